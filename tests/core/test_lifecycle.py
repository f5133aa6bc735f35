"""core.lifecycle: the whole (state x trigger) table, allowed rows and refused ones alike."""

from __future__ import annotations

import itertools
import re

import pytest

from core.errors import DeoError, IllegalTransition, InvalidEvent
from core.lifecycle import COUNTED, LIVE, TRANSITIONS, Trigger, WorkerState, next_state

S, T = WorkerState, Trigger

#: The lifecycle as the module docstring tells it, written out independently of TRANSITIONS.
EXPECTED: dict[tuple[WorkerState, Trigger], WorkerState] = {
    # REQUESTED: SpawnWorker emitted, no process yet
    (S.REQUESTED, T.STARTED): S.STARTING,
    (S.REQUESTED, T.DRAIN): S.DRAINING,
    (S.REQUESTED, T.TERMINATE): S.STOPPING,
    (S.REQUESTED, T.EXIT): S.EXITED,  # spawn failed
    # STARTING: process exists, not ready yet
    (S.STARTING, T.READY): S.ACTIVE,
    (S.STARTING, T.DRAIN): S.DRAINING,
    (S.STARTING, T.TERMINATE): S.STOPPING,  # never ready within the start timeout
    (S.STARTING, T.EXIT): S.EXITED,
    # ACTIVE: producing
    (S.ACTIVE, T.SLEEP): S.SLEEPING,
    (S.ACTIVE, T.DRAIN): S.DRAINING,
    (S.ACTIVE, T.TERMINATE): S.STOPPING,
    (S.ACTIVE, T.EXIT): S.EXITED,
    # SLEEPING: GPU memory released, process alive
    (S.SLEEPING, T.WAKE): S.ACTIVE,
    (S.SLEEPING, T.DRAIN): S.DRAINING,
    (S.SLEEPING, T.TERMINATE): S.STOPPING,
    (S.SLEEPING, T.EXIT): S.EXITED,
    # DRAINING: drain signal sent (or decided before the process appeared)
    (S.DRAINING, T.STARTED): S.DRAINING,
    (S.DRAINING, T.TERMINATE): S.STOPPING,  # missed its drain deadline
    (S.DRAINING, T.EXIT): S.EXITED,
    # STOPPING: SIGTERM sent; KILL stays here
    (S.STOPPING, T.STARTED): S.STOPPING,
    (S.STOPPING, T.KILL): S.STOPPING,
    (S.STOPPING, T.EXIT): S.EXITED,
}

ALL_PAIRS = list(itertools.product(WorkerState, Trigger))
WORKER = "envs-7"


def test_table_is_the_documented_lifecycle() -> None:
    assert TRANSITIONS == EXPECTED


def test_every_pair_is_covered() -> None:
    assert len(ALL_PAIRS) == len(WorkerState) * len(Trigger) == 7 * 8


@pytest.mark.parametrize(
    ("state", "trigger"), ALL_PAIRS, ids=[f"{s.value}-{t.value}" for s, t in ALL_PAIRS]
)
def test_every_state_trigger_pair(state: WorkerState, trigger: Trigger) -> None:
    if (state, trigger) in TRANSITIONS:
        result = next_state(WORKER, state, trigger)
        assert result is TRANSITIONS[(state, trigger)]
        assert result is EXPECTED[(state, trigger)]
        return
    assert (state, trigger) not in EXPECTED
    with pytest.raises(IllegalTransition) as info:
        next_state(WORKER, state, trigger)
    message = str(info.value)
    assert repr(WORKER) in message
    # whole words, so that trigger "exit" is not found inside state "exited"
    assert re.search(rf"\b{state.value}\b", message), message
    assert re.search(rf"\b{trigger.value}\b", message), message
    # the KeyError of the table lookup is not chained onto the error
    assert info.value.__cause__ is None
    assert info.value.__suppress_context__


def test_illegal_transition_is_an_invalid_event() -> None:
    with pytest.raises(InvalidEvent):
        next_state("w", S.EXITED, T.EXIT)
    assert issubclass(IllegalTransition, DeoError)


def test_message_names_an_unusual_worker_id_verbatim() -> None:
    with pytest.raises(IllegalTransition) as info:
        next_state("pool.v2_x-12", S.ACTIVE, T.STARTED)
    assert str(info.value) == "worker 'pool.v2_x-12' is active: it cannot take 'started'"


def test_exited_is_terminal() -> None:
    assert not [pair for pair in TRANSITIONS if pair[0] is S.EXITED]
    for trigger in Trigger:
        with pytest.raises(IllegalTransition):
            next_state(WORKER, S.EXITED, trigger)


def test_every_live_state_can_exit() -> None:
    # "Any exit, spawn failure or loss ends in EXITED"
    for state in LIVE:
        assert next_state(WORKER, state, T.EXIT) is S.EXITED


def test_only_exit_leads_to_exited() -> None:
    assert {trigger for (_, trigger), to in TRANSITIONS.items() if to is S.EXITED} == {T.EXIT}


def test_kill_only_from_stopping_and_stays_there() -> None:
    assert [s for (s, t) in TRANSITIONS if t is T.KILL] == [S.STOPPING]
    assert next_state(WORKER, S.STOPPING, T.KILL) is S.STOPPING


def test_nothing_leaves_draining_or_stopping_for_a_counted_state() -> None:
    # On the way out is one-way: no trigger brings a draining or stopping worker back.
    for (state, _), to in TRANSITIONS.items():
        if state in (S.DRAINING, S.STOPPING):
            assert to not in COUNTED


def test_every_state_but_exited_is_reachable_from_requested() -> None:
    seen, frontier = {S.REQUESTED}, [S.REQUESTED]
    while frontier:
        state = frontier.pop()
        for (src, _), dst in TRANSITIONS.items():
            if src is state and dst not in seen:
                seen.add(dst)
                frontier.append(dst)
    assert seen == set(WorkerState)


def test_counted_is_requested_starting_active_sleeping() -> None:
    assert frozenset({S.REQUESTED, S.STARTING, S.ACTIVE, S.SLEEPING}) == COUNTED
    assert S.DRAINING not in COUNTED
    assert S.STOPPING not in COUNTED
    assert S.EXITED not in COUNTED


def test_live_is_everything_but_exited() -> None:
    assert frozenset(WorkerState) - LIVE == {S.EXITED}
    # draining and stopping workers still hold their process and GPUs
    assert {S.DRAINING, S.STOPPING} <= LIVE
    assert COUNTED < LIVE


@pytest.mark.parametrize(
    ("state", "value"),
    [
        (S.REQUESTED, "requested"),
        (S.STARTING, "starting"),
        (S.ACTIVE, "active"),
        (S.SLEEPING, "sleeping"),
        (S.DRAINING, "draining"),
        (S.STOPPING, "stopping"),
        (S.EXITED, "exited"),
    ],
)
def test_state_values_are_stable(state: WorkerState, value: str) -> None:
    # The values are written to the event log and appear in messages.
    assert state.value == value
    assert WorkerState(value) is state
