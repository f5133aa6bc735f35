"""bench/arbiter.py's simulation: every planner runs a scenario through, with no plan refused
and no request left waiting."""

from __future__ import annotations

import attrs
import pytest

from bench.arbiter import PLANNERS, PipelineSpec, Scenario, main, run, summarize
from core.arbiter import PlannerSettings

SMALL = Scenario(
    name="small",
    gpus=4,
    duration_s=400,
    pipelines=(
        PipelineSpec(name="a", rollout_trajectories=64, trajectories_per_gpu_s=1.0, train_s=20),
        PipelineSpec(
            name="b",
            rollout_trajectories=32,
            trajectories_per_gpu_s=1.0,
            train_s=30,
            arrive_s=50,
            stall_at_s=150,
            stall_s=100,
        ),
    ),
)


@pytest.mark.parametrize("planner", PLANNERS)
def test_every_planner_runs_a_scenario_through(planner: str) -> None:
    result = run(SMALL, planner)
    assert result.refused_plans == 0
    assert all(steps >= 1 for steps in result.steps.values()), result.steps
    assert 0.0 < result.busy_fraction <= 1.0
    assert result.longest_wait_s < SMALL.duration_s / 2


def test_the_shared_planners_use_the_gpus_a_static_partition_leaves_idle() -> None:
    # "b" arrives late and stalls: its static block idles meanwhile; deo lends it out.
    static, deo = run(SMALL, "static"), run(SMALL, "deo")
    assert deo.busy_fraction > static.busy_fraction


def test_engine_latency_and_preemption_cost_step_time() -> None:
    free = attrs.evolve(SMALL, wake_s=0.0, sleep_s=0.0, preempt_lost_s=0.0)
    slow = attrs.evolve(SMALL, wake_s=20.0, sleep_s=10.0, preempt_lost_s=20.0)
    for planner in PLANNERS:
        fast_run, slow_run = run(free, planner), run(slow, planner)
        assert slow_run.mean_step_s["a"] > fast_run.mean_step_s["a"], planner
        assert slow_run.busy_fraction < fast_run.busy_fraction, planner


def test_a_seed_varies_the_run_and_the_same_seed_repeats_it() -> None:
    once, again, other = run(SMALL, "deo", seed=1), run(SMALL, "deo", seed=1), run(SMALL, "deo", 2)
    assert once == again
    assert once.mean_step_s != other.mean_step_s
    summary = summarize(SMALL, "deo", seeds=(1, 2))
    assert summary.pipeline_mean_step_s == pytest.approx(
        (once.pipeline_mean_step_s + other.pipeline_mean_step_s) / 2
    )


def test_deo_runs_with_the_planner_settings_given() -> None:
    # Moves that must gain an hour are not made; free ones are, again and again.
    free = run(SMALL, "deo", seed=1, settings=PlannerSettings(move_cost_s=0.0, hysteresis=0.0))
    never = run(SMALL, "deo", seed=1, settings=PlannerSettings(move_cost_s=3600.0))
    assert never.preemptions < free.preemptions
    assert never.refused_plans == free.refused_plans == 0


def test_the_command_line_sets_every_scenario_s_engine_costs(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["--scenario", "2 equal", "--seeds", "1", "--wake-s", "15", "--sleep-s", "5"]
    assert main([*argv, "--preempt-lost-s", "10", "--move-cost-s", "30"]) == 0
    out = capsys.readouterr().out
    assert "command: python bench/arbiter.py --seeds 1 --scenario '2 equal' --wake-s 15" in out
    assert "--move-cost-s 30" in out
    assert "(3600 s simulated, wake 15 s, sleep 5 s, preemption loses 10 s)" in out
    assert "3 uneven" not in out
    for bad in (["--wake-s", "-1"], ["--move-cost-s", "-1"], ["--seeds", "0"]):
        with pytest.raises(SystemExit) as exited:
            main(bad)
        assert exited.value.code == 2
        assert bad[0] in capsys.readouterr().err
