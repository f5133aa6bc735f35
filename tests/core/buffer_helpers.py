"""What the buffer policy's tests share: batch 64 sequences throughout, a context as the reducer
builds it, a settled memory and one decision on the next sample."""

from __future__ import annotations

from typing import Any

from core.events import QueueSampled
from core.policies import BufferMemory, BufferPolicy, Decision, PolicyContext

BATCH = 64


def ctx(
    t: float,
    queued: int,
    step: int,
    *,
    current: int,
    active: int | None = None,
    desired: int | None = None,
    max_workers: int = 100,
    batch: int = BATCH,
    last_failure_t: float | None = None,
) -> PolicyContext:
    return PolicyContext(
        t=t,
        pool="p",
        current=current,
        active=current if active is None else active,
        min_workers=0,
        max_workers=max_workers,
        desired=current if desired is None else desired,
        last_failure_t=last_failure_t,
        queue=QueueSampled(
            t=t, pool="p", queued_sequences=queued, batch_size_seqs=batch, trainer_step=step
        ),
    )


def settled(**changes: Any) -> BufferMemory:
    """Windows full: D = 32 seq/s (a step per 2 s), p = 4 seq/s/worker (n = 8), Q = 80 seq,
    start-up 20 s measured, a production spread of 0 (target 1 batch, band [32, 96] seq)."""
    fields: dict[str, Any] = {
        "last_t": 100.0,
        "last_queued_seqs": 80,
        "last_step": 50,
        "last_active": 8,
        "queue_seqs": 80.0,
        "demand_seqs_s": 32.0,
        "fast_demand_seqs_s": 32.0,
        "last_advance_t": 100.0,
        "per_worker_seqs_s": 4.0,
        "production_seqs_s": 32.0,
        "queue_seen_s": 4.0,
        "demand_seen_s": 60.0,
        "production_seen_s": 120.0,
        "last_desired": 8,
        "startup_s": 20.0,
        "startups_seen": 8,
        "probe_t": 1.0,
    }
    fields.update(changes)
    if "queue_seqs" in changes and "last_queued_seqs" not in changes:
        fields["last_queued_seqs"] = round(changes["queue_seqs"])
    return BufferMemory(**fields)


def probe(
    memory: BufferMemory,
    count: int,
    *,
    queued: int | None = None,
    steps: int = 1,
    policy: BufferPolicy | None = None,
    **extra: Any,
) -> Decision:
    """Decide 2 s after ``memory`` on a sample of ``queued`` (default: the smoothed queue)."""
    queued = round(memory.queue_seqs) if queued is None else queued
    return (policy or BufferPolicy()).decide(
        ctx(memory.last_t + 2.0, queued, memory.last_step + steps, current=count, **extra),
        memory,
    )
