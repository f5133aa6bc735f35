"""``deo run`` and the processes around its workers: what a worker leaves behind, processes of
the run the log does not name, deo's own signals, and the CUDA device order workers get.

Real ``deo run`` processes, real worker processes that fork, call setsid() and clear their
environment, real signals.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from spawned import marked_processes
from waiting import wait_for

from tests.adapters.runtime.test_run import (
    STUBBORN,
    WELL_BEHAVED,
    Deo,
    alive,
    pool,
    script,
    verified,
)

#: A worker that starts six kinds of descendants, says their pids, and exits at once with code 3
#: on the drain signal (SIGUSR1) or SIGTERM, leaving them all behind.
LEAVER = """
import os, signal, subprocess, sys, time
SLEEP = "import time; time.sleep(600)"
DEAF = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
DAEMON = ("import os, sys, time\\n"
          "r, w = os.pipe()\\n"
          "if os.fork(): os.read(r, 1); sys.exit(0)\\n"
          "os.setsid(); print('left', os.getpid(), flush=True); os.write(w, b'.'); time.sleep(600)")
def start(code, **kw):
    child = subprocess.Popen([sys.executable, "-c", code], **kw)
    print("left", child.pid, flush=True)
start(SLEEP)                                   # in the worker's group
start(DEAF)                                    # in its group, ignoring SIGTERM
start(SLEEP, start_new_session=True)           # its own session
start(DEAF, start_new_session=True)            # its own session, ignoring SIGTERM
start(SLEEP, start_new_session=True, env={})   # its own session, without deo's variables
subprocess.run([sys.executable, "-c", DAEMON]) # a daemon: forked, setsid, parent gone
print("ready", flush=True)
signal.signal(signal.SIGUSR1, lambda *_: os._exit(3))
signal.signal(signal.SIGTERM, lambda *_: os._exit(3))
while True:
    time.sleep(1)
"""


#: Ignores the drain signal and SIGTERM, and so does its child, which leads a session of its own:
#: SIGKILL to the worker's process group does not reach it.
STUBBORN_WITH_SETSID_CHILD = """
import signal, subprocess, sys, time
for s in (signal.SIGUSR1, signal.SIGTERM):
    signal.signal(s, signal.SIG_IGN)
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                         start_new_session=True)
print("child", child.pid, flush=True)
while True:
    time.sleep(1)
"""


def left_pids(log: Path) -> list[int]:
    text = log.read_text()
    return [int(pid) for pid in re.findall(r"^left (\d+)$", text, re.M)]


@pytest.fixture
def deo(tmp_path: Path) -> Iterator[Callable[[str], Deo]]:
    made: list[Deo] = []
    strays: list[int] = []

    def make(pools: str) -> Deo:
        instance = Deo(tmp_path, pools)
        made.append(instance)
        return instance

    yield make
    for instance in made:
        instance.cleanup()
        # Descendants without the test's marker are found by the pids the workers printed.
        for log in (instance.dir / "deo-workers").glob("*.log"):
            strays += left_pids(log)
    for pid in strays:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def raised_alerts(instance: Deo, alert: str) -> list[dict[str, Any]]:
    return [
        command
        for record in instance.records()
        if record["kind"] == "commands"
        for command in record["commands"]
        if command["@"] == "RaiseAlert" and command["alert"] == alert
    ]


def zombie_children(pid: int) -> list[int]:
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                stat = Path(entry.path, "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if stat[0] == "Z" and int(stat[1]) == pid:
                found.append(int(entry.name))
    return found


def leaver_pool(tmp_path: Path, **fields: Any) -> str:
    leaver = script(tmp_path, "leaver.py", LEAVER)
    return pool(
        "envs",
        [sys.executable, leaver],
        min_workers=0,
        max_workers=1,
        drain_timeout_s=5.0,
        stop_timeout_s=1.0,
        **fields,
    )


def test_what_a_drained_worker_leaves_behind_is_stopped_and_named_in_an_alert(
    deo: Callable[[str], Deo], tmp_path: Path
) -> None:
    d = deo(leaver_pool(tmp_path))
    d.start()
    [worker] = wait_for("the worker", lambda: d.workers("active"))
    log = d.worker_log(worker)
    wait_for("its descendants", lambda: "ready" in log.read_text())
    left = left_pids(log)
    assert len(left) == 6 and all(alive(pid) for pid in left), left
    assert d.post("/v1/pools/envs/pin", {"count": 0}).status_code == 200
    wait_for("the worker gone", lambda: not alive(worker["pid"]))
    wait_for("what it left behind gone", lambda: not any(alive(pid) for pid in left))
    [alert] = wait_for("the alert", lambda: raised_alerts(d, "leftover_processes"))
    assert alert["subject"] == worker["id"]
    for pid in left:
        assert str(pid) in alert["reason"], alert
    # Resolved once all are gone: a pool of leaky workers keeps no alert per worker.
    wait_for("the alert resolved", lambda: d.status()["alerts"] == [])
    stopped = d.events("LeftoverProcessesStopped")
    assert [e["worker_id"] for e in stopped] == [worker["id"]]
    assert d.process is not None
    wait_for("no zombie left to deo", lambda: not zombie_children(d.process.pid))
    # Reaping the orphans never took the worker's own exit status from deo.
    assert [e["exit_code"] for e in d.events("WorkerExited")] == [3]
    verified(d)


def test_a_killed_workers_session_leaders_are_stopped_too(
    deo: Callable[[str], Deo], tmp_path: Path
) -> None:
    stubborn = script(tmp_path, "stubborn.py", STUBBORN_WITH_SETSID_CHILD)
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
    assert d.post("/v1/pools/envs/pin", {"count": 0}).status_code == 200
    wait_for("the worker killed", lambda: not alive(worker["pid"]))
    wait_for("its setsid child gone too", lambda: not alive(child))
    assert raised_alerts(d, "leftover_processes")
    verified(d)


def test_processes_of_the_run_the_log_does_not_name_are_stopped_before_any_spawn(
    deo: Callable[[str], Deo], tmp_path: Path
) -> None:
    d = deo(leaver_pool(tmp_path, policy='name = "static"\ncount = 1'))
    d.start()
    [worker] = wait_for("the worker", lambda: d.workers("active"))
    log = d.worker_log(worker)
    wait_for("its descendants", lambda: "ready" in log.read_text())
    left = left_pids(log)
    d.kill9()
    # The log loses everything from the worker's spawn on, as if those writes never made it.
    lines = d.log.read_bytes().splitlines(keepends=True)
    records = [json.loads(line) for line in lines]
    cause = next(
        r["cause"]
        for r in records
        if r["kind"] == "commands" and any(c["@"] == "SpawnWorker" for c in r["commands"])
    )
    cut = next(i for i, r in enumerate(records) if r.get("seq") == cause)
    d.log.write_bytes(b"".join(lines[:cut]))
    d.start()
    # The restarted deo spawns envs-0 again only once the unnamed one and its descendants are gone.
    wait_for("a new worker", lambda: [w for w in d.workers("active") if w["pid"] != worker["pid"]])
    assert not alive(worker["pid"])
    wait_for("its descendants gone", lambda: not any(alive(pid) for pid in left))
    [alert] = raised_alerts(d, "leftover_processes")
    assert str(worker["pid"]) in alert["reason"], alert
    records = d.records()
    alert_seq = next(
        r["seq"]
        for r in records
        if r["kind"] == "commands" and any(c["@"] == "RaiseAlert" for c in r["commands"])
    )
    first_spawn_seq = min(
        r["seq"]
        for r in records
        if r["kind"] == "commands" and any(c["@"] == "SpawnWorker" for c in r["commands"])
    )
    assert alert_seq < first_spawn_seq
    verified(d)


#: Leaves one child behind that leads its own session and ignores SIGTERM, so the sweep after the
#: worker's exit waits the whole stop timeout before its SIGKILL.
LEAVES_A_DEAF_CHILD = """
import os, signal, subprocess, sys, time
DEAF = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
child = subprocess.Popen([sys.executable, "-c", DEAF], start_new_session=True)
print("left", child.pid, flush=True)
signal.signal(signal.SIGUSR1, lambda *_: os._exit(3))
while True:
    time.sleep(1)
"""


def test_a_leftover_alert_raised_when_deo_died_is_resolved_when_nothing_is_left(
    deo: Callable[[str], Deo], tmp_path: Path
) -> None:
    leaver = script(tmp_path, "deaf_child.py", LEAVES_A_DEAF_CHILD)
    d = deo(
        pool(
            "envs",
            [sys.executable, leaver],
            min_workers=0,
            max_workers=1,
            drain_timeout_s=5.0,
            stop_timeout_s=600.0,  # the sweep is still waiting when deo dies
        )
    )
    d.start()
    [worker] = wait_for("the worker", lambda: d.workers("active"))
    log = d.worker_log(worker)
    [child] = wait_for("its child", lambda: left_pids(log))
    assert d.post("/v1/pools/envs/pin", {"count": 0}).status_code == 200
    wait_for("the alert", lambda: raised_alerts(d, "leftover_processes"))
    d.kill9()  # mid-sweep: no LeftoverProcessesStopped
    os.kill(child, signal.SIGKILL)  # it ends while no deo watches
    wait_for("the child gone", lambda: not alive(child))
    assert d.events("LeftoverProcessesStopped") == []

    d.start()

    wait_for("the alert resolved", lambda: d.status()["alerts"] == [])
    stopped = d.events("LeftoverProcessesStopped")
    assert [e["worker_id"] for e in stopped] == [worker["id"]]
    verified(d)


@pytest.mark.parametrize("drain", [False, True], ids=["stop", "drain-stop"])
def test_sigterms_during_a_stop_never_end_deo_uncleanly(
    deo: Callable[[str], Deo], tmp_path: Path, drain: bool
) -> None:
    stubborn = script(tmp_path, "stubborn.py", STUBBORN)
    d = deo(
        pool(
            "envs",
            [sys.executable, stubborn],
            min_workers=0,
            max_workers=1,
            drain_timeout_s=60.0,
            stop_timeout_s=60.0,
        )
    )
    d.start()
    [worker] = wait_for("the worker", lambda: d.workers("active"))
    # It prints its child once it ignores the drain signal and SIGTERM: a signal sent before
    # then would end it.
    log = d.worker_log(worker)
    wait_for("the worker's handlers", lambda: log.exists() and "child" in log.read_text())
    if drain:
        assert d.post("/v1/stop", {"drain": True}).status_code == 200
        wait_for("the drain", lambda: "DrainWorker" in d.log.read_text())
    assert d.process is not None
    # SIGTERM after SIGTERM, as fast as they can be sent, until deo has exited.
    deadline = time.monotonic() + 60
    while d.process.poll() is None and time.monotonic() < deadline:
        with contextlib.suppress(ProcessLookupError):
            d.process.send_signal(signal.SIGTERM)
        time.sleep(0.002)
    assert d.process.wait(timeout=10) == 0, d.output()
    assert "deo: stopped; 1 worker(s) left running" in d.output()
    assert alive(worker["pid"])  # left running (or draining): a restart adopts it
    proc = d.replay()
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_a_plain_stop_during_a_drain_stop_stops_at_once(
    deo: Callable[[str], Deo], tmp_path: Path
) -> None:
    stubborn = script(tmp_path, "stubborn.py", STUBBORN)
    d = deo(
        pool(
            "envs",
            [sys.executable, stubborn],
            min_workers=0,
            max_workers=1,
            drain_timeout_s=600.0,
            stop_timeout_s=600.0,
        )
    )
    d.start()
    [worker] = wait_for("the worker", lambda: d.workers("active"))
    log = d.worker_log(worker)
    wait_for("the worker's handlers", lambda: log.exists() and "child" in log.read_text())
    assert d.post("/v1/stop", {"drain": True}).status_code == 200
    wait_for("the drain", lambda: "DrainWorker" in d.log.read_text())
    # Actions while deo stops would only be undone: refused, not taken.
    pinned = d.post("/v1/pools/envs/pin", {"count": 1})
    assert pinned.status_code == 503 and "stopping" in pinned.json()["error"]
    # The drain would take ten minutes; a stop without one ends the wait (a second signal's
    # way), and the worker goes on draining for a restart to adopt.
    assert d.post("/v1/stop", {"drain": False}).status_code == 200
    assert d.process is not None
    assert d.process.wait(timeout=60) == 0, d.output()
    assert "stop requested without a drain: stopping now" in d.output()
    assert "deo: stopped; 1 worker(s) left running" in d.output()
    assert alive(worker["pid"])
    proc = d.replay()
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_sighup_and_sigusr_are_logged_and_ignored(deo: Callable[[str], Deo]) -> None:
    d = deo(pool("envs", [sys.executable, str(WELL_BEHAVED), "0.2"], min_workers=1))
    d.start()
    wait_for("the worker", lambda: d.workers("active"))
    assert d.process is not None
    for sig in (signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        d.process.send_signal(sig)
        wait_for(f"{sig.name} noted", lambda sig=sig: f"{sig.name}: ignored" in d.output())
    assert d.process.poll() is None
    assert d.workers("active")  # still answering
    verified(d)
    assert d.process.returncode == 0


def worker_environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.decode().split("=", 1) for item in raw.split(b"\0") if b"=" in item)


@pytest.mark.parametrize("deo_order", [None, "FASTEST_FIRST", "PCI_BUS_ID"])
def test_workers_always_count_devices_in_pci_order(
    deo: Callable[[str], Deo], monkeypatch: pytest.MonkeyPatch, deo_order: str | None
) -> None:
    if deo_order is None:
        monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)
    else:
        monkeypatch.setenv("CUDA_DEVICE_ORDER", deo_order)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    d = deo(pool("envs", [sys.executable, str(WELL_BEHAVED), "0.2"], min_workers=1))
    d.start()
    [worker] = wait_for("the worker", lambda: d.workers("active"))
    assert worker_environ(worker["pid"])["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    verified(d)


def test_a_device_order_deo_cannot_resolve_stops_it_before_it_starts(
    deo: Callable[[str], Deo], monkeypatch: pytest.MonkeyPatch
) -> None:
    # deo's CUDA_VISIBLE_DEVICES indices counted FASTEST_FIRST name GPUs deo cannot know without
    # CUDA: it refuses rather than hand workers the wrong devices.
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "FASTEST_FIRST")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,0")
    d = deo(pool("envs", ["true"]))
    d.config.write_text(d.config.read_text().replace("[api]", 'gpus = ["0"]\n[api]', 1))
    proc = d.run_to_end()
    assert proc.returncode == 2, proc.stdout
    assert "CUDA_DEVICE_ORDER" in proc.stdout and "FASTEST_FIRST" in proc.stdout, proc.stdout
    assert not marked_processes(d.marker)
