"""Two generation clusters run by deo engine pools on the same GPUs: one engine holds a GPU's
memory, the other cluster's engines there sleep (tenants), and a rank's engine starts or wakes
on a GPU only once the engine there confirmed its sleep or exited (invariant 1)."""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

from core import (
    Command,
    Config,
    Configured,
    EngineAsleep,
    EngineAwake,
    EngineLoadSampled,
    PolicySpec,
    PoolSpec,
    Reducer,
    Tick,
    WorkerExited,
    WorkerReady,
    WorkerStarted,
    WorkerState,
    reduce,
)
from core import commands as c
from core.arbiter import (
    ArbiterGpusDeclared,
    ClusterSpec,
    GpusRequested,
    PipelineRegistered,
    ProgressReported,
    RolloutOpened,
)
from core.invariants import STATE_CHECK_INTERVAL_S as SPAN
from core.invariants import state_violations, step_violations
from core.records import replace
from core.state import State, count_workers
from tests.core.arbiter_helpers import engine_pool

S = WorkerState
GPUS = ("0", "1")
WORKERS = PoolSpec(name="gen2", argv=["w"], policy=PolicySpec(name="static", params={"count": 0}))


class Shared:
    """Pipelines p (engine pool ``gen``) and q (engine pool ``gen2``), each with a generation
    cluster on both GPUs."""

    def __init__(self) -> None:
        self.reducer = Reducer(check_invariants=True)
        self.t = 0.0
        self.pid = 100
        pools = [engine_pool(), engine_pool(name="gen2", ports=(18010, 18013))]
        self.feed(Configured(t=0.0, config=Config(pools=pools, gpus=GPUS)))
        self.feed(ArbiterGpusDeclared(t=0.0, gpus=GPUS))
        for pipeline, pool in (("p", "gen"), ("q", "gen2")):
            spec = ClusterSpec(name="gen", kind="GENERATION", device_mapping=GPUS, engine_pool=pool)
            self.feed(PipelineRegistered(t=self.at(), pipeline=pipeline, clusters=[spec]))

    def at(self) -> float:
        self.t += 1.0
        return self.t

    def feed(self, event: Any) -> list[Command]:
        return self.reducer.step(event)

    def up(self, *worker_ids: str) -> None:
        for worker_id in worker_ids:
            self.pid += 1
            self.feed(WorkerStarted(t=self.at(), worker_id=worker_id, pid=self.pid, start_time=1))
            self.feed(WorkerReady(t=self.at(), worker_id=worker_id))

    def wants(self, pipeline: str, left: int) -> list[Command]:
        """``pipeline``'s rollout open with ``left`` trajectories to go, and its request."""
        progress = ProgressReported(
            t=self.at(),
            pipeline=pipeline,
            stream="s",
            target_trajectories=left,
            completed_trajectories=0,
        )
        commands = self.feed(progress)
        commands += self.feed(RolloutOpened(t=self.at(), pipeline=pipeline))
        request = GpusRequested(t=self.at(), pipeline=pipeline, cluster="gen", priority=6)
        return commands + self.feed(request)

    def sleep(self, worker_id: str) -> list[Command]:
        """The engine leaves routing and confirms its sleep."""
        pool = self.reducer.state.workers[worker_id].pool
        self.feed(
            EngineLoadSampled(t=self.at(), pool=pool, worker_id=worker_id, in_flight_requests=0)
        )
        return self.feed(EngineAsleep(t=self.at(), worker_id=worker_id))

    def states(self) -> dict[str, tuple[str, tuple[str, ...]]]:
        return {w.worker_id: (w.state.value, w.gpus) for w in self.reducer.state.workers.values()}


def of(commands: list[Command], kind: type) -> list[Any]:
    return [command for command in commands if isinstance(command, kind)]


def p_awake_then_q() -> Shared:
    """p's engines awake on both GPUs, then q asks: the arbiter gives q both GPUs."""
    run = Shared()
    run.wants("p", 100)
    run.up("gen-0", "gen-1")
    run.feed(
        ProgressReported(
            t=run.at(),
            pipeline="p",
            stream="s",
            target_trajectories=100,
            completed_trajectories=100,
        )
    )
    run.wants("q", 100)
    return run


def test_engine_run_clusters_may_share_gpus() -> None:
    run = Shared()
    bound = run.reducer.state.arbiter.engine_pools()
    assert {name: (p, cluster.spec.device_mapping) for name, (p, cluster) in bound.items()} == {
        "gen": ("p", GPUS),
        "gen2": ("q", GPUS),
    }


def test_the_second_clusters_engine_starts_only_once_the_first_confirmed_its_sleep() -> None:
    run = p_awake_then_q()
    # p's engines go to sleep; nothing of q starts beside an engine that holds the memory.
    assert run.states() == {
        "gen-0": ("going_to_sleep", ("0",)),
        "gen-1": ("going_to_sleep", ("1",)),
    }
    asleep = run.sleep("gen-0")
    assert [(s.worker_id, s.gpus) for s in of(asleep, c.SpawnWorker)] == [("gen2-0", ("0",))]
    assert run.states()["gen-0"] == ("sleeping", ("0",))
    # gen-1's sleep call goes out; it crashes instead: its exit frees GPU 1 too.
    run.feed(EngineLoadSampled(t=run.at(), pool="gen", worker_id="gen-1", in_flight_requests=0))
    assert "gen2-1" not in run.states()
    exited = run.feed(WorkerExited(t=run.at(), worker_id="gen-1", exit_code=1))
    assert [(s.worker_id, s.gpus) for s in of(exited, c.SpawnWorker)] == [("gen2-1", ("1",))]


def test_a_woken_rank_waits_for_the_other_clusters_engine_to_sleep() -> None:
    run = p_awake_then_q()
    run.sleep("gen-0")
    run.sleep("gen-1")
    run.up("gen2-0", "gen2-1")
    # p asks again with far more to do: it takes a GPU back from q.
    run.feed(
        ProgressReported(
            t=run.at(), pipeline="q", stream="s", target_trajectories=100, completed_trajectories=90
        )
    )
    commands = run.wants("p", 10_000)
    commands += run.feed(Tick(t=run.at(), interval_s=1.0))
    (drained,) = of(commands, c.DrainEngine)
    engine = drained.worker_id
    gpu = run.reducer.state.workers[engine].gpus[0]
    tenant = f"gen-{gpu}"
    # The rank's engine on that GPU is not woken while q's engine there still holds it.
    assert of(commands, c.WakeEngine) == []
    assert run.states()[tenant] == ("sleeping", (gpu,))
    asleep = run.sleep(engine)
    assert [w.worker_id for w in of(asleep, c.WakeEngine)] == [tenant]
    awake = run.feed(EngineAwake(t=run.at(), worker_id=tenant))
    assert of(awake, c.WakeEngine) == []
    assert run.states()[tenant] == ("active", (gpu,))
    assert run.states()[engine] == ("sleeping", (gpu,))


# --- invariant 1 ----------------------------------------------------------------------------------


def tenanted() -> State:
    """gen-0 asleep and gen2-0 awake on GPU 0."""
    run = p_awake_then_q()
    run.sleep("gen-0")
    run.up("gen2-0")
    state = run.reducer.state
    assert state.workers["gen-0"].state is S.SLEEPING
    assert state.workers["gen2-0"].state is S.ACTIVE
    return state


def with_worker(before: State, worker_id: str, /, **changes: Any) -> State:
    """``before`` with ``worker_id`` changed (a state no step would produce)."""
    workers = dict(before.workers)
    workers[worker_id] = replace(workers[worker_id], **changes)
    counts = MappingProxyType(count_workers(workers.values()))
    return replace(before, workers=MappingProxyType(workers), worker_counts=counts)


def test_invariant_1_allows_an_awake_engine_beside_an_asleep_one() -> None:
    assert state_violations(tenanted()) == []


def test_invariant_1_finds_two_awake_workers_on_one_gpu() -> None:
    state = with_worker(tenanted(), "gen-0", state=S.ACTIVE, asleep_t=None)
    assert state_violations(state) == [
        "1: GPU 0 held by 2 live workers that hold its memory: gen-0, gen2-0"
    ]


def test_invariant_1_counts_waking_and_stopping_engines_as_holding() -> None:
    waking = with_worker(tenanted(), "gen-0", state=S.WAKING, asleep_t=None)
    assert any("GPU 0 held by 2" in v for v in state_violations(waking))
    # Stopped from its sleep, an engine takes no memory back: still a tenant.
    stopping = with_worker(tenanted(), "gen-0", state=S.STOPPING, deadline_t=1e9)
    assert state_violations(stopping) == []


def test_invariant_1_finds_a_worker_that_is_no_engine_beside_an_asleep_engine() -> None:
    state = tenanted()
    # gen2-0 as a worker of a pool that is no engine pool, beside gen-0 asleep.
    pools = dict(state.pools)
    pools["gen2"] = replace(pools["gen2"], spec=WORKERS)
    found = state_violations(replace(state, pools=pools))
    assert "1: GPU 0 is shared by 2 live workers, gen2-0 no engine" in " ".join(found), found


def test_a_spawn_beside_an_asleep_engine_of_a_pool_the_arbiter_does_not_run_is_caught() -> None:
    state = tenanted()
    spawn = c.SpawnWorker(worker_id="w-0", pool="w", argv=["w"], gpus=("0",), env={}, reason="r")
    found = step_violations(state, Tick(t=state.now, interval_s=1.0), state, [spawn])
    assert any("which the arbiter does not run, placed on GPU 0 beside" in v for v in found)
    bound = c.SpawnWorker(
        worker_id="gen2-9", pool="gen2", argv=["x"], gpus=("0",), env={}, reason="r"
    )
    found = step_violations(state, Tick(t=state.now, interval_s=1.0), state, [bound])
    assert not any("does not run" in v for v in found)


# --- checked as deo runs --------------------------------------------------------------------------


def alerts(commands: list[Command], kind: type) -> list[tuple[str, str]]:
    return [(a.alert.value, a.subject) for a in of(commands, kind)]


def test_a_tick_finds_a_broken_invariant_and_alerts_until_it_holds_again() -> None:
    # The whole state is checked at the first tick of each span of STATE_CHECK_INTERVAL_S.
    broken = with_worker(tenanted(), "gen-0", state=S.ACTIVE, asleep_t=None)
    t = broken.now + SPAN
    after, commands = reduce(broken, Tick(t=t, interval_s=1.0))
    (raised,) = of(commands, c.RaiseAlert)
    assert (raised.alert.value, raised.subject) == ("invariant_violated", "deo")
    assert "1: GPU 0 held by 2 live workers that hold its memory: gen-0, gen2-0" in raised.reason
    # Raised once while it lasts; the state is carried on as it is, not refused.
    again, more = reduce(after, Tick(t=t + SPAN, interval_s=1.0))
    assert alerts(more, c.RaiseAlert) == [] and again.workers.keys() == broken.workers.keys()
    # Mended (gen-0 asleep again), the next tick resolves it.
    mended = with_worker(again, "gen-0", state=S.SLEEPING, asleep_t=t)
    _, last = reduce(mended, Tick(t=t + 2 * SPAN, interval_s=1.0))
    assert alerts(last, c.ResolveAlert) == [("invariant_violated", "deo")]


def test_an_engine_found_awake_beside_the_memory_holder_goes_back_to_sleep_unrouted() -> None:
    run = p_awake_then_q()
    run.sleep("gen-0")
    run.up("gen2-0")
    run.reducer.check_invariants = False  # the world breaks invariant 1 here, not deo
    # After a restart, gen-0 (asleep by the log) answers that it is awake: something woke it.
    woke = run.feed(EngineAwake(t=run.at(), worker_id="gen-0"))
    assert run.states()["gen-0"] == ("going_to_sleep", ("0",))  # never active: never routed
    assert run.states()["gen2-0"] == ("active", ("0",))
    assert [d.worker_id for d in of(woke, c.DrainEngine)] == ["gen-0"]
    (control,) = of(woke, c.RaiseAlert)
    assert control.subject == "gen-0" and "beside gen2-0" in control.reason
    run.t += SPAN
    ticked = run.feed(Tick(t=run.at(), interval_s=1.0))
    assert alerts(ticked, c.RaiseAlert) == [("invariant_violated", "deo")]
    # Its sleep confirmed: both alerts resolved.
    asleep = run.sleep("gen-0")
    assert alerts(asleep, c.ResolveAlert) == [("engine_control", "gen-0")]
    run.t += SPAN
    ticked = run.feed(Tick(t=run.at(), interval_s=1.0))
    assert alerts(ticked, c.ResolveAlert) == [("invariant_violated", "deo")]
