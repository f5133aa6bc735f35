"""core.lifecycle: what the transition table guarantees, and how it refuses what it lacks.

The reducer's use of each row, state by state and event by event, is checked in
test_transitions.py; here the table's own shape: every state reachable, every live state able to
end, every deadline with an action that is a row, refusals naming worker, state and trigger.
"""

from __future__ import annotations

import itertools
import re

import pytest

from core.errors import DeoError, IllegalTransition, InvalidEvent
from core.lifecycle import (
    ASLEEP,
    COUNTED,
    DEADLINE_ACTIONS,
    LIVE,
    TRANSITIONS,
    Trigger,
    WorkerState,
    next_state,
)

S, T = WorkerState, Trigger
WORKER = "envs-7"
REFUSED = [pair for pair in itertools.product(WorkerState, Trigger) if pair not in TRANSITIONS]


def successors(state: WorkerState) -> set[WorkerState]:
    return {to for (src, _), to in TRANSITIONS.items() if src is state}


def reachable_from(start: WorkerState) -> set[WorkerState]:
    seen, frontier = {start}, [start]
    while frontier:
        for nxt in successors(frontier.pop()) - seen:
            seen.add(nxt)
            frontier.append(nxt)
    return seen


def test_every_state_is_reachable_from_requested() -> None:
    assert reachable_from(S.REQUESTED) == set(WorkerState)


@pytest.mark.parametrize("state", sorted(LIVE, key=lambda s: s.value), ids=lambda s: s.value)
def test_every_live_state_can_reach_exited(state: WorkerState) -> None:
    assert S.EXITED in reachable_from(state)
    # An exit, a failed spawn or a loss can be reported in any live state.
    assert next_state(WORKER, state, T.EXIT) is S.EXITED


def test_exited_is_terminal() -> None:
    assert successors(S.EXITED) == set()
    for trigger in Trigger:
        with pytest.raises(IllegalTransition):
            next_state(WORKER, S.EXITED, trigger)


@pytest.mark.parametrize(
    ("state", "action"), DEADLINE_ACTIONS.items(), ids=lambda v: getattr(v, "value", "")
)
def test_each_deadline_action_is_a_row_that_leaves_the_state(
    state: WorkerState, action: Trigger
) -> None:
    # Escalation moves on: a deadline action that kept the state would fire on every tick.
    assert (state, action) in TRANSITIONS
    assert next_state(WORKER, state, action) is not state


def test_the_escalation_ladder_ends_in_exited() -> None:
    # drain -> SIGTERM -> SIGKILL -> give up: following deadline actions always ends a worker.
    state, ladder = S.DRAINING, []
    while state in DEADLINE_ACTIONS:
        trigger = DEADLINE_ACTIONS[state]
        ladder.append(trigger)
        state = next_state(WORKER, state, trigger)
    assert ladder == [T.TERMINATE, T.KILL, T.GIVE_UP]
    assert state is S.EXITED


def test_every_state_a_stop_or_drain_enters_has_a_deadline_action() -> None:
    # The reducer sets a deadline whenever it drains, terminates or kills: each such target state
    # must say what happens when that deadline passes.
    for (_, trigger), target in TRANSITIONS.items():
        if trigger in (T.DRAIN, T.TERMINATE, T.KILL):
            assert target in DEADLINE_ACTIONS, (trigger, target)
    # Of the counted states only a waking engine waits on a deadline: a wake that never answers.
    assert set(DEADLINE_ACTIONS) & COUNTED == {S.WAKING}


def test_a_late_readiness_report_keeps_every_state_after_starting() -> None:
    for state in LIVE - {S.REQUESTED, S.STARTING}:
        assert next_state(WORKER, state, T.READY) is state
    assert next_state(WORKER, S.STARTING, T.READY) is S.ACTIVE
    with pytest.raises(IllegalTransition):
        next_state(WORKER, S.REQUESTED, T.READY)  # not started: a report from nowhere


def test_nothing_on_its_way_out_comes_back_to_a_counted_state() -> None:
    leaving = LIVE - COUNTED - ASLEEP
    assert leaving == {S.DRAINING, S.STOPPING, S.KILLED}
    for state in leaving:
        assert not successors(state) & COUNTED


def test_an_engine_asleep_comes_back_only_by_a_wake() -> None:
    for state in ASLEEP:
        back = {t for (s, t), to in TRANSITIONS.items() if s is state and to in COUNTED}
        # AWAKE from SLEEPING: an engine found awake when asked after a restart.
        assert back <= {T.WAKE, T.AWAKE}, (state, back)
    assert next_state(WORKER, S.SLEEPING, T.WAKE) is S.WAKING
    assert next_state(WORKER, S.WAKING, T.AWAKE) is S.ACTIVE
    assert next_state(WORKER, S.GOING_TO_SLEEP, T.WAKE) is S.ACTIVE  # called off before release
    with pytest.raises(IllegalTransition):
        next_state(WORKER, S.FALLING_ASLEEP, T.WAKE)  # the sleep call is out: wait for its answer


def test_sleep_goes_through_a_drain_a_call_and_a_confirmation() -> None:
    assert next_state(WORKER, S.ACTIVE, T.SLEEP) is S.GOING_TO_SLEEP
    assert next_state(WORKER, S.GOING_TO_SLEEP, T.RELEASE) is S.FALLING_ASLEEP
    assert next_state(WORKER, S.FALLING_ASLEEP, T.RELEASE) is S.FALLING_ASLEEP  # a retry
    assert next_state(WORKER, S.FALLING_ASLEEP, T.ASLEEP) is S.SLEEPING
    assert DEADLINE_ACTIONS[S.GOING_TO_SLEEP] is T.RELEASE  # the drain timeout: sleep anyway
    assert DEADLINE_ACTIONS[S.FALLING_ASLEEP] is T.TERMINATE  # a sleep that never answers
    assert DEADLINE_ACTIONS[S.WAKING] is T.TERMINATE  # a wake that never answers
    for state in (S.ACTIVE, S.STARTING, S.GOING_TO_SLEEP, S.WAKING):
        with pytest.raises(IllegalTransition):
            next_state(WORKER, state, T.ASLEEP)


def test_only_exit_and_give_up_lead_to_exited() -> None:
    assert {t for (_, t), to in TRANSITIONS.items() if to is S.EXITED} == {T.EXIT, T.GIVE_UP}
    assert [s for (s, t) in TRANSITIONS if t is T.GIVE_UP] == [S.KILLED]


@pytest.mark.parametrize(
    ("state", "trigger"), REFUSED, ids=[f"{s.value}-{t.value}" for s, t in REFUSED]
)
def test_a_pair_without_a_row_is_refused_naming_worker_state_and_trigger(
    state: WorkerState, trigger: Trigger
) -> None:
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


def test_counted_is_requested_starting_active_waking() -> None:
    # A sleeping engine is no capacity: the pool's size counts the engines that serve or will.
    assert frozenset({S.REQUESTED, S.STARTING, S.ACTIVE, S.WAKING}) == COUNTED
    assert frozenset({S.GOING_TO_SLEEP, S.FALLING_ASLEEP, S.SLEEPING}) == ASLEEP


def test_live_is_everything_but_exited() -> None:
    assert frozenset(WorkerState) - LIVE == {S.EXITED}


@pytest.mark.parametrize(
    ("state", "value"),
    [
        (S.REQUESTED, "requested"),
        (S.STARTING, "starting"),
        (S.ACTIVE, "active"),
        (S.GOING_TO_SLEEP, "going_to_sleep"),
        (S.FALLING_ASLEEP, "falling_asleep"),
        (S.SLEEPING, "sleeping"),
        (S.WAKING, "waking"),
        (S.DRAINING, "draining"),
        (S.STOPPING, "stopping"),
        (S.KILLED, "killed"),
        (S.EXITED, "exited"),
    ],
)
def test_state_values_are_stable(state: WorkerState, value: str) -> None:
    # The values are written to snapshots and the API, and appear in messages.
    assert state.value == value
    assert WorkerState(value) is state
