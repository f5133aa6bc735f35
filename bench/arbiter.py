"""The GPU arbiter on simulated multi-pipeline workloads: deo's planner against a static partition
and rlix's planner as published.

Run from the repository root::

    .venv/bin/python bench/arbiter.py

Each scenario runs 2-4 RL pipelines on 4-16 GPUs for a fixed simulated time. A pipeline loops:
rollout (generate ``rollout_trajectories`` trajectories at ``trajectories_per_gpu_s`` per awake
generation GPU, reporting progress every second), then training (``train_s`` seconds on its
training cluster's GPUs), then rollout again. It talks to the arbiter the way a training loop
would: ``RolloutOpened`` and a generation request with an estimate when a rollout starts;
``RolloutClosed`` and ``GpusReleasedAndRequested`` (generation -> training) when it ends;
``GpusReleasedAndRequested`` (training -> generation) when training ends. Commands take effect at
once (no wake or sleep latency); time advances in steps of 1 s.

Planners:

- ``static``: each pipeline owns ``gpus / pipelines`` GPUs; its training and generation clusters
  both map to them only (deo's planner inside each partition, which cannot share across).
- ``rlix``: :class:`core.arbiter.RlixPlanner`; generation maps to every GPU, training to the
  pipeline's own block of the same size as the static partition.
- ``deo``: :class:`core.arbiter.GapRatioPlanner` on the same mappings.

Figures, per scenario and planner: steps done and mean step time per pipeline; GPU busy fraction
(GPU-seconds spent generating for a pipeline in rollout or training, over all GPU-seconds from the
first arrival); fairness (slowest / fastest normalised progress, where a pipeline's normalised
progress is its steps times its step time alone on its static share, over the time it was
present); and the longest time any request waited (no pipeline waits forever).
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from typing import Any

import attrs

from core import GpuLost
from core.arbiter import (
    ArbiterGpusDeclared,
    ArbiterReducer,
    ClusterRegistered,
    ClusterSpec,
    GapRatioPlanner,
    GpusReleasedAndRequested,
    GpusRequested,
    PipelineRegistered,
    Planner,
    Priority,
    ProgressCleared,
    ProgressReported,
    RlixPlanner,
    RolloutClosed,
    RolloutOpened,
)
from core.commands import RaiseAlert

__all__ = ["SCENARIOS", "PipelineSpec", "Result", "Scenario", "main", "run"]


@attrs.frozen(kw_only=True)
class PipelineSpec:
    """One simulated RL job."""

    name: str
    rollout_trajectories: int
    trajectories_per_gpu_s: float
    train_s: float
    tp: int = 1
    arrive_s: float = 0.0
    #: From ``stall_at_s`` for ``stall_s`` seconds its generation produces nothing and it reports
    #: nothing (a hung rollout worker); a stalled training step holds its GPUs that long too.
    stall_at_s: float | None = None
    stall_s: float = 0.0


@attrs.frozen(kw_only=True)
class Scenario:
    name: str
    gpus: int
    duration_s: float
    pipelines: tuple[PipelineSpec, ...]
    #: GPUs lost during the run: (time, GPU id).
    lost: tuple[tuple[float, str], ...] = ()


SCENARIOS: tuple[Scenario, ...] = (
    Scenario(
        name="2 equal on 4 GPUs",
        gpus=4,
        duration_s=3600,
        pipelines=(
            PipelineSpec(
                name="a", rollout_trajectories=256, trajectories_per_gpu_s=1.0, train_s=60
            ),
            PipelineSpec(
                name="b", rollout_trajectories=256, trajectories_per_gpu_s=1.0, train_s=60
            ),
        ),
    ),
    Scenario(
        name="3 uneven on 8 GPUs",
        gpus=8,
        duration_s=3600,
        pipelines=(
            PipelineSpec(
                name="long", rollout_trajectories=1024, trajectories_per_gpu_s=1.0, train_s=90
            ),
            PipelineSpec(
                name="mid", rollout_trajectories=512, trajectories_per_gpu_s=2.0, train_s=60
            ),
            PipelineSpec(
                name="short", rollout_trajectories=128, trajectories_per_gpu_s=1.0, train_s=120
            ),
        ),
    ),
    Scenario(
        name="4 on 16 GPUs, one late, tp 2",
        gpus=16,
        duration_s=3600,
        pipelines=(
            PipelineSpec(
                name="a", rollout_trajectories=1024, trajectories_per_gpu_s=1.0, train_s=60
            ),
            PipelineSpec(
                name="b", rollout_trajectories=512, trajectories_per_gpu_s=1.0, train_s=90, tp=2
            ),
            PipelineSpec(
                name="c", rollout_trajectories=768, trajectories_per_gpu_s=1.5, train_s=45
            ),
            PipelineSpec(
                name="late",
                rollout_trajectories=512,
                trajectories_per_gpu_s=1.0,
                train_s=60,
                arrive_s=1200,
            ),
        ),
    ),
    Scenario(
        name="3 on 8 GPUs, one stalls",
        gpus=8,
        duration_s=3600,
        pipelines=(
            PipelineSpec(
                name="a", rollout_trajectories=512, trajectories_per_gpu_s=1.0, train_s=60
            ),
            PipelineSpec(
                name="b", rollout_trajectories=512, trajectories_per_gpu_s=1.0, train_s=60
            ),
            PipelineSpec(
                name="stall",
                rollout_trajectories=512,
                trajectories_per_gpu_s=1.0,
                train_s=60,
                stall_at_s=600,
                stall_s=900,
            ),
        ),
    ),
)


@attrs.define
class _Job:
    spec: PipelineSpec
    phase: str = "absent"  # absent, rollout, wait_train, train
    completed: float = 0.0
    train_left_s: float = 0.0
    step_started_s: float = 0.0
    step_times: list[float] = attrs.Factory(list)
    waiting_since: float | None = None
    longest_wait_s: float = 0.0

    def stalled(self, t: float) -> bool:
        at = self.spec.stall_at_s
        return at is not None and at <= t < at + self.spec.stall_s


@attrs.frozen(kw_only=True)
class Result:
    planner: str
    steps: dict[str, int]
    mean_step_s: dict[str, float]
    busy_fraction: float
    fairness: float
    longest_wait_s: float
    refused_plans: int
    #: Fractions of GPU-seconds: idle, and awake for a pipeline not generating (stalled).
    idle_fraction: float
    wasted_fraction: float


def _block(scenario: Scenario, index: int) -> range:
    """Pipeline ``index``'s share of the GPUs: equal blocks, the first ones one GPU larger
    when the GPUs do not divide evenly."""
    share, extra = divmod(scenario.gpus, len(scenario.pipelines))
    first = index * share + min(index, extra)
    return range(first, first + share + (1 if index < extra else 0))


def _mappings(
    scenario: Scenario, index: int, shared: bool
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    block = tuple(str(g) for g in _block(scenario, index))
    generation = tuple(str(g) for g in range(scenario.gpus)) if shared else block
    return block, generation


def _solo_step_s(spec: PipelineSpec, gpus: int) -> float:
    """The pipeline's step time alone on ``gpus`` GPUs."""
    usable = gpus - gpus % spec.tp
    return spec.rollout_trajectories / (usable * spec.trajectories_per_gpu_s) + spec.train_s


def run(scenario: Scenario, planner_name: str) -> Result:
    """Simulate ``scenario`` under ``planner_name`` (static, rlix or deo)."""
    planner: Planner = RlixPlanner() if planner_name == "rlix" else GapRatioPlanner()
    shared = planner_name != "static"
    arbiter = ArbiterReducer(planner=planner)
    refused = 0

    def step(event: Any) -> None:
        nonlocal refused
        refused += sum(isinstance(c, RaiseAlert) for c in arbiter.step(event))

    step(ArbiterGpusDeclared(t=0.0, gpus=tuple(str(g) for g in range(scenario.gpus))))
    jobs = [_Job(spec=p) for p in scenario.pipelines]
    lost = sorted(scenario.lost)
    busy_gpu_s = 0.0
    idle_gpu_s = 0.0
    wasted_gpu_s = 0.0
    start = min(p.arrive_s for p in scenario.pipelines)
    t = 0.0
    while t < scenario.duration_s:
        while lost and lost[0][0] <= t:
            step(GpuLost(t=t, gpu_id=lost.pop(0)[1], error="simulated loss"))
        for index, job in enumerate(jobs):
            name = job.spec.name
            if job.phase == "absent" and t >= job.spec.arrive_s:
                train_gpus, generation = _mappings(scenario, index, shared)
                step(PipelineRegistered(t=t, pipeline=name))
                step(
                    ClusterRegistered(
                        t=t,
                        pipeline=name,
                        spec=ClusterSpec(
                            name="train", kind=Priority.ACTOR_TRAINING, device_mapping=train_gpus
                        ),
                    )
                )
                step(
                    ClusterRegistered(
                        t=t,
                        pipeline=name,
                        spec=ClusterSpec(
                            name="gen",
                            kind=Priority.GENERATION,
                            device_mapping=generation,
                            tp_size=job.spec.tp,
                        ),
                    )
                )
                _start_rollout(step, job, t)
                step(
                    GpusRequested(
                        t=t,
                        pipeline=name,
                        cluster="gen",
                        priority=Priority.GENERATION,
                        estimate_trajectories=job.spec.rollout_trajectories,
                    )
                )
                job.waiting_since = t
        state = arbiter.state
        if t >= start:
            idle_gpu_s += len(state.idle)
        for job in jobs:
            if job.phase == "absent":
                continue
            awake = len(state.pipelines[job.spec.name].clusters["gen"].active_gpus())
            if job.phase != "rollout" or job.stalled(t):
                wasted_gpu_s += awake
            pipeline = state.pipelines[job.spec.name]
            gen = pipeline.clusters["gen"]
            train = pipeline.clusters["train"]
            for cluster in (gen, train):
                if (
                    job.waiting_since is not None
                    and cluster.request is None
                    and (cluster.active_ranks or cluster.held)
                ):
                    job.longest_wait_s = max(job.longest_wait_s, t - job.waiting_since)
                    job.waiting_since = None
            if job.waiting_since is not None:
                job.longest_wait_s = max(job.longest_wait_s, t - job.waiting_since)
            stalled = job.stalled(t)
            if job.phase == "rollout":
                gpus = len(gen.active_ranks) * job.spec.tp
                if stalled:
                    continue
                busy_gpu_s += gpus
                job.completed += gpus * job.spec.trajectories_per_gpu_s
                target = job.spec.rollout_trajectories
                if job.completed >= target:
                    step(RolloutClosed(t=t, pipeline=job.spec.name))
                    step(
                        GpusReleasedAndRequested(
                            t=t,
                            pipeline=job.spec.name,
                            release_cluster="gen",
                            cluster="train",
                            priority=Priority.ACTOR_TRAINING,
                        )
                    )
                    job.phase = "wait_train"
                    job.waiting_since = t
                else:
                    step(
                        ProgressReported(
                            t=t,
                            pipeline=job.spec.name,
                            stream="rollout",
                            target_trajectories=target,
                            completed_trajectories=int(job.completed),
                        )
                    )
            elif job.phase == "wait_train" and train.held:
                job.phase = "train"
                job.train_left_s = job.spec.train_s
            if job.phase == "train":
                busy_gpu_s += 0 if stalled else len(train.held)
                if not stalled:
                    job.train_left_s -= 1.0
                if job.train_left_s <= 0:
                    job.step_times.append(t + 1.0 - job.step_started_s)
                    step(
                        GpusReleasedAndRequested(
                            t=t,
                            pipeline=job.spec.name,
                            release_cluster="train",
                            cluster="gen",
                            priority=Priority.GENERATION,
                            estimate_trajectories=job.spec.rollout_trajectories,
                        )
                    )
                    _start_rollout(step, job, t + 1.0)
                    job.waiting_since = t
        t += 1.0
    progress = []
    for index, job in enumerate(jobs):
        present_s = scenario.duration_s - job.spec.arrive_s
        share = len(_block(scenario, index))
        progress.append(len(job.step_times) * _solo_step_s(job.spec, share) / present_s)
    usable_gpu_s = scenario.gpus * (scenario.duration_s - start)
    return Result(
        planner=planner_name,
        steps={j.spec.name: len(j.step_times) for j in jobs},
        mean_step_s={
            j.spec.name: (sum(j.step_times) / len(j.step_times)) if j.step_times else math.inf
            for j in jobs
        },
        busy_fraction=busy_gpu_s / usable_gpu_s,
        fairness=min(progress) / max(progress) if max(progress) > 0 else 0.0,
        longest_wait_s=max(j.longest_wait_s for j in jobs),
        refused_plans=refused,
        idle_fraction=idle_gpu_s / usable_gpu_s,
        wasted_fraction=wasted_gpu_s / usable_gpu_s,
    )


def _start_rollout(step: Any, job: _Job, t: float) -> None:
    step(ProgressCleared(t=t, pipeline=job.spec.name))
    step(RolloutOpened(t=t, pipeline=job.spec.name))
    job.phase = "rollout"
    job.completed = 0.0
    job.step_started_s = t


PLANNERS = ("static", "rlix", "deo")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.parse_args(argv)
    print("command: python bench/arbiter.py")
    for scenario in SCENARIOS:
        print(f"\n### {scenario.name} ({scenario.duration_s:.0f} s simulated)\n")
        names = [p.name for p in scenario.pipelines]
        header = ["planner", *(f"{n} steps / mean step s" for n in names)]
        header += ["GPU busy", "fairness", "longest wait s", "refused plans"]
        print("| " + " | ".join(header) + " |")
        print("|" + "---|" * len(header))
        for planner in PLANNERS:
            r = run(scenario, planner)
            cells = [planner]
            cells += [f"{r.steps[n]} / {r.mean_step_s[n]:.0f}" for n in names]
            cells += [
                f"{r.busy_fraction:.1%}",
                f"{r.fairness:.2f}",
                f"{r.longest_wait_s:.0f}",
                str(r.refused_plans),
            ]
            print("| " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
