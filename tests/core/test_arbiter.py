"""The arbiter's core, transition by transition: registration, priorities, the gap ratio, the
fixes to rlix's rule, bad input, and plans refused by the plan checks."""

from __future__ import annotations

import attrs
import pytest

from core import GpuLost, RaiseAlert, Tick, decode, encode
from core.arbiter import (
    ArbiterGpusDeclared,
    ArbiterReducer,
    ArbiterState,
    ClusterRegistered,
    ClusterSpec,
    ExpandGeneration,
    GapRatioPlanner,
    GpuOp,
    GpusReleased,
    GpusReleasedAndRequested,
    GpusRequested,
    GrantGpus,
    PipelineRegistered,
    PipelineUnregistered,
    Plan,
    Priority,
    ProgressCleared,
    ProgressReported,
    RankOp,
    RequestFailed,
    RlixPlanner,
    RolloutClosed,
    RolloutOpened,
    ShrinkGeneration,
    plan_violations,
    reduce_arbiter,
    state_violations,
)
from core.commands import Command
from core.errors import InvalidEvent, Refused, UnknownSubject
from core.events import Event
from core.vocabulary import AlertName
from tests.core.arbiter_helpers import active, gpus, held, make_arbiter, register

GEN = Priority.GENERATION
TRAIN = Priority.ACTOR_TRAINING


def gen_request(pipeline: str, t: float = 1.0, estimate: int | None = None) -> GpusRequested:
    return GpusRequested(
        t=t, pipeline=pipeline, cluster="gen", priority=GEN, estimate_trajectories=estimate
    )


def train_request(pipeline: str, t: float = 1.0, priority: Priority = TRAIN) -> GpusRequested:
    return GpusRequested(t=t, pipeline=pipeline, cluster="train", priority=priority)


def grants(commands: list[Command]) -> list[tuple[str, str]]:
    return [(c.pipeline, c.cluster) for c in commands if isinstance(c, GrantGpus)]


def progress(pipeline: str, target: int, completed: int, stream: str = "main") -> ProgressReported:
    return ProgressReported(
        t=1.0,
        pipeline=pipeline,
        stream=stream,
        target_trajectories=target,
        completed_trajectories=completed,
    )


def two_pipelines_sharing(n: int = 4) -> ArbiterReducer:
    arbiter = make_arbiter(n)
    register(arbiter, "p1", train=gpus(n), generation=gpus(n))
    register(arbiter, "p2", train=gpus(n), generation=gpus(n))
    return arbiter


# --- the PR's scenario: durable demand ---------------------------------------------------------


def test_two_pipelines_preempted_to_zero_split_the_gpus_as_soon_as_both_ask() -> None:
    # 4 GPUs, both pipelines generate on all four; p1's training preempts both to zero.
    arbiter = two_pipelines_sharing()
    for p in ("p1", "p2"):
        arbiter.step(RolloutOpened(t=1.0, pipeline=p))
        arbiter.step(gen_request(p))
    arbiter.step(train_request("p1", t=2.0))
    assert held(arbiter, "p1") == list(gpus(4))
    assert active(arbiter, "p1") == active(arbiter, "p2") == []
    # p2 asks while training still holds everything: it waits; nobody reported progress.
    assert grants(arbiter.step(gen_request("p2", t=3.0))) == []
    # Training releases and p1 asks for generation in one step: both are answered at once, 2/2.
    commands = arbiter.step(
        GpusReleasedAndRequested(
            t=4.0, pipeline="p1", release_cluster="train", cluster="gen", priority=GEN
        )
    )
    assert sorted(grants(commands)) == [("p1", "gen"), ("p2", "gen")]
    assert len(active(arbiter, "p1")) == len(active(arbiter, "p2")) == 2


def test_a_generation_request_is_answered_only_once_a_rank_is_awake() -> None:
    arbiter = make_arbiter(2)
    register(arbiter, "p1", train=gpus(2))
    register(arbiter, "p2", generation=gpus(2))
    arbiter.step(train_request("p1"))
    commands = arbiter.step(gen_request("p2", t=2.0))
    assert grants(commands) == [] and active(arbiter, "p2") == []
    commands = arbiter.step(GpusReleased(t=3.0, pipeline="p1", cluster="train"))
    assert grants(commands) == [("p2", "gen")]
    woken = [c for c in commands if isinstance(c, ExpandGeneration)]
    # The wake comes before the answer, and the answer names the awake GPUs.
    assert commands.index(woken[0]) < [type(c) for c in commands].index(GrantGpus)
    answer = next(c for c in commands if isinstance(c, GrantGpus))
    assert set(answer.gpus) == set(gpus(2))


# --- priorities and preemption -----------------------------------------------------------------


def test_non_generation_requests_are_served_by_priority_then_arrival() -> None:
    arbiter = make_arbiter(2)
    register(arbiter, "holder", train=gpus(2))
    for name in ("a", "b", "c"):
        register(arbiter, name, train=gpus(2))
    arbiter.step(train_request("holder"))
    arbiter.step(train_request("a", t=2.0, priority=Priority.REF_LOG_PROBS))
    arbiter.step(train_request("b", t=3.0, priority=Priority.CRITIC_TRAINING))
    arbiter.step(train_request("c", t=4.0, priority=Priority.CRITIC_TRAINING))
    order = []
    for holder in ("holder", "b", "c", "a"):
        commands = arbiter.step(GpusReleased(t=5.0, pipeline=holder, cluster="train"))
        order += [p for p, _ in grants(commands)]
    # CRITIC_TRAINING (2) before REF_LOG_PROBS (4); b before c (FIFO within a priority).
    assert order == ["b", "c", "a"]


def test_a_higher_priority_request_reserves_its_gpus_against_lower_ones() -> None:
    arbiter = make_arbiter(2)
    register(arbiter, "holder", train=["0"])
    register(arbiter, "high", train=gpus(2))
    register(arbiter, "low", train=["1"])
    arbiter.step(train_request("holder"))
    arbiter.step(train_request("high", priority=Priority.INITIALIZATION))
    # GPU 1 is idle, but "high" waits for it: "low" must not jump the queue.
    assert grants(arbiter.step(train_request("low", priority=Priority.VALUE_COMPUTE))) == []
    commands = arbiter.step(GpusReleased(t=2.0, pipeline="holder", cluster="train"))
    assert grants(commands) == [("high", "train")]


def test_a_holder_that_never_releases_holds_up_only_the_requests_that_need_its_gpus() -> None:
    # "stuck" holds GPU 0 and never lets go. "high" needs GPUs 0-1 and waits; "low" needs only
    # GPUs 1-2, which are free. "high" reserves GPU 1 against "low" until "stuck" has held
    # GPU 0 for reserve_s; then "low" is served from the GPUs "stuck" does not hold.
    arbiter = make_arbiter(3, planner=GapRatioPlanner(reserve_s=100.0))
    register(arbiter, "stuck", train=["0"])
    register(arbiter, "high", train=["0", "1"])
    register(arbiter, "low", train=["1", "2"])
    register(arbiter, "later", train=["0"])
    arbiter.step(train_request("stuck", t=1.0))
    arbiter.step(train_request("high", t=2.0, priority=Priority.INITIALIZATION))
    assert grants(arbiter.step(train_request("low", t=3.0, priority=Priority.VALUE_COMPUTE))) == []
    assert grants(arbiter.step(Tick(t=100.0))) == []  # held 99 s: "high" still reserves
    assert grants(arbiter.step(Tick(t=101.0))) == [("low", "train")]
    assert held(arbiter, "low") == ["1", "2"]
    # "high" still waits for GPU 0 and for "low" to let go; once "stuck" lets go, "high"
    # reserves again: a later, lower request for GPU 0 does not jump it.
    arbiter.step(train_request("later", t=102.0, priority=Priority.VALUE_COMPUTE))
    assert grants(arbiter.step(GpusReleased(t=103.0, pipeline="stuck", cluster="train"))) == []
    assert held(arbiter, "later") == []
    commands = arbiter.step(GpusReleased(t=104.0, pipeline="low", cluster="train"))
    assert grants(commands) == [("high", "train")]


def test_a_request_blocked_by_its_own_pipeline_holds_up_nobody() -> None:
    # "stuck" asks for training while its own critic holds GPU 0 and never releases: it waits,
    # but reserves nothing, so "other" is not queued behind it forever.
    arbiter = make_arbiter(2)
    register(arbiter, "stuck", train=gpus(2))
    arbiter.step(
        ClusterRegistered(
            t=0.0,
            pipeline="stuck",
            spec=ClusterSpec(name="critic", kind=Priority.CRITIC_TRAINING, device_mapping=("0",)),
        )
    )
    register(arbiter, "other", train=["1"])
    arbiter.step(
        GpusRequested(t=1.0, pipeline="stuck", cluster="critic", priority=Priority.CRITIC_TRAINING)
    )
    assert grants(arbiter.step(train_request("stuck", t=2.0))) == []
    assert grants(arbiter.step(train_request("other", t=3.0))) == [("other", "train")]


def test_a_training_request_that_must_wait_shrinks_no_generation() -> None:
    # deo: no shrink that serves nobody; rlix as published shrinks anyway (and later re-expands).
    for planner, shrinks in ((GapRatioPlanner(), False), (RlixPlanner(), True)):
        arbiter = make_arbiter(4, planner=planner)
        register(arbiter, "holder", train=["0"])
        register(arbiter, "p1", train=gpus(4))
        register(arbiter, "p2", generation=["1", "2", "3"])
        arbiter.step(train_request("holder"))
        arbiter.step(gen_request("p2", estimate=10))
        assert active(arbiter, "p2") == [0, 1, 2]
        commands = arbiter.step(train_request("p1", t=2.0))
        shrunk = any(isinstance(c, ShrinkGeneration) for c in commands)
        assert shrunk is shrinks, planner.name


def test_training_and_an_asleep_engine_share_a_gpu() -> None:
    arbiter = make_arbiter(2)
    register(arbiter, "p1", train=gpus(2), generation=gpus(2))
    arbiter.step(gen_request("p1"))
    assert active(arbiter, "p1") == [0, 1]
    commands = arbiter.step(train_request("p1", t=2.0))
    assert [type(c) for c in commands] == [ShrinkGeneration, GrantGpus]
    # The engine's ranks are asleep on the GPUs the training cluster holds: allowed.
    assert held(arbiter, "p1") == ["0", "1"] and active(arbiter, "p1") == []
    assert state_violations(arbiter.state) == []


# --- the gap ratio -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("remaining", "tp", "expected"),
    [
        # 8 GPUs, tp 1: rho = 300/400, 100/400 -> 6 and 2 GPUs
        ((300, 100), (1, 1), (6, 2)),
        # equal work -> 4 and 4
        ((50, 50), (1, 1), (4, 4)),
        # w = R * tp: 100*2 vs 100*1 -> rho 2/3, 1/3 of 8 = 5.33, 2.67 -> bundles: 6 (3 x 2) and 2
        ((100, 100), (2, 1), (6, 2)),
        # tiny share still gets its one-bundle floor: 1000 vs 1 -> 7 and 1
        ((1000, 1), (1, 1), (7, 1)),
    ],
)
def test_generation_gpus_follow_remaining_work(
    remaining: tuple[int, int], tp: tuple[int, int], expected: tuple[int, int]
) -> None:
    arbiter = make_arbiter(8)
    for name, r, size in zip(("p1", "p2"), remaining, tp, strict=True):
        register(arbiter, name, generation=gpus(8), tp=size)
        arbiter.step(progress(name, target=r, completed=0))
        arbiter.step(RolloutOpened(t=1.0, pipeline=name))
    got = tuple(len(active(arbiter, p)) * s for p, s in zip(("p1", "p2"), tp, strict=True))
    assert got == expected


def test_shares_show_each_pipelines_demand_target_and_awake_gpus() -> None:
    arbiter = make_arbiter(8)
    for name, remaining in (("p1", 300), ("p2", 100)):
        register(arbiter, name, generation=gpus(8))
        arbiter.step(progress(name, target=remaining, completed=0))
        arbiter.step(RolloutOpened(t=1.0, pipeline=name))
    shares = GapRatioPlanner().shares(arbiter.state)
    assert [(s.remaining, s.target_gpus, s.active_gpus) for s in shares.values()] == [
        (300, 6, 6),
        (100, 2, 2),
    ]


def test_progress_is_latest_wins_and_moves_gpus() -> None:
    arbiter = make_arbiter(4)
    for name in ("p1", "p2"):
        register(arbiter, name, generation=gpus(4))
        arbiter.step(RolloutOpened(t=1.0, pipeline=name))
    assert len(active(arbiter, "p1")) == len(active(arbiter, "p2")) == 2
    arbiter.step(progress("p1", target=100, completed=0))
    arbiter.step(progress("p2", target=100, completed=97))  # p2 is almost done: 100 vs 3
    assert (len(active(arbiter, "p1")), len(active(arbiter, "p2"))) == (3, 1)
    arbiter.step(progress("p2", target=100, completed=0))  # a later report replaces it
    assert len(active(arbiter, "p1")) == len(active(arbiter, "p2")) == 2
    arbiter.step(ProgressCleared(t=2.0, pipeline="p2"))
    # With no progress and an open rollout p2 counts one trajectory: 100 vs 1 -> 3 and 1.
    assert (len(active(arbiter, "p1")), len(active(arbiter, "p2"))) == (3, 1)


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


def test_the_generation_rate_is_measured_from_progress_over_awake_gpu_seconds() -> None:
    arbiter = make_arbiter(2)
    register(arbiter, "p1", generation=gpus(2))
    arbiter.step(RolloutOpened(t=0.0, pipeline="p1"))
    report(arbiter, "p1", 0.0, 1000, 0)
    report(arbiter, "p1", 2.0, 1000, 8)  # too short a span for a sample
    assert arbiter.state.pipelines["p1"].trajectories_per_gpu_s is None
    report(arbiter, "p1", 10.0, 1000, 40)  # 40 trajectories on 2 GPUs in 10 s
    assert arbiter.state.pipelines["p1"].trajectories_per_gpu_s == pytest.approx(2.0)
    report(arbiter, "p1", 20.0, 1000, 40)  # no progress: no sample, the span grows
    report(arbiter, "p1", 30.0, 1000, 80)  # 40 in 20 s on 2 GPUs: 1.0, smoothed
    assert arbiter.state.pipelines["p1"].trajectories_per_gpu_s == pytest.approx(
        2.0 + 0.2 * (1.0 - 2.0)
    )
    arbiter.step(ProgressCleared(t=31.0, pipeline="p1"))
    report(arbiter, "p1", 40.0, 1000, 10)  # fewer than at the mark: a new rollout, a new mark
    assert arbiter.state.pipelines["p1"].trajectories_per_gpu_s == pytest.approx(1.8)


def test_generation_follows_remaining_gpu_seconds_not_trajectories() -> None:
    # Same remaining trajectories, but p1's GPUs turn them out twice as fast: p2 needs twice the
    # GPU-seconds and gets twice the GPUs (rlix's ratio would split 3 and 3).
    arbiter = make_arbiter(6)
    for name in ("p1", "p2"):
        register(arbiter, name, generation=gpus(6))
        arbiter.step(RolloutOpened(t=0.0, pipeline=name))
        report(arbiter, name, 0.0, 1000, 0)
    assert len(active(arbiter, "p1")) == len(active(arbiter, "p2")) == 3
    report(arbiter, "p1", 10.0, 1000, 60)  # 2 trajectories per GPU-second
    report(arbiter, "p2", 10.0, 1030, 30)  # 1 per GPU-second, 1000 left as p1
    assert (len(active(arbiter, "p1")), len(active(arbiter, "p2"))) == (2, 4)


def test_a_generating_rank_moves_only_when_the_move_pays() -> None:
    # Targets say 3 and 1 (100 against 60 GPU-seconds of work on 4 GPUs), but moving a rank
    # from p2 to p1 would make p2 the one to finish last, later than p1 finishes now.
    arbiter = make_arbiter(4)
    for name, target in (("p1", 120), ("p2", 80)):
        register(arbiter, name, generation=gpus(4))
        arbiter.step(RolloutOpened(t=0.0, pipeline=name))
        report(arbiter, name, 0.0, target, 0)
    assert len(active(arbiter, "p1")) == len(active(arbiter, "p2")) == 2
    report(arbiter, "p1", 10.0, 120, 20)
    report(arbiter, "p2", 10.0, 80, 20)
    shares = GapRatioPlanner().shares(arbiter.state)
    assert [s.target_gpus for s in shares.values()] == [3, 1]
    assert len(active(arbiter, "p1")) == len(active(arbiter, "p2")) == 2


def test_a_move_gaining_less_than_a_minute_is_not_made_by_default() -> None:
    # After their reports p1 has 270 GPU-seconds left and p2 60, on 2 GPUs each (targets 3 and
    # 1): moving a rank shortens the longer finish from 135 s to 90 s. 45 s pays for a wake, a
    # sleep and the lost trajectories (about 12 s) but not for the preemption the rank meets when
    # its host's training comes back: the default waits for a gain of 60 s.
    for planner, after in (
        (GapRatioPlanner(), (2, 2)),
        (GapRatioPlanner(move_cost_s=30.0), (3, 1)),
    ):
        arbiter = make_arbiter(4, planner=planner)
        for name in ("p1", "p2"):
            register(arbiter, name, generation=gpus(4))
            arbiter.step(RolloutOpened(t=0.0, pipeline=name))
            report(arbiter, name, 0.0, 290, 0)
        assert len(active(arbiter, "p1")) == len(active(arbiter, "p2")) == 2
        report(arbiter, "p1", 10.0, 290, 20)  # 1 trajectory per GPU-second, 270 left
        report(arbiter, "p2", 10.0, 80, 20)  # the same rate, 60 left
        shares = planner.shares(arbiter.state)
        assert [s.target_gpus for s in shares.values()] == [3, 1]
        assert (len(active(arbiter, "p1")), len(active(arbiter, "p2"))) == after, planner


def test_generation_wakes_first_where_no_other_pipeline_trains() -> None:
    # Each pipeline trains on its own half; generation may run anywhere. p2's first ranks go to
    # its own half, where only its own training (after it has released generation) takes them.
    arbiter = make_arbiter(4)
    register(arbiter, "p1", train=["0", "1"], generation=gpus(4))
    register(arbiter, "p2", train=["2", "3"], generation=gpus(4))
    arbiter.step(RolloutOpened(t=0.0, pipeline="p1"))
    report(arbiter, "p1", 0.0, 100, 0)
    assert active(arbiter, "p1") == [0, 1, 2, 3]
    arbiter.step(RolloutOpened(t=1.0, pipeline="p2"))
    report(arbiter, "p2", 1.0, 100, 0)
    assert active(arbiter, "p1") == [0, 1] and active(arbiter, "p2") == [2, 3]


def test_targets_never_exceed_max_dp_size_and_the_rest_goes_to_others() -> None:
    arbiter = make_arbiter(4)
    register(arbiter, "small", generation=gpus(4), max_dp=1)
    register(arbiter, "big", generation=gpus(4))
    arbiter.step(progress("small", 1000, 0))
    arbiter.step(progress("big", 1, 0))
    arbiter.step(RolloutOpened(t=1.0, pipeline="small"))
    arbiter.step(RolloutOpened(t=1.0, pipeline="big"))
    assert len(active(arbiter, "small")) == 1 and len(active(arbiter, "big")) == 3


def test_an_awake_pipeline_without_demand_gives_its_gpus_up() -> None:
    # rlix cannot see a pipeline with no progress and no request: its GPUs stay with it.
    arbiter = make_arbiter(2)
    register(arbiter, "idler", generation=gpus(2))
    register(arbiter, "worker", generation=gpus(2))
    arbiter.step(gen_request("idler"))
    arbiter.step(RolloutClosed(t=2.0, pipeline="idler"))  # no request, no rollout, awake
    assert active(arbiter, "idler") == [0, 1]
    commands = arbiter.step(gen_request("worker", t=3.0))
    assert grants(commands) == [("worker", "gen")]
    assert active(arbiter, "worker") == [0, 1] and active(arbiter, "idler") == []


def test_a_request_without_estimate_or_progress_is_answered() -> None:
    for planner, answered in ((GapRatioPlanner(), True), (RlixPlanner(), False)):
        arbiter = make_arbiter(2, planner=planner)
        register(arbiter, "p1", generation=gpus(2))
        assert bool(grants(arbiter.step(gen_request("p1")))) is answered, planner.name


def test_a_pipeline_with_no_work_left_gets_no_floor() -> None:
    arbiter = make_arbiter(2)
    register(arbiter, "done", generation=gpus(2))
    register(arbiter, "busy", generation=gpus(2))
    arbiter.step(progress("done", 10, 10))
    arbiter.step(RolloutOpened(t=1.0, pipeline="done"))
    arbiter.step(progress("busy", 10, 0))
    arbiter.step(RolloutOpened(t=1.0, pipeline="busy"))
    assert active(arbiter, "done") == [] and active(arbiter, "busy") == [0, 1]


def test_tp_bundles_are_woken_whole() -> None:
    arbiter = make_arbiter(4)
    register(arbiter, "p1", generation=gpus(4), tp=2)
    commands = arbiter.step(gen_request("p1"))
    woken = next(c for c in commands if isinstance(c, ExpandGeneration))
    assert woken.ranks == (0, 1) and woken.gpus == ("0", "1", "2", "3")


# --- release, release-then-request, leaving, faults ---------------------------------------------


def test_release_then_request_is_all_or_nothing() -> None:
    arbiter = make_arbiter(2)
    register(arbiter, "p1", train=gpus(2), generation=gpus(2))
    arbiter.step(train_request("p1"))
    before = arbiter.state
    bad = GpusReleasedAndRequested(
        t=2.0, pipeline="p1", release_cluster="train", cluster="gen", priority=TRAIN
    )
    with pytest.raises(Refused, match="GENERATION"):
        arbiter.step(bad)
    assert arbiter.state is before and held(arbiter, "p1") == ["0", "1"]


def test_releasing_generation_puts_every_rank_to_sleep_and_ends_the_rollout() -> None:
    arbiter = make_arbiter(2)
    register(arbiter, "p1", generation=gpus(2))
    arbiter.step(RolloutOpened(t=1.0, pipeline="p1"))
    assert active(arbiter, "p1") == [0, 1]
    commands = arbiter.step(GpusReleased(t=2.0, pipeline="p1", cluster="gen"))
    assert [(type(c), c.ranks) for c in commands if isinstance(c, ShrinkGeneration)] == [
        (ShrinkGeneration, (0, 1))
    ]
    assert active(arbiter, "p1") == [] and not arbiter.state.pipelines["p1"].rollout_open
    assert arbiter.state.idle == frozenset(gpus(2))


def test_an_unregistered_pipeline_frees_everything() -> None:
    arbiter = make_arbiter(4)
    register(arbiter, "p1", train=["0", "1"], generation=["2", "3"])
    register(arbiter, "p2", generation=gpus(4))
    arbiter.step(train_request("p1"))
    for p in ("p1", "p2"):
        arbiter.step(RolloutOpened(t=1.0, pipeline=p))
    assert len(active(arbiter, "p1")) == len(active(arbiter, "p2")) == 1
    commands = arbiter.step(PipelineUnregistered(t=2.0, pipeline="p1"))
    assert "p1" not in arbiter.state.pipelines
    assert active(arbiter, "p2") == [0, 1, 2, 3]
    assert any(isinstance(c, ShrinkGeneration) and c.pipeline == "p1" for c in commands)


def test_a_lost_gpu_sleeps_its_ranks_and_fails_requests_that_need_it() -> None:
    arbiter = make_arbiter(2)
    register(arbiter, "holder", train=["1"])
    register(arbiter, "p1", train=gpus(2), generation=gpus(2))
    arbiter.step(train_request("holder"))
    arbiter.step(gen_request("p1"))
    arbiter.step(train_request("p1", t=2.0))  # waits for GPU 1
    commands = arbiter.step(GpuLost(t=3.0, gpu_id="0", error="fell off the bus"))
    assert [type(c) for c in commands] == [ShrinkGeneration, RequestFailed]
    assert arbiter.state.pipelines["p1"].clusters["train"].request is None
    assert "0" not in arbiter.state.idle and state_violations(arbiter.state) == []
    with pytest.raises(Refused, match="lost"):
        arbiter.step(train_request("p1", t=4.0))


def test_a_gpu_outside_the_inventory_being_lost_is_ignored() -> None:
    arbiter = make_arbiter(2)
    register(arbiter, "p1", train=gpus(2), generation=gpus(2))
    arbiter.step(gen_request("p1"))
    before = arbiter.state
    # deo's reducer reads the same stream and may lose GPUs the arbiter does not manage.
    assert arbiter.step(GpuLost(t=3.0, gpu_id="7", error="fell off the bus")) == []
    assert arbiter.state == attrs.evolve(before, now=3.0)


# --- bad input --------------------------------------------------------------------------------


def spec(name: str = "train", mapping: tuple[str, ...] = ("0",)) -> ClusterSpec:
    return ClusterSpec(name=name, kind=TRAIN, device_mapping=mapping)


@pytest.mark.parametrize(
    ("event", "error", "words"),
    [
        (gen_request("nobody"), UnknownSubject, "unknown pipeline 'nobody'"),
        (
            GpusRequested(t=1.0, pipeline="p1", cluster="critic", priority=TRAIN),
            UnknownSubject,
            "no cluster 'critic'",
        ),
        (PipelineRegistered(t=1.0, pipeline="p1"), Refused, "already registered"),
        (
            ClusterRegistered(t=1.0, pipeline="p1", spec=spec()),
            Refused,
            "p1/train is already registered",
        ),
        (
            ClusterRegistered(t=1.0, pipeline="p1", spec=spec("critic", ("0", "9"))),
            UnknownSubject,
            r"outside the inventory.*\['9'\]",
        ),
        (
            ClusterRegistered(
                t=1.0,
                pipeline="p1",
                spec=ClusterSpec(name="gen2", kind=GEN, device_mapping=("0",)),
            ),
            Refused,
            "already has a generation cluster",
        ),
        (train_request("p1", priority=GEN), Refused, "cannot ask with priority GENERATION"),
        (
            GpusRequested(t=1.0, pipeline="p1", cluster="gen", priority=TRAIN),
            Refused,
            "GENERATION is for generation clusters only",
        ),
        (ArbiterGpusDeclared(t=1.0, gpus=("0",)), Refused, "already declared"),
        (progress("ghost", 1, 0), UnknownSubject, "ghost"),
    ],
)
def test_bad_input_is_refused_and_changes_nothing(
    event: Event, error: type[Exception], words: str
) -> None:
    arbiter = make_arbiter(2)
    register(arbiter, "p1", train=gpus(2), generation=gpus(2))
    before = arbiter.state
    with pytest.raises(error, match=words):
        arbiter.step(event)
    assert arbiter.state is before


def test_a_second_request_or_a_request_while_holding_is_refused() -> None:
    arbiter = make_arbiter(2)
    register(arbiter, "holder", train=gpus(2))
    register(arbiter, "p1", train=gpus(2))
    arbiter.step(train_request("holder"))
    arbiter.step(train_request("p1"))
    with pytest.raises(Refused, match="already has a waiting request"):
        arbiter.step(train_request("p1"))
    with pytest.raises(Refused, match="already holds"):
        arbiter.step(train_request("holder"))


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"device_mapping": ()}, "at least one GPU"),
        ({"device_mapping": ("0", "0")}, "twice"),
        ({"device_mapping": ("0", "1", "2"), "tp_size": 2}, "bundles of tp_size=2"),
        ({"tp_size": 0}, "tp_size must be >= 1"),
        ({"kind": "SOMETHING"}, "kind must be one of"),
    ],
)
def test_malformed_cluster_specs_name_what_is_wrong(kwargs: dict[str, object], words: str) -> None:
    fields: dict[str, object] = {"name": "gen", "kind": GEN, "device_mapping": ("0", "1")}
    with pytest.raises(InvalidEvent, match=words):
        ClusterSpec(**{**fields, **kwargs})  # type: ignore[arg-type]


def test_priorities_are_spelt_by_name_or_number() -> None:
    by_name = GpusRequested(t=0.0, pipeline="p", cluster="c", priority="critic_training")
    by_number = GpusRequested(t=0.0, pipeline="p", cluster="c", priority=2)
    assert by_name == by_number and by_name.priority is Priority.CRITIC_TRAINING


# --- plans refused by the checks ---------------------------------------------------------------


@attrs.frozen
class FixedPlanner:
    """A planner that always proposes the same plan (to test the checks)."""

    proposal: Plan
    name: str = "fixed"

    def plan(self, state: ArbiterState) -> Plan:
        return self.proposal


def test_a_plan_that_breaks_an_invariant_is_refused_with_an_alert() -> None:
    double = Plan(
        grants=(
            GpuOp(pipeline="p1", cluster="train", gpus=("0", "1"), reason="bad"),
            GpuOp(pipeline="p2", cluster="train", gpus=("0", "1"), reason="bad"),
        )
    )
    arbiter = make_arbiter(2)
    register(arbiter, "p1", train=gpus(2))
    register(arbiter, "p2", train=gpus(2))
    arbiter.planner = FixedPlanner(double)
    before = arbiter.state
    commands = arbiter.step(train_request("p1"))
    assert len(commands) == 1 and isinstance(commands[0], RaiseAlert)
    assert commands[0].alert is AlertName.PLAN_REFUSED
    assert "10: GPU 0 held by 2 clusters" in commands[0].reason
    assert arbiter.state is before


def checked_state() -> ArbiterState:
    """p1: training on 0-1 (held); p2: generation on 0-3 with ranks 2, 3 awake, max dp 2."""
    arbiter = make_arbiter(5)
    register(arbiter, "p1", train=["0", "1"])
    register(arbiter, "p2", generation=gpus(4), max_dp=2)
    arbiter.step(train_request("p1"))
    arbiter.step(gen_request("p2"))
    assert held(arbiter, "p1") == ["0", "1"] and active(arbiter, "p2") == [2, 3]
    return arbiter.state


def free(p: str, c: str, *g: str) -> GpuOp:
    return GpuOp(pipeline=p, cluster=c, gpus=g, reason="test")


def ranks(p: str, c: str, *r: int) -> RankOp:
    return RankOp(pipeline=p, cluster=c, ranks=r, reason="test")


@pytest.mark.parametrize(
    ("plan", "number"),
    [
        (Plan(shrinks=(ranks("p2", "gen", 2), ranks("p2", "gen", 3))), "1"),
        (Plan(shrinks=(ranks("p1", "train", 0),)), "2"),
        (Plan(frees=(free("p2", "gen", "2"),)), "2"),
        (Plan(removed=(("p2", "gen"),), expands=(ranks("p2", "gen", 0),)), "3"),
        (Plan(shrinks=(ranks("p2", "gen", 0),)), "5"),
        (Plan(expands=(ranks("p2", "gen", 2),)), "5"),
        (Plan(grants=(free("p1", "train", "0", "1", "4"),)), "6"),
        (Plan(expands=(ranks("p2", "gen", 7),)), "6"),
        (Plan(frees=(free("p1", "train", "0", "1", "2"),)), "9"),
        (Plan(expands=(ranks("p2", "gen", 1),)), "7"),
        (Plan(expands=(ranks("p2", "gen", 0),)), "10"),
        (Plan(shrinks=(ranks("ghost", "gen", 0),)), "11"),
        (Plan(removed=(("p9", "x"),)), "11"),
    ],
)
def test_each_plan_check_catches_its_violation(plan: Plan, number: str) -> None:
    state = checked_state()
    found = plan_violations(state, plan)
    assert any(v.startswith(f"{number}:") for v in found), found


def test_bookkeeping_checks_catch_a_wrong_idle_set() -> None:
    state = checked_state()
    assert plan_violations(state, Plan()) == []
    assert any(v.startswith("4:") for v in state_violations(attrs.evolve(state, idle={"0"})))
    assert any(v.startswith("8:") for v in state_violations(attrs.evolve(state, idle=set())))


def test_expanding_onto_a_lost_gpu_is_refused() -> None:
    state = attrs.evolve(checked_state(), lost=frozenset({"4"}))
    arbiter = make_arbiter(5)
    register(arbiter, "p1", generation=["3", "4"])
    state = attrs.evolve(arbiter.state, lost=frozenset({"4"}), idle=frozenset(gpus(4)))
    found = plan_violations(state, Plan(expands=(ranks("p1", "gen", 1),)))
    assert any(v.startswith("12:") for v in found), found


# --- log round trip and replay -----------------------------------------------------------------


def scripted_events() -> list[Event]:
    def c(p: str, name: str, kind: Priority, mapping: tuple[str, ...], tp: int = 1) -> Event:
        cluster = ClusterSpec(name=name, kind=kind, device_mapping=mapping, tp_size=tp)
        return ClusterRegistered(t=0.0, pipeline=p, spec=cluster)

    return [
        ArbiterGpusDeclared(t=0.0, gpus=gpus(4)),
        PipelineRegistered(t=0.0, pipeline="p1"),
        c("p1", "train", TRAIN, gpus(2)),
        c("p1", "gen", GEN, gpus(4), tp=2),
        PipelineRegistered(t=0.0, pipeline="p2"),
        c("p2", "gen", GEN, gpus(4)),
        RolloutOpened(t=1.0, pipeline="p1"),
        progress("p2", 50, 10),
        gen_request("p2", t=2.0),
        train_request("p1", t=3.0),
        GpuLost(t=4.0, gpu_id="3", error="xid 79"),
        GpusReleasedAndRequested(
            t=5.0, pipeline="p1", release_cluster="train", cluster="gen", priority=GEN
        ),
        ProgressCleared(t=6.0, pipeline="p2", stream="main"),
        PipelineUnregistered(t=7.0, pipeline="p2"),
    ]


def test_events_and_commands_round_trip_and_replay_the_same() -> None:
    arbiter = ArbiterReducer()
    first = []
    for event in scripted_events():
        assert decode(encode(event)) == event
        commands = arbiter.step(event)
        for command in commands:
            assert decode(encode(command)) == command
        first.append(commands)
        assert state_violations(arbiter.state) == []
    state = ArbiterState()
    for event, expected in zip(scripted_events(), first, strict=True):
        state, commands = reduce_arbiter(state, decode(encode(event)))
        assert commands == expected
    assert state == arbiter.state
    # A snapshot of the state survives the log encoding too.
    assert decode(encode(state)) == state


def test_a_silent_pipeline_keeps_one_probe_bundle_at_most_and_only_for_a_while() -> None:
    arbiter = make_arbiter(4)
    register(arbiter, "hung", generation=gpus(4))
    register(arbiter, "live", generation=gpus(4))
    arbiter.step(RolloutOpened(t=0.0, pipeline="hung"))
    arbiter.step(
        ProgressReported(
            t=0.0,
            pipeline="hung",
            stream="main",
            target_trajectories=1000,
            completed_trajectories=0,
        )
    )
    assert active(arbiter, "hung") == [0, 1, 2, 3]

    def live_reports(t: float, completed: int) -> list[Command]:
        return arbiter.step(
            ProgressReported(
                t=t,
                pipeline="live",
                stream="main",
                target_trajectories=1000,
                completed_trajectories=completed,
            )
        )

    arbiter.step(RolloutOpened(t=30.0, pipeline="live"))
    live_reports(30.0, 0)
    assert len(active(arbiter, "hung")) == 2  # within 60 s: an equal share
    # 61 s silent, woken 61 s ago: it is a donor with target 0.
    commands = live_reports(61.0, 1)
    assert active(arbiter, "hung") == [] and len(active(arbiter, "live")) == 4
    assert any("hung/gen is above its target of 0" in c.reason for c in commands)
    live_reports(100.0, 2)
    assert active(arbiter, "hung") == []  # its next probe: 120 s after the last wake
    live_reports(121.0, 3)
    assert len(active(arbiter, "hung")) == 1  # one bundle, not a share
    live_reports(182.0, 4)
    assert active(arbiter, "hung") == []
    # A sign of life ends it: a fresh report brings an equal share back.
    arbiter.step(
        ProgressReported(
            t=183.0,
            pipeline="hung",
            stream="main",
            target_trajectories=1000,
            completed_trajectories=0,
        )
    )
    assert len(active(arbiter, "hung")) == 2
