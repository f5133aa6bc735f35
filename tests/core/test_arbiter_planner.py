"""deo's arbiter planner: rates measured over the GPU-seconds each span had, holders judged
against their own holds, the settings recorded in the log, and reasons that say what they
measured."""

from __future__ import annotations

import pytest

from core import Config, Configured, RaiseAlert, Reducer, ResolveAlert, Tick, decode, encode
from core.arbiter import (
    PLANNER_SETTINGS_UNRECORDED,
    ArbiterGpusDeclared,
    ArbiterReducer,
    ClusterSpec,
    ExpandGeneration,
    GapRatioPlanner,
    GpusReleased,
    GpusRequested,
    GrantGpus,
    PipelineRegistered,
    PlannerSettings,
    Priority,
    ProgressReported,
    RolloutOpened,
    planner_for,
)
from core.commands import Command
from core.errors import InvalidEvent
from core.vocabulary import AlertName
from tests.core.arbiter_helpers import active, gpus, register

TRAIN = Priority.ACTOR_TRAINING


def declared(n_gpus: int, settings: PlannerSettings | None) -> ArbiterReducer:
    """An arbiter whose planner is the one ``settings`` record (None: recorded none)."""
    arbiter = ArbiterReducer()
    arbiter.step(ArbiterGpusDeclared(t=0.0, gpus=gpus(n_gpus), planner=settings))
    return arbiter


def request(pipeline: str, t: float, priority: Priority = TRAIN) -> GpusRequested:
    return GpusRequested(t=t, pipeline=pipeline, cluster="train", priority=priority)


def release(pipeline: str, t: float) -> GpusReleased:
    return GpusReleased(t=t, pipeline=pipeline, cluster="train")


def report(arbiter: ArbiterReducer, pipeline: str, t: float, target: int, completed: int) -> None:
    arbiter.step(
        ProgressReported(
            t=t,
            pipeline=pipeline,
            stream="main",
            target_trajectories=target,
            completed_trajectories=completed,
        )
    )


def grants(commands: list[Command]) -> list[GrantGpus]:
    return [c for c in commands if isinstance(c, GrantGpus)]


# --- the generation rate ------------------------------------------------------------------------


def woken_before_a_report(settings: PlannerSettings | None) -> ArbiterReducer:
    """p1 generates on GPU 0 alone for 9 s (p2 trains on 1-3), then on all four for 1 s, and has
    completed 10 trajectories by its report at t=10: 13 awake GPU-seconds."""
    arbiter = declared(4, settings)
    register(arbiter, "p2", train=["1", "2", "3"])
    register(arbiter, "p1", generation=gpus(4))
    arbiter.step(request("p2", 0.0))
    arbiter.step(RolloutOpened(t=0.0, pipeline="p1"))
    report(arbiter, "p1", 0.0, 1000, 0)
    assert active(arbiter, "p1") == [0]
    arbiter.step(release("p2", 9.0))
    assert active(arbiter, "p1") == [0, 1, 2, 3]
    report(arbiter, "p1", 10.0, 1000, 10)
    return arbiter


def test_a_rate_sample_divides_by_the_gpu_seconds_its_span_had_awake() -> None:
    arbiter = woken_before_a_report(PlannerSettings())
    rate = arbiter.state.pipelines["p1"].trajectories_per_gpu_s
    assert rate == pytest.approx(10 / 13)  # not 10 / (10 s x 4 GPUs)
    # The next span starts at the report, with all four awake.
    report(arbiter, "p1", 20.0, 1000, 50)
    sample = 40 / (10 * 4)
    assert arbiter.state.pipelines["p1"].trajectories_per_gpu_s == pytest.approx(
        rate + 0.2 * (sample - rate)
    )


def test_a_shrink_mid_span_counts_the_gpu_seconds_before_it() -> None:
    arbiter = declared(4, PlannerSettings())
    register(arbiter, "p2", train=["1", "2", "3"])
    register(arbiter, "p1", generation=gpus(4))
    arbiter.step(RolloutOpened(t=0.0, pipeline="p1"))
    report(arbiter, "p1", 0.0, 1000, 0)
    assert active(arbiter, "p1") == [0, 1, 2, 3]
    arbiter.step(request("p2", 2.0))  # ranks 1-3 sleep after 2 s
    assert active(arbiter, "p1") == [0]
    report(arbiter, "p1", 10.0, 1000, 14)  # 2 s x 4 + 8 s x 1 = 16 GPU-seconds
    assert arbiter.state.pipelines["p1"].trajectories_per_gpu_s == pytest.approx(14 / 16)


def test_a_log_that_recorded_no_settings_measures_rates_as_when_it_was_written() -> None:
    arbiter = woken_before_a_report(None)
    assert arbiter.state.pipelines["p1"].trajectories_per_gpu_s == pytest.approx(10 / (10 * 4))


# --- holders that overstay ----------------------------------------------------------------------


def holder_with_long_steps(settings: PlannerSettings) -> ArbiterReducer:
    """ "trainer" holds GPU 0 for 1200 s per step, twice; its third step starts at t=3000.
    "high" (INITIALIZATION) needs GPUs 0-1 and waits from t=3001; "low" needs 1-2."""
    arbiter = declared(3, settings)
    register(arbiter, "trainer", train=["0"])
    register(arbiter, "high", train=["0", "1"])
    register(arbiter, "low", train=["1", "2"])
    for start in (0.0, 1500.0, 3000.0):
        arbiter.step(request("trainer", start))
        if start < 3000.0:
            arbiter.step(release("trainer", start + 1200.0))
    assert arbiter.state.pipelines["trainer"].clusters["train"].holds_s == (1200.0, 1200.0)
    arbiter.step(request("high", 3001.0, Priority.INITIALIZATION))
    assert grants(arbiter.step(request("low", 3002.0, Priority.VALUE_COMPUTE))) == []
    return arbiter


def test_a_long_ordinary_training_step_does_not_let_lower_requests_pass() -> None:
    # 1300 s into a step (past the old flat 600 s), well within 3 x its 1200 s steps: "high"
    # still reserves GPU 1 and "low" waits; when "trainer" lets go, "high" goes first.
    arbiter = holder_with_long_steps(PlannerSettings())
    assert grants(arbiter.step(Tick(t=4300.0))) == []
    commands = arbiter.step(release("trainer", 4301.0))
    assert [(g.pipeline, g.cluster) for g in grants(commands)] == [("high", "train")]
    assert not [c for c in commands if isinstance(c, RaiseAlert)]


def test_a_holder_past_its_own_measured_holds_lets_lower_requests_pass_and_says_so() -> None:
    arbiter = holder_with_long_steps(PlannerSettings())
    assert grants(arbiter.step(Tick(t=6599.0))) == []  # held 3599 s < 3 x 1200 s
    commands = arbiter.step(Tick(t=6600.0))
    (grant,) = grants(commands)
    assert (grant.pipeline, grant.cluster) == ("low", "train")
    assert "ahead of high/train (INITIALIZATION), which waits for trainer/train" in grant.reason
    assert "holding GPUs for 3600s" in grant.reason
    assert "3 x its longest recent hold 1200s" in grant.reason
    (alert,) = [c for c in commands if isinstance(c, RaiseAlert)]
    assert (alert.alert, alert.subject) == (AlertName.HOLDER_OVERSTAYING, "trainer/train")
    assert "high/train (INITIALIZATION) waits for them" in alert.reason
    # Raised once, resolved when the holder lets go.
    assert not [c for c in arbiter.step(Tick(t=6700.0)) if isinstance(c, RaiseAlert)]
    commands = arbiter.step(release("trainer", 6800.0))
    resolved = [c for c in commands if isinstance(c, ResolveAlert)]
    assert [(c.alert, c.subject) for c in resolved] == [
        (AlertName.HOLDER_OVERSTAYING, "trainer/train")
    ]
    assert arbiter.state.overstaying == frozenset()


def test_a_holder_with_no_measured_hold_overstays_only_past_reserve_s() -> None:
    for settings, passes_at in ((PlannerSettings(), 3600.0), (PLANNER_SETTINGS_UNRECORDED, 600.0)):
        arbiter = declared(3, settings)
        register(arbiter, "trainer", train=["0"])
        register(arbiter, "high", train=["0", "1"])
        register(arbiter, "low", train=["1", "2"])
        arbiter.step(request("trainer", 0.0))
        arbiter.step(request("high", 1.0, Priority.INITIALIZATION))
        arbiter.step(request("low", 2.0, Priority.VALUE_COMPUTE))
        assert grants(arbiter.step(Tick(t=passes_at - 1.0))) == []
        (grant,) = grants(arbiter.step(Tick(t=passes_at)))
        assert grant.pipeline == "low"
        assert f"past reserve_s {passes_at:.0f}s" in grant.reason


def test_a_short_measured_hold_is_judged_with_reserve_min_s() -> None:
    settings = PlannerSettings(reserve_min_s=100.0)
    arbiter = declared(3, settings)
    register(arbiter, "trainer", train=["0"])
    register(arbiter, "high", train=["0", "1"])
    register(arbiter, "low", train=["1", "2"])
    arbiter.step(request("trainer", 0.0))
    arbiter.step(release("trainer", 5.0))
    arbiter.step(request("trainer", 10.0))
    arbiter.step(request("high", 11.0, Priority.INITIALIZATION))
    arbiter.step(request("low", 12.0, Priority.VALUE_COMPUTE))
    assert grants(arbiter.step(Tick(t=109.0))) == []  # 3 x 5 s is 15 s; at least 100 s
    assert [g.pipeline for g in grants(arbiter.step(Tick(t=110.0)))] == ["low"]


# --- the settings: checked, recorded, replayed ---------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("hysteresis", -0.1),
        ("move_cost_s", -1.0),
        ("reserve_s", 0.0),
        ("reserve_s", -5.0),
        ("reserve_factor", 0.5),
        ("reserve_min_s", -1.0),
        ("stale_after_s", 0.0),
        ("step_weight", -1.0),
    ],
)
def test_bad_planner_parameters_are_refused_naming_the_field(field: str, value: float) -> None:
    with pytest.raises(InvalidEvent, match=field):
        GapRatioPlanner(**{field: value})  # type: ignore[arg-type]
    with pytest.raises(InvalidEvent, match=f"PlannerSettings.{field}"):
        PlannerSettings(**{field: value})  # type: ignore[arg-type]


def test_reserve_s_none_means_a_holder_never_overstays() -> None:
    arbiter = declared(3, PlannerSettings(reserve_s=None))
    register(arbiter, "trainer", train=["0"])
    register(arbiter, "high", train=["0", "1"])
    register(arbiter, "low", train=["1", "2"])
    arbiter.step(request("trainer", 0.0))
    arbiter.step(request("high", 1.0, Priority.INITIALIZATION))
    arbiter.step(request("low", 2.0, Priority.VALUE_COMPUTE))
    assert grants(arbiter.step(Tick(t=1e7))) == []


def test_the_recorded_settings_decide_and_survive_the_log() -> None:
    settings = PlannerSettings(hysteresis=0.25, move_cost_s=10.0, reserve_s=50.0)
    event = ArbiterGpusDeclared(t=0.0, gpus=gpus(3), planner=settings)
    assert decode(encode(event)) == event
    arbiter = ArbiterReducer()
    arbiter.step(event)
    assert arbiter.state.planner == settings
    assert decode(encode(arbiter.state)) == arbiter.state
    assert planner_for(settings) == GapRatioPlanner(
        hysteresis=0.25, move_cost_s=10.0, reserve_s=50.0
    )
    register(arbiter, "trainer", train=["0"])
    register(arbiter, "high", train=["0", "1"])
    register(arbiter, "low", train=["1", "2"])
    arbiter.step(request("trainer", 0.0))
    arbiter.step(request("high", 1.0, Priority.INITIALIZATION))
    arbiter.step(request("low", 2.0, Priority.VALUE_COMPUTE))
    assert [g.pipeline for g in grants(arbiter.step(Tick(t=50.0)))] == ["low"]


def test_an_old_log_without_settings_replays_with_those_of_its_time() -> None:
    # As a log written before deo recorded the planner's settings holds the declaration.
    old = decode({"@": "ArbiterGpusDeclared", "t": 0.0, "gpus": ["0", "1"]})
    arbiter = ArbiterReducer()
    arbiter.step(old)
    assert arbiter.state.planner is None
    assert planner_for(None) == GapRatioPlanner(
        hysteresis=0.1, move_cost_s=30.0, reserve_s=600.0, reserve_factor=None, step_weight=0.0
    )
    assert planner_for(PlannerSettings(name="rlix")).name == "rlix"


def test_declaring_the_same_gpus_again_replaces_the_settings() -> None:
    arbiter = declared(2, PlannerSettings())
    changed = PlannerSettings(reserve_s=120.0)
    assert arbiter.step(ArbiterGpusDeclared(t=1.0, gpus=gpus(2), planner=changed)) == []
    assert arbiter.state.planner == changed


# --- reasons ------------------------------------------------------------------------------------


def test_reasons_say_gpu_seconds_only_once_a_rate_is_measured() -> None:
    arbiter = declared(2, PlannerSettings())
    register(arbiter, "p1", generation=gpus(2), tp=2)
    commands = arbiter.step(
        GpusRequested(
            t=0.0, pipeline="p1", cluster="gen", priority="GENERATION", estimate_trajectories=600
        )
    )
    (expand,) = [c for c in commands if isinstance(c, ExpandGeneration)]
    assert "GPU-s" not in expand.reason
    assert "600 trajectories remaining, weight 1200 (rate not measured yet: R x tp)" in (
        expand.reason
    )


def test_deo_keeps_an_overstaying_holder_among_its_alerts_until_it_lets_go() -> None:
    reducer = Reducer(check_invariants=True)
    reducer.step(Configured(t=0.0, config=Config(gpus=gpus(2))))
    reducer.step(ArbiterGpusDeclared(t=0.0, gpus=gpus(2), planner=PlannerSettings(reserve_s=10.0)))
    for name, mapping in (("stuck", ["0"]), ("high", ["0", "1"])):
        spec = ClusterSpec(name="train", kind=TRAIN, device_mapping=mapping)
        reducer.step(PipelineRegistered(t=0.0, pipeline=name, clusters=[spec]))
    reducer.step(request("stuck", 0.0))
    reducer.step(request("high", 1.0, Priority.INITIALIZATION))
    reducer.step(Tick(t=9.0))
    assert (AlertName.HOLDER_OVERSTAYING, "stuck/train") not in reducer.state.alerts
    reducer.step(Tick(t=10.0))
    assert (AlertName.HOLDER_OVERSTAYING, "stuck/train") in reducer.state.alerts
    reducer.step(release("stuck", 11.0))
    assert (AlertName.HOLDER_OVERSTAYING, "stuck/train") not in reducer.state.alerts
