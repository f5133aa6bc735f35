"""Engines as the router and the engine metrics source see them, and a pool's engine figures.

:class:`EngineEndpoint` is what :mod:`adapters.router` routes to and what
:mod:`adapters.sources.engine_metrics` reads; :func:`engine_figures` computes verl's figures for
an engine pool from the state (``/global-status`` and ``/metrics`` show them). Both live here,
below the router, the sources, the API and the runtime, so that each can import them without
importing the others.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs

from core import State, WorkerState

__all__ = ["EngineEndpoint", "EngineProvider", "engine_figures"]

_DRAINING = frozenset({WorkerState.GOING_TO_SLEEP, WorkerState.DRAINING})
_ASLEEP = frozenset({WorkerState.FALLING_ASLEEP, WorkerState.SLEEPING})
_STARTING = frozenset({WorkerState.REQUESTED, WorkerState.STARTING, WorkerState.WAKING})


@attrs.frozen(slots=True, kw_only=True)
class EngineEndpoint:
    """One engine as the router sees it: its worker id, its base URL, whether to send it work."""

    worker_id: str
    base_url: str
    routable: bool


#: Called for each request: the pool's engines, in a stable order (ties go to the first).
EngineProvider = Callable[[], Sequence[EngineEndpoint]]


def engine_figures(state: State, pool: str) -> dict[str, Any] | None:
    """verl's figures for an engine pool (None for other pools): engines by verl's state, the
    capacity of the active ones, the last load sample and their ratio."""
    found = state.pools.get(pool)
    if found is None or not found.spec.is_engine:
        return None
    workers = state.workers_of(pool)
    active = sum(1 for w in workers if w.state is WorkerState.ACTIVE)
    capacity = active * found.spec.capacity_per_engine
    in_flight = found.load.in_flight_requests if found.load is not None else None
    return {
        "engine": found.spec.engine,
        "active": active,
        "draining": sum(1 for w in workers if w.state in _DRAINING),
        "inactive": sum(1 for w in workers if w.state in _ASLEEP),
        "starting": sum(1 for w in workers if w.state in _STARTING),
        "capacity_per_engine": found.spec.capacity_per_engine,
        "total_capacity": capacity,
        "in_flight_requests": in_flight,
        # verl's rule: requests in flight over the active engines' capacity.
        "load_ratio": None if in_flight is None or capacity == 0 else in_flight / capacity,
        # Only draining engines are counted one by one (their drains end at 0); the router's
        # GET /router/engines shows every engine's.
        "in_flight_by_engine": {
            w.worker_id: w.in_flight_requests for w in workers if w.state in _DRAINING
        },
        "router_port": found.spec.router_port or None,
    }
