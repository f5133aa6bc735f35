"""A generation cluster run by a deo engine pool (core.arbiter.engines): one engine per rank on
its bundle, put to sleep and woken with the arbiter's shrinks and expansions."""

from __future__ import annotations

from typing import Any

import pytest

from core import (
    Command,
    Config,
    Configured,
    EngineAsleep,
    EngineAwake,
    EngineLoadSampled,
    EngineSleepFailed,
    GpuCordonRequested,
    GpuLost,
    GpuUncordonRequested,
    PolicySpec,
    PoolSpec,
    Reducer,
    Refused,
    Tick,
    UnknownSubject,
    WorkerExited,
    WorkerReady,
    WorkerStarted,
    WorkerState,
)
from core import commands as c
from core.arbiter import (
    ArbiterGpusDeclared,
    ClusterSpec,
    ExpandGeneration,
    GpusReleased,
    GpusRequested,
    GrantGpus,
    PipelineRegistered,
    PipelineUnregistered,
    RolloutOpened,
)
from core.vocabulary import AlertName
from tests.core.arbiter_helpers import engine_pool

S = WorkerState
GPUS = ("0", "1")


class Run:
    def __init__(self, **pool: Any) -> None:
        self.reducer = Reducer(check_invariants=True)
        self.t = 0.0
        self.pid = 100
        self.feed(Configured(t=0.0, config=Config(pools=[engine_pool(**pool)], gpus=GPUS)))
        self.feed(ArbiterGpusDeclared(t=0.0, gpus=GPUS))

    def feed(self, event: Any) -> list[Command]:
        self.t = max(self.t, event.t)
        return self.reducer.step(event)

    def at(self) -> float:
        self.t += 1.0
        return self.t

    def register(self, engine_pool: str | None = "gen", tp_size: int = 1) -> list[Command]:
        gen = ClusterSpec(
            name="gen",
            kind="GENERATION",
            device_mapping=GPUS,
            tp_size=tp_size,
            engine_pool=engine_pool,
        )
        train = ClusterSpec(name="train", kind="ACTOR_TRAINING", device_mapping=["0"])
        return self.feed(PipelineRegistered(t=self.at(), pipeline="p", clusters=[train, gen]))

    def state(self, worker_id: str) -> WorkerState:
        worker = self.reducer.state.workers.get(worker_id)
        return S.EXITED if worker is None else worker.state

    def gpus(self, worker_id: str) -> tuple[str, ...]:
        return self.reducer.state.workers[worker_id].gpus

    def up(self, *worker_ids: str) -> None:
        for worker_id in worker_ids:
            self.pid += 1
            self.feed(WorkerStarted(t=self.at(), worker_id=worker_id, pid=self.pid, start_time=1))
            self.feed(WorkerReady(t=self.at(), worker_id=worker_id))


def of(commands: list[Command], kind: type) -> list[Any]:
    return [command for command in commands if isinstance(command, kind)]


def test_each_active_rank_gets_an_engine_on_its_bundle() -> None:
    run = Run()
    run.register()
    commands = run.feed(GpusRequested(t=run.at(), pipeline="p", cluster="gen", priority=6))
    spawned = of(commands, c.SpawnWorker)
    assert [(s.worker_id, s.gpus) for s in spawned] == [("gen-0", ("0",)), ("gen-1", ("1",))]
    assert all("the arbiter has p/gen rank" in s.reason for s in spawned)


def test_training_puts_the_engine_on_its_gpu_to_sleep_and_release_wakes_it() -> None:
    run = Run()
    run.register()
    run.feed(GpusRequested(t=run.at(), pipeline="p", cluster="gen", priority=6))
    run.up("gen-0", "gen-1")
    commands = run.feed(GpusRequested(t=run.at(), pipeline="p", cluster="train", priority=1))
    assert [type(x).__name__ for x in commands][:2] == ["ShrinkGeneration", "GrantGpus"]
    assert [d.worker_id for d in of(commands, c.DrainEngine)] == ["gen-0"]
    assert run.state("gen-0") is S.GOING_TO_SLEEP and run.state("gen-1") is S.ACTIVE
    sleep = run.feed(
        EngineLoadSampled(t=run.at(), pool="gen", worker_id="gen-0", in_flight_requests=0)
    )
    assert [s.worker_id for s in of(sleep, c.SleepEngine)] == ["gen-0"]
    run.feed(EngineAsleep(t=run.at(), worker_id="gen-0"))
    assert run.state("gen-0") is S.SLEEPING and run.gpus("gen-0") == ("0",)

    run.feed(GpusReleased(t=run.at(), pipeline="p", cluster="train"))
    woken = run.feed(RolloutOpened(t=run.at(), pipeline="p"))
    assert [(x.ranks, x.gpus) for x in of(woken, ExpandGeneration)] == [((0,), ("0",))]
    assert [w.worker_id for w in of(woken, c.WakeEngine)] == ["gen-0"]
    assert run.state("gen-0") is S.WAKING
    run.feed(EngineAwake(t=run.at(), worker_id="gen-0"))
    assert run.state("gen-0") is S.ACTIVE and run.gpus("gen-0") == ("0",)


def test_a_sleep_that_keeps_failing_stops_the_engine() -> None:
    run = Run()
    run.register()
    run.feed(GpusRequested(t=run.at(), pipeline="p", cluster="gen", priority=6))
    run.up("gen-0", "gen-1")
    run.feed(GpusRequested(t=run.at(), pipeline="p", cluster="train", priority=1))
    run.feed(EngineLoadSampled(t=run.at(), pool="gen", worker_id="gen-0", in_flight_requests=0))
    run.feed(EngineSleepFailed(t=run.at(), worker_id="gen-0", error="HTTP 500"))
    stop = run.feed(EngineSleepFailed(t=run.at(), worker_id="gen-0", error="HTTP 500"))
    assert [t.worker_id for t in of(stop, c.TerminateWorker)] == ["gen-0"]
    exited = run.feed(WorkerExited(t=run.at(), worker_id="gen-0", exit_code=0))
    assert of(exited, c.SpawnWorker) == []  # rank 0 is asleep: no engine is started for it
    assert run.state("gen-0") is S.EXITED


def test_a_starting_engine_of_a_rank_put_to_sleep_is_stopped() -> None:
    run = Run()
    run.register()
    run.feed(GpusRequested(t=run.at(), pipeline="p", cluster="gen", priority=6))
    commands = run.feed(GpusRequested(t=run.at(), pipeline="p", cluster="train", priority=1))
    assert [t.worker_id for t in of(commands, c.TerminateWorker)] == ["gen-0"]


@pytest.mark.parametrize(
    ("pool", "register", "error", "message"),
    [
        ({}, {"engine_pool": "nope"}, UnknownSubject, "not a pool of deo's"),
        ({}, {"tp_size": 2}, Refused, "tp_size=2"),
        ({"max_workers": 1}, {}, Refused, "max_workers = 1: fewer than the cluster's 2 ranks"),
        ({"max_asleep": 1}, {}, Refused, "max_asleep = 1: fewer than the cluster's 2 ranks"),
        (
            {"kind": "worker", "engine": None, "ports": None, "argv": ["w"]},
            {},
            Refused,
            "not .engine.",
        ),
    ],
)
def test_a_cluster_deo_cannot_run_on_the_pool_is_refused(
    pool: dict[str, Any], register: dict[str, Any], error: type[Exception], message: str
) -> None:
    run = Run(**pool)
    before = run.reducer.state
    with pytest.raises(error, match=message):
        run.register(**register)
    assert run.reducer.state is before


def live_on(run: Run) -> dict[str, list[str]]:
    """GPU -> the live workers on it (any state but exited)."""
    found: dict[str, list[str]] = {}
    for worker in run.reducer.state.workers.values():
        for gpu in worker.gpus:
            found.setdefault(gpu, []).append(worker.worker_id)
    return found


def test_a_rank_woken_while_its_stopped_engine_still_runs_waits_for_it_to_exit() -> None:
    run = Run()
    run.register()
    run.feed(GpusRequested(t=run.at(), pipeline="p", cluster="gen", priority=6))
    run.pid += 1
    run.feed(WorkerStarted(t=run.at(), worker_id="gen-0", pid=run.pid, start_time=1))
    run.feed(GpusRequested(t=run.at(), pipeline="p", cluster="train", priority=1))
    assert run.state("gen-0") is S.STOPPING  # its rank went to sleep while it started
    run.feed(GpusReleased(t=run.at(), pipeline="p", cluster="train"))
    woken = run.feed(RolloutOpened(t=run.at(), pipeline="p"))
    assert of(woken, c.SpawnWorker) == []  # gen-0 still holds GPU 0
    assert live_on(run)["0"] == ["gen-0"]
    exited = run.feed(WorkerExited(t=run.at(), worker_id="gen-0", exit_code=0))
    assert [(s.worker_id, s.gpus) for s in of(exited, c.SpawnWorker)] == [("gen-2", ("0",))]


def test_a_lost_gpu_gets_no_engine_started_on_it() -> None:
    run = Run()
    run.register()
    run.feed(GpusRequested(t=run.at(), pipeline="p", cluster="gen", priority=6))
    run.up("gen-0", "gen-1")
    commands = run.feed(GpuLost(t=run.at(), gpu_id="1", error="xid 79"))
    assert of(commands, c.SpawnWorker) == []
    assert [t.worker_id for t in of(commands, c.TerminateWorker)] == ["gen-1"]
    exited = run.feed(WorkerExited(t=run.at(), worker_id="gen-1", exit_code=None, signal=9))
    assert of(exited, c.SpawnWorker) == []


def test_a_cordoned_gpu_gets_no_engine_until_it_is_uncordoned() -> None:
    run = Run()
    run.register()
    run.feed(GpuCordonRequested(t=run.at(), gpu_id="1"))
    commands = run.feed(GpusRequested(t=run.at(), pipeline="p", cluster="gen", priority=6))
    assert [(s.worker_id, s.gpus) for s in of(commands, c.SpawnWorker)] == [("gen-0", ("0",))]
    assert run.reducer.state.arbiter.pipelines["p"].clusters["gen"].active_ranks == {0}
    run.feed(RolloutOpened(t=run.at(), pipeline="p"))
    run.feed(GpuUncordonRequested(t=run.at(), gpu_id="1"))
    woken = run.feed(Tick(t=run.at(), interval_s=1.0))  # the next plan sees GPU 1 again
    assert [(s.worker_id, s.gpus) for s in of(woken, c.SpawnWorker)] == [("gen-1", ("1",))]


def test_unregistering_stops_the_pipelines_engines_before_others_get_their_gpus() -> None:
    run = Run()
    run.register()
    run.feed(GpusRequested(t=run.at(), pipeline="p", cluster="gen", priority=6))
    run.up("gen-0", "gen-1")
    commands = run.feed(PipelineUnregistered(t=run.at(), pipeline="p"))
    assert sorted(t.worker_id for t in of(commands, c.TerminateWorker)) == ["gen-0", "gen-1"]
    assert all("p/gen left the arbiter" in t.reason for t in of(commands, c.TerminateWorker))
    train = ClusterSpec(name="train", kind="ACTOR_TRAINING", device_mapping=GPUS)
    run.feed(PipelineRegistered(t=run.at(), pipeline="q", clusters=[train]))
    run.feed(GpusRequested(t=run.at(), pipeline="q", cluster="train", priority=1))
    # The arbiter grants them (the API answers once gen-0 and gen-1 exited); nothing restarts.
    for worker_id in ("gen-0", "gen-1"):
        exited = run.feed(WorkerExited(t=run.at(), worker_id=worker_id, exit_code=0))
        assert of(exited, c.SpawnWorker) == []
    assert run.reducer.state.workers == {}


def test_a_pool_the_arbiter_does_not_run_never_takes_its_gpus() -> None:
    run = Run()
    workers = PoolSpec(
        name="w",
        argv=["w"],
        gpus_per_worker=1,
        max_workers=2,
        policy=PolicySpec(name="static", params={"count": 2}),
    )
    config = Config(pools=[engine_pool(), workers], gpus=(*GPUS, "2"))
    commands = run.feed(Configured(t=run.at(), config=config))
    assert [(s.worker_id, s.gpus) for s in of(commands, c.SpawnWorker)] == [("w-0", ("2",))]
    assert "w" not in {w.pool for w in run.reducer.state.workers.values() if "0" in w.gpus}


def crash(run: Run, worker_id: str) -> list[Command]:
    run.pid += 1
    run.feed(WorkerStarted(t=run.at(), worker_id=worker_id, pid=run.pid, start_time=1))
    return run.feed(WorkerExited(t=run.t + 0.01, worker_id=worker_id, exit_code=1))


def test_a_crashing_rank_engine_is_restarted_under_the_pools_backoff_and_alerts() -> None:
    run = Run()
    run.register()
    run.feed(GpusRequested(t=run.at(), pipeline="p", cluster="gen", priority=6))
    run.up("gen-1")
    spawned: list[str] = []
    engine = "gen-0"
    alerts: set[Any] = set()
    for _ in range(4):
        commands = crash(run, engine)
        alerts |= run.reducer.state.alerts
        assert of(commands, c.SpawnWorker) == []  # its slot waits for the backoff
        # Ticks until the backoff has passed; the replacement carries the failures on.
        while not (started := of(run.feed(Tick(t=run.at(), interval_s=1.0)), c.SpawnWorker)):
            assert run.t < 10_000
        (replacement,) = started
        assert replacement.gpus == ("0",)
        engine = replacement.worker_id
        spawned.append(engine)
    assert spawned == ["gen-2", "gen-3", "gen-4", "gen-5"]
    assert run.reducer.state.workers[engine].attempt == 4
    assert (AlertName.CRASH_LOOP, "gen") in alerts


def test_a_rank_bundle_on_two_nodes_is_refused() -> None:
    gpus = ("a:0", "b:0")
    reducer = Reducer(check_invariants=True)
    pool = engine_pool(gpus_per_worker=2)
    reducer.step(Configured(t=0.0, config=Config(pools=[pool], gpus=gpus)))
    reducer.step(ArbiterGpusDeclared(t=0.0, gpus=gpus))
    spec = ClusterSpec(
        name="gen", kind="GENERATION", device_mapping=gpus, tp_size=2, engine_pool="gen"
    )
    before = reducer.state
    with pytest.raises(Refused, match=r"rank bundles \[\['a:0', 'b:0'\]\] span nodes"):
        reducer.step(PipelineRegistered(t=1.0, pipeline="p", clusters=[spec]))
    assert reducer.state is before


def test_declaring_the_arbiters_gpus_stops_other_pools_workers_there() -> None:
    reducer = Reducer(check_invariants=True)
    workers = PoolSpec(
        name="w",
        argv=["w"],
        gpus_per_worker=1,
        max_workers=1,
        policy=PolicySpec(name="static", params={"count": 1}),
    )
    started = reducer.step(Configured(t=0.0, config=Config(pools=[workers], gpus=(*GPUS, "2"))))
    assert [(s.worker_id, s.gpus) for s in of(started, c.SpawnWorker)] == [("w-0", ("0",))]
    declared = reducer.step(ArbiterGpusDeclared(t=1.0, gpus=GPUS))
    (stop,) = of(declared, c.TerminateWorker)
    assert stop.worker_id == "w-0" and "GPU 0 is the arbiter's" in stop.reason
    # Its replacement starts on the GPU outside the arbiter's.
    assert [(s.worker_id, s.gpus) for s in of(declared, c.SpawnWorker)] == [("w-1", ("2",))]


def test_a_rank_woken_before_its_sleep_call_cancels_the_sleep() -> None:
    run = Run()
    run.register()
    run.feed(GpusRequested(t=run.at(), pipeline="p", cluster="gen", priority=6))
    run.up("gen-0", "gen-1")
    run.feed(GpusRequested(t=run.at(), pipeline="p", cluster="train", priority=1))
    assert run.state("gen-0") is S.GOING_TO_SLEEP  # out of routing, its sleep call not sent
    run.feed(GpusReleased(t=run.at(), pipeline="p", cluster="train"))
    woken = run.feed(RolloutOpened(t=run.at(), pipeline="p"))
    assert [x.worker_id for x in of(woken, c.CancelSleep)] == ["gen-0"]
    assert of(woken, c.WakeEngine) == [] and of(woken, c.SpawnWorker) == []
    assert run.state("gen-0") is S.ACTIVE


@pytest.mark.parametrize(
    ("pools", "message"),
    [
        ([engine_pool(gpus_per_worker=2)], "engine pool 'gen' \\(it runs p/gen\\) gives each"),
        ([engine_pool(max_workers=1)], "max_workers = 1: fewer than the cluster's 2 ranks"),
    ],
)
def test_a_configuration_that_could_no_longer_run_a_cluster_is_refused(
    pools: list[PoolSpec], message: str
) -> None:
    run = Run()
    run.register()
    before = run.reducer.state
    with pytest.raises(Refused, match=message):
        run.feed(Configured(t=run.at(), config=Config(pools=pools, gpus=GPUS)))
    assert run.reducer.state is before
    run.feed(Configured(t=run.at(), config=Config(pools=[engine_pool(min_workers=0)], gpus=GPUS)))


def test_removing_the_pool_a_cluster_runs_drains_its_engines() -> None:
    run = Run()
    run.register()
    run.feed(GpusRequested(t=run.at(), pipeline="p", cluster="gen", priority=6))
    run.up("gen-0", "gen-1")
    commands = run.feed(Configured(t=run.at(), config=Config(pools=[], gpus=GPUS)))
    assert sorted(d.worker_id for d in of(commands, c.DrainEngine)) == ["gen-0", "gen-1"]
    assert of(commands, c.SpawnWorker) == []


def test_the_arbiter_plans_nothing_new_on_a_gpu_deo_cordoned() -> None:
    run = Run()
    run.feed(GpuCordonRequested(t=run.at(), gpu_id="1"))
    train = ClusterSpec(name="train", kind="ACTOR_TRAINING", device_mapping=["1"])
    gen = ClusterSpec(name="gen", kind="GENERATION", device_mapping=GPUS)
    run.feed(PipelineRegistered(t=run.at(), pipeline="q", clusters=[train, gen]))
    woken = run.feed(GpusRequested(t=run.at(), pipeline="q", cluster="gen", priority=6))
    assert [x.gpus for x in of(woken, ExpandGeneration)] == [("0",)]
    waiting = run.feed(GpusRequested(t=run.at(), pipeline="q", cluster="train", priority=1))
    assert of(waiting, GrantGpus) == []
    run.feed(GpuUncordonRequested(t=run.at(), gpu_id="1"))
    granted = run.feed(Tick(t=run.at(), interval_s=1.0))
    assert [x.gpus for x in of(granted, GrantGpus)] == [("1",)]
