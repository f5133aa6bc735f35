"""``threshold``: load-ratio scaling with up/down thresholds, as in verl's elastic scheduler.

load ratio = in-flight requests / (capacity per worker x workers). Above ``scale_up_threshold``
for ``stability_s`` (and ``scale_up_cooldown_s`` after the last scale-up) it adds ``step`` workers;
below ``scale_down_threshold`` for ``stability_s`` (and ``scale_down_cooldown_s`` after the last
scale-down) it removes ``step``.
"""

from __future__ import annotations

from typing import ClassVar

import attrs

from core.errors import ConfigError
from core.events import LoadSampled
from core.policies.base import Decision, PolicyContext
from core.records import replace

__all__ = ["ThresholdMemory", "ThresholdPolicy"]


@attrs.frozen(slots=True, kw_only=True)
class ThresholdMemory:
    above_since_t: float | None = None
    below_since_t: float | None = None
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
    step: int = 1

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
        for key in ("scale_up_cooldown_s", "scale_down_cooldown_s", "stability_s"):
            if getattr(self, key) < 0:
                raise ConfigError(f"policy.{key} must be >= 0, got {getattr(self, key)}")

    def initial_target(self, min_workers: int, max_workers: int) -> int:
        return min_workers

    def decide(self, context: PolicyContext, memory: ThresholdMemory | None) -> Decision:
        mem = memory or ThresholdMemory()
        t, current = context.t, context.current
        assert context.load is not None  # the reducer asks only with a load sample
        in_flight = context.load.in_flight_requests
        ratio = in_flight / (self.capacity_per_worker * max(current, 1))
        figures = (
            f"load {in_flight} / ({self.capacity_per_worker:g} x {max(current, 1)}) = {ratio:.2f}"
        )
        if ratio > self.scale_up_threshold:
            if mem.above_since_t is None or mem.below_since_t is not None:
                mem = replace(mem, above_since_t=t, below_since_t=None)
            assert mem.above_since_t is not None
            held = t - mem.above_since_t
            if held >= self.stability_s and _since(t, mem.last_up_t) >= self.scale_up_cooldown_s:
                target = current + self.step
                return Decision(
                    target=target,
                    reason=f"{figures} > {self.scale_up_threshold:g} for {held:.0f}s -> {target}",
                    memory=replace(mem, last_up_t=t, above_since_t=None),
                )
            return Decision(
                target=current, reason=f"{figures} high; waiting (stability/cooldown)", memory=mem
            )
        if ratio < self.scale_down_threshold and current > 0:
            if mem.below_since_t is None or mem.above_since_t is not None:
                mem = replace(mem, below_since_t=t, above_since_t=None)
            assert mem.below_since_t is not None
            held = t - mem.below_since_t
            if (
                held >= self.stability_s
                and _since(t, mem.last_down_t) >= self.scale_down_cooldown_s
            ):
                target = max(current - self.step, 0)
                return Decision(
                    target=target,
                    reason=f"{figures} < {self.scale_down_threshold:g} for {held:.0f}s -> {target}",
                    memory=replace(mem, last_down_t=t, below_since_t=None),
                )
            return Decision(
                target=current, reason=f"{figures} low; waiting (stability/cooldown)", memory=mem
            )
        return Decision(
            target=current,
            reason=f"{figures} within [{self.scale_down_threshold:g}, {self.scale_up_threshold:g}]",
            memory=replace(mem, above_since_t=None, below_since_t=None),
        )
