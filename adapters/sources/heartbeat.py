"""Heartbeat files: a worker touches ``$DEO_HEARTBEAT_FILE`` to say it is alive.

A small anyio loop watches each live worker's file and reports a sighting (``saw(worker_id)``,
:meth:`adapters.runtime.runner.Runner.saw`) whenever it has been touched since the last look.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from pathlib import Path

import anyio

from core import State, UnknownSubject

__all__ = ["HEARTBEAT_ENV", "heartbeat_files", "heartbeat_path"]

#: Workers may touch the file this variable names to report they are alive.
HEARTBEAT_ENV = "DEO_HEARTBEAT_FILE"


def heartbeat_path(directory: Path, worker_id: str) -> Path:
    """Where worker ``worker_id`` touches its heartbeat file."""
    return directory / f"{worker_id}.heartbeat"


async def heartbeat_files(
    path_of: Callable[[str], Path],
    state: Callable[[], State],
    saw: Callable[[str], None],
    interval_s: float = 1.0,
) -> None:
    """Report a sighting whenever a live worker's heartbeat file (``path_of(worker_id)``: the
    file its executor named in its ``$DEO_HEARTBEAT_FILE``) was touched since the last look.

    ``state`` may lag the one ``saw`` judges by (readers see the last durable state): a worker
    whose pool is gone by then is refused with UnknownSubject, which is no sign of life to
    report, never a reason to stop watching the others."""
    seen: dict[str, float] = {}
    while True:
        live = state().workers
        for worker_id in list(seen):
            if worker_id not in live:
                del seen[worker_id]
        for worker_id in live:
            try:
                mtime = os.stat(path_of(worker_id)).st_mtime
            except OSError:  # not touched yet, or unreadable: no sign of life
                continue
            if seen.get(worker_id) != mtime:
                seen[worker_id] = mtime
                with contextlib.suppress(UnknownSubject):
                    saw(worker_id)
        await anyio.sleep(interval_s)
