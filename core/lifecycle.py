"""The worker lifecycle: every state, every trigger, every allowed transition, in one table.

Theory of operation
-------------------
The reducer asks for a worker (REQUESTED) by emitting ``SpawnWorker``. The executor reports the
process (STARTED -> STARTING); a worker that need not report readiness becomes ACTIVE at once,
others on READY. Scaling down, an operator drain or a GPU error sends the drain signal
(DRAIN -> DRAINING); a worker that misses its drain deadline, hangs (no heartbeat within the grace
period, never ready within the start timeout) or sits on a lost GPU is terminated (TERMINATE ->
STOPPING), and a stopping worker that misses its deadline is killed with its process group
(KILL, staying in STOPPING). Any exit, spawn failure or loss ends in EXITED, which is terminal:
the reducer forgets the worker and keeps only its pool's counters.

A worker counts toward its pool's size while it is REQUESTED, STARTING, ACTIVE or SLEEPING: those
are the workers that are or will be producing. DRAINING and STOPPING workers are on their way out;
they still hold their GPUs until EXITED, which is why a GPU is never handed out twice.

SLEEPING is reserved for inference engines that release GPU memory without exiting (SGLang
``release_memory_occupation``, vLLM sleep); no event drives it yet.

Anything not in the table raises :class:`IllegalTransition` naming the worker, state and trigger.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from types import MappingProxyType

from core.errors import IllegalTransition

__all__ = ["COUNTED", "LIVE", "TRANSITIONS", "Trigger", "WorkerState", "mermaid", "next_state"]


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
    EXITED = "exited"


class Trigger(enum.Enum):
    __hash__ = object.__hash__

    STARTED = "started"  # the executor reports the process
    READY = "ready"  # the worker reports readiness (or needs none)
    SLEEP = "sleep"  # reserved: engine released its GPU memory
    WAKE = "wake"  # reserved: engine resumed
    DRAIN = "drain"  # drain signal sent
    TERMINATE = "terminate"  # SIGTERM sent (drain deadline, hung, GPU lost)
    KILL = "kill"  # SIGKILL sent to the process group
    EXIT = "exit"  # the process ended, failed to spawn, or was lost


S, T = WorkerState, Trigger

TRANSITIONS: Mapping[tuple[WorkerState, Trigger], WorkerState] = {
    (S.REQUESTED, T.STARTED): S.STARTING,
    (S.REQUESTED, T.DRAIN): S.DRAINING,  # drained before it started: signalled once it does
    (S.REQUESTED, T.TERMINATE): S.STOPPING,
    (S.REQUESTED, T.EXIT): S.EXITED,
    (S.STARTING, T.READY): S.ACTIVE,
    (S.STARTING, T.DRAIN): S.DRAINING,
    (S.STARTING, T.TERMINATE): S.STOPPING,
    (S.STARTING, T.EXIT): S.EXITED,
    (S.ACTIVE, T.SLEEP): S.SLEEPING,
    (S.ACTIVE, T.DRAIN): S.DRAINING,
    (S.ACTIVE, T.TERMINATE): S.STOPPING,
    (S.ACTIVE, T.EXIT): S.EXITED,
    (S.SLEEPING, T.WAKE): S.ACTIVE,
    (S.SLEEPING, T.DRAIN): S.DRAINING,
    (S.SLEEPING, T.TERMINATE): S.STOPPING,
    (S.SLEEPING, T.EXIT): S.EXITED,
    (S.DRAINING, T.STARTED): S.DRAINING,  # started after its drain was decided
    (S.DRAINING, T.TERMINATE): S.STOPPING,
    (S.DRAINING, T.EXIT): S.EXITED,
    (S.STOPPING, T.STARTED): S.STOPPING,
    (S.STOPPING, T.KILL): S.STOPPING,
    (S.STOPPING, T.EXIT): S.EXITED,
}
TRANSITIONS = MappingProxyType(TRANSITIONS)  # read-only: the table is the whole authority

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
    """The transition table as a Mermaid state diagram (docs/lifecycle.md is made from it)."""
    lines = ["stateDiagram-v2", f"    [*] --> {S.REQUESTED.value}"]
    for (state, trigger), target in TRANSITIONS.items():
        lines.append(f"    {state.value} --> {target.value}: {trigger.value}")
    lines.append(f"    {S.EXITED.value} --> [*]")
    return "\n".join(lines) + "\n"
