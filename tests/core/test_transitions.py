"""Every lifecycle state x every worker event, through the reducer, against a table written out.

A worker ``envs-0`` is put in each state by real events, then fed one event (the states only
engines reach are tested in ``test_engines.py``). Each row says what must follow: the triggers
the reducer takes for ``envs-0`` (each a row of ``core.lifecycle.TRANSITIONS``), the state it
ends in ("exited", with "crash" when its pool counts the exit as a failure) or the error that
refuses the event, and the commands. Any change of behaviour shows as a failing row.

The pool: one worker on one of two GPUs, readiness required; drain 20 s, stop 5 s, start 10 s,
heartbeat grace 60 s, early exit 30 s. A worker drained or stopped by deo is replaced at once by
``envs-1``, which the set-up starts (pid 101) so that only ``envs-0`` is under test.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

import core.lifecycle
import core.step
from core import (
    Command,
    Config,
    Configured,
    CordonGpu,
    CrashLoopRules,
    DeoError,
    DrainRequested,
    DrainWorker,
    Event,
    GpuLost,
    IllegalTransition,
    KillWorker,
    PolicySpec,
    PoolPinned,
    PoolSpec,
    RaiseAlert,
    Reducer,
    ResolveAlert,
    SpawnFailed,
    SpawnWorker,
    TerminateWorker,
    Tick,
    Trigger,
    WorkerAdopted,
    WorkerExited,
    WorkerHeartbeat,
    WorkerLost,
    WorkerReady,
    WorkerStarted,
    WorkerState,
)
from core.lifecycle import ASLEEP, TRANSITIONS

#: States only an engine pool's workers reach.
ENGINE_STATES = ASLEEP | {WorkerState.WAKING}

S = WorkerState

SPEC = PoolSpec(
    name="envs",
    argv=["worker", "{worker_id}"],
    min_workers=0,
    max_workers=4,
    gpus_per_worker=1,
    require_ready=True,
    policy=PolicySpec(name="static", params={"count": 1}),
    drain_timeout_s=20,
    stop_timeout_s=5,
    start_timeout_s=10,
    heartbeat_grace_s=60,
    crash_loop=CrashLoopRules(early_exit_s=30, backoff_base_s=2, backoff_cap_s=8, alert_after=3),
)


def _start_replacement(reducer: Reducer, t: float) -> None:
    reducer.step(WorkerStarted(t=t, worker_id="envs-1", pid=101, start_time=101))
    reducer.step(WorkerReady(t=t, worker_id="envs-1"))


def put_in(situation: str) -> Reducer:
    """A reducer whose worker envs-0 is in ``situation`` (a state; "_unstarted": no pid yet)."""
    reducer = Reducer(check_invariants=True)
    reducer.step(Configured(t=0.0, config=Config(pools=[SPEC], gpus=["0", "1"])))
    if situation == "requested":
        return reducer
    if situation == "draining_unstarted":
        reducer.step(PoolPinned(t=1.0, pool="envs", count=0))  # drained before it started
        return reducer
    if situation in ("stopping_unstarted", "killed_unstarted"):
        reducer.step(Tick(t=10.0))  # never started: SIGTERM (deadline 15), a failed start
        reducer.step(Tick(t=12.0))  # its slot's backoff over: envs-1 spawned
        _start_replacement(reducer, 12.0)
        if situation == "killed_unstarted":
            reducer.step(Tick(t=15.0))  # SIGKILL (deadline 20)
        return reducer
    reducer.step(WorkerStarted(t=1.0, worker_id="envs-0", pid=100, start_time=100))
    if situation == "starting":
        return reducer
    reducer.step(WorkerReady(t=2.0, worker_id="envs-0"))
    if situation == "active":
        return reducer
    reducer.step(DrainRequested(t=3.0, worker_id="envs-0"))  # deadline 23, envs-1 spawned
    _start_replacement(reducer, 3.0)
    if situation == "draining":
        return reducer
    reducer.step(Tick(t=23.0))  # SIGTERM, deadline 28
    if situation == "stopping":
        return reducer
    assert situation == "killed"
    reducer.step(Tick(t=28.0))  # SIGKILL, deadline 33
    return reducer


def tick_past_deadline(reducer: Reducer) -> Tick:
    """A tick at envs-0's deadline, or just past the timeout its state waits on."""
    worker = reducer.state.workers["envs-0"]
    if worker.deadline_t is not None:
        return Tick(t=worker.deadline_t)
    if worker.state is S.REQUESTED:
        return Tick(t=worker.requested_t + SPEC.start_timeout_s)
    if worker.state is S.STARTING:
        assert worker.started_t is not None
        return Tick(t=worker.started_t + SPEC.start_timeout_s)
    assert SPEC.heartbeat_grace_s is not None
    return Tick(t=reducer.state.last_seen["envs-0"] + SPEC.heartbeat_grace_s + 1)


EVENTS: dict[str, Callable[[Reducer, float], Event]] = {
    "started": lambda r, t: WorkerStarted(t=t, worker_id="envs-0", pid=200, start_time=200),
    "ready": lambda r, t: WorkerReady(t=t, worker_id="envs-0"),
    "heartbeat": lambda r, t: WorkerHeartbeat(t=t, worker_id="envs-0"),
    "exited": lambda r, t: WorkerExited(t=t, worker_id="envs-0", exit_code=1),
    "spawn_failed": lambda r, t: SpawnFailed(t=t, worker_id="envs-0", error="exec failed"),
    "adopted": lambda r, t: WorkerAdopted(t=t, worker_id="envs-0"),
    "lost": lambda r, t: WorkerLost(t=t, worker_id="envs-0", reason="no such process"),
    "drain": lambda r, t: DrainRequested(t=t, worker_id="envs-0"),
    "gpu_lost": lambda r, t: GpuLost(t=t, gpu_id="0", error="fell off the bus"),
    "tick": lambda r, t: tick_past_deadline(r),
}


def summary(command: Command) -> str:
    match command:
        case SpawnWorker(worker_id=w, gpus=g):
            return f"spawn {w} on {','.join(g)}"
        case DrainWorker(worker_id=w, pid=p, deadline_t=d):
            return f"drain {w} pid {p} until {d:g}"
        case TerminateWorker(worker_id=w, pid=p, deadline_t=d):
            return f"terminate {w} pid {p} until {d:g}"
        case KillWorker(worker_id=w, pid=p):
            return f"kill {w} pid {p}"
        case RaiseAlert(alert=a, subject=s):
            return f"raise {a} {s}"
        case ResolveAlert(alert=a, subject=s):
            return f"resolve {a} {s}"
        case CordonGpu(gpu_id=g, causes=causes):
            return f"cordon {g} {','.join(sorted(causes))}"
    return type(command).__name__


ALREADY_STARTED = "Refused: WorkerStarted: worker 'envs-0' already started as pid"
RUNNING = "Refused: SpawnFailed: worker 'envs-0' is running as pid"
NEVER_STARTED = "Refused: WorkerAdopted: worker 'envs-0' never started"
GPU_LOST = ["cordon 0 lost", "raise gpu_lost 0"]

# (situation, event, triggers taken for envs-0, outcome, commands)
ROWS: list[tuple[str, str, list[str], str, list[str]]] = [
    # --- requested: SpawnWorker sent, no process yet ---------------------------------------------
    ("requested", "started", ["started"], "starting", []),  # must still report ready
    (
        "requested",
        "ready",
        [],
        "IllegalTransition: worker 'envs-0' is requested: it cannot take 'ready'",
        [],
    ),
    ("requested", "heartbeat", [], "requested", []),  # refreshes its liveness only
    ("requested", "exited", ["exit"], "exited crash", []),  # early: backoff, no respawn yet
    ("requested", "spawn_failed", ["exit"], "exited crash", []),
    ("requested", "adopted", [], NEVER_STARTED, []),
    ("requested", "lost", ["exit"], "exited", ["spawn envs-1 on 0"]),  # no crash; GPU 0 freed
    (
        "requested",
        "drain",
        ["drain"],
        "draining",
        ["drain envs-0 pid None until 20.5", "spawn envs-1 on 1"],
    ),
    (
        "requested",
        "gpu_lost",
        ["terminate"],
        "stopping",
        [*GPU_LOST, "terminate envs-0 pid None until 5.5", "spawn envs-1 on 1"],
    ),
    (
        "requested",
        "tick",
        ["terminate"],
        "stopping",
        ["terminate envs-0 pid None until 15"],
    ),  # start timeout: a failed start, its replacement after the slot's backoff
    # --- starting: process up, readiness not reported yet -----------------------------------------
    ("starting", "started", [], ALREADY_STARTED, []),
    ("starting", "ready", ["ready"], "active", []),
    ("starting", "heartbeat", [], "starting", []),
    ("starting", "exited", ["exit"], "exited crash", []),
    ("starting", "spawn_failed", [], RUNNING, []),
    ("starting", "adopted", [], "starting", []),  # nothing to repeat
    ("starting", "lost", ["exit"], "exited", ["spawn envs-1 on 0"]),
    (
        "starting",
        "drain",
        ["drain"],
        "draining",
        ["drain envs-0 pid 100 until 21.5", "spawn envs-1 on 1"],
    ),
    (
        "starting",
        "gpu_lost",
        ["terminate"],
        "stopping",
        [*GPU_LOST, "terminate envs-0 pid 100 until 6.5", "spawn envs-1 on 1"],
    ),
    (
        "starting",
        "tick",
        ["terminate"],
        "stopping",
        ["terminate envs-0 pid 100 until 16"],
    ),  # never ready: a failed start, its replacement after the slot's backoff
    # --- active: producing ------------------------------------------------------------------------
    ("active", "started", [], ALREADY_STARTED, []),
    ("active", "ready", ["ready"], "active", []),  # late READY: a sign of life, same state
    ("active", "heartbeat", [], "active", []),
    ("active", "exited", ["exit"], "exited crash", []),  # up 1.5 s < early_exit_s 30
    ("active", "spawn_failed", [], RUNNING, []),
    ("active", "adopted", [], "active", []),
    ("active", "lost", ["exit"], "exited", ["spawn envs-1 on 0"]),
    (
        "active",
        "drain",
        ["drain"],
        "draining",
        ["drain envs-0 pid 100 until 22.5", "spawn envs-1 on 1"],
    ),
    (
        "active",
        "gpu_lost",
        ["terminate"],
        "stopping",
        [*GPU_LOST, "terminate envs-0 pid 100 until 7.5", "spawn envs-1 on 1"],
    ),
    (
        "active",
        "tick",
        ["terminate"],
        "stopping",
        ["terminate envs-0 pid 100 until 68", "spawn envs-1 on 1"],
    ),  # hung
    # --- draining: drain signal sent, deadline 23 -------------------------------------------------
    ("draining", "started", [], ALREADY_STARTED, []),
    ("draining", "ready", ["ready"], "draining", []),  # a sign of life only
    ("draining", "heartbeat", [], "draining", []),
    ("draining", "exited", ["exit"], "exited", []),  # asked to leave: no crash, no respawn
    ("draining", "spawn_failed", [], RUNNING, []),
    ("draining", "adopted", [], "draining", ["drain envs-0 pid 100 until 23"]),  # same deadline
    ("draining", "lost", ["exit"], "exited", []),
    ("draining", "drain", [], "draining", []),  # already leaving
    (
        "draining",
        "gpu_lost",
        ["terminate"],
        "stopping",
        [*GPU_LOST, "terminate envs-0 pid 100 until 8.5"],
    ),
    (
        "draining",
        "tick",
        ["terminate"],
        "stopping",
        ["terminate envs-0 pid 100 until 28"],
    ),  # deadline action
    # --- draining before it started (pinned to 0 while requested) ---------------------------------
    ("draining_unstarted", "started", ["started"], "draining", ["drain envs-0 pid 200 until 21"]),
    ("draining_unstarted", "ready", ["ready"], "draining", []),
    ("draining_unstarted", "heartbeat", [], "draining", []),
    ("draining_unstarted", "exited", ["exit"], "exited", []),  # scale-down: planned
    ("draining_unstarted", "spawn_failed", ["exit"], "exited crash", []),  # counted all the same
    ("draining_unstarted", "adopted", [], NEVER_STARTED, []),
    ("draining_unstarted", "lost", ["exit"], "exited", []),
    ("draining_unstarted", "drain", [], "draining", []),
    (
        "draining_unstarted",
        "gpu_lost",
        ["terminate"],
        "stopping",
        [*GPU_LOST, "terminate envs-0 pid None until 6.5"],
    ),
    (
        "draining_unstarted",
        "tick",
        ["terminate"],
        "stopping",
        ["terminate envs-0 pid None until 26"],
    ),
    # --- stopping: SIGTERM sent, deadline 28 ------------------------------------------------------
    ("stopping", "started", [], ALREADY_STARTED, []),
    ("stopping", "ready", ["ready"], "stopping", []),  # a sign of life only
    ("stopping", "heartbeat", [], "stopping", []),
    ("stopping", "exited", ["exit"], "exited", []),  # operator drain: planned
    ("stopping", "spawn_failed", [], RUNNING, []),
    ("stopping", "adopted", [], "stopping", ["terminate envs-0 pid 100 until 28"]),
    ("stopping", "lost", ["exit"], "exited", []),
    ("stopping", "drain", [], "stopping", []),
    ("stopping", "gpu_lost", [], "stopping", GPU_LOST),  # already being stopped
    ("stopping", "tick", ["kill"], "killed", ["kill envs-0 pid 100"]),  # deadline action
    # --- stopping before it started (start timeout while requested), deadline 15 ------------------
    (
        "stopping_unstarted",
        "started",
        ["started"],
        "stopping",
        ["terminate envs-0 pid 200 until 15"],
    ),
    ("stopping_unstarted", "ready", ["ready"], "stopping", []),
    ("stopping_unstarted", "heartbeat", [], "stopping", []),
    # A start that timed out was counted as a failure when deo stopped it, not again here.
    ("stopping_unstarted", "exited", ["exit"], "exited", []),
    ("stopping_unstarted", "spawn_failed", ["exit"], "exited", []),
    ("stopping_unstarted", "adopted", [], NEVER_STARTED, []),
    ("stopping_unstarted", "lost", ["exit"], "exited", []),
    ("stopping_unstarted", "drain", [], "stopping", []),
    ("stopping_unstarted", "gpu_lost", [], "stopping", GPU_LOST),
    ("stopping_unstarted", "tick", ["kill"], "killed", ["kill envs-0 pid None"]),
    # --- killed: SIGKILL sent to its process group, deadline 33 -----------------------------------
    ("killed", "started", [], ALREADY_STARTED, []),
    ("killed", "ready", ["ready"], "killed", []),  # a sign of life only
    ("killed", "heartbeat", [], "killed", []),
    ("killed", "exited", ["exit"], "exited", []),
    ("killed", "spawn_failed", [], RUNNING, []),
    ("killed", "adopted", [], "killed", ["kill envs-0 pid 100"]),  # SIGKILL repeated
    ("killed", "lost", ["exit"], "exited", []),
    ("killed", "drain", [], "killed", []),
    ("killed", "gpu_lost", [], "killed", GPU_LOST),
    # Deadline action: given up on; its GPU may still be in use, so it is cordoned.
    (
        "killed",
        "tick",
        ["give_up"],
        "exited",
        ["raise unkillable_worker envs-0", "cordon 0 unkillable_worker"],
    ),
    # --- killed before it started, deadline 20 ----------------------------------------------------
    ("killed_unstarted", "started", ["started"], "killed", ["kill envs-0 pid 200"]),
    ("killed_unstarted", "ready", ["ready"], "killed", []),
    ("killed_unstarted", "heartbeat", [], "killed", []),
    ("killed_unstarted", "exited", ["exit"], "exited", []),
    ("killed_unstarted", "spawn_failed", ["exit"], "exited", []),
    ("killed_unstarted", "adopted", [], NEVER_STARTED, []),
    ("killed_unstarted", "lost", ["exit"], "exited", []),
    ("killed_unstarted", "drain", [], "killed", []),
    ("killed_unstarted", "gpu_lost", [], "killed", GPU_LOST),
    # Given up on: no process was ever seen, so nothing to cordon (a failure to start, counted
    # when it was stopped).
    ("killed_unstarted", "tick", ["give_up"], "exited", []),
]


@pytest.fixture
def asked(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[str, WorkerState, Trigger]]]:
    """Every (worker, state, trigger) the reducer asks the lifecycle table about."""
    calls: list[tuple[str, WorkerState, Trigger]] = []
    real = core.step.next_state

    def recording(worker_id: str, state: WorkerState, trigger: Trigger) -> WorkerState:
        calls.append((worker_id, state, trigger))
        return real(worker_id, state, trigger)

    monkeypatch.setattr(core.step, "next_state", recording)
    yield calls


def outcome(reducer: Reducer, last_failure_before: float | None) -> str:
    worker = reducer.state.workers.get("envs-0")
    if worker is not None:
        return worker.state.value
    # A failure is counted even when the pool no longer wants the slot (nothing waits then).
    crashed = reducer.state.pools["envs"].last_failure_t != last_failure_before
    return "exited crash" if crashed else "exited"


@pytest.mark.parametrize(
    ("situation", "event", "triggers", "expected", "commands"),
    ROWS,
    ids=[f"{s}-{e}" for s, e, *_ in ROWS],
)
def test_state_x_event(
    asked: list[tuple[str, WorkerState, Trigger]],
    situation: str,
    event: str,
    triggers: list[str],
    expected: str,
    commands: list[str],
) -> None:
    reducer = put_in(situation)
    before = reducer.state
    asked.clear()
    failures = before.pools["envs"].last_failure_t
    try:
        produced = reducer.step(EVENTS[event](reducer, before.now + 0.5))
    except DeoError as exc:
        assert f"{type(exc).__name__}: {exc}".startswith(expected), exc
        assert reducer.state is before  # refused: nothing applied
        assert commands == [] and triggers == []
        return
    assert outcome(reducer, failures) == expected
    assert [t.value for w, _, t in asked if w == "envs-0"] == triggers
    assert [summary(c) for c in produced] == commands


def test_the_table_covers_every_situation_and_event() -> None:
    situations = {s for s, *_ in ROWS}
    pairs = [(s, e) for s, e, *_ in ROWS]
    assert len(pairs) == len(set(pairs)) == len(situations) * len(EVENTS)
    engine_only = {s.value for s in ENGINE_STATES}
    assert {s.value for s in WorkerState} - {s.split("_")[0] for s in situations} == {
        "exited",
        *engine_only,
    }


def test_the_reducer_takes_every_row_of_the_lifecycle_table(
    asked: list[tuple[str, WorkerState, Trigger]],
) -> None:
    # A row no event takes is dead, or the behaviour it names lives outside the table.
    taken: set[tuple[WorkerState, Trigger]] = set()
    for situation, event, *_ in ROWS:
        reducer = put_in(situation)
        asked.clear()
        try:
            reducer.step(EVENTS[event](reducer, reducer.state.now + 0.5))
        except DeoError:
            continue
        taken |= {(state, trigger) for _, state, trigger in asked}
    # Only engines sleep: their rows are taken in tests/core/test_engines.py.
    engines = {
        (state, trigger)
        for (state, trigger), target in TRANSITIONS.items()
        if state in ENGINE_STATES or target in ENGINE_STATES
    }
    assert taken == set(TRANSITIONS) - engines


@pytest.mark.parametrize(
    ("situation", "event", "row"),
    [
        ("active", "ready", (S.ACTIVE, Trigger.READY)),
        ("draining_unstarted", "started", (S.DRAINING, Trigger.STARTED)),
        ("draining", "tick", (S.DRAINING, Trigger.TERMINATE)),
        ("stopping", "tick", (S.STOPPING, Trigger.KILL)),
        ("killed", "tick", (S.KILLED, Trigger.GIVE_UP)),
        ("killed_unstarted", "tick", (S.KILLED, Trigger.GIVE_UP)),
        ("killed", "exited", (S.KILLED, Trigger.EXIT)),
    ],
)
def test_without_its_row_the_reducer_refuses_the_event(
    monkeypatch: pytest.MonkeyPatch,
    situation: str,
    event: str,
    row: tuple[WorkerState, Trigger],
) -> None:
    # The table is the one authority: no handler changes a state the table does not allow.
    reducer = put_in(situation)
    without = {pair: target for pair, target in TRANSITIONS.items() if pair != row}
    monkeypatch.setattr(core.lifecycle, "TRANSITIONS", without)
    before = reducer.state
    state, trigger = row
    message = f"worker 'envs-0' is {state.value}: it cannot take '{trigger.value}'"
    with pytest.raises(IllegalTransition, match=message):
        reducer.step(EVENTS[event](reducer, before.now + 0.5))
    assert reducer.state is before
