"""The worker lifecycle: every state, every trigger, every allowed transition, in one table.

Theory of operation
-------------------
The reducer asks for a worker (REQUESTED) by emitting ``SpawnWorker``. The executor reports the
process (STARTED -> STARTING); a worker that need not report readiness becomes ACTIVE at once,
others on READY. A readiness report that comes later (from an active, draining or stopping
worker) is a sign of life only: its row keeps the state. Scaling down, an operator drain or a GPU
error sends the drain signal (DRAIN -> DRAINING); a worker that hangs (no heartbeat within the
grace period, never ready within the start timeout) or sits on a lost GPU is terminated
(TERMINATE -> STOPPING). Any exit, spawn failure or loss ends in EXITED, which is terminal: the
reducer forgets the worker and keeps only its pool's counters.

Escalation is driven by deadlines. A worker in a state of :data:`DEADLINE_ACTIONS` carries a
deadline; when a tick finds it past, the reducer takes the trigger that table names: a draining
worker is terminated (SIGTERM), a stopping one is killed with its process group (KILL -> KILLED,
SIGKILL), and a killed one that still has not exited is given up on (GIVE_UP -> EXITED: its GPUs
are cordoned and an alert raised, since its process may still hold them).

A worker counts toward its pool's size while it is REQUESTED, STARTING, ACTIVE or WAKING: those
are the workers that are or will be producing. DRAINING, STOPPING and KILLED workers are on their
way out; they still hold their GPUs until EXITED, which is why a GPU is never handed out twice.

Inference engines (pools of kind ``engine``) can also sleep: release their GPU memory but keep
their process, their port and their GPUs. Scaling an engine pool down sends an active engine to
sleep rather than draining it: SLEEP takes it out of routing (GOING_TO_SLEEP) until its in-flight
requests reach 0 or the drain timeout passes; RELEASE is the sleep call (SGLang
``release_memory_occupation``, vLLM ``/sleep``) sent (FALLING_ASLEEP); ASLEEP is the engine's
confirmation (SLEEPING). Scaling up wakes a sleeping engine before it starts a new one: WAKE is the
wake call sent (WAKING), AWAKE its confirmation (ACTIVE again). A failed sleep or wake call is
retried (RELEASE or WAKE again, up to the pool's ``control_attempts``), then the engine is stopped
(TERMINATE) and, for a wake, replaced; a call that never answers reaches the state's deadline.
Sleeping engines do not count toward the pool's size: the size is the engines that serve or are
about to (requested, starting, active, waking), so a policy's target means awake engines, as
verl's INACTIVE engines are no active capacity; ``max_asleep`` bounds the sleeping ones.

Heartbeats and adoption after a restart change no state: they refresh a live worker's last sign of
life.

A state change anywhere in the reducer goes through :func:`next_state`; anything not in the table
raises :class:`IllegalTransition` naming the worker, state and trigger. A new state is a member of
:class:`WorkerState`, its rows in :data:`TRANSITIONS`, and, if it waits on a deadline, a row in
:data:`DEADLINE_ACTIONS`.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from types import MappingProxyType

from core.errors import IllegalTransition

__all__ = [
    "ASLEEP",
    "COUNTED",
    "DEADLINE_ACTIONS",
    "LIVE",
    "TRANSITIONS",
    "Trigger",
    "WorkerState",
    "mermaid",
    "next_state",
]


class WorkerState(enum.Enum):
    # Members are singletons compared by identity: hash them the same way (Enum's default
    # hashes the name in Python, a measurable cost in the reducer's hot loops).
    __hash__ = object.__hash__

    REQUESTED = "requested"
    STARTING = "starting"
    ACTIVE = "active"
    GOING_TO_SLEEP = "going_to_sleep"
    FALLING_ASLEEP = "falling_asleep"
    SLEEPING = "sleeping"
    WAKING = "waking"
    DRAINING = "draining"
    STOPPING = "stopping"
    KILLED = "killed"
    EXITED = "exited"


class Trigger(enum.Enum):
    __hash__ = object.__hash__

    STARTED = "started"  # the executor reports the process
    READY = "ready"  # the worker reports readiness (or needs none)
    SLEEP = "sleep"  # an engine is to sleep: no new requests, in-flight ones finish
    RELEASE = "release"  # the sleep call (release GPU memory) sent to the engine
    ASLEEP = "asleep"  # the engine confirmed it released its memory
    WAKE = "wake"  # the wake call (take GPU memory back) sent, or a sleep called off
    AWAKE = "awake"  # the engine confirmed it is awake
    DRAIN = "drain"  # drain signal sent
    TERMINATE = "terminate"  # SIGTERM sent (drain deadline, hung, start timeout, GPU lost)
    KILL = "kill"  # SIGKILL sent to the process group
    GIVE_UP = "give_up"  # SIGKILL did not end it in time: forgotten, its GPUs cordoned
    EXIT = "exit"  # the process ended, failed to spawn, or was lost


S, T = WorkerState, Trigger

TRANSITIONS: Mapping[tuple[WorkerState, Trigger], WorkerState] = {
    (S.REQUESTED, T.STARTED): S.STARTING,
    (S.REQUESTED, T.DRAIN): S.DRAINING,  # drained before it started: signalled once it does
    (S.REQUESTED, T.TERMINATE): S.STOPPING,  # not started within the start timeout
    (S.REQUESTED, T.EXIT): S.EXITED,  # spawn failed
    (S.STARTING, T.READY): S.ACTIVE,
    (S.STARTING, T.DRAIN): S.DRAINING,
    (S.STARTING, T.TERMINATE): S.STOPPING,  # not ready within the start timeout, or hung
    (S.STARTING, T.EXIT): S.EXITED,
    (S.ACTIVE, T.READY): S.ACTIVE,  # a late or repeated report: a sign of life only
    (S.ACTIVE, T.SLEEP): S.GOING_TO_SLEEP,  # an engine scaled down: sleep rather than exit
    (S.ACTIVE, T.DRAIN): S.DRAINING,
    (S.ACTIVE, T.TERMINATE): S.STOPPING,  # hung
    (S.ACTIVE, T.EXIT): S.EXITED,
    (S.GOING_TO_SLEEP, T.READY): S.GOING_TO_SLEEP,  # a sign of life only
    (S.GOING_TO_SLEEP, T.RELEASE): S.FALLING_ASLEEP,  # in-flight reached 0, or drain deadline
    (S.GOING_TO_SLEEP, T.WAKE): S.ACTIVE,  # scaled up before its memory was released
    (S.GOING_TO_SLEEP, T.DRAIN): S.DRAINING,  # an operator drain: it exits instead
    (S.GOING_TO_SLEEP, T.TERMINATE): S.STOPPING,
    (S.GOING_TO_SLEEP, T.EXIT): S.EXITED,
    (S.FALLING_ASLEEP, T.READY): S.FALLING_ASLEEP,  # a sign of life only
    (S.FALLING_ASLEEP, T.RELEASE): S.FALLING_ASLEEP,  # the sleep call failed: sent again
    (S.FALLING_ASLEEP, T.ASLEEP): S.SLEEPING,
    (S.FALLING_ASLEEP, T.TERMINATE): S.STOPPING,  # sleep failed too often, or never answered
    (S.FALLING_ASLEEP, T.EXIT): S.EXITED,
    (S.SLEEPING, T.READY): S.SLEEPING,  # a sign of life only
    (S.SLEEPING, T.ASLEEP): S.SLEEPING,  # confirmed again (asked after a restart)
    (S.SLEEPING, T.AWAKE): S.ACTIVE,  # found awake when asked (after a restart)
    (S.SLEEPING, T.WAKE): S.WAKING,
    (S.SLEEPING, T.TERMINATE): S.STOPPING,  # over max_asleep, drained, or its pool removed
    (S.SLEEPING, T.EXIT): S.EXITED,
    (S.WAKING, T.READY): S.WAKING,  # a sign of life only
    (S.WAKING, T.WAKE): S.WAKING,  # the wake call failed: sent again
    (S.WAKING, T.AWAKE): S.ACTIVE,
    (S.WAKING, T.DRAIN): S.DRAINING,  # scaled down or drained while waking
    (S.WAKING, T.TERMINATE): S.STOPPING,  # wake failed too often, or never answered: replaced
    (S.WAKING, T.EXIT): S.EXITED,
    (S.DRAINING, T.STARTED): S.DRAINING,  # started after its drain was decided: signalled now
    (S.DRAINING, T.READY): S.DRAINING,  # a sign of life only
    (S.DRAINING, T.TERMINATE): S.STOPPING,  # missed its drain deadline, or its GPU was lost
    (S.DRAINING, T.EXIT): S.EXITED,
    (S.STOPPING, T.STARTED): S.STOPPING,  # started after it was told to stop: SIGTERM now
    (S.STOPPING, T.READY): S.STOPPING,  # a sign of life only
    (S.STOPPING, T.KILL): S.KILLED,  # missed its stop deadline
    (S.STOPPING, T.EXIT): S.EXITED,
    (S.KILLED, T.STARTED): S.KILLED,  # started after it was killed: SIGKILL now
    (S.KILLED, T.READY): S.KILLED,  # a sign of life only
    (S.KILLED, T.GIVE_UP): S.EXITED,  # SIGKILL did not end it within the stop timeout
    (S.KILLED, T.EXIT): S.EXITED,
}
TRANSITIONS = MappingProxyType(TRANSITIONS)  # read-only: the table is the whole authority

#: The trigger the reducer takes when a worker in each of these states is past its deadline
#: (``Worker.deadline_t``). Exactly these states carry a deadline.
DEADLINE_ACTIONS: Mapping[WorkerState, Trigger] = MappingProxyType(
    {
        S.GOING_TO_SLEEP: T.RELEASE,
        S.FALLING_ASLEEP: T.TERMINATE,
        S.WAKING: T.TERMINATE,
        S.DRAINING: T.TERMINATE,
        S.STOPPING: T.KILL,
        S.KILLED: T.GIVE_UP,
    }
)

#: States that count toward a pool's size (and its min/max): workers that serve or are about to.
COUNTED = frozenset({S.REQUESTED, S.STARTING, S.ACTIVE, S.WAKING})
#: States of an engine that sleeps or is on its way to sleep (bounded by the pool's max_asleep).
ASLEEP = frozenset({S.GOING_TO_SLEEP, S.FALLING_ASLEEP, S.SLEEPING})
#: States whose worker may still hold a process and GPUs.
LIVE = frozenset(S) - {S.EXITED}
#: States of a worker on its way out: its GPUs come free when it exits.
LEAVING = frozenset({S.DRAINING, S.STOPPING, S.KILLED})


def next_state(worker_id: str, state: WorkerState, trigger: Trigger) -> WorkerState:
    """The state after ``trigger``, or :class:`IllegalTransition` if the table has no such row."""
    try:
        return TRANSITIONS[(state, trigger)]
    except KeyError:
        raise IllegalTransition(
            f"worker {worker_id!r} is {state.value}: it cannot take {trigger.value!r}"
        ) from None


def mermaid() -> str:
    """The transition table as a Mermaid state diagram, deadline actions included
    (docs/lifecycle.md is made from it).

    Each row is one edge labelled with its trigger; a row taken when a deadline passes is
    labelled ``trigger (deadline)``.
    """
    lines = ["stateDiagram-v2", f"    [*] --> {S.REQUESTED.value}"]
    for (state, trigger), target in TRANSITIONS.items():
        label = trigger.value
        if DEADLINE_ACTIONS.get(state) is trigger:
            label += " (deadline)"
        lines.append(f"    {state.value} --> {target.value}: {label}")
    lines.append(f"    {S.EXITED.value} --> [*]")
    return "\n".join(lines) + "\n"
