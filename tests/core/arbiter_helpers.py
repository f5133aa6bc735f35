"""Builders for arbiter tests: a reducer with GPUs and pipelines from a few words."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from core import PolicySpec, PoolSpec
from core.arbiter import (
    ArbiterGpusDeclared,
    ArbiterReducer,
    ClusterRegistered,
    ClusterSpec,
    PipelineRegistered,
    Planner,
    PlannerSettings,
    Priority,
)
from core.commands import Command


def engine_pool(**changes: Any) -> PoolSpec:
    """An engine pool ``gen`` of vLLM engines, one GPU each, that starts none by itself (the
    arbiter's generation clusters start them); ``changes`` set other fields."""
    fields: dict[str, Any] = {
        "name": "gen",
        "kind": "engine",
        "engine": "vllm",
        "argv": ["serve", "--port", "{port}"],
        "ports": (18000, 18003),
        "gpus_per_worker": 1,
        "max_workers": 2,
        "max_asleep": 2,
        "policy": PolicySpec(name="static", params={"count": 0}),
        "drain_timeout_s": 30.0,
        "control_timeout_s": 5.0,
        "control_attempts": 2,
    }
    return PoolSpec(**{**fields, **changes})


def gpus(n: int) -> tuple[str, ...]:
    return tuple(str(i) for i in range(n))


def make_arbiter(n_gpus: int, planner: Planner | None = None) -> ArbiterReducer:
    arbiter = ArbiterReducer(planner=planner)
    arbiter.step(ArbiterGpusDeclared(t=0.0, gpus=gpus(n_gpus), planner=PlannerSettings()))
    return arbiter


def register(
    arbiter: ArbiterReducer,
    pipeline: str,
    *,
    train: Iterable[str] | None = None,
    generation: Iterable[str] | None = None,
    tp: int = 1,
    max_dp: int | None = None,
    t: float = 0.0,
) -> list[Command]:
    """Register ``pipeline`` with a training cluster on ``train`` and a generation cluster on
    ``generation`` (either may be left out)."""
    out = arbiter.step(PipelineRegistered(t=t, pipeline=pipeline))
    if train is not None:
        spec = ClusterSpec(name="train", kind=Priority.ACTOR_TRAINING, device_mapping=tuple(train))
        out += arbiter.step(ClusterRegistered(t=t, pipeline=pipeline, spec=spec))
    if generation is not None:
        spec = ClusterSpec(
            name="gen",
            kind=Priority.GENERATION,
            device_mapping=tuple(generation),
            tp_size=tp,
            max_dp_size=max_dp,
        )
        out += arbiter.step(ClusterRegistered(t=t, pipeline=pipeline, spec=spec))
    return out


def active(arbiter: ArbiterReducer, pipeline: str, cluster: str = "gen") -> list[int]:
    return sorted(arbiter.state.pipelines[pipeline].clusters[cluster].active_ranks)


def held(arbiter: ArbiterReducer, pipeline: str, cluster: str = "train") -> list[str]:
    return list(arbiter.state.pipelines[pipeline].clusters[cluster].held)
