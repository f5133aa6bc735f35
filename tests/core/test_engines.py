"""Engine pools in the core: ports, sleep before exit, wake before start, failed calls, max_asleep,
the operator's wake-all and drain, adoption after a restart; every engine row of the lifecycle
table is taken by one of these scenarios."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

import core.step
from core import (
    AutoscalingResumed,
    Command,
    Config,
    Configured,
    DrainRequested,
    EngineAsleep,
    EngineAwake,
    EngineLoadSampled,
    EngineSleepFailed,
    EnginesWakeRequested,
    EngineWakeFailed,
    GpuCordonRequested,
    PolicySpec,
    PoolPinned,
    PoolSpec,
    Reducer,
    Refused,
    Tick,
    WorkerAdopted,
    WorkerReady,
    WorkerStarted,
    WorkerState,
)
from core import commands as c
from core.lifecycle import ASLEEP, TRANSITIONS, Trigger
from core.vocabulary import AlertName, StopCause

S = WorkerState


def spec(**kwargs: Any) -> PoolSpec:
    fields: dict[str, Any] = {
        "name": "gen",
        "kind": "engine",
        "engine": "vllm",
        "argv": ["serve", "--port", "{port}"],
        "ports": (18000, 18003),
        "max_workers": 3,
        "max_asleep": 1,
        "policy": PolicySpec(name="static", params={"count": 2}),
        "drain_timeout_s": 30.0,
        "control_timeout_s": 5.0,
        "control_attempts": 2,
    }
    fields.update(kwargs)
    return PoolSpec(**fields)


class Engines:
    """A reducer with an engine pool, and shorthands for the events its engines send."""

    def __init__(self, gpus: tuple[str, ...] = (), **kwargs: Any) -> None:
        self.reducer = Reducer(check_invariants=True)
        self.t = 0.0
        self.pid = 100
        config = Config(pools=[spec(**kwargs)], gpus=gpus)
        self.commands = self.feed(Configured(t=0.0, config=config))

    def feed(self, event: Any) -> list[Command]:
        self.t = max(self.t, event.t)
        return self.reducer.step(event)

    def at(self, dt: float = 1.0) -> float:
        self.t += dt
        return self.t

    def state(self, worker_id: str) -> WorkerState:
        worker = self.reducer.state.workers.get(worker_id)
        return S.EXITED if worker is None else worker.state

    def up(self, *worker_ids: str) -> None:
        for worker_id in worker_ids:
            self.pid += 1
            self.feed(
                WorkerStarted(t=self.at(), worker_id=worker_id, pid=self.pid, start_time=self.pid)
            )
            self.feed(WorkerReady(t=self.at(), worker_id=worker_id))

    def pin(self, count: int) -> list[Command]:
        return self.feed(PoolPinned(t=self.at(), pool="gen", count=count))

    def load(self, worker_id: str, in_flight: int) -> list[Command]:
        return self.feed(
            EngineLoadSampled(
                t=self.at(), pool="gen", worker_id=worker_id, in_flight_requests=in_flight
            )
        )

    def asleep(self, worker_id: str) -> list[Command]:
        return self.feed(EngineAsleep(t=self.at(), worker_id=worker_id))

    def awake(self, worker_id: str) -> list[Command]:
        return self.feed(EngineAwake(t=self.at(), worker_id=worker_id))

    def put_to_sleep(self, worker_id: str, count: int) -> None:
        """Pin the pool at ``count``, ``worker_id`` being the engine that goes."""
        self.pin(count)
        assert self.state(worker_id) is S.GOING_TO_SLEEP
        self.load(worker_id, 0)
        self.asleep(worker_id)
        assert self.state(worker_id) is S.SLEEPING


def of(commands: list[Command], kind: type) -> list[Any]:
    return [command for command in commands if isinstance(command, kind)]


@pytest.fixture
def rows(monkeypatch: pytest.MonkeyPatch) -> Iterator[set[tuple[WorkerState, Trigger]]]:
    taken: set[tuple[WorkerState, Trigger]] = set()
    real = core.step.next_state

    def recording(worker_id: str, state: WorkerState, trigger: Trigger) -> WorkerState:
        taken.add((state, trigger))
        return real(worker_id, state, trigger)

    monkeypatch.setattr(core.step, "next_state", recording)
    yield taken


# --- scenarios --------------------------------------------------------------------------------


def spawns_on_the_lowest_free_ports() -> None:
    pool = Engines()
    spawns = of(pool.commands, c.SpawnWorker)
    assert [(s.worker_id, s.port, s.argv[-1]) for s in spawns] == [
        ("gen-0", 18000, "18000"),
        ("gen-1", 18001, "18001"),
    ]
    assert all(s.env["VLLM_SERVER_DEV_MODE"] == "1" for s in spawns)
    pool.pid += 1
    pool.feed(WorkerStarted(t=pool.at(), worker_id="gen-0", pid=pool.pid, start_time=pool.pid))
    assert pool.state("gen-0") is S.STARTING  # an engine is active once its /health answers
    pool.feed(WorkerReady(t=pool.at(), worker_id="gen-0"))
    assert pool.state("gen-0") is S.ACTIVE
    assert pool.reducer.state.workers["gen-1"].port == 18001


def scale_down_sleeps_and_scale_up_wakes() -> None:
    pool = Engines()
    pool.up("gen-0", "gen-1")
    pool.load("gen-1", 3)
    commands = pool.pin(1)
    assert pool.state("gen-1") is S.GOING_TO_SLEEP  # the newest goes; out of routing at once
    assert [d.worker_id for d in of(commands, c.DrainEngine)] == ["gen-1"]
    assert not of(commands, c.SleepEngine)  # three requests still in flight
    assert pool.reducer.state.counted("gen") == 1
    sleep = of(pool.load("gen-1", 0), c.SleepEngine)
    assert [(s.worker_id, s.port, s.level, s.attempt) for s in sleep] == [("gen-1", 18001, 1, 1)]
    assert pool.state("gen-1") is S.FALLING_ASLEEP
    pool.asleep("gen-1")
    worker = pool.reducer.state.workers["gen-1"]
    assert (worker.state, worker.port, worker.pid, worker.asleep_t) == (
        S.SLEEPING,
        18001,
        102,
        pool.t,
    )
    commands = pool.pin(2)
    assert not of(commands, c.SpawnWorker)  # woken, not started
    assert [w.worker_id for w in of(commands, c.WakeEngine)] == ["gen-1"]
    assert pool.state("gen-1") is S.WAKING
    assert pool.reducer.state.counted("gen") == 2  # waking is capacity on its way
    pool.awake("gen-1")
    assert pool.state("gen-1") is S.ACTIVE


def a_sleep_called_off_before_its_call() -> None:
    pool = Engines()
    pool.up("gen-0", "gen-1")
    pool.load("gen-1", 2)
    pool.pin(1)
    commands = pool.pin(2)
    assert [x.worker_id for x in of(commands, c.CancelSleep)] == ["gen-1"]
    assert not of(commands, c.SpawnWorker) and not of(commands, c.WakeEngine)
    assert pool.state("gen-1") is S.ACTIVE


def the_drain_before_sleep_times_out() -> None:
    pool = Engines()
    pool.up("gen-0", "gen-1")
    pool.pin(1)
    deadline = pool.reducer.state.workers["gen-1"].deadline_t
    assert deadline == pool.t + 30.0
    pool.load("gen-1", 5)
    commands = pool.feed(Tick(t=deadline))
    assert [s.worker_id for s in of(commands, c.SleepEngine)] == ["gen-1"]
    assert "5 request(s) in flight" in of(commands, c.SleepEngine)[0].reason


def a_failed_sleep_is_retried_then_the_engine_stopped() -> None:
    pool = Engines()
    pool.up("gen-0", "gen-1")
    pool.pin(1)
    pool.load("gen-1", 0)
    retry = pool.feed(EngineSleepFailed(t=pool.at(), worker_id="gen-1", error="HTTP 500"))
    assert [s.attempt for s in of(retry, c.SleepEngine)] == [2]
    assert pool.state("gen-1") is S.FALLING_ASLEEP
    done = pool.feed(EngineSleepFailed(t=pool.at(), worker_id="gen-1", error="HTTP 500"))
    assert [t.worker_id for t in of(done, c.TerminateWorker)] == ["gen-1"]
    assert [a.alert for a in of(done, c.RaiseAlert)] == [AlertName.ENGINE_CONTROL]
    worker = pool.reducer.state.workers["gen-1"]
    assert (worker.state, worker.stop_cause) == (S.STOPPING, StopCause.SLEEP_FAILED)
    assert not of(done, c.SpawnWorker)  # it was leaving anyway: nothing to replace


def a_sleep_that_never_answers_reaches_its_deadline() -> None:
    pool = Engines()
    pool.up("gen-0", "gen-1")
    pool.pin(1)
    pool.load("gen-1", 0)
    deadline = pool.reducer.state.workers["gen-1"].deadline_t
    assert deadline == pool.t + 10.0  # twice the call's timeout
    commands = pool.feed(Tick(t=deadline))
    assert [t.worker_id for t in of(commands, c.TerminateWorker)] == ["gen-1"]
    assert pool.reducer.state.workers["gen-1"].stop_cause is StopCause.SLEEP_FAILED


def a_failed_wake_is_retried_then_replaced() -> None:
    pool = Engines()
    pool.up("gen-0", "gen-1")
    pool.put_to_sleep("gen-1", 1)
    pool.pin(2)
    retry = pool.feed(EngineWakeFailed(t=pool.at(), worker_id="gen-1", error="timed out"))
    assert [w.attempt for w in of(retry, c.WakeEngine)] == [2]
    done = pool.feed(EngineWakeFailed(t=pool.at(), worker_id="gen-1", error="timed out"))
    assert pool.state("gen-1") is S.STOPPING
    assert pool.reducer.state.workers["gen-1"].stop_cause is StopCause.WAKE_FAILED
    spawned = of(done, c.SpawnWorker)
    # Its port is still held until it exits: the replacement gets the next free one.
    assert [(s.worker_id, s.port) for s in spawned] == [("gen-2", 18002)]


def a_wake_that_never_answers_is_replaced() -> None:
    pool = Engines()
    pool.up("gen-0", "gen-1")
    pool.put_to_sleep("gen-1", 1)
    pool.pin(2)
    deadline = pool.reducer.state.workers["gen-1"].deadline_t
    assert deadline is not None
    commands = pool.feed(Tick(t=deadline))
    assert [t.worker_id for t in of(commands, c.TerminateWorker)] == ["gen-1"]
    assert [s.worker_id for s in of(commands, c.SpawnWorker)] == ["gen-2"]


def max_asleep_stops_the_one_asleep_longest() -> None:
    pool = Engines(max_workers=3, policy=PolicySpec(name="static", params={"count": 3}))
    pool.up("gen-0", "gen-1", "gen-2")
    pool.put_to_sleep("gen-2", 2)
    commands = pool.pin(1)  # gen-1 goes to sleep; only one may: gen-2, asleep longest, stops
    assert pool.state("gen-1") is S.GOING_TO_SLEEP
    assert pool.state("gen-2") is S.STOPPING
    assert pool.reducer.state.workers["gen-2"].stop_cause is StopCause.MAX_ASLEEP
    assert [t.worker_id for t in of(commands, c.TerminateWorker)] == ["gen-2"]


def past_max_asleep_while_one_is_on_its_way_the_next_exits() -> None:
    pool = Engines(max_workers=3, policy=PolicySpec(name="static", params={"count": 3}))
    pool.up("gen-0", "gen-1", "gen-2")
    pool.load("gen-2", 1)
    pool.load("gen-1", 1)
    pool.pin(1)
    assert pool.state("gen-2") is S.GOING_TO_SLEEP
    assert pool.state("gen-1") is S.DRAINING  # max_asleep 1 already going: this one exits
    commands = pool.load("gen-1", 0)  # drained: stopped once nothing is in flight
    assert [t.worker_id for t in of(commands, c.TerminateWorker)] == ["gen-1"]


def max_asleep_zero_always_stops() -> None:
    pool = Engines(max_asleep=0)
    pool.up("gen-0", "gen-1")
    commands = pool.pin(1)
    assert pool.state("gen-1") is S.DRAINING
    assert [d.worker_id for d in of(commands, c.DrainEngine)] == ["gen-1"]
    pool.load("gen-1", 0)
    assert pool.state("gen-1") is S.STOPPING  # nothing in flight: stopped


def a_lower_max_asleep_stops_the_extra_sleepers() -> None:
    pool = Engines(max_asleep=1)
    pool.up("gen-0", "gen-1")
    pool.put_to_sleep("gen-1", 1)
    config = Config(pools=[spec(max_asleep=0)])
    commands = pool.feed(Configured(t=pool.at(), config=config))
    assert [t.worker_id for t in of(commands, c.TerminateWorker)] == ["gen-1"]


def the_operator_wakes_every_engine_and_the_policy_resumes_after() -> None:
    pool = Engines(max_asleep=2, policy=PolicySpec(name="static", params={"count": 3}))
    pool.up("gen-0", "gen-1", "gen-2")
    pool.put_to_sleep("gen-2", 2)
    pool.load("gen-1", 4)
    pool.pin(1)
    assert pool.state("gen-1") is S.GOING_TO_SLEEP
    pool.feed(PoolPinned(t=pool.at(), pool="gen", count=None))  # the policy decides again
    commands = pool.feed(EnginesWakeRequested(t=pool.at(), pool="gen", hold_s=None))
    assert [w.worker_id for w in of(commands, c.WakeEngine)] == ["gen-2"]
    assert [x.worker_id for x in of(commands, c.CancelSleep)] == ["gen-1"]
    state = pool.reducer.state.pools["gen"]
    assert (state.pinned, state.wake_held) == (3, True)
    ended = pool.feed(AutoscalingResumed(t=pool.at(), pool="gen"))
    assert "wake hold ended" in of(ended, c.ScalePool)[0].reason
    state = pool.reducer.state.pools["gen"]
    assert (state.pinned, state.wake_held, state.desired) == (None, False, 3)


def a_timed_wake_hold_ends_on_its_own() -> None:
    pool = Engines()
    pool.up("gen-0", "gen-1")
    pool.feed(EnginesWakeRequested(t=pool.at(), pool="gen", hold_s=60.0))
    assert pool.reducer.state.pools["gen"].wake_held
    pool.feed(Tick(t=pool.t + 60.0))
    assert not pool.reducer.state.pools["gen"].wake_held
    assert pool.reducer.state.pools["gen"].pinned is None


def the_operator_drains_one_engine_until_nothing_is_in_flight() -> None:
    pool = Engines()
    pool.up("gen-0", "gen-1")
    pool.load("gen-0", 2)
    commands = pool.feed(DrainRequested(t=pool.at(), worker_id="gen-0"))
    assert [d.worker_id for d in of(commands, c.DrainEngine)] == ["gen-0"]
    assert not of(commands, c.DrainWorker)  # an engine takes no drain signal
    assert pool.state("gen-0") is S.DRAINING
    assert [s.worker_id for s in of(commands, c.SpawnWorker)] == ["gen-2"]  # replaced
    stop = pool.load("gen-0", 0)
    assert [t.worker_id for t in of(stop, c.TerminateWorker)] == ["gen-0"]
    assert pool.reducer.state.workers["gen-0"].stop_cause is StopCause.OPERATOR


def draining_asleep_engines() -> None:
    pool = Engines(max_asleep=2, policy=PolicySpec(name="static", params={"count": 3}))
    pool.up("gen-0", "gen-1", "gen-2")
    pool.put_to_sleep("gen-2", 2)
    pool.load("gen-1", 1)
    pool.pin(1)
    pool.feed(DrainRequested(t=pool.at(), worker_id="gen-1"))  # going to sleep: drained to exit
    assert pool.state("gen-1") is S.DRAINING
    pool.feed(DrainRequested(t=pool.at(), worker_id="gen-2"))  # asleep: stopped at once
    assert pool.state("gen-2") is S.STOPPING


def draining_a_waking_engine() -> None:
    pool = Engines()
    pool.up("gen-0", "gen-1")
    pool.put_to_sleep("gen-1", 1)
    pool.pin(2)
    assert pool.state("gen-1") is S.WAKING
    pool.feed(DrainRequested(t=pool.at(), worker_id="gen-1"))
    assert pool.state("gen-1") is S.STOPPING  # drained, and nothing in flight: stopped at once


def removing_the_pool_stops_its_sleepers() -> None:
    pool = Engines(max_asleep=2, policy=PolicySpec(name="static", params={"count": 3}))
    pool.up("gen-0", "gen-1", "gen-2")
    pool.put_to_sleep("gen-2", 2)
    pool.load("gen-1", 1)
    pool.pin(1)
    assert pool.state("gen-1") is S.GOING_TO_SLEEP
    commands = pool.feed(Configured(t=pool.at(), config=Config()))
    assert {t.worker_id for t in of(commands, c.TerminateWorker)} == {"gen-1", "gen-2"}
    assert pool.state("gen-0") is S.DRAINING
    assert pool.reducer.state.workers["gen-1"].stop_cause is StopCause.POOL_REMOVED


def a_restart_repeats_pending_calls_and_asks_the_sleepers() -> None:
    pool = Engines(max_asleep=2, policy=PolicySpec(name="static", params={"count": 3}))
    pool.up("gen-0", "gen-1", "gen-2")
    pool.put_to_sleep("gen-2", 2)
    pool.pin(1)
    pool.load("gen-1", 0)
    assert pool.state("gen-1") is S.FALLING_ASLEEP
    again = pool.feed(WorkerAdopted(t=pool.at(), worker_id="gen-1"))
    assert [(s.worker_id, s.attempt) for s in of(again, c.SleepEngine)] == [("gen-1", 1)]
    ask = pool.feed(WorkerAdopted(t=pool.at(), worker_id="gen-2"))
    assert [(v.worker_id, v.port) for v in of(ask, c.VerifyAsleep)] == [("gen-2", 18002)]
    pool.asleep("gen-2")  # it does sleep
    assert pool.state("gen-2") is S.SLEEPING
    pool.asleep("gen-1")
    commands = pool.awake("gen-2")  # found awake after all: in service, one too many
    assert [a.alert for a in of(commands, c.RaiseAlert)] == [AlertName.ENGINE_CONTROL]
    # Evened out: back to sleep once a fresh count says nothing is in flight (the one from
    # before it slept is forgotten).
    assert [d.worker_id for d in of(commands, c.DrainEngine)] == ["gen-2"]
    assert [s.worker_id for s in of(pool.load("gen-2", 0), c.SleepEngine)] == ["gen-2"]
    pool.feed(PoolPinned(t=pool.at(), pool="gen", count=2))
    assert pool.state("gen-1") is S.WAKING
    woken = pool.feed(WorkerAdopted(t=pool.at(), worker_id="gen-1"))
    assert [(w.worker_id, w.attempt) for w in of(woken, c.WakeEngine)] == [("gen-1", 1)]


def a_call_repeated_after_a_long_restart_gets_its_own_deadline() -> None:
    pool = Engines()
    pool.up("gen-0", "gen-1")
    pool.put_to_sleep("gen-1", 1)
    pool.pin(2)
    assert pool.state("gen-1") is S.WAKING
    later = pool.t + 600.0  # deo was down far longer than the wake's deadline
    woken = pool.feed(WorkerAdopted(t=later, worker_id="gen-1"))
    assert [w.worker_id for w in of(woken, c.WakeEngine)] == ["gen-1"]
    assert pool.reducer.state.workers["gen-1"].deadline_t == later + 10.0
    commands = pool.feed(Tick(t=later + 1.0))
    assert not of(commands, c.TerminateWorker) and pool.state("gen-1") is S.WAKING
    pool.awake("gen-1")
    assert pool.state("gen-1") is S.ACTIVE


def ports_run_out() -> None:
    pool = Engines(
        ports=(18000, 18001), max_workers=2, max_asleep=1, policy=PolicySpec(name="static")
    )
    pool.pin(2)
    pool.up("gen-0", "gen-1")
    pool.put_to_sleep("gen-1", 1)
    pool.feed(DrainRequested(t=pool.at(), worker_id="gen-0"))
    # gen-0 drains (port held), gen-1 wakes for it; a third would need a port: none is free.
    assert pool.state("gen-1") is S.WAKING
    pool.feed(EngineWakeFailed(t=pool.at(), worker_id="gen-1", error="x"))
    commands = pool.feed(EngineWakeFailed(t=pool.at(), worker_id="gen-1", error="x"))
    assert not of(commands, c.SpawnWorker)
    assert AlertName.NO_FREE_PORTS in [a.alert for a in of(commands, c.RaiseAlert)]


def engine_events_for_a_worker_pool_are_refused() -> None:
    reducer = Reducer(check_invariants=True)
    envs = PoolSpec(
        name="envs", argv=["env"], policy=PolicySpec(name="static", params={"count": 1})
    )
    reducer.step(Configured(t=0.0, config=Config(pools=[envs])))
    with pytest.raises(Refused, match="not an engine"):
        reducer.step(EngineAsleep(t=1.0, worker_id="envs-0"))
    with pytest.raises(Refused, match="not an engine pool"):
        reducer.step(EnginesWakeRequested(t=1.0, pool="envs"))


def a_gpu_lost_under_a_sleeping_engine_stops_it() -> None:
    from core import GpuLost

    reducer = Engines(gpus=("0", "1", "2"), gpus_per_worker=1)
    reducer.up("gen-0", "gen-1")
    reducer.put_to_sleep("gen-1", 1)
    assert reducer.reducer.state.workers["gen-1"].gpus == ("1",)  # it keeps its GPU asleep
    reducer.feed(GpuLost(t=reducer.at(), gpu_id="1", error="fell off the bus"))
    assert reducer.state("gen-1") is S.STOPPING


def a_count_taken_while_routed_is_forgotten_when_the_engine_leaves_routing() -> None:
    pool = Engines(policy=PolicySpec(name="static", params={"count": 3}))
    pool.up("gen-0", "gen-1", "gen-2")
    pool.load("gen-2", 0)  # taken while routed: the router may send it more right after
    pool.load("gen-1", 0)
    commands = pool.pin(2)
    assert pool.state("gen-2") is S.GOING_TO_SLEEP
    assert not of(commands, c.SleepEngine)  # no sleep call on a count from while it was routed
    assert pool.reducer.state.workers["gen-2"].in_flight_requests is None
    assert not of(pool.load("gen-2", 2), c.SleepEngine)  # reported after it left routing
    assert [s.worker_id for s in of(pool.load("gen-2", 0), c.SleepEngine)] == ["gen-2"]
    commands = pool.feed(DrainRequested(t=pool.at(), worker_id="gen-1"))
    assert pool.state("gen-1") is S.DRAINING  # not stopped on its stale 0
    assert not of(commands, c.TerminateWorker)
    stop = pool.load("gen-1", 0)
    assert [t.worker_id for t in of(stop, c.TerminateWorker)] == ["gen-1"]


def a_count_from_before_a_cancelled_sleep_is_forgotten() -> None:
    pool = Engines()
    pool.up("gen-0", "gen-1")
    pool.pin(1)
    pool.load("gen-1", 2)  # reported while going to sleep
    pool.pin(2)  # called back: routed again, so that count says nothing any more
    assert pool.state("gen-1") is S.ACTIVE
    assert pool.reducer.state.workers["gen-1"].in_flight_requests is None


def scale_down_puts_an_active_engine_to_sleep_rather_than_stop_a_starting_one() -> None:
    pool = Engines(policy=PolicySpec(name="static", params={"count": 3}))
    pool.up("gen-0", "gen-1")
    pool.pid += 1
    pool.feed(WorkerStarted(t=pool.at(), worker_id="gen-2", pid=pool.pid, start_time=pool.pid))
    commands = pool.pin(2)
    assert pool.state("gen-2") is S.STARTING  # its cold start goes on
    assert pool.state("gen-1") is S.GOING_TO_SLEEP  # the newest active one sleeps instead
    assert not of(commands, c.TerminateWorker)


def with_nowhere_to_sleep_a_starting_engine_goes_first() -> None:
    pool = Engines(max_asleep=0, policy=PolicySpec(name="static", params={"count": 3}))
    pool.up("gen-0", "gen-1")
    pool.pin(2)  # gen-2 still requested
    assert pool.state("gen-2") is S.STOPPING
    assert (pool.state("gen-0"), pool.state("gen-1")) == (S.ACTIVE, S.ACTIVE)


SCENARIOS: list[Callable[[], None]] = [
    scale_down_puts_an_active_engine_to_sleep_rather_than_stop_a_starting_one,
    with_nowhere_to_sleep_a_starting_engine_goes_first,
    a_count_taken_while_routed_is_forgotten_when_the_engine_leaves_routing,
    a_count_from_before_a_cancelled_sleep_is_forgotten,
    spawns_on_the_lowest_free_ports,
    scale_down_sleeps_and_scale_up_wakes,
    a_sleep_called_off_before_its_call,
    the_drain_before_sleep_times_out,
    a_failed_sleep_is_retried_then_the_engine_stopped,
    a_sleep_that_never_answers_reaches_its_deadline,
    a_failed_wake_is_retried_then_replaced,
    a_wake_that_never_answers_is_replaced,
    max_asleep_stops_the_one_asleep_longest,
    past_max_asleep_while_one_is_on_its_way_the_next_exits,
    max_asleep_zero_always_stops,
    a_lower_max_asleep_stops_the_extra_sleepers,
    the_operator_wakes_every_engine_and_the_policy_resumes_after,
    a_timed_wake_hold_ends_on_its_own,
    the_operator_drains_one_engine_until_nothing_is_in_flight,
    draining_asleep_engines,
    draining_a_waking_engine,
    removing_the_pool_stops_its_sleepers,
    a_restart_repeats_pending_calls_and_asks_the_sleepers,
    a_call_repeated_after_a_long_restart_gets_its_own_deadline,
    ports_run_out,
    engine_events_for_a_worker_pool_are_refused,
    a_gpu_lost_under_a_sleeping_engine_stops_it,
]


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda f: f.__name__)
def test_scenario(scenario: Callable[[], None]) -> None:
    scenario()


def test_the_scenarios_take_every_engine_row_of_the_lifecycle_table(
    rows: set[tuple[WorkerState, Trigger]],
) -> None:
    for scenario in SCENARIOS:
        scenario()
    engine_states = ASLEEP | {S.WAKING}
    engine_rows = {
        (state, trigger)
        for (state, trigger), target in TRANSITIONS.items()
        if state in engine_states or target in engine_states
    }
    # Signs of life and exits are the rows every state has; the worker table covers how they
    # are taken, and these states take them the same way.
    common = {(s, t) for s, t in engine_rows if t in (Trigger.READY, Trigger.EXIT)}
    assert engine_rows - common - rows == set()


def test_a_drained_engine_still_busy_at_its_deadline_is_stopped() -> None:
    pool = Engines()
    pool.up("gen-0", "gen-1")
    pool.feed(DrainRequested(t=pool.at(), worker_id="gen-0"))
    pool.load("gen-0", 3)
    deadline = pool.reducer.state.workers["gen-0"].deadline_t
    assert deadline is not None
    commands = pool.feed(Tick(t=deadline))
    [stop] = of(commands, c.TerminateWorker)
    assert stop.worker_id == "gen-0" and "3 request(s) in flight" in stop.reason
    assert pool.reducer.state.workers["gen-0"].stop_cause is StopCause.OPERATOR


@settings(max_examples=60, deadline=None)
@given(
    asleep=st.integers(min_value=1, max_value=3),
    cordoned=st.sets(st.integers(min_value=0, max_value=3)),
    target=st.integers(min_value=1, max_value=4),
)
def test_no_engine_is_woken_on_a_cordoned_gpu(asleep: int, cordoned: set[int], target: int) -> None:
    # Four GPUs, one engine each: gen-0 stays awake, the next ``asleep`` go to sleep.
    pool = Engines(gpus=("0", "1", "2", "3"), gpus_per_worker=1, max_workers=4, max_asleep=3)
    pool.pin(1 + asleep)
    pool.up(*(f"gen-{i}" for i in range(1 + asleep)))
    for i in range(asleep, 0, -1):
        pool.put_to_sleep(f"gen-{i}", i)
    for gpu in sorted(cordoned):
        pool.feed(GpuCordonRequested(t=pool.at(), gpu_id=str(gpu)))
    workers = pool.reducer.state.workers
    on_cordon = {w for w, worker in workers.items() if set(worker.gpus) & set(map(str, cordoned))}
    commands = pool.pin(target)
    woken = {command.worker_id for command in of(commands, c.WakeEngine)}
    assert not woken & on_cordon, (woken, on_cordon)
    for worker_id in on_cordon:
        assert pool.state(worker_id) is not S.WAKING
    # Those that could wake did, before anything new was started.
    free = [w for w, worker in workers.items() if worker.state is S.SLEEPING and w not in on_cordon]
    assert len(woken) == min(len(free), max(target - 1, 0))
