"""The buffer policy's stall rule: a pool whose trainer waits after each visit to the off-policy
limit steps down.

Where groups outlast the batches the queue holds at atroposlib's off-policy limit, each visit
there costs a wait whatever the pool: the envs cancel their groups in generation, and nothing
lands again for the shortest group latency while the trainer takes what the queue held. More
workers do not shorten that (the fastest group of a fresh start is about as slow however many
start) and bring the queue back to the limit sooner, for the next wait; the starvation that
follows a visit reads as a short pool and would grow it to its maximum. So once the waits are
reported (``offpolicy_stalls``), starvation within two stalls' spans of the limit holds the pool,
and each new stall takes a quarter of it: fewer workers reach the limit less often. A growth
after such a step says the pool went below its need: later steps keep what that growth brought.
A trainer restart or a flushed queue since the last visit ends that reading: the queue is short
for that, and the other rules decide.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import attrs

from core.policies.base import Decision, PolicyContext
from core.policies.buffer.constants import STALL_SHARE, STALL_SPANS, STALLS_TO_ALERT
from core.policies.buffer.memory import BufferMemory
from core.policies.buffer.reading import Reading
from core.records import replace

if TYPE_CHECKING:
    from core.policies.buffer.policy import BufferPolicy

__all__ = ["floor_after_growth", "shed_on_stalls"]


def shed_on_stalls(
    policy: BufferPolicy,
    context: PolicyContext,
    memory: BufferMemory,
    reading: Reading,
    starving: bool,
) -> Decision | None:
    """Waits after the off-policy limit are reported and the queue stood there within
    two stalls' spans (a stall's wait and the batches the limit holds): a queue below the
    target is the envs restarting, not a short pool. A stall since the last removal, a
    start-up after the last change: down by ``STALL_SHARE`` (``max_down_fraction`` at most);
    otherwise hold."""
    stalls = len(memory.stall_times)
    if stalls < STALLS_TO_ALERT or memory.limit_t is None or math.isinf(reading.step_s):
        return None
    if memory.restarted_t is not None and memory.restarted_t >= memory.limit_t:
        return None  # a trainer restart or a flushed queue since the limit: not the envs
    if not (starving or reading.queue_seqs < reading.target_seqs):
        return None
    t, current, figures = context.t, reading.current, reading.figures
    span_s = memory.stall_wait_s + policy.max_batches_offpolicy * reading.step_s
    since_limit_s = t - memory.limit_t
    if since_limit_s >= STALL_SPANS * span_s:
        return None
    minutes = (t - memory.stall_times[0]) / 60
    waits = (
        f"the trainer waited after the queue fell from the off-policy limit {stalls} times in "
        f"{minutes:.0f} min (the envs cancel their groups there)"
    )
    new_stall = memory.last_down_t is None or memory.stall_times[-1] > memory.last_down_t
    startup = reading.startup_s
    settled = reading.since_down_s >= startup and reading.since_up_s >= startup
    lowest = max(context.min_workers, 1, memory.stall_floor_workers)
    share = min(STALL_SHARE, policy.max_down_fraction)
    target = max(current - math.ceil(current * share), lowest)
    if new_stall and settled and target < current:
        return Decision(
            target=target,
            reason=f"{figures}; {waits}: fewer workers reach the limit less often -> "
            f"stepping down to {target} (at most {share:.0%} of the pool at a time)",
            memory=replace(memory, stall_shed_workers=target),
        )
    return Decision(
        target=current,
        reason=f"{figures}; {waits}, and the queue stood at the limit {since_limit_s:.0f}s "
        f"ago: it is short while the envs start again, not the pool -> hold {current}",
        memory=memory,
    )


def floor_after_growth(context: PolicyContext, current: int, decision: Decision) -> Decision:
    """A growth or addition after the stall rule stepped down: the pool went below its need,
    so later steps on stalls keep what this one brings."""
    memory = decision.memory
    if not memory.stall_shed_workers or decision.target <= current:
        return decision
    floor = max(memory.stall_floor_workers, min(decision.target, context.max_workers))
    return attrs.evolve(decision, memory=replace(memory, stall_floor_workers=floor))
