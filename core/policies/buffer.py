"""``buffer``: the default for trainer queues. Hold the queue near ``target_batches`` batches.

Units are sequences throughout: a queue sample carries queued sequences (Atropos: queued groups x
group size) and the trainer's batch size in sequences.

Each sample updates two smoothed rates:

* consumption C (seq/s): the trainer step advancing, times the batch size, over elapsed time;
* per-worker production p (seq/s/worker): what entered the queue (its change plus what the trainer
  took) over elapsed time and active workers. Not measured while the queue is near atroposlib's
  ``max_batches_offpolicy`` limit, where envs pause themselves and production reads falsely low.

The wanted production rate is feed-forward plus a PI term on the buffer error e (sequences):

    P* = C + (e + I / integral_s) / refill_s,    I = integral of e dt (anti-windup: frozen while
                                                   the output is pinned at a bound, and clamped)
    workers = ceil(P* / p)

Scaling up takes effect at once; scaling down moves at most ``max_down_fraction`` of the pool
(at least one worker) per ``down_cooldown_s``. Until p has been measured the policy doubles the
pool while the queue is short of its target and holds otherwise.
"""

from __future__ import annotations

import math
from typing import ClassVar

import attrs

from core.errors import ConfigError
from core.events import QueueSampled
from core.policies.base import Decision, PolicyContext
from core.records import replace

__all__ = ["BufferMemory", "BufferPolicy"]


@attrs.frozen(slots=True, kw_only=True)
class BufferMemory:
    last_t: float
    last_queued_seqs: int
    last_step: int
    consumption_seqs_s: float | None = None
    per_worker_seqs_s: float | None = None
    integral_seqs_s: float = 0.0
    last_down_t: float | None = None


@attrs.frozen(slots=True, kw_only=True)
class BufferPolicy:
    reacts_to: ClassVar[type[QueueSampled]] = QueueSampled
    target_batches: float = 1.5
    #: Seconds over which a buffer error is to be made up (proportional gain 1/refill_s).
    refill_s: float = 30.0
    #: Integral time: how slowly a persistent error is integrated away.
    integral_s: float = 300.0
    #: Time constant of the rate estimates.
    rate_window_s: float = 30.0
    #: atroposlib's max_batches_offpolicy: envs stop producing once this many batches are queued.
    max_batches_offpolicy: float = 3.0
    max_down_fraction: float = 0.1
    down_cooldown_s: float = 30.0

    def __attrs_post_init__(self) -> None:
        for key in (
            "target_batches",
            "refill_s",
            "integral_s",
            "rate_window_s",
            "max_batches_offpolicy",
        ):
            if not getattr(self, key) > 0:
                raise ConfigError(f"policy.{key} must be > 0, got {getattr(self, key)!r}")
        if not 0 < self.max_down_fraction <= 1:
            raise ConfigError(
                f"policy.max_down_fraction must be in (0, 1], got {self.max_down_fraction}"
            )
        if self.down_cooldown_s < 0:
            raise ConfigError(f"policy.down_cooldown_s must be >= 0, got {self.down_cooldown_s}")

    def initial_target(self, min_workers: int, max_workers: int) -> int:
        return min_workers

    def decide(self, context: PolicyContext, memory: BufferMemory | None) -> Decision:
        sample = context.queue
        assert sample is not None  # the reducer asks only with a queue sample
        t, current = context.t, context.current
        batch = sample.batch_size_seqs
        queued = sample.queued_sequences
        target_seqs = self.target_batches * batch
        error = target_seqs - queued
        queued_batches = queued / batch
        if memory is None:
            memory = BufferMemory(last_t=t, last_queued_seqs=queued, last_step=sample.trainer_step)
            return self._without_rate(context, memory, error, queued_batches)

        dt = t - memory.last_t
        consumption, per_worker, integral = (
            memory.consumption_seqs_s,
            memory.per_worker_seqs_s,
            memory.integral_seqs_s,
        )
        if dt > 0:
            alpha = 1.0 - math.exp(-dt / self.rate_window_s)
            steps = max(sample.trainer_step - memory.last_step, 0)
            consumed = steps * batch
            rate = consumed / dt
            consumption = (
                rate if consumption is None else consumption + alpha * (rate - consumption)
            )
            offpolicy_seqs = 0.8 * self.max_batches_offpolicy * batch
            if context.active > 0 and max(queued, memory.last_queued_seqs) < offpolicy_seqs:
                produced = max(queued - memory.last_queued_seqs + consumed, 0)
                rate = produced / dt / context.active
                per_worker = (
                    rate if per_worker is None else per_worker + alpha * (rate - per_worker)
                )
        measured = {
            "last_t": t,
            "last_queued_seqs": queued,
            "last_step": sample.trainer_step,
            "consumption_seqs_s": consumption,
            "per_worker_seqs_s": per_worker,
        }
        if not per_worker:  # None or 0: production has not been seen yet
            return self._without_rate(context, replace(memory, **measured), error, queued_batches)
        assert consumption is not None

        # PI on the buffer error with conditional integration (anti-windup).
        candidate = integral + error * dt
        limit = 2 * target_seqs * self.integral_s
        candidate = min(max(candidate, -limit), limit)
        wanted_rate = consumption + (error + candidate / self.integral_s) / self.refill_s
        raw = wanted_rate / per_worker
        saturated_high = raw > context.max_workers and error > 0
        saturated_low = raw < context.min_workers and error < 0
        if not (saturated_high or saturated_low):
            integral = candidate
        wanted_rate = consumption + (error + integral / self.integral_s) / self.refill_s
        workers = max(math.ceil(wanted_rate / per_worker - 1e-9), 0)

        figures = (
            f"queue {queued_batches:.2f} batches vs target {self.target_batches:g}; consumption "
            f"{consumption:.2f} seq/s, {per_worker:.2f} seq/s per worker"
        )
        memory = replace(memory, integral_seqs_s=integral, **measured)
        if workers >= current:
            return Decision(target=workers, reason=f"{figures} -> {workers} workers", memory=memory)
        if memory.last_down_t is not None and t - memory.last_down_t < self.down_cooldown_s:
            return Decision(
                target=current,
                reason=f"{figures} -> {workers} workers; holding {current} (down cooldown)",
                memory=memory,
            )
        step = max(1, math.floor(current * self.max_down_fraction))
        target = max(workers, current - step)
        return Decision(
            target=target,
            reason=f"{figures} -> {workers} workers; stepping down to {target}",
            memory=replace(memory, last_down_t=t),
        )

    def _without_rate(
        self, context: PolicyContext, memory: BufferMemory, error: float, queued_batches: float
    ) -> Decision:
        current = context.current
        if error > 0:
            # Double what is already producing; workers still starting up count as requested.
            target = max(current, 2 * context.active, 1)
            return Decision(
                target=target,
                reason=(
                    f"queue {queued_batches:.2f} batches < target {self.target_batches:g}; "
                    f"per-worker production not measured yet -> {target} workers"
                ),
                memory=memory,
            )
        return Decision(
            target=current,
            reason=(
                f"queue {queued_batches:.2f} batches >= target {self.target_batches:g}; "
                f"per-worker production not measured yet -> hold {current}"
            ),
            memory=memory,
        )
