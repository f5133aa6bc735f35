"""GPU health end to end: ``deo run`` as a real process reading GPU health from a readings file.

``[nvml] backend = "file"`` stands in for NVML: each test rewrites the file (atomically) the way
a GPU would change, and watches what deo does about it through its API, the worker processes in
/proc and its log, which ``tools/replay`` must verify at the end. Three GPUs, a pool of two
workers with one GPU each: one GPU is always free.
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
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from spawned import alive, kill_marked
from waiting import wait_for

ROOT = Path(__file__).resolve().parents[3]
TOKEN = "test-operator-token"
WORKER = ROOT / "examples" / "worker.py"
GIB = 2**30
UNCORDON_AFTER_S = 1.0

HEALTHY: dict[str, Any] = {
    "memory_used_bytes": 1 * GIB,
    "memory_total_bytes": 80 * GIB,
    "temperature_c": 45,
    "throttle_reasons": [],
    "errors_total": 0,
}


class Deo:
    """One ``deo run`` with three GPUs whose health comes from ``gpus.json``."""

    def __init__(self, tmp_path: Path, visible: str | None = None) -> None:
        #: deo's own CUDA_VISIBLE_DEVICES (None: unset); the readings file is keyed by device ids.
        self.visible = visible
        self.dir = tmp_path
        self.marker = uuid.uuid4().hex
        self.log = tmp_path / "run.jsonl"
        self.readings_file = tmp_path / "gpus.json"
        self.readings: dict[str, dict[str, Any]] = {g: dict(HEALTHY) for g in ("0", "1", "2")}
        self.write_readings()
        argv = json.dumps([sys.executable, str(WORKER), "0.1"])
        self.config = tmp_path / "deo.toml"
        self.config.write_text(
            f"""
[deo]
log = "run.jsonl"
tick_interval_s = 0.2
gpus = ["0", "1", "2"]
[api]
port = 0
[nvml]
backend = "file"
file = "gpus.json"
interval_s = 0.2
keepalive_s = 1.0
[cordon]
uncordon_after_s = {UNCORDON_AFTER_S}
[pools.envs]
argv = {argv}
env = {{ TEST_DEO_MARKER = "{self.marker}" }}
min_workers = 0
max_workers = 2
gpus_per_worker = 1
drain_timeout_s = 5.0
stop_timeout_s = 1.0
[pools.envs.policy]
name = "static"
count = 2
"""
        )
        self.output = tmp_path / "deo.out"
        self.process: subprocess.Popen[bytes] | None = None
        self.url = ""

    def write_readings(self) -> None:
        """Replace the readings file atomically: a poll never sees half of it."""
        partial = self.readings_file.with_suffix(".partial")
        partial.write_text(json.dumps(self.readings))
        os.replace(partial, self.readings_file)

    def set_gpu(self, gpu: str, **fields: Any) -> None:
        self.readings[gpu] = {**HEALTHY, **fields}
        self.write_readings()

    def start(self) -> None:
        # NVML ids ignore CUDA_VISIBLE_DEVICES, deo's do not: run deo without one.
        env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
        if self.visible is not None:
            env["CUDA_VISIBLE_DEVICES"] = self.visible
        self.process = subprocess.Popen(
            [sys.executable, "-m", "adapters.cli", "run", "--config", str(self.config)],
            cwd=self.dir,
            env={**env, "DEO_TOKEN": TOKEN},
            stdout=self.output.open("wb"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        found = wait_for("the API", lambda: re.search(r"API on (http://\S+)", self.text()))
        self.url = found.group(1)

    def text(self) -> str:
        return self.output.read_text()

    def workers(self, *states: str) -> list[dict[str, Any]]:
        body = httpx.get(f"{self.url}/v1/workers", timeout=5).json()
        return [w for w in body["workers"] if not states or w["state"] in states]

    def gpus(self) -> dict[str, dict[str, Any]]:
        body = httpx.get(f"{self.url}/global-status", timeout=5).json()
        return {g["id"]: g for g in body["gpus"]}

    def alerts(self) -> list[dict[str, str]]:
        alerts: list[dict[str, str]] = httpx.get(f"{self.url}/global-status", timeout=5).json()[
            "alerts"
        ]
        return alerts

    def two_active(self) -> tuple[dict[str, Any], dict[str, Any], str]:
        """The two workers once active, and the GPU neither holds."""
        first, second = wait_for(
            "two active workers",
            lambda: len(self.workers("active")) == 2 and self.workers("active"),
        )
        [free] = {"0", "1", "2"} - {*first["gpus"], *second["gpus"]}
        return first, second, free

    def records(self) -> list[dict[str, Any]]:
        """The log's complete records so far (deo may be writing the last one)."""
        raw = self.log.read_bytes()
        return [json.loads(line) for line in raw[: raw.rfind(b"\n") + 1].splitlines()]

    def commands(self, kind: str, **fields: Any) -> list[tuple[float, dict[str, Any]]]:
        """Commands of type ``kind`` with these field values, each with its cause event's t."""
        records = self.records()  # once: deo appends while we read
        times = {r["seq"]: r["event"]["t"] for r in records if r["kind"] == "event"}
        found = []
        for record in records:
            if record["kind"] != "commands":
                continue
            for command in record["commands"]:
                if command["@"] == kind and all(command.get(k) == v for k, v in fields.items()):
                    found.append((times[record["cause"]], command))
        return found

    def samples(self, gpu: str) -> list[dict[str, Any]]:
        return [
            r["event"]
            for r in self.records()
            if r["kind"] == "event"
            and r["event"]["@"] == "GpuSampled"
            and r["event"]["gpu_id"] == gpu
        ]

    def post(self, path: str, body: dict[str, Any] | None = None) -> httpx.Response:
        return httpx.post(
            f"{self.url}{path}",
            json=body or {},
            headers={"Authorization": f"Bearer {TOKEN}"},
            timeout=10,
        )

    def verified(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGTERM)
        self.process.wait(timeout=20)
        proc = subprocess.run(
            [sys.executable, str(ROOT / "tools" / "replay"), "-q", str(self.log)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "verified:" in proc.stdout

    def cleanup(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)
        kill_marked(self.marker)


@pytest.fixture
def deo(tmp_path: Path) -> Iterator[Deo]:
    instance = Deo(tmp_path)
    instance.start()
    yield instance
    instance.cleanup()


def environ(pid: int) -> dict[str, str]:
    """The environment process ``pid`` was started with."""
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


def visible_devices(pid: int) -> str:
    return environ(pid)["CUDA_VISIBLE_DEVICES"]


# --- scenarios -----------------------------------------------------------------------------------


def test_a_throttled_gpu_is_cordoned_and_a_replacement_goes_to_a_free_gpu(deo: Deo) -> None:
    first, second, free = deo.two_active()
    [hot] = first["gpus"]
    assert visible_devices(first["pid"]) == hot  # the worker is told its GPU
    deo.set_gpu(hot, temperature_c=87, throttle_reasons=["thermal"])
    [(_, cordon)] = wait_for("the cordon", lambda: deo.commands("CordonGpu", gpu_id=hot))
    assert cordon["causes"] == ["thermal"]
    assert "throttled (thermal)" in cordon["reason"]
    assert deo.gpus()[hot]["causes"] == ["thermal"]
    # Throttling is transient: the core leaves running work where it is ...
    assert not deo.commands("DrainWorker", worker_id=first["id"])
    assert alive(first["pid"])
    assert {"id": first["id"], "state": "active", "gpus": [hot]}.items() <= next(
        w for w in deo.workers() if w["id"] == first["id"]
    ).items()
    # ... but places nothing new there: the crashed worker's replacement takes the free GPU.
    os.kill(first["pid"], signal.SIGKILL)
    [new] = wait_for(
        "the replacement",
        lambda: [w for w in deo.workers("active") if w["id"] not in (first["id"], second["id"])],
    )
    assert new["gpus"] == [free]
    assert visible_devices(new["pid"]) == free
    assert [spawn["gpus"] for _, spawn in deo.commands("SpawnWorker")][-1] == [free]
    assert deo.gpus()[hot]["cordoned"] and not deo.gpus()[hot]["workers"]
    deo.verified()


def test_xid_errors_drain_the_worker_on_that_gpu_and_keep_it_cordoned(deo: Deo) -> None:
    first, second, free = deo.two_active()
    [bad] = first["gpus"]
    deo.set_gpu(bad, errors_total=1)
    [(_, cordon)] = wait_for("the cordon", lambda: deo.commands("CordonGpu", gpu_id=bad))
    assert cordon["causes"] == ["errors"] and "1 new XID/ECC error(s)" in cordon["reason"]
    wait_for("the drain", lambda: deo.commands("DrainWorker", worker_id=first["id"]))
    wait_for("the drained worker gone", lambda: not alive(first["pid"]))
    [new] = wait_for(
        "the replacement",
        lambda: [w for w in deo.workers("active") if w["id"] not in (first["id"], second["id"])],
    )
    assert new["gpus"] == [free]
    assert {"alert": "gpu_errors", "subject": bad} in deo.alerts()
    # Errors point at hardware: clean samples for longer than the hysteresis do not lift it.
    clean_since = time.time()
    wait_for(
        "clean samples past the hysteresis",
        lambda: any(
            s["t"] > clean_since + 2 * UNCORDON_AFTER_S and s["new_errors"] == 0
            for s in deo.samples(bad)
        ),
    )
    assert deo.gpus()[bad]["causes"] == ["errors"]
    assert not deo.commands("UncordonGpu", gpu_id=bad)
    deo.verified()


def test_memory_used_by_another_process_cordons_a_free_gpu_until_clean_long_enough(
    deo: Deo,
) -> None:
    first, second, free = deo.two_active()
    deo.set_gpu(free, memory_used_bytes=76 * GIB)  # 95%: someone else's job
    [(_, cordon)] = wait_for("the cordon", lambda: deo.commands("CordonGpu", gpu_id=free))
    assert cordon["causes"] == ["memory"] and "memory 95% used by others" in cordon["reason"]
    # Full memory on a GPU a deo worker holds is that worker's own: no cordon there.
    [held] = first["gpus"]
    deo.set_gpu(held, memory_used_bytes=79 * GIB)
    wait_for("a full sample", lambda: deo.samples(held)[-1]["memory_used_bytes"] == 79 * GIB)
    assert not deo.commands("CordonGpu", gpu_id=held)
    # Nothing is placed on the saturated GPU: a crashed worker's replacement takes the other
    # (whose memory the driver freed with the worker).
    deo.set_gpu(held)
    wait_for("the memory freed", lambda: deo.samples(held)[-1]["memory_used_bytes"] == GIB)
    os.kill(first["pid"], signal.SIGKILL)
    [new] = wait_for(
        "the replacement",
        lambda: [w for w in deo.workers("active") if w["id"] not in (first["id"], second["id"])],
    )
    assert new["gpus"] == [held]
    assert not deo.commands("CordonGpu", gpu_id=held)
    # Recovery with a relapse: clean, saturated again before the hysteresis ran out, clean.
    deo.set_gpu(free)
    wait_for("a clean sample", lambda: deo.samples(free)[-1]["memory_used_bytes"] == GIB)
    deo.set_gpu(free, memory_used_bytes=76 * GIB)
    wait_for("the relapse", lambda: deo.samples(free)[-1]["memory_used_bytes"] == 76 * GIB)
    deo.set_gpu(free)
    [(uncordoned_t, uncordon)] = wait_for(
        "the uncordon", lambda: deo.commands("UncordonGpu", gpu_id=free)
    )
    assert "was: memory" in uncordon["reason"]
    samples = deo.samples(free)
    saturated = [s["t"] for s in samples if s["memory_used_bytes"] == 76 * GIB]
    clean_from = min(s["t"] for s in samples if s["t"] > max(saturated))
    # Uncordoned only once the samples since the relapse were clean for uncordon_after_s.
    assert uncordoned_t - clean_from >= UNCORDON_AFTER_S
    assert len(deo.commands("CordonGpu", gpu_id=free)) == 1  # the relapse re-armed, not re-cordoned
    assert deo.gpus()[free]["causes"] == []
    deo.verified()


def test_a_lost_gpu_terminates_its_worker_and_stays_cordoned(deo: Deo) -> None:
    first, second, free = deo.two_active()
    [lost] = first["gpus"]
    deo.set_gpu(lost, lost="fell off the bus")
    wait_for("the terminate", lambda: deo.commands("TerminateWorker", worker_id=first["id"]))
    lost_events = [
        r["event"] for r in deo.records() if r["kind"] == "event" and r["event"]["@"] == "GpuLost"
    ]
    assert lost_events and lost_events[0]["gpu_id"] == lost
    assert lost_events[0]["error"] == "fell off the bus"
    wait_for("the terminated worker gone", lambda: not alive(first["pid"]))
    [new] = wait_for(
        "the replacement",
        lambda: [w for w in deo.workers("active") if w["id"] not in (first["id"], second["id"])],
    )
    assert new["gpus"] == [free]
    assert {"alert": "gpu_lost", "subject": lost} in deo.alerts()
    polled_t = time.time()  # several polls of a still-lost GPU: a keep-alive of another later
    wait_for(
        "a keep-alive past several polls",
        lambda: any(s["t"] > polled_t + 1.0 for s in deo.samples(free)),
    )
    assert len([r for r in deo.records() if r.get("event", {}).get("@") == "GpuLost"]) == 1
    # It answers again (a reset): still cordoned, whatever the samples say, until an operator.
    deo.set_gpu(lost)
    back_t = time.time()
    wait_for(
        "clean samples past the hysteresis",
        lambda: any(s["t"] > back_t + 2 * UNCORDON_AFTER_S for s in deo.samples(lost)),
    )
    assert deo.gpus()[lost]["causes"] == ["lost"]
    assert deo.post(f"/v1/gpus/{lost}/uncordon").status_code == 200
    wait_for("the operator's uncordon", lambda: deo.commands("UncordonGpu", gpu_id=lost))
    assert deo.gpus()[lost]["causes"] == []
    deo.verified()


def test_under_a_remapping_cuda_visible_devices_workers_get_what_the_log_says(
    tmp_path: Path,
) -> None:
    # deo itself sees devices 2, 0 and 1 as its GPUs 0, 1 and 2.
    deo = Deo(tmp_path, visible="2,0,1")
    devices = {"0": "2", "1": "0", "2": "1"}
    try:
        deo.start()
        first, second, _ = deo.two_active()
        [configured] = [
            r["event"]
            for r in deo.records()
            if r["kind"] == "event" and r["event"]["@"] == "Configured"
        ]
        assert configured["config"]["gpu_devices"] == devices
        spawns = {spawn["worker_id"]: spawn for _, spawn in deo.commands("SpawnWorker")}
        for worker in (first, second):
            logged = spawns[worker["id"]]["env"]
            [gpu] = worker["gpus"]
            assert logged["CUDA_VISIBLE_DEVICES"] == devices[gpu], worker
            got = environ(worker["pid"])
            # Every variable the log says the worker was given is what it has.
            assert {name: got.get(name) for name in logged} == logged, worker
        # Health read from the device is reported under the configured id.
        [hot] = first["gpus"]
        deo.set_gpu(devices[hot], temperature_c=87, throttle_reasons=["thermal"])
        wait_for("the cordon", lambda: deo.commands("CordonGpu", gpu_id=hot))
        deo.verified()
    finally:
        deo.cleanup()


def test_a_gpu_outside_deos_cuda_visible_devices_stops_deo_before_it_starts(
    tmp_path: Path,
) -> None:
    deo = Deo(tmp_path)  # for its configuration: GPUs 0, 1 and 2
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "1", "DEO_TOKEN": TOKEN}
    proc = subprocess.run(
        [sys.executable, "-m", "adapters.cli", "run", "--config", str(deo.config)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert (
        "deo.gpus: GPU '1' is outside deo's CUDA_VISIBLE_DEVICES='1', which makes 1 GPU(s) "
        "visible (ids 0-0)" in proc.stdout
    )
    assert not deo.log.exists()  # nothing was started or written
