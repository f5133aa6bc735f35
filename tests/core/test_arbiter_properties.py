"""Property tests of the arbiter: arbitrary sequences of registrations, requests, releases,
progress reports and faults (a GPU lost between plans, a pipeline that never releases its
training GPUs), time passing, right and deliberately wrong.

After every step: no plan was refused (deo's planner never proposes a plan that breaks a plan
invariant), the state keeps the invariants, a generation request with an awake rank has been
answered, no non-generation grant jumped a waiting request of higher priority on the same GPUs
(unless a holder that does not let go blocks that request), no request waits for free GPUs
except behind a higher request that reserves them, and every command survives the log
encoding. At teardown: the accepted events replay to the same commands, and each waiting request
is answered once everyone else lets go (liveness over bounded sequences), unless the pipeline
that never releases holds what it needs.
"""

from __future__ import annotations

from typing import Any

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from core import GpuLost, RaiseAlert, Tick, decode, encode
from core.arbiter import (
    ArbiterGpusDeclared,
    ArbiterReducer,
    ArbiterState,
    ClusterRegistered,
    ClusterSpec,
    ExpandGeneration,
    GapRatioPlanner,
    GpusReleased,
    GpusReleasedAndRequested,
    GpusRequested,
    GrantGpus,
    PipelineRegistered,
    PipelineUnregistered,
    Planner,
    PlannerSettings,
    Priority,
    ProgressCleared,
    ProgressReported,
    RolloutClosed,
    RolloutOpened,
    ShrinkGeneration,
    reduce_arbiter,
    state_violations,
)
from core.commands import Command
from core.errors import DeoError
from core.events import Event
from core.vocabulary import AlertName

STUBBORN = "stubborn"
#: The state machine's planner stops a blocked request's reservation after this many seconds
#: of a holder that does not let go (each rule advances time by a second; a rule skips more).
RESERVE_S = 5.0
NAMES = st.sampled_from(["p0", "p1", "p2", STUBBORN])
NON_GENERATION = st.sampled_from([p for p in Priority if p is not Priority.GENERATION])


class ArbiterMachine(RuleBasedStateMachine):
    """Drives :class:`ArbiterReducer` with deo's planner; ``stubborn`` never releases training."""

    #: The planner under test.
    planner: Planner = GapRatioPlanner(reserve_s=RESERVE_S, reserve_min_s=RESERVE_S)

    def __init__(self) -> None:
        super().__init__()
        self.arbiter = ArbiterReducer(planner=self.planner)
        self.gpus: tuple[str, ...] = ()
        self.t = 0.0
        self.accepted: list[tuple[Event, list[Command]]] = []

    # --- helpers ------------------------------------------------------------------------------

    def step(self, event: Event) -> list[Command]:
        before = self.arbiter.state
        commands = self.arbiter.step(event)
        self.accepted.append((event, commands))
        refused = [
            c for c in commands if isinstance(c, RaiseAlert) and c.alert is AlertName.PLAN_REFUSED
        ]
        assert not refused, refused[0].reason
        for command in commands:
            assert decode(encode(command)) == command
        self.check_priorities(before, commands)
        self.check_shrinks_serve_someone(event, commands)
        return commands

    def refused(self, event: Event) -> None:
        before = self.arbiter.state
        try:
            self.arbiter.step(event)
        except DeoError:
            assert self.arbiter.state is before
        else:
            raise AssertionError(f"{event!r} was accepted")

    def tick(self) -> float:
        self.t += 1.0
        return self.t

    def check_priorities(self, before: ArbiterState, commands: list[Command]) -> None:
        after = self.arbiter.state
        for grant in commands:
            if not isinstance(grant, GrantGpus) or grant.priority is Priority.GENERATION:
                continue
            for pipeline_id, cluster in after.clusters():
                request = cluster.request
                if request is None or cluster.spec.is_generation:
                    continue
                own = {g for c in after.pipelines[pipeline_id].clusters.values() for g in c.held}
                if own & set(cluster.spec.device_mapping):
                    continue  # it waits for its own pipeline to release, and reserves nothing
                if _overstayed(after, pipeline_id, cluster.spec.name):
                    continue  # a holder that does not let go blocks it: it reserves nothing
                overlap = set(cluster.spec.device_mapping) & set(grant.gpus)
                assert not (overlap and request.priority < grant.priority), (
                    f"{grant.pipeline}/{grant.cluster} ({grant.priority.name}) granted while"
                    f" {pipeline_id}/{cluster.spec.name} ({request.priority.name}) waits on"
                    f" {sorted(overlap)}"
                )

    def check_shrinks_serve_someone(self, event: Event, commands: list[Command]) -> None:
        """Generation is put to sleep only when its GPUs go to someone in the same step, or
        the event itself asks for it (a release, a pipeline leaving, a lost GPU)."""
        taken = {
            g
            for c in commands
            if isinstance(c, ExpandGeneration)
            or (isinstance(c, GrantGpus) and c.priority is not Priority.GENERATION)
            for g in c.gpus
        }
        for shrink in commands:
            if not isinstance(shrink, ShrinkGeneration):
                continue
            leaving = GpusReleased | GpusReleasedAndRequested | PipelineUnregistered
            if isinstance(event, leaving) and event.pipeline == shrink.pipeline:
                continue
            if isinstance(event, GpuLost) and event.gpu_id in shrink.gpus:
                continue
            assert set(shrink.gpus) & taken, f"{shrink} serves nobody"

    def pipelines(self) -> list[str]:
        return sorted(self.arbiter.state.pipelines)

    def mapping(self, data: st.DataObject, tp: int) -> tuple[str, ...]:
        bundles = data.draw(st.integers(1, len(self.gpus) // tp))
        chosen = data.draw(st.permutations(self.gpus))[: bundles * tp]
        return tuple(chosen)

    # --- rules --------------------------------------------------------------------------------

    @initialize(n=st.integers(2, 8))
    def declare(self, n: int) -> None:
        self.gpus = tuple(str(i) for i in range(n))
        self.step(ArbiterGpusDeclared(t=0.0, gpus=self.gpus, planner=PlannerSettings()))

    @rule(name=NAMES, data=st.data(), tp=st.sampled_from([1, 1, 2]))
    def register(self, name: str, data: st.DataObject, tp: int) -> None:
        if name in self.arbiter.state.pipelines:
            self.refused(PipelineRegistered(t=self.tick(), pipeline=name))
            return
        tp = min(tp, len(self.gpus))
        t = self.tick()
        self.step(PipelineRegistered(t=t, pipeline=name))
        train = ClusterSpec(
            name="train", kind=Priority.ACTOR_TRAINING, device_mapping=self.mapping(data, 1)
        )
        self.step(ClusterRegistered(t=t, pipeline=name, spec=train))
        if data.draw(st.booleans()):
            critic = ClusterSpec(
                name="critic", kind=Priority.CRITIC_TRAINING, device_mapping=self.mapping(data, 1)
            )
            self.step(ClusterRegistered(t=t, pipeline=name, spec=critic))
        gen = ClusterSpec(
            name="gen",
            kind=Priority.GENERATION,
            device_mapping=self.mapping(data, tp),
            tp_size=tp,
            max_dp_size=data.draw(st.none() | st.integers(1, 4)),
        )
        self.step(ClusterRegistered(t=t, pipeline=name, spec=gen))

    @precondition(lambda self: self.arbiter.state.pipelines)
    @rule(data=st.data(), estimate=st.none() | st.integers(0, 500))
    def request_generation(self, data: st.DataObject, estimate: int | None) -> None:
        name = data.draw(st.sampled_from(self.pipelines()))
        cluster = self.arbiter.state.pipelines[name].clusters["gen"]
        event = GpusRequested(
            t=self.tick(),
            pipeline=name,
            cluster="gen",
            priority=Priority.GENERATION,
            estimate_trajectories=estimate,
        )
        if cluster.request is not None or not _servable(self.arbiter.state, name, "gen"):
            self.refused(event)
        else:
            self.step(event)

    @precondition(lambda self: self.arbiter.state.pipelines)
    @rule(data=st.data(), priority=NON_GENERATION)
    def request_training(self, data: st.DataObject, priority: Priority) -> None:
        name = data.draw(st.sampled_from(self.pipelines()))
        clusters = self.arbiter.state.pipelines[name].clusters
        which = data.draw(st.sampled_from(sorted(c for c in clusters if c != "gen")))
        cluster = clusters[which]
        event = GpusRequested(t=self.tick(), pipeline=name, cluster=which, priority=priority)
        busy = cluster.request is not None or cluster.held
        if busy or not _servable(self.arbiter.state, name, which):
            self.refused(event)
        else:
            self.step(event)

    @precondition(lambda self: self.arbiter.state.pipelines)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        name = data.draw(st.sampled_from(self.pipelines()))
        clusters = sorted(self.arbiter.state.pipelines[name].clusters)
        which = data.draw(st.sampled_from(clusters))
        if name == STUBBORN and which != "gen":
            return  # it never releases its training GPUs
        self.step(GpusReleased(t=self.tick(), pipeline=name, cluster=which))

    @precondition(lambda self: self.arbiter.state.pipelines)
    @rule(data=st.data())
    def release_training_then_request_generation(self, data: st.DataObject) -> None:
        candidates = [p for p in self.pipelines() if p != STUBBORN]
        if not candidates:
            return
        name = data.draw(st.sampled_from(candidates))
        event = GpusReleasedAndRequested(
            t=self.tick(),
            pipeline=name,
            release_cluster="train",
            cluster="gen",
            priority=Priority.GENERATION,
        )
        gen = self.arbiter.state.pipelines[name].clusters["gen"]
        if gen.request is not None or not _servable(self.arbiter.state, name, "gen"):
            self.refused(event)
        else:
            self.step(event)

    @precondition(lambda self: self.arbiter.state.pipelines)
    @rule(
        data=st.data(),
        stream=st.sampled_from(["a", "b"]),
        trajectories=st.integers(0, 300),
        completed=st.integers(0, 400),
    )
    def report_progress(
        self, data: st.DataObject, stream: str, trajectories: int, completed: int
    ) -> None:
        name = data.draw(st.sampled_from(self.pipelines()))
        self.step(
            ProgressReported(
                t=self.tick(),
                pipeline=name,
                stream=stream,
                target_trajectories=trajectories,
                completed_trajectories=completed,
            )
        )

    @precondition(lambda self: self.arbiter.state.pipelines)
    @rule(data=st.data(), stream=st.none() | st.sampled_from(["a", "b"]))
    def clear_progress(self, data: st.DataObject, stream: str | None) -> None:
        name = data.draw(st.sampled_from(self.pipelines()))
        self.step(ProgressCleared(t=self.tick(), pipeline=name, stream=stream))

    @precondition(lambda self: self.arbiter.state.pipelines)
    @rule(data=st.data(), opened=st.booleans())
    def rollout(self, data: st.DataObject, opened: bool) -> None:
        name = data.draw(st.sampled_from(self.pipelines()))
        kind = RolloutOpened if opened else RolloutClosed
        self.step(kind(t=self.tick(), pipeline=name))

    @precondition(lambda self: self.arbiter.state.pipelines)
    @rule(data=st.data())
    def unregister(self, data: st.DataObject) -> None:
        candidates = [p for p in self.pipelines() if p != STUBBORN]
        if candidates:
            name = data.draw(st.sampled_from(candidates))
            self.step(PipelineUnregistered(t=self.tick(), pipeline=name))

    @rule(seconds=st.sampled_from([1.0, RESERVE_S]))
    def time_passes(self, seconds: float) -> None:
        self.t += seconds
        self.step(Tick(t=self.t))

    @precondition(lambda self: len(self.arbiter.state.lost) < 2)
    @rule(data=st.data())
    def lose_a_gpu(self, data: st.DataObject) -> None:
        gpu = data.draw(st.sampled_from(self.gpus))
        self.step(GpuLost(t=self.tick(), gpu_id=gpu, error="fell off the bus"))

    @rule(data=st.data())
    def wrong_input(self, data: st.DataObject) -> None:
        t = self.tick()
        spec = ClusterSpec(name="x", kind=Priority.VALUE_COMPUTE, device_mapping=("nope",))
        wrong: list[Event] = [
            GpusRequested(t=t, pipeline="ghost", cluster="gen", priority=Priority.GENERATION),
            GpusReleased(t=t, pipeline="ghost", cluster="train"),
            ProgressReported(
                t=t, pipeline="ghost", stream="a", target_trajectories=1, completed_trajectories=0
            ),
            ArbiterGpusDeclared(t=t, gpus=("other",)),
        ]
        for name in self.pipelines():
            wrong += [
                ClusterRegistered(t=t, pipeline=name, spec=spec),
                GpusRequested(t=t, pipeline=name, cluster="gen", priority=Priority.INITIALIZATION),
                GpusRequested(t=t, pipeline=name, cluster="train", priority=Priority.GENERATION),
                GpusReleased(t=t, pipeline=name, cluster="nope"),
            ]
        self.refused(data.draw(st.sampled_from(wrong)))

    # --- invariants ---------------------------------------------------------------------------

    @invariant()
    def state_is_sound(self) -> None:
        state = self.arbiter.state
        assert state_violations(state) == []
        for name in state.overstaying:  # alerted holders hold GPUs another request waits for
            pipeline_id, cluster = name.split("/")
            holder = state.pipelines[pipeline_id].clusters[cluster]
            assert holder.held, f"{name} is alerted as overstaying and holds nothing"
        for pipeline_id, other in state.clusters():
            assert all(hold_s >= 0 for hold_s in other.holds_s), (pipeline_id, other.holds_s)
        for pipeline in state.pipelines.values():
            assert pipeline.rate_gpu_s >= 0

    @invariant()
    def awake_generation_requests_are_answered(self) -> None:
        for pipeline_id, cluster in self.arbiter.state.clusters():
            if cluster.spec.is_generation and cluster.active_ranks:
                assert cluster.request is None, f"{pipeline_id} has ranks awake and still waits"

    @invariant()
    def nothing_waits_for_gpus_that_are_free(self) -> None:
        state = self.arbiter.state
        holders = {g for _, c in state.clusters() for g in c.held}
        awake = {g for _, c in state.clusters() for g in c.active_gpus()}
        waiting = [(p, c) for p, c in state.clusters() if c.request is not None]
        for pipeline_id, cluster in waiting:
            spec = cluster.spec
            where = f"{pipeline_id}/{spec.name}"
            if spec.is_generation:
                # Work-conserving: an idle bundle of its own is woken for it.
                for rank in range(spec.ranks):
                    assert not set(spec.bundle(rank)) <= state.idle, (
                        f"{where} waits, rank {rank} idle"
                    )
                continue
            mapping = set(spec.device_mapping)
            if mapping & (holders | state.lost):
                continue
            ahead = [
                f"{p}/{c.spec.name}"
                for p, c in waiting
                if c is not cluster
                and not c.spec.is_generation
                and c.request is not None
                and cluster.request is not None
                and (c.request.priority, c.request.seq)
                < (cluster.request.priority, cluster.request.seq)
                and set(c.spec.device_mapping) & mapping
                # One blocked by a holder that does not let go reserves nothing.
                and not _overstayed(state, p, c.spec.name)
            ]
            assert ahead, f"{where} waits for {sorted(mapping)}: idle or generation only ({awake})"

    def teardown(self) -> None:
        # Determinism: the accepted events, through the log, give the same commands again.
        state = ArbiterState()
        for event, commands in self.accepted:
            state, again = reduce_arbiter(state, decode(encode(event)), self.planner)
            assert again == commands, event
        assert state == self.arbiter.state
        self.check_liveness()

    def check_liveness(self) -> None:
        state = self.arbiter.state
        waiting = [(p, c) for p, c in state.clusters() if c.request is not None]
        for pipeline_id, cluster in waiting:
            name = cluster.spec.name
            drained = ArbiterReducer(state=state, planner=self.planner)
            answered = False
            for other_id, other in list(state.clusters()):
                if (other_id, other.spec.name) == (pipeline_id, name):
                    continue
                if other_id == STUBBORN and other.spec.name != "gen":
                    continue
                for command in drained.step(
                    GpusReleased(t=self.t, pipeline=other_id, cluster=other.spec.name)
                ):
                    answered |= isinstance(command, GrantGpus) and (
                        command.pipeline,
                        command.cluster,
                    ) == (pipeline_id, name)
            for other_id in state.pipelines:
                if other_id != pipeline_id:
                    drained.step(RolloutClosed(t=self.t, pipeline=other_id))
            left = drained.state.pipelines[pipeline_id].clusters[name]
            assert answered == (left.request is None)
            if answered:
                continue
            # The pipeline that never releases may have been granted more while others let go.
            stubborn = drained.state.pipelines.get(STUBBORN)
            blocked = set() if stubborn is None else _held_by(stubborn.clusters)
            spec = cluster.spec
            needs = (
                [set(spec.bundle(r)) for r in range(spec.ranks)]
                if spec.is_generation
                else [set(spec.device_mapping)]
            )
            assert all(need & (blocked | state.lost) for need in needs), (
                f"{pipeline_id}/{name} still waits with everyone else gone; stubborn holds"
                f" {sorted(blocked)}, lost {sorted(state.lost)}"
            )


def _overstayed(state: ArbiterState, pipeline_id: str, name: str) -> bool:
    """Whether the cluster's waiting request is blocked by another pipeline's holder that has
    held its GPUs past its limit (RESERVE_S while none of its holds is measured)."""
    mapping = set(state.pipelines[pipeline_id].clusters[name].spec.device_mapping)
    return any(
        other_id != pipeline_id
        and other.held_t is not None
        and state.now - other.held_t >= ArbiterMachine.planner.overstay_limit(other)[0]
        and mapping & set(other.held)
        for other_id, other in state.clusters()
    )


def _held_by(clusters: Any) -> set[str]:
    return {g for c in clusters.values() for g in c.held}


def _servable(state: ArbiterState, pipeline_id: str, name: str) -> bool:
    spec = state.pipelines[pipeline_id].clusters[name].spec
    if spec.is_generation:
        return any(not set(spec.bundle(r)) & state.lost for r in range(spec.ranks))
    return not set(spec.device_mapping) & state.lost


#: 60 sequences keep a default run short; a profile asking for more than hypothesis's default
#: 100 (`--hypothesis-profile=ci-long`: 150) gets its own count.
_EXAMPLES = 60 if settings.default.max_examples <= 100 else settings.default.max_examples

ArbiterMachine.TestCase.settings = settings(
    max_examples=_EXAMPLES,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestArbiterMachine = ArbiterMachine.TestCase
