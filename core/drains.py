"""How long a drain may run before deo escalates to SIGTERM: fixed, or measured from the pool.

A pool's ``drain_timeout_s`` is either a number of seconds (the operator's: always used) or
``"auto"`` (the default). In auto, each drain of a worker of the pool is measured from the drain
signal to the worker's exit, or, if its deadline came first, to the deadline (a cut drain: it
would have taken longer). Once :data:`MIN_DRAINS` drains are measured, the deadline is a high
quantile of the latest :data:`WINDOW_DRAINS` drains times a margin, within [:data:`FLOOR_S`,
:data:`CAP_S`]; before that it is :data:`START_S`. A cut drain counts at the length it was
allowed, so when drains are cut often enough to reach the quantile the next deadline is at least
the margin longer than the one that cut them: the deadline grows until drains end on their own.
No drain counts longer than its deadline (a tick that escalates late, an exit seen after the
deadline: deo's downtime is not the drain's). A pool reconfigured to run another program
(``argv``, ``env`` or ``kind``) forgets its drains.

Engine pools drain their in-flight requests, which deo sees directly; in auto their drains and
sleeps wait :data:`START_S`.

Everything here is a function of the pool's recorded drains, which only events change, so replay
reproduces every deadline.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from core.config import AUTO, PoolSpec

__all__ = [
    "CAP_S",
    "FLOOR_S",
    "MARGIN",
    "MIN_DRAINS",
    "QUANTILE",
    "START_S",
    "WINDOW_DRAINS",
    "drain_timeout",
    "engine_drain_timeout_s",
    "is_measured",
    "with_drain",
]

#: The deadline in auto until enough drains are measured (deo's fixed default before auto).
START_S = 60.0
#: Bounds of a measured deadline: no drain is cut sooner than FLOOR_S, none waits beyond CAP_S.
FLOOR_S = 10.0
CAP_S = 1800.0
#: The measured deadline is MARGIN x the QUANTILE of the latest WINDOW_DRAINS drains ...
QUANTILE = 0.95
MARGIN = 1.5
WINDOW_DRAINS = 40
#: ... once at least this many drains were measured.
MIN_DRAINS = 3


def _quantile(values: Iterable[float], q: float) -> float:
    """The ``q`` quantile of ``values`` (the nearest rank at or above it)."""
    ordered = sorted(values)
    rank = max(math.ceil(q * len(ordered)) - 1, 0)
    return ordered[rank]


def drain_timeout(spec: PoolSpec, drains: tuple[tuple[float, bool], ...]) -> tuple[float, str]:
    """The drain deadline in seconds for a pool with ``spec`` and recorded ``drains`` (seconds,
    cut), and why it is that long."""
    if spec.drain_timeout_s != AUTO:
        return float(spec.drain_timeout_s), "drain_timeout_s set in the configuration"
    if spec.kind == "engine":
        return START_S, "auto: an engine's drain waits on its in-flight requests"
    if len(drains) < MIN_DRAINS:
        return START_S, f"auto: {len(drains)} of {MIN_DRAINS} drains measured, the start value"
    latest = drains[-WINDOW_DRAINS:]
    high = _quantile((seconds for seconds, _ in latest), QUANTILE)
    cut = sum(1 for _, was_cut in latest if was_cut)
    wanted = MARGIN * high
    # Whole seconds: a deadline is not that precise, and reads better.
    timeout = min(max(wanted, FLOOR_S), CAP_S)
    bound = ""
    if timeout != wanted:
        bound = f", {'floor' if timeout > wanted else 'cap'} {timeout:g}s"
    cuts = f", {cut} cut at their deadline" if cut else ""
    why = (
        f"auto: {MARGIN:g} x p{QUANTILE * 100:g} {high:.1f}s of the last {len(latest)} "
        f"drains{cuts}{bound}"
    )
    return float(round(timeout)), why


def is_measured(spec: PoolSpec, drains: tuple[tuple[float, bool], ...]) -> bool:
    """Whether :func:`drain_timeout` measures the deadline from ``drains`` (not the
    configuration's number or the start value)."""
    return spec.drain_timeout_s == AUTO and not spec.is_engine and len(drains) >= MIN_DRAINS


def engine_drain_timeout_s(spec: PoolSpec) -> float:
    """How long an engine's in-flight requests get before its sleep call or SIGTERM."""
    return drain_timeout(spec, ())[0]


def with_drain(
    drains: tuple[tuple[float, bool], ...], seconds: float, cut: bool
) -> tuple[tuple[float, bool], ...]:
    """``drains`` with one more (its ``seconds``, whether its deadline cut it), the latest
    :data:`WINDOW_DRAINS` kept."""
    return (*drains[-(WINDOW_DRAINS - 1) :], (round(seconds, 3), cut))
