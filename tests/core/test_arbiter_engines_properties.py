"""Property tests of generation clusters run by deo's engine pools, under deo's invariants:
arbitrary registrations (with and without ``engine_pool``), requests, releases, rollouts and
unregistrations, beside a worker pool; engines that start, come up, crash, confirm or fail their
sleep and wake calls; GPUs lost, cordoned and uncordoned; time passing.

Every step runs through ``Reducer(check_invariants=True)``: no GPU ever has two live workers
that hold its memory (engine-run clusters of two pipelines may share GPUs: the engines beside
the one that holds a GPU sleep), no worker is started on a lost or cordoned GPU, no pool has
more workers than its ``max_workers``.
Beside them, after every step: a pool the arbiter does not run has no worker on the arbiter's
GPUs unless on its way out, nothing is granted or woken on a GPU deo has cordoned, and an event
the reducer refuses changes nothing.
"""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from core import (
    Config,
    Configured,
    EngineAsleep,
    EngineAwake,
    EngineLoadSampled,
    EngineSleepFailed,
    EngineWakeFailed,
    GpuCordonRequested,
    GpuLost,
    GpuUncordonRequested,
    PolicySpec,
    PoolSpec,
    Reducer,
    Tick,
    WorkerExited,
    WorkerReady,
    WorkerStarted,
    WorkerState,
)
from core.arbiter import (
    ArbiterGpusDeclared,
    ClusterSpec,
    ExpandGeneration,
    GpusReleased,
    GpusRequested,
    GrantGpus,
    PipelineRegistered,
    PipelineUnregistered,
    Priority,
    ProgressReported,
    RolloutClosed,
    RolloutOpened,
)
from core.errors import DeoError, InvariantViolation
from core.events import Event
from tests.core.arbiter_helpers import engine_pool

S = WorkerState
ARBITER_GPUS = ("0", "1", "2", "3")
#: A GPU outside the arbiter's: the worker pool's.
OWN_GPU = "4"
PIPELINES = st.sampled_from(["p0", "p1", "p2"])
MAPPINGS = st.lists(st.sampled_from(ARBITER_GPUS), min_size=1, max_size=4, unique=True)
LEAVING = frozenset({S.STOPPING, S.KILLED, S.DRAINING})


POOLS = [
    engine_pool(ports=(18000, 18007), max_workers=4, max_asleep=4, drain_timeout_s=5.0),
    # A second pool as large: two pipelines' engine-run clusters on the same GPUs.
    engine_pool(
        name="gen2", ports=(18200, 18207), max_workers=4, max_asleep=4, drain_timeout_s=5.0
    ),
    # Too small for a cluster of more than 2 ranks: registration must refuse those.
    engine_pool(name="small", ports=(18100, 18107), drain_timeout_s=5.0),
    PoolSpec(
        name="w",
        argv=["w"],
        gpus_per_worker=1,
        max_workers=2,
        policy=PolicySpec(name="static", params={"count": 2}),
    ),
]


class EngineClusterMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.reducer = Reducer(check_invariants=True)
        self.t = 0.0
        self.pid = 100

    def at(self, seconds: float = 1.0) -> float:
        self.t += seconds
        return self.t

    def feed(self, event: Event) -> None:
        before = self.reducer.state
        try:
            commands = self.reducer.step(event)
        except InvariantViolation:
            raise
        except DeoError:
            assert self.reducer.state is before  # refused: nothing half-applied
            return
        cordoned = self.reducer.state.arbiter.cordoned
        for command in commands:
            # (A generation grant answers with the ranks already awake: not something new.)
            new = isinstance(command, ExpandGeneration) or (
                isinstance(command, GrantGpus) and command.priority is not Priority.GENERATION
            )
            if new:
                assert not set(command.gpus) & cordoned, f"{command!r} on cordoned {cordoned}"

    def workers(self, *states: WorkerState) -> list[str]:
        return sorted(w.worker_id for w in self.reducer.state.workers.values() if w.state in states)

    @initialize()
    def configure(self) -> None:
        config = Config(pools=POOLS, gpus=(*ARBITER_GPUS, OWN_GPU))
        self.feed(Configured(t=0.0, config=config))
        self.feed(ArbiterGpusDeclared(t=0.0, gpus=ARBITER_GPUS))

    # --- the arbiter's callers -----------------------------------------------------------------

    @rule(
        pipeline=PIPELINES,
        train=MAPPINGS,
        gen=MAPPINGS,
        pool=st.sampled_from([None, "gen", "gen2", "small", "w"]),
    )
    def register(self, pipeline: str, train: list[str], gen: list[str], pool: str | None) -> None:
        clusters = [
            ClusterSpec(name="train", kind=Priority.ACTOR_TRAINING, device_mapping=train),
            ClusterSpec(name="gen", kind=Priority.GENERATION, device_mapping=gen, engine_pool=pool),
        ]
        self.feed(PipelineRegistered(t=self.at(), pipeline=pipeline, clusters=clusters))

    @rule(pipeline=PIPELINES, generation=st.booleans())
    def request(self, pipeline: str, generation: bool) -> None:
        cluster, priority = ("gen", 6) if generation else ("train", 1)
        self.feed(GpusRequested(t=self.at(), pipeline=pipeline, cluster=cluster, priority=priority))

    @rule(pipeline=PIPELINES, generation=st.booleans())
    def release(self, pipeline: str, generation: bool) -> None:
        cluster = "gen" if generation else "train"
        self.feed(GpusReleased(t=self.at(), pipeline=pipeline, cluster=cluster))

    @rule(pipeline=PIPELINES, opened=st.booleans(), left=st.integers(0, 100))
    def rollout(self, pipeline: str, opened: bool, left: int) -> None:
        if opened:
            self.feed(
                ProgressReported(
                    t=self.at(),
                    pipeline=pipeline,
                    stream="s",
                    target_trajectories=100,
                    completed_trajectories=100 - left,
                )
            )
            self.feed(RolloutOpened(t=self.at(), pipeline=pipeline))
        else:
            self.feed(RolloutClosed(t=self.at(), pipeline=pipeline))

    @rule(pipelines=st.permutations(["p0", "p1", "p2"]), gen=MAPPINGS, left=st.integers(1, 100))
    def share(self, pipelines: list[str], gen: list[str], left: int) -> None:
        """Two pipelines whose generation clusters, run by two engine pools, have the same GPUs
        both want them (the first more than the second)."""
        for pipeline, pool, wanted in ((pipelines[0], "gen", 100), (pipelines[1], "gen2", left)):
            spec = ClusterSpec(
                name="gen", kind=Priority.GENERATION, device_mapping=gen, engine_pool=pool
            )
            self.feed(PipelineRegistered(t=self.at(), pipeline=pipeline, clusters=[spec]))
            self.rollout(pipeline, opened=True, left=wanted)
            self.request(pipeline, generation=True)

    @rule()
    def settle(self) -> None:
        """Every worker takes its next step the way it goes when all is well: started, ready,
        out of routing, asleep or awake as asked, exited when stopped."""
        for worker_id in self.workers(*S):
            worker = self.reducer.state.workers.get(worker_id)
            if worker is None:
                continue
            t = self.at(0.1)
            if worker.state is S.REQUESTED:
                self.pid += 1
                self.feed(WorkerStarted(t=t, worker_id=worker_id, pid=self.pid, start_time=1))
            elif worker.state is S.STARTING:
                self.feed(WorkerReady(t=t, worker_id=worker_id))
            elif worker.state is S.GOING_TO_SLEEP:
                load = EngineLoadSampled(
                    t=t, pool=worker.pool, worker_id=worker_id, in_flight_requests=0
                )
                self.feed(load)
            elif worker.state is S.FALLING_ASLEEP:
                self.feed(EngineAsleep(t=t, worker_id=worker_id))
            elif worker.state is S.WAKING:
                self.feed(EngineAwake(t=t, worker_id=worker_id))
            elif worker.state in LEAVING:
                self.feed(WorkerExited(t=t, worker_id=worker_id, exit_code=0))

    @rule(pipeline=PIPELINES)
    def unregister(self, pipeline: str) -> None:
        self.feed(PipelineUnregistered(t=self.at(), pipeline=pipeline))

    # --- the workers and engines ---------------------------------------------------------------

    @rule(data=st.data())
    def start(self, data: st.DataObject) -> None:
        requested = self.workers(S.REQUESTED)
        if requested:
            worker_id = data.draw(st.sampled_from(requested))
            self.pid += 1
            self.feed(WorkerStarted(t=self.at(), worker_id=worker_id, pid=self.pid, start_time=1))

    @rule(data=st.data())
    def ready(self, data: st.DataObject) -> None:
        starting = self.workers(S.STARTING)
        if starting:
            self.feed(WorkerReady(t=self.at(), worker_id=data.draw(st.sampled_from(starting))))

    @rule(data=st.data(), crashed=st.booleans())
    def exit(self, data: st.DataObject, crashed: bool) -> None:
        live = [w for w in self.workers(*S) if w not in self.workers(S.REQUESTED, S.EXITED)]
        if live:
            worker_id = data.draw(st.sampled_from(live))
            self.feed(WorkerExited(t=self.at(0.1), worker_id=worker_id, exit_code=int(crashed)))

    @rule(data=st.data(), fails=st.booleans())
    def engine_calls(self, data: st.DataObject, fails: bool) -> None:
        """An engine leaving routing, answering its sleep call or its wake call."""
        going = self.workers(S.GOING_TO_SLEEP)
        falling = self.workers(S.FALLING_ASLEEP)
        waking = self.workers(S.WAKING)
        choices = going + falling + waking
        if not choices:
            return
        worker_id = data.draw(st.sampled_from(choices))
        t = self.at()
        if worker_id in going:
            pool = self.reducer.state.workers[worker_id].pool
            self.feed(EngineLoadSampled(t=t, pool=pool, worker_id=worker_id, in_flight_requests=0))
        elif worker_id in falling:
            if fails:
                self.feed(EngineSleepFailed(t=t, worker_id=worker_id, error="HTTP 500"))
            else:
                self.feed(EngineAsleep(t=t, worker_id=worker_id))
        elif fails:
            self.feed(EngineWakeFailed(t=t, worker_id=worker_id, error="HTTP 500"))
        else:
            self.feed(EngineAwake(t=t, worker_id=worker_id))

    # --- GPUs and time -------------------------------------------------------------------------

    @rule(gpu=st.sampled_from([*ARBITER_GPUS, OWN_GPU]))
    def lose(self, gpu: str) -> None:
        self.feed(GpuLost(t=self.at(), gpu_id=gpu, error="xid 79"))

    @rule(gpu=st.sampled_from([*ARBITER_GPUS, OWN_GPU]), cordon=st.booleans())
    def cordon(self, gpu: str, cordon: bool) -> None:
        event = GpuCordonRequested if cordon else GpuUncordonRequested
        self.feed(event(t=self.at(), gpu_id=gpu))

    @rule(seconds=st.sampled_from([1.0, 10.0, 400.0]))
    def tick(self, seconds: float) -> None:
        self.feed(Tick(t=self.at(seconds), interval_s=seconds))

    # --- properties ----------------------------------------------------------------------------

    @invariant()
    def only_the_arbiters_clusters_use_its_gpus(self) -> None:
        state = self.reducer.state
        bound = state.arbiter.engine_pools()
        for worker in state.workers.values():
            if worker.pool in bound or worker.state in LEAVING:
                continue
            on = set(worker.gpus) & set(ARBITER_GPUS)
            assert not on, f"{worker.worker_id} ({worker.state.value}) of unbound {worker.pool}"

    @invariant()
    def a_gpu_has_one_memory_holder_and_asleep_engines_beside_it(self) -> None:
        state = self.reducer.state
        on_gpu: dict[str, list[str]] = {}
        for worker in state.workers.values():
            for gpu in worker.gpus:
                on_gpu.setdefault(gpu, []).append(worker.worker_id)
        for gpu, ids in on_gpu.items():
            holding = [i for i in ids if state.workers[i].holds_memory]
            assert len(holding) <= 1, f"GPU {gpu}: {holding} hold its memory"
            if len(ids) > 1:
                pools = {state.workers[i].pool for i in ids}
                assert pools <= {"gen", "gen2", "small"}, f"GPU {gpu} shared by {ids}"


EngineClusterMachine.TestCase.settings = settings(
    max_examples=60 if settings.default.max_examples <= 100 else settings.default.max_examples,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestEngineClusterMachine = EngineClusterMachine.TestCase
