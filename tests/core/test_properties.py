"""Property tests: deo's invariants over arbitrary event sequences.

A ``RuleBasedStateMachine`` drives the reducer with random events, right and deliberately wrong,
the way the runtime's sources would (plus what no well-behaved source sends). After every step
the invariants of :mod:`core.invariants` are checked by the reducer itself
(``check_invariants=True``); the machine also keeps its own history to check the time-based
invariants (4: no flapping, 5: backoff spacing) independently of the reducer's bookkeeping, the
codec round-trip (8) of every event and command, and at teardown determinism (7): the accepted
events, reduced again from scratch, give the same commands.
"""

from __future__ import annotations

import math
from typing import Any

import attrs
import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from core import (
    AutoscalingPaused,
    AutoscalingResumed,
    Command,
    Config,
    Configured,
    CordonRules,
    CrashLoopRules,
    DrainRequested,
    DrainWorker,
    EngineAsleep,
    EngineAwake,
    EngineLoadSampled,
    EngineSleepFailed,
    EnginesWakeRequested,
    EngineWakeFailed,
    Event,
    GpuCordonRequested,
    GpuLost,
    GpuSampled,
    GpuUncordonRequested,
    InvalidEvent,
    InvariantViolation,
    KillWorker,
    LoadSampled,
    PolicySpec,
    PoolPinned,
    PoolSpec,
    QueueSampled,
    RaiseAlert,
    Reducer,
    ScalePool,
    SourceDown,
    SpawnFailed,
    SpawnWorker,
    TerminateWorker,
    Tick,
    WorkerAdopted,
    WorkerExited,
    WorkerHeartbeat,
    WorkerLost,
    WorkerReady,
    WorkersSeen,
    WorkerStarted,
    decode,
    encode,
    reduce,
)
from core.commands import DrainEngine, SleepEngine
from core.invariants import free_healthy_gpus, state_violations
from core.lifecycle import ASLEEP, COUNTED, DEADLINE_ACTIONS, TRANSITIONS, Trigger, WorkerState
from core.state import State
from core.step import Step
from core.vocabulary import AlertName

POLICIES = st.sampled_from(
    [
        PolicySpec(name="static", params={"count": 2}),
        PolicySpec(name="static", params={"count": 5}),
        PolicySpec(name="hpa", params={"target_per_worker": 4.0}),
        PolicySpec(name="threshold", params={"capacity_per_worker": 4.0, "stability_s": 2.0}),
        PolicySpec(name="buffer", params={"refill_s": 10.0, "down_cooldown_s": 5.0}),
    ]
)


@st.composite
def engine_settings(draw: st.DrawFn, max_workers: int) -> dict[str, Any]:
    """What makes a pool an engine pool (the pool called "engines", half the time)."""
    return {
        "kind": "engine",
        "engine": draw(st.sampled_from(["vllm", "sglang"])),
        "argv": ["engine", "--port", "{port}"],
        "ports": (18000, 18000 + max_workers - 1 + draw(st.integers(0, 2))),
        "max_asleep": draw(st.integers(0, 2)),
        "control_attempts": draw(st.integers(1, 2)),
        "control_timeout_s": draw(st.sampled_from([2.0, 10.0])),
    }


@st.composite
def pool_specs(draw: st.DrawFn, name: str, gpus: int) -> PoolSpec:
    minimum = draw(st.integers(0, 3))
    maximum = draw(st.integers(max(minimum, 1), 6))
    engine = draw(engine_settings(maximum)) if name == "engines" and draw(st.booleans()) else {}
    return PoolSpec(
        name=name,
        argv=engine.pop("argv", ["worker", "{worker_id}"]),
        **engine,
        min_workers=minimum,
        max_workers=maximum,
        gpus_per_worker=draw(st.integers(0, min(gpus, 2))),
        policy=draw(POLICIES),
        require_ready=draw(st.booleans()),
        start_timeout_s=draw(st.sampled_from([5.0, 30.0])),
        heartbeat_grace_s=draw(st.sampled_from([None, 4.0, 20.0])),
        drain_timeout_s=draw(st.sampled_from([2.0, 10.0, "auto"])),
        stop_timeout_s=draw(st.sampled_from([1.0, 3.0])),
        metrics_stale_s=draw(st.sampled_from([5.0, 30.0])),
        stabilization_s=draw(st.sampled_from([0.0, 10.0, 60.0])),
        max_starting=draw(st.sampled_from([1, 2, 16])),
        crash_loop=CrashLoopRules(
            early_exit_s=draw(st.sampled_from([3.0, 20.0])),
            backoff_base_s=1.0,
            backoff_cap_s=draw(st.sampled_from([4.0, 30.0])),
            alert_after=draw(st.integers(1, 3)),
        ),
    )


@st.composite
def configs(draw: st.DrawFn) -> Config:
    gpus = draw(st.integers(0, 4))
    names = draw(
        st.lists(
            st.sampled_from(["envs", "engines", "judges"]), min_size=1, max_size=3, unique=True
        )
    )
    return Config(
        pools=[draw(pool_specs(name, gpus)) for name in names],
        gpus=[str(i) for i in range(gpus)],
        cordon=CordonRules(uncordon_after_s=draw(st.sampled_from([0.0, 5.0, 30.0]))),
    )


def round_trips(value: Any) -> bool:
    return bool(decode(encode(value)) == value)


class ReducerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.reducer = Reducer(check_invariants=True)
        self.t = 0.0
        self.pid = 100
        self.accepted: list[tuple[Event, list[Command]]] = []
        self.last_policy_up: dict[str, float] = {}
        #: Workers seen to exit, for re-feeding their end.
        self.ended: set[str] = set()

    # --- plumbing ---------------------------------------------------------------------------------

    def feed(self, event: Event) -> list[Command]:
        assert round_trips(event), event
        before = self.reducer.state
        try:
            commands = self.reducer.step(event)
        except InvalidEvent:
            assert self.reducer.state is before  # refused input changes nothing
            return []
        for command in commands:
            assert round_trips(command), command
            self.check_history(before, command)
        self.check_backoff_reset(before)
        for pool in set(self.last_policy_up) - set(self.state.pools):
            # Removed with no worker left: declared again, it is a new pool with no history.
            del self.last_policy_up[pool]
        self.accepted.append((event, commands))
        self.ended |= set(before.workers) - set(self.state.workers)
        return commands

    def check_replacement(self, before: State, pool: str, commands: list[Command]) -> None:
        """After a worker ends, its pool is refilled to its target unless backoff or GPUs forbid."""
        after = self.state.pools.get(pool)
        if after is None or any(isinstance(c, SpawnWorker) and c.pool == pool for c in commands):
            return
        short = self.state.counted(pool) < after.target
        backing_off = bool(after.retries) and self.state.now < after.backoff_until_t
        no_gpus = free_healthy_gpus(self.state) < after.spec.gpus_per_worker
        no_ports = (AlertName.NO_FREE_PORTS, pool) in self.state.alerts
        starting = [
            w
            for w in self.state.workers.values()
            if w.pool == pool and w.state in (WorkerState.REQUESTED, WorkerState.STARTING)
        ]
        if len(starting) >= after.spec.max_starting:
            return  # the rest follow as these come up
        assert not short or backing_off or no_gpus or no_ports, (
            f"{pool} left at {self.state.counted(pool)} < target {after.target} with GPUs free "
            f"and no backoff"
        )

    def check_backoff_reset(self, before: State) -> None:
        """5. A slot's crash loop ends only when its worker stayed up for ``early_exit_s``."""
        for worker_id, old in before.workers.items():
            new = self.state.workers.get(worker_id)
            if new is None or not old.attempt or new.attempt:
                continue
            early = self.state.pools[new.pool].spec.crash_loop.early_exit_s
            assert new.started_t is not None and self.state.now - new.started_t >= early, (
                f"5: {worker_id}'s slot failures reset at t={self.state.now} without a healthy run"
            )

    def check_history(self, before: State, command: Command) -> None:
        if isinstance(command, ScalePool) and command.source == "policy":
            spec = before.pools[command.pool].spec  # a policy only decides for a known pool
            if command.target > command.previous:
                after = self.state.pools.get(command.pool)
                # A guess before anything was measured (a cold start) opens no window.
                if after is not None and after.last_scale_up_t == self.state.now:
                    self.last_policy_up[command.pool] = self.state.now
            elif command.pool in self.last_policy_up:
                since = self.state.now - self.last_policy_up[command.pool]
                assert since >= spec.stabilization_s, f"4: flap on {command.pool} after {since}s"
        if isinstance(command, SpawnWorker):
            pool = before.pools.get(command.pool)
            worker = self.state.workers.get(command.worker_id)
            if pool is not None and worker is not None and worker.attempt:
                rules = pool.spec.crash_loop
                earliest = min(
                    (t + rules.backoff_s(n) for t, n in pool.retries if n == worker.attempt),
                    default=math.inf,
                )
                assert self.t >= earliest, f"5: {command.worker_id} spawned before {earliest}"

    @property
    def state(self) -> State:
        return self.reducer.state

    def workers(self, *states: str) -> list[str]:
        return sorted(
            w.worker_id
            for w in self.state.workers.values()
            if not states or w.state.value in states
        )

    # --- rules ------------------------------------------------------------------------------------

    @initialize(config=configs())
    def configure(self, config: Config) -> None:
        self.feed(Configured(t=self.t, config=config))

    @rule(
        dt=st.sampled_from([0.1, 0.5, 1.0, 3.0, 10.0, 45.0]),
        interval=st.sampled_from([None, 1.0]),
    )
    def tick(self, dt: float, interval: float | None) -> None:
        self.t += dt
        before = self.state
        commands = self.feed(Tick(t=self.t, interval_s=interval))
        if self.state.last_tick_skipped:
            # After a stall of deo itself: no worker judged, every liveness credited.
            assert not any(isinstance(c, (TerminateWorker, KillWorker)) for c in commands)
            return
        # Each worker past its deadline takes its state's deadline action: one rung, one command.
        for worker in before.workers.values():
            action = DEADLINE_ACTIONS.get(worker.state)
            if action is None or worker.deadline_t is None or worker.deadline_t > self.t:
                continue
            expected = TRANSITIONS[(worker.state, action)]
            now = self.state.workers.get(worker.worker_id)
            assert (now.state if now else WorkerState.EXITED) is expected, (worker, now)
            mine = [c for c in commands if getattr(c, "worker_id", None) == worker.worker_id]
            if action is Trigger.TERMINATE:
                assert [type(c) for c in mine] == [TerminateWorker], mine
            elif action is Trigger.KILL:
                assert [type(c) for c in mine] == [KillWorker], mine
            elif action is Trigger.RELEASE:  # a drain before sleep ran out: the sleep call
                assert [type(c) for c in mine] == [SleepEngine], mine
            else:
                alerts = [c for c in commands if isinstance(c, RaiseAlert)]
                unkillable = [a for a in alerts if a.subject == worker.worker_id]
                assert mine == []
                # Raised once per subject: a pool removed and declared again reuses worker ids,
                # and an earlier worker's alert under the same id may still be active.
                active = (AlertName.UNKILLABLE_WORKER, worker.worker_id) in before.alerts
                assert [a.alert for a in unkillable] == (
                    [AlertName.UNKILLABLE_WORKER] if worker.pid is not None and not active else []
                )

    @rule(config=configs())
    def reconfigure(self, config: Config) -> None:
        self.feed(Configured(t=self.t, config=config))

    @rule(data=st.data())
    def start(self, data: st.DataObject) -> None:
        ids = [*self.workers("requested", "draining", "stopping", "killed"), "envs-999"]
        self.pid += 1
        worker_id = data.draw(st.sampled_from(ids))
        before = self.state.workers.get(worker_id)
        commands = self.feed(
            WorkerStarted(t=self.t, worker_id=worker_id, pid=self.pid, start_time=self.pid)
        )
        if before is None or before.pid is not None:
            return  # refused
        # Started after deo decided to let it go: the signal it missed, once, with its pid.
        engine = self.state.pools[before.pool].spec.is_engine
        repeated = {
            WorkerState.DRAINING: [DrainEngine if engine else DrainWorker],
            WorkerState.STOPPING: [TerminateWorker],
            WorkerState.KILLED: [KillWorker],
        }.get(before.state, [])
        mine = [c for c in commands if getattr(c, "worker_id", None) == worker_id]
        assert [type(c) for c in mine] == repeated, (before.state, mine)
        assert all(getattr(c, "pid", self.pid) == self.pid for c in mine)

    @rule(data=st.data())
    def seen(self, data: st.DataObject) -> None:
        ids = data.draw(st.sets(st.sampled_from([*self.workers(), *self.ended, "judges-0"])))
        assert self.feed(WorkersSeen(t=self.t, worker_ids=ids)) == []
        # Always accepted: ids deo never made (judges-0, maybe) are skipped, the rest refreshed.
        for worker_id in ids & set(self.state.workers):
            assert self.state.last_seen[worker_id] == self.state.now
        assert set(self.state.last_seen) <= set(self.state.workers)

    @rule(data=st.data(), kind=st.sampled_from(["ready", "heartbeat", "adopted"]))
    def report(self, data: st.DataObject, kind: str) -> None:
        worker_id = data.draw(st.sampled_from([*self.workers(), "judges-0", "nonsense"]))
        event = {"ready": WorkerReady, "heartbeat": WorkerHeartbeat, "adopted": WorkerAdopted}[kind]
        self.feed(event(t=self.t, worker_id=worker_id))

    @rule(data=st.data(), how=st.sampled_from(["code0", "code1", "signal9", "spawn", "lost"]))
    def end(self, data: st.DataObject, how: str) -> None:
        ids = self.workers()
        if not ids:
            return
        worker_id = data.draw(st.sampled_from(ids))
        if how == "spawn":
            event: Event = SpawnFailed(t=self.t, worker_id=worker_id, error="exec failed")
        elif how == "lost":
            event = WorkerLost(t=self.t, worker_id=worker_id, reason="gone after restart")
        elif how == "signal9":
            event = WorkerExited(t=self.t, worker_id=worker_id, signal=9)
        else:
            event = WorkerExited(t=self.t, worker_id=worker_id, exit_code=int(how[-1]))
        before = self.state
        commands = self.feed(event)
        if worker_id not in self.state.workers:
            self.check_replacement(before, before.workers[worker_id].pool, commands)

    @precondition(lambda self: bool(self.ended - set(self.state.workers)))
    @rule(data=st.data(), how=st.sampled_from(["exit", "spawn", "lost"]))
    def repeat_end(self, data: st.DataObject, how: str) -> None:
        # A report about a worker that already ended changes nothing but the clock.
        worker_id = data.draw(st.sampled_from(sorted(self.ended - set(self.state.workers))))
        event: Event = {
            "exit": WorkerExited(t=self.t, worker_id=worker_id, exit_code=1),
            "spawn": SpawnFailed(t=self.t, worker_id=worker_id, error="exec failed"),
            "lost": WorkerLost(t=self.t, worker_id=worker_id, reason="gone"),
        }[how]
        before = self.state
        assert self.feed(event) == []
        assert attrs.evolve(self.state, now=before.now) == before

    @rule(data=st.data(), queued=st.integers(0, 600), steps=st.integers(0, 3))
    def queue_sample(self, data: st.DataObject, queued: int, steps: int) -> None:
        name = data.draw(st.sampled_from([*sorted(self.state.pools), "nope"]))
        pool = self.state.pools.get(name)
        step = (pool.queue.trainer_step if pool and pool.queue else 0) + steps
        self.feed(
            QueueSampled(
                t=self.t, pool=name, queued_sequences=queued, batch_size_seqs=64, trainer_step=step
            )
        )

    @rule(data=st.data(), in_flight=st.integers(0, 80))
    def load_sample(self, data: st.DataObject, in_flight: int) -> None:
        name = data.draw(st.sampled_from([*sorted(self.state.pools), "nope"]))
        self.feed(LoadSampled(t=self.t, pool=name, in_flight_requests=in_flight))

    @precondition(lambda self: bool(self.state.pools))
    @rule(data=st.data())
    def source_down(self, data: st.DataObject) -> None:
        name = data.draw(st.sampled_from(sorted(self.state.pools)))
        self.feed(SourceDown(t=self.t, pool=name, error="connection refused"))

    @rule(data=st.data(), action=st.sampled_from(["pause", "resume", "pin", "unpin", "drain"]))
    def operator(self, data: st.DataObject, action: str) -> None:
        pools = sorted(self.state.pools)
        name = data.draw(st.sampled_from([*pools, "nope"]))
        if action == "pause":
            self.feed(AutoscalingPaused(t=self.t, pool=data.draw(st.sampled_from([None, name]))))
        elif action == "resume":
            self.feed(AutoscalingResumed(t=self.t, pool=data.draw(st.sampled_from([None, name]))))
        elif action == "pin":
            self.feed(PoolPinned(t=self.t, pool=name, count=data.draw(st.integers(0, 7))))
        elif action == "unpin":
            self.feed(PoolPinned(t=self.t, pool=name, count=None))
        else:
            ids = [*self.workers(), "envs-12345"]
            worker_id = data.draw(st.sampled_from(ids))
            before = self.state.workers.get(worker_id)
            commands = self.feed(DrainRequested(t=self.t, worker_id=worker_id))
            drains = [c for c in commands if isinstance(c, DrainWorker | DrainEngine)]
            after = self.state.workers[worker_id].state if before is not None else None
            if before is not None and before.state in ASLEEP - {WorkerState.GOING_TO_SLEEP}:
                assert after is WorkerState.STOPPING  # nothing in flight: it exits now
            elif before is not None and (
                before.state in COUNTED or before.state is WorkerState.GOING_TO_SLEEP
            ):
                assert [d.worker_id for d in drains] == [worker_id]
                # An engine with nothing in flight is stopped at once.
                assert after in (WorkerState.DRAINING, WorkerState.STOPPING)
            else:
                assert commands == []  # already leaving, or refused

    @rule(
        data=st.data(),
        kind=st.sampled_from(
            ["hot", "throttle", "memory", "errors", "clean", "lost", "cordon", "uncordon"]
        ),
    )
    def gpu(self, data: st.DataObject, kind: str) -> None:
        gpu_id = data.draw(st.sampled_from([*sorted(self.state.gpus), "9"]))
        total = 80 << 30
        fields: dict[str, Any] = {
            "t": self.t,
            "gpu_id": gpu_id,
            "memory_used_bytes": 0,
            "memory_total_bytes": total,
            "temperature_c": 50.0,
        }
        if kind == "hot":
            fields["temperature_c"] = 95.0
        elif kind == "throttle":
            fields["throttle_reasons"] = {"power"}
        elif kind == "memory":
            fields["memory_used_bytes"] = total
        elif kind == "errors":
            fields["new_errors"] = 1
        if kind == "lost":
            self.feed(GpuLost(t=self.t, gpu_id=gpu_id, error="fell off the bus"))
        elif kind == "cordon":
            self.feed(GpuCordonRequested(t=self.t, gpu_id=gpu_id))
        elif kind == "uncordon":
            self.feed(GpuUncordonRequested(t=self.t, gpu_id=gpu_id))
        else:
            self.feed(GpuSampled(**fields))

    @rule(
        data=st.data(),
        kind=st.sampled_from(["asleep", "awake", "sleep_failed", "wake_failed"]),
    )
    def engine_answer(self, data: st.DataObject, kind: str) -> None:
        worker_id = data.draw(st.sampled_from([*self.workers(), "engines-77"]))
        before = self.state.workers.get(worker_id)
        event: Event = {
            "asleep": EngineAsleep(t=self.t, worker_id=worker_id),
            "awake": EngineAwake(t=self.t, worker_id=worker_id),
            "sleep_failed": EngineSleepFailed(t=self.t, worker_id=worker_id, error="500"),
            "wake_failed": EngineWakeFailed(t=self.t, worker_id=worker_id, error="timed out"),
        }[kind]
        self.feed(event)
        after = self.state.workers.get(worker_id)
        if before is not None and after is not None:
            if kind == "asleep" and before.state is WorkerState.FALLING_ASLEEP:
                assert after.state is WorkerState.SLEEPING and after.asleep_t == self.state.now
            if kind == "awake" and before.state is WorkerState.WAKING:
                assert after.state is WorkerState.ACTIVE
            if before.state not in ASLEEP | {WorkerState.WAKING}:
                assert after.state is before.state  # a late answer changes nothing

    @rule(data=st.data(), in_flight=st.integers(0, 4))
    def engine_load(self, data: st.DataObject, in_flight: int) -> None:
        worker_id = data.draw(st.sampled_from([*self.workers(), "engines-77"]))
        worker = self.state.workers.get(worker_id)
        pool = worker.pool if worker is not None else "engines"
        self.feed(
            EngineLoadSampled(
                t=self.t, pool=pool, worker_id=worker_id, in_flight_requests=in_flight
            )
        )

    @rule(data=st.data(), hold_s=st.sampled_from([None, 5.0, 60.0]))
    def wake_all(self, data: st.DataObject, hold_s: float | None) -> None:
        name = data.draw(st.sampled_from([*sorted(self.state.pools), "nope"]))
        self.feed(EnginesWakeRequested(t=self.t, pool=name, hold_s=hold_s))

    @rule(back=st.sampled_from([1.0, 30.0]))
    def late_event(self, back: float) -> None:
        # An event stamped in the past is taken at the current time, never rewinding it.
        before = self.state.now
        self.feed(Tick(t=max(self.t - back, 0.0)))
        assert self.state.now == before

    # --- invariants -------------------------------------------------------------------------------

    @invariant()
    def state_is_sound(self) -> None:
        assert state_violations(self.state) == []

    @invariant()
    def state_round_trips(self) -> None:
        assert round_trips(self.state)

    def teardown(self) -> None:
        state = State()
        for event, commands in self.accepted:
            state, again = reduce(state, event)
            assert again == commands, f"7: {type(event).__name__} at t={event.t} not deterministic"
        assert state == self.reducer.state


ReducerMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestReducerMachine = ReducerMachine.TestCase


# --- the invariants catch plausible wrong reducers ---------------------------------------------


def refuses_to_spawn(
    step: Step, pool: Any, count: int, starting: int, free: list[str]
) -> tuple[int, int]:
    """A wrong reducer: never spawns, and (through _check_min) blames the GPUs for it."""
    return count, starting


def never_a_crash(step: Step, worker: Any) -> bool:
    """A wrong reducer: no exit ever counts as a crash, so crash loops never back off."""
    return False


MUTATIONS = [
    pytest.param("_grow", refuses_to_spawn, "2: pool envs has 0 < min 1 workers", id="no-spawn"),
    pytest.param("is_failure", never_a_crash, "5: pool envs had 1 early exit", id="no-crash"),
]


def run_into_the_mutation(reducer: Reducer) -> None:
    spec = PoolSpec(
        name="envs",
        argv=["worker"],
        min_workers=1,
        max_workers=2,
        policy=PolicySpec(name="static", params={"count": 1}),
    )
    reducer.step(Configured(t=0.0, config=Config(pools=[spec])))
    reducer.step(WorkerStarted(t=1.0, worker_id="envs-0", pid=7, start_time=7))
    reducer.step(WorkerExited(t=2.0, worker_id="envs-0", exit_code=1))  # 1 s: an early crash


def test_the_right_reducer_passes_the_mutation_scenario() -> None:
    reducer = Reducer(check_invariants=True)
    run_into_the_mutation(reducer)
    assert reducer.state.pools["envs"].failures == 1


@pytest.mark.parametrize(("method", "mutant", "message"), MUTATIONS)
def test_the_invariants_catch_a_wrong_reducer(
    monkeypatch: pytest.MonkeyPatch, method: str, mutant: Any, message: str
) -> None:
    monkeypatch.setattr(Step, method, mutant)
    with pytest.raises(InvariantViolation, match=message):
        run_into_the_mutation(Reducer(check_invariants=True))


@pytest.mark.parametrize(("method", "mutant", "message"), MUTATIONS)
def test_the_state_machine_catches_a_wrong_reducer(
    monkeypatch: pytest.MonkeyPatch, method: str, mutant: Any, message: str
) -> None:
    monkeypatch.setattr(Step, method, mutant)
    quick = settings(
        max_examples=200,
        stateful_step_count=60,
        deadline=None,
        database=None,
        phases=[Phase.generate],  # the first failure is enough: no shrinking
        suppress_health_check=list(HealthCheck),
    )
    with pytest.raises(InvariantViolation, match=message.split(" pool ")[0]):
        run_state_machine_as_test(ReducerMachine, settings=quick)
