"""The buffer policy's rule 2: a starving trainer takes only what the envs make, so the pool grows
by up to ``max_up_factor`` per start-up, unless production stopped (an outage) or the shared
inference saturates (:mod:`core.policies.buffer.saturation`)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from core.policies.base import Decision, PolicyContext
from core.policies.buffer.constants import OUTAGE_BATCHES, PROBE_MIN_S, PROBE_STEPS
from core.policies.buffer.memory import BufferMemory, sped_up_lately
from core.policies.buffer.reading import Reading
from core.policies.buffer.saturation import at_maximum, probe_grown
from core.records import replace

if TYPE_CHECKING:
    from core.policies.buffer.policy import BufferPolicy

__all__ = ["grow", "growth_shown"]


def grow(
    policy: BufferPolicy,
    context: PolicyContext,
    memory: BufferMemory,
    reading: Reading,
) -> Decision:
    """Rule 2: the trainer starves. Grow by up to ``max_up_factor`` (per start-up), unless
    the last growth showed the shared inference saturated."""
    figures, workers, batch = reading.figures, reading.workers, reading.batch
    t, current, active = context.t, policy.in_force(context), context.active
    # What entered the queue, measured (starving, the queue never nears the off-policy
    # limit, so this is all the pool makes).
    production = memory.production_seqs_s or 0.0
    # Production is averaged over a settle time: two of them after the last worker came,
    # it shows what the workers added make (to 86%).
    settle = policy.production_settle_s(memory, batch)
    settled = t - memory.active_changed_t >= 2 * settle
    startup = policy.startup(memory)
    # Starving, the trainer takes each batch as soon as the envs complete it, so at the
    # measured rate a batch comes every B / (p x active). No batch over twice that: the envs
    # make less than half of what they did (an inference outage), not what the trainer
    # wants; more workers would add nothing.
    since_advance = 0.0 if memory.last_advance_t is None else t - memory.last_advance_t
    expected = (memory.per_worker_seqs_s or 0.0) * active * since_advance
    if expected >= OUTAGE_BATCHES * batch:
        return Decision(
            target=current,
            reason=f"{figures}; trainer starving, but no batch for {since_advance:.0f}s, in "
            f"which {active} active workers at {memory.per_worker_seqs_s or 0.0:.2f} seq/s "
            f"make {expected / batch:.1f} batches: production stopped, not a demand to "
            f"chase -> hold {current}",
            memory=memory,
        )
    # A removal since the growth voids its test: the pool it grew is gone, and what the
    # present one makes, later, compares with production before it only by chance (groups
    # that grow longer over the run read as a saturating inference).
    removed = memory.last_down_t is not None and memory.last_down_t >= memory.probe_t
    probing = (
        probe_grown(memory, active)
        and t - memory.probe_t <= 3 * startup + 3 * settle
        and not removed
    )
    added = (active - memory.probe_workers) / max(memory.probe_workers, 1)
    gained = production / memory.probe_seqs_s - 1 if memory.probe_seqs_s > 0 else added
    # What the grown pool made over eight of its steps (and 30 s) since its workers were in
    # shows a rise before the average does (it holds the pool before the growth for a
    # settle time, and a starving trainer would wait two of them). It only passes the test:
    # with heavy tails eight steps of production are too noisy to call saturation on.
    step_s = policy.step_s(memory, batch) or math.inf
    if memory.probe_made_s >= max(PROBE_STEPS * step_s, PROBE_MIN_S):
        made = memory.probe_made_seqs / memory.probe_made_s
        gained = max(gained, made / memory.probe_seqs_s - 1 if memory.probe_seqs_s else 0.0)
    if probing and not settled and (gained >= added / 2 or growth_shown(memory, active)):
        # Production, averaged, lags what the pool makes: a rise that already shows half
        # of what the workers added should make passes the test early (the trainer is
        # starving meanwhile); only a shortfall needs the settle times to be told.
        probing = False
    if probing and settled:
        if gained < added / 2:
            per_worker = memory.probe_seqs_s / memory.probe_workers
            cap = max(memory.probe_workers, math.ceil(production / per_worker - 1e-9))
            cap = max(cap, context.min_workers)
            until = t + 10 * startup
            return Decision(
                target=cap,
                reason=f"{figures}; {active} workers make {production:.1f} seq/s, "
                f"{memory.probe_workers} made {memory.probe_seqs_s:.1f}: the shared "
                f"inference saturates, holding {cap} workers",
                memory=replace(
                    memory, probe_workers=0, saturated_workers=cap, saturated_until_t=until
                ),
            )
    elif probing:
        return Decision(
            target=current,
            reason=f"{figures}; trainer starving, the last workers added are still "
            f"warming up -> hold {current}",
            memory=memory,
        )
    if t < memory.saturated_until_t and memory.saturated_workers is not None:
        cap = memory.saturated_workers
        return Decision(
            target=min(current, cap) if current > cap else current,
            reason=f"{figures}; trainer starving, but the shared inference saturates near "
            f"{cap} workers -> hold {min(current, cap)}",
            memory=memory,
        )
    if current >= context.max_workers:
        return at_maximum(policy, context, memory, figures, startup)
    # In proportion to how much of the last start-up the trainer went hungry: a dip in the
    # jitter adds a little, a trainer that sped up unseen doubles the pool per start-up.
    factor = 1 + (policy.max_up_factor - 1) * memory.hungry_share
    # The hungry share takes a start-up to rise. Within a few start-ups of the trainer being
    # seen to speed up (while a batch waited, so not the pool's own rise), its quick rate over
    # the demand before, r, is how many times what it took it takes now (starving, at least
    # that): the growth takes up to r at once.
    rose = _sped_up_by(memory, t, startup)
    why = ""
    if min(rose, policy.max_up_factor) > factor:
        factor = min(rose, policy.max_up_factor)
        why = f", the trainer sped up x{rose:.1f}"
    grown = max(current + 1, math.ceil(current * factor - 1e-9))
    target = max(workers, grown)
    memory = replace(
        memory,
        probe_workers=active,
        probe_seqs_s=production,
        probe_t=t,
        probe_made_seqs=0.0,
        probe_made_s=0.0,
    )
    placed = t - memory.active_changed_t >= startup
    if placed and policy.fell_from_limit(memory) and active >= current:
        memory = replace(
            memory, short_workers=current, short_demand_seqs_s=memory.demand_seqs_s or 0.0
        )
    return Decision(
        target=target,
        reason=f"{figures}; trainer starving, what it takes is only what the envs make: "
        f"growing x{factor:.2f}{why} -> {target} workers",
        memory=memory,
    )


def _sped_up_by(memory: BufferMemory, t: float, startup: float) -> float:
    """How many times faster the trainer's quick rate reads than the demand before it was
    seen to speed up, where that was lately (1.0: not sped up)."""
    before = memory.sped_up_from_seqs_s
    fast = max(memory.fast_demand_seqs_s or 0.0, memory.sped_up_to_seqs_s)
    if not sped_up_lately(memory, t, startup) or before <= 0 or not fast:
        return 1.0
    return max(fast / before, 1.0)


def growth_shown(memory: BufferMemory, active: int) -> bool:
    """Starving, the trainer takes each batch as the envs make it, so its quick step rate is
    what the pool makes now: once that shows half of what the workers added last make, their
    first groups are in (however short the start-up and the groups)."""
    fast, before, workers = memory.fast_demand_seqs_s, memory.up_from_seqs_s, memory.up_from_workers
    if not (fast and before > 0 and 0 < workers < active):
        return False
    added = (active - workers) / workers
    return fast / before - 1 >= added / 2
