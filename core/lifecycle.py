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

A worker counts toward its pool's size while it is REQUESTED, STARTING, ACTIVE or SLEEPING: those
are the workers that are or will be producing. DRAINING, STOPPING and KILLED workers are on their
way out; they still hold their GPUs until EXITED, which is why a GPU is never handed out twice.

SLEEPING is reserved for inference engines that release GPU memory without exiting (SGLang
``release_memory_occupation``, vLLM sleep); no event drives it yet. Heartbeats and adoption after
a restart change no state: they refresh a live worker's last sign of life.

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
    SLEEPING = "sleeping"
    DRAINING = "draining"
    STOPPING = "stopping"
    KILLED = "killed"
    EXITED = "exited"


class Trigger(enum.Enum):
    __hash__ = object.__hash__

    STARTED = "started"  # the executor reports the process
    READY = "ready"  # the worker reports readiness (or needs none)
    SLEEP = "sleep"  # reserved: engine released its GPU memory
    WAKE = "wake"  # reserved: engine resumed
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
    (S.ACTIVE, T.SLEEP): S.SLEEPING,
    (S.ACTIVE, T.DRAIN): S.DRAINING,
    (S.ACTIVE, T.TERMINATE): S.STOPPING,  # hung
    (S.ACTIVE, T.EXIT): S.EXITED,
    (S.SLEEPING, T.READY): S.SLEEPING,  # a sign of life only
    (S.SLEEPING, T.WAKE): S.ACTIVE,
    (S.SLEEPING, T.DRAIN): S.DRAINING,
    (S.SLEEPING, T.TERMINATE): S.STOPPING,
    (S.SLEEPING, T.EXIT): S.EXITED,
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
        S.DRAINING: T.TERMINATE,
        S.STOPPING: T.KILL,
        S.KILLED: T.GIVE_UP,
    }
)

#: States that count toward a pool's size (and its min/max).
COUNTED = frozenset({S.REQUESTED, S.STARTING, S.ACTIVE, S.SLEEPING})
#: States whose worker may still hold a process and GPUs.
LIVE = frozenset(S) - {S.EXITED}


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
