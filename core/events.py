"""Events: everything that enters the core. Each carries its timestamp ``t`` in seconds.

Events are facts about the world (a sample was taken, a process exited, an operator asked for
something). Time never comes from a clock inside the core: it comes from ``t``, and ``Tick`` exists
only to let time pass when nothing else happens. Events validate their own fields on construction
and raise :class:`InvalidEvent` with a message naming the field.
"""

from __future__ import annotations

import attrs

from core.config import Config
from core.convert import CheckedRecord, Name, Seconds, str_set
from core.errors import InvalidEvent

__all__ = [
    "AutoscalingPaused",
    "AutoscalingResumed",
    "ClusterReachable",
    "ClusterUnreachable",
    "Configured",
    "DrainRequested",
    "EngineAsleep",
    "EngineAwake",
    "EngineLoadSampled",
    "EngineSleepFailed",
    "EngineWakeFailed",
    "EnginesWakeRequested",
    "Event",
    "GpuCordonRequested",
    "GpuLost",
    "GpuSampled",
    "GpuUncordonRequested",
    "LeftoverProcesses",
    "LeftoverProcessesStopped",
    "LoadSampled",
    "PoolPinned",
    "QueueSampled",
    "SourceDown",
    "SpawnFailed",
    "Tick",
    "WorkerAdopted",
    "WorkerExited",
    "WorkerHeartbeat",
    "WorkerLost",
    "WorkerReady",
    "WorkerStarted",
    "WorkersSeen",
]


@attrs.frozen(slots=True, kw_only=True)
class Event(CheckedRecord):
    """Base class of every input. ``t`` is the time the fact was observed, in seconds.

    Construction checks every field against its annotation (``int``: an integer in [0, 2**63);
    ``float``: finite; :data:`~core.convert.Seconds`: finite and >= 0; ``str``: a string;
    :data:`~core.convert.Name`: a non-empty string; ``X | None``: None or X; nested records:
    instances of their class) and raises :class:`InvalidEvent` naming the class, the field and
    the value. A subclass declares only what its annotations cannot say, in :meth:`_check`.
    """

    t: Seconds


@attrs.frozen(slots=True, kw_only=True)
class Tick(Event):
    """Time passes: deadlines, heartbeat expiry, backoff and cordon hysteresis are checked.

    ``interval_s`` is how far apart the ticker means its ticks to be. With it, a tick that comes
    much later than the previous one (more than :data:`~core.step.STALL_FACTOR` intervals) tells
    the core that deo itself was not observing in between (stopped, a VM pause): that time is not
    counted against any worker's heartbeat, and the tick judges no worker, so that the reports
    queued during the stall arrive first. None (older logs) disables this.
    """

    interval_s: Seconds | None = None

    def _check(self) -> None:
        if self.interval_s == 0:
            raise InvalidEvent("Tick.interval_s must be > 0 (or None), got 0")


# --- configuration and operator overrides ------------------------------------------------------


@attrs.frozen(slots=True, kw_only=True)
class Configured(Event):
    """The whole configuration, declared or changed (declarative, like ``kubectl apply``)."""

    config: Config


@attrs.frozen(slots=True, kw_only=True)
class AutoscalingPaused(Event):
    """Stop policy decisions for one pool, or all pools when ``pool`` is None.

    Crashed workers are still replaced: pausing freezes the count, not the pool.
    """

    pool: Name | None = None


@attrs.frozen(slots=True, kw_only=True)
class AutoscalingResumed(Event):
    """Resume policy decisions for one pool, or all pools when ``pool`` is None."""

    pool: Name | None = None


@attrs.frozen(slots=True, kw_only=True)
class PoolPinned(Event):
    """Pin a pool at ``count`` workers (within its bounds); ``count=None`` unpins it."""

    pool: Name
    count: int | None


@attrs.frozen(slots=True, kw_only=True)
class DrainRequested(Event):
    """Drain one worker gracefully; the pool replaces it (pin the pool to shrink it instead)."""

    worker_id: Name


@attrs.frozen(slots=True, kw_only=True)
class GpuCordonRequested(Event):
    """An operator cordons a GPU: no new worker is placed on it until uncordoned."""

    gpu_id: Name


@attrs.frozen(slots=True, kw_only=True)
class GpuUncordonRequested(Event):
    """An operator lifts every cordon on a GPU, including error and loss cordons."""

    gpu_id: Name


@attrs.frozen(slots=True, kw_only=True)
class EnginesWakeRequested(Event):
    """An operator wakes every engine of an engine pool (before a validation pass, say): the pool
    is held at all its engines, sleeping ones woken, until ``hold_s`` has passed or, with
    ``hold_s`` None, until the operator resumes its autoscaling."""

    pool: Name
    hold_s: Seconds | None = None

    def _check(self) -> None:
        if self.hold_s == 0:
            raise InvalidEvent("EnginesWakeRequested.hold_s must be > 0 (or None), got 0")


# --- pressure ------------------------------------------------------------------------------------


@attrs.frozen(slots=True, kw_only=True)
class QueueSampled(Event):
    """A trainer's queue, in sequences (Atropos: queued groups x group size).

    ``trainer_step`` advancing is how consumption is measured: each step consumes
    ``batch_size_seqs`` sequences.
    """

    pool: Name
    queued_sequences: int
    batch_size_seqs: int
    trainer_step: int

    def _check(self) -> None:
        if self.batch_size_seqs == 0:
            raise InvalidEvent("QueueSampled.batch_size_seqs must be >= 1, got 0")


@attrs.frozen(slots=True, kw_only=True)
class LoadSampled(Event):
    """In-flight requests summed over a pool's workers (inference engines, request servers)."""

    pool: Name
    in_flight_requests: int


@attrs.frozen(slots=True, kw_only=True)
class EngineLoadSampled(Event):
    """Requests at one engine, as its router or its ``/metrics`` counts them: in flight (sent,
    not yet answered) and, of those, waiting in the engine's queue. A draining engine's drain
    ends when its in-flight count reaches 0."""

    pool: Name
    worker_id: Name
    in_flight_requests: int
    waiting_requests: int = 0


@attrs.frozen(slots=True, kw_only=True)
class SourceDown(Event):
    """A pool's pressure source could not be read: the pool holds its count until it returns."""

    pool: Name
    error: str


@attrs.frozen(slots=True, kw_only=True)
class ClusterUnreachable(Event):
    """The cluster the workers run on (a Ray head at ``address``) does not answer: its workers
    are not taken for lost on a guess, and a ``cluster_unreachable`` alert stays raised until
    :class:`ClusterReachable`."""

    address: Name
    error: str


@attrs.frozen(slots=True, kw_only=True)
class ClusterReachable(Event):
    """The cluster at ``address`` answers again (or answered when deo started)."""

    address: Name


# --- workers -------------------------------------------------------------------------------------


@attrs.frozen(slots=True, kw_only=True)
class WorkerStarted(Event):
    """A spawned worker's process exists. ``pid`` with ``start_time`` identifies it uniquely."""

    worker_id: Name
    pid: int
    #: The process start time as the OS reports it (``/proc/PID/stat`` field 22), not wall time.
    start_time: int


@attrs.frozen(slots=True, kw_only=True)
class WorkerReady(Event):
    """A worker reports it is ready to produce (only awaited when the pool requires it)."""

    worker_id: Name


@attrs.frozen(slots=True, kw_only=True)
class WorkerHeartbeat(Event):
    """A worker is alive: one sign of life, one record.

    ``deo run`` does not emit it (it records sightings in batches: :class:`WorkersSeen`); it is
    kept so that older logs replay and for code embedding the core that reports each heartbeat.
    """

    worker_id: Name


@attrs.frozen(slots=True, kw_only=True)
class WorkersSeen(Event):
    """Workers that showed a sign of life since the last record of them, batched (one record per
    tick rather than one per heartbeat). Each is taken as seen at ``seen_t`` when given (when
    the sightings were made, at most ``t``: recorded late, judged on time), else at ``t``; a
    record never moves a worker's last sign of life back. Ids of workers that already exited are
    ignored, and so are ids this core never made (a replay under another configuration meets
    recorded batches naming workers it never spawned)."""

    worker_ids: frozenset[str] = attrs.field(converter=str_set)
    seen_t: Seconds | None = None

    def _check(self) -> None:
        if "" in self.worker_ids:
            raise InvalidEvent("WorkersSeen.worker_ids: a worker id must be non-empty, got ''")
        if self.seen_t is not None and self.seen_t > self.t:
            raise InvalidEvent(
                f"WorkersSeen.seen_t ({self.seen_t}) is after the record's t ({self.t})"
            )


@attrs.frozen(slots=True, kw_only=True)
class WorkerExited(Event):
    """A worker's process ended, with an exit code or the signal that killed it."""

    worker_id: Name
    exit_code: int | None = None
    signal: int | None = None


@attrs.frozen(slots=True, kw_only=True)
class SpawnFailed(Event):
    """A requested worker could not be started at all (bad argv, exec error, ...)."""

    worker_id: Name
    error: str


@attrs.frozen(slots=True, kw_only=True)
class WorkerAdopted(Event):
    """After an orchestrator restart, a worker the log says is alive was found alive."""

    worker_id: Name


@attrs.frozen(slots=True, kw_only=True)
class WorkerLost(Event):
    """A worker the log says is alive is gone or cannot be trusted (restart check, lost host)."""

    worker_id: Name
    reason: str


@attrs.frozen(slots=True, kw_only=True)
class LeftoverProcesses(Event):
    """Processes of this run that are no live worker: what worker ``worker_id`` left behind when
    it ended, or, at start-up, processes claiming a worker id the state does not know. The
    executor stops them (SIGTERM, then SIGKILL after the stop timeout); ``detail`` names them."""

    worker_id: Name
    count: int
    detail: str


@attrs.frozen(slots=True, kw_only=True)
class LeftoverProcessesStopped(Event):
    """Every process of the last :class:`LeftoverProcesses` for ``worker_id`` is gone."""

    worker_id: Name


# --- engines ------------------------------------------------------------------------------------


@attrs.frozen(slots=True, kw_only=True)
class EngineAsleep(Event):
    """An engine confirmed its sleep: its GPU memory is released, its process and GPUs kept."""

    worker_id: Name


@attrs.frozen(slots=True, kw_only=True)
class EngineAwake(Event):
    """An engine confirmed it is awake: its memory taken back, ready to serve."""

    worker_id: Name


@attrs.frozen(slots=True, kw_only=True)
class EngineSleepFailed(Event):
    """A sleep call failed (an error answer, a timeout, or not asleep when asked after)."""

    worker_id: Name
    error: str


@attrs.frozen(slots=True, kw_only=True)
class EngineWakeFailed(Event):
    """A wake call failed (an error answer, a timeout, or still asleep when asked after)."""

    worker_id: Name
    error: str


# --- GPUs ----------------------------------------------------------------------------------------


@attrs.frozen(slots=True, kw_only=True)
class GpuSampled(Event):
    """One health reading of one GPU (NVML or a fake). Unknown GPU ids are ignored."""

    gpu_id: Name
    memory_used_bytes: int
    memory_total_bytes: int
    temperature_c: float
    #: Active throttle reasons, e.g. {"thermal", "power"}.
    throttle_reasons: frozenset[str] = attrs.field(factory=frozenset, converter=str_set)
    #: Errors seen since the previous sample (XID events, uncorrected ECC errors).
    new_errors: int = 0

    def _check(self) -> None:
        if self.memory_used_bytes > self.memory_total_bytes:
            raise InvalidEvent(
                f"GpuSampled.memory_used_bytes ({self.memory_used_bytes}) exceeds "
                f"memory_total_bytes ({self.memory_total_bytes}) on GPU {self.gpu_id!r}"
            )


@attrs.frozen(slots=True, kw_only=True)
class GpuLost(Event):
    """A GPU is gone (fell off the bus, driver reports it lost): its workers are lost too."""

    gpu_id: Name
    error: str
