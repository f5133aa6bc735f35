"""The buffer policy's saturation search: a shared inference service that more workers do not
help.

While the trainer starves the pool grows in steps (rule 2: :mod:`.growth`); when a step's workers
are active and the total production rose by less than half of what they should have added (with
no removal since the step: that voids the test), the shared inference service is the
bottleneck: the pool is held at the count that makes that
production, and tried again only after 10 start-ups. Production is averaged, so that is judged two
settle times after the workers came; a rise already half as large before then passes at once (the
trainer is starving meanwhile), in the average or in what the grown pool made over eight steps (30
s at least) from a settle time after its workers came (their first groups are in generation until
then; too few steps to call saturation on with heavy tails). Short at the pool's maximum with a
trainer that waits (less than a batch queued, the queue not near the off-policy limit, where envs
hold back), a removal tests for saturation: a quarter of the pool when production per worker fell
below 70% of its best (p as the rules read it: over the window's recent quarter where that reads
lower with the same workers throughout, so the test does not wait for the whole window to catch
up with a saturated pool); without such a sign (a pool saturated from its first measurement), an
eighth, no more than a step past the knee may cost (below) but a sixteenth at least (a smaller fall
is lost in the noise of production), and only if the pool was never measured at the count the test
would try. Production that held up (fell by less than a quarter of the share removed) means
saturation: while the trainer still waits, fewer: first the count that makes the most the series
made at the best production per worker ever measured, when the pool is larger (sharing only lowers
production per worker, so that many make as much and the knee is no higher; at most half the pool
at a time), then steps of twice the last, capped at a quarter and at the share whose loss for the
time a step past the knee takes to be judged and brought back (two settle times and a start-up) is
36 s of the pool's production, 1% of an hour, but the cap never below an eighth. The step that
passes the knee shows production falling, and workers there run unshared, so the knee is the count
that makes, at their production per worker, the most a pool of the series made (a fall of less than
half the share removed is measured for up to four settle times before it is told from noise), and
their production per worker is the best from then on. That count is held for 30 start-ups. A fall
already clear after one settle time is judged then, on the level it is heading for, so a pool below
the knee is not kept there long. Production that fell at the first removal means the trainer simply
wants more: back to the maximum, not tested again until production per worker falls well below what
it was then."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from core.policies.base import Decision, PolicyContext
from core.policies.buffer.constants import (
    FELL,
    HELD,
    KNEE_STARTUPS,
    PAST_KNEE_COST_S,
    SHED_MAX_SHARE,
)
from core.policies.buffer.memory import BufferMemory, settle_s
from core.records import replace

if TYPE_CHECKING:
    from core.policies.buffer.policy import BufferPolicy

__all__ = ["at_maximum", "judge_shed", "probe_grown", "probe_in"]


def at_maximum(
    policy: BufferPolicy,
    context: PolicyContext,
    memory: BufferMemory,
    figures: str,
    startup: float,
) -> Decision:
    """Short at the pool's maximum. The shared inference may be saturated (production per
    worker fell well below its best, or no such test has been made yet): remove some (a
    quarter, or less without a sign of saturation: see the module docstring) and see
    whether production falls with them (judged by :func:`judge_shed`)."""
    t, current, active = context.t, policy.in_force(context), context.active
    p, best = policy.per_worker(memory) or 0.0, memory.best_per_worker_seqs_s
    # The queue is short of the band, never near the limit: all the pool makes is in this
    # estimate.
    production = memory.production_seqs_s or 0.0
    since_up = math.inf if memory.last_up_t is None else t - memory.last_up_t
    since_down = math.inf if memory.last_down_t is None else t - memory.last_down_t
    quiet = min(since_up, since_down) >= 2 * startup and t >= memory.no_shed_until_t
    tested = memory.unsaturated_per_worker_seqs_s
    sample = context.queue
    assert sample is not None
    # Production is what the pool can make only if the envs were not held back at the
    # off-policy limit within the time it is averaged over.
    settle = policy.production_settle_s(memory, sample.batch_size_seqs)
    # A pool that made its best at the maximum tells nothing: it may have been saturated
    # from its first measurement. One test; the next only once p falls well below that.
    if tested:
        fell, why = p < FELL * tested, f"fell from {tested:.2f} to {p:.2f} seq/s since"
        share = 1 / 4
    elif p < FELL * best:
        fell, why = True, f"fell from {best:.2f} to {p:.2f} seq/s"
        share = 1 / 4
    else:
        # Without a sign of saturation, a smaller test: an eighth, and no more than a step
        # past the knee may cost (it loses its share until judged and brought back), so a
        # pool with long start-ups that is simply short loses little; but a sixteenth at
        # least, or production's noise hides what the test shows. Only once p is measured
        # over its window (not the cold start's first groups), and never with the pool
        # measured at the count the test would try (it made as much per worker there).
        share = min(1 / 8, max(1 / 16, PAST_KNEE_COST_S / (2 * settle + startup)))
        fewest = memory.fewest_measured_workers
        fell = memory.production_seen_s >= policy.production_window_s and (
            not fewest or fewest > active - max(1, math.floor(active * share))
        )
        why = f"is {p:.2f} seq/s, never measured with fewer workers"
    clean = memory.limit_t is None or t - memory.limit_t >= 2 * settle
    # A trainer short of the band but fed (a batch queued) is not worth a test's cost.
    waiting = memory.queue_seqs < sample.batch_size_seqs
    if quiet and clean and waiting and active >= 4 and p > 0 and fell:
        target = current - max(1, math.floor(current * share))
        return Decision(
            target=target,
            reason=f"{figures}; short at the pool's maximum, production per worker {why}: "
            f"trying {target} workers to see whether the shared inference saturates",
            memory=replace(
                memory,
                shed_workers=active,
                shed_seqs_s=production,
                shed_t=t,
            ),
        )
    return Decision(
        target=current,
        reason=f"{figures}; short at the pool's maximum -> hold {current}",
        memory=memory,
    )


def judge_shed(
    policy: BufferPolicy,
    context: PolicyContext,
    memory: BufferMemory,
    figures: str,
    settle: float,
    startup: float,
    low_seqs: float,
) -> Decision:
    """After a removal made short at the maximum: production that held up means saturation
    (keep the smaller pool, and while the queue stays short try fewer);
    production that fell with the workers means the trainer simply wants more than that
    pool can make (the steps: see the module docstring). After a saturated step, one
    that places the knee: the count at which workers
    at the production per worker now measured (unshared) make what the saturated pool made,
    held until demand or the inference changes. With no saturated step before: back to the
    maximum, and no such removal for a while."""
    t, current, active = context.t, policy.in_force(context), context.active
    production = memory.production_seqs_s or 0.0
    cleared = replace(memory, shed_workers=0, no_shed_until_t=t + 10 * startup)
    if memory.limit_t is not None and memory.limit_t >= memory.shed_t:
        # Near the off-policy limit the envs hold back: what the smaller pool made is not
        # what it can make (and it is not short); the other rules decide.
        return Decision(
            target=current,
            reason=f"{figures}; {active} workers filled the queue: no saturation test -> "
            f"hold {current}",
            memory=cleared,
        )
    if active >= memory.shed_workers:
        if t - memory.shed_t > startup + 2 * settle:  # the removal was not applied
            return Decision(target=current, reason=f"{figures} -> hold {current}", memory=cleared)
        return Decision(
            target=current,
            reason=f"{figures}; waiting for the removal -> hold {current}",
            memory=memory,
        )
    removed = 1 - active / memory.shed_workers
    elapsed = t - memory.shed_t
    if elapsed < 2 * settle and memory.shed_seqs_s > 0:
        # Production is averaged over a settle time, so it shows a fall only in part yet:
        # a fall already clear (half what the removal would cost without saturation) is
        # judged now, on its extrapolated level, so a pool below the knee is not kept
        # there long.
        shown = 1 - math.exp(-elapsed / settle)
        fall = (memory.shed_seqs_s - production) / memory.shed_seqs_s
        if elapsed < settle or fall < shown * removed / 2:
            return Decision(
                target=current,
                reason=f"{figures}; {active} of {memory.shed_workers} workers: measuring "
                f"what they make -> hold {current}",
                memory=memory,
            )
        production = memory.shed_seqs_s * (1 - min(fall / shown, 1.0))
    kept = production / memory.shed_seqs_s if memory.shed_seqs_s > 0 else 0.0
    made = (
        f"{figures}; {active} workers make {production:.1f} seq/s, "
        f"{memory.shed_workers} made {memory.shed_seqs_s:.1f}"
    )
    # The most a pool of this series made: what the shared inference gives.
    capacity = max(memory.shed_seqs_s, memory.capacity_seqs_s)
    if kept >= 1 - removed * HELD:
        saturated = replace(
            cleared,
            saturated_workers=current,
            saturated_until_t=t + 10 * startup,
            capacity_seqs_s=capacity,
        )
        if memory.queue_seqs < low_seqs and active >= 4:
            # Still short with fewer workers making as much: the knee is lower still.
            # Workers making the best production per worker measured (sharing only lowers
            # it) make the capacity at this count or fewer, so the knee is no higher: to
            # that count first (at most half the pool). From there, twice the last step, as
            # far as a step past the knee may cost (it loses what it removes until judged
            # and brought back).
            best = memory.best_per_worker_seqs_s
            known = math.ceil(capacity / best - 1e-9) if best > 0 else current
            if known < current:
                target = max(known, current // 2)
            else:
                most = min(SHED_MAX_SHARE, PAST_KNEE_COST_S / (2 * settle + startup))
                share = min(2 * removed, max(most, 1 / 8))
                target = current - max(1, math.floor(current * share))
            return Decision(
                target=target,
                reason=f"{made}: the shared inference saturates; still short, trying "
                f"{target} workers",
                memory=replace(
                    saturated,
                    shed_workers=active,
                    shed_seqs_s=production,
                    shed_t=t,
                ),
            )
        return Decision(
            target=current,
            reason=f"{made}: the shared inference saturates, holding {current} workers",
            memory=saturated,
        )
    if kept > 1 - removed / 2 and elapsed < 4 * settle:
        # Production fell by less than half as much as the workers: saturated still (and
        # noise), or the knee passed part of the way. Measured for longer before it is told.
        return Decision(
            target=current,
            reason=f"{made}: measuring longer -> hold {current}",
            memory=memory,
        )
    last = memory.saturated_workers if t < memory.saturated_until_t else None
    above = last is not None and last > current
    if (above or kept >= 1 - removed / 2) and active > 0 and production > 0:
        # Fewer workers made less, by less than in proportion or after a step that made as
        # much: the knee lies between. Here workers share the inference less (if at all),
        # so the knee is where they make the most a pool of this series made.
        per_worker = production / active
        before = memory.shed_workers if last is None else max(last, memory.shed_workers)
        knee = math.ceil(capacity / per_worker - 1e-9)
        target = min(max(knee, current + 1), before)
        return Decision(
            target=target,
            reason=f"{made}: below the knee; at {per_worker:.2f} seq/s per worker "
            f"{target} workers make {capacity:.1f}, the most the shared inference gave "
            f"-> {target}",
            # The best production per worker is this one from now on: an older best (shorter
            # groups then) would put the next series' first step below the knee.
            memory=replace(
                cleared,
                saturated_workers=target,
                saturated_until_t=t + KNEE_STARTUPS * startup,
                capacity_seqs_s=0.0,
                best_per_worker_seqs_s=per_worker,
            ),
        )
    # Production fell with the workers and no saturation was seen: the trainer simply wants
    # more than the pool can make (back to the maximum, not tested again until production
    # per worker falls well below this).
    target = max(current, context.max_workers)
    return Decision(
        target=target,
        reason=f"{made}: not saturated -> {target}",
        memory=replace(
            cleared,
            unsaturated_per_worker_seqs_s=memory.per_worker_seqs_s or 0.0,
            capacity_seqs_s=0.0,
        ),
    )


def probe_grown(memory: BufferMemory, active: int) -> bool:
    """The last growth while starving is in place (enough workers to tell its effect)."""
    probe = memory.probe_workers
    return probe > 0 and active >= max(1.2 * probe, probe + 2)


def probe_in(memory: BufferMemory, active: int, t: float, step_s: float | None) -> bool:
    """The grown pool's workers are past their first groups: what it makes counts."""
    warm_s = settle_s(step_s)
    return (
        probe_grown(memory, active)
        and active == memory.last_active
        and t - memory.active_changed_t >= warm_s
    )
