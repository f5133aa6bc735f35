"""The arbiter measures each pipeline's step from what it hears, and deo's planner leans its
generation shares towards pipelines whose step is long for what it costs."""

from __future__ import annotations

import pytest

from core.arbiter import (
    ArbiterReducer,
    ExpandGeneration,
    GapRatioPlanner,
    GpusReleasedAndRequested,
    GpusRequested,
    PlannerSettings,
    Priority,
    ProgressReported,
    RolloutClosed,
    RolloutOpened,
)
from core.arbiter.model import PLANNER_SETTINGS_UNRECORDED
from core.arbiter.planner import planner_for
from core.commands import Command
from core.errors import InvalidEvent
from tests.core.arbiter_helpers import active, gpus, make_arbiter, register


def start(arbiter: ArbiterReducer, pipeline: str, t: float, *, first: bool = False) -> None:
    """A rollout starts as a training loop starts one: ask for generation (releasing training
    after the first step), report its target of 100 trajectories, open it."""
    if first:
        arbiter.step(
            GpusRequested(t=t, pipeline=pipeline, cluster="gen", priority=Priority.GENERATION)
        )
    else:
        arbiter.step(
            GpusReleasedAndRequested(
                t=t,
                pipeline=pipeline,
                release_cluster="train",
                cluster="gen",
                priority=Priority.GENERATION,
            )
        )
    arbiter.step(
        ProgressReported(
            t=t,
            pipeline=pipeline,
            stream="main",
            target_trajectories=100,
            completed_trajectories=0,
        )
    )
    arbiter.step(RolloutOpened(t=t, pipeline=pipeline))


def finish(arbiter: ArbiterReducer, pipeline: str, t: float) -> list[Command]:
    """A rollout ends: close it, release generation and ask for training in one step."""
    arbiter.step(RolloutClosed(t=t, pipeline=pipeline))
    return arbiter.step(
        GpusReleasedAndRequested(
            t=t,
            pipeline=pipeline,
            release_cluster="gen",
            cluster="train",
            priority=Priority.ACTOR_TRAINING,
        )
    )


def test_the_arbiter_measures_each_pipelines_non_generation_time_and_step_period() -> None:
    arbiter = make_arbiter(4)
    register(arbiter, "p", train=gpus(2), generation=gpus(4))
    start(arbiter, "p", 0.0, first=True)
    pipeline = arbiter.state.pipelines["p"]
    assert (pipeline.step_started_t, pipeline.non_generation_s, pipeline.step_s) == (
        0.0,
        None,
        None,
    )
    finish(arbiter, "p", 50.0)
    assert arbiter.state.pipelines["p"].generation_ended_t == 50.0
    start(arbiter, "p", 110.0)  # 60 s of training and the rest, a step of 110 s
    pipeline = arbiter.state.pipelines["p"]
    assert (pipeline.non_generation_s, pipeline.step_s) == (60.0, 110.0)
    finish(arbiter, "p", 160.0)
    start(arbiter, "p", 200.0)  # 40 s and 90 s this time: smoothed
    pipeline = arbiter.state.pipelines["p"]
    assert pipeline.non_generation_s == pytest.approx(60.0 + 0.3 * (40.0 - 60.0))
    assert pipeline.step_s == pytest.approx(110.0 + 0.3 * (90.0 - 110.0))
    assert pipeline.step_started_t == 200.0


def two_pipelines_after_unequal_steps() -> tuple[ArbiterReducer, list[Command]]:
    """Pipelines a and b on 8 GPUs (training on 2 each), the same rollout of 100 trajectories
    each time. a's training takes 20 s (steps of 60 s), b's 200 s (a step of 240 s); at t=240
    b asks for generation again (the commands it gets), a generating with 100 trajectories left.
    """
    arbiter = make_arbiter(8)
    register(arbiter, "a", train=("0", "1"), generation=gpus(8))
    register(arbiter, "b", train=("2", "3"), generation=gpus(8))
    start(arbiter, "a", 0.0, first=True)
    start(arbiter, "b", 0.0, first=True)
    finish(arbiter, "a", 40.0)
    finish(arbiter, "b", 40.0)
    start(arbiter, "a", 60.0)
    finish(arbiter, "a", 100.0)
    start(arbiter, "a", 120.0)
    arbiter.step(
        ProgressReported(
            t=240.0, pipeline="a", stream="main", target_trajectories=100, completed_trajectories=0
        )
    )
    commands = arbiter.step(
        GpusReleasedAndRequested(
            t=240.0,
            pipeline="b",
            release_cluster="train",
            cluster="gen",
            priority=Priority.GENERATION,
        )
    )
    return arbiter, commands


def test_a_pipeline_whose_step_is_long_for_its_cost_gets_the_larger_share() -> None:
    # Each step costs c = T / r + M * N GPU-seconds (100 + 2 * 20 = 140 for a, 100 + 2 * 200 =
    # 500 for b, rates not measured: one trajectory per GPU-second); normalised steps S / c**(1/3)
    # are 11.6 (a) and 30.2 (b): b's step is long for what it costs, and b gets most of the GPUs
    # although both have the same work left. By remaining work alone they split 4 and 4.
    arbiter, _ = two_pipelines_after_unequal_steps()
    by_work = GapRatioPlanner(step_weight=0.0).shares(arbiter.state)
    assert [by_work[(p, "gen")].target_gpus for p in ("a", "b")] == [4, 4]
    shares = GapRatioPlanner().shares(arbiter.state)
    target_a, target_b = (shares[(p, "gen")].target_gpus for p in ("a", "b"))
    assert target_b >= 6 > 2 >= target_a >= 1
    # Measured as b asked: its next report moves GPUs to it.
    arbiter.step(
        ProgressReported(
            t=241.0, pipeline="b", stream="main", target_trajectories=100, completed_trajectories=1
        )
    )
    assert len(active(arbiter, "b")) > len(active(arbiter, "a")) >= 1


def test_the_step_factor_is_in_the_reasons() -> None:
    arbiter, commands = two_pipelines_after_unequal_steps()
    planner = GapRatioPlanner()
    factors = planner.step_factors(arbiter.state, planner.demand(arbiter.state))
    factor_a, _ = factors[("a", "gen")]
    factor_b, why_b = factors[("b", "gen")]
    assert factor_b > 1 > factor_a
    assert why_b == "step 240s for 500 GPU-s, 1.45 x the mean normalised step: weight x2.09"
    # b's step was measured as its request came: the wakes its next report brings say why.
    assert not any("normalised step" in c.reason for c in commands if c.reason)
    commands = arbiter.step(
        ProgressReported(
            t=241.0, pipeline="b", stream="main", target_trajectories=100, completed_trajectories=1
        )
    )
    woken = [c for c in commands if isinstance(c, ExpandGeneration) and c.pipeline == "b"]
    assert woken and "step 240s for" in woken[0].reason
    assert "x the mean normalised step: weight x" in woken[0].reason


def test_release_then_request_is_a_sign_of_life() -> None:
    # Without it b would be silent at t=240 (nothing heard from it for 200 s) and get a probe.
    arbiter, _ = two_pipelines_after_unequal_steps()
    assert arbiter.state.pipelines["b"].activity_t == 240.0
    assert not GapRatioPlanner().shares(arbiter.state)[("b", "gen")].probe


def test_a_step_weight_of_zero_shares_by_remaining_work_alone_and_old_logs_replay_so() -> None:
    assert PlannerSettings().step_weight == 2.0
    assert planner_for(None) == GapRatioPlanner(
        move_cost_s=30.0, reserve_s=600.0, reserve_factor=None, step_weight=0.0
    )
    assert planner_for(PlannerSettings(step_weight=3.0)) == GapRatioPlanner(step_weight=3.0)
    assert PLANNER_SETTINGS_UNRECORDED.step_weight == 0.0
    with pytest.raises(InvalidEvent, match=r"PlannerSettings\.step_weight"):
        PlannerSettings(step_weight=-1.0)
