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
from core.arbiter.model import ArbiterState, ClusterSpec
from core.arbiter.reducer import reduce_arbiter
from core.config import PoolSpec, node_of
from core.errors import Refused, UnknownSubject
from core.records import replace
from core.state import State
from core.vocabulary import AlertName

__all__ = [
    "ALERT_SUBJECT",
    "ARBITER_EVENTS",
    "SHARED_EVENTS",
    "arbiter_step",
    "check_bound_pools",
    "check_engine_pools",
]

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
#: The arbiter's alerts on its holders (subject ``pipeline/cluster``).
_HOLDER_ALERTS = (AlertName.HOLDER_OVERSTAYING, AlertName.HOLD_ON_CORDONED)


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
    for command in commands:  # the arbiter's own alerts on its holders
        if isinstance(command, c.RaiseAlert) and command.alert in _HOLDER_ALERTS:
            alerts = alerts | {(command.alert, command.subject)}
        elif isinstance(command, c.ResolveAlert) and command.alert in _HOLDER_ALERTS:
            alerts = alerts - {(command.alert, command.subject)}
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


def check_engine_pools(state: State, event: e.Event) -> None:
    """Refuse a registration whose generation cluster names an engine pool deo cannot run it
    with: no such pool, not an engine pool, one engine's GPUs not the cluster's ``tp_size``,
    fewer ``max_workers``, ``max_asleep`` or ports than the cluster has ranks, a rank's bundle
    on two nodes, a pool another cluster already runs on, or GPUs outside deo's. Its GPUs may
    be another engine-run cluster's too: their engines time-share them."""
    if isinstance(event, ae.PipelineRegistered):
        specs = event.clusters
    elif isinstance(event, ae.ClusterRegistered):
        specs = (event.spec,)
    else:
        return
    bound = state.arbiter.engine_pools()
    for spec in specs:
        name = spec.engine_pool
        if name is None:
            continue
        where = f"{type(event).__name__}: {event.pipeline}/{spec.name}: engine_pool {name!r}"
        pool = state.pools.get(name)
        if pool is None or pool.removed:
            known = ", ".join(sorted(p for p, s in state.pools.items() if s.spec.is_engine))
            raise UnknownSubject(
                f"{where} is not a pool of deo's (engine pools: {known or 'none'})"
            )
        _check_runs(where, pool.spec, spec)
        if name in bound:
            pipeline, cluster = bound[name]
            raise Refused(f"{where} already runs {pipeline}/{cluster.spec.name}")
        # Engine-run clusters may share GPUs: one engine holds a GPU's memory, the others
        # there sleep (core.arbiter.engines).
        outside = [g for g in spec.device_mapping if g not in state.config.gpus]
        if outside:
            raise UnknownSubject(f"{where}: GPUs {outside} are not among deo's GPUs")


def _check_runs(where: str, pool: PoolSpec, spec: ClusterSpec) -> None:
    """Refuse ``pool`` for ``spec`` unless it can run one engine per rank on its bundle."""
    if not pool.is_engine:
        raise Refused(f"{where} is a pool of kind {pool.kind!r}, not 'engine'")
    if pool.gpus_per_worker != spec.tp_size:
        raise Refused(
            f"{where} gives each engine {pool.gpus_per_worker} GPU(s); the cluster's "
            f"ranks need tp_size={spec.tp_size}"
        )
    limits = [
        f"{field} = {value}"
        for field, value in (
            ("max_workers", pool.max_workers),
            ("max_asleep", pool.max_asleep),
            ("ports", len(pool.port_range())),
        )
        if value < spec.ranks
    ]
    if limits:
        # Every rank keeps an engine (awake or asleep), each with a port of its own.
        raise Refused(
            f"{where} has {', '.join(limits)}: fewer than the cluster's {spec.ranks} ranks "
            f"(max_workers, max_asleep and the ports must each allow one engine per rank)"
        )
    split = [
        spec.bundle(r) for r in range(spec.ranks) if len(set(map(node_of, spec.bundle(r)))) > 1
    ]
    if split:
        raise Refused(
            f"{where}: rank bundles {[list(b) for b in split]} span nodes; one engine's "
            f"GPUs must share a node"
        )


def check_bound_pools(state: State, event: e.Event) -> None:
    """Refuse a configuration that changes an engine pool a generation cluster runs so that it
    could no longer run it (the checks of :func:`check_engine_pools`). Removing the pool is
    allowed: its engines are drained like any removed pool's (``deo run``'s drain on stop
    removes every pool)."""
    if not isinstance(event, e.Configured):
        return
    pools = {pool.name: pool for pool in event.config.pools}
    for name, (pipeline, cluster) in sorted(state.arbiter.engine_pools().items()):
        where = f"Configured: engine pool {name!r} (it runs {pipeline}/{cluster.spec.name})"
        pool = pools.get(name)
        if pool is not None:
            _check_runs(where, pool, cluster.spec)
