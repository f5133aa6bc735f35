"""The reactive oracle and the lower bound on scenarios whose answer can be worked out by hand.

Every pool here: groups of 8, 4 in flight, 8 s each (sigma ~ 0: every group takes the mean), so
one worker produces 4 x 8 / 8 = 4 seq/s. Batches of 64 every 4 s consume 16 seq/s: 4 workers.
Start-up 10 s: the first batch (8 groups) is ready at 10 + 8 = 18 s at the earliest.
"""

from __future__ import annotations

from typing import Any

import pytest

from adapters.sim.draws import Draws
from adapters.sim.oracle import oracle, worker_hours_bound
from adapters.sim.scenario import EnvPool, Fault, InferenceSpec, Pause, Phase, Scenario, TrainerSpec


def make_scenario(
    *,
    trainer: dict[str, Any] | None = None,
    pools: tuple[EnvPool, ...] | None = None,
    duration_s: float = 100.0,
    **scenario: Any,
) -> Scenario:
    pool = EnvPool(
        name="envs",
        group_size=8,
        groups_in_flight=4,
        latency_mean_s=8.0,
        latency_sigma=1e-6,
        startup_s=10.0,
        min_workers=1,
        max_workers=10,
    )
    return Scenario(
        name="hand",
        duration_s=duration_s,
        trainer=TrainerSpec(**{"batch_size_seqs": 64, "step_s": 4.0, **(trainer or {})}),
        pools=pools or (pool,),
        **scenario,
    )


def test_the_reactive_oracle_asks_when_demand_changes_and_waits_a_start_up() -> None:
    # 4 workers; from t = 50 the step takes 2 s: 32 seq/s, 8 workers, asked for at t = 50 and
    # producing from 60. The one batch queued lasts 4 s of the 16 seq/s deficit; in [54, 60)
    # the trainer gets half of what it consumes: 3 s more starvation after the first 18 s.
    result = oracle(make_scenario(trainer={"phases": (Phase(at_s=50.0, step_s=2.0),)}))
    workers = [p.workers for p in result.series]
    assert workers[:50] == [4] * 50
    assert workers[50:] == [8] * 50
    assert result.worker_hours == pytest.approx((4 * 50 + 8 * 50) / 3600)
    assert result.first_batch_t == pytest.approx(18.0, abs=1e-3)
    assert result.unavoidable == ((0.0, 18.0), (54.0, 60.0))
    assert result.unavoidable_starvation_share == pytest.approx(21 / 100, abs=1e-3)
    assert result.series[0].consumption_seqs_s == 16.0
    assert result.series[0].capacity_seqs_s == pytest.approx(40.0)  # 10 workers x 4 seq/s


def test_the_lower_bound_starves_only_at_the_start_and_costs_the_generation_needed() -> None:
    result = oracle(make_scenario(trainer={"phases": (Phase(at_s=50.0, step_s=2.0),)}))
    bound = result.bound
    assert bound.first_batch_t == pytest.approx(18.0, abs=1e-3)
    assert bound.starved == ((0.0, 18.0),)
    assert bound.starvation_share == pytest.approx(0.18, abs=1e-3)
    # Busy from 18 s: 8 steps of 4 s to t = 50, then 2 s steps: the trainer starts 33 steps;
    # the bound adds the one in progress at the end (34), or, the first batch at 18 s less
    # float noise, sees the ninth step start just before 50 s and take 4 s (33).
    assert 33 <= bound.steps <= 34
    # Each step: 8 groups x 8 s over 4 slots = 16 worker-seconds; plus one start-up (10 s).
    assert bound.worker_hours == pytest.approx((bound.steps * 16 + 10) / 3600, rel=1e-4)
    assert bound.worker_hours < result.worker_hours


def test_the_oracle_and_the_bound_start_no_more_at_once_than_the_pool_allows() -> None:
    # max_starting 1, as the reducer enforces it under every policy: the 4 workers needed come
    # one a start-up (1 at t = 0, 2 at 10, 3 at 20, 4 at 30), each producing 10 s later.
    pool = EnvPool(**{**_fields(make_scenario().pools[0]), "max_starting": 1})
    result = oracle(make_scenario(pools=(pool,)))
    workers = [p.workers for p in result.series]
    assert workers[:40] == [1] * 10 + [2] * 10 + [3] * 10 + [4] * 10
    assert set(workers[40:]) == {4}
    assert result.worker_hours == pytest.approx((10 + 20 + 30 + 4 * 70) / 3600)
    # The first worker's 4 groups land at 18 s (32 sequences) and again at 26 s: the first
    # batch. The queue it starts then drains at 8 seq/s to t = 30 and 4 seq/s to t = 38, and
    # the trainer gets 12 of its 16 seq/s until the fourth worker produces at 40: 0.5 s more.
    assert result.first_batch_t == pytest.approx(26.0, abs=1e-3)
    assert result.unavoidable_starvation_share == pytest.approx(0.265, abs=1e-3)
    # The bound's workers come as slowly (none starts faster than the fastest start-up drawn):
    # it starves more than with every worker at once, and never more than the oracle.
    unthrottled = oracle(make_scenario()).bound.starvation_share
    assert unthrottled < result.bound.starvation_share <= result.unavoidable_starvation_share


def test_gpus_per_worker_multiply_the_cost_and_min_workers_are_kept() -> None:
    base = make_scenario()
    pool = base.pools[0]
    doubled = make_scenario(
        pools=(EnvPool(**{**_fields(pool), "gpus_per_worker": 2}),),
    )
    assert oracle(doubled).worker_hours == pytest.approx(2 * oracle(base).worker_hours)
    assert oracle(doubled).bound.worker_hours == pytest.approx(2 * oracle(base).bound.worker_hours)
    floor = make_scenario(pools=(EnvPool(**{**_fields(pool), "min_workers": 6}),))
    assert {p.workers for p in oracle(floor).series} == {6}
    assert oracle(floor).bound.worker_hours == pytest.approx(6 * 100 / 3600)


def test_into_a_pause_the_reactive_oracle_keeps_its_workers_one_start_up_then_lets_go() -> None:
    # Paused [40, 70) (it cannot know for how long): 4 workers to t = 50, then the minimum (1);
    # 4 again at 70, producing from 80. The buffer filled during the pause (3 batches, 192
    # sequences) covers the 12 seq/s deficit of [70, 80): only the first 18 s starve.
    result = oracle(make_scenario(trainer={"pauses": (Pause(at_s=40.0, duration_s=30.0),)}))
    workers = [p.workers for p in result.series]
    assert workers[:50] == [4] * 50
    assert workers[50:70] == [1] * 20
    assert workers[70:] == [4] * 30
    assert result.worker_hours == pytest.approx((4 * 50 + 1 * 20 + 4 * 30) / 3600)
    # Paused time is neither starving nor counted: 18 s of start-up over 70 s trained.
    assert result.unavoidable_starvation_share == pytest.approx(18 / 70, abs=1e-3)


def test_inference_saturation_bounds_useful_workers_and_makes_starvation_unavoidable() -> None:
    # 8 groups at once: 2 workers saturate it, 8 groups x 8 seqs / 8 s = 8 seq/s < 16 seq/s.
    result = oracle(make_scenario(inference=InferenceSpec(max_concurrent_groups=8)))
    assert {p.workers for p in result.series} == {2}
    assert result.series[0].capacity_seqs_s == pytest.approx(8.0)
    assert result.worker_hours == pytest.approx(2 * 100 / 3600)
    # First batch at 18 s (2 workers' 64 sequences); the batch then drains in 64 / (16 - 8) =
    # 8 s, after which the trainer gets half of what it consumes: 18 + (100 - 26) / 2 = 55 s.
    assert result.first_batch_t == pytest.approx(18.0, abs=1e-3)
    assert result.unavoidable_starvation_share == pytest.approx(0.55, abs=0.01)
    assert result.unavoidable[-1] == (26.0, 100.0)
    # No controller does better: more workers add nothing.
    assert result.bound.starvation_share == pytest.approx(0.55, abs=0.01)


def test_lost_gpus_bound_the_workers_and_their_replacement_takes_a_start_up() -> None:
    # 5 GPUs; 2 lost at t = 50 kill 2 of the 4 workers and leave 3 GPUs: the reactive oracle
    # holds 3, one of them starting until t = 60, so 2 produce (8 seq/s) in [50, 60). The one
    # queued batch lasts 8 s: 0.5 s starved in each of [58, 60). From 60, 3 workers (12 seq/s)
    # for a 16 seq/s trainer: a quarter of 240 s. 18 + 1 + 60 = 79 s of 300.
    faults = (Fault(kind="gpu_loss", at_s=50.0, gpu=0), Fault(kind="gpu_loss", at_s=50.0, gpu=1))
    result = oracle(make_scenario(duration_s=300.0, gpus=5, faults=faults))
    workers = [p.workers for p in result.series]
    assert workers[:50] == [4] * 50
    assert set(workers[50:]) == {3}
    assert result.worker_hours == pytest.approx((4 * 50 + 3 * 250) / 3600)
    assert result.unavoidable_starvation_share == pytest.approx(79 / 300, abs=0.01)


def test_the_cheapest_sequences_come_first_across_pools() -> None:
    # "fast" makes 4 seq/s per GPU worker, "slow" 2 seq/s per CPU worker: fast first, up to its
    # maximum of 2 (8 seq/s), then 4 slow workers for the other 8 seq/s.
    fast = EnvPool(
        name="fast",
        latency_mean_s=8.0,
        latency_sigma=1e-6,
        startup_s=0.0,
        min_workers=0,
        max_workers=2,
    )
    slow = EnvPool(
        name="slow",
        latency_mean_s=16.0,
        latency_sigma=1e-6,
        startup_s=0.0,
        min_workers=0,
        max_workers=10,
        gpus_per_worker=0,
    )
    result = oracle(make_scenario(pools=(slow, fast)))
    assert {p.workers for p in result.series} == {6}
    assert result.worker_hours == pytest.approx(6 * 100 / 3600)


def test_the_bound_uses_the_latencies_drawn_not_their_mean() -> None:
    # Heavy tails: the first groups drawn take, on average, less than the nominal mean; the
    # bound counts what they take, so a pool that met them is not measured against the mean.
    pool = EnvPool(
        name="envs",
        latency_mean_s=8.0,
        latency_dist="pareto",
        latency_alpha=1.2,
        startup_s=0.0,
        min_workers=0,
        max_workers=10,
    )
    scenario = make_scenario(pools=(pool,), duration_s=3600.0)
    groups = 100 * 64 // 8
    drawn = sum(Draws(scenario).latency_factors("envs", groups)) * 8.0
    assert worker_hours_bound(scenario, 100) == pytest.approx(drawn / 4 / 3600)
    assert worker_hours_bound(scenario, 100) != pytest.approx(groups * 8.0 / 4 / 3600)


def _fields(pool: EnvPool) -> dict[str, Any]:
    import attrs

    return attrs.asdict(pool, recurse=False)
