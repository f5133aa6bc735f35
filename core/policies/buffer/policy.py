"""The buffer policy: its parameters, what it derives from its measurements, and its rules in
order (the package docstring states them)."""

from __future__ import annotations

import math
from typing import ClassVar

import attrs

from core.errors import ConfigError
from core.events import QueueSampled
from core.policies.base import Decision, PolicyContext
from core.policies.buffer.addition import add
from core.policies.buffer.constants import (
    CENSORED_RATIO,
    DEMAND_STEPS,
    FALLING,
    FLAP_HALF_LIFE_S,
    FLAPS_MAX,
    FULL_SLACK_BATCHES,
    SAME_LOAD,
    STALL_WINDOW_S,
    STALLS_TO_ALERT,
)
from core.policies.buffer.growth import grow, growth_shown
from core.policies.buffer.measure import measure
from core.policies.buffer.memory import BufferMemory, settle_s, sped_up_lately
from core.policies.buffer.pause import hold_through_pause
from core.policies.buffer.reading import Reading
from core.policies.buffer.removal import remove
from core.policies.buffer.saturation import judge_shed
from core.policies.buffer.stalls import floor_after_growth, shed_on_stalls
from core.records import replace
from core.vocabulary import AlertName

__all__ = ["BufferPolicy"]


@attrs.frozen(slots=True, kw_only=True)
class BufferPolicy:
    """Hold a trainer's queue within ``target_batches`` +- ``band_batches`` (the rules: the
    package docstring). Its fields are a pool's ``policy`` settings, all optional."""

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
        saturating, which more workers would not help: the growth rule judges that. Never
        far under what entered the queue per active worker (:meth:`censored`)."""
        whole, recent = memory.per_worker_seqs_s, memory.recent_per_worker_seqs_s
        unchanged = memory.last_t - memory.active_changed_t >= self.production_window_s
        if whole and recent and unchanged and recent <= FALLING * whole:
            whole = recent
        delivered = self.censored(memory, whole)
        return whole if delivered is None else delivered

    @staticmethod
    def censored(memory: BufferMemory, per_worker: float | None) -> float | None:
        """What entered the queue per active worker, where ``per_worker`` is far under it (None
        otherwise). That bounds p from below: a measurement far under it was made where nothing
        could land (the envs had cancelled their groups at the off-policy limit and restarted,
        groups longer than the steps the queue held), and would ask for the pool many times
        over."""
        # (A p of 0 is the extreme case: nothing landed in any interval it counted.)
        if per_worker is None or not (memory.last_active and memory.production_seqs_s):
            return None
        delivered = memory.production_seqs_s / memory.last_active
        return delivered if per_worker < delivered / CENSORED_RATIO else None

    def demand_window_s(self, step_s: float | None) -> float:
        """The demand estimate's window: 30 trainer steps (4 s at least), ``rate_window_s`` at
        most."""
        if step_s is None:
            return self.rate_window_s
        return min(max(DEMAND_STEPS * step_s, 4.0), self.rate_window_s)

    def need(self, memory: BufferMemory) -> float | None:
        """Workers that make what the trainer takes, as measured (None: not yet)."""
        per_worker = self.per_worker(memory)
        if not per_worker or memory.demand_seqs_s is None:
            return None
        return memory.demand_seqs_s / per_worker

    @staticmethod
    def flaps(memory: BufferMemory, t: float, need: float) -> float:
        """Removals undone at about this need, each counted half as much an hour on (none once
        the need fell by more than a tenth since the last: a slower trainer, faster groups)."""
        if need * SAME_LOAD < memory.flap_need_workers:
            return 0.0
        age_s = max(t - memory.flaps_t, 0.0)
        faded: float = memory.flaps * 0.5 ** (age_s / FLAP_HALF_LIFE_S)
        return min(faded, FLAPS_MAX)

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

    @staticmethod
    def fell_from_limit(memory: BufferMemory) -> bool:
        """The pool held the queue at the off-policy limit since its last worker came: if the
        queue is now short, so is the pool, whatever p reads."""
        return memory.limit_t is not None and memory.limit_t >= memory.active_changed_t

    def production_settle_s(self, memory: BufferMemory, batch: int) -> float:
        """How long after the active count changes production reflects it."""
        step = self.step_s(memory, batch)
        return max(self.demand_window_s(step), 10.0)

    def offpolicy_seqs(self, batch: int) -> float:
        """From this queue length on envs may hold back (atroposlib's limit, with a margin)."""
        return 0.8 * self.max_batches_offpolicy * batch

    def limit_reached_seqs(self, batch: int) -> float:
        """From this queue length on the queue stands at atroposlib's limit (within
        ``FULL_SLACK_BATCHES`` of it), where the envs cancel their groups."""
        return (self.max_batches_offpolicy - FULL_SLACK_BATCHES) * batch

    # --- deciding --------------------------------------------------------------------------------

    def decide(self, context: PolicyContext, memory: BufferMemory | None) -> Decision:
        decision = self._decide(context, memory)
        after = decision.memory
        assert isinstance(after, BufferMemory) and context.queue is not None
        count = len(after.stall_times)
        reported = count >= STALLS_TO_ALERT or (after.stalls_reported and count > 0)
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
            f"times in {STALL_WINDOW_S / 60:.0f} minutes: groups take longer to land than the "
            f"queue above one batch lasts{lasts}, and the envs stop (atroposlib's cancel the "
            f"groups in generation) each time it reaches the limit. More workers do not shorten "
            f"the wait: raise max_batches_offpolicy (the envs' and this policy's){to}, or "
            f"shorten the groups. Meanwhile each new wait takes up to a quarter of the pool (fewer "
            f"workers reach the limit less often)"
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
        memory = replace(measure(self, context, memory), excess_since_t=None)
        if memory.workers_before_pause is not None and memory.last_advance_t == t:
            # Rule 4's end (the rest is in :mod:`.pause`): the trainer steps again, and what the
            # pause let go comes back at once (its demand is measured afresh from here, and the
            # queue the pause filled feeds its first steps); p, measured with those workers,
            # stays theirs.
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
        measurable = queue < self.offpolicy_seqs(batch)
        # Held up: above the band's top (the queue and its latest sample), near the off-policy
        # limit within a settle time. p is measured only away from the limit, so a queue that
        # hovers just below it leaves p to the intervals after each visit there, when the
        # groups the limit cancelled are still in generation, and p reads low (a cold start's
        # first reading, half the true one, can stand for minutes).
        target_batches = self.target(memory, batch)
        high_seqs = (target_batches + self.band_batches) * batch
        held_up = (
            memory.limit_t is not None
            and t - memory.limit_t < settle_s(self.step_s(memory, batch))
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
        # Never below 0: only rules 2 and 3 read the PI's count, and a negative integral wound
        # while the queue stood above the target (for hours at the limit) would hold their
        # additions to the balance ceil(D / p), with nothing left to refill the queue.
        candidate = min(max(candidate, 0.0), limit)
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
        since_up = math.inf if memory.last_up_t is None else t - memory.last_up_t
        settled_s = settle_s(step_s)
        # Fed, the queue holds a batch or more before each step; starving, it never reaches one
        # and averages about half of one. Just after a speed-up, whatever it averages: groups
        # landing as fast as the trainer takes them put most samples mid-way through a batch
        # (1-s groups, 0.3-s steps: 0.6-0.75 batch for six seconds while it waited).
        starving = max(raw, previous_raw) < batch and (
            queue < 0.6 * batch or sped_up_lately(memory, t, startup)
        )
        reading = Reading(
            current=current,
            batch=batch,
            raw_seqs=raw,
            previous_raw_seqs=previous_raw,
            queue_seqs=queue,
            target_seqs=target_seqs,
            low_seqs=(target_batches - self.band_batches) * batch,
            high_seqs=high_seqs,
            demand_seqs_s=demand,
            per_worker_seqs_s=per_worker,
            startup_s=startup,
            step_s=step_s,
            workers=workers,
            balanced=balanced,
            cap=cap,
            measurable=measurable,
            # The workers of the last addition just became active: their first groups are
            # still in generation, so a trainer still waiting is no reason to grow yet
            # (unless, starving, it already shows what they make).
            warming=since_up < startup + settled_s
            and t - memory.active_changed_t < settled_s
            and not (starving and growth_shown(memory, context.active)),
            since_up_s=since_up,
            since_down_s=math.inf if memory.last_down_t is None else t - memory.last_down_t,
            interval_s=dt,
            excess_since_t=excess_since,
            figures=figures,
        )
        if cap is not None and current > cap:
            return Decision(
                target=cap,
                reason=f"{figures}; the shared inference saturates near {cap} workers -> {cap}",
                memory=memory,
            )
        if memory.shed_workers:
            # A removal made to test for saturation: nothing else moves the pool until judged.
            settle = self.production_settle_s(memory, batch)
            return judge_shed(self, context, memory, figures, settle, startup, reading.low_seqs)
        stalled = shed_on_stalls(self, context, memory, reading, starving)
        if stalled is not None:
            return stalled
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
        if starving and since_up >= startup and not reading.warming:
            return floor_after_growth(context, current, grow(self, context, memory, reading))
        added = add(self, context, memory, reading)
        if added is not None:
            return floor_after_growth(context, current, added)
        if queue <= high_seqs or raw <= high_seqs:
            return Decision(target=current, reason=f"{figures} -> hold {current}", memory=memory)
        paused = hold_through_pause(self, context, memory, reading)
        if paused is not None:
            return paused
        return remove(self, context, memory, reading)

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
                memory=replace(memory, cold_workers=target),
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
