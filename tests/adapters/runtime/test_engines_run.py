"""Engine pools under ``deo run``, with stand-in engines as real processes and the real API:
scale-down sleeps an engine (its memory visibly freed, its process and port kept), scale-up wakes
it rather than starting one, ``max_asleep`` stops the rest, a wake that keeps failing gets the
engine replaced, and a ``kill -9`` of deo leaves sleeping engines that a restart adopts and asks
whether they sleep."""

from __future__ import annotations

import json
import os
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
from engine_standins import rss_bytes
from spawned import alive, kill_marked
from waiting import wait_for

from bench.ports import reserve_port_range

TOKEN = "engines-operator-token"
OPERATOR = {"Authorization": f"Bearer {TOKEN}"}
DEADLINE_S = 60.0
#: The stand-in's memory: what a sleep must visibly free (its RSS falls by most of it).
MEMORY_MIB = 64


class Deo:
    """``deo run`` over an engine pool of stand-ins, in its own directory."""

    def __init__(self, tmp_path: Path, marker: str, **pool: Any) -> None:
        self.dir = tmp_path
        self.marker = marker
        self.first_port = reserve_port_range(8).first
        settings = {
            "kind": '"engine"',
            "engine": '"vllm"',
            "ports": f"[{self.first_port}, {self.first_port + 7}]",
            "max_workers": 3,
            "max_asleep": 1,
            "drain_timeout_s": 1.0,
            "control_timeout_s": 5.0,
            "control_attempts": 2,
            "stop_timeout_s": 2.0,
            "stabilization_s": 0,
            "startup_s": 1.0,
        }
        settings.update(pool)
        startup_s = settings.pop("startup_s")
        # Tables of the pool's own (its source), written after its settings.
        tables = str(settings.pop("tables", ""))
        policy = str(settings.pop("policy", 'name = "static"\ncount = 2'))
        argv = [sys.executable, "-m", "deo_worker.engine_standin", "--port", "{port}"]
        argv += ["--host", "{host}"]  # filled in with 127.0.0.1 on deo's machine
        argv += ["--engine", "vllm", "--memory-mib", str(MEMORY_MIB), "--startup-s", str(startup_s)]
        lines = [f"{key} = {value}" for key, value in settings.items()]
        (tmp_path / "deo.toml").write_text(
            '[deo]\nlog = "run.jsonl"\ntick_interval_s = 0.2\n[api]\nport = 0\n'
            "[pools.gen]\n"
            f"argv = {json.dumps(argv)}\n"
            f'env = {{ TEST_DEO_MARKER = "{marker}" }}\n'
            + "\n".join(lines)
            + f"\n[pools.gen.policy]\n{policy}\n"
            + tables
        )
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = ""
        self.runs = 0

    def start(self) -> Deo:
        self.runs += 1
        out = self.dir / f"deo-{self.runs}.out"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "adapters.cli", "run", "--config", str(self.dir / "deo.toml")],
            cwd=self.dir,
            env={**os.environ, "DEO_TOKEN": TOKEN, "TEST_DEO_MARKER": self.marker},
            stdout=out.open("wb"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

        def api() -> str | None:
            assert self.proc is not None and self.proc.poll() is None, out.read_text()
            for line in out.read_text().splitlines():
                if "API on " in line:
                    return line.split("API on ", 1)[1].split()[0]
            return None

        self.url = wait_for("deo's API", api)
        return self

    def workers(self) -> dict[str, dict[str, Any]]:
        body = httpx.get(f"{self.url}/v1/workers", timeout=30).json()
        return {w["id"]: w for w in body["workers"]}

    def states(self) -> dict[str, str]:
        return {worker_id: w["state"] for worker_id, w in self.workers().items()}

    def post(self, path: str, body: dict[str, Any]) -> Any:
        answer = httpx.post(f"{self.url}{path}", json=body, headers=OPERATOR, timeout=30)
        assert answer.status_code == 200, answer.text
        return answer.json()

    def wait_states(self, wanted: dict[str, str]) -> dict[str, dict[str, Any]]:
        def reached() -> dict[str, dict[str, Any]] | None:
            workers = self.workers()
            states = {w: workers[w]["state"] if w in workers else "exited" for w in wanted}
            return workers if states == wanted else None

        return wait_for(f"states {wanted}", reached, retry_on=(httpx.HTTPError,))

    def records(self) -> list[dict[str, Any]]:
        lines = (self.dir / "run.jsonl").read_text().splitlines()
        return [json.loads(line) for line in lines if line.strip()]

    def events(self, kind: str) -> list[dict[str, Any]]:
        return [r["event"] for r in self.records() if r.get("event", {}).get("@") == kind]

    def commands(self, kind: str) -> list[dict[str, Any]]:
        found = []
        for record in self.records():
            for command in record.get("commands", []) or []:
                if isinstance(command, dict) and command.get("@") == kind:
                    found.append(command)
        return found

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def deo(tmp_path: Path) -> Iterator[Callable[..., Deo]]:
    marker = uuid.uuid4().hex
    made: list[Deo] = []

    def make(**pool: Any) -> Deo:
        made.append(Deo(tmp_path, marker, **pool))
        return made[-1]

    yield make
    for one in made:
        one.stop()
    kill_marked(marker)  # every engine this test started, whatever happened


def is_sleeping(port: int) -> bool:
    answer = httpx.get(f"http://127.0.0.1:{port}/is_sleeping", timeout=30).json()
    return bool(answer["is_sleeping"])


def test_scale_down_sleeps_scale_up_wakes_and_max_asleep_stops_the_rest(
    deo: Callable[..., Deo],
) -> None:
    run = deo(max_workers=3).start()
    run.post("/v1/pools/gen/pin", {"count": 3})
    workers = run.wait_states({"gen-0": "active", "gen-1": "active", "gen-2": "active"})
    env = Path(f"/proc/{workers['gen-2']['pid']}/environ").read_bytes().split(b"\0")
    assert b"VLLM_SERVER_DEV_MODE=1" in env
    ports = {w["port"] for w in workers.values()}
    assert ports == {run.first_port, run.first_port + 1, run.first_port + 2}
    sleeper = workers["gen-2"]
    awake_rss = rss_bytes(sleeper["pid"])

    # Down to 1: the newest sleeps, the next would be a second sleeper (max_asleep 1): it exits.
    run.post("/v1/pools/gen/pin", {"count": 1})
    workers = run.wait_states({"gen-0": "active", "gen-1": "exited", "gen-2": "sleeping"})
    assert workers["gen-2"]["pid"] == sleeper["pid"] and workers["gen-2"]["port"] == sleeper["port"]
    assert is_sleeping(sleeper["port"])
    asleep_rss = rss_bytes(sleeper["pid"])
    assert awake_rss - asleep_rss > MEMORY_MIB * 2**20 // 2, (awake_rss, asleep_rss)

    # Up to 2: the sleeper wakes (same process, same port); nothing new is started.
    spawned = len(run.commands("SpawnWorker"))
    started = time.monotonic()
    run.post("/v1/pools/gen/pin", {"count": 2})
    workers = run.wait_states({"gen-0": "active", "gen-2": "active"})
    wake_s = time.monotonic() - started
    assert workers["gen-2"]["pid"] == sleeper["pid"]
    assert not is_sleeping(sleeper["port"])
    assert rss_bytes(sleeper["pid"]) - asleep_rss > MEMORY_MIB * 2**20 // 2
    assert len(run.commands("SpawnWorker")) == spawned
    assert [c["worker_id"] for c in run.commands("WakeEngine")] == ["gen-2"]

    # Up to 3 with nobody asleep: a cold start, on the lowest free port (gen-1's, freed).
    started = time.monotonic()
    run.post("/v1/pools/gen/pin", {"count": 3})
    workers = run.wait_states({"gen-0": "active", "gen-2": "active", "gen-3": "active"})
    cold_s = time.monotonic() - started
    assert workers["gen-3"]["port"] == run.first_port + 1
    print(f"\nwake {wake_s:.2f}s vs cold start {cold_s:.2f}s (stand-in --startup-s 1)")


def test_a_wake_that_keeps_failing_gets_the_engine_replaced(deo: Callable[..., Deo]) -> None:
    # Generous call timeouts (a loaded machine must not fail the sleep): the wake fails because
    # the engine is told to refuse it.
    run = deo(control_timeout_s=30.0, control_attempts=2).start()
    workers = run.wait_states({"gen-0": "active", "gen-1": "active"})
    run.post("/v1/pools/gen/pin", {"count": 1})
    run.wait_states({"gen-0": "active", "gen-1": "sleeping"})
    failing = workers["gen-1"]
    told = httpx.post(
        f"http://127.0.0.1:{failing['port']}/standin/fail_next",
        json={"count": 2, "status": 503, "route": "/wake_up"},
        timeout=30,
    )
    assert told.status_code == 200, told.text
    run.post("/v1/pools/gen/pin", {"count": 2})
    # Two wake calls fail; then it is stopped and a new engine takes its place.
    run.wait_states({"gen-0": "active", "gen-1": "exited", "gen-2": "active"})
    failed = run.events("EngineWakeFailed")
    assert [f["worker_id"] for f in failed] == ["gen-1", "gen-1"]
    assert all("HTTP 503" in f["error"] for f in failed), failed
    assert [c["attempt"] for c in run.commands("WakeEngine")] == [1, 2]
    assert [c["alert"] for c in run.commands("RaiseAlert") if c["subject"] == "gen-1"] == [
        "engine_control"
    ]
    wait_for("gen-1's process to end", lambda: not alive(failing["pid"]))


def test_kill_9_of_deo_with_a_sleeping_engine_restart_adopts_it_asleep(
    deo: Callable[..., Deo],
) -> None:
    run = deo().start()
    run.wait_states({"gen-0": "active", "gen-1": "active"})
    run.post("/v1/pools/gen/pin", {"count": 1})
    before = run.wait_states({"gen-0": "active", "gen-1": "sleeping"})
    run.kill9()
    assert is_sleeping(before["gen-1"]["port"])  # deo's death touched no engine

    run.start()
    after = run.wait_states({"gen-0": "active", "gen-1": "sleeping"})
    assert after["gen-1"]["pid"] == before["gen-1"]["pid"]
    assert after["gen-0"]["pid"] == before["gen-0"]["pid"]
    # Asked, and confirmed: the log records the question and the engine's answer.
    wait_for("the sleeper's answer", lambda: run.events("EngineAsleep")[1:])
    assert [c["worker_id"] for c in run.commands("VerifyAsleep")] == ["gen-1"]
    assert len(run.commands("SpawnWorker")) == 2  # nothing new was started
    assert is_sleeping(after["gen-1"]["port"])

    # It still wakes when needed.
    run.post("/v1/pools/gen/pin", {"count": 2})
    run.wait_states({"gen-0": "active", "gen-1": "active"})


def test_the_operator_wakes_every_engine_then_resumes_the_policy(deo: Callable[..., Deo]) -> None:
    run = deo().start()
    run.wait_states({"gen-0": "active", "gen-1": "active"})
    run.post("/v1/pools/gen/pin", {"count": 1})
    run.wait_states({"gen-0": "active", "gen-1": "sleeping"})
    answer = run.post("/v1/pools/gen/wake", {"hold_s": None})
    assert "woke every engine" in json.dumps(answer)
    run.wait_states({"gen-0": "active", "gen-1": "active"})
    status = httpx.get(f"{run.url}/global-status", timeout=30).json()
    assert "gen" in json.dumps(status)
    run.post("/v1/resume", {"pool": "gen"})
    assert any("wake hold ended" in c["reason"] for c in run.commands("ScalePool"))
    assert run.states() == {"gen-0": "active", "gen-1": "active"}  # the policy decides from 2
    bad = httpx.post(
        f"{run.url}/v1/pools/gen/wake", json={"hold_s": "soon"}, headers=OPERATOR, timeout=30
    )
    assert bad.status_code == 400 and "hold_s" in bad.text
    anonymous = httpx.post(f"{run.url}/v1/pools/gen/wake", json={}, timeout=30)
    assert anonymous.status_code == 401

    # The same from the command line, held for a time this time.
    cli = [sys.executable, "-m", "adapters.cli", "wake", "gen", "600", "--url", run.url]
    done = subprocess.run(
        cli, env={**os.environ, "DEO_TOKEN": TOKEN}, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert "held for 600s" in done.stdout
    hold = run.events("EnginesWakeRequested")[-1]
    assert hold["hold_s"] == 600.0


def test_active_engines_are_seen_through_their_health_and_a_wedged_one_is_replaced(
    deo: Callable[..., Deo],
) -> None:
    run = deo(heartbeat_grace_s=6.0).start()
    workers = run.wait_states({"gen-0": "active", "gen-1": "active"})
    os.kill(workers["gen-1"]["pid"], signal.SIGSTOP)  # alive, answering nothing
    # gen-1 is judged hung once the grace passes; gen-0, as long active, answers and stays.
    after = run.wait_states({"gen-0": "active", "gen-1": "exited", "gen-2": "active"})
    assert after["gen-0"]["pid"] == workers["gen-0"]["pid"]
    stops = [c for c in run.commands("TerminateWorker") if c["worker_id"] == "gen-1"]
    assert stops and "hung" in stops[0]["reason"], stops
    assert not [c for c in run.commands("TerminateWorker") if c["worker_id"] == "gen-0"]
    assert any("gen-0" in e["worker_ids"] for e in run.events("WorkersSeen"))
