"""Pressure polled from a JSON endpoint: ``[pools.NAME.source] kind = "json"``.

The source is a small anyio loop that turns each response into a core event and hands it to
``emit`` (the runner's channel). It never decides anything: an unreachable endpoint or a missing
field becomes a ``SourceDown`` event and the core holds the pool's count.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anyio
import attrs
import httpx

from adapters.sources.url import check_url
from core import ConfigError, Event, InvalidEvent, LoadSampled, QueueSampled, SourceDown

__all__ = ["JsonSource", "poll_json", "read_pressure"]


@attrs.frozen(slots=True, kw_only=True)
class JsonSource:
    """A pool's pressure, polled from a JSON endpoint; each field is a dotted path in the body."""

    pool: str
    url: str
    interval_s: float = 2.0
    timeout_s: float = 5.0
    queued_sequences: str | None = None
    batch_size_seqs: str | None = None
    trainer_step: str | None = None
    in_flight_requests: str | None = None

    def __attrs_post_init__(self) -> None:
        where = f"pools.{self.pool}.source"
        check_url(where, self.url)
        queue = (self.queued_sequences, self.batch_size_seqs, self.trainer_step)
        if all(queue) == (self.in_flight_requests is not None) or (any(queue) and not all(queue)):
            raise ConfigError(
                f"{where}: give either queued_sequences, batch_size_seqs and trainer_step "
                f"(a trainer queue) or in_flight_requests (a request load)"
            )
        if not self.interval_s > 0 or not self.timeout_s > 0:
            raise ConfigError(f"{where}: interval_s and timeout_s must be > 0")


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
