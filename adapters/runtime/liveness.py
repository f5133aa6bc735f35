"""Liveness batching: heartbeats gathered between ticks and logged as few ``WorkersSeen`` as the
core's judgement needs.

A heartbeat is the most frequent input deo has (every worker, every fraction of a second); with
one record per heartbeat the log would grow by about 100 bytes per worker per second. The core
needs a worker's last sign of life only to judge it hung once it has been silent for its pool's
``heartbeat_grace_s``, so :meth:`Liveness.records` records a worker only when the core's record of
it is nearly a grace old (two tick intervals short of it, never under a quarter of it;
:data:`UNJUDGED_REFRESH_S` for pools that judge no heartbeat), and each with the time deo saw it
(rounded up to a tick interval, in one record per such time). At 10,000 workers and a 30 s
grace that is one id per worker per 28 s instead of one per heartbeat. A worker's first sighting
is recorded at the next tick whatever its grace: it tells how long the worker took to come up,
which the log keeps for the demo's summary (after a restart, once more per adopted worker).

Why no worker is judged hung that was seen within its grace: a tick at ``t`` judges with every
sighting a worker's record is old enough to need, recorded just before it at the sighting's
time (or a little after). Why a silent worker is still found on time: its last sighting is
recorded with the time it was made, not the time it was recorded, so its deadline is that
sighting plus its grace, to within a tick interval.
"""

from __future__ import annotations

import math

from core import State, WorkersSeen
from core.handlers import check_seen

__all__ = ["UNJUDGED_REFRESH_S", "Liveness"]

#: How old the core's record of a worker whose pool judges no heartbeat may grow (status only).
UNJUDGED_REFRESH_S = 30.0
#: A sighting is recorded once the core's record is this fraction of the grace old.
REFRESH_FRACTION = 0.25


class Liveness:
    """Sightings since the last record, by worker id, with when each was last seen. Used from
    the event loop only."""

    def __init__(self) -> None:
        #: worker id -> the time of its latest sighting (None: not known; taken as record time)
        self._pending: dict[str, float | None] = {}
        #: The workers whose first sighting was recorded.
        self._recorded: set[str] = set()

    @property
    def pending(self) -> frozenset[str]:
        """The workers seen since their last record, not yet recorded."""
        return frozenset(self._pending)

    def saw(self, state: State, worker_id: str, t: float | None = None) -> None:
        """Note a sign of life of ``worker_id`` at ``t`` (deo's clock; None: unknown).

        Raises :class:`~core.errors.UnknownSubject` for a worker deo never made; a worker that
        already exited is ignored (a late heartbeat)."""
        if check_seen(state, worker_id):
            before = self._pending.get(worker_id)
            if t is None or before is None or t > before:
                self._pending[worker_id] = t

    def records(self, state: State, t: float, interval_s: float) -> list[WorkersSeen]:
        """The sightings the core needs before the tick at ``t`` judges, as few events as their
        times allow (one per tick interval they fall in); the rest stay pending, those of
        workers gone since are dropped."""
        by_time: dict[float | None, set[str]] = {}
        self._recorded.intersection_update(state.workers)  # forget workers gone
        for worker_id, seen_t in list(self._pending.items()):
            worker = state.workers.get(worker_id)
            if worker is None:
                del self._pending[worker_id]
                continue
            grace = state.pools[worker.pool].spec.heartbeat_grace_s
            if grace is None:
                refresh = UNJUDGED_REFRESH_S
            else:
                refresh = max(grace * REFRESH_FRACTION, grace - 2 * interval_s)
            last = state.last_seen.get(worker_id)
            first = worker_id not in self._recorded
            if last is not None and t - last < refresh and not first:
                continue
            del self._pending[worker_id]
            self._recorded.add(worker_id)
            if seen_t is not None:
                # Rounded up (never judged before its time), to share records; at most t.
                seen_t = min(t, max(seen_t, math.ceil(seen_t / interval_s) * interval_s))
            by_time.setdefault(seen_t, set()).add(worker_id)
        return [
            WorkersSeen(t=t, worker_ids=ids, seen_t=seen_t)
            for seen_t, ids in sorted(
                by_time.items(), key=lambda item: t if item[0] is None else item[0]
            )
        ]
