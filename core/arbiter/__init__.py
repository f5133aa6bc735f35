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
    PLANNER_SETTINGS_UNRECORDED,
    ArbiterState,
    Cluster,
    ClusterSpec,
    Pipeline,
    PlannerSettings,
    Priority,
    Progress,
    Request,
)
from core.arbiter.plan import GpuOp, Plan, RankOp, apply_plan
from core.arbiter.planner import GapRatioPlanner, Planner, RlixPlanner, Share, planner_for
from core.arbiter.reducer import ArbiterReducer, planner_in_use, reduce_arbiter

__all__ = [
    "PLANNER_SETTINGS_UNRECORDED",
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
    "PlannerSettings",
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
    "planner_for",
    "planner_in_use",
    "reduce_arbiter",
    "state_violations",
]
