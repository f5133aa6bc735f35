"""The reducer: ``reduce(state, event) -> (state, commands)``, and :class:`Reducer` around it.

Each step works on a private copy-on-write view of the state (:class:`~core.step.Step`), so the
state passed in is never touched and an event that raises leaves nothing half-applied. Worker
lifecycle changes go through :func:`core.lifecycle.next_state`; each event type's handler is in
:mod:`core.handlers`.

Order inside a step: the event's own handler first, then reconciliation of the pools it may have
affected (spawn up to each pool's target, drain the excess). The GPU arbiter's events go to
:mod:`core.arbiter.served`; a lost GPU and a tick go to the arbiter too, after deo's own handler.
"""

from __future__ import annotations

import attrs

from core import commands as c
from core import events as e
from core.arbiter.engines import stop_engines, stop_outsiders
from core.arbiter.events import ArbiterGpusDeclared
from core.arbiter.served import (
    ARBITER_EVENTS,
    SHARED_EVENTS,
    arbiter_step,
    check_bound_pools,
    check_engine_pools,
)
from core.errors import InvalidEvent
from core.handlers import HANDLERS, heartbeat_only, seen_only
from core.invariants import checked, raise_on_violation
from core.policies import BUILT_INS, PolicyCatalog
from core.records import replace
from core.state import State
from core.step import Step

__all__ = ["Reducer", "reduce"]


def reduce(
    state: State, event: e.Event, policies: PolicyCatalog = BUILT_INS
) -> tuple[State, list[c.Command]]:
    """One step of the fold; ``policies`` names the policies a pool may run (the core's). Its
    invariants are checked as it goes (:func:`core.invariants.checked`: a violation raises the
    ``invariant_violated`` alert).

    Raises :class:`~core.errors.InvalidEvent` on bad input; the state given is left unchanged.
    """
    if type(event) is e.WorkerHeartbeat:
        return heartbeat_only(state, event), []
    if type(event) is e.WorkersSeen:
        return seen_only(state, event), []
    after, commands = _reduce(state, event, policies)
    return checked(state, event, after, commands)


def _reduce(state: State, event: e.Event, policies: PolicyCatalog) -> tuple[State, list[c.Command]]:
    if type(event) in ARBITER_EVENTS:
        check_engine_pools(state, event)
        after, commands = arbiter_step(state, event)
        return _follow_arbiter(state, after, event, commands, policies)
    if type(event) is e.Configured:
        check_bound_pools(state, event)
    handler = HANDLERS.get(type(event))
    if handler is None:
        raise InvalidEvent(f"{type(event).__name__} is not an event the reducer knows")
    step = Step(state, event.t, policies)
    handler(step, event)
    shared = type(event) in SHARED_EVENTS and bool(state.arbiter.gpus)
    if shared:
        # The arbiter has not seen the event yet (a lost GPU): its engine pools follow its
        # ranks once it has, below, never its state from before the event.
        step.dirty_pools.difference_update(state.arbiter.engine_pools())
    after, commands = step.finish()
    after = _with_cordons(after)
    if shared:
        after, more = arbiter_step(after, event)
        return _follow_arbiter(state, after, event, commands + more, policies)
    return after, commands


def _with_cordons(state: State) -> State:
    """``state`` with its arbiter told which of its GPUs deo has cordoned (it plans nothing new
    there; the next plan, at the latest the next tick, sees an uncordoned GPU again)."""
    arbiter = state.arbiter
    if not arbiter.gpus:
        return state
    cordoned = frozenset(
        g
        for g in arbiter.gpus
        if g not in arbiter.lost and g in state.gpus and state.gpus[g].causes
    )
    if cordoned == arbiter.cordoned:
        return state
    return replace(state, arbiter=attrs.evolve(arbiter, cordoned=cordoned))


def _follow_arbiter(
    before: State,
    state: State,
    event: e.Event,
    commands: list[c.Command],
    policies: PolicyCatalog,
) -> tuple[State, list[c.Command]]:
    """The engine pools that run generation clusters brought in line with the arbiter's ranks
    (:mod:`core.arbiter.engines`); a pool whose cluster left with this event has its engines
    stopped (the arbiter counts their GPUs idle from now on), and once the arbiter has its GPUs,
    the workers of other pools there are stopped (they are the arbiter's clusters' alone)."""
    bound = state.arbiter.engine_pools()
    unbound = {
        name: who for name, who in before.arbiter.engine_pools().items() if name not in bound
    }
    if not bound and not unbound and not isinstance(event, ArbiterGpusDeclared):
        return state, commands
    step = Step(state, event.t, policies)
    if isinstance(event, ArbiterGpusDeclared):
        stop_outsiders(step, bound)
    for name, (pipeline, cluster) in sorted(unbound.items()):
        if name in step.pools:
            why = f"{pipeline}/{cluster.spec.name} left the arbiter ({type(event).__name__})"
            stop_engines(step, name, why)
    step.dirty_pools.update(bound)
    after, more = step.finish()
    return after, commands + more


class Reducer:
    """Feed events, read commands. ``state`` is the state after the last accepted event.

    ``policies``: the policies its pools may run, by name (default: the core's); a caller with
    policies of its own (the benchmark's baselines) passes a catalog with them. Everything a
    reducer remembers is in its state: two reducers never share anything.

    With ``check_invariants=True`` every step is checked against :mod:`core.invariants` and a
    violation raises :class:`~core.errors.InvariantViolation` (a bug in deo, never bad input).
    """

    def __init__(
        self,
        state: State | None = None,
        *,
        policies: PolicyCatalog = BUILT_INS,
        check_invariants: bool = False,
    ) -> None:
        self.state = state if state is not None else State()
        self.policies = policies
        self.check_invariants = check_invariants

    def step(self, event: e.Event) -> list[c.Command]:
        before = self.state
        after, commands = reduce(before, event, self.policies)
        if self.check_invariants:
            raise_on_violation(before, event, after, commands)
        self.state = after
        return commands
