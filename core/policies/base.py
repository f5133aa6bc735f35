"""The policy interface: a pure function from a pool's situation to a target count.

A policy is a small frozen object built from its parameters. ``decide(context, memory)`` returns a
:class:`Decision`: the target, a reason a person can read, and the memory to pass to the next call
(rate estimates, timers). Policies never see stale data (the reducer holds instead of asking) and
never enforce bounds or the stabilization window (the reducer does, for every policy alike).
"""

from __future__ import annotations

from typing import Any, ClassVar, Protocol

import attrs

from core.events import LoadSampled, QueueSampled
from core.vocabulary import AlertName

__all__ = ["POLICY_ALERTS", "Decision", "Policy", "PolicyContext"]


@attrs.frozen(slots=True, kw_only=True)
class PolicyContext:
    """What a policy may know when it decides, all taken at time ``t``."""

    t: float
    pool: str
    #: Workers counting toward the pool's size (requested, starting, active, sleeping).
    current: int
    #: Workers producing now.
    active: int
    min_workers: int
    max_workers: int
    queue: QueueSampled | None = None
    load: LoadSampled | None = None
    #: The count in force before this decision: the previous decisions as the reducer applied
    #: them (after bounds and the stabilization window). None where unknown.
    desired: int | None = None
    #: When a worker of the pool last exited early (None: never): the workers starting may be
    #: its replacements.
    last_failure_t: float | None = None


@attrs.frozen(slots=True, kw_only=True)
class Decision:
    """A policy's answer: the count it wants, why, and what it remembers for next time."""

    target: int
    reason: str
    memory: Any = None
    #: False for a guess made before anything was measured (a cold start): a scale-up that does
    #: not open the stabilization window, so it can be corrected once rates are known.
    stabilize: bool = True
    #: What the operator should know that no count fixes, by alert (one of
    #: :data:`POLICY_ALERTS`): the reducer keeps each raised on the pool while decisions
    #: report it, and resolves it at the first that does not.
    alerts: tuple[tuple[AlertName, str], ...] = ()


#: The alerts a policy may report through :attr:`Decision.alerts`.
POLICY_ALERTS = (AlertName.OFFPOLICY_STALLS,)


class Policy(Protocol):
    """One scaling policy. Implementations are frozen attrs classes; their fields are parameters."""

    #: The sample type that makes the reducer ask this policy (None: never asked).
    reacts_to: ClassVar[type[QueueSampled] | type[LoadSampled] | None]

    def initial_target(self, min_workers: int, max_workers: int) -> int:
        """The count a newly declared pool starts from, before any pressure is seen."""
        ...

    def decide(self, context: PolicyContext, memory: Any) -> Decision:
        """The target for the pool given ``context``; ``memory`` is the previous Decision's."""
        ...
