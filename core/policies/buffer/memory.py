"""What the buffer policy carries from one queue sample to the next."""

from __future__ import annotations

import math
from collections.abc import Iterable

import attrs

from core.policies.buffer.constants import SPEEDUP_MIN_S, SPEEDUP_STARTUPS
from core.records import replaceable

__all__ = ["BufferMemory", "average", "floats", "settle_s", "sped_up_lately"]


def floats(value: Iterable[float]) -> tuple[float, ...]:
    return tuple(float(v) for v in value)


def settle_s(step_s: float | None) -> float:
    """How long the queue and production take to show a change: four trainer steps, 10 s at
    least (a worker's first groups, the queue leaving the limit)."""
    return max(4 * (step_s or 0.0), 10.0)


@replaceable
@attrs.frozen(slots=True, kw_only=True)
class BufferMemory:
    last_t: float
    last_queued_seqs: int
    last_step: int
    #: Workers active at the last sample (those active throughout an interval produce in it).
    last_active: int = 0
    queue_seqs: float = 0.0
    demand_seqs_s: float | None = None
    #: The same over three steps: a trainer that speeds up is believed at once.
    fast_demand_seqs_s: float | None = None
    #: When the trainer step was last seen to advance (None: never).
    last_advance_t: float | None = None
    #: When the trainer took a batch again after a pause (None: no pause seen, or its demand
    #: measured since over the window rule 4 waits for).
    resumed_t: float | None = None
    #: The count a pause let go to the minimum, brought back at the trainer's next step (None:
    #: no pool let go).
    workers_before_pause: int | None = None
    #: The count that came back after a pause, while its workers are still starting: their p
    #: is the one measured before it (None: none coming back).
    returning_workers: int | None = None
    per_worker_seqs_s: float | None = None
    #: The same over a quarter of its window: it shows a fall (longer groups) sooner.
    recent_per_worker_seqs_s: float | None = None
    #: Share of the samples of the last start-up that found less than half a batch queued.
    hungry_share: float = 0.0
    #: Everything that entered the queue (seq/s), over the demand window.
    production_seqs_s: float | None = None
    #: Seconds of measurement behind each estimate, up to its window (the warm-up weights).
    queue_seen_s: float = 0.0
    demand_seen_s: float = 0.0
    production_seen_s: float = 0.0
    integral_seqs_s: float = 0.0
    #: The count in force at the last sample, and when the last applied change went each way.
    last_desired: int | None = None
    last_up_t: float | None = None
    #: The workers active and the trainer's quick rate when the pool last went up (starving,
    #: that rate is what they made).
    up_from_workers: int = 0
    up_from_seqs_s: float = 0.0
    last_down_t: float | None = None
    #: The need (D / p, in workers) when the pool last went down (0: unknown, or on purpose: a
    #: saturation test or a pause let go).
    down_need_workers: float = 0.0
    #: Removals an addition undid at about the same need, as of ``flaps_t`` (they count half as
    #: much an hour later), and the need at the last of them.
    flaps: float = 0.0
    flaps_t: float = 0.0
    flap_need_workers: float = 0.0
    #: When each worker still starting was first counted, oldest first.
    pending_t: tuple[float, ...] = attrs.field(default=(), converter=floats)
    startup_s: float | None = None
    startups_seen: int = 0
    #: When the active count last rose (a worker's first groups are still in generation).
    active_changed_t: float = 0.0
    #: When the queue was last near the off-policy limit (envs held back; they take a group
    #: latency to produce at full rate again).
    limit_t: float | None = None
    #: Production's departure from p x workers summed since ``spread_since_t``, and the mean
    #: square of those sums over start-up-long spans.
    spread_sum_seqs: float = 0.0
    spread_worker_s: float = 0.0
    spread_since_t: float | None = None
    #: The last span's production per worker (seq/s).
    spread_rate_seqs_s: float | None = None
    spread_var_seqs2: float | None = None
    spreads_seen: int = 0
    #: The last growth while starving: active workers and total production before it.
    probe_workers: int = 0
    probe_seqs_s: float = 0.0
    probe_t: float = 0.0
    #: What the grown pool made once its workers were in (active and past their first groups):
    #: sequences and seconds, so a rise shows before the average (which still holds the pool
    #: before the growth) does.
    probe_made_seqs: float = 0.0
    probe_made_s: float = 0.0
    #: The highest per-worker production measured (inference not yet shared by many).
    best_per_worker_seqs_s: float = 0.0
    #: A removal made to see whether production falls with it (at the maximum, starving):
    #: active workers and their production before it, and when.
    shed_workers: int = 0
    shed_seqs_s: float = 0.0
    shed_t: float = 0.0
    #: The most a pool made in a series of such removals (what the shared inference gives).
    capacity_seqs_s: float = 0.0
    #: No such removal before this time.
    no_shed_until_t: float = 0.0
    #: Production per worker at the maximum when such a removal showed no saturation: the next
    #: is tried only once it falls well below this (0: none tried yet).
    unsaturated_per_worker_seqs_s: float = 0.0
    #: The fewest workers active throughout an interval in which p was measured (0: none).
    fewest_measured_workers: int = 0
    #: When the trainer's quick rate last read a speed-up while a batch waited, and the demand
    #: before the first such reading of that speed-up (None: none seen). A starving trainer's
    #: growths follow it for ``SPEEDUP_STARTUPS`` start-ups (``SPEEDUP_MIN_S`` at least).
    sped_up_t: float | None = None
    sped_up_from_seqs_s: float = 0.0
    #: The quick rate at that first reading.
    sped_up_to_seqs_s: float = 0.0
    #: The demand when the quick rate began to read 10-25% above it (None: not rising). The
    #: demand follows the quick rate half-way there, so a trainer that speeds up step by step
    #: (a 2x speed-up seen through three steps' average) would never read 25% above it.
    rising_from_seqs_s: float | None = None
    #: The count the shared inference saturates at, and until when that holds.
    saturated_workers: int | None = None
    saturated_until_t: float = 0.0
    #: Since when the pool has held more workers than the need plus the removal margin, with
    #: the queue above the band (None: not now). A removal needs a window of it.
    excess_since_t: float | None = None
    #: The last count found short (the trainer starved or the queue fell below the band at
    #: it), and the demand then: no removal goes back to it unless demand fell by more than a
    #: worker makes.
    short_workers: int | None = None
    short_demand_seqs_s: float = 0.0
    #: Seconds of production measured since the active count last rose (p is then the present
    #: pool's, not a stale one).
    fresh_s: float = 0.0
    #: p holds intervals soon after the queue was near the off-policy limit (the stand-in its
    #: first settle time of measurement allows), and whether an interval measured away from
    #: the limit has since started it afresh (from then on only such intervals count).
    near_limit_p: bool = False
    restarted_away_p: bool = False
    #: When a sample last found the queue away from the off-policy limit for a settle time
    #: (None: never).
    away_t: float | None = None
    #: Since when every sample found the queue full (within an eighth of a batch of the
    #: off-policy limit), and the trainer step then (None: the last sample was not full).
    full_since_t: float | None = None
    full_since_step: int = 0
    #: Samples since the queue was last away from the off-policy limit or the pool last
    #: shrank, and how many of them found it full.
    limit_samples: int = 0
    full_samples: int = 0
    #: A take from the full queue that left it short: the sample before it (the take came
    #: after) and the batches taken (None: no refill under way).
    refill_from_t: float | None = None
    refill_batches: int = 0
    #: Worker-seconds per batch the full queue took to be full again after each recent take
    #: (from the sample before the take: at most that), newest last; none since the active
    #: count last rose.
    refills_worker_s: tuple[float, ...] = attrs.field(default=(), converter=floats)
    #: When the newest of them was timed (None: none).
    refill_t: float | None = None
    #: The count the last removal on refills kept (0: none since workers last came): the
    #: share rules at the limit step no lower.
    refill_kept_workers: int = 0
    #: The count a cold start asked for before any rate was known (0: none, or the queue has
    #: left the off-policy limit or the pool grown to a measured count since).
    cold_workers: int = 0
    #: When the queue last stood at the off-policy limit with less than a batch landed since
    #: (None: a batch landed since, or it was not there), and when it then fell below a batch.
    unfed_limit_t: float | None = None
    unfed_below_t: float | None = None
    #: The trainer's step when it stood there.
    unfed_limit_step: int = 0
    #: Sequences landed since it stood there (a batch ends the watch).
    unfed_made_seqs: int = 0
    #: When the trainer then waited a step or more, within the last ``STALL_WINDOW_S``, and
    #: whether that is reported (from the third until none is left in the window).
    stall_times: tuple[float, ...] = attrs.field(default=(), converter=floats)
    stalls_reported: bool = False
    #: How long the trainer waited in the last such visit, from the queue falling below a batch
    #: to a batch landing (0: none ended yet).
    stall_wait_s: float = 0.0
    #: The count the stall rule (:mod:`.stalls`) last stepped down to, and the count a growth
    #: after such a step brought, below which it steps no more (0: none since stalls were
    #: last reported).
    stall_shed_workers: int = 0
    stall_floor_workers: int = 0
    #: When the trainer last restarted (its step went back), or the queue was flushed or no
    #: worker was active while watched (None: never): the queue is short for that, not for
    #: the envs starting again.
    restarted_t: float | None = None


def average(value: float | None, sample: float, seen_s: float, dt: float, window_s: float) -> float:
    """Exponential average over ``window_s``; the exact running mean while less was seen."""
    if value is None or seen_s <= 0:
        return sample
    weight = dt / (seen_s + dt) if seen_s < window_s else 1.0 - math.exp(-dt / window_s)
    return value + weight * (sample - value)


def sped_up_lately(memory: BufferMemory, t: float, startup_s: float) -> bool:
    """Whether the trainer was seen to speed up within ``SPEEDUP_STARTUPS`` start-ups of ``t``
    (``SPEEDUP_MIN_S`` at least)."""
    window_s = max(SPEEDUP_STARTUPS * startup_s, SPEEDUP_MIN_S)
    return memory.sped_up_t is not None and t - memory.sped_up_t <= window_s
