"""deo's GPU arbiter: several RL pipelines time-sharing one set of GPUs.

A pure, event-sourced core like :mod:`core`'s reducer: pipelines register clusters and ask for
GPUs (:mod:`core.arbiter.events`); :func:`reduce_arbiter` answers with commands
(:mod:`core.arbiter.commands`) planned by a :class:`Planner` (deo's gap-ratio planner by default)
and checked against the plan invariants of :mod:`core.arbiter.invariants` before any of them is
emitted. See docs/arbiter.md.
"""

from core.arbiter.commands import ExpandGeneration, GrantGpus, RequestFailed, ShrinkGeneration
from core.arbiter.events import (
    ArbiterGpusDeclared,
    ClusterRegistered,
    GpusReleased,
    GpusReleasedAndRequested,
    GpusRequested,
    PipelineRegistered,
    PipelineUnregistered,
    ProgressCleared,
    ProgressReported,
    RolloutClosed,
    RolloutOpened,
)
from core.arbiter.invariants import plan_violations, state_violations
from core.arbiter.model import (
    ArbiterState,
    Cluster,
    ClusterSpec,
    Pipeline,
    Priority,
    Progress,
    Request,
)
from core.arbiter.plan import GpuOp, Plan, RankOp, apply_plan
from core.arbiter.planner import GapRatioPlanner, Planner, RlixPlanner, Share
from core.arbiter.reducer import ArbiterReducer, default_planner, reduce_arbiter

__all__ = [
    "ArbiterGpusDeclared",
    "ArbiterReducer",
    "ArbiterState",
    "Cluster",
    "ClusterRegistered",
    "ClusterSpec",
    "ExpandGeneration",
    "GapRatioPlanner",
    "GpuOp",
    "GpusReleased",
    "GpusReleasedAndRequested",
    "GpusRequested",
    "GrantGpus",
    "Pipeline",
    "PipelineRegistered",
    "PipelineUnregistered",
    "Plan",
    "Planner",
    "Priority",
    "Progress",
    "ProgressCleared",
    "ProgressReported",
    "RankOp",
    "Request",
    "RequestFailed",
    "RlixPlanner",
    "RolloutClosed",
    "RolloutOpened",
    "Share",
    "ShrinkGeneration",
    "apply_plan",
    "plan_violations",
    "default_planner",
    "reduce_arbiter",
    "state_violations",
]
