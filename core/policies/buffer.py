"""``buffer``: the default for trainer queues. Hold the queue within target +- band batches.

Units are sequences throughout: a queue sample carries queued sequences (Atropos: queued groups x
group size) and the trainer's batch size B in sequences.

Why a band. The trainer starves when a step ends with less than a batch queued, and every batch
queued ahead of a sequence is a step of off-policy lag. With whole workers, production rarely
equals demand, so the count alternates between neighbours and the queue drifts between the edges
of ``target +- band_batches``; the rules below keep those alternations minutes apart.

Everything the rules need is measured from the samples, so one set of defaults serves a trainer
stepping every 0.3 s and one stepping every minute, workers that start in 5 s and in 3 minutes:

* the step time s = B / D and the demand D (seq/s): batches taken x B between trainer advances,
  averaged over 30 steps (at most ``rate_window_s``); a quick estimate, the step time averaged
  over the last 3 steps (after a speed-up, 3 of the new ones), replaces it when 25% higher or
  lower (a trainer that changed speed). A span without an advance while a batch waited for
  more than four steps is a pause (evaluation, checkpoint, restart): demand is measured afresh
  after it, and nothing is removed until it has been;
* the queue Q, smoothed over two steps (the saw-tooth of batches taken is noise);
* per-worker production p (seq/s/worker): what entered the queue (its change plus what the
  trainer took) over the workers active throughout the interval, over ``production_window_s``,
  only below 0.8 x ``max_batches_offpolicy`` batches and a few steps after the queue was last
  there (envs hold back near atroposlib's limit and take a group latency to produce at full rate
  again), and a few steps after workers came (their first groups are all in generation; a cold
  pool's first reading too: the interval its workers came in reads their first groups landing
  together). p is measured over a quarter of that window too, and where that reads 10% lower
  with the same workers active throughout the window, it is used instead: production per
  worker that falls as responses grow longer reads high over the whole window, and the pool
  falls short (a fall that came with more workers may be a saturating inference service).
  For its first settle time of measurement p counts intervals soon after the queue was near
  the limit too (a queue that nears it every few steps would leave p unmeasured). At the
  limit a queue that stays full proves p >= D / active, which is used when higher; so does a
  queue held above the band's top that was near the limit within a settle time (there p is
  left to the intervals after each visit, when the groups the limit cancelled are still in
  generation, and reads low: a large pool read 0.73-0.79 seq/s per worker for half an hour
  while its 117-127 workers held the queue up there, which proves 1.0-1.1);
* the start-up time T: from the sample at which a worker was first counted to the one at which it
  was first active (``startup_prior_s`` until one has been seen, or the age of the oldest worker
  still starting when longer);
* how hungry the trainer was: the share of the samples over the last start-up that found less
  than half a batch queued;
* the spread of production over a start-up: how much what the pool makes per worker over one
  start-up-long span differs from the next (heavy-tailed group latencies make it large). With
  ``target_batches`` 0 (the default), the target is 1 batch plus ``spread_k`` spreads, so a
  steady load keeps a short queue (little lag) and a bursty one a deeper buffer, never past
  ``max_batches_offpolicy - 1`` (atroposlib discards older groups);
* saturation: while the trainer starves the pool grows in steps (below); when a step's workers are
  active and the total production rose by less than half of what they should have added, the
  shared inference service is the bottleneck: the pool is held at the count that makes that
  production, and tried again only after 10 start-ups. Production is averaged, so that is judged
  two settle times after the workers came; a rise already half as large before then passes at once
  (the trainer is starving meanwhile), in the average or in what the grown pool made over eight
  steps (30 s at least) from a settle time after its workers came (their first groups are in
  generation until then; too few steps to call saturation on with heavy tails). Short at the
  pool's maximum with a trainer that waits (less than a batch queued, the queue not near the
  off-policy limit, where envs hold back), a removal tests for saturation: a quarter of the pool
  when production per worker fell below 70% of its best; without such a sign (a pool saturated
  from its first measurement), an eighth, no more than a step past the knee may cost (below) but a
  sixteenth at least (a smaller fall is lost in the noise of production), and only if the pool was
  never measured at the count the test would try. Production that held up (fell by less than a
  quarter of the share removed) means saturation: while the trainer still waits, fewer: first the
  count that makes the most the series made at the best production per worker ever measured, when
  the pool is larger (sharing only lowers production per worker, so that many make as much and the
  knee is no higher; at most half the pool at a time), then steps of twice the last, capped at a
  quarter and at the share whose loss for the time a step past the knee takes to be judged and
  brought back (two settle times and a start-up) is 36 s of the pool's production, 1% of an hour,
  but the cap never below an eighth. The step that passes the knee shows production falling, and
  workers there run unshared, so the knee is the count that makes, at their production per worker,
  the most a pool of the series made (a fall of less than half the share removed is measured for
  up to four settle times before it is told from noise), and their production per worker is the
  best from then on. That count is held for 30 start-ups. A fall already clear after one settle
  time is judged then, on the level it is heading for, so a pool below the knee is not kept there
  long. Production that fell at the first removal means the trainer simply wants more: back to the
  maximum, not tested again until production per worker falls well below what it was then.

The count the policy works from is the one the reducer applied: ``PolicyContext.desired``
tells, on the next call, whether the last decision was applied or dropped (stabilization window,
bounds), and only an applied change restarts the policy's timers.

The model is feed-forward plus PI on the error e = target - Q (anti-windup: the integral is
frozen while the count is pinned at a bound, and clamped); the proportional time R is
``refill_s`` or, by default (0), 2 x (T + 4 s); balance is ceil(D / p):

    n = ceil((D + (e + I / integral_s) / R) / p)

Rules, in order:

1. Cold start: until D and p are known, a cold pool (no worker active yet, or a trainer that has
   taken no batch) whose queue is short of the target starts every worker it may (the fastest
   way to a first batch; not a scale-up for the stabilization window, so the excess is shed as
   soon as both are known); otherwise the pool holds. A reconfigured pool keeps what the policy
   measured when only the parameters change.
2. Starving: Q under 0.6 batch and no sample of the last two reaching a batch: the trainer waits
   and takes only what the envs make, so demand is at least that. Once a start-up has passed
   since the last applied addition, grow by 1 + (``max_up_factor`` - 1) x the hungry share (a
   dip in the jitter adds a worker or two; a trainer that sped up unseen doubles the pool per
   start-up), unless the shared inference saturates (or the pool is at its maximum), and not
   while the last addition's workers have just become active. No batch for the time the active
   workers at the measured p make two is an outage of production (inference down), not demand:
   the pool holds. Saturation is judged on the production measured, never on p x workers.
3. Add: a queue below the target that, projected a start-up ahead (or a step, where a step is
   longer; workers still starting count from half-way through a start-up), would fall below the
   band's bottom x min(step / start-up, 1)^2, or stays below the band: up to max(n, balance,
   count + 1) (not the + 1 while workers are still starting). Over a start-up of many steps
   the queue falls smoothly at the measured drift, and the bound is about empty (a larger one
   adds workers on the rates' noise: a reversal an hour more on a steady load); a trainer
   that steps seldom takes a whole batch at a time, and the queue, smoothed over two steps,
   reads a step late, so there the pool grows before the queue leaves the band, where the
   trainer starts to wait (a batch of 1024 every 44 s with 10-s start-ups: 4.1-5.2% of the
   time starved avoidably with a projection to empty, 1.0-1.5% with this).
   Within a start-up of a removal only a queue below the band adds workers, and nothing is
   added while the last addition's workers have just become active (their groups are still in
   generation).
4. Hold up to the band's top, while a batch waits but the trainer takes none for four steps (a
   pause, or a slowdown: the next step tells), and until demand has been measured after a pause.
   With ``pause_release_startups`` k > 0, a pause that has lasted k start-ups lets the pool go to
   its minimum and the trainer's next step brings the count back at once (p, measured with
   those workers, stays theirs: a slowdown taken for a pause costs a restart, not p): the workers
   of a long evaluation are not held idle, for about a start-up of waiting when it ends (0, the
   default: held through pauses, so the trainer is never caught short by one).
5. Remove when both Q and the latest sample are above the band, with hysteresis in whole workers (a
   fractional need would otherwise make the count alternate between neighbours): the count must
   exceed the need D / p by a whole worker plus the production spread in workers (how far
   production wanders over a start-up, or over a step where that is longer: the trainer sees
   nothing shorter), and, unless it exceeds it by twice that, for 3 start-ups and 8 steps in a row.
   The removal goes to max(ceil(need + spread), safe, count - ``max_down_fraction`` x count), where
   safe is the fewest workers that keep the queue inside the band for a start-up at the measured
   demand; workers still starting (they make nothing yet) go beyond that share, down to the
   workers up or twice the need, whichever is more (a cold pool that went to the maximum, its
   need measured from its first wave). p measured before a removal stays the pool's after it
   (each worker left makes at least what it made); after a growth it is measured afresh for two
   start-ups. At the off-policy limit (where p is then not measured and rests on its bound) a
   twentieth of the pool at a time; with
   the queue held there for a whole cooldown, up to a tenth: the share whose shortfall (at most
   that share of D, since every worker makes at least D / n) the two batches above the band cover
   for a start-up, 2 steps / start-up. With the queue full (within an eighth of a batch of the
   limit, either side: a backlog above it proves nothing) at every sample for a whole cooldown
   while the trainer took batches, each batch taken was made again within a sample interval, so the
   pool makes at least D x (1 + step / interval): up to step / (interval + step) of it (and
   ``max_down_fraction``) goes at once, whatever p reads. With the queue held at the limit for a
   whole cooldown by the workers up, every worker still starting goes at once (it would make
   nothing the trainer takes: a cold start that went to the maximum keeps only its first waves;
   not within a cooldown of a worker exiting early: the retries tell a crash loop). Once a count
   has been found short, a twentieth, and only down to the need plus the spread at the p last
   measured. No removal goes back to the last count found short (rule 3 added to it with the pool
   in place, its workers' groups in, and p measured over its window or the queue about to empty;
   or rule 3 or 2 added to it after this pool had held the queue at the limit) unless demand fell
   by more than a worker makes and by 40%: that count emptied the queue once. At most once per
   max(``down_cooldown_s``, T, min(4 steps, 2 T)): each removal shows in the queue before the
   next. Flap damping: each removal that an addition undid while the need D / p had not risen
   by more than 10% (the removal was wrong: neither a faster trainer nor slower groups made the
   addition) widens what later removals keep by a whole worker plus the spread, and the excess
   a removal needs in proportion; such flaps count half as much after an hour, at most three
   count, and none once the need has fallen by more than 10% since the last (a slower trainer:
   a new load). Where jitter alone sometimes starves a count that the need says holds
   (minute-long groups, whose queue swings from empty to the off-policy limit), the pool then
   settles higher instead of cycling between that count and a growth.

What no count fixes is reported (``Decision.alerts``): ``offpolicy_stalls`` from the third time
within 30 minutes the queue fell from the off-policy limit to under a batch with less than a batch
landing and the trainer then waited a step or more, until 30 minutes pass without one. Groups
outlast the batches the queue held there, and the envs stopped at the limit (atroposlib's cancel
the groups in generation), so each visit costs a wait whatever the pool: the remedy is a larger
``max_batches_offpolicy`` or shorter groups. While such a fall has landed less than a batch, the
pool holds (rule 3 does not read it as a short pool).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import ClassVar

import attrs

from core.errors import ConfigError
from core.events import QueueSampled
from core.policies.base import Decision, PolicyContext
from core.records import replace, replaceable
from core.vocabulary import AlertName

__all__ = ["BufferMemory", "BufferPolicy"]

#: Steps the demand estimate spans, and the quick estimate that catches a speed-up.
_DEMAND_STEPS = 30.0
_FAST_STEPS = 3.0
#: Steps without an advance, with a batch waiting, that make a pause.
_PAUSE_STEPS = 4.0
#: A removal within twice its margin waits this many start-ups plus trainer steps of excess.
_REMOVAL_STARTUPS = 3.0
_REMOVAL_STEPS = 8.0
#: Starving, no batch for the time the pool makes this many at its measured rate: an outage.
_OUTAGE_BATCHES = 2.0
#: Start-ups a knee found by removals (the count the shared inference saturates at) holds.
_KNEE_STARTUPS = 30.0
#: Production per worker below this share of its best at the maximum: a sign of saturation.
_FELL = 0.7
#: A smaller pool whose production fell by less than this share of the workers removed (a
#: quarter of a proportional fall): saturated.
_HELD = 0.25
#: A step past the knee loses what it removes until it is judged and brought back: at most this
#: many seconds of the pool's production (1% of an hour) per step, and at most a quarter.
_PAST_KNEE_COST_S = 36.0
_SHED_MAX_SHARE = 1 / 4
#: At the off-policy limit a removal takes a twentieth of the pool; with the queue held there
#: for a whole cooldown, up to a tenth (the batches the full queue holds above the band cover
#: the shortfall for this many trainer steps per start-up).
_LIMIT_SHARE = 1 / 20
_PINNED_SHARE = 1 / 10
_PINNED_STEPS = 2.0
#: A sample this close to the off-policy limit (in batches, either side) finds the queue full.
_FULL_SLACK_BATCHES = 1 / 8
#: A removal keeps workers still starting only up to this many times the need.
_STARTING_NEEDS = 2.0
#: A removal undone by an addition while the measured need (D / p) is no more than this share of
#: what it was then was a flap; flaps count half as much after this long, and at most this many
#: count.
_SAME_LOAD = 1.1
_FLAP_HALF_LIFE_S = 3600.0
_FLAPS_MAX = 3.0
#: The trainer left waiting a step with less than a batch landing after the queue fell from the
#: off-policy limit this many times within the window: reported (``offpolicy_stalls``).
_STALLS_TO_ALERT = 3
_STALL_WINDOW_S = 1800.0
#: A growth while starving passes its test early on what the grown pool made over this many
#: steps (and seconds) once its workers were in.
_PROBE_STEPS = 8.0
_PROBE_MIN_S = 30.0
#: p is also measured over this share of its window; where that reads this share of p or
#: less, production per worker is falling (groups growing longer) and it is used instead.
_RECENT_WINDOW_SHARE = 1 / 4
_FALLING = 0.9


def _floats(value: Iterable[float]) -> tuple[float, ...]:
    return tuple(float(v) for v in value)


def _settle_s(step_s: float | None) -> float:
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
    #: When the trainer took a batch again after a pause (None: no pause seen).
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
    pending_t: tuple[float, ...] = attrs.field(default=(), converter=_floats)
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
    #: When a sample last found the queue away from the off-policy limit for a settle time
    #: (None: never).
    away_t: float | None = None
    #: Since when every sample found the queue full (within an eighth of a batch of the
    #: off-policy limit), and the trainer step then (None: the last sample was not full).
    full_since_t: float | None = None
    full_since_step: int = 0
    #: When the queue last stood at the off-policy limit with less than a batch landed since
    #: (None: a batch landed since, or it was not there), and when it then fell below a batch.
    unfed_limit_t: float | None = None
    unfed_below_t: float | None = None
    #: Sequences landed since it stood there (a batch ends the watch).
    unfed_made_seqs: int = 0
    #: When the trainer then waited a step or more, within the last ``_STALL_WINDOW_S``, and
    #: whether that is reported (from the third until none is left in the window).
    stall_times: tuple[float, ...] = attrs.field(default=(), converter=_floats)
    stalls_reported: bool = False
    #: How long the trainer waited in the last such visit, from the queue falling below a batch
    #: to a batch landing (0: none ended yet).
    stall_wait_s: float = 0.0


def _average(
    value: float | None, sample: float, seen_s: float, dt: float, window_s: float
) -> float:
    """Exponential average over ``window_s``; the exact running mean while less was seen."""
    if value is None or seen_s <= 0:
        return sample
    weight = dt / (seen_s + dt) if seen_s < window_s else 1.0 - math.exp(-dt / window_s)
    return value + weight * (sample - value)


@attrs.frozen(slots=True, kw_only=True)
class BufferPolicy:
    reacts_to: ClassVar[type[QueueSampled]] = QueueSampled
    #: The queue to hold, in batches (0: 1 batch plus the measured spread of production).
    target_batches: float = 0.0
    #: Seconds over which a buffer error is to be made up (0: 2 x (start-up + 4 s)).
    refill_s: float = 0.0
    #: Integral time: how slowly a persistent error is integrated away.
    integral_s: float = 1800.0
    #: The longest window of the demand estimate (it spans 30 trainer steps when shorter).
    rate_window_s: float = 300.0
    #: Window of the per-worker production estimate.
    production_window_s: float = 300.0
    #: atroposlib's max_batches_offpolicy: envs stop producing once this many batches are queued.
    max_batches_offpolicy: float = 3.0
    #: The queue is held within target +- band_batches.
    band_batches: float = 0.5
    #: With no target given: how many measured spreads of production the buffer covers.
    spread_k: float = 1.0
    #: A worker's start-up time until one has been measured.
    startup_prior_s: float = 30.0
    #: While starving, the pool grows by up to this factor per start-up.
    max_up_factor: float = 2.0
    max_down_fraction: float = 0.25
    #: At least this long between removals (they are also spaced by a start-up).
    down_cooldown_s: float = 0.0
    #: A pause (no trainer step while a batch waits) that has lasted this many start-ups lets
    #: the pool go to its minimum, and the trainer's next step brings the count back at once
    #: (0: the pool is held through pauses; the trainer then waits about a start-up after each).
    pause_release_startups: float = 0.0

    def __attrs_post_init__(self) -> None:
        for field in attrs.fields(type(self)):
            # An infinite or NaN parameter passes the range checks below but breaks the
            # arithmetic (a pool of infinitely many workers, a cooldown no time ever exceeds).
            value = getattr(self, field.name)
            if not math.isfinite(value):
                raise ConfigError(f"policy.{field.name} must be a finite number, got {value!r}")
        for key in (
            "integral_s",
            "rate_window_s",
            "production_window_s",
            "max_batches_offpolicy",
            "startup_prior_s",
        ):
            if not getattr(self, key) > 0:
                raise ConfigError(f"policy.{key} must be > 0, got {getattr(self, key)!r}")
        for key in ("target_batches", "refill_s"):
            value = getattr(self, key)
            if not value >= 0:
                raise ConfigError(f"policy.{key} must be >= 0 (0: measured), got {value!r}")
        if not self.max_up_factor > 1:
            raise ConfigError(f"policy.max_up_factor must be > 1, got {self.max_up_factor!r}")
        if not self.spread_k >= 0:
            raise ConfigError(f"policy.spread_k must be >= 0, got {self.spread_k!r}")
        if not 0 < self.max_down_fraction <= 1:
            raise ConfigError(
                f"policy.max_down_fraction must be in (0, 1], got {self.max_down_fraction}"
            )
        lowest_target = self.target_batches or 1.0
        if not 0 <= self.band_batches < lowest_target:
            raise ConfigError(
                f"policy.band_batches must be in [0, target_batches), got {self.band_batches}"
            )
        for key in ("down_cooldown_s", "pause_release_startups"):
            if not getattr(self, key) >= 0:
                raise ConfigError(f"policy.{key} must be >= 0, got {getattr(self, key)!r}")

    def initial_target(self, min_workers: int, max_workers: int) -> int:
        return min_workers

    # --- measured parameters ---------------------------------------------------------------------

    def startup(self, memory: BufferMemory) -> float:
        """The start-up time: measured, or the prior (the oldest worker still starting when
        older than either: a start-up is at least that long)."""
        measured = memory.startup_s if memory.startup_s is not None else self.startup_prior_s
        oldest = memory.last_t - memory.pending_t[0] if memory.pending_t else 0.0
        return max(measured, oldest if memory.startup_s is None else 0.0)

    def target(self, memory: BufferMemory, batch: int) -> float:
        """The queue to hold, in batches."""
        if self.target_batches:
            return self.target_batches
        spread = 0.0
        if memory.spread_var_seqs2 is not None and memory.spreads_seen >= 2:
            spread = math.sqrt(memory.spread_var_seqs2) / batch
        ceiling = max(self.max_batches_offpolicy - 1.0, 1.0)
        return min(1.0 + self.spread_k * spread, ceiling)

    @staticmethod
    def in_force(context: PolicyContext) -> int:
        """The count the pool is being brought to (workers not yet requested included)."""
        return context.current if context.desired is None else context.desired

    @staticmethod
    def step_s(memory: BufferMemory, batch: int) -> float | None:
        demand = memory.demand_seqs_s
        return batch / demand if demand else None

    def per_worker(self, memory: BufferMemory) -> float | None:
        """Production per worker as the rules use it: over its window, or over the recent
        quarter of it where that reads 10% lower with the same workers active over the whole
        window (their groups grow longer, which the whole window trails: the pool it sizes
        would fall short). A fall that came with more workers may be a shared inference
        saturating, which more workers would not help: the growth rule judges that."""
        whole, recent = memory.per_worker_seqs_s, memory.recent_per_worker_seqs_s
        unchanged = memory.last_t - memory.active_changed_t >= self.production_window_s
        if whole and recent and unchanged and recent <= _FALLING * whole:
            return recent
        return whole

    def _demand_window_s(self, step_s: float | None) -> float:
        if step_s is None:
            return self.rate_window_s
        return min(max(_DEMAND_STEPS * step_s, 4.0), self.rate_window_s)

    # --- deciding --------------------------------------------------------------------------------

    def decide(self, context: PolicyContext, memory: BufferMemory | None) -> Decision:
        decision = self._decide(context, memory)
        after = decision.memory
        assert isinstance(after, BufferMemory) and context.queue is not None
        count = len(after.stall_times)
        reported = count >= _STALLS_TO_ALERT or (after.stalls_reported and count > 0)
        if reported != after.stalls_reported:
            decision = attrs.evolve(decision, memory=replace(after, stalls_reported=reported))
        if not reported:
            return decision
        stalls = (AlertName.OFFPOLICY_STALLS, self._stalls_reason(after, context.queue))
        return attrs.evolve(decision, alerts=(stalls,))

    def _stalls_reason(self, memory: BufferMemory, sample: QueueSampled) -> str:
        limit = self.max_batches_offpolicy
        step_s = self.step_s(memory, sample.batch_size_seqs)
        lasts = f" ({(limit - 1) * step_s:.0f}s at a step per {step_s:.1f}s)" if step_s else ""
        to = ""
        if step_s and memory.stall_wait_s > 0:
            # The queue above one batch lasts a step more per batch of limit.
            covered = math.ceil(limit + memory.stall_wait_s / step_s)
            to = f" to {covered} at least (the last wait was {memory.stall_wait_s:.0f}s)"
        return (
            f"the trainer waited a step or more with less than a batch landing after the queue "
            f"fell from the off-policy limit ({limit:g} batches), {len(memory.stall_times)} "
            f"times in {_STALL_WINDOW_S / 60:.0f} minutes: groups take longer to land than the "
            f"queue above one batch lasts{lasts}, and the envs stop (atroposlib's cancel the "
            f"groups in generation) each time it reaches the limit. More workers do not shorten "
            f"the wait: raise max_batches_offpolicy (the envs' and this policy's){to}, or "
            f"shorten the groups"
        )

    def _decide(self, context: PolicyContext, memory: BufferMemory | None) -> Decision:
        sample = context.queue
        assert sample is not None  # the reducer asks only with a queue sample
        t, current = context.t, self.in_force(context)
        batch = sample.batch_size_seqs
        raw = sample.queued_sequences
        if memory is None:
            memory = BufferMemory(
                last_t=t,
                last_queued_seqs=raw,
                last_step=sample.trainer_step,
                last_active=context.active,
                queue_seqs=float(raw),
                last_desired=context.current if context.desired is None else context.desired,
                active_changed_t=t,
                pending_t=(t,) * max(context.current - context.active, 0),
            )
            return self._without_rates(context, memory, raw / batch)
        previous_raw = memory.last_queued_seqs
        dt = max(t - memory.last_t, 0.0)
        # Each sample decides anew whether the excess lasts (only the removal rule carries it).
        excess_since = memory.excess_since_t
        memory = replace(self._measure(context, memory), excess_since_t=None)
        if memory.workers_before_pause is not None and memory.last_advance_t == t:
            # The trainer steps again: what the pause let go comes back at once (its demand
            # is measured afresh from here, and the queue the pause filled feeds its first
            # steps), and p, measured with those workers, stays theirs.
            kept = memory.workers_before_pause
            memory = replace(memory, workers_before_pause=None)
            if current < kept:  # (not when the reducer held the pool: nothing was let go)
                target = min(kept, context.max_workers)
                capped = ", at the pool's maximum" if target < kept else ""
                return Decision(
                    target=target,
                    reason=f"queue {raw / batch:.2f} batches; the trainer stepped again after "
                    f"a pause -> {target} workers (the {kept} before it{capped})",
                    memory=replace(memory, returning_workers=target),
                )
        demand, per_worker = memory.demand_seqs_s, self.per_worker(memory)
        queue = memory.queue_seqs
        measurable = queue < self._offpolicy_seqs(batch)
        # Held up: above the band's top (the queue and its latest sample), near the off-policy
        # limit within a settle time. p is measured only away from the limit, so a queue that
        # hovers just below it leaves p to the intervals after each visit there, when the
        # groups the limit cancelled are still in generation, and p reads low (a cold start's
        # first reading, half the true one, can stand for minutes).
        target_batches = self.target(memory, batch)
        high_seqs = (target_batches + self.band_batches) * batch
        held_up = (
            memory.limit_t is not None
            and t - memory.limit_t < _settle_s(self.step_s(memory, batch))
            and min(queue, raw) > high_seqs
        )
        if demand and (not measurable or held_up) and context.active:
            # At the off-policy limit the envs hold back, so p cannot be measured there (and an
            # old measurement may read low); but a queue that stays full, or held up, means
            # every active worker makes at least D / active.
            per_worker = max(per_worker or 0.0, demand / context.active)
        if not per_worker or demand is None:  # not measured yet (or nothing produced)
            return self._without_rates(context, memory, queue / batch)

        startup = self.startup(memory)
        step_s = batch / demand if demand > 0 else math.inf
        refill = self.refill_s or 2 * (startup + 4.0)
        target_seqs = target_batches * batch
        error = target_seqs - queue
        # PI on the buffer error with conditional integration (anti-windup).
        integral = memory.integral_seqs_s
        candidate = integral + error * dt
        limit = 2 * target_seqs * self.integral_s
        candidate = min(max(candidate, -limit), limit)
        raw_n = (demand + (error + candidate / self.integral_s) / refill) / per_worker
        saturated_high = raw_n > context.max_workers and error > 0
        saturated_low = raw_n < context.min_workers and error < 0
        if not (saturated_high or saturated_low):
            integral = candidate
        wanted_rate = demand + (error + integral / self.integral_s) / refill
        workers = max(math.ceil(wanted_rate / per_worker - 1e-9), 0)
        memory = replace(memory, integral_seqs_s=integral)
        cap = memory.saturated_workers if t < memory.saturated_until_t else None
        # Feed-forward alone: the count that makes what the trainer takes.
        balanced = max(math.ceil(demand / per_worker - 1e-9), 0)
        if cap is not None:
            workers, balanced = min(workers, cap), min(balanced, cap)

        figures = (
            f"queue {queue / batch:.2f} batches (last {raw / batch:.2f}) vs target "
            f"{target_batches:.2f}; demand {demand:.1f} seq/s (a step per {step_s:.1f}s), "
            f"{per_worker:.2f} seq/s per worker, start-up {startup:.0f}s"
        )
        low_seqs = (target_batches - self.band_batches) * batch
        since_up = math.inf if memory.last_up_t is None else t - memory.last_up_t
        since_down = math.inf if memory.last_down_t is None else t - memory.last_down_t
        # Fed, the queue holds a batch or more before each step; starving, it never reaches one
        # and averages about half of one.
        starving = max(raw, previous_raw) < batch and queue < 0.6 * batch
        settle_s = _settle_s(step_s)
        if cap is not None and current > cap:
            return Decision(
                target=cap,
                reason=f"{figures}; the shared inference saturates near {cap} workers -> {cap}",
                memory=memory,
            )
        if memory.shed_workers:
            # A removal made to test for saturation: nothing else moves the pool until judged.
            settle = self._production_settle_s(memory, batch)
            return self._judge_shed(context, memory, figures, settle, startup, low_seqs)
        # The workers of the last addition just became active: their first groups are still in
        # generation, so a trainer still waiting is no reason to grow yet.
        warming = since_up < startup + settle_s and t - memory.active_changed_t < settle_s
        if memory.unfed_limit_t is not None and (starving or queue < target_seqs):
            # The envs stopped at the off-policy limit (atroposlib's cancel their groups in
            # generation there) and start again only as the trainer takes batches: what they
            # make lands a group latency later, however many there are. Not a short pool.
            return Decision(
                target=current,
                reason=f"{figures}; less than a batch landed since the queue left the "
                f"off-policy limit {t - memory.unfed_limit_t:.0f}s ago (the envs stopped "
                f"there) -> hold {current}",
                memory=memory,
            )
        if starving and since_up >= startup and not warming:
            return self._grow(context, memory, figures, workers, batch)
        if measurable and queue < target_seqs and not warming:
            # The queue is projected a start-up ahead, at the drift the rates give. A trainer
            # that steps seldom takes a whole batch at a time and the queue, smoothed over two
            # steps, reads a step late: look a step ahead at least, and add before the queue
            # would fall below the band's bottom (where the trainer starts to wait), scaled by
            # (step / start-up) squared; over a start-up of many steps, before it would empty
            # (a larger bound there adds workers on the rates' noise).
            horizon = max(startup, step_s) if math.isfinite(step_s) else startup
            floor_seqs = low_seqs * min(step_s / startup, 1.0) ** 2
            # Workers still starting produce only once started: credit them for the part of
            # the horizon after half a start-up (they are, on average, half-way there).
            starting = max(context.current - context.active, 0)
            drift = context.active * per_worker - demand
            projected = queue + drift * horizon + starting * per_worker * (horizon - startup / 2)
            # A removal was judged safe for a start-up: within it, only a queue below the band
            # (not a projection, which rests on noisy rates) brings workers back.
            trusted = since_down >= startup
            if (projected < floor_seqs and trusted) or (queue < low_seqs and projected < low_seqs):
                # One more worker at a time while none is starting; while some are, only what
                # the rates ask for (the ones starting are not in the queue yet).
                target = max(workers, balanced, current + 1 if not starting else current)
                if cap is not None:
                    target = min(target, max(cap, current))
                if target > current and current >= context.max_workers:
                    # Short at the pool's maximum: perhaps the shared inference saturates.
                    return self._at_maximum(context, memory, figures, startup)
                if target > current:
                    # Short (it would empty the queue within a start-up, or p is measured over
                    # its window, not from the cold start's first groups), with the pool in place
                    # (its workers' groups in): no removal comes back to this count.
                    placed = t - memory.active_changed_t >= max(startup, 2 * settle_s)
                    known = memory.production_seen_s >= self.production_window_s
                    told = known or projected < 0 or self._fell_from_limit(memory)
                    if placed and told and context.active >= current:
                        memory = replace(memory, short_workers=current, short_demand_seqs_s=demand)
                    return Decision(
                        target=target,
                        reason=f"{figures}; {projected / batch:.2f} batches in {horizon:.0f}s "
                        f"-> {target} workers",
                        memory=memory,
                    )
        if queue <= high_seqs or raw <= high_seqs:
            return Decision(target=current, reason=f"{figures} -> hold {current}", memory=memory)
        last_advance = memory.last_advance_t
        if last_advance is not None and t - last_advance > _PAUSE_STEPS * step_s:
            # A batch is waiting but the trainer takes none: a pause (evaluation, checkpoint)
            # or a slowdown, told apart when the next step comes; remove nothing until then.
            # Where asked to (``pause_release_startups``), a pause that lasts is not held idle:
            # workers let go cost a start-up to bring back, so once it has lasted that long (k =
            # 1, the ski-rental rule: never more than twice what knowing its length would cost)
            # the pool goes to its minimum until the trainer steps again.
            paused_s = t - last_advance
            release_s = self.pause_release_startups * startup
            floor = context.min_workers
            if self.pause_release_startups and paused_s > release_s and current > floor:
                kept = max(memory.workers_before_pause or 0, current)
                return Decision(
                    target=floor,
                    reason=f"{figures}; no trainer step for {paused_s:.0f}s, longer than "
                    f"{release_s:.0f}s ({self.pause_release_startups:g} x the start-up): a "
                    f"pause -> {floor} ({kept} again at the trainer's next step)",
                    memory=replace(memory, workers_before_pause=kept),
                )
            return Decision(
                target=current,
                reason=f"{figures}; no trainer step for {t - last_advance:.0f}s -> hold {current}",
                memory=memory,
            )
        window = self._demand_window_s(step_s)
        if memory.resumed_t is not None and memory.demand_seen_s < window:
            return Decision(
                target=current,
                reason=f"{figures}; demand measured for {memory.demand_seen_s:.0f}s since the "
                f"trainer resumed, {window:.0f}s needed -> hold {current}",
                memory=memory,
            )
        return self._remove(context, memory, figures, batch, per_worker, excess_since, dt)

    def _need(self, memory: BufferMemory) -> float | None:
        """Workers that make what the trainer takes, as measured (None: not yet)."""
        per_worker = self.per_worker(memory)
        if not per_worker or memory.demand_seqs_s is None:
            return None
        return memory.demand_seqs_s / per_worker

    @staticmethod
    def flaps(memory: BufferMemory, t: float, need: float) -> float:
        """Removals undone at about this need, each counted half as much an hour on (none once
        the need fell by more than a tenth since the last: a slower trainer, faster groups)."""
        if need * _SAME_LOAD < memory.flap_need_workers:
            return 0.0
        age_s = max(t - memory.flaps_t, 0.0)
        faded: float = memory.flaps * 0.5 ** (age_s / _FLAP_HALF_LIFE_S)
        return min(faded, _FLAPS_MAX)

    def removal_margin_workers(
        self, memory: BufferMemory, per_worker: float, startup: float, step_s: float
    ) -> float:
        """How far production wanders over a start-up, in workers: the pool keeps that many
        above the need, and removes only once it holds a whole worker more (whole workers and a
        fractional need would otherwise alternate between neighbouring counts). The trainer
        takes a batch a step, and a wander shorter than that evens out within it (a group that
        lands late in one span lands in the next), so where a step outlasts a start-up the
        wander counts over the step: env workers that start in a second and finish a group or
        two each a second wander by whole workers from one second to the next, which a trainer
        stepping every 10 s never sees."""
        if memory.spread_var_seqs2 is None or memory.spreads_seen < 2 or per_worker <= 0:
            return 0.0
        span_s = max(startup, step_s, 1.0)
        return math.sqrt(memory.spread_var_seqs2) / span_s / per_worker

    def _remove(
        self,
        context: PolicyContext,
        memory: BufferMemory,
        figures: str,
        batch: int,
        per_worker: float,
        excess_since: float | None,
        interval_s: float,
    ) -> Decision:
        """Rule 5: the queue is above the band. Whole workers and a fractional need would
        alternate between neighbouring counts, so a removal keeps the need plus the production
        spread, needs a whole worker more than that, and, unless the excess is clear (twice
        that), an excess lasting a window that spans the jitter. It never goes back to a count
        found short while demand has not fallen by more than a worker makes."""
        t, current = context.t, self.in_force(context)
        demand = memory.demand_seqs_s or 0.0
        queue = memory.queue_seqs
        startup = self.startup(memory)
        step_s = batch / demand if demand > 0 else math.inf
        low_seqs = (self.target(memory, batch) - self.band_batches) * batch
        since_down = math.inf if memory.last_down_t is None else t - memory.last_down_t
        # A removal shows in the queue once the workers' last groups are in: a start-up (the
        # time to bring one back if it was wrong) before the next.
        cooldown = max(self.down_cooldown_s, startup, min(4 * step_s, 2 * startup))
        floor = 0
        short = memory.short_workers
        # Demand estimates wander by a quarter when steps are short and uneven; a real fall
        # (a slower trainer) is more than that and more than a worker makes.
        fell = min(memory.short_demand_seqs_s - per_worker, 0.6 * memory.short_demand_seqs_s)
        if short is not None and demand > fell:
            floor = short + 1
        settle = _settle_s(step_s)
        at_limit = queue >= self._offpolicy_seqs(batch) or (
            memory.limit_t is not None and t - memory.limit_t < settle
        )
        # p measured over two start-ups of the present pool is trusted over its bound.
        measured = self.per_worker(memory)
        fresh = memory.fresh_s >= 2 * startup and measured is not None
        if fresh and measured:
            per_worker = measured
        need = demand / per_worker
        pinned = memory.away_t is None or t - memory.away_t >= cooldown
        # Held at the limit for a cooldown by the workers up (seen away from it before, so not
        # a pool that came to this policy there): those still starting would make nothing the
        # trainer takes. (Not sooner: a worker's first groups all start together and the
        # fastest land first, so a queue that has just reached the limit proves little.) (Not
        # within a cooldown of a worker exiting early: those starting may be its replacements,
        # and their retries are what tells a crash loop.)
        held = memory.away_t is not None and t - memory.away_t >= cooldown
        pending = current - max(context.active, floor)
        assert context.queue is not None
        full_now = min(queue, context.queue.queued_sequences) >= self._offpolicy_seqs(batch)
        failed = context.last_failure_t is not None and t - context.last_failure_t < cooldown
        if full_now and held and pending > 0 and not failed:
            return Decision(
                target=current - pending,
                reason=f"{figures}; queue at the off-policy limit with {context.active} "
                f"workers up -> {current - pending} (the {pending} not yet up are not needed)",
                memory=memory,
            )
        if at_limit and not fresh:
            # The envs hold back at the off-policy limit, so p is not measured there and may
            # rest on its lower bound D / active (every estimate of the need reads high): step
            # down by a twentieth of the pool until the queue leaves the limit, never to a
            # count found short.
            share, how = _LIMIT_SHARE, "a twentieth of the pool"
            covered = step_s * _PINNED_STEPS / startup if startup > 0 else _PINNED_SHARE
            if not floor and pinned and covered > share:
                # Held at the limit for a whole cooldown, every worker makes at least D / n:
                # removing a share f leaves at most f x D short should the need lie just
                # below. The batches the full queue holds above the band cover that for
                # two steps / f, the start-up it takes to bring workers back when
                # f = 2 steps / start-up. At most a tenth (and max_down_fraction): with heavy
                # tails a pool held at the limit can fall short once the queue leaves it (the
                # off-policy stop discards the long groups, so a full queue overstates what
                # the pool makes).
                share = min(covered, _PINNED_SHARE, self.max_down_fraction)
                how = f"{share:.0%} of the pool, the queue held there for {cooldown:.0f}s"
            step = max(1, math.floor(current * share))
            # Full at every sample for a cooldown while the trainer took batches: each batch
            # taken was made again within a sample interval, so the pool makes at least
            # D x (1 + step / interval), and removing step / (interval + step) of it still
            # makes D. (Not sooner than a cooldown: with heavy tails a pool held at the limit
            # refills from its shortest groups, and what it makes once the queue leaves the
            # limit shows only later.)
            full_s = 0.0 if memory.full_since_t is None else t - memory.full_since_t
            taken = context.queue.trainer_step - memory.full_since_step
            full = not floor and full_s >= cooldown and taken >= 2
            if full:
                interval_s = interval_s if interval_s > 0 else step_s
                share = min(self.max_down_fraction, step_s / (interval_s + step_s))
                step = max(1, math.floor(current * share))
                how = f"{share:.0%} of the pool, the queue full at every sample for {full_s:.0f}s"
            if floor:
                # A count was found short, with p measured as the queue drained: down to the
                # need plus the spread, never below what was short.
                measured = measured or per_worker
                spread = self.removal_margin_workers(memory, measured, startup, step_s)
                kept = math.ceil(demand / measured + spread - 1e-9)
                target = max(current - step, kept, floor, 0)
            else:
                # (Flaps keep more: the count this descent would stop at was undone before.)
                spread = self.removal_margin_workers(memory, per_worker, startup, step_s)
                keep = need + self.flaps(memory, t, need) * (1.0 + spread)
                balanced = math.ceil(keep - 1e-9) if not full else 0
                target = max(min(balanced, current - 1), current - step, 0)
            if target < current and since_down >= cooldown:
                return Decision(
                    target=target,
                    reason=f"{figures}; queue at the off-policy limit -> stepping down to "
                    f"{target} (at most {how} at a time)",
                    memory=memory,
                )
            why = f", {short} were short" if floor >= current else ""
            return Decision(
                target=current,
                reason=f"{figures}; queue at the off-policy limit{why} -> hold {current}",
                memory=memory,
            )
        spread = self.removal_margin_workers(memory, per_worker, startup, step_s)
        flaps = self.flaps(memory, t, need)
        margin = (1.0 + spread) * (1.0 + flaps)
        damped = f", {flaps:.1f} removals undone" if flaps >= 0.05 else ""
        excess = current - need
        if excess < margin or floor >= current:
            # Fewer to spare than that: the queue rests higher (a little lag), where a removal
            # would bring the count back up.
            why = f"{short} were short" if floor >= current else f"a removal needs {margin:.2f}"
            why += damped
            return Decision(
                target=current,
                reason=f"{figures}; need {need:.2f} workers, {excess:.2f} over ({why}) "
                f"-> hold {current}",
                memory=memory,
            )
        since = excess_since if excess_since is not None else t
        memory = replace(memory, excess_since_t=since)
        span = _REMOVAL_STARTUPS * startup + _REMOVAL_STEPS * min(step_s, startup)
        if excess < 2 * margin and t - since < span:
            return Decision(
                target=current,
                reason=f"{figures}; need {need:.2f} workers, {excess:.2f} over for "
                f"{t - since:.0f}s of the {span:.0f}s a removal needs{damped} -> hold {current}",
                memory=memory,
            )
        # The need plus the spread, and the fewest workers that keep the queue inside the band
        # for a start-up (the time it takes to bring one back if this was wrong).
        kept = math.ceil(need + spread + flaps * (1.0 + spread) - 1e-9)
        horizon = startup + 4 * step_s
        safe = math.ceil((demand - (queue - low_seqs) / horizon) / per_worker - 1e-9)
        step = max(1, math.floor(current * self.max_down_fraction))
        target = min(max(safe, kept, floor, current - step, 0), current)
        starting = ""
        if current > context.active:
            # Workers still starting make nothing yet: ``max_down_fraction``, the most a wrong
            # estimate may take from the trainer at once, does not hold them back. Those beyond
            # twice the need go (a cold pool's first groups may read p high by half).
            wanted = math.ceil(_STARTING_NEEDS * need - 1e-9)
            spare = max(context.active, wanted, kept, floor, safe)
            if spare < target:
                target = spare
                going = current - target
                starting = f" (the {going} going are still starting; twice the need stays)"
        if target < current and since_down >= cooldown:
            return Decision(
                target=target,
                reason=f"{figures}; need {need:.2f} workers, {excess:.2f} over (a removal needs "
                f"{margin:.2f}{damped}) -> stepping down to {target}{starting}",
                memory=replace(memory, excess_since_t=None),
            )
        return Decision(target=current, reason=f"{figures} -> hold {current}", memory=memory)

    def _grow(
        self,
        context: PolicyContext,
        memory: BufferMemory,
        figures: str,
        workers: int,
        batch: int,
    ) -> Decision:
        """Rule 2: the trainer starves. Grow by up to ``max_up_factor`` (per start-up), unless
        the last growth showed the shared inference saturated."""
        t, current, active = context.t, self.in_force(context), context.active
        # What entered the queue, measured (starving, the queue never nears the off-policy
        # limit, so this is all the pool makes).
        production = memory.production_seqs_s or 0.0
        # Production is averaged over a settle time: two of them after the last worker came,
        # it shows what the workers added make (to 86%).
        settle = self._production_settle_s(memory, batch)
        settled = t - memory.active_changed_t >= 2 * settle
        startup = self.startup(memory)
        # Starving, the trainer takes each batch as soon as the envs complete it, so at the
        # measured rate a batch comes every B / (p x active). No batch over twice that: the envs
        # make less than half of what they did (an inference outage), not what the trainer
        # wants; more workers would add nothing.
        since_advance = 0.0 if memory.last_advance_t is None else t - memory.last_advance_t
        expected = (memory.per_worker_seqs_s or 0.0) * active * since_advance
        if expected >= _OUTAGE_BATCHES * batch:
            return Decision(
                target=current,
                reason=f"{figures}; trainer starving, but no batch for {since_advance:.0f}s, in "
                f"which {active} active workers at {memory.per_worker_seqs_s or 0.0:.2f} seq/s "
                f"make {expected / batch:.1f} batches: production stopped, not a demand to "
                f"chase -> hold {current}",
                memory=memory,
            )
        probing = (
            self._probe_grown(memory, active) and t - memory.probe_t <= 3 * startup + 3 * settle
        )
        added = (active - memory.probe_workers) / max(memory.probe_workers, 1)
        gained = production / memory.probe_seqs_s - 1 if memory.probe_seqs_s > 0 else added
        # What the grown pool made over eight of its steps (and 30 s) since its workers were in
        # shows a rise before the average does (it holds the pool before the growth for a
        # settle time, and a starving trainer would wait two of them). It only passes the test:
        # with heavy tails eight steps of production are too noisy to call saturation on.
        step_s = self.step_s(memory, batch) or math.inf
        if memory.probe_made_s >= max(_PROBE_STEPS * step_s, _PROBE_MIN_S):
            made = memory.probe_made_seqs / memory.probe_made_s
            gained = max(gained, made / memory.probe_seqs_s - 1 if memory.probe_seqs_s else 0.0)
        if probing and not settled and gained >= added / 2:
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
            return self._at_maximum(context, memory, figures, startup)
        # In proportion to how much of the last start-up the trainer went hungry: a dip in the
        # jitter adds a little, a trainer that sped up unseen doubles the pool per start-up.
        factor = 1 + (self.max_up_factor - 1) * memory.hungry_share
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
        if placed and self._fell_from_limit(memory) and active >= current:
            memory = replace(
                memory, short_workers=current, short_demand_seqs_s=memory.demand_seqs_s or 0.0
            )
        return Decision(
            target=target,
            reason=f"{figures}; trainer starving, what it takes is only what the envs make: "
            f"growing x{factor:.2f} -> {target} workers",
            memory=memory,
        )

    @staticmethod
    def _fell_from_limit(memory: BufferMemory) -> bool:
        """The pool held the queue at the off-policy limit since its last worker came: if the
        queue is now short, so is the pool, whatever p reads."""
        return memory.limit_t is not None and memory.limit_t >= memory.active_changed_t

    def _at_maximum(
        self,
        context: PolicyContext,
        memory: BufferMemory,
        figures: str,
        startup: float,
    ) -> Decision:
        """Short at the pool's maximum. The shared inference may be saturated (production per
        worker fell well below its best, or no such test has been made yet): remove some (a
        quarter, or less without a sign of saturation: see the module docstring) and see
        whether production falls with them (judged by :meth:`_judge_shed`)."""
        t, current, active = context.t, self.in_force(context), context.active
        p, best = memory.per_worker_seqs_s or 0.0, memory.best_per_worker_seqs_s
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
        settle = self._production_settle_s(memory, sample.batch_size_seqs)
        # A pool that made its best at the maximum tells nothing: it may have been saturated
        # from its first measurement. One test; the next only once p falls well below that.
        if tested:
            fell, why = p < _FELL * tested, f"fell from {tested:.2f} to {p:.2f} seq/s since"
            share = 1 / 4
        elif p < _FELL * best:
            fell, why = True, f"fell from {best:.2f} to {p:.2f} seq/s"
            share = 1 / 4
        else:
            # Without a sign of saturation, a smaller test: an eighth, and no more than a step
            # past the knee may cost (it loses its share until judged and brought back), so a
            # pool with long start-ups that is simply short loses little; but a sixteenth at
            # least, or production's noise hides what the test shows. Only once p is measured
            # over its window (not the cold start's first groups), and never with the pool
            # measured at the count the test would try (it made as much per worker there).
            share = min(1 / 8, max(1 / 16, _PAST_KNEE_COST_S / (2 * settle + startup)))
            fewest = memory.fewest_measured_workers
            fell = memory.production_seen_s >= self.production_window_s and (
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

    def _judge_shed(
        self,
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
        t, current, active = context.t, self.in_force(context), context.active
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
                return Decision(
                    target=current, reason=f"{figures} -> hold {current}", memory=cleared
                )
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
        if kept >= 1 - removed * _HELD:
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
                    most = min(_SHED_MAX_SHARE, _PAST_KNEE_COST_S / (2 * settle + startup))
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
                    saturated_until_t=t + _KNEE_STARTUPS * startup,
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

    @staticmethod
    def _probe_grown(memory: BufferMemory, active: int) -> bool:
        """The last growth while starving is in place (enough workers to tell its effect)."""
        probe = memory.probe_workers
        return probe > 0 and active >= max(1.2 * probe, probe + 2)

    def _probe_in(self, memory: BufferMemory, active: int, t: float, step_s: float | None) -> bool:
        """The grown pool's workers are past their first groups: what it makes counts."""
        warm_s = _settle_s(step_s)
        return (
            self._probe_grown(memory, active)
            and active == memory.last_active
            and t - memory.active_changed_t >= warm_s
        )

    def _production_settle_s(self, memory: BufferMemory, batch: int) -> float:
        """How long after the active count changes production reflects it."""
        step = self.step_s(memory, batch)
        return max(self._demand_window_s(step), 10.0)

    def _offpolicy_seqs(self, batch: int) -> float:
        """From this queue length on envs may hold back (atroposlib's limit, with a margin)."""
        return 0.8 * self.max_batches_offpolicy * batch

    def _measure(self, context: PolicyContext, memory: BufferMemory) -> BufferMemory:
        """The memory with this sample's measurements folded in."""
        sample = context.queue
        assert sample is not None
        t, batch, queued = context.t, sample.batch_size_seqs, sample.queued_sequences
        dt = t - memory.last_t
        changes: dict[str, object] = {
            "last_t": max(t, memory.last_t),
            "last_queued_seqs": queued,
            "last_step": sample.trainer_step,
            "last_active": context.active,
        }
        # What the reducer applied of the last decision (not told: the count shows it).
        desired = context.current if context.desired is None else context.desired
        if desired is not None and memory.last_desired is not None:
            if desired > memory.last_desired:
                changes["last_up_t"] = memory.last_t
                down, up = memory.last_down_t, memory.last_up_t
                undone = down is not None and (up is None or down > up)
                need = self._need(memory)
                if undone and need is not None and need <= _SAME_LOAD * memory.down_need_workers:
                    flaps = self.flaps(memory, t, need) + 1.0
                    changes.update(flaps=flaps, flaps_t=t, flap_need_workers=need)
            elif desired < memory.last_desired:
                changes["last_down_t"] = memory.last_t
                # A saturation test or a pause let go is undone on purpose: never a flap.
                deliberate = memory.shed_workers > 0 or memory.workers_before_pause is not None
                changes["down_need_workers"] = 0.0 if deliberate else self._need(memory) or 0.0
        changes["last_desired"] = desired
        # Start-up: the oldest workers still starting are the ones that became active.
        pending = list(memory.pending_t)
        # Counted since the previous sample (requested then at the latest), before any is popped:
        # a worker may be requested and become active between two samples.
        counted_before = memory.last_active + len(pending)
        pending.extend([memory.last_t] * max(context.current - counted_before, 0))
        became = max(context.active - memory.last_active, 0)
        startup, seen = memory.startup_s, memory.startups_seen
        for _ in range(min(became, len(pending))):
            age = t - pending.pop(0)
            seen += 1
            startup = age if startup is None else startup + (age - startup) / min(seen, 8)
        starting = max(context.current - context.active, 0)
        del pending[starting:]  # cancelled or failed: the newest go first
        pending.extend([memory.last_t] * (starting - len(pending)))
        changes.update(pending_t=tuple(pending), startup_s=startup, startups_seen=seen)
        returning = memory.returning_workers
        if returning is not None and (context.active >= returning or context.current < returning):
            changes["returning_workers"] = None
        if context.active > memory.last_active:
            changes["active_changed_t"] = t
            # Workers added may make less each (a shared inference saturating); a removal
            # leaves each of the rest making at least what it made, so p stays the present
            # pool's (reset there, the next removal at the off-policy limit would rest on p's
            # bound and a twentieth of the pool a cooldown, however far the need lies below).
            # Workers coming back after a pause are the pool p was measured with.
            if returning is None or context.active > returning:
                changes["fresh_s"] = 0.0
        if dt <= 0:
            return replace(memory, **changes)
        step_s = self.step_s(memory, batch)
        hungry = 1.0 if queued < 0.5 * batch else 0.0
        weight = 1.0 - math.exp(-dt / max(self.startup(memory), dt))
        changes["hungry_share"] = memory.hungry_share + weight * (hungry - memory.hungry_share)
        queue_window = min(max(2 * (step_s or 0.0), dt), self.rate_window_s / 2)
        changes["queue_seqs"] = _average(
            memory.queue_seqs, queued, memory.queue_seen_s, dt, queue_window
        )
        changes["queue_seen_s"] = min(memory.queue_seen_s + dt, queue_window)
        steps = max(sample.trainer_step - memory.last_step, 0)
        consumed = steps * batch
        demand_window = self._demand_window_s(step_s)
        if steps:
            changes["last_advance_t"] = t
        if steps and memory.last_advance_t is not None:
            # From one advance to the next: sampling at arbitrary phases of a step would add a
            # ripple of a whole batch per sample to the estimate.
            span = t - memory.last_advance_t
            # (Right after a pause, a second long span is a slower trainer.)
            paused = (
                step_s is not None
                and span > _PAUSE_STEPS * step_s + dt
                and memory.last_queued_seqs >= batch
                and (memory.resumed_t is None or memory.demand_seen_s > 0)
            )
            if paused:
                # The trainer took nothing while a batch waited: a pause. What it takes now is
                # measured afresh (the demand before it may not hold after a restart).
                changes.update(resumed_t=t, demand_seen_s=0.0, fast_demand_seqs_s=None)
            else:
                rate = consumed / span
                demand = _average(
                    memory.demand_seqs_s, rate, memory.demand_seen_s, span, demand_window
                )
                # The quick estimate averages step times over steps, not rates over seconds:
                # after a speed-up three of the new steps move it (three seconds of the old
                # length would take twice as many), and one short span between two samples
                # moves it by a step's share, not by its rate (rates of short spans are large).
                step_now = span / steps
                fast_step = (
                    step_now
                    if memory.fast_demand_seqs_s is None or memory.demand_seen_s <= 0
                    else batch / memory.fast_demand_seqs_s
                )
                fast_step += (1.0 - math.exp(-steps / _FAST_STEPS)) * (step_now - fast_step)
                fast = batch / fast_step
                if not 0.75 * demand <= fast <= 1.25 * demand:
                    demand = fast  # the trainer sped up or slowed down (not step-timing noise)
                elif not 0.9 * demand <= fast <= 1.1 * demand:
                    demand = (demand + fast) / 2  # and it is still settling
                changes["demand_seqs_s"] = demand
                changes["fast_demand_seqs_s"] = fast
                changes["demand_seen_s"] = min(memory.demand_seen_s + span, demand_window)
        produced = max(queued - memory.last_queued_seqs + consumed, 0)
        changes.update(self._watch_stalls(memory, context, produced, consumed, step_s))
        if self._probe_in(memory, context.active, t, step_s):
            changes["probe_made_seqs"] = memory.probe_made_seqs + produced
            changes["probe_made_s"] = memory.probe_made_s + dt
        changes["production_seqs_s"] = _average(
            memory.production_seqs_s, produced / dt, memory.production_seen_s, dt, demand_window
        )
        throughout = min(context.active, memory.last_active)
        # Workers that just started make less than they will (their first groups are all still
        # in generation): p is measured once the pool has settled. A few steps: p reads a
        # little low for a group latency after workers come, but it must keep up with a pool
        # that grows and shrinks.
        settle = _settle_s(step_s)
        near_limit = max(queued, memory.last_queued_seqs) >= self._offpolicy_seqs(batch)
        if near_limit:
            changes["limit_t"] = t
        elif memory.limit_t is None or t - memory.limit_t >= settle:
            changes["away_t"] = t
        # Full: at the limit, not above it (groups that were in flight when it was reached
        # may land on top: a backlog above the limit stays full whatever the pool makes).
        limit_seqs = self.max_batches_offpolicy * batch
        if abs(queued - limit_seqs) <= _FULL_SLACK_BATCHES * batch:
            if memory.full_since_t is None:
                changes.update(full_since_t=t, full_since_step=sample.trainer_step)
        else:
            changes["full_since_t"] = None
        # Until p has been measured for a settle time it is provisional: once the pool has
        # settled, intervals soon after the queue was near the limit count too. Where the queue
        # reaches the limit every few steps (a trainer that fetches every full batch at once),
        # p would otherwise never be measured, or rest on the first interval (the one in which a
        # cold pool's workers came reads them as one while all of them post their first groups,
        # 40-90x high; the next may hold no group yet).
        provisional = memory.production_seen_s < min(settle, self.production_window_s)
        settled = t - memory.active_changed_t >= settle and (
            provisional or memory.limit_t is None or t - memory.limit_t >= settle
        )
        if throughout > 0 and settled and not near_limit:
            changes["per_worker_seqs_s"] = _average(
                memory.per_worker_seqs_s,
                produced / dt / throughout,
                memory.production_seen_s,
                dt,
                self.production_window_s,
            )
            changes["recent_per_worker_seqs_s"] = _average(
                memory.recent_per_worker_seqs_s or memory.per_worker_seqs_s,
                produced / dt / throughout,
                memory.production_seen_s,
                dt,
                self.production_window_s * _RECENT_WINDOW_SHARE,
            )
            changes["production_seen_s"] = min(
                memory.production_seen_s + dt, self.production_window_s
            )
            if context.active == memory.last_active:
                changes["fresh_s"] = memory.fresh_s + dt
            if not provisional:
                p = changes["per_worker_seqs_s"]
                assert isinstance(p, float)
                changes["best_per_worker_seqs_s"] = max(memory.best_per_worker_seqs_s, p)
                fewest = memory.fewest_measured_workers
                changes["fewest_measured_workers"] = (
                    min(fewest, throughout) if fewest else throughout
                )
            changes.update(self._spread(memory, t, produced, throughout * dt))
        return replace(memory, **changes)

    def _watch_stalls(
        self,
        memory: BufferMemory,
        context: PolicyContext,
        produced: int,
        consumed: int,
        step_s: float | None,
    ) -> dict[str, object]:
        """Count the trainer left waiting a step or more after the queue fell from the off-policy
        limit with less than a batch landing: the groups outlast the batches the queue held, and
        the envs stopped at the limit, so each visit there costs a wait however many workers run.
        A restart (the trainer's step going back) or a queue flushed ends the watch."""
        assert context.queue is not None
        t, queued, batch = context.t, context.queue.queued_sequences, context.queue.batch_size_seqs
        stalls = tuple(s for s in memory.stall_times if t - s < _STALL_WINDOW_S)
        changes: dict[str, object] = {"stall_times": stalls}
        unfed = {"unfed_limit_t": None, "unfed_below_t": None, "unfed_made_seqs": 0}
        restarted = context.queue.trainer_step < memory.last_step
        watched = memory.unfed_limit_t
        counted = watched is not None and bool(stalls) and stalls[-1] >= watched  # this visit's
        landed = memory.unfed_made_seqs + produced >= batch
        # At the limit: within the slack of a full queue, where the envs stop.
        at_limit = queued >= (self.max_batches_offpolicy - _FULL_SLACK_BATCHES) * batch
        if counted and memory.unfed_below_t is not None and (at_limit or landed):
            changes["stall_wait_s"] = t - memory.unfed_below_t  # a stalled visit ends
        if at_limit:
            changes.update(unfed, unfed_limit_t=t)
        elif watched is None:
            pass
        elif restarted or queued < memory.last_queued_seqs - consumed or context.active == 0:
            changes.update(unfed)  # a restart or a flushed queue, not the trainer taking it
        elif landed:
            changes.update(unfed)  # a batch landed: the envs are making again
        else:
            changes["unfed_made_seqs"] = memory.unfed_made_seqs + produced
            if queued < batch:
                below = t if memory.unfed_below_t is None else memory.unfed_below_t
                changes["unfed_below_t"] = below
                if step_s is not None and t - below >= step_s and not counted:
                    changes["stall_times"] = (*stalls, t)
        return changes

    def _spread(
        self, memory: BufferMemory, t: float, produced: float, worker_s: float
    ) -> dict[str, object]:
        """Fold one interval into the start-up-long spans: the spread is how much the production
        of the pool over a start-up changes from one span to the next (slow drifts cancel)."""
        if memory.spread_since_t is None:
            return {"spread_sum_seqs": 0.0, "spread_worker_s": 0.0, "spread_since_t": t}
        total, worker_total = memory.spread_sum_seqs + produced, memory.spread_worker_s + worker_s
        span = t - memory.spread_since_t
        if span < self.startup(memory) or worker_total <= 0:
            return {"spread_sum_seqs": total, "spread_worker_s": worker_total}
        rate = total / worker_total
        changes: dict[str, object] = {
            "spread_sum_seqs": 0.0,
            "spread_worker_s": 0.0,
            "spread_since_t": t,
            "spread_rate_seqs_s": rate,
        }
        if memory.spread_rate_seqs_s is not None:
            # The pool's production over the span, had it kept this span's workers.
            square = ((rate - memory.spread_rate_seqs_s) * worker_total) ** 2 / 2
            seen = memory.spreads_seen + 1
            var = memory.spread_var_seqs2
            var = square if var is None else var + (square - var) / min(seen, 10)
            changes.update(spread_var_seqs2=var, spreads_seen=seen)
        return changes

    def _without_rates(
        self, context: PolicyContext, memory: BufferMemory, queued_batches: float
    ) -> Decision:
        current = self.in_force(context)
        sample = context.queue
        assert sample is not None
        target_batches = self.target(memory, sample.batch_size_seqs)
        # A cold pool has no worker active yet or a trainer that has taken no batch. A pool
        # already running (production stopped, or this policy just took it over) is held.
        cold = context.active == 0 or sample.trainer_step == 0
        if cold and queued_batches < target_batches:
            # A cold pool: every worker it may have reaches the first batch soonest.
            target = max(current, context.max_workers)
            return Decision(
                target=target,
                reason=(
                    f"queue {queued_batches:.2f} batches < target {target_batches:g}; "
                    f"rates not measured yet -> {target} workers"
                ),
                memory=memory,
                stabilize=False,
            )
        compared = ">=" if queued_batches >= target_batches else "<"
        running = "" if cold else f", {context.active} workers active"
        return Decision(
            target=current,
            reason=(
                f"queue {queued_batches:.2f} batches {compared} target {target_batches:g}; "
                f"rates not measured yet{running} -> hold {current}"
            ),
            memory=memory,
        )
