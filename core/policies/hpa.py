"""``hpa``: the Kubernetes Horizontal Pod Autoscaler's rule on in-flight requests per worker.

desired = ceil(current x metric / target), unchanged while |metric / target - 1| <= tolerance;
a scale-down takes the highest recommendation of the last ``scale_down_stabilization_s``; a
scale-up adds at most max(``scale_up_pods``, ``scale_up_percent`` %) of the count at the start of
the last ``scale_up_period_s`` (Kubernetes' defaults: tolerance 0.1, 300 s; 4 pods or 100 % per
15 s).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import ClassVar

import attrs

from core.errors import ConfigError
from core.events import LoadSampled
from core.policies.base import Decision, PolicyContext

__all__ = ["HpaMemory", "HpaPolicy"]


def _pairs(value: Iterable[Iterable[float]]) -> tuple[tuple[float, int], ...]:
    return tuple((float(t), int(n)) for t, n in value)


@attrs.frozen(slots=True, kw_only=True)
class HpaMemory:
    #: (time, recommendation) pairs inside the stabilization window, oldest first.
    recommendations: tuple[tuple[float, int], ...] = attrs.field(default=(), converter=_pairs)
    #: (time, workers added) of the scale-ups inside the scale-up period.
    scale_ups: tuple[tuple[float, int], ...] = attrs.field(default=(), converter=_pairs)


@attrs.frozen(slots=True, kw_only=True)
class HpaPolicy:
    reacts_to: ClassVar[type[LoadSampled]] = LoadSampled
    target_per_worker: float = 4.0
    tolerance: float = 0.1
    scale_down_stabilization_s: float = 300.0
    scale_up_pods: int = 4
    scale_up_percent: float = 100.0
    scale_up_period_s: float = 15.0

    def __attrs_post_init__(self) -> None:
        if not self.target_per_worker > 0:
            raise ConfigError(f"policy.target_per_worker must be > 0, got {self.target_per_worker}")
        if not 0 <= self.tolerance < 1:
            raise ConfigError(f"policy.tolerance must be in [0, 1), got {self.tolerance}")
        if self.scale_down_stabilization_s < 0:
            raise ConfigError("policy.scale_down_stabilization_s must be >= 0")
        if self.scale_up_pods < 1 or not self.scale_up_percent > 0:
            raise ConfigError("policy.scale_up_pods must be >= 1 and scale_up_percent > 0")
        if self.scale_up_period_s < 0:
            raise ConfigError("policy.scale_up_period_s must be >= 0")

    def initial_target(self, min_workers: int, max_workers: int) -> int:
        return min_workers

    def _workers_for(self, in_flight: int) -> int:
        whole = in_flight / self.target_per_worker
        nearest = round(whole)
        # Guard exact multiples against float noise (100 / 4.0 is exactly 25, not 25.0000001).
        return nearest if abs(whole - nearest) < 1e-9 else math.ceil(whole)

    def decide(self, context: PolicyContext, memory: HpaMemory | None) -> Decision:
        mem = memory or HpaMemory()
        t, current = context.t, context.current
        assert context.load is not None  # the reducer asks only with a load sample
        in_flight = context.load.in_flight_requests
        if current == 0:
            ratio = math.inf if in_flight else 1.0
        else:
            ratio = in_flight / (current * self.target_per_worker)
        # ceil(current x ratio) = ceil(in_flight / target), computed without the float product.
        raw = current if abs(ratio - 1) <= self.tolerance else self._workers_for(in_flight)
        horizon = self.scale_down_stabilization_s
        kept = tuple((ts, n) for ts, n in mem.recommendations if t - ts < horizon)
        window = (*kept, (t, raw))
        target = raw
        why = (
            f"{in_flight} in flight / {current} workers = {ratio:.2f} x target "
            f"{self.target_per_worker:g}"
        )
        ups = tuple((ts, n) for ts, n in mem.scale_ups if t - ts < self.scale_up_period_s)
        if raw < current:
            # Stabilization only delays a scale-down: never above the current count.
            target = min(current, max(n for _, n in window))
            if target > raw:
                why += f"; recommendation {raw}, highest in last {horizon:g}s {target}"
        elif raw > current:
            start = max(current - sum(n for _, n in ups), 0)  # the count when the period began
            limit = max(
                start + self.scale_up_pods, math.ceil(start * (1 + self.scale_up_percent / 100))
            )
            target = max(min(raw, limit), current)
            if target < raw:
                why += f"; recommendation {raw}, at most {limit} per {self.scale_up_period_s:g}s"
            if target > current:
                ups = (*ups, (t, target - current))
        return Decision(
            target=target,
            reason=f"{why} -> {target}",
            memory=HpaMemory(recommendations=window, scale_ups=ups),
        )
