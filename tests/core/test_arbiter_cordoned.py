"""Cordoned GPUs and the arbiter: a generation rank awake on one is its cluster's first to
shrink, and moves (sleeps there, another rank wakes) onto an idle healthy bundle of its cluster
when there is one; a training hold there stays, with an alert naming it."""

from __future__ import annotations

import attrs
from hypothesis import given, settings
from hypothesis import strategies as st

from core import (
    Config,
    Configured,
    GpuCordonRequested,
    GpuUncordonRequested,
    RaiseAlert,
    Reducer,
    ResolveAlert,
    Tick,
)
from core.arbiter import (
    ArbiterGpusDeclared,
    ArbiterReducer,
    ClusterSpec,
    ExpandGeneration,
    GpusReleased,
    GpusRequested,
    PipelineRegistered,
    Priority,
    ProgressReported,
    RolloutOpened,
    ShrinkGeneration,
    state_violations,
)
from core.commands import Command
from core.vocabulary import AlertName
from tests.core.arbiter_helpers import active, gpus, make_arbiter, register


def cordon(arbiter: ArbiterReducer, t: float, *cordoned: str) -> list[Command]:
    """deo's reducer tells the arbiter its cordons (``core.reducer``); the next plan sees them."""
    arbiter.state = attrs.evolve(arbiter.state, cordoned=frozenset(cordoned))
    return arbiter.step(Tick(t=t))


def ranks_of(commands: list[Command], kind: type) -> dict[str, tuple[int, ...]]:
    found: dict[str, tuple[int, ...]] = {}
    for command in commands:
        if isinstance(command, kind):
            found[command.pipeline] = found.get(command.pipeline, ()) + command.ranks
    return found


def test_a_rank_on_a_cordoned_gpu_moves_onto_an_idle_healthy_bundle() -> None:
    arbiter = make_arbiter(4)
    register(arbiter, "p", generation=gpus(4), max_dp=2)
    arbiter.step(RolloutOpened(t=1.0, pipeline="p"))
    assert active(arbiter, "p") == [0, 1]
    commands = cordon(arbiter, 2.0, "0")
    assert ranks_of(commands, ShrinkGeneration) == {"p": (0,)}
    assert ranks_of(commands, ExpandGeneration) == {"p": (2,)}
    assert active(arbiter, "p") == [1, 2]
    shrink = next(c for c in commands if isinstance(c, ShrinkGeneration))
    assert "cordoned" in shrink.reason and "rank 2 wakes in its place" in shrink.reason
    assert "0" in arbiter.state.idle  # unused (and, cordoned, no place for anything new)


def test_a_rank_on_a_cordoned_gpu_with_nowhere_to_go_keeps_generating() -> None:
    arbiter = make_arbiter(2)
    register(arbiter, "p", generation=gpus(2))
    arbiter.step(RolloutOpened(t=1.0, pipeline="p"))
    assert cordon(arbiter, 2.0, "0") == []
    assert active(arbiter, "p") == [0, 1]


def test_a_donor_gives_its_rank_on_a_cordoned_gpu_first() -> None:
    arbiter = make_arbiter(4)
    register(arbiter, "p1", generation=gpus(4))
    arbiter.step(RolloutOpened(t=1.0, pipeline="p1"))
    assert active(arbiter, "p1") == [0, 1, 2, 3]
    cordon(arbiter, 2.0, "3")
    assert active(arbiter, "p1") == [0, 1, 2, 3]  # alone: nothing better to do with GPU 3
    register(arbiter, "p2", generation=gpus(4), t=3.0)
    commands = arbiter.step(RolloutOpened(t=3.0, pipeline="p2"))
    shrunk = ranks_of(commands, ShrinkGeneration)["p1"]
    assert 3 in shrunk  # the cordoned rank goes, and before any healthy rank
    first = next(c for c in commands if isinstance(c, ShrinkGeneration))
    assert first.reason.startswith("GPUs ['3'] are cordoned") and "first to shrink" in first.reason
    assert len(shrunk) == 2 and active(arbiter, "p1") == [1, 2]  # one healthy rank given
    assert active(arbiter, "p2") and 3 not in active(arbiter, "p2")
    awake = [g for _, c in arbiter.state.clusters() for g in c.active_gpus()]
    assert "3" not in awake and state_violations(arbiter.state) == []


def test_a_training_hold_on_a_cordoned_gpu_stays_and_is_alerted() -> None:
    arbiter = make_arbiter(2)
    register(arbiter, "q", train=gpus(2))
    arbiter.step(GpusRequested(t=1.0, pipeline="q", cluster="train", priority=1))
    commands = cordon(arbiter, 2.0, "1")
    alerts = [c for c in commands if isinstance(c, RaiseAlert)]
    assert [(a.alert, a.subject) for a in alerts] == [(AlertName.HOLD_ON_CORDONED, "q/train")]
    assert "['1']" in alerts[0].reason
    assert arbiter.state.pipelines["q"].clusters["train"].held == ("0", "1")  # not revoked
    assert cordon(arbiter, 3.0, "1") == []  # raised once
    commands = arbiter.step(GpusReleased(t=4.0, pipeline="q", cluster="train"))
    resolved = [c for c in commands if isinstance(c, ResolveAlert)]
    assert [(r.alert, r.subject) for r in resolved] == [(AlertName.HOLD_ON_CORDONED, "q/train")]


def test_the_hold_alert_reaches_deos_alerts() -> None:
    reducer = Reducer(check_invariants=True)
    reducer.step(Configured(t=0.0, config=Config(gpus=("0", "1"))))
    reducer.step(ArbiterGpusDeclared(t=0.0, gpus=("0", "1")))
    train = ClusterSpec(name="train", kind="ACTOR_TRAINING", device_mapping=["0"])
    reducer.step(PipelineRegistered(t=0.0, pipeline="q", clusters=[train]))
    reducer.step(GpusRequested(t=1.0, pipeline="q", cluster="train", priority=1))
    reducer.step(GpuCordonRequested(t=2.0, gpu_id="0"))  # the operator's cordon
    reducer.step(Tick(t=3.0))
    assert (AlertName.HOLD_ON_CORDONED, "q/train") in reducer.state.alerts
    assert reducer.state.arbiter.pipelines["q"].clusters["train"].held == ("0",)
    reducer.step(GpuUncordonRequested(t=4.0, gpu_id="0"))
    reducer.step(Tick(t=5.0))
    assert (AlertName.HOLD_ON_CORDONED, "q/train") not in reducer.state.alerts


# --- the planner's property -------------------------------------------------------------------


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[ArbiterReducer, frozenset[str]]:
    """A few pipelines generating (and maybe training) on up to 6 GPUs, then some cordoned."""
    n = draw(st.integers(2, 6))
    arbiter = make_arbiter(n)
    names = [f"p{i}" for i in range(draw(st.integers(1, 3)))]
    for t, name in enumerate(names):
        tp = draw(st.sampled_from([1, 2] if n % 2 == 0 else [1]))
        mapping = draw(st.permutations(gpus(n)))
        train = draw(st.none() | st.lists(st.sampled_from(gpus(n)), min_size=1, unique=True))
        max_dp = draw(st.none() | st.integers(1, n // tp))
        register(arbiter, name, train=train, generation=mapping, tp=tp, max_dp=max_dp, t=t)
        arbiter.step(RolloutOpened(t=float(t), pipeline=name))
        target = draw(st.integers(1, 500))
        done = draw(st.integers(0, target))
        arbiter.step(
            ProgressReported(
                t=float(t),
                pipeline=name,
                stream="s",
                target_trajectories=target,
                completed_trajectories=done,
            )
        )
        if train is not None and draw(st.booleans()):
            arbiter.step(
                GpusRequested(
                    t=float(t), pipeline=name, cluster="train", priority=Priority.ACTOR_TRAINING
                )
            )
    cordoned = draw(st.frozensets(st.sampled_from(gpus(n)), min_size=1, max_size=n))
    return arbiter, cordoned


@settings(max_examples=150, deadline=None)
@given(scenarios())
def test_generation_leaves_cordoned_gpus_whenever_that_costs_no_healthy_rank(
    scenario: tuple[ArbiterReducer, frozenset[str]],
) -> None:
    arbiter, cordoned = scenario
    commands = cordon(arbiter, 100.0, *cordoned)
    state = arbiter.state
    assert state_violations(state) == []
    for command in commands:
        if isinstance(command, ExpandGeneration):
            assert not set(command.gpus) & cordoned, command.reason  # nothing new there
    for pipeline_id, cluster in state.clusters():
        spec = cluster.spec
        stuck = [r for r in cluster.active_ranks if set(spec.bundle(r)) & cordoned]
        if not stuck:
            continue
        # Still awake on a cordoned GPU: no idle healthy bundle of its own could take its place...
        for rank in range(spec.ranks):
            if rank not in cluster.active_ranks:
                assert not set(spec.bundle(rank)) <= state.idle - cordoned, (pipeline_id, rank)
        # ... and it gave no healthy rank to another pipeline in this plan.
        for command in commands:
            if isinstance(command, ShrinkGeneration) and command.pipeline == pipeline_id:
                assert "preempted" in command.reason or "cordoned" in command.reason, command.reason
    # Holds are never revoked; each one on a cordoned GPU is alerted.
    alerted = {c.subject for c in commands if isinstance(c, RaiseAlert)}
    for pipeline_id, cluster in state.clusters():
        if set(cluster.held) & cordoned:
            assert f"{pipeline_id}/{cluster.spec.name}" in alerted
