"""``buffer``: the default for trainer queues. Hold the queue within target +- band batches.

Units are sequences throughout: a queue sample carries queued sequences (Atropos: queued groups x
group size) and the trainer's batch size B in sequences.

Why a band. The trainer starves when a step ends with less than a batch queued, and every batch
queued ahead of a sequence is a step of off-policy lag. With whole workers, production rarely
equals demand, so the count alternates between neighbours and the queue drifts between the edges
of ``target_batches +- band_batches``; the rules below keep those alternations minutes apart.

Estimates, updated on every sample (exponential averages over a window; the exact running mean
until the window has been filled once, so first estimates are not noise):

* Q, the queue, over ``rate_window_s / 2`` (the saw-tooth of batches taken is noise);
* demand D (seq/s): batches taken x B between samples where the trainer step advanced (per
  sample, the step cadence would add a ripple of a batch), over ``rate_window_s``. An estimate
  over a sixth of that window replaces it when 25% higher (a trainer that sped up). The highest
  D of the last ``5 x rate_window_s`` is kept as the recent peak;
* per-worker production p (seq/s/worker): what entered the queue (its change plus what the
  trainer took) over the workers active throughout the interval, over ``production_window_s``;
  only below 0.8 x ``max_batches_offpolicy`` batches, as envs hold back near atroposlib's limit.
  At that limit a queue that stays full proves p >= D / active, which is used when higher.

The model is feed-forward plus PI on the error e = target - Q (anti-windup: the integral is
frozen while the count is pinned at a bound, and clamped):

    n = ceil((D + (e + I / integral_s) / refill_s) / p)

Rules, in order (lead_s = refill_s / 2, about a worker's start-up; hold_s = 1.75 x refill_s):

1. Cold start: until D and p are known, a pool whose queue is short of the target starts every
   worker it may (the fastest way to a first batch; the excess is shed once both are known), and
   otherwise holds.
2. Not refilling: lead_s after the last addition, a queue nearly empty (under half a batch) or
   below the band for lead_s means the trainer waits, and what it takes is only what the envs
   make, so D reads low: grow by ``max_up_fraction`` (at least one worker).
3. Add: a queue below the target that, projected lead_s ahead with the workers already counted
   (requested ones included), would empty, or stays below the band: up to max(n, count + 1).
   Smaller drifts inside the band are left alone: the rates are too noisy to act on them. Within
   hold_s of a removal (judged safe for that long), only a queue below the band adds workers.
4. Hold up to the band's top, and while a batch waits but the trainer takes none for three step
   times (a pause for evaluation or a checkpoint, or a slowdown: the next step tells).
5. Remove above the band: to max(n, safe, count - max_down_fraction x count), where safe is the
   fewest workers that keep the projected queue inside the band for hold_s at the expected
   demand (the recent peak while D is below 80% of it: a pause ends), at most once per
   ``down_cooldown_s`` (per lead_s at the limit, where p rests on its lower bound).
"""

from __future__ import annotations

import math
from typing import ClassVar

import attrs

from core.errors import ConfigError
from core.events import QueueSampled
from core.policies.base import Decision, PolicyContext
from core.records import replace, replaceable

__all__ = ["BufferMemory", "BufferPolicy"]


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
    #: The same over a sixth of the window: a trainer that speeds up is believed at once.
    fast_demand_seqs_s: float | None = None
    #: When the trainer step was last seen to advance (None: never).
    last_advance_t: float | None = None
    #: The highest demand estimate of the last peak window, and when it was seen.
    peak_demand_seqs_s: float = 0.0
    peak_t: float = 0.0
    per_worker_seqs_s: float | None = None
    #: Seconds of measurement behind each estimate, up to its window (the warm-up weights).
    queue_seen_s: float = 0.0
    demand_seen_s: float = 0.0
    production_seen_s: float = 0.0
    integral_seqs_s: float = 0.0
    #: Since when the smoothed queue has been below the band (None: it is not).
    low_since_t: float | None = None
    last_up_t: float | None = None
    last_down_t: float | None = None


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
    target_batches: float = 1.25
    #: Seconds over which a buffer error is to be made up (proportional gain 1/refill_s).
    refill_s: float = 120.0
    #: Integral time: how slowly a persistent error is integrated away.
    integral_s: float = 1800.0
    #: Window of the demand estimate (and, halved, of the queue's smoothing).
    rate_window_s: float = 60.0
    #: Window of the per-worker production estimate.
    production_window_s: float = 300.0
    #: atroposlib's max_batches_offpolicy: envs stop producing once this many batches are queued.
    max_batches_offpolicy: float = 3.0
    #: The queue is held within target +- band_batches.
    band_batches: float = 0.5
    #: While the queue stays nearly empty, the pool grows by this fraction per lead_s.
    max_up_fraction: float = 0.25
    max_down_fraction: float = 0.25
    down_cooldown_s: float = 30.0

    def __attrs_post_init__(self) -> None:
        for key in (
            "target_batches",
            "refill_s",
            "integral_s",
            "rate_window_s",
            "production_window_s",
            "max_batches_offpolicy",
            "max_up_fraction",
        ):
            if not getattr(self, key) > 0:
                raise ConfigError(f"policy.{key} must be > 0, got {getattr(self, key)!r}")
        if not 0 < self.max_down_fraction <= 1:
            raise ConfigError(
                f"policy.max_down_fraction must be in (0, 1], got {self.max_down_fraction}"
            )
        if not 0 <= self.band_batches < self.target_batches:
            raise ConfigError(
                f"policy.band_batches must be in [0, target_batches), got {self.band_batches}"
            )
        if self.down_cooldown_s < 0:
            raise ConfigError(f"policy.down_cooldown_s must be >= 0, got {self.down_cooldown_s}")

    @property
    def lead_s(self) -> float:
        """How far ahead the queue is projected before adding workers (refill_s / 2)."""
        return self.refill_s / 2

    @property
    def hold_s(self) -> float:
        """How long a removal must keep the projected queue inside the band (1.75 x refill_s:
        a little longer than a lead_s plus deo's default stabilization window of 120 s)."""
        return 1.75 * self.refill_s

    @property
    def peak_window_s(self) -> float:
        """Removals respect the highest demand seen this long (5 x rate_window_s)."""
        return 5 * self.rate_window_s

    def initial_target(self, min_workers: int, max_workers: int) -> int:
        return min_workers

    def decide(self, context: PolicyContext, memory: BufferMemory | None) -> Decision:
        sample = context.queue
        assert sample is not None  # the reducer asks only with a queue sample
        t, current = context.t, context.current
        batch = sample.batch_size_seqs
        if memory is None:
            queued = sample.queued_sequences
            memory = BufferMemory(
                last_t=t,
                last_queued_seqs=queued,
                last_step=sample.trainer_step,
                last_active=context.active,
                queue_seqs=float(queued),
            )
            return self._without_rates(context, memory, queued / batch)
        dt = max(t - memory.last_t, 0.0)
        memory = self._measure(context, memory)
        demand, per_worker = memory.demand_seqs_s, memory.per_worker_seqs_s
        queue = memory.queue_seqs
        measurable = queue < self._offpolicy_seqs(batch)
        if demand and not measurable and context.active:
            # At the off-policy limit the envs hold back, so p cannot be measured there (and an
            # old measurement may read low); but a queue that stays full means every active
            # worker makes at least D / active.
            per_worker = max(per_worker or 0.0, demand / context.active)
        if not per_worker or demand is None:  # not measured yet (or nothing produced)
            return self._without_rates(context, memory, queue / batch)

        target_seqs = self.target_batches * batch
        error = target_seqs - queue
        # PI on the buffer error with conditional integration (anti-windup).
        integral = memory.integral_seqs_s
        candidate = integral + error * dt
        limit = 2 * target_seqs * self.integral_s
        candidate = min(max(candidate, -limit), limit)
        raw = (demand + (error + candidate / self.integral_s) / self.refill_s) / per_worker
        saturated_high = raw > context.max_workers and error > 0
        saturated_low = raw < context.min_workers and error < 0
        if not (saturated_high or saturated_low):
            integral = candidate
        wanted_rate = demand + (error + integral / self.integral_s) / self.refill_s
        workers = max(math.ceil(wanted_rate / per_worker - 1e-9), 0)
        memory = replace(memory, integral_seqs_s=integral)

        figures = (
            f"queue {queue / batch:.2f} batches vs target {self.target_batches:g}; demand "
            f"{demand:.2f} seq/s, {per_worker:.2f} seq/s per worker"
        )
        low_seqs = (self.target_batches - self.band_batches) * batch
        high_seqs = (self.target_batches + self.band_batches) * batch
        since_up = math.inf if memory.last_up_t is None else t - memory.last_up_t
        since_down = math.inf if memory.last_down_t is None else t - memory.last_down_t
        low_since = memory.low_since_t if queue < low_seqs else None
        if queue < low_seqs and low_since is None:
            low_since = t
        memory = replace(memory, low_since_t=low_since)
        short_for = 0.0 if low_since is None else t - low_since
        if since_up >= self.lead_s and (queue < 0.5 * batch or short_for >= self.lead_s):
            # Nearly empty, or below the band for lead_s whatever was added: the trainer waits,
            # and what it takes is only what the envs make, so demand reads low (a trainer that
            # sped up unseen). Grow multiplicatively until the queue refills.
            grown = current + max(1, math.ceil(current * self.max_up_fraction))
            target = max(workers, grown)
            return Decision(
                target=target,
                reason=f"{figures}; queue not refilling -> {target} workers",
                memory=replace(memory, last_up_t=t),
            )
        if measurable and queue < target_seqs:
            drift = current * per_worker - demand  # seq/s the queue gains at this count
            projected = queue + drift * self.lead_s
            # Below the band and not refilling within lead_s with the workers already counted
            # (requested ones included), or emptying within lead_s: add workers. (The rates are
            # too noisy to act on a small drift while the queue is still inside the band.)
            # A removal was judged safe for hold_s: within it, only a queue below the band
            # (not a projection, which rests on noisy rates) brings workers back.
            trusted = since_down >= self.hold_s
            if (projected < 0 and trusted) or (queue < low_seqs and projected < low_seqs):
                target = max(workers, current + 1)
                return Decision(
                    target=target,
                    reason=f"{figures}; {projected / batch:.2f} batches in {self.lead_s:g}s "
                    f"-> {target} workers",
                    memory=replace(memory, last_up_t=t),
                )
        if queue <= high_seqs:
            return Decision(target=current, reason=f"{figures} -> hold {current}", memory=memory)
        last_advance = memory.last_advance_t
        if demand > 0 and last_advance is not None and t - last_advance > 3 * batch / demand:
            # A batch is waiting but the trainer takes none: a pause (evaluation, checkpoint)
            # or a slowdown, told apart when the next step comes; remove nothing until then.
            return Decision(
                target=current,
                reason=f"{figures}; no trainer step for {t - last_advance:.0f}s -> hold {current}",
                memory=memory,
            )
        cooldown, why = self.down_cooldown_s, ""
        if not measurable:
            # Removals at the limit rest on the lower bound of p: wait lead_s between them, so
            # that each one shows in the queue before the next.
            cooldown, why = self.lead_s, "queue at the off-policy limit, "
        # The fewest workers that keep the queue inside the band for hold_s. A demand well below
        # its recent peak may be a pause (an evaluation, a checkpoint): assume it comes back.
        peak = memory.peak_demand_seqs_s
        expected = peak if demand < 0.8 * peak else demand
        safe = math.ceil((expected - (queue - low_seqs) / self.hold_s) / per_worker - 1e-9)
        step = max(1, math.floor(current * self.max_down_fraction))
        target = max(workers, safe, current - step, 0)
        if target < current and since_down >= cooldown:
            return Decision(
                target=target,
                reason=f"{figures} -> {workers} workers; {why}stepping down to {target}",
                memory=replace(memory, last_down_t=t),
            )
        return Decision(target=current, reason=f"{figures} -> hold {current}", memory=memory)

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
        if dt <= 0:
            return replace(memory, **changes)
        queue_window = self.rate_window_s / 2
        changes["queue_seqs"] = _average(
            memory.queue_seqs, queued, memory.queue_seen_s, dt, queue_window
        )
        changes["queue_seen_s"] = min(memory.queue_seen_s + dt, queue_window)
        steps = max(sample.trainer_step - memory.last_step, 0)
        consumed = steps * batch
        if steps:
            changes["last_advance_t"] = t
        if steps and memory.last_advance_t is not None:
            # From one advance to the next: sampling at arbitrary phases of a step would add a
            # ripple of a whole batch per sample to the estimate.
            span = t - memory.last_advance_t
            rate = consumed / span
            demand = _average(
                memory.demand_seqs_s, rate, memory.demand_seen_s, span, self.rate_window_s
            )
            fast = _average(
                memory.fast_demand_seqs_s,
                rate,
                memory.demand_seen_s,
                span,
                self.rate_window_s / 6,
            )
            if fast > 1.25 * demand:  # a sustained speed-up, not step-timing noise
                demand = fast
            changes["demand_seqs_s"] = demand
            changes["fast_demand_seqs_s"] = fast
            changes["demand_seen_s"] = min(memory.demand_seen_s + span, self.rate_window_s)
            # The recent peak: replaced when it has not been approached for a peak window.
            if memory.demand_seen_s >= self.rate_window_s:  # not from warm-up noise
                peak = memory.peak_demand_seqs_s
                if demand >= peak or t - memory.peak_t > self.peak_window_s:
                    changes["peak_demand_seqs_s"] = demand
                    changes["peak_t"] = t
                elif demand >= 0.9 * peak:
                    changes["peak_t"] = t
        throughout = min(context.active, memory.last_active)
        if throughout > 0 and max(queued, memory.last_queued_seqs) < self._offpolicy_seqs(batch):
            produced = max(queued - memory.last_queued_seqs + consumed, 0)
            changes["per_worker_seqs_s"] = _average(
                memory.per_worker_seqs_s,
                produced / dt / throughout,
                memory.production_seen_s,
                dt,
                self.production_window_s,
            )
            changes["production_seen_s"] = min(
                memory.production_seen_s + dt, self.production_window_s
            )
        return replace(memory, **changes)

    def _without_rates(
        self, context: PolicyContext, memory: BufferMemory, queued_batches: float
    ) -> Decision:
        current = context.current
        if queued_batches < self.target_batches:
            # A cold pool: every worker it may have reaches the first batch soonest.
            target = max(current, context.max_workers)
            return Decision(
                target=target,
                reason=(
                    f"queue {queued_batches:.2f} batches < target {self.target_batches:g}; "
                    f"rates not measured yet -> {target} workers"
                ),
                memory=memory,
            )
        return Decision(
            target=current,
            reason=(
                f"queue {queued_batches:.2f} batches >= target {self.target_batches:g}; "
                f"rates not measured yet -> hold {current}"
            ),
            memory=memory,
        )
