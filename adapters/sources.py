"""Event sources besides the API: JSON pressure pollers and heartbeat files.

Each source is a small anyio loop that turns what it observes into core events and hands them to
``emit`` (the runner's channel). A source never decides anything: an unreachable endpoint becomes
a ``SourceDown`` event and the core holds the pool's count.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import httpx

from adapters.config_file import JsonSource
from core import Event, InvalidEvent, LoadSampled, QueueSampled, SourceDown, State, WorkerHeartbeat

__all__ = ["HEARTBEAT_ENV", "heartbeat_files", "poll_json", "read_pressure"]

#: Workers may touch the file this variable names to report they are alive.
HEARTBEAT_ENV = "DEO_HEARTBEAT_FILE"


def _field(body: Any, path: str) -> Any:
    value = body
    for part in path.split("."):
        if not isinstance(value, dict) or part not in value:
            raise KeyError(path)
        value = value[part]
    return value


def read_pressure(source: JsonSource, body: Any, t: float) -> Event:
    """The pressure event ``body`` describes, or SourceDown saying which field is missing/wrong."""
    try:
        if source.in_flight_requests is not None:
            return LoadSampled(
                t=t, pool=source.pool, in_flight_requests=_field(body, source.in_flight_requests)
            )
        assert source.queued_sequences and source.batch_size_seqs and source.trainer_step
        return QueueSampled(
            t=t,
            pool=source.pool,
            queued_sequences=_field(body, source.queued_sequences),
            batch_size_seqs=_field(body, source.batch_size_seqs),
            trainer_step=_field(body, source.trainer_step),
        )
    except KeyError as exc:
        return SourceDown(t=t, pool=source.pool, error=f"{source.url}: no field {exc.args[0]!r}")
    except InvalidEvent as exc:
        return SourceDown(t=t, pool=source.pool, error=f"{source.url}: {exc}")


async def poll_json(
    source: JsonSource, emit: Callable[[Event], None], clock: Callable[[], float]
) -> None:
    """Poll ``source.url`` every ``interval_s`` until cancelled."""
    async with httpx.AsyncClient(timeout=source.timeout_s) as client:
        while True:
            try:
                response = await client.get(source.url)
                response.raise_for_status()
                event = read_pressure(source, response.json(), clock())
            except Exception as exc:
                # A source never takes deo down: any failure is an outage the core holds through.
                what = f"{type(exc).__name__}: {exc}"
                event = SourceDown(t=clock(), pool=source.pool, error=f"{source.url}: {what}")
            emit(event)
            await anyio.sleep(source.interval_s)


def heartbeat_path(directory: Path, worker_id: str) -> Path:
    """Where worker ``worker_id`` touches its heartbeat file."""
    return directory / f"{worker_id}.heartbeat"


async def heartbeat_files(
    directory: Path,
    state: Callable[[], State],
    emit: Callable[[Event], None],
    clock: Callable[[], float],
    interval_s: float = 1.0,
) -> None:
    """Emit a heartbeat whenever a live worker's heartbeat file has been touched since last look."""
    seen: dict[str, float] = {}
    while True:
        live = state().workers
        for worker_id in list(seen):
            if worker_id not in live:
                del seen[worker_id]
        for worker_id in live:
            try:
                mtime = os.stat(heartbeat_path(directory, worker_id)).st_mtime
            except OSError:  # not touched yet, or unreadable: no sign of life
                continue
            if seen.get(worker_id) != mtime:
                seen[worker_id] = mtime
                emit(WorkerHeartbeat(t=clock(), worker_id=worker_id))
        await anyio.sleep(interval_s)
