"""The arbiter's events: what pipelines and the GPU inventory tell it.

Each is a :class:`core.events.Event` (a timestamp ``t`` and field checks on construction). A lost
GPU arrives as the core's own :class:`core.events.GpuLost`.
"""

from __future__ import annotations

from collections.abc import Iterable

import attrs

from core.arbiter.model import ClusterSpec, PlannerSettings, Priority, as_priority
from core.convert import Name, UrlName, str_tuple
from core.errors import InvalidEvent
from core.events import Event

__all__ = [
    "ArbiterGpusDeclared",
    "ClusterRegistered",
    "GpusReleased",
    "GpusReleasedAndRequested",
    "GpusRequested",
    "PipelineRegistered",
    "PipelineUnregistered",
    "ProgressCleared",
    "ProgressReported",
    "RolloutClosed",
    "RolloutOpened",
]


def _spec_tuple(value: Iterable[ClusterSpec]) -> tuple[ClusterSpec, ...]:
    return value if type(value) is tuple else tuple(value)


@attrs.frozen(slots=True, kw_only=True)
class ArbiterGpusDeclared(Event):
    """The GPUs the arbiter shares among pipelines (declared once, before any pipeline), and
    the planner that shares them."""

    gpus: tuple[str, ...] = attrs.field(converter=str_tuple)
    #: The planner and its parameters; declared again with the same GPUs, they replace the
    #: recorded ones. None: not recorded (a log written before deo recorded them replays with
    #: :data:`~core.arbiter.model.PLANNER_SETTINGS_UNRECORDED`).
    planner: PlannerSettings | None = None

    def _check(self) -> None:
        if not self.gpus or len(set(self.gpus)) != len(self.gpus) or "" in self.gpus:
            raise InvalidEvent(
                f"ArbiterGpusDeclared.gpus must list distinct GPU ids, got {self.gpus}"
            )


@attrs.frozen(slots=True, kw_only=True)
class PipelineRegistered(Event):
    """A pipeline joins, with ``clusters`` registered in the same step (all of them or, when one
    is refused, none and not the pipeline either); more may follow as :class:`ClusterRegistered`.
    """

    pipeline: UrlName
    clusters: tuple[ClusterSpec, ...] = attrs.field(default=(), converter=_spec_tuple)


@attrs.frozen(slots=True, kw_only=True)
class ClusterRegistered(Event):
    """A pipeline declares one cluster (at most one generation cluster per pipeline)."""

    pipeline: UrlName
    spec: ClusterSpec


@attrs.frozen(slots=True, kw_only=True)
class PipelineUnregistered(Event):
    """A pipeline leaves: everything it holds is freed, its generation ranks are put to sleep."""

    pipeline: UrlName


@attrs.frozen(slots=True, kw_only=True)
class GpusRequested(Event):
    """A cluster asks for GPUs with ``priority``.

    Generation clusters ask with GENERATION and are answered once at least one rank is awake;
    other clusters ask with any other priority and are answered with their whole mapping.
    ``estimate_trajectories``: a generation request's expected work when no progress is known.
    ``request_id``: the caller's name for this request, the same on each of its long polls: a
    poll sent again (after a restart of deo) is then answered about this request (granted,
    withdrawn, failed) instead of queuing it anew.
    """

    pipeline: UrlName
    cluster: UrlName
    priority: Priority = attrs.field(converter=as_priority)
    estimate_trajectories: int | None = None
    request_id: UrlName | None = None


@attrs.frozen(slots=True, kw_only=True)
class GpusReleased(Event):
    """A cluster gives back what it holds (a generation cluster: all its ranks go to sleep),
    and withdraws its waiting request if any."""

    pipeline: UrlName
    cluster: UrlName


@attrs.frozen(slots=True, kw_only=True)
class GpusReleasedAndRequested(Event):
    """``release_cluster`` releases and ``cluster`` requests, in one step: both happen, or
    neither (a refused request leaves the release undone too)."""

    pipeline: UrlName
    release_cluster: UrlName
    cluster: UrlName
    priority: Priority = attrs.field(converter=as_priority)
    estimate_trajectories: int | None = None
    #: As :attr:`GpusRequested.request_id`.
    request_id: UrlName | None = None


@attrs.frozen(slots=True, kw_only=True)
class ProgressReported(Event):
    """A pipeline's progress on one stream; the latest report per (pipeline, stream) wins."""

    pipeline: UrlName
    stream: Name
    target_trajectories: int
    completed_trajectories: int


@attrs.frozen(slots=True, kw_only=True)
class ProgressCleared(Event):
    """Forget a pipeline's progress on ``stream``, or on every stream when it is None."""

    pipeline: UrlName
    stream: Name | None = None


@attrs.frozen(slots=True, kw_only=True)
class RolloutOpened(Event):
    """A pipeline's rollout begins: it wants generation (durable demand) until it closes."""

    pipeline: UrlName


@attrs.frozen(slots=True, kw_only=True)
class RolloutClosed(Event):
    """A pipeline's rollout ends: its durable demand is gone."""

    pipeline: UrlName
