"""The arbiter's state: pipelines, their clusters, and who owns which GPU.

A pipeline (one RL job) registers clusters. Each cluster has a kind (:class:`Priority`), a device
mapping (the GPUs it runs on, in order) and a tensor-parallel size ``tp_size``:

- a non-generation cluster (training, log-probs, value) is granted its whole mapping at once and
  holds it *memory-exclusively* until it releases it;
- a generation cluster has ``len(mapping) // tp_size`` data-parallel ranks; rank ``r`` owns the
  fixed bundle ``mapping[r*tp : (r+1)*tp]`` and is either *active* (awake: its engine holds GPU
  memory) or *asleep* (memory released, process and placement kept). An asleep rank is a tenant
  that may share its GPUs with a memory-exclusive holder; an active rank may not.

``ArbiterState.idle`` is kept explicitly (not derived) so that the plan checks of
:mod:`core.arbiter.invariants` can verify the bookkeeping: idle and allocated are disjoint and
together make up every usable GPU.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Iterator, Mapping
from types import MappingProxyType
from typing import Any, ClassVar

import attrs

from core.convert import CheckedRecord, Seconds, UrlName, member_of, str_set, str_tuple
from core.errors import InvalidEvent

__all__ = [
    "ArbiterState",
    "Cluster",
    "ClusterSpec",
    "HOLDS_KEPT",
    "PLANNER_SETTINGS_UNRECORDED",
    "Pipeline",
    "PlannerSettings",
    "Priority",
    "Progress",
    "Request",
    "as_priority",
]


class Priority(enum.IntEnum):
    """A request's priority, and a cluster's kind: the lower the value, the sooner it is served."""

    INITIALIZATION = 0
    ACTOR_TRAINING = 1
    CRITIC_TRAINING = 2
    OLD_LOG_PROBS = 3
    REF_LOG_PROBS = 4
    VALUE_COMPUTE = 5
    GENERATION = 6


_to_priority = member_of(Priority)


def as_priority(value: Any) -> Priority:
    """``value`` (a member, its number or its name) as a :class:`Priority` member; anything else is
    kept for the field check to name."""
    if isinstance(value, str) and value.upper() in Priority.__members__:
        return Priority[value.upper()]
    return _to_priority(value)


def _int_set(value: Iterable[int]) -> frozenset[int]:
    return value if type(value) is frozenset else frozenset(value)


def _float_tuple(value: Iterable[float]) -> tuple[float, ...]:
    return value if type(value) is tuple else tuple(value)


def _read_only(value: Mapping[Any, Any]) -> MappingProxyType[Any, Any]:
    return value if type(value) is MappingProxyType else MappingProxyType(dict(value))


@attrs.frozen(slots=True, kw_only=True)
class ClusterSpec(CheckedRecord):
    """What a pipeline declares of one cluster.

    ``max_dp_size`` caps a generation cluster's active ranks (None: every rank of its mapping).
    """

    name: UrlName
    kind: Priority = attrs.field(converter=as_priority)
    device_mapping: tuple[str, ...] = attrs.field(converter=str_tuple)
    tp_size: int = 1
    max_dp_size: int | None = None
    #: The deo engine pool (``kind = "engine"``) whose engines run this generation cluster, one
    #: per rank on its bundle; None: the pipeline runs its own generation.
    engine_pool: str | None = None

    def _check(self) -> None:
        where = f"cluster {self.name!r}"
        if not self.device_mapping:
            raise InvalidEvent(f"{where}: device_mapping must list at least one GPU")
        if len(set(self.device_mapping)) != len(self.device_mapping):
            raise InvalidEvent(f"{where}: device_mapping lists a GPU twice: {self.device_mapping}")
        if self.tp_size < 1:
            raise InvalidEvent(f"{where}: tp_size must be >= 1, got {self.tp_size}")
        if self.kind is Priority.GENERATION:
            if len(self.device_mapping) % self.tp_size:
                raise InvalidEvent(
                    f"{where}: {len(self.device_mapping)} GPUs do not split into bundles of"
                    f" tp_size={self.tp_size}"
                )
            if self.max_dp_size is not None and self.max_dp_size < 1:
                raise InvalidEvent(f"{where}: max_dp_size must be >= 1, got {self.max_dp_size}")
        elif self.max_dp_size is not None:
            raise InvalidEvent(f"{where}: max_dp_size applies to generation clusters only")
        if self.engine_pool is not None and (
            not self.is_generation or not isinstance(self.engine_pool, str) or not self.engine_pool
        ):
            raise InvalidEvent(
                f"{where}: engine_pool names the engine pool of a generation cluster, got "
                f"{self.engine_pool!r} for a {self.kind.name} cluster"
            )

    @property
    def is_generation(self) -> bool:
        return self.kind is Priority.GENERATION

    @property
    def ranks(self) -> int:
        """Data-parallel ranks of a generation cluster (1 for any other)."""
        return len(self.device_mapping) // self.tp_size if self.is_generation else 1

    @property
    def dp_limit(self) -> int:
        """The most ranks that may be active at once."""
        cap = self.max_dp_size if self.max_dp_size is not None else self.ranks
        return min(cap, self.ranks)

    def bundle(self, rank: int) -> tuple[str, ...]:
        """The GPUs of generation rank ``rank``."""
        return self.device_mapping[rank * self.tp_size : (rank + 1) * self.tp_size]


@attrs.frozen(slots=True, kw_only=True)
class Request:
    """A cluster's one waiting request: ``seq`` orders requests of one priority (FIFO)."""

    priority: Priority = attrs.field(converter=as_priority)
    seq: int
    t: float
    estimate_trajectories: int | None = None


@attrs.frozen(slots=True, kw_only=True)
class Progress:
    """The latest progress report of one stream of a pipeline (latest wins)."""

    target_trajectories: int
    completed_trajectories: int

    @property
    def remaining(self) -> int:
        """``T - clamp(completed, 0, T)`` with ``T = max(target, 1)``."""
        target = max(self.target_trajectories, 1)
        return target - min(max(self.completed_trajectories, 0), target)


@attrs.frozen(slots=True, kw_only=True)
class Cluster:
    """A registered cluster and what it holds now.

    ``held``: the GPUs a non-generation cluster holds memory-exclusively (empty when not granted).
    ``active_ranks``: a generation cluster's awake ranks. ``request``: its waiting request.
    """

    spec: ClusterSpec
    held: tuple[str, ...] = attrs.field(default=(), converter=str_tuple)
    active_ranks: frozenset[int] = attrs.field(default=frozenset(), converter=_int_set)
    request: Request | None = None
    #: When it was granted what it holds (None: it holds nothing).
    held_t: float | None = None
    #: How long its last holds lasted, from grant to release, oldest first (at most
    #: :data:`HOLDS_KEPT`): how long it usually keeps its GPUs.
    holds_s: tuple[float, ...] = attrs.field(default=(), converter=_float_tuple)
    #: The caller's name for its latest request (waiting or answered), if it gave one.
    request_id: str | None = None
    #: Why its latest request can no longer be answered with a grant (it was withdrawn by a
    #: release, or failed), until it asks again; None otherwise. Kept in the state, so a caller
    #: still waiting on that request is told so after deo restarts too.
    request_ended: str | None = None

    def active_gpus(self) -> tuple[str, ...]:
        return tuple(g for r in sorted(self.active_ranks) for g in self.spec.bundle(r))


@attrs.frozen(slots=True, kw_only=True)
class Pipeline:
    """One RL job: its clusters, its latest progress per stream, and whether its rollout is open
    (open: it wants generation until it closes it, whether or not a request is waiting)."""

    pipeline_id: str
    clusters: Mapping[str, Cluster] = attrs.field(factory=dict, converter=_read_only)
    progress: Mapping[str, Progress] = attrs.field(factory=dict, converter=_read_only)
    rollout_open: bool = False
    #: When it registered (None: in a state written before deo recorded it). Its token derives
    #: from it, so a pipeline registered again under the same name gets a new one.
    registered_t: float | None = None
    #: When it last showed life: registered, opened its rollout, asked for GPUs, or reported
    #: progress.
    activity_t: float = 0.0
    #: When its generation last woke from zero ranks (None: never).
    woken_t: float | None = None
    #: Measured trajectories per awake generation GPU-second, smoothed (None: not yet), and the
    #: progress report it was last measured from: its time and its completed trajectories.
    trajectories_per_gpu_s: float | None = None
    rate_mark_t: float | None = None
    rate_mark_completed: int = 0
    #: Awake generation GPU-seconds since the mark, counted up to ``rate_counted_t`` (brought up
    #: to date before its generation wakes or sleeps ranks, so a span with a change is divided
    #: by the GPU-seconds it really had).
    rate_gpu_s: float = 0.0
    rate_counted_t: float | None = None
    #: Its step as the arbiter sees it, from what it already hears (no step times asked): a
    #: *generation phase* lasts while its rollout is open, its generation request waits or its
    #: generation has ranks awake; the rest of the step (training, log-probs, ...) lies between
    #: two such phases. When the latest generation phase began and when the latest one ended
    #: (None: never), the time from a phase's end to the next one's start (its *non-generation
    #: time*) and from one phase's start to the next one's (its *step period*), both smoothed
    #: (None: not measured yet).
    step_started_t: float | None = None
    generation_ended_t: float | None = None
    non_generation_s: float | None = None
    step_s: float | None = None

    def generation(self) -> Cluster | None:
        """Its generation cluster (at most one), if registered."""
        for cluster in self.clusters.values():
            if cluster.spec.is_generation:
                return cluster
        return None

    def generating(self) -> bool:
        """Whether it is in a generation phase: its rollout is open, or its generation cluster
        waits for GPUs or has ranks awake."""
        cluster = self.generation()
        return self.rollout_open or (
            cluster is not None and (cluster.request is not None or bool(cluster.active_ranks))
        )

    def gpu_time_counted(self, now: float) -> Pipeline:
        """This pipeline with its awake generation GPU-seconds counted up to ``now`` (its awake
        ranks unchanged since ``rate_counted_t``)."""
        if self.rate_counted_t is None or now <= self.rate_counted_t:
            return self
        cluster = self.generation()
        gpus = 0 if cluster is None else len(cluster.active_gpus())
        return attrs.evolve(
            self,
            rate_gpu_s=self.rate_gpu_s + gpus * (now - self.rate_counted_t),
            rate_counted_t=now,
        )


#: Holds remembered per cluster (:attr:`Cluster.holds_s`).
HOLDS_KEPT = 8


@attrs.frozen(slots=True, kw_only=True)
class PlannerSettings(CheckedRecord):
    """The planner and the parameters of its decisions, recorded in the log with the arbiter's
    GPUs (:class:`~core.arbiter.events.ArbiterGpusDeclared`) so that a log replays to the same
    decisions whatever later code defaults are. The defaults are deo's; docs/arbiter.md says
    what each does."""

    #: ``"deo"`` (:class:`~core.arbiter.planner.GapRatioPlanner`) or ``"rlix"``.
    name: str = "deo"
    #: Seconds without a sign of life after which a pipeline is silent (None: never).
    stale_after_s: Seconds | None = 60.0
    #: A generating rank moves only when that shortens the longer time to finish by this
    #: fraction of it and by more than ``move_cost_s``.
    hysteresis: float = 0.1
    move_cost_s: Seconds = 60.0
    #: A holder that has held its GPUs past its limit is *overstaying*: a request it blocks
    #: stops reserving against lower priorities. The limit: ``reserve_factor`` times the
    #: longest of its last holds (at least ``reserve_min_s``); while none is measured (or
    #: ``reserve_factor`` is None), ``reserve_s``. ``reserve_s`` None: never.
    reserve_s: float | None = 3600.0
    reserve_factor: float | None = 3.0
    reserve_min_s: Seconds = 60.0
    #: A rate sample divides by the awake generation GPU-seconds of its span (False: by the GPUs
    #: awake at the report times the span, as deo's first time-to-finish planner did).
    rate_over_awake_gpu_s: bool = True
    #: How strongly shares lean towards pipelines whose measured step is long for their size
    #: (the gain ``k`` of the step factor; 0: shares by remaining GPU-seconds alone).
    step_weight: float = 2.0

    #: Settings recorded before ``step_weight`` existed ran without a step factor.
    UNRECORDED_FIELDS: ClassVar[Mapping[str, Any]] = MappingProxyType({"step_weight": 0.0})

    def _check(self) -> None:
        where = "PlannerSettings"
        if self.name not in ("deo", "rlix"):
            raise InvalidEvent(f"{where}.name must be 'deo' or 'rlix', got {self.name!r}")
        if self.stale_after_s is not None and self.stale_after_s <= 0:
            raise InvalidEvent(
                f"{where}.stale_after_s must be > 0 or null, got {self.stale_after_s}"
            )
        if self.hysteresis < 0:
            raise InvalidEvent(f"{where}.hysteresis must be >= 0, got {self.hysteresis}")
        if self.reserve_s is not None and not 0 < self.reserve_s < math.inf:
            raise InvalidEvent(f"{where}.reserve_s must be > 0 or null, got {self.reserve_s}")
        if not 0 <= self.step_weight < math.inf:
            raise InvalidEvent(f"{where}.step_weight must be >= 0, got {self.step_weight}")
        if self.reserve_factor is not None and not 1 <= self.reserve_factor < math.inf:
            raise InvalidEvent(
                f"{where}.reserve_factor must be >= 1 or null, got {self.reserve_factor}"
            )


#: The settings a log that recorded none replays with: those of deo's first time-to-finish
#: planner (a holder overstays after 600 s whatever its own holds; rates divide by the GPUs
#: awake at the report; a move pays for itself past 30 s).
PLANNER_SETTINGS_UNRECORDED = PlannerSettings(
    move_cost_s=30.0,
    reserve_s=600.0,
    reserve_factor=None,
    rate_over_awake_gpu_s=False,
    step_weight=0.0,
)


@attrs.frozen(slots=True, kw_only=True)
class ArbiterState:
    """Everything the arbiter knows; rebuilt, never mutated, by each step.

    ``gpus``: the inventory, in order (declared once). ``lost``: GPUs gone from the driver.
    ``cordoned``: GPUs deo's health rules or an operator cordoned: whoever has one keeps it, but
    plans grant and wake nothing new there until it is uncordoned. ``idle``: usable GPUs that no
    holder and no active rank uses. ``now``: the time of the latest event (the arbiter's only
    clock).
    """

    gpus: tuple[str, ...] = attrs.field(default=(), converter=str_tuple)
    lost: frozenset[str] = attrs.field(default=frozenset(), converter=str_set)
    cordoned: frozenset[str] = attrs.field(default=frozenset(), converter=str_set)
    idle: frozenset[str] = attrs.field(default=frozenset(), converter=str_set)
    pipelines: Mapping[str, Pipeline] = attrs.field(factory=dict, converter=_read_only)
    next_seq: int = 0
    now: float = 0.0
    #: The planner's settings as recorded when the GPUs were declared (None: a log written
    #: before deo recorded them; it replays with :data:`PLANNER_SETTINGS_UNRECORDED`).
    planner: PlannerSettings | None = None
    #: Holders treated as overstaying (``pipeline/cluster``): their alert is raised.
    overstaying: frozenset[str] = attrs.field(default=frozenset(), converter=str_set)
    #: Holders (``pipeline/cluster``) whose held GPUs include a cordoned one: a hold cannot be
    #: revoked, so it stays, and their alert is raised.
    holds_on_cordoned: frozenset[str] = attrs.field(default=frozenset(), converter=str_set)

    def clusters(self) -> Iterator[tuple[str, Cluster]]:
        """Every (pipeline id, cluster), in registration order."""
        for pipeline_id, pipeline in self.pipelines.items():
            for cluster in pipeline.clusters.values():
                yield pipeline_id, cluster

    def usable(self) -> frozenset[str]:
        """GPUs of the inventory that are not lost."""
        return frozenset(self.gpus) - self.lost

    def engine_pools(self) -> dict[str, tuple[str, Cluster]]:
        """Engine pool name -> (pipeline id, the generation cluster it runs)."""
        return {
            cluster.spec.engine_pool: (pipeline_id, cluster)
            for pipeline_id, cluster in self.clusters()
            if cluster.spec.engine_pool is not None
        }
