"""The published controllers deo is benchmarked against, as policies the real reducer can run.

These are comparison baselines, not policies a user should pick: they live with the benchmark, and
a reducer runs them only when its caller hands it :data:`CATALOG` (the core's policies and these).
Each reproduces its published rule, including where that rule is wrong for a trainer queue (the
point of a baseline is to measure the rule people actually ran).

* ``deo-proposal`` (:class:`DeoProposalPolicy`): the Atropos DEO proposal's ScalingController.
* ``ray-serve`` (:class:`RayServePolicy`): Ray Serve's default autoscaling policy.
* verl's elastic scheduler and the Kubernetes HPA are core's ``threshold`` and ``hpa`` policies;
  :func:`baseline_specs` gives them their published parameters.
* ``static``: core's static policy at the pool's maximum.

:func:`baseline_specs` maps each baseline's name to its :class:`~core.config.PolicySpec` and the
pool settings it needs (``stabilization_s=0`` for policies that keep their own delays, so the
reducer's central window does not change their published behaviour).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import Any, ClassVar

import attrs

from core.config import PolicySpec
from core.errors import ConfigError
from core.events import LoadSampled, QueueSampled
from core.policies import BUILT_INS, PolicyCatalog
from core.policies.base import Decision, PolicyContext

__all__ = [
    "BASELINE_POLICIES",
    "CATALOG",
    "HPA_TARGET_OF_CAPACITY",
    "RAY_TARGET_OF_MAX_ONGOING",
    "DeoCorrectedPolicy",
    "DeoProposalMemory",
    "DeoProposalPolicy",
    "RayServeMemory",
    "RayServePolicy",
    "baseline_specs",
]


def _ceil(value: float) -> int:
    """``math.ceil`` that takes a value within float noise of an integer as that integer."""
    nearest = round(value)
    return int(nearest) if abs(value - nearest) < 1e-9 else math.ceil(value)


def _clamp(value: int, context: PolicyContext) -> int:
    return max(context.min_workers, min(context.max_workers, value))


# --- the Atropos DEO proposal --------------------------------------------------------------------


@attrs.frozen(slots=True, kw_only=True)
class DeoProposalMemory:
    #: When the controller last changed the count (its ``last_action_timestamp``); None: never.
    last_action_t: float | None = None


@attrs.frozen(slots=True, kw_only=True)
class _DeoRule:
    """The DEO proposal's controller loop: cooldown, strict dead band, launch-storm guard, step
    cap, clamping, and "no action" when the target is the connected count. Subclasses say how
    the queue becomes a pressure (:meth:`_pressure`) and how a pressure becomes a worker count
    (:meth:`_wanted`)."""

    reacts_to: ClassVar[type[QueueSampled]] = QueueSampled
    target_pressure: float = 1.0
    scaling_threshold: float = 0.2
    cooldown_s: float = 60.0
    max_step_change: int = 4

    def __attrs_post_init__(self) -> None:
        if not self.target_pressure > 0:
            raise ConfigError(f"policy.target_pressure must be > 0, got {self.target_pressure}")
        if self.scaling_threshold < 0:
            raise ConfigError(
                f"policy.scaling_threshold must be >= 0, got {self.scaling_threshold}"
            )
        if self.cooldown_s < 0:
            raise ConfigError(f"policy.cooldown_s must be >= 0, got {self.cooldown_s}")
        if self.max_step_change < 1:
            raise ConfigError(f"policy.max_step_change must be >= 1, got {self.max_step_change}")

    def initial_target(self, min_workers: int, max_workers: int) -> int:
        # ScalingController starts from current_desired = min_actors.
        return min_workers

    def _pressure(self, sample: QueueSampled) -> tuple[float, str]:
        """The pressure of ``sample``, and how a reason shows it."""
        raise NotImplementedError

    def _wanted(self, pressure: float, connected: int, context: PolicyContext) -> int:
        """The worker count ``pressure`` asks for, before the step cap."""
        raise NotImplementedError

    def decide(self, context: PolicyContext, memory: DeoProposalMemory | None) -> Decision:
        mem = memory or DeoProposalMemory()
        sample = context.queue
        assert sample is not None  # the reducer asks only with a queue sample
        t, current, connected = context.t, context.current, context.active
        pressure, shown = self._pressure(sample)
        figures = f"{shown} (target {self.target_pressure:g}), {connected} connected of {current}"
        if mem.last_action_t is not None and t - mem.last_action_t < self.cooldown_s:
            left = self.cooldown_s - (t - mem.last_action_t)
            return Decision(
                target=current, reason=f"{figures}; cooldown {left:.0f}s: hold", memory=mem
            )
        if abs(pressure - self.target_pressure) < self.scaling_threshold:
            return Decision(
                target=current,
                reason=f"{figures}; within +-{self.scaling_threshold:g}: hold",
                memory=mem,
            )
        raw = self._wanted(pressure, connected, context)
        if raw > connected and current >= raw:
            return Decision(
                target=current,
                reason=f"{figures}; wants {raw}, already {current} with pending: hold",
                memory=mem,
            )
        step = max(-self.max_step_change, min(self.max_step_change, raw - connected))
        final = _clamp(connected + step, context)
        if final == connected:
            return Decision(target=current, reason=f"{figures}; wants {raw}: hold", memory=mem)
        direction = "up" if final > connected else "down"
        return Decision(
            target=final,
            reason=f"{figures}; wants {raw}, scale {direction} {connected} -> {final}",
            memory=DeoProposalMemory(last_action_t=t),
        )


@attrs.frozen(slots=True, kw_only=True)
class DeoProposalPolicy(_DeoRule):
    """The Atropos DEO proposal's controller (NousResearch/atropos PR #438), as published.

    Source: ``atroposlib/orchestration/controller.py`` (``ScalingController.calculate_desired``)
    and ``metrics.py`` (``WorkloadMetrics.rollout_pressure``) on branch
    ``RUFFY-369:feat/deo-elastic-orchestrator``. On every queue sample:

    1. pressure = queue_size / batch_size, where Atropos' ``queue_size`` counts queued **groups**
       (here ``queued_sequences // group_size``) and ``batch_size`` counts **sequences**;
    2. within ``cooldown_s`` of its last change: hold;
    3. ``|pressure - target_pressure| < scaling_threshold`` (dead band, strict): hold;
    4. raw = ceil(max(connected, 1) x pressure / target_pressure): more workers on a **deep**
       queue, fewer on a short one, which is backwards for a trainer queue (a deep queue means
       the environments are ahead); reproduced anyway;
    5. scaling up while connected + pending workers already reach raw: hold (launch-storm guard);
    6. the change from the connected count is capped at ``max_step_change`` workers, then the
       result is clamped to the pool's bounds; if it differs from the connected count it is the
       new target and the cooldown starts.

    Mapping and choices where the published code is silent or tied to its runtime:

    * connected = ``context.active`` (registered envs), pending = ``context.current - active``.
      deo does not count draining workers as active, so the published "already draining enough"
      guard (connected - draining <= raw) can never hold here and is left out; the proposal's
      ``num_connected_envs`` would also include envs still draining.
    * A target equal to the connected count means "no action" in the proposal's loop (it calls
      ``set_instance_count`` only when the target differs from the connected count), so it holds
      ``context.current`` rather than stopping pending workers. A capped target above the
      connected count but below the live count is passed on as is: the proposal then stops
      workers too (``set_instance_count`` compares with every live process).
    * ``cooldown_s`` is 60 s: the controller's default, the README's ``--cooldown`` default and
      what the PR's tests use; the CLI (``atropos-orchestrate``) passes ``--cooldown`` whose
      argparse default is 10 s. No cooldown before the first change (the published
      ``last_action_timestamp = 0`` against wall-clock time never blocks the first decision).
    * The proposal polls every 10 s; here it decides on every queue sample the runner feeds.
    * Its VRAM pre-flight check is left to deo's GPU placement (the reducer places workers).
    * The "PID-style dampening" the PR describes is exactly steps 2, 3 and 6 (no integral or
      derivative term exists in the code).
    """

    #: Sequences per group: Atropos' queue counts groups, the sample counts sequences.
    group_size: int = 1

    def __attrs_post_init__(self) -> None:
        if self.group_size < 1:
            raise ConfigError(f"policy.group_size must be >= 1, got {self.group_size}")
        super().__attrs_post_init__()

    def _pressure(self, sample: QueueSampled) -> tuple[float, str]:
        queue_groups = sample.queued_sequences // self.group_size
        pressure = queue_groups / sample.batch_size_seqs
        return pressure, (
            f"pressure {queue_groups} groups / {sample.batch_size_seqs} seqs = {pressure:.2f}"
        )

    def _wanted(self, pressure: float, connected: int, context: PolicyContext) -> int:
        return _ceil(max(connected, 1) * (pressure / self.target_pressure))


@attrs.frozen(slots=True, kw_only=True)
class DeoCorrectedPolicy(_DeoRule):
    """The DEO proposal's rule with its units and direction corrected: the baseline that matters.

    Everything of :class:`DeoProposalPolicy` (cooldown, strict dead band, launch-storm guard, step
    cap, clamping, "no action" when the target is the connected count) except two things:

    1. pressure = queued **batches** = ``queued_sequences / batch_size_seqs`` (sequences over
       sequences), so ``target_pressure`` is the queue depth in batches it aims at;
    2. raw = ceil(max(connected, 1) x target_pressure / pressure): more workers on a **short**
       queue, fewer on a deep one; an empty queue asks for the pool's maximum (the step cap
       still applies).
    """

    def _pressure(self, sample: QueueSampled) -> tuple[float, str]:
        pressure = sample.queued_sequences / sample.batch_size_seqs
        return pressure, f"queue {pressure:.2f} batches"

    def _wanted(self, pressure: float, connected: int, context: PolicyContext) -> int:
        if pressure > 0:
            return _ceil(max(connected, 1) * (self.target_pressure / pressure))
        return context.max_workers


# --- Ray Serve -----------------------------------------------------------------------------------


def _samples(value: Iterable[Iterable[float]]) -> tuple[tuple[float, int], ...]:
    return tuple((float(t), int(n)) for t, n in value)


@attrs.frozen(slots=True, kw_only=True)
class RayServeMemory:
    #: (time, in-flight requests) samples inside the look-back window, oldest first.
    samples: tuple[tuple[float, int], ...] = attrs.field(default=(), converter=_samples)
    #: The direction of the decision made on consecutive samples: +1 up, -1 down, 0 none.
    direction: int = 0
    #: When that run of same-direction decisions began.
    since_t: float | None = None


@attrs.frozen(slots=True, kw_only=True)
class RayServePolicy:
    """Ray Serve's default autoscaling policy (``replica_queue_length_autoscaling_policy``).

    Source: ``python/ray/serve/autoscaling_policy.py`` (ray-project/ray) and the
    ``ray.serve.config.AutoscalingConfig`` defaults: ``target_ongoing_requests=2``,
    ``upscale_delay_s=30``, ``downscale_delay_s=600``, ``smoothing_factor=1`` (the up/down
    scaling factors default to it), ``look_back_period_s=30``. On every load sample:

    1. total = mean of the in-flight samples of the last ``look_back_period_s`` (Serve averages
       each replica's ongoing requests over that window and sums them);
    2. cold start: with no running replica, any load asks for max(ceil(upscaling_factor), current
       target) at once and no load holds, both bypassing the delays;
    3. desired = running x total / (target_ongoing_requests x running), i.e. total / target;
    4. scaling factor: ceil(running + factor x (desired - running)), the up or down factor by
       sign; a scale-down the factor would leave stuck at ``running`` steps down by one;
    5. clamp to the pool's bounds (Serve does this before the delays, so a desire beyond the
       bounds does not keep a delay running);
    6. delay: a decision above the current target applies once decisions above it have been made
       continuously for ``upscale_delay_s``, one below it after ``downscale_delay_s`` (never
       below 1 except from exactly 1); a decision equal to the target, or in the other direction,
       restarts the count. A decision that applies restarts it too.

    Mapping and choices: running replicas = ``context.active``; Serve's current target =
    ``context.current``. Step 6 is measured in event time: Serve counts its 0.1 s control-loop
    iterations (``decision_counter > int(delay_s / CONTROL_LOOP_INTERVAL_S)``), which equals
    "persisted for the delay" only when the loop runs on time. ``downscale_to_zero_delay_s`` is
    unset by default, so 1 -> 0 waits ``downscale_delay_s`` as well. The look-back mean is the
    plain mean of the samples whose age is below ``look_back_period_s``, the current one included.
    """

    reacts_to: ClassVar[type[LoadSampled]] = LoadSampled
    target_ongoing_requests: float = 2.0
    upscale_delay_s: float = 30.0
    downscale_delay_s: float = 600.0
    upscaling_factor: float = 1.0
    downscaling_factor: float = 1.0
    look_back_period_s: float = 30.0

    def __attrs_post_init__(self) -> None:
        for key in (
            "target_ongoing_requests",
            "upscaling_factor",
            "downscaling_factor",
            "look_back_period_s",
        ):
            if not getattr(self, key) > 0:
                raise ConfigError(f"policy.{key} must be > 0, got {getattr(self, key)!r}")
        for key in ("upscale_delay_s", "downscale_delay_s"):
            if getattr(self, key) < 0:
                raise ConfigError(f"policy.{key} must be >= 0, got {getattr(self, key)!r}")

    def initial_target(self, min_workers: int, max_workers: int) -> int:
        # initial_replicas defaults to None: Serve starts from min_replicas.
        return min_workers

    def decide(self, context: PolicyContext, memory: RayServeMemory | None) -> Decision:
        mem = memory or RayServeMemory()
        assert context.load is not None  # the reducer asks only with a load sample
        t, target_now, running = context.t, context.current, context.active
        window = (
            *((ts, n) for ts, n in mem.samples if t - ts < self.look_back_period_s),
            (t, context.load.in_flight_requests),
        )
        total = sum(n for _, n in window) / len(window)
        figures = f"{total:.2f} in flight (mean of {len(window)} over {self.look_back_period_s:g}s)"
        mem = attrs.evolve(mem, samples=window)

        if running == 0:
            # Cold start: bypasses factors and delays, and leaves the decision count alone.
            if total > 0:
                target = max(_ceil(self.upscaling_factor), target_now)
                return Decision(
                    target=target, reason=f"{figures}, no replica running -> {target}", memory=mem
                )
            return Decision(target=target_now, reason=f"{figures}, no replica running", memory=mem)

        desired = total / self.target_ongoing_requests
        delta = desired - running
        factor = self.upscaling_factor if delta > 0 else self.downscaling_factor
        scaled = _ceil(running + factor * delta)
        if _ceil(desired) < running and scaled == running:
            scaled -= 1
        bounded = _clamp(scaled, context)
        figures += (
            f" / target {self.target_ongoing_requests:g} = {desired:.2f} replicas -> {bounded}"
        )

        if bounded > target_now:
            direction, delay_s = 1, self.upscale_delay_s
        elif bounded < target_now:
            direction, delay_s = -1, self.downscale_delay_s
            if target_now != 1:
                bounded = max(1, bounded)  # only 1 -> 0 may reach zero
        else:
            return Decision(
                target=target_now,
                reason=f"{figures}: at target",
                memory=attrs.evolve(mem, direction=0, since_t=None),
            )
        since_t = mem.since_t if mem.direction == direction and mem.since_t is not None else t
        held_s = t - since_t
        if held_s >= delay_s:
            return Decision(
                target=bounded,
                reason=f"{figures}: held {held_s:.0f}s >= {delay_s:g}s, {target_now} -> {bounded}",
                memory=attrs.evolve(mem, direction=0, since_t=None),
            )
        return Decision(
            target=target_now,
            reason=f"{figures}: held {held_s:.0f}s < {delay_s:g}s, keeping {target_now}",
            memory=attrs.evolve(mem, direction=direction, since_t=since_t),
        )


# --- the catalog and the benchmark's line-up ------------------------------------------------------

#: The baselines defined here, by name.
BASELINE_POLICIES: Mapping[str, type] = MappingProxyType(
    {
        "deo-proposal": DeoProposalPolicy,
        "deo-corrected": DeoCorrectedPolicy,
        "ray-serve": RayServePolicy,
    }
)
#: The core's policies and the baselines, with the baselines' memories for the codec (a state
#: snapshot of a pool run by a baseline encodes and decodes like any other): what the harness
#: hands to the simulator, and through it to the reducer and the event log.
CATALOG: PolicyCatalog = BUILT_INS.extended(
    BASELINE_POLICIES, records=(DeoProposalMemory, RayServeMemory)
)

#: Ray Serve's default target_ongoing_requests (2) over its default max_ongoing_requests (5).
RAY_TARGET_OF_MAX_ONGOING = 2 / 5
#: The HPA's target per worker as a share of its capacity (no published default; see
#: :func:`baseline_specs`).
HPA_TARGET_OF_CAPACITY = 0.8


def baseline_specs(
    group_size: int, groups_in_flight: int, max_workers: int
) -> dict[str, tuple[PolicySpec, dict[str, Any]]]:
    """Every baseline by name: its policy spec and the pool settings it runs with.

    ``group_size``: sequences per group (the DEO proposal counts the queue in groups).
    ``groups_in_flight``: groups one worker generates at once: the per-worker capacity of the
    load-based policies, which read in-flight requests = groups being generated. A worker can
    never hold more than its capacity, so a policy aiming at 100% of it would never scale up;
    each aims where its published defaults put it:

    * verl: ``capacity_per_worker`` = capacity, thresholds 0.5 / 0.8 of it (``ElasticConfig``);
    * Ray Serve: ``target_ongoing_requests`` = capacity x 2/5, the default target (2) over the
      default ``max_ongoing_requests`` (5), the per-replica limit that capacity stands for;
    * Kubernetes HPA: it has no default target (the user sets one); ``target_per_worker`` =
      capacity x 0.8, verl's scale-up point, so a saturated worker (ratio 1.25) lies outside the
      0.1 tolerance.

    ``max_workers``: the count the ``static`` baseline holds (the pool's maximum: it never
    starves for lack of workers, so it bounds what a fixed allocation costs).

    Every baseline except ``static`` keeps its own published delays, so it runs with the
    reducer's stabilization window off (``stabilization_s = 0``).
    """
    for key, value in (
        ("group_size", group_size),
        ("groups_in_flight", groups_in_flight),
        ("max_workers", max_workers),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"baseline_specs: {key} must be an integer >= 1, got {value!r}")
    own_delays: dict[str, Any] = {"stabilization_s": 0.0}
    capacity = float(groups_in_flight)
    return {
        "deo-proposal": (
            PolicySpec(name="deo-proposal", params={"group_size": group_size}),
            dict(own_delays),
        ),
        "deo-corrected": (PolicySpec(name="deo-corrected"), dict(own_delays)),
        "ray-serve": (
            PolicySpec(
                name="ray-serve",
                params={"target_ongoing_requests": capacity * RAY_TARGET_OF_MAX_ONGOING},
            ),
            dict(own_delays),
        ),
        # verl's ElasticConfig defaults (the elastic scheduler for SGLangRollout).
        "verl": (
            PolicySpec(
                name="threshold",
                params={
                    "capacity_per_worker": capacity,
                    "scale_up_threshold": 0.8,
                    "scale_down_threshold": 0.5,
                    "scale_up_cooldown_s": 30.0,
                    "scale_down_cooldown_s": 60.0,
                    "stability_s": 10.0,
                    "step": 1,
                },
            ),
            dict(own_delays),
        ),
        # Kubernetes HPA defaults: --horizontal-pod-autoscaler-tolerance 0.1, scaleDown
        # stabilizationWindowSeconds 300; an AverageValue target per worker.
        "k8s-hpa": (
            PolicySpec(
                name="hpa",
                params={
                    "target_per_worker": capacity * HPA_TARGET_OF_CAPACITY,
                    "tolerance": 0.1,
                    "scale_down_stabilization_s": 300.0,
                },
            ),
            dict(own_delays),
        ),
        "static": (PolicySpec(name="static", params={"count": max_workers}), {}),
    }
