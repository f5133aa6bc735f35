"""``deo run`` stopped (SIGSTOP) for longer than the heartbeat grace: no healthy worker is blamed.

The real program, real heartbeating workers (over the API and through the heartbeat file), a real
SIGSTOP/SIGCONT of deo. While deo is stopped nothing observes the workers; the time it missed
must not count against them.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

from waiting import wait_for

from tests.adapters.runtime.test_run import Deo, alive, deo, pool, script, verified

__all__ = ["deo"]  # the fixture (its clean-up SIGKILLs a deo left stopped, too)

GRACE_S = 2.0
STOPPED_S = 3 * GRACE_S
WORKERS = 6

#: Beats every 0.3 s over the API (and, when deo set one, by touching the heartbeat file).
BEATING = """
import os, time
from deo_worker import Drain, Heartbeat
api = Heartbeat(
    api_url=os.environ["DEO_API_URL"],
    worker_id=os.environ["DEO_WORKER_ID"],
    token=os.environ["DEO_WORKER_TOKEN"],
    timeout_s=1.0,
)
file = Heartbeat.from_environ()
with Drain() as drain:
    while not drain.requested:
        api.beat()
        file.beat()
        time.sleep(0.3)
"""


def test_a_stopped_deo_does_not_blame_its_healthy_workers(
    deo: Callable[[str], Deo], tmp_path: Path
) -> None:
    beating = script(tmp_path, "beating.py", BEATING)
    d = deo(
        pool(
            "envs",
            [sys.executable, beating],
            min_workers=WORKERS,
            max_workers=WORKERS,
            heartbeat_grace_s=GRACE_S,
            stop_timeout_s=1.0,
            policy=f'name = "static"\ncount = {WORKERS}',
        )
    )
    d.start()
    workers = wait_for("every worker active", lambda: len(d.workers("active")) == WORKERS)
    workers = {w["id"]: w["pid"] for w in d.workers("active")}
    # Heartbeats are flowing: each worker has been seen after it started.
    wait_for("a sign of life after start from each worker", lambda: _all_seen(d, set(workers)))
    assert d.process is not None
    os.kill(d.process.pid, signal.SIGSTOP)
    try:
        time.sleep(STOPPED_S)  # the fault itself: deo stopped longer than the grace
    finally:
        os.kill(d.process.pid, signal.SIGCONT)
    resumed_t = time.time()
    # Let deo judge for well over a grace period after it resumed.
    wait_for(
        "ticks for two grace periods after the stop",
        lambda: any(e["t"] >= resumed_t + 2 * GRACE_S for e in d.events("Tick")),
    )
    assert d.commands("TerminateWorker") == []
    assert "hung" not in d.log.read_text()
    assert all(alive(pid) for pid in workers.values())
    assert {w["id"]: w["pid"] for w in d.workers("active")} == workers
    verified(d)


def _all_seen(d: Deo, ids: set[str]) -> bool:
    seen: set[str] = set()
    for record in d.records():
        event = record.get("event") if record.get("kind") == "event" else None
        if event is None:
            continue
        if event["@"] == "WorkerHeartbeat":
            seen.add(event["worker_id"])
        elif event["@"] == "WorkersSeen":
            seen.update(event["worker_ids"])
    return ids <= seen
