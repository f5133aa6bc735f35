"""``threshold``: load-ratio scaling with up/down thresholds, as in verl's elastic scheduler.

load ratio = in-flight requests / (capacity per worker x active workers). Each sample is kept for
``stability_s``; the load is *stable* once at least three samples have been seen, at least two lie
in the last ``stability_s`` seconds and their (population) variance is below ``max_variance``.
When stable, a ratio above ``scale_up_threshold`` adds ``step`` workers (if more than
``scale_up_cooldown_s`` has passed since the last scale-up) and one below ``scale_down_threshold``
removes ``step`` (more than ``scale_down_cooldown_s`` since the last scale-down). These are verl's
rules and defaults (ElasticConfig: 0.8 / 0.5, 30 s / 60 s, 10 s, variance 0.1, one worker).

``count_starting = true`` divides by the workers on their way as well (requested, starting and,
for engines, waking): capacity already asked for, so that a scale-up is not repeated while it
starts (a cold start takes minutes). While any is on its way the policy does not scale down: the
capacity that makes the ratio low does not serve yet. Engine pools set it unless their policy says
otherwise; ``false`` (the default elsewhere) is verl's rule as published.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from typing import ClassVar

import attrs

from core.errors import ConfigError
from core.events import LoadSampled
from core.policies.base import Decision, PolicyContext
from core.records import replace, replaceable

__all__ = ["ThresholdMemory", "ThresholdPolicy"]


def _pairs(value: Iterable[Sequence[float]]) -> tuple[tuple[float, float], ...]:
    # JSON gives lists back; the memory must compare equal after a round trip through the log.
    return tuple((float(t), float(ratio)) for t, ratio in value)


@replaceable
@attrs.frozen(slots=True, kw_only=True)
class ThresholdMemory:
    #: (t, load ratio) of the samples of the last ``stability_s`` seconds.
    recent: tuple[tuple[float, float], ...] = attrs.field(default=(), converter=_pairs)
    samples_seen: int = 0
    last_up_t: float | None = None
    last_down_t: float | None = None


def _since(now: float, then: float | None) -> float:
    return float("inf") if then is None else now - then


@attrs.frozen(slots=True, kw_only=True)
class ThresholdPolicy:
    reacts_to: ClassVar[type[LoadSampled]] = LoadSampled
    capacity_per_worker: float = 8.0
    scale_up_threshold: float = 0.8
    scale_down_threshold: float = 0.5
    scale_up_cooldown_s: float = 30.0
    scale_down_cooldown_s: float = 60.0
    stability_s: float = 10.0
    max_variance: float = 0.1
    step: int = 1
    count_starting: bool = False

    def __attrs_post_init__(self) -> None:
        if not self.capacity_per_worker > 0:
            raise ConfigError(
                f"policy.capacity_per_worker must be > 0, got {self.capacity_per_worker}"
            )
        if not 0 <= self.scale_down_threshold < self.scale_up_threshold:
            raise ConfigError(
                f"policy.scale_down_threshold ({self.scale_down_threshold}) must be >= 0 and below "
                f"scale_up_threshold ({self.scale_up_threshold})"
            )
        if self.step < 1:
            raise ConfigError(f"policy.step must be >= 1, got {self.step}")
        for key in ("scale_up_cooldown_s", "scale_down_cooldown_s", "stability_s", "max_variance"):
            if getattr(self, key) < 0:
                raise ConfigError(f"policy.{key} must be >= 0, got {getattr(self, key)}")

    def initial_target(self, min_workers: int, max_workers: int) -> int:
        return min_workers

    def decide(self, context: PolicyContext, memory: ThresholdMemory | None) -> Decision:
        mem = memory or ThresholdMemory()
        t, current, active = context.t, context.current, max(context.active, 1)
        assert context.load is not None  # the reducer asks only with a load sample
        in_flight = context.load.in_flight_requests
        workers = f"{active}"
        if self.count_starting and context.current > context.active:
            # Starting (or waking) workers are capacity on the way: counted, as if active.
            workers = f"({context.active} active + {context.current - context.active} starting)"
            active = max(context.current, 1)
        ratio = in_flight / (self.capacity_per_worker * active)
        recent = tuple((ts, r) for ts, r in mem.recent if t - ts <= self.stability_s)
        recent += ((t, ratio),)
        mem = replace(mem, recent=recent, samples_seen=mem.samples_seen + 1)
        figures = f"load {in_flight} / ({self.capacity_per_worker:g} x {workers}) = {ratio:.2f}"
        variance = statistics.pvariance([r for _, r in recent]) if len(recent) >= 2 else None
        stable = mem.samples_seen >= 3 and variance is not None and variance < self.max_variance
        if ratio > self.scale_up_threshold:
            if stable and _since(t, mem.last_up_t) > self.scale_up_cooldown_s:
                target = current + self.step
                return Decision(
                    target=target,
                    reason=f"{figures} > {self.scale_up_threshold:g}, stable -> {target}",
                    memory=replace(mem, last_up_t=t),
                )
            why = "cooldown" if stable else "not stable yet"
            return Decision(target=current, reason=f"{figures} high; waiting ({why})", memory=mem)
        if ratio < self.scale_down_threshold and current > 0:
            arriving = context.current - context.active
            if self.count_starting and arriving > 0:
                # The capacity that makes the ratio low does not serve yet: a dip now says
                # nothing about the pool once it does.
                return Decision(
                    target=current,
                    reason=f"{figures} low; waiting ({arriving} starting)",
                    memory=mem,
                )
            if stable and _since(t, mem.last_down_t) > self.scale_down_cooldown_s:
                target = max(current - self.step, 0)
                return Decision(
                    target=target,
                    reason=f"{figures} < {self.scale_down_threshold:g}, stable -> {target}",
                    memory=replace(mem, last_down_t=t),
                )
            why = "cooldown" if stable else "not stable yet"
            return Decision(target=current, reason=f"{figures} low; waiting ({why})", memory=mem)
        return Decision(
            target=current,
            reason=f"{figures} within [{self.scale_down_threshold:g}, {self.scale_up_threshold:g}]",
            memory=mem,
        )
