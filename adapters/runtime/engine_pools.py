"""Engine pools under ``deo run``: each pool's router and its load from the engines' metrics.

For every pool of kind ``engine`` in the configuration:

- a router (:class:`adapters.router.EngineRouter`) on ``127.0.0.1:router_port`` when the pool
  sets one, whose engines are read from the runner's state at each request: an engine is
  routable only while ACTIVE (never starting, waking, draining, going to sleep or asleep);
- a load source (:mod:`adapters.sources.engine_metrics`) reading the ``/metrics`` of the
  engines that may have requests in flight (active, draining, going to sleep), unless the pool
  has a ``source`` of its own. It emits the pool's ``LoadSampled`` (or ``SourceDown``) every
  ``interval_s``: the engines' requests, plus the requests the router holds waiting for an engine
  and those it has in flight at engines no longer measured, so that a pool with no engine awake
  still sees its load (and scales up);
- a drain watch, for every engine pool (a ``source`` of its own included): every
  ``DRAIN_WATCH_S`` it reads the draining engines and emits an ``EngineLoadSampled`` for one
  whenever its count changes (taking the router's count where it is larger), so a drain ends at
  0 in flight rather than at its timeout.

:func:`~adapters.engine_endpoints.engine_figures` (re-exported here) computes verl's figures for
a pool from the state (``/global-status`` and ``/metrics`` show them): load ratio, engines
active/draining/inactive/starting, capacity.

Each engine is reached at the address its executor gives
(:class:`~adapters.runtime.engine_hosts.EngineHosts`: 127.0.0.1 on deo's machine, the node's
address over Ray); an engine whose address is not known yet is neither routed to nor read.

Routers bind when deo starts (:func:`bind_routers`), before the log is touched, so a port in
use is an error at start-up, not a task failing later.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Sequence

import anyio
import attrs
import httpx

from adapters.api.serving import listen
from adapters.engine_endpoints import EngineEndpoint, engine_figures
from adapters.router import EngineRouter, serve_router
from adapters.runtime.engine_hosts import EngineHosts, LocalEngineHosts
from adapters.runtime.engines import engine_url
from adapters.sources.engine_metrics import EngineMetricsSource, sample_engine_metrics
from core import Config, EngineLoadSampled, Event, LoadSampled, PoolSpec, State, WorkerState

__all__ = [
    "MEASURED_STATES",
    "EnginePool",
    "bind_routers",
    "engine_endpoints",
    "engine_figures",
    "run_engine_pools",
]

#: Engines whose requests count: they serve, or finish what they were sent.
MEASURED_STATES = frozenset({WorkerState.ACTIVE, WorkerState.GOING_TO_SLEEP, WorkerState.DRAINING})
#: How often draining engines are read (their drains end at 0 in flight).
DRAIN_WATCH_S = 0.25
_DRAINING = frozenset({WorkerState.GOING_TO_SLEEP, WorkerState.DRAINING})


def engine_endpoints(
    state: State,
    pool: str,
    states: frozenset[WorkerState] | None = None,
    hosts: EngineHosts | None = None,
) -> list[EngineEndpoint]:
    """The pool's engines that hold a port (in ``states``, if given) at an address ``hosts``
    knows (by default: all on deo's machine), oldest first; routable while ACTIVE."""
    where = hosts if hosts is not None else LocalEngineHosts()
    found = []
    for worker in state.workers_of(pool):
        if worker.port is None or (states is not None and worker.state not in states):
            continue
        host = where.engine_host(worker.worker_id)
        if host is None:
            continue
        found.append(
            EngineEndpoint(
                worker_id=worker.worker_id,
                base_url=engine_url(worker.port, host),
                routable=worker.state is WorkerState.ACTIVE,
            )
        )
    return found


@attrs.define(slots=True, kw_only=True)
class EnginePool:
    """One engine pool's router (and its bound socket, if it serves one) and load source."""

    spec: PoolSpec
    router: EngineRouter
    sock: socket.socket | None
    #: How its engines' /metrics are read (by the drain watch always, by the load source too
    #: unless ``own_source``).
    metrics: EngineMetricsSource
    #: The pool's load comes from a source of its own: no pool-level sample from the engines.
    own_source: bool
    #: Where its engines run.
    hosts: EngineHosts = attrs.field(factory=LocalEngineHosts)


def bind_routers(
    config: Config,
    state: Callable[[], State],
    *,
    own_sources: frozenset[str] = frozenset(),
    metrics_interval_s: float = 2.0,
    hosts: EngineHosts | None = None,
) -> list[EnginePool]:
    """An :class:`EnginePool` per engine pool, routers bound on loopback, engines reached where
    ``hosts`` says (by default: on deo's machine); OSError (the socket's) naming the pool if a
    port cannot be bound (earlier ones closed)."""
    where = hosts if hosts is not None else LocalEngineHosts()

    pools: list[EnginePool] = []
    try:
        for spec in config.pools:
            if not spec.is_engine or spec.engine is None:
                continue
            name = spec.name

            def provider(name: str = name) -> list[EngineEndpoint]:
                return engine_endpoints(state(), name, hosts=where)

            sock = None
            if spec.router_port:
                try:
                    sock = listen("127.0.0.1", spec.router_port)
                except OSError as exc:
                    raise OSError(
                        exc.errno, f"pools.{name}.router_port {spec.router_port}: {exc.strerror}"
                    ) from None
            metrics = EngineMetricsSource(
                pool=name, engine=spec.engine, interval_s=metrics_interval_s
            )
            pools.append(
                EnginePool(
                    spec=spec,
                    router=EngineRouter(name, provider),
                    sock=sock,
                    metrics=metrics,
                    own_source=name in own_sources,
                    hosts=where,
                )
            )
    except BaseException:
        for pool in pools:
            if pool.sock is not None:
                pool.sock.close()
        raise
    return pools


async def _read(
    pool: EnginePool,
    client: httpx.AsyncClient,
    engines: Sequence[EngineEndpoint],
    clock: Callable[[], float],
) -> tuple[list[Event], dict[str, int]]:
    """One reading of ``engines`` and the router's counts it used."""
    # Read after the state the engines came from: every request the router sent them counts.
    routed = pool.router.in_flight()
    events = await sample_engine_metrics(client, pool.metrics, engines, clock, routed)
    return events, routed


def _with_router_load(
    sample: LoadSampled, pool: EnginePool, engines: Sequence[EngineEndpoint], routed: dict[str, int]
) -> LoadSampled:
    """The pool's sample plus what the engines cannot report: requests waiting in the router for
    an engine, and those in flight at engines no longer measured (stopping, falling asleep)."""
    measured = {engine.worker_id for engine in engines}
    unmeasured = sum(count for worker, count in routed.items() if worker not in measured)
    extra = pool.router.waiting_requests + unmeasured
    if not extra:
        return sample
    return attrs.evolve(sample, in_flight_requests=sample.in_flight_requests + extra)


async def _poll(
    pool: EnginePool,
    state: Callable[[], State],
    emit: Callable[[Event], None],
    clock: Callable[[], float],
) -> None:
    """The pool's load every ``interval_s``: all the engines with requests to count, and the
    router's waiting requests."""
    name = pool.spec.name
    async with httpx.AsyncClient(timeout=pool.metrics.timeout_s) as client:
        while True:
            now = state()
            current = now.pools.get(name)
            # A pool removed (or being removed, as when deo stops) takes no samples.
            if current is not None and not current.removed:
                engines = engine_endpoints(now, name, MEASURED_STATES, pool.hosts)
                events, routed = await _read(pool, client, engines, clock)
                for event in events:
                    if isinstance(event, LoadSampled):
                        emit(_with_router_load(event, pool, engines, routed))
                    # Per-engine counts go only from the drain watch (below).
                    elif not isinstance(event, EngineLoadSampled):
                        emit(event)
            await anyio.sleep(pool.metrics.interval_s)


async def _watch_drains(
    pool: EnginePool,
    state: Callable[[], State],
    emit: Callable[[Event], None],
    clock: Callable[[], float],
) -> None:
    """Each draining engine's requests in flight, every ``DRAIN_WATCH_S``, whenever the core's
    count differs, so that its drain ends as soon as the last request is answered.

    Only engines that had left routing when the router's counts were taken, and are still in
    that same drain when the reading ends, are reported: the router sends such an engine nothing
    more, so its count can only fall, and a 0 is final. A count taken while an engine still
    served would be stale by the time the core read it, and so would one read across a drain
    that was called off and begun again (routed in between): a drain is told from the next by
    its deadline.
    """
    name = pool.spec.name
    async with httpx.AsyncClient(timeout=pool.metrics.timeout_s) as client:
        while True:
            now = state()
            before = _drains(now, name)
            engines = engine_endpoints(now, name, _DRAINING, pool.hosts)
            if engines:
                events, _ = await _read(pool, client, engines, clock)
                after = state()
                known = {w.worker_id: w.in_flight_requests for w in after.workers_of(name)}
                still = _drains(after, name)
                for event in events:
                    if (
                        isinstance(event, EngineLoadSampled)
                        and event.worker_id in before
                        and still.get(event.worker_id) == before[event.worker_id]
                        and known.get(event.worker_id, -1) != event.in_flight_requests
                    ):
                        emit(event)
            await anyio.sleep(DRAIN_WATCH_S)


def _drains(state: State, pool: str) -> dict[str, tuple[WorkerState, float | None]]:
    """The pool's engines out of routing, each with what tells its drain from a later one."""
    return {
        worker.worker_id: (worker.state, worker.deadline_t)
        for worker in state.workers_of(pool)
        if worker.state in _DRAINING
    }


async def run_engine_pools(
    pools: Sequence[EnginePool],
    state: Callable[[], State],
    emit: Callable[[Event], None],
    clock: Callable[[], float],
    out: Callable[[str], None] = print,
) -> None:
    """Serve every pool's router and poll its engines until cancelled."""
    async with anyio.create_task_group() as tasks:
        for pool in pools:
            if pool.sock is not None:
                sock = pool.sock
                out(
                    f"deo: pool {pool.spec.name}: OpenAI-compatible router on "
                    f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
                )
                tasks.start_soon(_serve, pool.router, sock)
            if not pool.own_source:
                tasks.start_soon(_poll, pool, state, emit, clock)
            # Drains end at 0 in flight whatever the pool's load is read from.
            tasks.start_soon(_watch_drains, pool, state, emit, clock)


async def _serve(router: EngineRouter, sock: socket.socket) -> None:
    await serve_router(router, sock=sock)
