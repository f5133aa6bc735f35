"""The reducer's state: plain frozen records, rebuilt (never mutated) by each step.

Only live workers are kept; an exited worker is forgotten except for its pool's counters
(``next_index`` tells an already-exited worker from one that never existed, so a late or repeated
report about it is a no-op rather than an error).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import Any, TypeVar

import attrs

from core.arbiter.model import ArbiterState
from core.config import Config, PolicySpec, PoolSpec
from core.convert import str_tuple
from core.errors import InvalidEvent
from core.events import LoadSampled, QueueSampled
from core.lifecycle import COUNTED, WorkerState
from core.policies.base import Policy
from core.records import replaceable
from core.vocabulary import AlertName, StopCause, as_alert_name, as_cordon_causes, as_stop_cause

__all__ = [
    "Gpu",
    "HeldChange",
    "PoolState",
    "State",
    "Worker",
    "count_workers",
    "split_worker_id",
]

K = TypeVar("K")
V = TypeVar("V")


def _alert_set(value: Iterable[Iterable[str]]) -> frozenset[tuple[AlertName, str]]:
    if type(value) is frozenset:
        return value
    pairs = (tuple(a) for a in value)
    return frozenset((as_alert_name(a), s) for a, s in pairs)


def _worker_state(value: WorkerState | str) -> WorkerState:
    if type(value) is WorkerState:
        return value
    try:
        return WorkerState(value)
    except ValueError:
        known = ", ".join(s.value for s in WorkerState)
        raise InvalidEvent(f"unknown worker state {value!r} (known: {known})") from None


def _retry_tuple(value: Iterable[Iterable[Any]]) -> tuple[tuple[float, int], ...]:
    # The log gives lists of lists; the state must compare equal after a round trip.
    return tuple((float(failed_t), int(failures)) for failed_t, failures in value)


def _drain_tuple(value: Iterable[Iterable[Any]]) -> tuple[tuple[float, bool], ...]:
    return tuple((float(seconds), bool(cut)) for seconds, cut in value)


def _read_only(value: Mapping[K, V]) -> MappingProxyType[K, V]:
    # A copy: the caller's dict stays theirs, and editing it cannot change the state.
    return MappingProxyType(dict(value))


@replaceable
@attrs.frozen(slots=True, kw_only=True, init=False)
class Worker:
    """One worker, from the moment the core asks for it until it exits."""

    worker_id: str
    pool: str
    index: int
    state: WorkerState = attrs.field(converter=_worker_state)
    gpus: tuple[str, ...] = attrs.field(converter=str_tuple)
    requested_t: float
    started_t: float | None = None
    pid: int | None = None
    #: OS process start time; with ``pid`` it identifies the process across restarts.
    start_time: int | None = None
    #: When the reducer takes the state's deadline action (``lifecycle.DEADLINE_ACTIONS``); None
    #: in the states that have none.
    deadline_t: float | None = None
    #: Why deo is stopping it; None if it is not.
    stop_cause: StopCause | None = attrs.field(default=None, converter=as_stop_cause)
    #: An engine's port (``http://HOST:{port}``, HOST the address its executor gives: 127.0.0.1
    #: on deo's machine), held from its spawn until it exits, asleep or not; None for others.
    port: int | None = None
    #: Requests in flight at the engine as last reported (router or metrics); None: not known.
    in_flight_requests: int | None = None
    #: Sleep or wake calls sent in the current attempt to sleep or wake (retries are bounded).
    control_attempts: int = 0
    #: When the engine confirmed it sleeps (its memory released; it keeps its GPUs and port).
    asleep_t: float | None = None
    #: Early failures in a row of the worker slot it fills (0: a fresh slot, or one proven
    #: healthy): the crash-loop rules judge each slot by its own history.
    attempt: int = 0
    #: When its drain signal went out (None: not draining, or drained before it started): the
    #: start of the drain its pool measures.
    drain_started_t: float | None = None
    #: The deadline its drain was given, in seconds after the drain signal (None: not drained),
    #: and whether the pool's measured drains set it (``"auto"`` past the start value).
    drain_deadline_s: float | None = None
    drain_measured: bool = False

    def __init__(
        self,
        *,
        worker_id: str,
        pool: str,
        index: int,
        state: WorkerState | str,
        gpus: Iterable[str],
        requested_t: float,
        started_t: float | None = None,
        pid: int | None = None,
        start_time: int | None = None,
        deadline_t: float | None = None,
        stop_cause: str | None = None,
        port: int | None = None,
        in_flight_requests: int | None = None,
        control_attempts: int = 0,
        asleep_t: float | None = None,
        attempt: int = 0,
        drain_started_t: float | None = None,
        drain_deadline_s: float | None = None,
        drain_measured: bool = False,
        killed: bool = False,
    ) -> None:
        # Snapshots written before KILLED was a state marked a killed worker STOPPING with
        # ``killed``: read it as the state it is now.
        if killed and _worker_state(state) is WorkerState.STOPPING:
            state = WorkerState.KILLED
        self.__attrs_init__(
            worker_id=worker_id,
            pool=pool,
            index=index,
            state=state,
            gpus=gpus,
            requested_t=requested_t,
            started_t=started_t,
            pid=pid,
            start_time=start_time,
            deadline_t=deadline_t,
            stop_cause=stop_cause,
            port=port,
            in_flight_requests=in_flight_requests,
            control_attempts=control_attempts,
            asleep_t=asleep_t,
            attempt=attempt,
            drain_started_t=drain_started_t,
            drain_deadline_s=drain_deadline_s,
            drain_measured=drain_measured,
        )

    @property
    def counted(self) -> bool:
        return self.state in COUNTED

    @property
    def holds_memory(self) -> bool:
        """Whether it holds (or may be taking) its GPUs' memory: every live worker but an engine
        confirmed asleep and not woken since (asleep, or being stopped from there). Any number
        of asleep engines may share a GPU with the one worker that holds its memory."""
        return self.state is not WorkerState.SLEEPING and self.asleep_t is None


@replaceable
@attrs.frozen(slots=True, kw_only=True)
class Gpu:
    """One GPU of the inventory and why, if at all, it is cordoned."""

    gpu_id: str
    #: Every active cordon cause (see :func:`core.vocabulary.as_cordon_causes`); empty if none.
    causes: frozenset[str] = attrs.field(default=frozenset(), converter=as_cordon_causes)
    #: Since when samples have shown no transient cause (the uncordon hysteresis clock).
    clean_since_t: float | None = None
    memory_used_bytes: int | None = None
    memory_total_bytes: int | None = None
    temperature_c: float | None = None

    @property
    def cordoned(self) -> bool:
        return bool(self.causes)


@replaceable
@attrs.frozen(slots=True, kw_only=True)
class HeldChange:
    """A removal the pool's policy asks for that the stabilization window holds back: HPA's
    ``ScaleDownStabilized``. It is state, not a command (nothing is done), so it shows in
    ``deo status`` and ``deo replay --at`` without adding records to the log."""

    #: The count the policy asks for, and since when it has asked for less than the pool holds.
    target: int
    since_t: float
    #: When the window closes (the last scale-up plus ``stabilization_s``).
    until_t: float
    #: The policy's latest reason.
    reason: str


@replaceable
@attrs.frozen(slots=True, kw_only=True)
class PoolState:
    """One pool: its spec, target, overrides, pressure and crash-loop bookkeeping."""

    spec: PoolSpec
    #: The target the autoscaler (or configuration) set.
    desired: int
    #: An operator's pinned count; overrides ``desired`` while set.
    pinned: int | None = None
    paused: bool = False
    #: Removed from configuration: drains to zero, then disappears.
    removed: bool = False
    next_index: int = 0
    policy_memory: Any = None
    queue: QueueSampled | None = None
    load: LoadSampled | None = None
    last_sample_t: float | None = None
    source_error: str | None = None
    #: The most early failures in a row of any one worker slot not yet proven healthy (see
    #: :class:`~core.config.CrashLoopRules`): a failed slot waiting for its replacement, or a
    #: replacement not yet up for ``early_exit_s``.
    failures: int = 0
    last_failure_t: float | None = None
    #: Unused (older logs' snapshots carry it).
    incident_t: float | None = None
    #: When the first failed slot waiting for its replacement may have it (0: none waits).
    backoff_until_t: float = 0.0
    #: Failed slots waiting for their replacement, each as (the failure's time, the failures in
    #: a row of that slot), earliest replacement first; the replacement waits
    #: ``crash_loop.backoff_s(failures)`` after the failure.
    retries: tuple[tuple[float, int], ...] = attrs.field(default=(), converter=_retry_tuple)
    last_scale_up_t: float | None = None
    #: The removal the stabilization window holds back now (None: none).
    held: HeldChange | None = None
    #: An operator woke every engine (``EnginesWakeRequested``): ``pinned`` holds them awake
    #: until autoscaling is resumed or, if set, until ``wake_hold_until_t``.
    wake_held: bool = False
    wake_hold_until_t: float | None = None
    #: The latest drains of its workers as (seconds, cut at the deadline), oldest first: what an
    #: ``"auto"`` drain deadline is measured from (:mod:`core.drains`).
    drains: tuple[tuple[float, bool], ...] = attrs.field(default=(), converter=_drain_tuple)
    #: The policy built from ``spec.policy``, with the spec it was built from (a step rebuilds it
    #: when the spec is another object). Derived, so not compared and not encoded; None until a
    #: step first needs it.
    built_policy: tuple[PolicySpec, Policy] | None = attrs.field(
        default=None, init=False, eq=False, repr=False
    )

    def held_at(self, now: float) -> HeldChange | None:
        """The removal the stabilization window holds back at ``now`` (None once its window has
        ended: the next sample applies it)."""
        return self.held if self.held is not None and now < self.held.until_t else None

    @property
    def target(self) -> int:
        """How many counted workers the pool should have now."""
        if self.removed:
            return 0
        return self.desired if self.pinned is None else self.pinned


def next_index_in(
    pools: Mapping[str, PoolState], removed_next_index: Mapping[str, int], pool: str
) -> int | None:
    """The index the next worker of ``pool`` gets, declared or removed (None: never declared)."""
    declared = pools.get(pool)
    return declared.next_index if declared is not None else removed_next_index.get(pool)


@replaceable
@attrs.frozen(slots=True, kw_only=True)
class State:
    """Everything the core knows. ``now`` is the latest event time seen.

    Its collections are read-only views (an edit raises :class:`TypeError`): a step works on
    private copies and hands out new views when it finishes.
    """

    now: float = 0.0
    config: Config = attrs.field(factory=Config)
    pools: MappingProxyType[str, PoolState] = attrs.field(
        factory=dict, converter=_read_only, hash=False
    )
    workers: MappingProxyType[str, Worker] = attrs.field(
        factory=dict, converter=_read_only, hash=False
    )
    gpus: MappingProxyType[str, Gpu] = attrs.field(factory=dict, converter=_read_only, hash=False)
    #: Each started worker's last sign of life (start, readiness, heartbeat, adoption). Kept
    #: apart from the worker records so that a heartbeat, the most frequent event, copies a
    #: float rather than a record.
    last_seen: MappingProxyType[str, float] = attrs.field(
        factory=dict, converter=_read_only, hash=False
    )
    paused_all: bool = False
    #: The time of the last tick, to tell a stall of deo itself from the ticks' usual spacing.
    last_tick_t: float | None = None
    #: The last tick came after a stall and judged no worker (the next one does, whatever comes).
    last_tick_skipped: bool = False
    #: Active alerts as (alert, subject) pairs, so each is raised once and resolved once.
    alerts: frozenset[tuple[AlertName, str]] = attrs.field(
        default=frozenset(), converter=_alert_set
    )
    #: The GPU arbiter's state (:mod:`core.arbiter`): empty unless ``deo run`` serves one.
    arbiter: ArbiterState = attrs.field(factory=ArbiterState)
    #: The next worker index of each pool removed (its workers gone): one declared again under
    #: that name numbers on from there, so no worker id repeats in a log (``deo stop --drain``
    #: removes every pool; the restart declares them again).
    removed_next_index: MappingProxyType[str, int] = attrs.field(
        factory=dict, converter=_read_only, hash=False
    )
    #: (counted, active) workers per pool that has a counted one: :func:`count_workers` of
    #: ``workers``, kept up to date by each step instead of recounted. Derived, so not compared
    #: and not encoded.
    worker_counts: MappingProxyType[str, tuple[int, int]] = attrs.field(
        init=False, eq=False, hash=False, repr=False
    )

    def __attrs_post_init__(self) -> None:
        # Only the constructor runs this (decoding, tests); a step passes its counts along.
        object.__setattr__(
            self, "worker_counts", MappingProxyType(count_workers(self.workers.values()))
        )

    def next_index_of(self, pool: str) -> int | None:
        """The index the next worker of ``pool`` gets (None: no such pool was ever declared)."""
        return next_index_in(self.pools, self.removed_next_index, pool)

    def workers_of(self, pool: str) -> list[Worker]:
        """Live workers of one pool, oldest first."""
        return sorted((w for w in self.workers.values() if w.pool == pool), key=lambda w: w.index)

    def counted(self, pool: str) -> int:
        """Workers counting toward the pool's size (requested, starting, active, waking)."""
        return self.worker_counts.get(pool, (0, 0))[0]


def count_workers(workers: Iterable[Worker]) -> dict[str, tuple[int, int]]:
    """(counted, active) workers per pool, for the pools with a counted worker."""
    counts: dict[str, tuple[int, int]] = {}
    for worker in workers:
        if worker.state in COUNTED:
            counted, active = counts.get(worker.pool, (0, 0))
            counts[worker.pool] = (counted + 1, active + (worker.state is WorkerState.ACTIVE))
    return counts


def split_worker_id(worker_id: str) -> tuple[str, int] | None:
    """``"envs-3"`` -> ``("envs", 3)``; None when the id is not one deo would have made."""
    pool, sep, index = worker_id.rpartition("-")
    if not sep or not index.isdigit():
        return None
    return pool, int(index)
