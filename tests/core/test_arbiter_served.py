"""The arbiter inside deo's reducer (core.arbiter.served): its state in ``State.arbiter``, its
events through ``core.reduce``, a lost GPU and a tick shared with deo's reducer, its refused plans
as deo's ``plan_refused`` alert, and the state through the codec and a log snapshot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import pytest

from adapters.log import EventLog
from core import (
    Config,
    Configured,
    GpuLost,
    RaiseAlert,
    Reducer,
    ResolveAlert,
    State,
    Tick,
    UnknownSubject,
    decode,
    encode,
    reduce,
)
from core.arbiter import (
    ArbiterGpusDeclared,
    ClusterSpec,
    ExpandGeneration,
    GpusRequested,
    GrantGpus,
    PipelineRegistered,
    ShrinkGeneration,
)
from core.arbiter import reducer as arbiter_reducer
from core.arbiter.plan import RankOp
from core.arbiter.planner import GapRatioPlanner
from core.vocabulary import AlertName

GPUS = ("0", "1")
TRAIN = ClusterSpec(name="train", kind="ACTOR_TRAINING", device_mapping=["0"])
GEN = ClusterSpec(name="gen", kind="GENERATION", device_mapping=GPUS)


def serving(*, config_gpus: tuple[str, ...] = GPUS) -> Reducer:
    reducer = Reducer(check_invariants=True)
    reducer.step(Configured(t=0.0, config=Config(gpus=config_gpus)))
    reducer.step(ArbiterGpusDeclared(t=0.0, gpus=GPUS))
    reducer.step(PipelineRegistered(t=0.0, pipeline="p", clusters=[TRAIN, GEN]))
    return reducer


def test_a_state_without_arbiter_is_untouched_by_ticks() -> None:
    reducer = Reducer(check_invariants=True)
    reducer.step(Configured(t=0.0, config=Config(gpus=GPUS)))
    assert reducer.step(Tick(t=1.0)) == []
    assert reducer.state.arbiter.gpus == ()


def test_requests_are_planned_and_training_preempts_generation() -> None:
    reducer = serving()
    woken = reducer.step(GpusRequested(t=1.0, pipeline="p", cluster="gen", priority="GENERATION"))
    assert [type(c) for c in woken] == [ExpandGeneration, GrantGpus]
    taken = reducer.step(GpusRequested(t=2.0, pipeline="p", cluster="train", priority=1))
    assert [type(c) for c in taken] == [ShrinkGeneration, GrantGpus]
    assert taken[0].gpus == ("0",) and taken[1].gpus == ("0",)
    assert reducer.state.now == 2.0


def test_a_lost_gpu_reaches_both_cores() -> None:
    reducer = serving()
    reducer.step(GpusRequested(t=1.0, pipeline="p", cluster="gen", priority="GENERATION"))
    commands = reducer.step(GpuLost(t=2.0, gpu_id="1", error="fell off the bus"))
    assert reducer.state.gpus["1"].causes  # deo's own reducer cordoned it
    assert "1" in reducer.state.arbiter.lost
    assert any(isinstance(c, ShrinkGeneration) and c.ranks == (1,) for c in commands)


def test_bad_input_leaves_the_state_as_it_was() -> None:
    reducer = serving()
    before = reducer.state
    with pytest.raises(UnknownSubject):
        reducer.step(GpusRequested(t=1.0, pipeline="nope", cluster="gen", priority=6))
    outside = ClusterSpec(name="x", kind=1, device_mapping=["7"])
    with pytest.raises(UnknownSubject):
        reducer.step(PipelineRegistered(t=1.0, pipeline="q", clusters=[TRAIN, outside]))
    assert reducer.state is before


class _Broken(GapRatioPlanner):
    """Wakes a rank the cluster does not have (invariants 5 and 6)."""

    def plan(self, state: Any) -> Any:
        plan = super().plan(state)
        bad = RankOp(pipeline="p", cluster="gen", ranks=(7,), reason="a rank out of range")
        return attrs.evolve(plan, expands=(bad,))


def test_a_refused_plan_raises_plan_refused_once_it_runs_again_it_is_resolved(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    reducer = serving()
    monkeypatch.setattr(arbiter_reducer, "planner_for", lambda settings: _Broken())
    before = reducer.state.arbiter
    commands = reducer.step(GpusRequested(t=1.0, pipeline="p", cluster="gen", priority=6))
    assert [type(c) for c in commands] == [RaiseAlert]
    assert (AlertName.PLAN_REFUSED, "arbiter") in reducer.state.alerts
    assert reducer.state.arbiter.pipelines == before.pipelines  # nothing of it ran
    monkeypatch.undo()
    commands = reducer.step(GpusRequested(t=2.0, pipeline="p", cluster="gen", priority=6))
    assert isinstance(commands[-1], ResolveAlert)
    assert (AlertName.PLAN_REFUSED, "arbiter") not in reducer.state.alerts


def test_the_state_survives_the_codec_and_a_snapshot(tmp_path: Path) -> None:
    path = tmp_path / "deo.jsonl"
    log, _ = EventLog.open(path, fsync=False)
    reducer = Reducer(check_invariants=True)
    for event in (
        Configured(t=0.0, config=Config(gpus=GPUS)),
        ArbiterGpusDeclared(t=0.0, gpus=GPUS),
        PipelineRegistered(t=0.0, pipeline="p", clusters=[TRAIN, GEN]),
        GpusRequested(t=1.0, pipeline="p", cluster="gen", priority=6, estimate_trajectories=5),
        GpusRequested(t=2.0, pipeline="p", cluster="train", priority=1),
    ):
        log.record(reducer, event)
    state: State = reducer.state
    assert decode(encode(state)) == state
    log.snapshot(state)
    log.close()
    _, recovery = EventLog.open(path, fsync=False)
    assert recovery.state == state and recovery.state.arbiter.pipelines["p"].clusters[
        "train"
    ].held == ("0",)
    # The same events through reduce alone give the same state: a replay reproduces it.
    replayed = State()
    for event in (
        Configured(t=0.0, config=Config(gpus=GPUS)),
        ArbiterGpusDeclared(t=0.0, gpus=GPUS),
        PipelineRegistered(t=0.0, pipeline="p", clusters=[TRAIN, GEN]),
        GpusRequested(t=1.0, pipeline="p", cluster="gen", priority=6, estimate_trajectories=5),
        GpusRequested(t=2.0, pipeline="p", cluster="train", priority=1),
    ):
        replayed, _ = reduce(replayed, event)
    assert replayed == state
