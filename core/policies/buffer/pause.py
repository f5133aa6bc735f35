"""The buffer policy's rule 4: nothing is removed while the trainer pauses (a batch waits but
the trainer takes none), nor until its demand has been measured again after a pause; where
asked to (``pause_release_startups``), a long pause lets the pool go to its minimum, and the
trainer's next step brings it back (in ``BufferPolicy._decide``, before the sample is read)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from core.policies.base import Decision, PolicyContext
from core.policies.buffer.constants import PAUSE_STEPS
from core.policies.buffer.memory import BufferMemory
from core.policies.buffer.reading import Reading
from core.records import replace

if TYPE_CHECKING:
    from core.policies.buffer.policy import BufferPolicy

__all__ = ["hold_through_pause"]


def hold_through_pause(
    policy: BufferPolicy, context: PolicyContext, memory: BufferMemory, reading: Reading
) -> Decision | None:
    """Rule 4, for a queue above the band: hold (or let go) while the trainer pauses or its
    demand after one is not measured yet; None otherwise (the removal rule decides)."""
    t, current, figures = context.t, reading.current, reading.figures
    last_advance = memory.last_advance_t
    if last_advance is not None and t - last_advance > PAUSE_STEPS * reading.step_s:
        # A batch is waiting but the trainer takes none: a pause (evaluation, checkpoint) or a
        # slowdown, told apart when the next step comes; remove nothing until then. Where asked
        # to (``pause_release_startups``), a pause that lasts is not held idle: workers let go
        # cost a start-up to bring back, so once it has lasted that long (k = 1, the
        # ski-rental rule: never more than twice what knowing its length would cost) the pool
        # goes to its minimum until the trainer steps again.
        paused_s = t - last_advance
        release_s = policy.pause_release_startups * reading.startup_s
        floor = context.min_workers
        if policy.pause_release_startups and paused_s > release_s and current > floor:
            kept = max(memory.workers_before_pause or 0, current)
            return Decision(
                target=floor,
                reason=f"{figures}; no trainer step for {paused_s:.0f}s, longer than "
                f"{release_s:.0f}s ({policy.pause_release_startups:g} x the start-up): a "
                f"pause -> {floor} ({kept} again at the trainer's next step)",
                memory=replace(memory, workers_before_pause=kept),
            )
        return Decision(
            target=current,
            reason=f"{figures}; no trainer step for {t - last_advance:.0f}s -> hold {current}",
            memory=memory,
        )
    window = policy.demand_window_s(reading.step_s)
    if memory.resumed_t is not None and memory.demand_seen_s < window:
        return Decision(
            target=current,
            reason=f"{figures}; demand measured for {memory.demand_seen_s:.0f}s since the "
            f"trainer resumed, {window:.0f}s needed -> hold {current}",
            memory=memory,
        )
    return None
