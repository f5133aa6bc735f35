"""The oracle on scenarios whose answer can be worked out by hand.

Every pool here: groups of 8, 4 in flight, 8 s each (sigma ~ 0: every group takes the mean), so
one worker produces 4 x 8 / 8 = 4 seq/s. Batches of 64 every 4 s consume 16 seq/s: 4 workers.
"""

from __future__ import annotations

from typing import Any

import pytest

from adapters.sim.oracle import oracle
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


def test_steady_demand_and_a_faster_phase_provisioned_ahead_by_start_up() -> None:
    # 4 workers; from t = 50 the step takes 2 s: 32 seq/s, 8 workers, requested at t = 40.
    result = oracle(make_scenario(trainer={"phases": (Phase(at_s=50.0, step_s=2.0),)}))
    workers = [p.workers for p in result.series]
    assert workers[:40] == [4] * 40
    assert workers[40:] == [8] * 60
    assert result.worker_hours == pytest.approx((4 * 40 + 8 * 60) / 3600)
    assert result.series[0].consumption_seqs_s == 16.0
    assert result.series[0].capacity_seqs_s == 40.0  # 10 workers x 4 seq/s


def test_start_up_is_the_only_unavoidable_starvation_when_capacity_suffices() -> None:
    # At most 10 workers x 4 groups x 8 = 320 sequences in the first round: a 64-sequence batch
    # is ready once the first groups finish, start-up (10 s) + latency (8 s) = 18 s.
    result = oracle(make_scenario())
    assert result.first_batch_t == pytest.approx(18.0, abs=1e-3)
    assert result.unavoidable == ((0.0, 18.0),)
    assert result.unavoidable_starvation_share == pytest.approx(0.18, abs=1e-3)


def test_gpus_per_worker_multiply_the_cost_and_min_workers_are_kept() -> None:
    base = make_scenario()
    pool = base.pools[0]
    doubled = make_scenario(
        pools=(EnvPool(**{**_fields(pool), "gpus_per_worker": 2}),),
    )
    assert oracle(doubled).worker_hours == pytest.approx(2 * oracle(base).worker_hours)
    floor = make_scenario(pools=(EnvPool(**{**_fields(pool), "min_workers": 6}),))
    assert {p.workers for p in oracle(floor).series} == {6}


def test_a_pause_needs_only_the_minimum_until_start_up_before_it_ends() -> None:
    # Paused [40, 70): 1 worker (the minimum) from 40, back to 4 at 70 - 10 = 60.
    result = oracle(make_scenario(trainer={"pauses": (Pause(at_s=40.0, duration_s=30.0),)}))
    workers = [p.workers for p in result.series]
    assert workers[:40] == [4] * 40
    assert workers[40:60] == [1] * 20
    assert workers[60:] == [4] * 40
    assert result.worker_hours == pytest.approx((4 * 40 + 1 * 20 + 4 * 40) / 3600)
    # Paused time is neither starving nor counted: 18 s of start-up over 70 s trained.
    assert result.unavoidable_starvation_share == pytest.approx(18 / 70, abs=1e-3)


def test_inference_saturation_bounds_useful_workers_and_makes_starvation_unavoidable() -> None:
    # 8 groups at once: 2 workers saturate it, 8 groups x 8 seqs / 8 s = 8 seq/s < 16 seq/s.
    result = oracle(make_scenario(inference=InferenceSpec(max_concurrent_groups=8)))
    assert {p.workers for p in result.series} == {2}
    assert result.series[0].capacity_seqs_s == 8.0
    assert result.worker_hours == pytest.approx(2 * 100 / 3600)
    # First batch at 18 s (2 workers' 64 sequences); the batch then drains in 64 / (16 - 8) =
    # 8 s, after which the trainer gets half of what it consumes: 18 + (100 - 26) / 2 = 55 s.
    assert result.first_batch_t == pytest.approx(18.0, abs=1e-3)
    assert result.unavoidable_starvation_share == pytest.approx(0.55, abs=0.01)
    assert result.unavoidable[-1] == (26.0, 100.0)


def test_lost_gpus_bound_the_workers() -> None:
    # 5 GPUs; 2 lost at t = 50 leave 3 workers (12 seq/s) for a 16 seq/s trainer. The buffer,
    # full at 3 batches (192 sequences) by then, drains at 4 seq/s until t = 98; from then on the
    # trainer starves a quarter of the time: 18 + (300 - 98) / 4 = 68.5 s of 300.
    faults = (Fault(kind="gpu_loss", at_s=50.0, gpu=0), Fault(kind="gpu_loss", at_s=50.0, gpu=1))
    result = oracle(make_scenario(duration_s=300.0, gpus=5, faults=faults))
    workers = [p.workers for p in result.series]
    assert workers[:50] == [4] * 50
    assert set(workers[50:]) == {3}
    assert result.worker_hours == pytest.approx((4 * 50 + 3 * 250) / 3600)
    assert result.unavoidable_starvation_share == pytest.approx(68.5 / 300, abs=0.01)


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


def _fields(pool: EnvPool) -> dict[str, Any]:
    import attrs

    return attrs.asdict(pool, recurse=False)
