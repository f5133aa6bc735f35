"""Liveness batching: heartbeats gathered between ticks and logged as one ``WorkersSeen`` a tick.

A heartbeat is the most frequent input deo has (every worker, every fraction of a second); with
one record per heartbeat the log would grow by about 100 bytes per worker per second. The core
needs a worker's last sign of life only as precisely as its pool's ``heartbeat_grace_s`` asks, so
a sighting is recorded only once the core's record of that worker is a quarter of the grace old
(:data:`UNJUDGED_REFRESH_S` for pools that judge no heartbeat), and then for every such worker in
one record, just before the tick that judges them.

Why no worker is judged hung that was seen within its grace: at each tick, a worker with an
unrecorded sighting either is recorded now (at the tick's time, which is after the sighting) or
its record is younger than the refresh, a quarter of the grace. The price is precision the other
way: a worker that stops is found hung at most a quarter of the grace later than a record per
heartbeat would have found it.
"""

from __future__ import annotations

from core import State, WorkersSeen
from core.handlers import check_seen

__all__ = ["UNJUDGED_REFRESH_S", "Liveness"]

#: How old the core's record of a worker whose pool judges no heartbeat may grow (status only).
UNJUDGED_REFRESH_S = 30.0
#: A sighting is recorded once the core's record is this fraction of the grace old.
REFRESH_FRACTION = 0.25


class Liveness:
    """Sightings since the last record, by worker id. Used from the event loop only."""

    def __init__(self) -> None:
        self._pending: set[str] = set()

    @property
    def pending(self) -> frozenset[str]:
        """The workers seen since their last record, not yet recorded."""
        return frozenset(self._pending)

    def saw(self, state: State, worker_id: str) -> None:
        """Note a sign of life of ``worker_id``.

        Raises :class:`~core.errors.UnknownSubject` for a worker deo never made; a worker that
        already exited is ignored (a late heartbeat)."""
        if check_seen(state, worker_id):
            self._pending.add(worker_id)

    def due(self, state: State, t: float) -> WorkersSeen | None:
        """The sightings the core needs before judging at ``t``, as one event (None if none).

        Those not due yet stay pending; those of workers gone since are dropped."""
        due: set[str] = set()
        for worker_id in list(self._pending):
            worker = state.workers.get(worker_id)
            if worker is None:
                self._pending.discard(worker_id)
                continue
            grace = state.pools[worker.pool].spec.heartbeat_grace_s
            refresh = UNJUDGED_REFRESH_S if grace is None else grace * REFRESH_FRACTION
            last = state.last_seen.get(worker_id)
            if last is None or t - last >= refresh:
                due.add(worker_id)
        if not due:
            return None
        self._pending -= due
        return WorkersSeen(t=t, worker_ids=due)
