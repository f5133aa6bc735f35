"""core.policies: building from a PolicySpec, and decision tables for every policy.

Each table row carries its arithmetic as a comment, in the style of Ray Serve's autoscaling tests.
Policies never clamp to the pool's bounds (the reducer does), so targets here may exceed them.
"""

from __future__ import annotations

import math
from typing import Any

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from core.config import PolicySpec
from core.errors import ConfigError
from core.events import LoadSampled, QueueSampled
from core.policies import (
    BUILT_INS,
    POLICIES,
    BufferMemory,
    BufferPolicy,
    Decision,
    HpaMemory,
    HpaPolicy,
    PolicyCatalog,
    PolicyContext,
    StaticPolicy,
    ThresholdMemory,
    ThresholdPolicy,
    build,
)


def load_ctx(
    t: float,
    current: int,
    in_flight: int,
    *,
    active: int | None = None,
    min_workers: int = 0,
    max_workers: int = 100,
) -> PolicyContext:
    return PolicyContext(
        t=t,
        pool="p",
        current=current,
        active=current if active is None else active,
        min_workers=min_workers,
        max_workers=max_workers,
        load=LoadSampled(t=t, pool="p", in_flight_requests=in_flight),
    )


def queue_ctx(
    t: float,
    queued: int,
    step: int,
    *,
    current: int,
    active: int | None = None,
    batch: int = 64,
    min_workers: int = 0,
    max_workers: int = 100,
) -> PolicyContext:
    return PolicyContext(
        t=t,
        pool="p",
        current=current,
        active=current if active is None else active,
        min_workers=min_workers,
        max_workers=max_workers,
        queue=QueueSampled(
            t=t, pool="p", queued_sequences=queued, batch_size_seqs=batch, trainer_step=step
        ),
    )


# --- build --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "params", "key"),
    [
        ("nope", {}, "policy.name"),  # unknown policy
        ("Buffer", {}, "policy.name"),  # names are case-sensitive
        ("hpa", {"bogus": 1.0}, "policy.bogus"),  # unknown parameter
        ("static", {"target_per_worker": 4.0}, "policy.target_per_worker"),  # another's param
        ("buffer", {"reacts_to": "x"}, "policy.reacts_to"),  # a ClassVar is not a parameter
        # wrong types
        ("threshold", {"step": "2"}, "policy.step"),
        ("threshold", {"step": 1.5}, "policy.step"),  # float for an int
        ("threshold", {"step": 2.0}, "policy.step"),  # even a whole float
        ("static", {"count": True}, "policy.count"),  # bool is not an int here
        ("hpa", {"target_per_worker": "4"}, "policy.target_per_worker"),
        ("hpa", {"tolerance": True}, "policy.tolerance"),  # bool is not a float either
        ("buffer", {"refill_s": "30s"}, "policy.refill_s"),
        # out of range: the policy's own validation, still naming the key
        ("static", {"count": -1}, "policy.count"),
        ("hpa", {"target_per_worker": 0}, "policy.target_per_worker"),
        ("hpa", {"tolerance": 1.0}, "policy.tolerance"),
        ("hpa", {"tolerance": -0.1}, "policy.tolerance"),
        ("hpa", {"scale_down_stabilization_s": -1}, "policy.scale_down_stabilization_s"),
        ("threshold", {"capacity_per_worker": 0}, "policy.capacity_per_worker"),
        ("threshold", {"scale_down_threshold": 0.9}, "policy.scale_down_threshold"),  # > up 0.8
        ("threshold", {"scale_down_threshold": 0.8}, "policy.scale_down_threshold"),  # == up
        ("threshold", {"scale_down_threshold": -0.1}, "policy.scale_down_threshold"),
        ("threshold", {"step": 0}, "policy.step"),
        ("threshold", {"stability_s": -1}, "policy.stability_s"),
        ("threshold", {"scale_up_cooldown_s": -1}, "policy.scale_up_cooldown_s"),
        ("threshold", {"scale_down_cooldown_s": -1}, "policy.scale_down_cooldown_s"),
        ("buffer", {"target_batches": 0}, "policy.target_batches"),
        ("buffer", {"refill_s": 0}, "policy.refill_s"),
        ("buffer", {"integral_s": -1}, "policy.integral_s"),
        ("buffer", {"rate_window_s": 0}, "policy.rate_window_s"),
        ("buffer", {"max_batches_offpolicy": 0}, "policy.max_batches_offpolicy"),
        ("buffer", {"max_down_fraction": 0}, "policy.max_down_fraction"),
        ("buffer", {"max_down_fraction": 1.5}, "policy.max_down_fraction"),
        ("buffer", {"down_cooldown_s": -1}, "policy.down_cooldown_s"),
        ("buffer", {"production_window_s": 0}, "policy.production_window_s"),
        ("buffer", {"max_up_fraction": 0}, "policy.max_up_fraction"),
        ("buffer", {"band_batches": -0.1}, "policy.band_batches"),
        ("buffer", {"band_batches": 1.25}, "policy.band_batches"),  # not below the target 1.25
    ],
)
def test_build_errors_name_the_key(name: str, params: dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigError) as info:
        build(PolicySpec(name=name, params=params))
    assert key in str(info.value)


def test_unknown_policy_lists_the_known_ones() -> None:
    with pytest.raises(ConfigError) as info:
        build(PolicySpec(name="nope"))
    for known in ("buffer", "hpa", "static", "threshold"):
        assert known in str(info.value)


def test_unknown_parameter_lists_the_known_ones() -> None:
    with pytest.raises(ConfigError) as info:
        build(PolicySpec(name="hpa", params={"bogus": 1.0}))
    for known in ("target_per_worker", "tolerance", "scale_down_stabilization_s"):
        assert known in str(info.value)


@pytest.mark.parametrize(
    ("name", "cls"),
    [("buffer", BufferPolicy), ("hpa", HpaPolicy), ("static", StaticPolicy),
     ("threshold", ThresholdPolicy)],
)  # fmt: skip
def test_build_defaults(name: str, cls: type) -> None:
    assert POLICIES[name] is cls
    assert build(PolicySpec(name=name)) == cls()


def test_default_spec_is_the_buffer_policy() -> None:
    assert build(PolicySpec()) == BufferPolicy()


@pytest.mark.parametrize(
    ("name", "key", "value"),
    [
        ("hpa", "target_per_worker", 4),
        ("hpa", "scale_down_stabilization_s", 0),
        ("threshold", "capacity_per_worker", 16),
        ("buffer", "refill_s", 60),
    ],
)
def test_int_is_accepted_for_a_float_parameter(name: str, key: str, value: int) -> None:
    policy = build(PolicySpec(name=name, params={key: value}))
    assert getattr(policy, key) == value
    assert type(getattr(policy, key)) is float


def test_build_passes_every_parameter() -> None:
    params = {
        "capacity_per_worker": 2.0,
        "scale_up_threshold": 0.9,
        "scale_down_threshold": 0.2,
        "scale_up_cooldown_s": 1.0,
        "scale_down_cooldown_s": 2.0,
        "stability_s": 3.0,
        "step": 4,
    }
    assert build(PolicySpec(name="threshold", params=params)) == ThresholdPolicy(**params)


def test_validation_looks_at_the_parameter_type_not_only_its_value() -> None:
    build(PolicySpec(name="threshold", params={"step": 2}))
    with pytest.raises(ConfigError, match=r"policy\.step"):
        build(PolicySpec(name="threshold", params={"step": 2.0}))


# --- static -------------------------------------------------------------------------------------


@pytest.mark.parametrize("count", [0, 1, 7])
@pytest.mark.parametrize(
    "context",
    [
        load_ctx(0.0, 0, 0),
        load_ctx(5.0, 3, 1000),  # heavy load: still count
        load_ctx(9.0, 50, 0, min_workers=10, max_workers=60),  # idle: still count
        queue_ctx(1.0, 0, 0, current=2),
    ],
)
def test_static_always_count(count: int, context: PolicyContext) -> None:
    policy = StaticPolicy(count=count)
    decision = policy.decide(context, None)
    assert decision.target == count
    assert str(count) in decision.reason
    assert policy.initial_target(0, 100) == count
    assert StaticPolicy.reacts_to is None


# --- threshold (verl's elastic scheduler) -------------------------------------------------------

#: No cooldowns: three equal samples show the band. capacity 8, up > 0.8, down < 0.5, step 1.
INSTANT = ThresholdPolicy(scale_up_cooldown_s=0.0, scale_down_cooldown_s=0.0)


def third_decision(policy: ThresholdPolicy, context: PolicyContext) -> Any:
    """The decision on the third of three equal samples 1 s apart (the first that can be stable)."""
    memory = None
    for t in (context.t - 2, context.t - 1):
        memory = policy.decide(attrs.evolve(context, t=t), memory).memory
    return policy.decide(context, memory)


@pytest.mark.parametrize(
    ("step", "current", "in_flight", "expected"),
    [
        (1, 1, 12, 2),  # 12 / (8 x 1) = 1.5 > 0.8 -> 1 + 1 = 2
        (1, 4, 26, 5),  # 26 / (8 x 4) = 0.8125 > 0.8 -> 5
        (1, 5, 33, 6),  # 33 / (8 x 5) = 0.825 > 0.8 -> 6
        (1, 5, 32, 5),  # 32 / (8 x 5) = 0.8, not > 0.8 -> hold 5
        (1, 5, 24, 5),  # 24 / 40 = 0.6 inside [0.5, 0.8] -> hold 5
        (1, 5, 20, 5),  # 20 / 40 = 0.5, not < 0.5 -> hold 5
        (1, 5, 19, 4),  # 19 / 40 = 0.475 < 0.5 -> 4
        (1, 3, 0, 2),  # 0 / 24 = 0 < 0.5 -> 2
        (1, 1, 0, 0),  # 0 / 8 = 0 < 0.5 -> 0
        (1, 0, 0, 0),  # 0 / (8 x max(0, 1)) = 0 < 0.5 but current 0 -> hold 0
        (1, 0, 6, 0),  # 6 / (8 x 1) = 0.75 inside -> hold 0
        (1, 0, 7, 1),  # 7 / (8 x 1) = 0.875 > 0.8 -> 0 + 1 = 1
        (1, 10, 1000, 11),  # 1000 / 80 = 12.5 > 0.8 -> +1 only: one step per decision
        (3, 2, 100, 5),  # 100 / 16 = 6.25 > 0.8 -> 2 + 3 = 5
        (3, 10, 0, 7),  # 0 < 0.5 -> 10 - 3 = 7
        (3, 2, 0, 0),  # 0 < 0.5 -> max(2 - 3, 0) = 0
    ],
)
def test_threshold_single_decision(step: int, current: int, in_flight: int, expected: int) -> None:
    policy = attrs.evolve(INSTANT, step=step)
    decision = third_decision(policy, load_ctx(100.0, current, in_flight))
    assert decision.target == expected
    assert f"load {in_flight} / (8 x {max(current, 1)})" in decision.reason


def test_threshold_capacity_counts_active_workers_only() -> None:
    # 4 counted, 2 active, 17 in flight: 17 / (8 x 2) = 1.06 > 0.8 -> 4 + 1 (not 17 / 32 = 0.53)
    decision = third_decision(INSTANT, load_ctx(100.0, 4, 17, active=2))
    assert decision.target == 5
    assert "load 17 / (8 x 2)" in decision.reason


def test_threshold_counting_starting_workers_divides_by_the_capacity_on_its_way() -> None:
    # 4 counted, 2 active, 17 in flight: 17 / (8 x 4) = 0.53, within the band: no third worker
    # while two start (verl's rule, above, would add one).
    policy = attrs.evolve(INSTANT, count_starting=True)
    decision = third_decision(policy, load_ctx(100.0, 4, 17, active=2))
    assert decision.target == 4
    assert "load 17 / (8 x (2 active + 2 starting)) = 0.53" in decision.reason
    # 4 counted, 2 active, 12 in flight: 12 / 32 = 0.38 < 0.5, but two do not serve yet: held.
    low = third_decision(policy, load_ctx(100.0, 4, 12, active=2))
    assert low.target == 4 and "waiting (2 starting)" in low.reason
    # Once they serve, the same load scales down.
    assert third_decision(policy, load_ctx(100.0, 4, 12, active=4)).target == 3


#: Sequences under verl's defaults: stable = >= 3 samples seen, >= 2 in the last 10 s, variance
#: of their ratios < 0.1; cooldowns strict (more than 30 s up, 60 s down since the last one).
#: Each step: (t, current, in_flight, expected target).
THRESHOLD_SEQUENCES: dict[str, list[tuple[float, int, int, int]]] = {
    "up-needs-three-samples": [
        (100.0, 1, 12, 1),  # 12 / 8 = 1.5 > 0.8; 1 sample seen: not stable -> 1
        (105.0, 1, 12, 1),  # 2 seen -> 1
        (110.0, 1, 12, 2),  # 3 seen; 1.5, 1.5, 1.5 in the last 10 s: variance 0 -> 2
    ],
    "up-cooldown-is-strict": [
        (100.0, 1, 12, 1),
        (105.0, 1, 12, 1),
        (110.0, 1, 12, 2),  # last up 110
        (120.0, 2, 24, 2),  # 24 / 16 = 1.5, stable; 10 s since the last up, not > 30
        (130.0, 2, 24, 2),
        (140.0, 2, 24, 2),  # 30 s: not > 30 -> hold
        (140.5, 2, 24, 3),  # 30.5 s > 30 -> 3
    ],
    "unstable-load-waits": [
        (100.0, 2, 4, 2),  # 4 / 16 = 0.25
        (105.0, 2, 40, 2),  # 2.5
        (110.0, 2, 40, 2),  # 0.25, 2.5, 2.5: mean 1.75, variance (2.25 + 2 x 0.5625) / 3 = 1.125
        (116.0, 2, 40, 3),  # t=100 and t=105 older than 10 s: 2.5, 2.5, variance 0 -> 3
    ],
    "down-then-strict-cooldown": [
        (100.0, 4, 8, 4),  # 8 / 32 = 0.25 < 0.5
        (105.0, 4, 8, 4),
        (110.0, 4, 8, 3),  # stable, never scaled down -> 3 (last down 110)
        (120.0, 3, 6, 3),  # 6 / 24 = 0.25, stable; 10 s since the last down, not > 60
        (165.0, 3, 6, 3),  # alone in its 10 s window (t=120 is 45 s old): not stable
        (170.0, 3, 6, 3),  # stable again; 60 s: not > 60 -> hold
        (171.0, 3, 6, 2),  # 61 s > 60 -> 2
    ],
    "up-cooldown-does-not-block-down": [
        (100.0, 1, 12, 1),
        (105.0, 1, 12, 1),
        (110.0, 1, 12, 2),  # up, last up 110
        (111.0, 2, 0, 2),  # 1.5, 1.5, 0: variance 0.5 -> not stable
        (116.0, 2, 0, 2),  # 1.5 (t=110), 0, 0: variance 0.5 -> not stable
        (121.0, 2, 0, 1),  # 0, 0, 0 -> stable, never scaled down -> 1 (the reducer's window
        #                    guards flaps, not the policy)
    ],
    "down-cooldown-does-not-block-up": [
        (100.0, 4, 0, 4),
        (105.0, 4, 0, 4),
        (110.0, 4, 0, 3),  # down, last down 110
        (111.0, 3, 30, 3),  # 30 / 24 = 1.25; 0, 0, 1.25: variance 0.35 -> not stable
        (116.0, 3, 30, 3),  # 0, 1.25, 1.25: variance 0.35 -> not stable
        (121.0, 3, 30, 4),  # 1.25 x 3 -> stable, never scaled up -> 4
    ],
}


@pytest.mark.parametrize("name", list(THRESHOLD_SEQUENCES))
def test_threshold_sequences(name: str) -> None:
    policy = ThresholdPolicy()
    memory: ThresholdMemory | None = None
    for t, current, in_flight, expected in THRESHOLD_SEQUENCES[name]:
        decision = policy.decide(load_ctx(t, current, in_flight), memory)
        assert decision.target == expected, f"t={t}: {decision.reason}"
        assert isinstance(decision.memory, ThresholdMemory)
        memory = decision.memory


def test_threshold_memory_keeps_the_window_and_the_last_scale() -> None:
    policy = ThresholdPolicy()
    first = policy.decide(load_ctx(100.0, 1, 12), None)
    assert first.memory == ThresholdMemory(recent=((100.0, 1.5),), samples_seen=1)
    assert "not stable yet" in first.reason
    second = policy.decide(load_ctx(105.0, 1, 12), first.memory)
    third = policy.decide(load_ctx(110.0, 1, 12), second.memory)
    assert third.target == 2
    assert third.memory == ThresholdMemory(
        recent=((100.0, 1.5), (105.0, 1.5), (110.0, 1.5)), samples_seen=3, last_up_t=110.0
    )
    assert "stable -> 2" in third.reason
    band = policy.decide(load_ctx(121.0, 2, 8), third.memory)  # 8 / 16 = 0.5 in band
    assert band.memory == ThresholdMemory(recent=((121.0, 0.5),), samples_seen=4, last_up_t=110.0)
    assert "within [0.5, 0.8]" in band.reason


@settings(max_examples=200, deadline=None)
@given(
    step=st.integers(min_value=1, max_value=5),
    stability=st.sampled_from([0.0, 5.0, 10.0]),
    cooldown=st.sampled_from([0.0, 15.0, 30.0]),
    samples=st.lists(
        st.tuples(
            st.floats(min_value=0.1, max_value=30.0),  # seconds since the previous sample
            st.integers(min_value=0, max_value=50),  # current
            st.integers(min_value=0, max_value=1000),  # in flight
        ),
        min_size=1,
        max_size=40,
    ),
)
def test_threshold_moves_at_most_one_step_per_decision(
    step: int, stability: float, cooldown: float, samples: list[tuple[float, int, int]]
) -> None:
    policy = ThresholdPolicy(
        step=step,
        stability_s=stability,
        scale_up_cooldown_s=cooldown,
        scale_down_cooldown_s=cooldown,
    )
    memory, t = None, 1.0
    for dt, current, in_flight in samples:
        t += dt
        decision = policy.decide(load_ctx(t, current, in_flight), memory)
        memory = decision.memory
        ratio = in_flight / (policy.capacity_per_worker * max(current, 1))
        assert decision.target >= 0
        assert abs(decision.target - current) <= step
        if decision.target > current:
            assert ratio > policy.scale_up_threshold
            assert decision.target == current + step
        if decision.target < current:
            assert ratio < policy.scale_down_threshold


# --- hpa (Kubernetes HPA) -----------------------------------------------------------------------

#: The ratio rule alone: Kubernetes' default scale-up rate limit out of the way.
NO_LIMIT = 10**9


@pytest.mark.parametrize(
    ("samples", "expected"),
    [
        # 1 worker, 80 in flight, target 4: recommendation 20; at most max(1 + 4, 2 x 1) = 5
        ([(0.0, 1, 80)], [5]),
        # 5 workers 5 s later: 5 - 4 added this period = 1 at its start -> still at most 5
        ([(0.0, 1, 80), (5.0, 5, 80)], [5, 5]),
        # 15 s after the first scale-up it left the period: max(5 + 4, 2 x 5) = 10
        ([(0.0, 1, 80), (15.0, 5, 80)], [5, 10]),
        # 0 workers: max(0 + 4, 0 x 2) = 4
        ([(0.0, 0, 80)], [4]),
        # 10 workers, 120 in flight: recommendation 30; max(14, 20) = 20
        ([(0.0, 10, 120)], [20]),
    ],
)
def test_hpa_default_scale_up_limit(
    samples: list[tuple[float, int, int]], expected: list[int]
) -> None:
    policy = HpaPolicy(target_per_worker=4.0)
    memory = None
    targets = []
    for t, current, in_flight in samples:
        decision = policy.decide(load_ctx(t, current, in_flight), memory)
        memory = decision.memory
        targets.append(decision.target)
    assert targets == expected


@pytest.mark.parametrize(
    ("tolerance", "current", "in_flight", "expected"),
    [
        (0.1, 4, 16, 4),  # 16 / (4 x 4) = 1.0 -> 4
        (0.1, 4, 17, 4),  # 17 / 16 = 1.0625, |0.0625| <= 0.1 -> 4
        (0.1, 4, 18, 5),  # 18 / 16 = 1.125 > 1.1 -> ceil(4 x 1.125) = ceil(4.5) = 5
        (0.1, 4, 32, 8),  # 32 / 16 = 2.0 -> ceil(8.0) = 8
        (0.1, 4, 100, 25),  # 100 / 16 = 6.25 -> ceil(25.0) = 25 (no bound in the policy)
        (0.1, 4, 15, 4),  # 15 / 16 = 0.9375, |-0.0625| <= 0.1 -> 4
        (0.1, 4, 14, 4),  # 14 / 16 = 0.875 < 0.9 -> ceil(3.5) = 4
        (0.1, 4, 4, 1),  # 4 / 16 = 0.25 -> ceil(1.0) = 1 (nothing older in the window)
        (0.1, 4, 0, 0),  # 0 / 16 = 0 -> 0
        (0.1, 10, 36, 10),  # 36 / 40 = 0.9, |-0.1| <= 0.1 -> 10 (lower tolerance edge)
        (0.1, 10, 45, 12),  # 45 / 40 = 1.125 -> ceil(11.25) = 12
        (0.1, 3, 13, 3),  # 13 / 12 = 1.083 -> 3
        (0.1, 3, 14, 4),  # 14 / 12 = 1.167 -> ceil(3.5) = 4
        (0.0, 4, 17, 5),  # tolerance 0: 17 / 16 = 1.0625 -> ceil(4.25) = 5
        (0.0, 4, 16, 4),  # tolerance 0: exactly on target -> 4
        (0.5, 4, 23, 4),  # 23 / 16 = 1.4375, |0.4375| <= 0.5 -> 4
        (0.1, 0, 0, 0),  # current 0, nothing in flight -> ceil(0 / 4) = 0
        (0.1, 0, 1, 1),  # current 0 -> ceil(1 / 4) = 1
        (0.1, 0, 9, 3),  # current 0 -> ceil(9 / 4) = 3 (tolerance does not apply)
        (0.1, 0, 16, 4),  # current 0 -> ceil(16 / 4) = 4
    ],
)
def test_hpa_single_decision(tolerance: float, current: int, in_flight: int, expected: int) -> None:
    policy = HpaPolicy(scale_up_pods=NO_LIMIT, target_per_worker=4.0, tolerance=tolerance)
    decision = policy.decide(load_ctx(100.0, current, in_flight), None)
    assert decision.target == expected
    assert decision.reason.endswith(f"-> {expected}")
    assert f"{in_flight} in flight / {current} workers" in decision.reason
    assert decision.memory.recommendations == ((100.0, expected),)


#: (t, current, in_flight, expected, window afterwards) with target 4/worker and a 300 s window.
HPA_STABILIZATION = [
    (0.0, 4, 32, 8, ((0.0, 8),)),  # 32 / 16 = 2.0 -> 8: scale-up is immediate
    (60.0, 8, 8, 8, ((0.0, 8), (60.0, 2))),  # 8 / 32 = 0.25 -> 2, held by 8 from t=0
    (200.0, 8, 16, 8, ((0.0, 8), (60.0, 2), (200.0, 4))),  # 16 / 32 = 0.5 -> 4, held by 8
    (299.0, 8, 8, 8, ((0.0, 8), (60.0, 2), (200.0, 4), (299.0, 2))),  # t=0 still 299 s old
    (300.0, 8, 8, 4, ((60.0, 2), (200.0, 4), (299.0, 2), (300.0, 2))),  # t=0 leaves: max 4
    (361.0, 4, 4, 4, ((200.0, 4), (299.0, 2), (300.0, 2), (361.0, 1))),  # 4/16 -> 1; 4 holds
    (501.0, 4, 4, 2, ((299.0, 2), (300.0, 2), (361.0, 1), (501.0, 1))),  # t=200 leaves: max 2
    (661.0, 2, 2, 1, ((501.0, 1), (661.0, 1))),  # 2 / 8 = 0.25 -> 1; t=361 is 300 s old
]


def test_hpa_scale_down_takes_the_highest_recommendation_in_the_window() -> None:
    policy = HpaPolicy(
        scale_up_pods=NO_LIMIT,
        target_per_worker=4.0,
        tolerance=0.1,
        scale_down_stabilization_s=300.0,
    )
    memory: HpaMemory | None = None
    for t, current, in_flight, expected, window in HPA_STABILIZATION:
        decision = policy.decide(load_ctx(t, current, in_flight), memory)
        assert decision.target == expected, f"t={t}: {decision.reason}"
        assert decision.memory.recommendations == window, f"t={t}"
        memory = decision.memory
    held = policy.decide(load_ctx(60.0, 8, 8), HpaMemory(recommendations=[(0.0, 8)]))
    assert "recommendation 2, highest in last 300s 8 -> 8" in held.reason


def test_hpa_scale_up_ignores_lower_recommendations() -> None:
    policy = HpaPolicy(scale_up_pods=NO_LIMIT, target_per_worker=4.0)
    memory = HpaMemory(recommendations=[(0.0, 1), (10.0, 2)])
    decision = policy.decide(load_ctx(20.0, 2, 64), memory)  # 64 / 8 = 8.0 -> 16
    assert decision.target == 16


def test_hpa_without_stabilization_scales_down_at_once() -> None:
    policy = HpaPolicy(
        scale_up_pods=NO_LIMIT, target_per_worker=4.0, scale_down_stabilization_s=0.0
    )
    first = policy.decide(load_ctx(0.0, 4, 32), None)  # -> 8
    second = policy.decide(load_ctx(1.0, 8, 8), first.memory)  # 8 / 32 = 0.25 -> 2
    assert (first.target, second.target) == (8, 2)
    assert second.memory.recommendations == ((1.0, 2),)


def test_hpa_stabilization_never_scales_up() -> None:
    policy = HpaPolicy(
        scale_up_pods=NO_LIMIT, target_per_worker=4.0, scale_down_stabilization_s=300.0
    )
    # The pool is held at 2 (pinned or paused) while the load asks for 10; the policy is still
    # asked and remembers 10.
    first = policy.decide(load_ctx(0.0, 2, 40), None)  # 40 / 8 = 5.0 -> 10
    assert first.target == 10
    # Load falls: 4 / 8 = 0.5 -> ceil(1.0) = 1 < 2. Stabilization may hold 2, not ask for 10.
    second = policy.decide(load_ctx(10.0, 2, 4), first.memory)
    assert second.target <= 2


@pytest.mark.parametrize(
    ("current", "in_flight", "expected"),
    [
        (11, 100, 25),  # 100 / (11 x 4) = 2.2727; 11 x 2.2727 = 25 exactly -> 25
        (7, 116, 29),  # 116 / (7 x 4) = 4.1429; 7 x 4.1429 = 29 exactly -> 29
        (19, 84, 21),  # 84 / (19 x 4) = 1.1053; 19 x 1.1053 = 21 exactly -> 21
    ],
)
def test_hpa_exact_multiple_is_not_rounded_up(current: int, in_flight: int, expected: int) -> None:
    policy = HpaPolicy(scale_up_pods=NO_LIMIT, target_per_worker=4.0, tolerance=0.1)
    decision = policy.decide(load_ctx(0.0, current, in_flight), None)
    assert decision.target == expected


@settings(max_examples=200, deadline=None)
@given(
    target_per_worker=st.floats(min_value=0.1, max_value=100.0),
    tolerance=st.floats(min_value=0.0, max_value=0.9),
    window=st.floats(min_value=0.0, max_value=600.0),
    samples=st.lists(
        st.tuples(
            st.floats(min_value=0.0, max_value=200.0),  # seconds since the previous sample
            st.integers(min_value=0, max_value=200),  # current
            st.integers(min_value=0, max_value=10_000),  # in flight
        ),
        min_size=1,
        max_size=30,
    ),
)
def test_hpa_properties(
    target_per_worker: float,
    tolerance: float,
    window: float,
    samples: list[tuple[float, int, int]],
) -> None:
    policy = HpaPolicy(
        scale_up_pods=NO_LIMIT,
        target_per_worker=target_per_worker,
        tolerance=tolerance,
        scale_down_stabilization_s=window,
    )
    memory, t = None, 0.0
    for dt, current, in_flight in samples:
        t += dt
        decision = policy.decide(load_ctx(t, current, in_flight), memory)
        memory = decision.memory
        # never negative, an integer, and never below the latest recommendation
        latest_t, latest = memory.recommendations[-1]
        assert latest_t == t
        assert isinstance(decision.target, int)
        assert decision.target >= 0
        assert decision.target >= latest >= 0
        # the window keeps only recommendations younger than the stabilization period
        assert all(t - ts < window or ts == t for ts, _ in memory.recommendations)
        # within tolerance the count holds
        if current and abs(in_flight / (current * target_per_worker) - 1) <= tolerance:
            assert latest == current


# --- buffer -------------------------------------------------------------------------------------

# Batch 64 sequences; defaults: target 1.25 batches = 80 seq, band +-0.5 -> [48, 112] seq,
# refill_s 120 (lead_s 60, hold_s 210), rate window 60 s (queue smoothed over 30 s), production
# window 300 s, off-policy limit 0.8 x 3 x 64 = 153.6 seq.


def settled(**changes: Any) -> BufferMemory:
    """A memory whose windows are full: D = 32 seq/s, p = 4 seq/s/worker (n = 8), Q = 80."""
    fields: dict[str, Any] = {
        "last_t": 100.0,
        "last_queued_seqs": 80,
        "last_step": 50,
        "last_active": 0,  # nothing measured from the probe sample (see probe())
        "queue_seqs": 80.0,
        "demand_seqs_s": 32.0,
        "fast_demand_seqs_s": 32.0,
        "last_advance_t": 99.0,
        "peak_demand_seqs_s": 32.0,
        "peak_t": 99.0,
        "per_worker_seqs_s": 4.0,
        "queue_seen_s": 30.0,
        "demand_seen_s": 60.0,
        "production_seen_s": 300.0,
    }
    fields.update(changes)
    if "queue_seqs" in changes and "last_queued_seqs" not in changes:
        fields["last_queued_seqs"] = round(changes["queue_seqs"])
    return BufferMemory(**fields)


def probe(
    memory: BufferMemory, current: int, *, policy: BufferPolicy | None = None, **ctx: Any
) -> Decision:
    """Decide at t = 102 on a sample that changes no estimate: the queue as smoothed, no step,
    no worker active at the previous sample (so production is not measured)."""
    return (policy or BufferPolicy()).decide(
        queue_ctx(102.0, round(memory.queue_seqs), memory.last_step, current=current, **ctx),
        memory,
    )


@pytest.mark.parametrize(
    ("current", "max_workers", "expected"),
    [
        (0, 10, 10),  # nothing measured, queue short: every worker the pool may have
        (3, 10, 10),
        (12, 10, 12),  # never below the current count (the reducer clamps to the bounds)
    ],
)
def test_buffer_cold_start_starts_every_worker(
    current: int, max_workers: int, expected: int
) -> None:
    # 32 queued < 80 target
    ctx = queue_ctx(100.0, 32, 10, current=current, active=0, max_workers=max_workers)
    decision = BufferPolicy().decide(ctx, None)
    assert decision.target == expected
    assert "not measured yet" in decision.reason
    assert decision.memory == BufferMemory(
        last_t=100.0, last_queued_seqs=32, last_step=10, last_active=0, queue_seqs=32.0
    )


@pytest.mark.parametrize("queued", [80, 100, 500])  # >= 80 target sequences
def test_buffer_cold_start_with_a_full_queue_holds(queued: int) -> None:
    decision = BufferPolicy().decide(queue_ctx(100.0, queued, 3, current=5, active=2), None)
    assert decision.target == 5
    assert "hold 5" in decision.reason


def test_buffer_hand_computed_first_estimates() -> None:
    policy = BufferPolicy()
    first = policy.decide(queue_ctx(100.0, 32, 10, current=4), None)
    # t=102: 48 queued, one step (the first advance: no demand yet), 4 workers active throughout.
    second = policy.decide(queue_ctx(102.0, 48, 11, current=4), first.memory)
    memory = second.memory
    assert memory.queue_seqs == 48.0  # the first smoothed value is the sample itself
    assert memory.last_advance_t == 102.0
    assert memory.demand_seqs_s is None
    assert memory.per_worker_seqs_s == pytest.approx(10.0)  # (48 - 32 + 64) / 2 s / 4 = 10
    assert second.target == 100  # still cold: every worker (max_workers 100 in queue_ctx)

    # t=106: 40 queued, two steps since the advance at 102.
    third = policy.decide(queue_ctx(106.0, 40, 13, current=4), memory)
    memory = third.memory
    # Running means while the windows fill: weights dt / (seen + dt).
    assert memory.queue_seqs == pytest.approx(48 + 4 / 6 * (40 - 48))  # 42.67
    assert memory.demand_seqs_s == pytest.approx(2 * 64 / 4)  # 32 seq/s over the 4 s span
    produced = (40 - 48 + 128) / 4 / 4  # 7.5 seq/s/worker
    assert memory.per_worker_seqs_s == pytest.approx(10 + 4 / 6 * (produced - 10))  # 8.33
    # e = 80 - 42.67 = 37.33; I = 37.33 x 4 s = 149.3; n = ceil((32 + (37.33 + 149.3 / 1800)
    # / 120) / 8.33) = ceil(3.88) = 4. The queue is below the band (48) but 4 x 8.33 - 32 =
    # +1.33 seq/s refills it (42.67 + 80 in 60 s): hold.
    assert memory.integral_seqs_s == pytest.approx((80 - 128 / 3) * 4)
    assert third.target == 4
    assert third.reason.endswith("-> hold 4")
    assert "demand 32.00 seq/s, 8.33 seq/s per worker" in third.reason
    assert "queue 0.67 batches vs target 1.25" in third.reason


def test_buffer_demand_comes_from_step_advances_without_sampling_ripple() -> None:
    # A trainer stepping every 5 s, sampled every 2 s: advances are seen after 4 or 6 s, yet
    # the estimate (a running mean over the spans while the window fills) is exactly 64 / 5.
    policy = BufferPolicy()
    memory = None
    for k in range(0, 26):
        t = 2.0 * k
        step = int(t // 5)
        memory = policy.decide(queue_ctx(t, 200, step, current=4), memory).memory
    assert memory is not None
    # First advance seen at t=6 (step 1), last at t=50 (step 10): 9 steps over 44 s.
    assert memory.demand_seqs_s == pytest.approx(9 * 64 / 44)
    # A sample without an advance leaves it alone.
    same = policy.decide(queue_ctx(51.0, 200, 10, current=4), memory).memory
    assert same.demand_seqs_s == memory.demand_seqs_s


def test_buffer_a_trainer_that_speeds_up_is_believed_quickly() -> None:
    policy = BufferPolicy()
    memory = settled(demand_seqs_s=12.8, fast_demand_seqs_s=12.8, last_advance_t=100.0)
    t, step = 100.0, 50
    history = []
    for _ in range(3):  # now a step every 2 s: 32 seq/s
        t, step = t + 2.0, step + 1
        memory = policy.decide(queue_ctx(t, 80, step, current=8), memory).memory
        history.append(memory.demand_seqs_s)
    # The 60 s window alone would move 12.8 -> 14.5 in three samples (alpha 1 - e^(-2/60));
    # the 10 s window passes 1.25 x it by the second and replaces it.
    slow = 12.8
    for _ in range(3):
        slow += (1 - math.exp(-2 / 60)) * (32 - slow)
    assert history[-1] > 1.25 * slow


def test_buffer_recent_peak_of_demand() -> None:
    # Steps every 2 s keep the demand at 64 / 2 = 32 seq/s.
    def next_memory(memory: BufferMemory) -> BufferMemory:
        t = memory.last_t + 2.0
        ctx = queue_ctx(t, 80, memory.last_step + 1, current=8)
        after: BufferMemory = BufferPolicy().decide(ctx, memory).memory
        return after

    now = {"last_t": 102.0, "last_advance_t": 102.0}
    # 32 < 0.9 x 40: the peak stays, and so does its time
    step = next_memory(settled(peak_demand_seqs_s=40.0, peak_t=50.0, **now))
    assert step.demand_seqs_s == pytest.approx(32.0)
    assert (step.peak_demand_seqs_s, step.peak_t) == (40.0, 50.0)
    # 32 >= 0.9 x 34: approached again, the peak's time is refreshed
    step = next_memory(settled(peak_demand_seqs_s=34.0, peak_t=50.0, **now))
    assert (step.peak_demand_seqs_s, step.peak_t) == (34.0, 104.0)
    # not approached for more than 5 x 60 = 300 s: today's demand is the peak
    late = {"last_t": 358.0, "last_advance_t": 358.0}
    step = next_memory(settled(peak_demand_seqs_s=40.0, peak_t=50.0, **late))
    assert step.peak_t == 360.0
    assert step.peak_demand_seqs_s == pytest.approx(32.0)


def test_buffer_does_not_measure_production_near_the_offpolicy_limit() -> None:
    # batch 10; limit 0.8 x 5 x 10 = 40 seq: not measured when either end reaches it
    policy = BufferPolicy(max_batches_offpolicy=5.0)
    steps = [
        (100.0, 45, 0, None),  # first sample: nothing measured
        (110.0, 40, 1, None),  # max(40, 45) = 45 >= 40: not measured
        (120.0, 42, 2, None),  # max(42, 40) = 42 >= 40
        (130.0, 39, 3, None),  # max(39, 42) = 42 >= 40: the interval started near the limit
        (140.0, 39, 4, 1.0),  # max(39, 39) < 40: (39 - 39 + 10) / 10 / 1 = 1.0 seq/s/worker
    ]
    memory = None
    for t, queued, step, per_worker in steps:
        decision = policy.decide(queue_ctx(t, queued, step, current=1, batch=10), memory)
        memory = decision.memory
        assert memory.per_worker_seqs_s == per_worker, f"t={t}"
    assert memory is not None
    assert memory.demand_seqs_s == pytest.approx(1.0)  # one 10-seq step per 10 s


def test_buffer_does_not_measure_production_without_workers_active_throughout() -> None:
    policy = BufferPolicy()
    first = policy.decide(queue_ctx(100.0, 0, 0, current=2, active=0), None)
    second = policy.decide(queue_ctx(110.0, 10, 0, current=2, active=2), first.memory)
    assert second.memory.per_worker_seqs_s is None  # none was active at t=100
    third = policy.decide(queue_ctx(120.0, 30, 0, current=2, active=2), second.memory)
    assert third.memory.per_worker_seqs_s == pytest.approx(1.0)  # (30 - 10) / 10 s / 2


@pytest.mark.parametrize(
    ("queue", "current", "expected", "why"),
    [
        # n* = 32 / 4 = 8 workers
        (80.0, 8, 8, "hold 8"),  # at the target
        (60.0, 8, 8, "hold 8"),  # below the target, refilling at 8 x 4 - 32 = 0 seq/s: holds
        (110.0, 12, 12, "hold 12"),  # above the target, inside the band (<= 112)
        # below the band, 8 workers only hold it there: n = ceil((32 + (40 + 80 / 1800) / 120)
        # / 4) = ceil(8.08) = 9
        (40.0, 8, 9, "-> 9 workers"),
        # inside the band but emptying: 60 + (7 x 4 - 32) x 60 = -180 < 0 -> max(ceil(8.04), 8)
        (60.0, 7, 9, "-> 9 workers"),
        # above the band: n = ceil((32 + (-70 - 140 / 1800) / 120) / 4) = ceil(7.85) = 8; safe =
        # ceil((32 - (150 - 48) / 210) / 4) = ceil(7.88) = 8; step max(1, floor(10 x .25)) = 2
        (150.0, 10, 8, "stepping down to 8"),
        (150.0, 20, 15, "stepping down to 15"),  # step floor(20 x .25) = 5 -> max(8, 8, 15)
        (150.0, 8, 8, "hold 8"),  # already at n
    ],
)
def test_buffer_band_decisions(queue: float, current: int, expected: int, why: str) -> None:
    decision = probe(settled(queue_seqs=queue), current)
    assert decision.target == expected, decision.reason
    assert why in decision.reason


def test_buffer_removal_keeps_the_queue_in_the_band_for_hold_s() -> None:
    # 150 queued, demand 32, p 4: with 7 workers the queue loses 4 seq/s and would leave the
    # band (48) after 102 / 4 = 25.5 s < 210 s: safe = ceil((32 - 102 / 210) / 4) = 8
    policy = BufferPolicy(max_down_fraction=1.0)
    decision = probe(settled(queue_seqs=150.0), 10, policy=policy)
    assert decision.target == 8  # n says 8 too
    deep = probe(settled(queue_seqs=150.0, integral_seqs_s=-1_000_000.0), 10, policy=policy)
    # a large negative integral asks for ceil((32 + (-70 - 555.6) / 120) / 4) = 7: safe wins
    assert deep.target == 8


def test_buffer_after_a_removal_only_a_queue_below_the_band_adds_workers() -> None:
    # 60 queued with 7 workers: 60 + (7 x 4 - 32) x 60 = -180 < 0 would add (see the table),
    # but a removal 52 s ago (< hold_s 210) was judged safe: the projection alone is not enough.
    recent = settled(queue_seqs=60.0, last_down_t=50.0)
    assert probe(recent, 7).target == 7
    # Below the band (40 < 48) it is: n = ceil((32 + (40 + 80 / 1800) / 120) / 4) = 9.
    assert probe(settled(queue_seqs=40.0, last_down_t=50.0), 7).target == 9
    # And a removal 210 s ago no longer counts.
    assert probe(settled(queue_seqs=60.0, last_down_t=-108.0), 7).target == 9


def test_buffer_removal_cooldown() -> None:
    memory = settled(queue_seqs=150.0, last_down_t=75.0)  # 27 s ago < 30
    assert probe(memory, 10).target == 10
    memory = settled(queue_seqs=150.0, last_down_t=72.0)  # 30 s ago
    decision = probe(memory, 10)
    assert decision.target == 8
    assert decision.memory.last_down_t == 102.0


def test_buffer_holds_while_the_trainer_pauses_and_after_it() -> None:
    # A batch waits, but no step for 102 - 80 = 22 s > 3 x 64 / 32 = 6 s: a pause or slowdown
    paused = probe(settled(queue_seqs=150.0, last_advance_t=80.0), 10)
    assert paused.target == 10
    assert "no trainer step for 22s" in paused.reason
    # When steps resume, a demand fallen below 80% of its recent peak (the pause folded into
    # it) is not trusted for removals: safe = ceil((32 - 102 / 210) / 4) = 8 at the peak 32,
    # but with demand now 16: n = ceil((16 - 0.58) / 4) = 4 while safe stays 8.
    after = settled(queue_seqs=150.0, demand_seqs_s=16.0, fast_demand_seqs_s=16.0)
    decision = probe(after, 10, policy=BufferPolicy(max_down_fraction=1.0))
    assert decision.target == 8
    unprotected = settled(
        queue_seqs=150.0, demand_seqs_s=16.0, fast_demand_seqs_s=16.0, peak_demand_seqs_s=16.0
    )
    assert probe(unprotected, 10, policy=BufferPolicy(max_down_fraction=1.0)).target == 4


def test_buffer_at_the_offpolicy_limit_production_has_a_lower_bound() -> None:
    # 180 queued >= 153.6: p cannot be measured. A stale p of 2 says n = 16 (> 10 active), but
    # a full queue proves p >= 32 / 10 = 3.2: n = ceil((32 + (-100 - 200 / 1800) / 120) / 3.2)
    # = ceil(9.74) = 10, safe = ceil((32 - 132 / 210) / 3.2) = ceil(9.80) = 10: hold.
    stale = probe(settled(queue_seqs=180.0, per_worker_seqs_s=2.0), 10)
    assert stale.target == 10
    assert "3.20 seq/s per worker" in stale.reason
    # With p 4: n = ceil(7.79) = 8, safe = ceil(7.84) = 8, step 2 -> 8; at the limit removals
    # wait lead_s (60 s), not down_cooldown_s.
    decision = probe(settled(queue_seqs=180.0), 10)
    assert decision.target == 8
    assert "off-policy limit" in decision.reason
    assert probe(settled(queue_seqs=180.0, last_down_t=60.0), 10).target == 10  # 42 s ago
    assert probe(settled(queue_seqs=180.0, last_down_t=40.0), 10).target == 8  # 62 s ago
    # Even before p is measured at all, the bound lets a cold start shed workers: 400 queued,
    # p >= 32 / 20 = 1.6: n = ceil((32 + (-320 - 640 / 1800) / 120) / 1.6) = ceil(18.33) = 19,
    # safe = ceil((32 - 352 / 210) / 1.6) = ceil(18.95) = 19
    cold = probe(settled(queue_seqs=400.0, per_worker_seqs_s=None), 20)
    assert cold.target == 19


@pytest.mark.parametrize(
    ("changes", "current", "expected"),
    [
        # nearly empty (20 < 32): grow by max(1, ceil(10 x 0.25)) = 3 -> max(ceil(8.13), 13)
        ({"queue_seqs": 20.0}, 10, 13),
        # below the band (40 < 48) for 102 - 30 = 72 s >= 60 s, last addition 72 s ago
        ({"queue_seqs": 40.0, "low_since_t": 30.0, "last_up_t": 30.0}, 10, 13),
        # the last addition only 22 s ago: its workers are still starting; 10 x 4 - 32 = +8
        # seq/s refills the band within lead_s: hold
        ({"queue_seqs": 40.0, "low_since_t": 30.0, "last_up_t": 80.0}, 10, 10),
    ],
)
def test_buffer_grows_when_the_queue_does_not_refill(
    changes: dict[str, Any], current: int, expected: int
) -> None:
    decision = probe(settled(**changes), current)
    assert decision.target == expected, decision.reason
    if expected > current:
        assert "not refilling" in decision.reason
        assert decision.memory.last_up_t == 102.0


def _anti_windup_run(max_workers: int, samples: int) -> list[float]:
    """The queue stays empty while the trainer takes one 64-seq batch every 10 s from 1 worker
    producing exactly that: D = p = 6.4 seq/s, e = 80, so I grows 80 x 10 = 800 per sample
    unless frozen. raw = 1 + (80 + I / 1800) / (120 x 6.4) = 1.10 + I / 1382400 > 1."""
    policy = BufferPolicy()
    memory = settled(
        queue_seqs=0.0,
        last_queued_seqs=0,
        demand_seqs_s=6.4,
        fast_demand_seqs_s=6.4,
        peak_demand_seqs_s=6.4,
        per_worker_seqs_s=6.4,
        last_active=1,
        last_t=0.0,
        last_advance_t=0.0,
    )
    integrals = []
    for k in range(1, samples + 1):
        ctx = queue_ctx(10.0 * k, 0, 50 + k, current=1, max_workers=max_workers)
        memory = policy.decide(ctx, memory).memory
        assert memory.demand_seqs_s == pytest.approx(6.4)
        integrals.append(memory.integral_seqs_s)
    return integrals


def test_buffer_anti_windup_freezes_the_integral_while_saturated() -> None:
    # max 1: raw > 1 from the first sample: I never leaves 0
    assert _anti_windup_run(max_workers=1, samples=20) == [0.0] * 20
    # unbounded: I grows 800 per sample up to the clamp 2 x 80 x 1800 = 288000 (k = 360)
    free = _anti_windup_run(max_workers=1000, samples=370)
    assert free[:3] == pytest.approx([800.0, 1600.0, 2400.0])
    assert free[359] == pytest.approx(288_000.0)
    assert free[360:] == [288_000.0] * 10


@settings(max_examples=150, deadline=None)
@given(
    fraction=st.sampled_from([0.05, 0.1, 0.5, 1.0]),
    cooldown=st.sampled_from([0.0, 30.0]),
    batch=st.integers(min_value=1, max_value=128),
    samples=st.lists(
        st.tuples(
            st.floats(min_value=0.5, max_value=60.0),  # seconds since the previous sample
            st.integers(min_value=0, max_value=1000),  # queued sequences
            st.integers(min_value=0, max_value=3),  # trainer steps taken
            st.integers(min_value=0, max_value=40),  # current
            st.integers(min_value=0, max_value=40),  # active (capped at current)
        ),
        min_size=1,
        max_size=30,
    ),
)
def test_buffer_properties(
    fraction: float,
    cooldown: float,
    batch: int,
    samples: list[tuple[float, int, int, int, int]],
) -> None:
    policy = BufferPolicy(max_down_fraction=fraction, down_cooldown_s=cooldown)
    memory, t, step = None, 0.0, 0
    limit = 2 * policy.target_batches * batch * policy.integral_s
    for dt, queued, steps, current, active in samples:
        t, step = t + dt, step + steps
        ctx = queue_ctx(t, queued, step, current=current, active=min(active, current), batch=batch)
        decision = policy.decide(ctx, memory)
        after = decision.memory
        assert decision.target >= 0
        # removals never move more than max(1, floor(current x fraction)) at once, only from
        # above the band, and never sooner than the cooldown after the previous one
        assert decision.target >= current - max(1, math.floor(current * fraction))
        if decision.target < current:
            band_top = (policy.target_batches + policy.band_batches) * batch
            assert after.queue_seqs > band_top
            assert after.last_down_t == t
            if memory is not None and memory.last_down_t is not None:
                assert t - memory.last_down_t >= cooldown
        # additions only while the smoothed queue is short of the target
        if decision.target > current:
            assert after.queue_seqs < policy.target_batches * batch
        # without a demand estimate the policy never shrinks the pool
        if after.demand_seqs_s is None:
            assert decision.target >= current
        assert abs(after.integral_seqs_s) <= limit
        memory = after


def test_a_catalog_extended_with_an_outside_policy_builds_it_and_leaves_the_built_ins() -> None:
    @attrs.frozen(slots=True, kw_only=True)
    class OutsideMemory:
        seen: int = 0

    outside = BUILT_INS.extended({"outside-static": StaticPolicy}, records=[OutsideMemory])
    assert outside.build(PolicySpec(name="outside-static", params={"count": 3})) == StaticPolicy(
        count=3
    )
    assert outside.records == (OutsideMemory,)
    assert outside.extended({"outside-static": StaticPolicy}, [OutsideMemory]) == outside
    # The built-ins know nothing of it: nothing was registered anywhere.
    assert "outside-static" not in POLICIES and "outside-static" not in BUILT_INS.policies
    with pytest.raises(ConfigError, match="unknown policy 'outside-static'"):
        build(PolicySpec(name="outside-static"))
    with pytest.raises(ConfigError, match="'outside-static' is already StaticPolicy"):
        outside.extended({"outside-static": HpaPolicy})
    with pytest.raises(ConfigError, match="'buffer' is already BufferPolicy"):
        BUILT_INS.extended({"buffer": HpaPolicy})


def test_registries_are_read_only() -> None:
    catalog = PolicyCatalog(policies={"mine": StaticPolicy})
    with pytest.raises(TypeError):
        POLICIES["mine"] = StaticPolicy  # type: ignore[index]
    with pytest.raises(TypeError):
        catalog.policies["other"] = HpaPolicy  # type: ignore[index]
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        catalog.policies = {}  # type: ignore[misc]
