"""Queue pressure from an atroposlib trajectory API server (``run-api``, port 8000 by default).

Every ``interval_s`` the source asks ``GET /info`` (the trainer's ``batch_size``, in sequences) and
``GET /status`` (``current_step`` and ``queue_size``, in *groups*) and emits one
:class:`~core.QueueSampled` for its pool:

    queued_sequences = queue_size x group_size        (group_size: what the envs declare at
    batch_size_seqs  = batch_size                      /register-env; set it in the source table)
    trainer_step     = current_step

Both sides of the comparison are sequences, so "1.5 batches queued" means what it says. The
trainer's consumption rate is ``current_step`` advancing times ``batch_size`` over time; the
``buffer`` policy measures it from successive samples. (Atropos's DEO proposal divided the queue in
groups by the batch in sequences, which reads ``group_size`` times too low, and scaled *up* on a
deep queue; see docs/atropos.md.)

The source never decides: a server that is unreachable, answers an error or odd JSON, or has no
registered trainer yet (``batch_size`` -1) becomes a :class:`~core.SourceDown` saying so, and the
core holds the pool's count until samples return.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anyio
import attrs
import httpx

from adapters.sources.url import check_url
from core import ConfigError, Event, QueueSampled, SourceDown

__all__ = ["AtroposSource", "poll_atropos", "sample_atropos"]


@attrs.frozen(slots=True, kw_only=True)
class AtroposSource:
    """A pool's trainer queue, read from an atroposlib API server (``kind = "atropos"``)."""

    pool: str
    url: str = "http://127.0.0.1:8000"
    #: Sequences per group, as the pool's envs declare it at /register-env.
    group_size: int
    interval_s: float = 2.0
    timeout_s: float = 5.0

    def __attrs_post_init__(self) -> None:
        where = f"pools.{self.pool}.source"
        check_url(where, self.url)
        if self.group_size < 1:
            raise ConfigError(f"{where}.group_size must be >= 1, got {self.group_size}")
        if not self.interval_s > 0 or not self.timeout_s > 0:
            raise ConfigError(f"{where}: interval_s and timeout_s must be > 0")


def _number(body: Any, key: str, endpoint: str) -> int:
    value = body.get(key) if isinstance(body, dict) else None
    if type(value) is not int:
        raise ValueError(f"GET {endpoint}: expected an integer {key!r}, got {body!r:.200}")
    return value


async def sample_atropos(
    client: httpx.AsyncClient, source: AtroposSource, clock: Callable[[], float]
) -> Event:
    """One sample of the trainer queue, or the SourceDown that explains why there is none."""
    try:
        info = (await client.get("/info")).raise_for_status().json()
        status = (await client.get("/status")).raise_for_status().json()
        batch_size_seqs = _number(info, "batch_size", "/info")
        queue_groups = _number(status, "queue_size", "/status")
        step = _number(status, "current_step", "/status")
        if batch_size_seqs < 1:
            return SourceDown(
                t=clock(),
                pool=source.pool,
                error=f"{source.url}: no trainer registered yet (GET /info: batch_size "
                f"{batch_size_seqs}); holding until one does",
            )
        return QueueSampled(
            t=clock(),
            pool=source.pool,
            queued_sequences=queue_groups * source.group_size,
            batch_size_seqs=batch_size_seqs,
            trainer_step=step,
        )
    except Exception as exc:
        # A source never takes deo down: any failure is an outage the core holds through.
        what = str(exc) or type(exc).__name__
        return SourceDown(t=clock(), pool=source.pool, error=f"{source.url}: {what}")


async def poll_atropos(
    source: AtroposSource, emit: Callable[[Event], None], clock: Callable[[], float]
) -> None:
    """Sample ``source`` every ``interval_s`` until cancelled."""
    async with httpx.AsyncClient(base_url=source.url, timeout=source.timeout_s) as client:
        while True:
            emit(await sample_atropos(client, source, clock))
            await anyio.sleep(source.interval_s)
