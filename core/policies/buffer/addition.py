"""The buffer policy's rule 3: add workers before the queue leaves the band at the bottom, on a
projection of the queue at the rates measured."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from core.policies.base import Decision, PolicyContext
from core.policies.buffer.memory import BufferMemory, settle_s
from core.policies.buffer.reading import Reading
from core.policies.buffer.saturation import at_maximum
from core.records import replace

if TYPE_CHECKING:
    from core.policies.buffer.policy import BufferPolicy

__all__ = ["add"]


def add(
    policy: BufferPolicy, context: PolicyContext, memory: BufferMemory, reading: Reading
) -> Decision | None:
    """Rule 3: a queue below the target, projected to fall below the band's bottom (scaled by
    the step against the start-up) or already below the band, gets workers; None where the
    rule does not apply (the next rules decide)."""
    below_target = reading.queue_seqs < reading.target_seqs
    # Warming (the last workers' first groups still in generation) defers a reaction to the
    # queue, not the balance: more than the whole pool, once up, makes is asked for.
    short = reading.balanced > reading.current
    if not (reading.measurable and below_target and (short or not reading.warming)):
        return None
    t, current, queue = context.t, reading.current, reading.queue_seqs
    startup, step_s = reading.startup_s, reading.step_s
    per_worker, demand = reading.per_worker_seqs_s, reading.demand_seqs_s
    low_seqs = reading.low_seqs
    # The queue is projected a start-up ahead, at the drift the rates give. A trainer that steps
    # seldom takes a whole batch at a time and the queue, smoothed over two steps, reads a step
    # late: look a step ahead at least, and add before the queue would fall below the band's
    # bottom (where the trainer starts to wait), scaled by (step / start-up) squared; over a
    # start-up of many steps, before it would empty (a larger bound there adds workers on the
    # rates' noise).
    horizon = max(startup, step_s) if math.isfinite(step_s) else startup
    floor_seqs = low_seqs * min(step_s / startup, 1.0) ** 2
    # Workers still starting produce only once started: credit them for the part of the
    # horizon after half a start-up (they are, on average, half-way there).
    starting = max(context.current - context.active, 0)
    drift = context.active * per_worker - demand
    projected = queue + drift * horizon + starting * per_worker * (horizon - startup / 2)
    # A removal was judged safe for a start-up: within it, only a queue below the band (not a
    # projection, which rests on noisy rates) brings workers back.
    trusted = reading.since_down_s >= startup
    if not ((projected < floor_seqs and trusted) or (queue < low_seqs and projected < low_seqs)):
        return None
    # One more worker at a time while none is starting; while some are, only what the rates
    # ask for (the ones starting are not in the queue yet).
    target = max(reading.workers, reading.balanced, current + 1 if not starting else current)
    if reading.cap is not None:
        target = min(target, max(reading.cap, current))
    if target > current and current >= context.max_workers:
        # Short at the pool's maximum: perhaps the shared inference saturates.
        return at_maximum(policy, context, memory, reading.figures, startup)
    if target <= current:
        return None
    # Short (it would empty the queue within a start-up, or p is measured over its window, not
    # from the cold start's first groups), with the pool in place (its workers' groups in): no
    # removal comes back to this count.
    placed = t - memory.active_changed_t >= max(startup, 2 * settle_s(step_s))
    known = memory.production_seen_s >= policy.production_window_s
    told = known or projected < 0 or policy.fell_from_limit(memory)
    if placed and told and context.active >= current:
        memory = replace(memory, short_workers=current, short_demand_seqs_s=demand)
    return Decision(
        target=target,
        reason=f"{reading.figures}; {projected / reading.batch:.2f} batches in {horizon:.0f}s "
        f"-> {target} workers",
        memory=memory,
    )
