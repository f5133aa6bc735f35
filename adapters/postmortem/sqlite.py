"""Export a replayed log to SQLite (sqlite-utils) for SQL postmortems.

Tables:

* ``events``   — seq, line, t, type, pool, worker_id, gpu_id, data (the event as JSON)
* ``commands`` — n (the number the timeline shows), seq of its event, t, type, pool, worker_id,
  gpu_id, reason, data
* ``workers``  — one row per worker: pool, gpus, requested/started/ended times, pid, how it ended
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import orjson
import sqlite_utils

from adapters.describe import event_subject
from adapters.postmortem.engine import Replayed
from core import commands as c
from core import encode
from core import events as e

__all__ = ["export_sqlite"]

_BATCH = 5_000


def export_sqlite(steps: Iterable[Replayed], out: Path) -> dict[str, int]:
    """Write events, commands and worker lifetimes of ``steps`` to ``out``; returns row counts."""
    if out.exists():
        out.unlink()
    db = sqlite_utils.Database(out)
    events: list[dict[str, Any]] = []
    commands: list[dict[str, Any]] = []
    workers: dict[str, dict[str, Any]] = {}
    counts = {"events": 0, "commands": 0, "workers": 0}
    number = 0

    def flush(force: bool = False) -> None:
        if events and (force or len(events) >= _BATCH):
            db.table("events").insert_all(events, pk="seq")
            counts["events"] += len(events)
            events.clear()
        if commands and (force or len(commands) >= _BATCH):
            db.table("commands").insert_all(commands, pk="n")
            counts["commands"] += len(commands)
            commands.clear()

    for step in steps:
        event, t = step.event, step.after.now
        events.append(
            {
                "seq": step.seq,
                "line": step.line,
                "t": event.t,
                "type": type(event).__name__,
                "pool": event_subject(event),
                "worker_id": getattr(event, "worker_id", None),
                "gpu_id": getattr(event, "gpu_id", None),
                "rejected": step.produced_error,
                "data": orjson.dumps(encode(event)).decode(),
            }
        )
        _track_worker_event(workers, event, t)
        for command in step.produced:
            number += 1
            commands.append(
                {
                    "n": number,
                    "seq": step.seq,
                    "t": t,
                    "type": type(command).__name__,
                    "pool": getattr(command, "pool", None)
                    or (workers.get(getattr(command, "worker_id", ""), {}).get("pool")),
                    "worker_id": getattr(command, "worker_id", None),
                    "gpu_id": getattr(command, "gpu_id", None),
                    "reason": command.reason,
                    "data": orjson.dumps(encode(command)).decode(),
                }
            )
            if isinstance(command, c.SpawnWorker):
                workers[command.worker_id] = {
                    "worker_id": command.worker_id,
                    "pool": command.pool,
                    "gpus": ",".join(command.gpus),
                    "requested_t": t,
                    "started_t": None,
                    "ended_t": None,
                    "pid": None,
                    "exit_code": None,
                    "signal": None,
                    "ended_by": None,
                    "stop_cause": None,
                }
            elif isinstance(command, (c.DrainWorker, c.TerminateWorker)):
                row = workers.get(command.worker_id)
                if row is not None and row["stop_cause"] is None:
                    row["stop_cause"] = command.reason
        flush()
    flush(force=True)
    if workers:
        db.table("workers").insert_all(workers.values(), pk="worker_id")
    counts["workers"] = len(workers)
    for table, columns in (("events", ["t", "type"]), ("commands", ["t", "type"])):
        if db.table(table).exists():
            db.table(table).create_index(columns, if_not_exists=True)
    return counts


def _track_worker_event(workers: dict[str, dict[str, Any]], event: e.Event, t: float) -> None:
    worker_id = getattr(event, "worker_id", None)
    row = workers.get(worker_id) if isinstance(worker_id, str) else None
    if row is None:
        return
    match event:
        case e.WorkerStarted(pid=pid):
            row.update(started_t=t, pid=pid)
        case e.WorkerExited(exit_code=code, signal=sig):
            if row["ended_t"] is None:
                row.update(ended_t=t, exit_code=code, signal=sig, ended_by="exit")
        case e.SpawnFailed(error=err):
            if row["ended_t"] is None:
                row.update(ended_t=t, ended_by=f"spawn failed: {err}")
        case e.WorkerLost(reason=why):
            if row["ended_t"] is None:
                row.update(ended_t=t, ended_by=f"lost: {why}")
