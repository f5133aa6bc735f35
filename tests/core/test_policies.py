"""core.policies: building from a PolicySpec, and decision tables for every policy.

Each table row carries its arithmetic as a comment, in the style of Ray Serve's autoscaling tests.
Policies never clamp to the pool's bounds (the reducer does), so targets here may exceed them.
"""

from __future__ import annotations

from typing import Any

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from core.config import PolicySpec
from core.errors import ConfigError
from core.events import LoadSampled
from core.policies import (
    BUILT_INS,
    POLICIES,
    BufferPolicy,
    HpaMemory,
    HpaPolicy,
    PolicyCatalog,
    PolicyContext,
    StaticPolicy,
    ThresholdMemory,
    ThresholdPolicy,
    build,
)
from tests.core.buffer_helpers import ctx as queue_ctx


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
        ("buffer", {"target_batches": -1}, "policy.target_batches"),
        ("buffer", {"refill_s": -1}, "policy.refill_s"),
        ("buffer", {"startup_prior_s": 0}, "policy.startup_prior_s"),
        ("buffer", {"max_up_factor": 1.0}, "policy.max_up_factor"),
        ("buffer", {"spread_k": -1}, "policy.spread_k"),
        ("buffer", {"integral_s": -1}, "policy.integral_s"),
        ("buffer", {"rate_window_s": 0}, "policy.rate_window_s"),
        ("buffer", {"max_batches_offpolicy": 0}, "policy.max_batches_offpolicy"),
        ("buffer", {"max_down_fraction": 0}, "policy.max_down_fraction"),
        ("buffer", {"max_down_fraction": 1.5}, "policy.max_down_fraction"),
        ("buffer", {"down_cooldown_s": -1}, "policy.down_cooldown_s"),
        ("buffer", {"production_window_s": 0}, "policy.production_window_s"),
        ("buffer", {"band_batches": -0.1}, "policy.band_batches"),
        ("buffer", {"band_batches": 1.0}, "policy.band_batches"),  # not below the least target 1
        ("buffer", {"target_batches": 1.5, "band_batches": 1.5}, "policy.band_batches"),
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
        queue_ctx(1.0, 0, 0, current=2),  # a queue sample: still count
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
