"""The arbiter inside deo's reducer: its state is ``State.arbiter``, its events go through deo's
log like any other, so a snapshot holds it and ``deo replay`` reproduces its commands.

:func:`core.reducer.reduce` hands the arbiter's own events (:data:`ARBITER_EVENTS`) to
:func:`arbiter_step` alone; the events both cores read (a lost GPU, a tick) go to deo's reducer
first, then, once the arbiter has GPUs, to the arbiter. A plan the arbiter refuses (a plan
invariant broken) is raised as deo's ``plan_refused`` alert, subject ``arbiter``, and resolved by
the next plan that runs (one that issues commands or changes who holds which GPU).
"""

from __future__ import annotations

from core import commands as c
from core import events as e
from core.arbiter import events as ae
from core.arbiter.model import ArbiterState
from core.arbiter.reducer import reduce_arbiter
from core.records import replace
from core.state import State
from core.vocabulary import AlertName

__all__ = ["ARBITER_EVENTS", "SHARED_EVENTS", "ALERT_SUBJECT", "arbiter_step"]

#: Events only the arbiter reads.
ARBITER_EVENTS: frozenset[type[e.Event]] = frozenset(
    {
        ae.ArbiterGpusDeclared,
        ae.PipelineRegistered,
        ae.ClusterRegistered,
        ae.PipelineUnregistered,
        ae.GpusRequested,
        ae.GpusReleased,
        ae.GpusReleasedAndRequested,
        ae.ProgressReported,
        ae.ProgressCleared,
        ae.RolloutOpened,
        ae.RolloutClosed,
    }
)
#: Events deo's reducer reads first and the arbiter after it (when it has GPUs).
SHARED_EVENTS: frozenset[type[e.Event]] = frozenset({e.GpuLost, e.Tick})
#: The subject of the arbiter's alerts.
ALERT_SUBJECT = "arbiter"
_REFUSED = (AlertName.PLAN_REFUSED, ALERT_SUBJECT)


def _ownership(arbiter: ArbiterState) -> object:
    """Who holds or runs on which GPUs: what a plan that ran changes."""
    return arbiter.idle, [(p, c.held, c.active_ranks) for p, c in arbiter.clusters()]


def arbiter_step(state: State, event: e.Event) -> tuple[State, list[c.Command]]:
    """``state`` with ``event`` applied to its arbiter, and the arbiter's commands.

    Raises the arbiter's :class:`~core.errors.DeoError` on bad input, leaving ``state`` as it was.
    """
    arbiter, commands = reduce_arbiter(state.arbiter, event)
    alerts = state.alerts
    refused = any(
        isinstance(command, c.RaiseAlert) and command.alert == AlertName.PLAN_REFUSED
        for command in commands
    )
    if refused:
        alerts = alerts | {_REFUSED}
    elif _REFUSED in alerts and (commands or _ownership(arbiter) != _ownership(state.arbiter)):
        alerts = alerts - {_REFUSED}
        commands = [
            *commands,
            c.ResolveAlert(
                alert=AlertName.PLAN_REFUSED,
                subject=ALERT_SUBJECT,
                reason=f"the arbiter's plan after {type(event).__name__} was sound and ran",
            ),
        ]
    return replace(state, arbiter=arbiter, alerts=alerts, now=max(state.now, event.t)), commands
