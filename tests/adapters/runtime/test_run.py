"""``deo run`` end to end: the real program, real worker processes, real signals, the real API.

Each test starts ``deo run`` as a process of its own (so it can be SIGKILLed like a crashed
orchestrator), drives it over HTTP, watches /proc, and ends by checking that ``tools/replay``
verifies the log it wrote. Every worker carries a marker in its environment so that cleanup finds
and kills whatever a failed test leaves behind.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import free_port
from spawned import alive, kill_marked, marked_processes
from waiting import wait_for

from adapters.run import steady_wall_clock

ROOT = Path(__file__).resolve().parents[3]
TOKEN = "test-operator-token"

WELL_BEHAVED = ROOT / "examples" / "worker.py"
CRASHER = "import sys; sys.exit(3)"
STUBBORN = """
import os, signal, subprocess, sys, time
for s in (signal.SIGUSR1, signal.SIGTERM):
    signal.signal(s, signal.SIG_IGN)
IGNORE = ("import signal, time\\n"
          "for s in (signal.SIGUSR1, signal.SIGTERM): signal.signal(s, signal.SIG_IGN)")
child = subprocess.Popen([sys.executable, "-c", IGNORE + "\\ntime.sleep(600)"])
print("child", child.pid, flush=True)
while True:
    time.sleep(1)
"""
SILENT = "import time; time.sleep(600)"

#: Events only an operator's request (or deo's own start) puts in the log.
OPERATOR_EVENTS = frozenset(
    {
        "Configured",
        "AutoscalingPaused",
        "AutoscalingResumed",
        "PoolPinned",
        "DrainRequested",
        "GpuCordonRequested",
        "GpuUncordonRequested",
    }
)


class Deo:
    """One ``deo run`` process with its config, log and API."""

    def __init__(self, tmp_path: Path, pools: str) -> None:
        self.dir = tmp_path
        self.marker = uuid.uuid4().hex
        self.config = tmp_path / "deo.toml"
        self.log = tmp_path / "run.jsonl"
        self.config.write_text(
            f'[deo]\nlog = "run.jsonl"\ntick_interval_s = 0.2\n[api]\nport = 0\n{pools}'.replace(
                "@MARK@", self.marker
            )
        )
        self.process: subprocess.Popen[bytes] | None = None
        self.url = ""
        self.outputs: list[Path] = []

    def argv(self) -> list[str]:
        return [sys.executable, "-m", "adapters.cli", "run", "--config", str(self.config)]

    def start(self) -> None:
        out = self.dir / f"deo-{len(self.outputs)}.out"
        self.outputs.append(out)
        self.process = subprocess.Popen(
            self.argv(),
            cwd=self.dir,
            env={**os.environ, "DEO_TOKEN": TOKEN},
            stdout=out.open("wb"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        found = wait_for("the API", lambda: re.search(r"API on (http://\S+)", out.read_text()))
        self.url = found.group(1)

    def run_to_end(self) -> subprocess.CompletedProcess[str]:
        """Another ``deo run`` on the same config, expected to exit by itself (a refused start)."""
        return subprocess.run(
            self.argv(),
            cwd=self.dir,
            env={**os.environ, "DEO_TOKEN": TOKEN},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=60,
        )

    def output(self) -> str:
        return "".join(p.read_text() for p in self.outputs)

    def status(self) -> dict[str, Any]:
        body: dict[str, Any] = httpx.get(f"{self.url}/global-status", timeout=30).json()
        return body

    def workers(self, *states: str) -> list[dict[str, Any]]:
        body = httpx.get(f"{self.url}/v1/workers", timeout=30).json()
        return [w for w in body["workers"] if not states or w["state"] in states]

    def post(self, path: str, body: dict[str, Any] | None = None) -> httpx.Response:
        return httpx.post(
            f"{self.url}{path}",
            json=body or {},
            headers={"Authorization": f"Bearer {TOKEN}"},
            timeout=30,
        )

    def records(self) -> list[dict[str, Any]]:
        """The log's complete records, header first (deo may be writing the last one)."""
        raw = self.log.read_bytes()
        return [json.loads(line) for line in raw[: raw.rfind(b"\n") + 1].splitlines()]

    def last_seq(self) -> int:
        """The sequence number of the last complete record in the log."""
        return max(r.get("seq", 0) for r in self.records())

    def events(self, kind: str) -> list[dict[str, Any]]:
        """The logged events of type ``kind``, oldest first."""
        return [
            r["event"] for r in self.records() if r["kind"] == "event" and r["event"]["@"] == kind
        ]

    def commands(self, kind: str) -> list[tuple[float, dict[str, Any]]]:
        """The logged commands of type ``kind``, each with its cause event's t, oldest first."""
        records = self.records()  # once: deo appends while we read
        times = {r["seq"]: r["event"]["t"] for r in records if r["kind"] == "event"}
        return [
            (times[r["cause"]], command)
            for r in records
            if r["kind"] == "commands"
            for command in r["commands"]
            if command["@"] == kind
        ]

    def worker_log(self, worker: dict[str, Any]) -> Path:
        """Where deo writes ``worker``'s output."""
        return self.dir / "deo-workers" / f"{worker['id']}.log"

    def set_up(self) -> None:
        """Wait until every active worker has installed its signal handlers, which it says as it
        starts ("started": examples/worker.py; "child N": the stubborn script). A worker
        signalled while Python is still starting it dies of the signal's default action."""

        def said(worker: dict[str, Any]) -> bool:
            text = self.worker_log(worker).read_text()
            return "started" in text or "child " in text

        wait_for(
            "every worker set up",
            lambda: all(said(w) for w in self.workers("active")),
            retry_on=(FileNotFoundError,),
        )

    def logged_child(self, worker: dict[str, Any]) -> int:
        """The pid ``worker`` printed as ``child N`` in its output, once it has printed it."""
        log = self.worker_log(worker)
        found = wait_for("its child", lambda: re.search(r"child (\d+)", log.read_text()))
        return int(found.group(1))

    def kill9(self) -> None:
        assert self.process is not None
        self.process.kill()
        self.process.wait(timeout=10)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            self.process.wait(timeout=60)

    def replay(self) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, str(ROOT / "tools" / "replay"), "-q", str(self.log)],
            capture_output=True,
            text=True,
            timeout=120,
        )

    def cleanup(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)
        kill_marked(self.marker)


@pytest.fixture
def deo(tmp_path: Path) -> Iterator[Callable[[str], Deo]]:
    made: list[Deo] = []

    def make(pools: str) -> Deo:
        instance = Deo(tmp_path, pools)
        made.append(instance)
        return instance

    yield make
    for instance in made:
        instance.cleanup()


def pool(name: str, argv: list[str], **fields: Any) -> str:
    lines = [
        f"[pools.{name}]",
        f"argv = {argv!r}".replace("'", '"'),
        'env = { TEST_DEO_MARKER = "@MARK@" }',
    ]
    policy = fields.pop("policy", 'name = "static"\ncount = 1')
    lines += [f"{k} = {v!r}".replace("'", '"') for k, v in fields.items()]
    lines += [f"[pools.{name}.policy]", policy]
    return "\n".join(lines) + "\n"


def script(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def caused_by_requests(records: list[dict[str, Any]], after_seq: int) -> list[dict[str, Any]]:
    """The records after ``after_seq`` that an operator's request produces: its event, the
    refusal of it, the commands it caused. Ticks, heartbeats and samples may come and go."""
    by_seq = {r["seq"]: r for r in records if "seq" in r}

    def from_request(seq: int) -> bool:
        record = by_seq[seq]
        return record["kind"] == "event" and record["event"]["@"] in OPERATOR_EVENTS

    return [
        r
        for r in records
        if r.get("seq", 0) > after_seq
        and (from_request(r["cause"]) if "cause" in r else from_request(r["seq"]))
    ]


def verified(instance: Deo) -> None:
    instance.stop()
    proc = instance.replay()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "verified:" in proc.stdout


# --- scenarios ---------------------------------------------------------------------------------


def test_scales_up_and_down_on_pushed_pressure(deo: Callable[[str], Deo]) -> None:
    hpa = 'name = "hpa"\ntarget_per_worker = 4.0\nscale_down_stabilization_s = 0.0'
    d = deo(
        pool(
            "envs",
            [sys.executable, str(WELL_BEHAVED), "0.2"],
            min_workers=1,
            max_workers=4,
            stabilization_s=1.0,
            policy=hpa,
        )
    )
    d.start()
    wait_for("one worker", lambda: len(d.workers("active")) == 1)
    response = d.post("/v1/pools/envs/pressure", {"in_flight_requests": 14})
    assert response.status_code == 200, response.text
    wait_for("four workers", lambda: len(d.workers("active")) == 4)
    pids = [w["pid"] for w in d.workers()]
    assert all(alive(pid) for pid in pids)
    d.set_up()

    def no_pressure() -> bool:
        # Pushed again on every poll, as a poller would: deo holds the scale-down until its
        # stabilization window has passed, however long that takes on this machine.
        assert d.post("/v1/pools/envs/pressure", {"in_flight_requests": 0}).status_code == 200
        return len(d.workers()) == 1

    wait_for("back to one worker", no_pressure)
    scalings = d.commands("ScalePool")
    [up_t] = [t for t, c in scalings if c["previous"] == 1 and c["target"] == 4]
    downs = [t for t, c in scalings if c["target"] < c["previous"]]
    assert downs and all(t >= up_t + 1.0 for t in downs), scalings  # after the stabilization
    gone = [pid for pid in pids if not alive(pid)]
    assert len(gone) == 3  # drained workers exited on SIGUSR1
    assert "drained" in "".join(p.read_text() for p in (d.dir / "deo-workers").glob("*.log"))
    verified(d)


def test_a_killed_worker_is_replaced(deo: Callable[[str], Deo]) -> None:
    d = deo(pool("envs", [sys.executable, str(WELL_BEHAVED), "0.2"], min_workers=1, max_workers=2))
    d.start()
    [first] = wait_for("a worker", lambda: d.workers("active"))
    os.kill(first["pid"], signal.SIGKILL)
    [second] = wait_for(
        "a replacement", lambda: [w for w in d.workers("active") if w["id"] != first["id"]]
    )
    assert second["pid"] != first["pid"] and alive(second["pid"])
    assert f'"worker_id":"{first["id"]}","exit_code":null,"signal":9' in d.log.read_text()
    verified(d)


def test_a_crash_loop_backs_off_and_alerts_without_a_spawn_storm(
    deo: Callable[[str], Deo], tmp_path: Path
) -> None:
    crasher = script(tmp_path, "crash.py", CRASHER)
    policy = 'name = "static"\ncount = 1'
    d = deo(
        pool("envs", [sys.executable, crasher], min_workers=1, max_workers=1, policy=policy)
        + "[pools.envs.crash_loop]\nbackoff_base_s = 0.5\nbackoff_cap_s = 4.0\nalert_after = 3\n"
    )
    d.start()
    wait_for(
        "the crash_loop alert",
        lambda: {"alert": "crash_loop", "subject": "envs"} in d.status()["alerts"],
    )
    wait_for("a fourth failure", lambda: d.status()["pools"]["envs"]["failures"] >= 4)
    d.stop()
    exits = [e["t"] for e in d.events("WorkerExited")]
    spawns = [t for t, _ in d.commands("SpawnWorker")]
    assert len(exits) >= 4
    # One spawn per failure (and the first): no spawn storm. Each respawn waits out its backoff,
    # 0.5, 1, 2, 4, 4 ... s after the failure by deo's clock, however slow this machine is.
    assert len(spawns) <= len(exits) + 1, (spawns, exits)
    for n, (exit_t, respawn_t) in enumerate(zip(exits, spawns[1:], strict=False), start=1):
        assert respawn_t >= exit_t + min(4.0, 0.5 * 2 ** (n - 1)), (n, exits, spawns)
    verified(d)


def test_a_worker_ignoring_the_drain_is_terminated_then_killed_with_its_group(
    deo: Callable[[str], Deo], tmp_path: Path
) -> None:
    stubborn = script(tmp_path, "stubborn.py", STUBBORN)
    d = deo(
        pool(
            "envs",
            [sys.executable, stubborn],
            min_workers=0,
            max_workers=1,
            drain_timeout_s=1.0,
            stop_timeout_s=1.0,
        )
    )
    d.start()
    [worker] = wait_for("the worker", lambda: d.workers("active"))
    child = d.logged_child(worker)
    assert alive(child)
    assert d.post("/v1/pools/envs/pin", {"count": 0}).status_code == 200
    wait_for("the worker gone", lambda: not alive(worker["pid"]))
    wait_for("its child gone", lambda: not alive(child))
    [(drain_t, _)] = d.commands("DrainWorker")
    [(terminate_t, _)] = d.commands("TerminateWorker")
    [(kill_t, _)] = d.commands("KillWorker")
    # Drain 1 s, then SIGTERM, 1 s, then SIGKILL: by deo's clock, in that order.
    assert terminate_t - drain_t >= 1.0, (drain_t, terminate_t)
    assert kill_t - terminate_t >= 1.0, (terminate_t, kill_t)
    verified(d)


def test_an_orchestrator_killed_during_a_drain_adopts_its_workers_on_restart(
    deo: Callable[[str], Deo], tmp_path: Path
) -> None:
    stubborn = script(tmp_path, "stubborn.py", STUBBORN)
    slow = [sys.executable, str(WELL_BEHAVED), "0.2"]
    d = deo(
        pool("envs", slow, min_workers=1, max_workers=3, policy='name = "static"\ncount = 2')
        + pool(
            "stubborn",
            [sys.executable, stubborn],
            min_workers=0,
            max_workers=1,
            drain_timeout_s=3.0,
            stop_timeout_s=1.0,
        )
    )
    d.start()
    wait_for("three workers", lambda: len(d.workers("active")) == 3)
    d.set_up()
    before = {w["id"]: w["pid"] for w in d.workers()}
    assert d.post("/v1/pools/stubborn/pin", {"count": 0}).status_code == 200
    wait_for("the drain", lambda: d.workers("draining"))
    d.kill9()  # the orchestrator dies mid-drain
    assert all(alive(pid) for pid in before.values())  # its death killed no work
    d.start()
    wait_for("the adoption", lambda: "WorkerAdopted" in d.log.read_text())
    stubborn_pid = before["stubborn-0"]
    wait_for("the drain completed", lambda: not alive(stubborn_pid))
    wait_for("its exit seen", lambda: all(w["id"] != "stubborn-0" for w in d.workers()))
    after = {w["id"]: w["pid"] for w in d.workers()}
    assert after == {k: v for k, v in before.items() if k != "stubborn-0"}  # adopted, no duplicate
    assert len(marked_processes(d.marker)) == 2  # no orphan: the two envs workers only
    verified(d)


TOUCHING = """\
import os, pathlib, time
beat = pathlib.Path(os.environ["DEO_HEARTBEAT_FILE"])
while True:
    beat.touch()
    time.sleep(0.2)
"""


def test_an_adopted_worker_keeps_its_heartbeat_file_when_worker_logs_moves(
    deo: Callable[[str], Deo], tmp_path: Path
) -> None:
    touching = script(tmp_path, "touching.py", TOUCHING)
    envs = pool("envs", [sys.executable, touching], max_workers=1, heartbeat_grace_s=2.0)
    d = deo(envs)
    first_port, second_port = two_free_ports()
    text = d.config.read_text().replace("[deo]\n", '[deo]\nworker_logs = "wl"\n')
    d.config.write_text(text.replace("port = 0", f"port = {first_port}"))
    d.start()
    [worker] = wait_for("a worker", lambda: d.workers("active"))
    wait_for("its heartbeat", lambda: (tmp_path / "wl" / f"{worker['id']}.heartbeat").exists())
    d.stop()  # the worker lives on, touching wl/
    text = d.config.read_text().replace('worker_logs = "wl"', 'worker_logs = "wl2"')
    d.config.write_text(text.replace(f"port = {first_port}", f"port = {second_port}"))
    d.start()
    wait_for("the adoption", lambda: "WorkerAdopted" in d.log.read_text())
    adopted_t = max(e["t"] for e in events(d.log, "WorkerAdopted"))
    # deo's own clock passes three grace periods (no fixed sleep): the worker is still the one
    # adopted, not replaced as hung.
    wait_for(
        "3 grace periods",
        lambda: max((e["t"] for e in events(d.log, "Tick")), default=0) > adopted_t + 6,
    )
    assert [w["pid"] for w in d.workers("active")] == [worker["pid"]]
    assert "hung" not in d.log.read_text()
    # Its API address is the earlier run's, and deo now listens on another: deo says so.
    assert (
        f"was given DEO_API_URL=http://127.0.0.1:{first_port} by an earlier run; deo now listens "
        f"on http://127.0.0.1:{second_port}"
    ) in d.output()
    verified(d)


def two_free_ports() -> tuple[int, int]:
    first = free_port()
    second = free_port()
    while second == first:
        second = free_port()
    return first, second


def events(log: Path, name: str) -> list[dict[str, Any]]:
    """The events called ``name`` the log records."""
    found = []
    for line in log.read_bytes().splitlines():
        record = json.loads(line)
        if record.get("kind") == "event" and record["event"]["@"] == name:
            found.append(record["event"])
    return found


def test_a_silent_worker_is_replaced_after_its_grace_period(
    deo: Callable[[str], Deo], tmp_path: Path
) -> None:
    silent = script(tmp_path, "silent.py", SILENT)
    d = deo(
        pool(
            "envs",
            [sys.executable, silent],
            min_workers=1,
            max_workers=1,
            heartbeat_grace_s=1.0,
            stop_timeout_s=1.0,
        )
    )
    d.start()
    [first] = wait_for("a worker", lambda: d.workers("active"))
    wait_for(
        "its replacement",
        lambda: [w for w in d.workers("active", "starting") if w["id"] != first["id"]],
    )
    wait_for("the silent worker gone", lambda: not alive(first["pid"]))
    assert "hung" in d.log.read_text()
    verified(d)


def test_workers_that_never_report_ready_back_off_and_alert_naming_the_start_timeout(
    deo: Callable[[str], Deo], tmp_path: Path
) -> None:
    # A model that takes longer to load than start_timeout_s: real processes that never say
    # they are ready. Each is stopped at the timeout as a failed start of its slot.
    silent = script(tmp_path, "silent.py", SILENT)
    envs = pool(
        "envs",
        [sys.executable, silent],
        min_workers=1,
        max_workers=1,
        start_timeout_s=1.0,
        stop_timeout_s=1.0,
    ).replace("[pools.envs]\n", "[pools.envs]\nrequire_ready = true\n", 1)
    d = deo(
        envs
        + "[pools.envs.crash_loop]\nbackoff_base_s = 0.5\nbackoff_cap_s = 4.0\nalert_after = 3\n"
    )
    d.start()
    wait_for(
        "the crash_loop alert",
        lambda: {"alert": "crash_loop", "subject": "envs"} in d.status()["alerts"],
    )
    d.stop()
    [raised] = [c for _, c in d.commands("RaiseAlert") if c["alert"] == "crash_loop"]
    assert "not ready 1s after starting (raise start_timeout_s" in raised["reason"]
    stops = [t for t, c in d.commands("TerminateWorker") if "not ready" in c["reason"]]
    spawns = [t for t, _ in d.commands("SpawnWorker")]
    assert len(stops) >= 3
    # Each replacement waits out its slot's backoff after the stop: 0.5, 1, 2 ... s.
    for n, (stop_t, respawn_t) in enumerate(zip(stops, spawns[1:], strict=False), start=1):
        assert respawn_t >= stop_t + min(4.0, 0.5 * 2 ** (n - 1)), (n, stops, spawns)
    verified(d)


def test_bad_and_unauthorized_requests_change_nothing(deo: Callable[[str], Deo]) -> None:
    d = deo(pool("envs", [sys.executable, str(WELL_BEHAVED), "0.2"], min_workers=1, max_workers=2))
    d.start()
    wait_for("a worker", lambda: d.workers("active"))
    before = d.last_seq()
    url = f"{d.url}/v1/pools/envs/pin"
    assert httpx.post(url, json={"count": 2}).status_code == 401
    assert (
        httpx.post(url, json={"count": 2}, headers={"Authorization": "Bearer no"}).status_code
        == 403
    )
    bearer = {"Authorization": f"Bearer {TOKEN}"}
    assert httpx.post(url, content=b"{not json", headers=bearer).status_code == 400
    assert httpx.post(url, json={"count": "two"}, headers=bearer).status_code == 422
    assert httpx.post(url, content=b"x" * 100_000, headers=bearer).status_code == 413
    # The runner handles events in order: once an accepted action is answered, whatever the bad
    # requests could have queued before it is in the log.
    assert d.post("/v1/pause").status_code == 200
    records = d.records()
    [pause] = [r["seq"] for r in records if r.get("event", {}).get("@") == "AutoscalingPaused"]
    assert [r for r in caused_by_requests(records, before) if r["seq"] < pause] == []
    verified(d)


def test_status_and_stop_drain_from_the_command_line(deo: Callable[[str], Deo]) -> None:
    d = deo(
        pool(
            "envs",
            [sys.executable, str(WELL_BEHAVED), "0.2"],
            min_workers=2,
            max_workers=2,
            policy='name = "static"\ncount = 2',
        )
    )
    d.start()
    wait_for("two workers", lambda: len(d.workers("active")) == 2)
    pids = [w["pid"] for w in d.workers()]
    cli = [sys.executable, "-m", "adapters.cli"]
    status = subprocess.run(
        [*cli, "status", "--url", d.url], capture_output=True, text=True, timeout=30
    )
    assert status.returncode == 0, status.stderr
    assert re.search(r"^envs\s+2\s+2\s+2 active$", status.stdout, re.M), status.stdout
    stop = subprocess.run(
        [*cli, "stop", "--drain", "--url", d.url],
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, "DEO_TOKEN": TOKEN},
    )
    assert stop.returncode == 0, stop.stderr
    assert d.process is not None
    assert d.process.wait(timeout=30) == 0
    assert not any(alive(pid) for pid in pids)  # drained, not abandoned
    assert "0 worker(s) left running" in d.output()
    verified(d)


def test_a_configuration_the_core_refuses_stops_deo_with_the_reason(
    deo: Callable[[str], Deo],
) -> None:
    d = deo(
        pool(
            "envs",
            [sys.executable, str(WELL_BEHAVED), "0.2"],
            min_workers=1,
            max_workers=1,
            gpus_per_worker=1,
        )
    )
    d.config.write_text(d.config.read_text().replace("[deo]\n", '[deo]\ngpus = ["0"]\n'))
    d.start()
    [worker] = wait_for("a worker on GPU 0", lambda: d.workers("active"))
    assert worker["gpus"] == ["0"]
    d.stop()  # the worker keeps GPU 0
    d.config.write_text(d.config.read_text().replace('gpus = ["0"]', 'gpus = ["1"]'))
    proc = d.run_to_end()
    assert proc.returncode == 2
    assert "the configuration was refused" in proc.stdout
    assert "GPU '0' is held by worker envs-0" in proc.stdout
    assert alive(worker["pid"])  # refusing a configuration touches no worker
    verified(d)


def test_workers_get_the_runtime_variables_but_never_the_operator_token(
    deo: Callable[[str], Deo],
) -> None:
    d = deo(
        pool(
            "envs",
            [sys.executable, str(WELL_BEHAVED), "0.2"],
            min_workers=1,
            max_workers=1,
            heartbeat_grace_s=30.0,
        )
    )
    d.start()
    [worker] = wait_for("a worker", lambda: d.workers("active"))
    raw = Path(f"/proc/{worker['pid']}/environ").read_bytes().split(b"\0")
    env = dict(item.decode().split("=", 1) for item in raw if b"=" in item)
    assert "DEO_TOKEN" not in env  # a worker holding it could act as the operator
    assert env["DEO_API_URL"] == d.url and env["DEO_RUN_ID"] and env["DEO_WORKER_ID"] == "envs-0"
    beat = f"{d.url}/v1/workers/envs-0/heartbeat"
    bearer = {"Authorization": f"Bearer {env['DEO_WORKER_TOKEN']}"}
    assert httpx.post(beat, headers=bearer).status_code == 200
    d.stop()
    d.start()  # a restart adopts the worker; its token must still be accepted
    wait_for("the adoption", lambda: "WorkerAdopted" in d.log.read_text())
    assert httpx.post(f"{d.url}/v1/workers/envs-0/heartbeat", headers=bearer).status_code == 200
    verified(d)


def test_a_second_deo_on_the_same_log_is_refused(deo: Callable[[str], Deo]) -> None:
    d = deo(pool("envs", [sys.executable, str(WELL_BEHAVED), "0.2"], min_workers=1, max_workers=1))
    d.start()
    wait_for("a worker", lambda: d.workers("active"))
    before = d.log.read_bytes()
    before_seq = d.last_seq()
    second = d.run_to_end()
    assert second.returncode == 2
    assert "in use by another deo" in second.stdout
    assert len(d.workers()) == 1  # nothing adopted or spawned twice
    assert d.log.read_bytes().startswith(before)
    records = d.records()
    # One writer: one header and one unbroken numbering; the second deo logged no start of its
    # own (Configured, adoptions). The first one's ticks and heartbeats may come and go.
    assert [r["kind"] for r in records].count("header") == 1
    assert [r["seq"] for r in records[1:]] == list(range(1, len(records)))
    assert caused_by_requests(records, before_seq) == []
    assert [
        r
        for r in records
        if r.get("seq", 0) > before_seq
        and r["kind"] == "event"
        and r["event"]["@"] in {"WorkerAdopted", "WorkerLost", "WorkerStarted"}
    ] == []
    verified(d)


def test_deos_clock_goes_on_through_a_step_back_of_the_system_clock(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # An NTP step or a restored VM moves the wall clock; deo's deadlines (grace, drain,
    # backoff) must not wait for it to come back.
    clock = steady_wall_clock()
    before = clock()
    assert abs(before - time.time()) < 5.0  # wall time: the log means the same across restarts
    stepped = time.time() - 3600.0
    monkeypatch.setattr(time, "time", lambda: stepped)
    after = clock()
    assert before <= after < before + 60.0
