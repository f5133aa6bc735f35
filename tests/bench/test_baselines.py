"""bench.baselines: each published controller replayed on a hand-computed trace.

Every row is (t, sample, workers) fed to ``decide`` in order (memory carried from row to row), or
events fed through the real ``core.Reducer`` with the pool settings from ``baseline_specs``; the
comment on each row is the published rule's arithmetic. Sources:

* DEO proposal: NousResearch/atropos PR #438, ``atroposlib/orchestration/controller.py``
  (``ScalingController.calculate_desired``) and ``metrics.py`` (``rollout_pressure``).
* Ray Serve: ray-project/ray ``python/ray/serve/autoscaling_policy.py`` and the
  ``AutoscalingConfig`` defaults.
* verl: the elastic scheduler for SGLangRollout (``ElasticConfig`` defaults,
  ``ElasticScheduler._make_scaling_decision`` / ``_has_stable_load``), as core's ``threshold``.
* Kubernetes HPA: ``GetExternalPerPodMetricReplicas`` (AverageValue target, tolerance 0.1) and
  the default scale-down stabilization (highest recommendation of the last 300 s), as core's
  ``hpa``.

"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import pytest

from adapters.log import EventLog
from bench.baselines import (
    BASELINE_POLICIES,
    CATALOG,
    DeoProposalMemory,
    DeoProposalPolicy,
    RayServeMemory,
    RayServePolicy,
    baseline_specs,
)
from core import (
    Command,
    Config,
    Configured,
    DrainWorker,
    LoadSampled,
    PolicySpec,
    PoolSpec,
    QueueSampled,
    Reducer,
    ScalePool,
    SpawnWorker,
    WorkerExited,
    WorkerStarted,
    codec,
)
from core.codec import types_with
from core.errors import ConfigError
from core.policies import BUILT_INS, POLICIES, Decision, HpaPolicy, PolicyContext

GROUP_SIZE = 4
GROUPS_IN_FLIGHT = 10  # verl capacity 10, HPA target 8 (0.8 x 10), Ray target 4 (2/5 x 10)
SPECS = baseline_specs(group_size=GROUP_SIZE, groups_in_flight=GROUPS_IN_FLIGHT, max_workers=10)


def built(spec: PolicySpec) -> Any:
    """The benchmark catalog's ``build``, typed loosely: baselines narrow ``reacts_to``."""
    return CATALOG.build(spec)


def policy_of(name: str) -> Any:
    return built(SPECS[name][0])


# --- trace helpers --------------------------------------------------------------------------------


def queue_ctx(
    t: float, queued_seqs: int, *, current: int, active: int | None = None, batch: int = 64
) -> PolicyContext:
    return PolicyContext(
        t=t,
        pool="envs",
        current=current,
        active=current if active is None else active,
        min_workers=1,
        max_workers=10,
        queue=QueueSampled(
            t=t, pool="envs", queued_sequences=queued_seqs, batch_size_seqs=batch, trainer_step=0
        ),
    )


def load_ctx(
    t: float, in_flight: int, *, current: int, active: int | None = None, min_workers: int = 1
) -> PolicyContext:
    return PolicyContext(
        t=t,
        pool="envs",
        current=current,
        active=current if active is None else active,
        min_workers=min_workers,
        max_workers=10,
        load=LoadSampled(t=t, pool="envs", in_flight_requests=in_flight),
    )


def run_trace(
    policy: Any, contexts: Sequence[PolicyContext], memory: Any = None
) -> tuple[list[int], Any]:
    """The targets ``policy`` gives for ``contexts`` in order, memory carried along."""
    targets = []
    for context in contexts:
        decision: Decision = policy.decide(context, memory)
        targets.append(decision.target)
        memory = decision.memory
    return targets, memory


class World:
    """One pool under the real reducer; spawned workers start and drained ones exit at once."""

    def __init__(self, name: str, *, initial: int, min_workers: int = 1) -> None:
        spec, overrides = SPECS[name]
        self.reducer = Reducer(policies=CATALOG, check_invariants=True)
        self.pids = itertools.count(1000)
        pool = PoolSpec(
            name="envs",
            argv=["python", "env.py"],
            min_workers=min_workers,
            max_workers=10,
            # The pool starts with ``initial`` workers pinned, then the policy takes over.
            policy=PolicySpec(name="static", params={"count": initial}),
            **overrides,
        )
        self.feed(Configured(t=0.0, config=Config(pools=[pool])))
        self.feed(Configured(t=0.0, config=Config(pools=[pool_with(pool, spec)])))

    def feed(self, event: Any) -> list[int]:
        """Reduce ``event``; the ScalePool targets it produced."""
        commands: list[Command] = self.reducer.step(event)
        for command in commands:
            if isinstance(command, SpawnWorker):
                pid = next(self.pids)
                self.reducer.step(
                    WorkerStarted(t=event.t, worker_id=command.worker_id, pid=pid, start_time=pid)
                )
            elif isinstance(command, DrainWorker):
                self.reducer.step(WorkerExited(t=event.t, worker_id=command.worker_id, exit_code=0))
        return [c.target for c in commands if isinstance(c, ScalePool)]

    @property
    def workers(self) -> int:
        return self.reducer.state.pools["envs"].target


def pool_with(pool: PoolSpec, policy: PolicySpec) -> PoolSpec:
    return attrs.evolve(pool, policy=policy)


def load(t: float, in_flight: int) -> LoadSampled:
    return LoadSampled(t=t, pool="envs", in_flight_requests=in_flight)


def queue(t: float, queued_seqs: int, batch: int = 64) -> QueueSampled:
    return QueueSampled(
        t=t, pool="envs", queued_sequences=queued_seqs, batch_size_seqs=batch, trainer_step=0
    )


# --- registration and specs -----------------------------------------------------------------------


def test_the_catalog_builds_the_baselines_and_the_core_policies() -> None:
    assert CATALOG.policies["deo-proposal"] is DeoProposalPolicy
    assert CATALOG.policies["ray-serve"] is RayServePolicy
    assert built(PolicySpec(name="deo-proposal", params={"group_size": 16})) == DeoProposalPolicy(
        group_size=16
    )
    assert built(PolicySpec(name="ray-serve", params={"upscale_delay_s": 5})) == RayServePolicy(
        upscale_delay_s=5.0
    )
    # The core policies are there as well; the core's own catalog never learns of the baselines.
    for name in ("buffer", "hpa", "static", "threshold"):
        assert CATALOG.policies[name] is POLICIES[name]
    assert set(BUILT_INS.policies) == {"buffer", "hpa", "static", "threshold"}
    with pytest.raises(ConfigError, match="unknown policy 'ray-serve'"):
        BUILT_INS.build(PolicySpec(name="ray-serve"))


def test_a_reducer_without_the_catalog_refuses_a_baseline_by_name() -> None:
    pool = PoolSpec(name="envs", argv=["x"], policy=PolicySpec(name="ray-serve"))
    with pytest.raises(ConfigError, match="unknown policy 'ray-serve'"):
        Reducer().step(Configured(t=0.0, config=Config(pools=[pool])))
    reducer = Reducer(policies=CATALOG)
    reducer.step(Configured(t=0.0, config=Config(pools=[pool])))
    reducer.step(LoadSampled(t=1.0, pool="envs", in_flight_requests=3))
    built_policy = reducer.state.pools["envs"].built_policy
    assert built_policy is not None and built_policy[1] == RayServePolicy()


@pytest.mark.parametrize(
    ("name", "params", "key"),
    [
        ("deo-proposal", {"group_size": 0}, "policy.group_size"),
        ("deo-proposal", {"group_size": 4.0}, "policy.group_size"),  # a count, not a float
        ("deo-proposal", {"target_pressure": 0}, "policy.target_pressure"),
        ("deo-proposal", {"scaling_threshold": -0.1}, "policy.scaling_threshold"),
        ("deo-proposal", {"cooldown_s": -1}, "policy.cooldown_s"),
        ("deo-proposal", {"max_step_change": 0}, "policy.max_step_change"),
        ("ray-serve", {"target_ongoing_requests": 0}, "policy.target_ongoing_requests"),
        ("ray-serve", {"upscale_delay_s": -1}, "policy.upscale_delay_s"),
        ("ray-serve", {"downscale_delay_s": -1}, "policy.downscale_delay_s"),
        ("ray-serve", {"upscaling_factor": 0}, "policy.upscaling_factor"),
        ("ray-serve", {"look_back_period_s": 0}, "policy.look_back_period_s"),
        ("ray-serve", {"bogus": 1}, "policy.bogus"),
    ],
)
def test_bad_parameters_name_the_key(name: str, params: dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigError) as info:
        CATALOG.build(PolicySpec(name=name, params=params))
    assert key in str(info.value)


def test_baseline_specs_build_and_carry_the_published_parameters() -> None:
    assert set(SPECS) == {"deo-proposal", "deo-corrected", "ray-serve", "verl", "k8s-hpa", "static"}
    for name, (spec, overrides) in SPECS.items():
        CATALOG.build(spec)  # every spec is valid
        PoolSpec(name="envs", argv=["x"], max_workers=10, **overrides)  # so are the overrides
        expected = {} if name == "static" else {"stabilization_s": 0.0}
        assert overrides == expected, name
    assert policy_of("verl") == built(
        PolicySpec(
            name="threshold",
            params={
                "capacity_per_worker": 10.0,  # groups_in_flight
                "scale_up_threshold": 0.8,
                "scale_down_threshold": 0.5,
                "scale_up_cooldown_s": 30.0,
                "scale_down_cooldown_s": 60.0,
                "stability_s": 10.0,
                "step": 1,
            },
        )
    )
    assert policy_of("k8s-hpa") == HpaPolicy(
        target_per_worker=8.0,
        tolerance=0.1,
        scale_down_stabilization_s=300.0,  # 0.8 x 10
    )
    assert policy_of("deo-proposal") == DeoProposalPolicy(group_size=GROUP_SIZE)
    assert policy_of("ray-serve") == RayServePolicy(target_ongoing_requests=4.0)  # 10 x 2/5
    assert policy_of("static").initial_target(1, 10) == 10  # the pool's maximum


@pytest.mark.parametrize(
    "args", [(0, 8, 10), (4, 0, 10), (4, 8, 0), (4, 8, True), (4.0, 8, 10), (4, "8", 10)]
)
def test_baseline_specs_reject_bad_input(args: tuple[Any, Any, Any]) -> None:
    with pytest.raises(ConfigError, match="baseline_specs"):
        baseline_specs(*args)


@pytest.mark.parametrize(
    "memory",
    [
        DeoProposalMemory(),
        DeoProposalMemory(last_action_t=60.0),
        RayServeMemory(samples=((0.0, 3), (10.0, 5)), direction=-1, since_t=10.0),
    ],
)
def test_memories_survive_the_codec(memory: object) -> None:
    # A state snapshot of a pool run by a baseline encodes its memory like any other, and decodes
    # with the catalog's records.
    assert codec.decode(codec.encode(memory), types_with(CATALOG.records)) == memory


def test_published_defaults() -> None:
    deo = DeoProposalPolicy()
    # ScalingController(target_pressure=1.0, scaling_threshold=0.2, cooldown_seconds=60,
    # max_step_change=4); PR README: --cooldown 60, --max-step 4.
    assert (deo.target_pressure, deo.scaling_threshold, deo.cooldown_s, deo.max_step_change) == (
        1.0,
        0.2,
        60.0,
        4,
    )
    ray = RayServePolicy()
    # AutoscalingConfig(target_ongoing_requests=2, upscale_delay_s=30, downscale_delay_s=600,
    # smoothing_factor=1.0, look_back_period_s=30).
    assert (
        ray.target_ongoing_requests,
        ray.upscale_delay_s,
        ray.downscale_delay_s,
        ray.upscaling_factor,
        ray.downscaling_factor,
        ray.look_back_period_s,
    ) == (2.0, 30.0, 600.0, 1.0, 1.0, 30.0)
    assert set(BASELINE_POLICIES) == {"deo-proposal", "deo-corrected", "ray-serve"}


# --- the Atropos DEO proposal ---------------------------------------------------------------------


def test_deo_proposal_trace() -> None:
    # group_size 4, batch 64 sequences; pressure = (queued_seqs // 4) groups / 64 sequences.
    rows = [
        # 128 groups / 64 = 2.0; |2.0 - 1| >= 0.2; ceil(max(1,1) x 2.0) = 2 -> UP to 2 (deep
        # queue: the published direction); cooldown starts at t=0
        (queue_ctx(0, 512, current=1), 2),
        # 256 / 64 = 4.0 but 30 - 0 < 60 s cooldown: hold 2
        (queue_ctx(30, 1024, current=2), 2),
        # 60 - 0 >= 60: ceil(2 x 4.0) = 8, step 6 capped at max_step_change 4 -> 6
        (queue_ctx(60, 1024, current=2), 6),
        # 68 / 64 = 1.0625: |0.0625| < 0.2 dead band -> hold 6 (cooldown over: 120 - 60 >= 60)
        (queue_ctx(120, 272, current=6), 6),
        # empty queue (the trainer is starving): 0 / 64 = 0 -> ceil(6 x 0) = 0, step -6 capped
        # at -4 -> DOWN to 2 (backwards for a trainer queue, as published)
        (queue_ctx(121, 0, current=6), 2),
        # 250 sequences = 62 whole groups (250 // 4): 62 / 64 = 0.97 -> dead band, hold
        (queue_ctx(200, 250, current=2), 2),
        # 0.5 -> ceil(2 x 0.5) = 1 -> DOWN to 1
        (queue_ctx(250, 128, current=2), 1),
    ]
    targets, memory = run_trace(policy_of("deo-proposal"), [ctx for ctx, _ in rows])
    assert targets == [want for _, want in rows]
    assert memory == DeoProposalMemory(last_action_t=250)


def test_deo_corrected_trace() -> None:
    # pressure = queued batches (sequences / 64); more workers on a short queue.
    rows = [
        # empty queue: the pool's maximum (10), step capped at 4 from 1 connected -> 5
        (queue_ctx(0, 0, current=1), 5),
        # 0.25 batches, but within the 60 s cooldown: hold
        (queue_ctx(30, 16, current=5), 5),
        # 0.25 batches: ceil(5 x 1 / 0.25) = 20, step capped at 4 -> 9
        (queue_ctx(60, 16, current=5), 9),
        # 1.1 batches: inside the dead band -> hold
        (queue_ctx(130, 70, current=9), 9),
        # 3 batches (deep: the envs are ahead): ceil(9 x 1 / 3) = 3, step -4 -> DOWN to 5
        (queue_ctx(200, 192, current=9), 5),
        # 0.5 batches with 2 pending of 7: wants ceil(5 x 2) = 10 > 7, step 4 -> 9
        (queue_ctx(300, 32, current=7, active=5), 9),
    ]
    targets, memory = run_trace(policy_of("deo-corrected"), [ctx for ctx, _ in rows])
    assert targets == [want for _, want in rows]
    assert memory == DeoProposalMemory(last_action_t=300)


def test_deo_proposal_pending_bounds_and_steps_from_the_connected_count() -> None:
    policy = policy_of("deo-proposal")
    rows = [
        # 2 connected + 3 pending: 2.0 -> ceil(2 x 2.0) = 4 <= 5 effective -> hold 5, no cooldown
        (queue_ctx(0, 512, current=5, active=2), 5, None),
        # 1 connected + 5 pending: 8.0 -> ceil(1 x 8) = 8 > 6 effective; 1 + min(7, 4) = 5 -> 5
        # (below the 6 live workers: the proposal's set_instance_count(5) stops one too)
        (queue_ctx(0, 2048, current=6, active=1), 5, 0),
        # 9 connected: 4.0 -> 36, capped 9 + 4 = 13, clamped to max 10 -> 10
        (queue_ctx(0, 1024, current=9), 10, 0),
        # at max: 10 + 4 clamps back to 10 == connected -> no action, so no cooldown either
        (queue_ctx(0, 1024, current=10), 10, None),
        # 0 connected, 2 starting: base max(0, 1) = 1: ceil(1 x 0.5) = 1 <= 2 effective -> hold 2
        (queue_ctx(0, 128, current=2, active=0), 2, None),
        # 3 connected + 1 pending, pressure 0.75: ceil(3 x 0.75) = 3 == connected: the
        # proposal does nothing (set_instance_count is called only when the target differs from
        # the connected count), so the pending worker is kept: hold 4
        (queue_ctx(0, 192, current=4, active=3), 4, None),
    ]
    for i, (context, want, last_action_t) in enumerate(rows):
        decision = policy.decide(context, None)
        assert decision.target == want, i
        assert decision.memory == DeoProposalMemory(last_action_t=last_action_t), i


def test_deo_proposal_through_the_reducer_keeps_its_own_cooldown_only() -> None:
    world = World("deo-proposal", initial=1)
    assert world.workers == 1
    # 2.0 -> 2 at t=0
    assert world.feed(queue(0, 512)) == [2]
    # 0.0 -> DOWN at t=60: the proposal's 60 s cooldown has passed; the reducer's default 120 s
    # stabilization window would have held it, so baseline_specs turns that window off.
    assert world.feed(queue(30, 0)) == []  # cooldown
    assert world.feed(queue(60, 0)) == [1]  # ceil(2 x 0) = 0, clamped to min 1
    assert world.workers == 1


# --- Ray Serve ------------------------------------------------------------------------------------


def test_ray_serve_trace() -> None:
    # target_ongoing_requests 4, upscale 30 s, downscale 600 s, look-back 30 s, one sample / 10 s.
    policy = RayServePolicy(target_ongoing_requests=4.0)
    up = [
        # mean(8) = 8; 8 / 4 = 2 == target 2 -> at target
        (load_ctx(0, 8, current=2), 2),
        # mean(8, 20) = 14 -> 3.5 -> ceil(2 + 1.0 x 1.5) = 4 > 2: up decision begins, held 0
        (load_ctx(10, 20, current=2), 2),
        # mean(8, 20, 20) = 16 -> 4 -> 4: held 10 < 30
        (load_ctx(20, 20, current=2), 2),
        # the t=0 sample is 30 s old and leaves the window: mean(20, 20, 20) -> 5: held 20 < 30
        (load_ctx(30, 20, current=2), 2),
        # held 30 >= 30: scale to 5 (the latest decision)
        (load_ctx(40, 20, current=2), 5),
    ]
    targets, memory = run_trace(policy, [ctx for ctx, _ in up])
    assert targets == [want for _, want in up]
    assert memory.direction == 0 and memory.since_t is None  # a decision that applies resets

    # Load falls to 4 in flight with 5 replicas: mean(20, 20, 4) = 14.67 -> 3.67 ->
    # ceil(5 - 1.33) = 4 < 5 at t=50: a down decision begins; every later sample also wants
    # fewer (mean -> 4 -> 1 replica), so it applies 600 s later, at t=650, as 1.
    down = [load_ctx(t, 4, current=5) for t in range(50, 660, 10)]
    targets, memory = run_trace(policy, down, memory)
    assert targets[:-1] == [5] * (len(down) - 1)  # held 0 .. 590 s < 600 s
    assert targets[-1] == 1  # t=650: held 600 s; mean(4, 4, 4) / 4 = 1


def test_ray_serve_a_broken_streak_restarts_the_delay() -> None:
    policy = RayServePolicy(target_ongoing_requests=4.0, look_back_period_s=1.0)
    rows = [
        (load_ctx(0, 16, current=2), 2),  # 16 / 4 = 4 > 2: up streak from t=0
        (load_ctx(20, 16, current=2), 2),  # held 20 < 30
        (load_ctx(25, 8, current=2), 2),  # 8 / 4 = 2 == target: "do nothing" resets the count
        (load_ctx(30, 16, current=2), 2),  # up again, streak from t=30 (t=0 no longer counts)
        (load_ctx(50, 2, current=2), 2),  # 2 / 4 -> ceil(2 - 1.5) = 1 < 2: down resets the up run
        (load_ctx(55, 16, current=2), 2),  # up streak from t=55
        (load_ctx(85, 16, current=2), 4),  # held 30 >= 30 -> 4
    ]
    targets, _ = run_trace(policy, [ctx for ctx, _ in rows])
    assert targets == [want for _, want in rows]


def test_ray_serve_cold_start_factors_and_floor() -> None:
    policy = RayServePolicy(target_ongoing_requests=4.0, downscale_delay_s=0.0)
    rows = [
        # no replica running, 3 in flight: cold start -> max(ceil(1 x 1.0), 0) = 1 at once
        (load_ctx(0, 3, current=0, min_workers=0), 1),
        # no replica running yet (1 starting), no load: hold the current target 1
        (load_ctx(1, 0, current=1, active=0, min_workers=0), 1),
        # 2 running, 0 in flight, min 0: desired 0 -> but only 1 -> 0 may reach zero: 1
        (load_ctx(2, 0, current=2, min_workers=0), 1),
        # from exactly 1, zero is allowed (downscale_to_zero_delay_s unset: downscale_delay_s)
        (load_ctx(3, 0, current=1, min_workers=0), 0),
    ]
    for i, (context, want) in enumerate(rows):
        assert policy.decide(context, None).target == want, i

    slow = RayServePolicy(
        target_ongoing_requests=4.0, downscale_delay_s=0.0, downscaling_factor=0.5
    )
    # 6 in flight, 2 running: desired 1.5, ceil(2 + 0.5 x -0.5) = 2 and ceil(1.5) = 2 is not
    # below 2: stays 2
    assert slow.decide(load_ctx(0, 6, current=2), None).target == 2
    # 4 in flight: desired 1, ceil(2 + 0.5 x -1) = 2 == running but ceil(1) < 2: stuck -> 1
    assert slow.decide(load_ctx(0, 4, current=2), None).target == 1
    fast = RayServePolicy(target_ongoing_requests=4.0, upscale_delay_s=0.0, upscaling_factor=2.0)
    # 16 in flight, 2 running: desired 4 -> ceil(2 + 2 x 2) = 6, within max 10
    assert fast.decide(load_ctx(0, 16, current=2), None).target == 6
    # 40 in flight: ceil(2 + 2 x 8) = 18, clamped to 10 before the delay
    assert fast.decide(load_ctx(0, 40, current=2), None).target == 10


def test_ray_serve_through_the_reducer() -> None:
    # baseline_specs: target_ongoing_requests = 2/5 x groups_in_flight 10 = 4.
    world = World("ray-serve", initial=2)
    got = [world.feed(load(t, 24)) for t in (0, 10, 20, 30)]
    # 24 / 4 = 6 > 2 from t=0; applies when held 30 s, at t=30
    assert got == [[], [], [], [6]]
    assert world.workers == 6


# --- verl's elastic scheduler (core ``threshold``) ------------------------------------------------


def test_verl_trace() -> None:
    # capacity 10 per worker; ratio = in flight / (10 x workers). verl acts once load is "stable"
    # (>= 3 samples, >= 2 of them in the last 10 s with variance < 0.1) and its cooldown since the
    # last move in that direction has passed (strictly); core's threshold asks the ratio to stay
    # past the threshold for 10 s. The sample times below are where both agree.
    rows = [
        (load_ctx(0, 10, current=2), 2),  # 10/20 = 0.5: not < 0.5 -> hold
        (load_ctx(10, 10, current=2), 2),
        # 30/20 = 1.5 > 0.8; verl: var(0.5, 1.5) = 0.25 unstable; core: above for 0 s -> hold
        (load_ctx(20, 30, current=2), 2),
        # verl: var(1.5, 1.5) = 0 stable, never scaled up; core: above 10 s -> +1 = 3
        (load_ctx(30, 30, current=2), 3),
        # 30/30 = 1.0 > 0.8, but 10 s since the scale-up < 30 s cooldown -> hold
        (load_ctx(40, 30, current=3), 3),
        (load_ctx(50, 30, current=3), 3),  # 20 s < 30 s
        (load_ctx(58, 30, current=3), 3),  # 28 s < 30 s
        (load_ctx(65, 30, current=3), 4),  # 35 s > 30 s, stable, above 25 s -> +1 = 4
        # 5/40 = 0.125 < 0.5; verl: var(1.0, 0.125) = 0.19 unstable; core: below for 0 s -> hold
        (load_ctx(75, 5, current=4), 4),
        (load_ctx(85, 5, current=4), 3),  # stable / below 10 s, never scaled down -> -1 = 3
        (load_ctx(95, 5, current=3), 3),  # 5/30 = 0.17 < 0.5 but 10 s since the scale-down < 60 s
        (load_ctx(140, 5, current=3), 3),  # 55 s < 60 s
        (load_ctx(147, 5, current=3), 2),  # 62 s > 60 s -> -1 = 2
        (load_ctx(157, 6, current=2), 2),  # 6/20 = 0.3 < 0.5, below for 0 s since the last move
        (load_ctx(167, 7, current=2), 2),  # 7/20 = 0.35: 10 s below but 20 s since down < 60 s
        (load_ctx(177, 12, current=2), 2),  # 12/20 = 0.6: inside [0.5, 0.8] -> hold
    ]
    targets, _ = run_trace(policy_of("verl"), [ctx for ctx, _ in rows])
    assert targets == [want for _, want in rows]


def test_verl_through_the_reducer_with_the_stabilization_window_off() -> None:
    world = World("verl", initial=2)
    got = [world.feed(load(t, n)) for t, n in ((0, 10), (10, 10), (20, 30), (30, 30))]
    assert got == [[], [], [], [3]]  # as in the trace: +1 at t=30
    got = [world.feed(load(t, n)) for t, n in ((40, 2), (50, 2))]
    # 2/30 = 0.07 < 0.5 for 10 s at t=50 -> 2, 20 s after the scale-up: verl has no rule against
    # it (only its own per-direction cooldowns), and baseline_specs turned the reducer's 120 s
    # window off.
    assert got == [[], [2]]


def test_verl_acts_on_the_first_high_sample_after_steady_load() -> None:
    # verl at t=10: history and last 10 s (0.6, 0.6, 0.85) -> variance 0.014 < 0.1 stable;
    # 0.85 > 0.8 and never scaled up -> +1 = 3. Core waits until the ratio is 10 s past 0.8.
    rows = [
        (load_ctx(0, 12, current=2), 2),  # 12/20 = 0.6 inside the band
        (load_ctx(5, 12, current=2), 2),
        (load_ctx(10, 17, current=2), 3),  # 17/20 = 0.85
    ]
    targets, _ = run_trace(policy_of("verl"), [ctx for ctx, _ in rows])
    assert targets == [want for _, want in rows]


def test_verl_cooldown_is_strict() -> None:
    rows = [
        (load_ctx(0, 15, current=2), 2),  # 15/20 = 0.75 inside the band
        (load_ctx(10, 15, current=2), 2),
        (load_ctx(20, 30, current=2), 2),  # 1.5; verl: var(0.75, 1.5) = 0.14 unstable
        (load_ctx(30, 30, current=2), 3),  # both: +1 at t=30 (stable / above 10 s)
        (load_ctx(40, 45, current=3), 3),  # 45/30 = 1.5, 10 s since the scale-up
        (load_ctx(50, 45, current=3), 3),  # 20 s
        (load_ctx(60, 45, current=3), 3),  # verl: 60 - 30 = 30, not > 30 -> hold; core: 4
    ]
    targets, _ = run_trace(policy_of("verl"), [ctx for ctx, _ in rows])
    assert targets == [want for _, want in rows]


def test_verl_capacity_counts_active_workers_only() -> None:
    # 2 active + 2 starting, 17 in flight: verl 17 / (2 x 10) = 0.85 > 0.8 -> up once stable;
    # core 17 / (4 x 10) = 0.425 < 0.5 -> down after 10 s.
    rows = [
        (load_ctx(0, 17, current=4, active=2), 4),
        (load_ctx(10, 17, current=4, active=2), 4),
        (load_ctx(20, 17, current=4, active=2), 5),
    ]
    targets, _ = run_trace(policy_of("verl"), [ctx for ctx, _ in rows])
    assert targets == [want for _, want in rows]


# --- Kubernetes HPA (core ``hpa``) ----------------------------------------------------------------


def test_k8s_hpa_trace() -> None:
    # AverageValue target 8 per worker, tolerance 0.1, scale-down stabilization 300 s; one
    # sample per 15 s sync period. ratio = in flight / (8 x current); outside the tolerance the
    # recommendation is ceil(in flight / 8); a scale-down takes the highest recommendation of the
    # last 300 s (recorded after `now - 300`, exclusive).
    rows = [
        (load_ctx(0, 34, current=4), 4),  # 34/32 = 1.06: |0.06| <= 0.1 -> keep 4
        (load_ctx(15, 40, current=4), 5),  # 40/32 = 1.25 -> ceil(40/8) = 5, up at once
        (load_ctx(30, 20, current=5), 5),  # 20/40 = 0.5 -> 3, but max(4, 5, 3) = 5 -> 5
    ]
    # every 15 s up to t=300 the t=15 recommendation of 5 is inside the window: hold 5
    rows += [(load_ctx(t, 20, current=5), 5) for t in range(45, 315, 15)]
    # t=315: the t=15 recommendation is 300 s old, out; max(3, ..., 3) = 3
    rows += [(load_ctx(315, 20, current=5), 3)]
    # 20/24 = 0.83 -> ceil(20/8) = 3 == current 3: stays
    rows += [(load_ctx(330, 20, current=3), 3)]
    targets, _ = run_trace(policy_of("k8s-hpa"), [ctx for ctx, _ in rows])
    assert targets == [want for _, want in rows]


def test_k8s_hpa_through_the_reducer() -> None:
    world = World("k8s-hpa", initial=4)
    assert world.feed(load(0, 40)) == [5]  # ceil(40 / 8)
    got = [world.feed(load(t, 8)) for t in range(15, 315, 15)]
    # 8/40 = 0.2 -> 1 from t=15, held by the t=0 recommendation of 5 until it is 300 s old
    assert got[:-1] == [[]] * (len(got) - 1)
    assert got[-1] == [1]  # t=300: max of the last 300 s (t=15 .. 300) is 1
    assert world.workers == 1


def test_k8s_hpa_default_scale_up_rate_limit() -> None:
    # 1 worker, 80 in flight: recommendation ceil(80 / 8) = 10; default scaleUp policies allow
    # max(1 + 4, 2 x 1) = 5 this period.
    assert policy_of("k8s-hpa").decide(load_ctx(0, 80, current=1), None).target == 5


# --- static ---------------------------------------------------------------------------------------


def test_static_holds_the_pool_maximum() -> None:
    world = World("static", initial=1)
    assert world.workers == 10  # baseline_specs(max_workers=10): count 10
    assert world.feed(load(0, 0)) == []  # never asked, whatever the pressure
    assert world.feed(queue(1, 0)) == []
    assert world.workers == 10


def test_a_log_of_a_baseline_run_recovers_only_with_the_catalog(tmp_path: Path) -> None:
    pool = PoolSpec(
        name="envs",
        argv=["x"],
        max_workers=10,
        policy=PolicySpec(name="ray-serve"),
        **SPECS["ray-serve"][1],
    )
    path = tmp_path / "run.deo.jsonl"
    reducer = Reducer(policies=CATALOG)
    log, _ = EventLog.open(path, fsync=False, policies=CATALOG)
    with log:
        log.record(reducer, Configured(t=0.0, config=Config(pools=[pool])))
        log.record(reducer, load(1.0, 12))
        log.snapshot(reducer.state)
    assert isinstance(reducer.state.pools["envs"].policy_memory, RayServeMemory)

    log, recovery = EventLog.open(path, fsync=False, policies=CATALOG)
    log.close()
    assert recovery.state == reducer.state
    assert recovery.replayed == 0  # from the snapshot, which holds the baseline's memory
    # Without the catalog neither the snapshot nor the Configured event can be read back.
    log, recovery = EventLog.open(path, fsync=False)
    log.close()
    assert "envs" not in recovery.state.pools
