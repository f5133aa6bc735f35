"""The GPU arbiter on simulated multi-pipeline workloads: deo's planner against a static partition
and rlix's planner as published.

Run from the repository root::

    .venv/bin/python bench/arbiter.py [--seeds 3] [--scenario TEXT]
        [--wake-s S] [--sleep-s S] [--preempt-lost-s S] [--move-cost-s S]

Each scenario runs 2-4 RL pipelines on 4-16 GPUs for a fixed simulated time, once per seed (a
seed varies each step's generation rate by up to ``rate_jitter`` and its training time by up to
``train_jitter``). A pipeline loops: rollout (generate ``rollout_trajectories`` trajectories at
``trajectories_per_gpu_s`` per producing generation GPU, reporting progress every second), then
training (``train_s`` seconds on its training cluster's GPUs), then rollout again. It talks to
the arbiter the way a training loop would: at a rollout's start ``ProgressCleared``, a
generation request with an estimate (``GpusReleasedAndRequested`` training -> generation after
a step), a progress report of the new target, ``RolloutOpened``; at its end ``RolloutClosed`` and
``GpusReleasedAndRequested`` (generation -> training). Engines take time: a woken rank produces
nothing for ``wake_s``, a rank put to sleep keeps its GPUs for ``sleep_s`` (a grant or a wake on
them waits), and a rank put to sleep while generating loses ``preempt_lost_s`` of its output.
Time advances in steps of 1 s.

Planners:

- ``static``: each pipeline owns ``gpus / pipelines`` GPUs; its training and generation clusters
  both map to them only (deo's planner inside each partition, which cannot share across).
- ``rlix``: :class:`core.arbiter.RlixPlanner`; generation maps to every GPU, training to the
  pipeline's own block of the same size as the static partition.
- ``deo``: :class:`core.arbiter.GapRatioPlanner` on the same mappings.

Figures, per scenario and planner, means over seeds: mean step time per pipeline; the mean over
pipelines of their mean step times (*mean step*) and the slowest pipeline's (*worst step*); GPU busy
fraction (GPU-seconds producing: generating after a wake, or training, less those whose output a
preemption threw away, over all GPU-seconds from the first arrival); fairness (slowest / fastest
normalised progress, where a pipeline's normalised progress is its steps times its step time alone
on its static share, over the time it was present); the longest time any request waited (no pipeline
waits forever); preemptions (ranks put to sleep while generating). Then deo against static and rlix:
*beats* is better by more than :data:`TIE` (for step time: mean step lower, worst step no higher),
*ties* within it.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
from collections.abc import Sequence
from typing import Any

import attrs

from core import GpuLost, InvalidEvent
from core.arbiter import (
    ArbiterGpusDeclared,
    ArbiterReducer,
    ClusterRegistered,
    ClusterSpec,
    ExpandGeneration,
    GpusReleasedAndRequested,
    GpusRequested,
    GrantGpus,
    PipelineRegistered,
    Planner,
    PlannerSettings,
    Priority,
    ProgressCleared,
    ProgressReported,
    RlixPlanner,
    RolloutClosed,
    RolloutOpened,
    ShrinkGeneration,
    planner_for,
)
from core.commands import RaiseAlert

__all__ = [
    "SCENARIOS",
    "PipelineSpec",
    "Result",
    "Scenario",
    "Summary",
    "compare",
    "main",
    "run",
    "summarize",
]


#: deo's planner settings: its defaults.
DEO_SETTINGS = PlannerSettings()


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
    """Pipelines on ``gpus`` GPUs for ``duration_s`` simulated seconds, with engine latencies."""

    name: str
    gpus: int
    duration_s: float
    pipelines: tuple[PipelineSpec, ...]
    #: GPUs lost during the run: (time, GPU id).
    lost: tuple[tuple[float, str], ...] = ()
    #: A woken engine produces nothing for ``wake_s`` (vLLM sleep level 1: weights copied back
    #: from CPU memory, seconds); a sleeping engine keeps its GPUs for ``sleep_s``.
    wake_s: float = 5.0
    sleep_s: float = 2.0
    #: A rank put to sleep while generating loses this many seconds of its output (the
    #: trajectories in flight are aborted).
    preempt_lost_s: float = 5.0
    #: With a seed, each step's generation rate and training time vary by up to this fraction.
    rate_jitter: float = 0.2
    train_jitter: float = 0.1


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
    Scenario(
        name="2 uneven on 4 GPUs",
        gpus=4,
        duration_s=3600,
        pipelines=(
            PipelineSpec(
                name="long", rollout_trajectories=384, trajectories_per_gpu_s=1.0, train_s=45
            ),
            PipelineSpec(
                name="short", rollout_trajectories=96, trajectories_per_gpu_s=0.5, train_s=90
            ),
        ),
    ),
    Scenario(
        name="3 on 12 GPUs, tp 2 and a fast one",
        gpus=12,
        duration_s=3600,
        pipelines=(
            PipelineSpec(
                name="big",
                rollout_trajectories=1024,
                trajectories_per_gpu_s=0.75,
                train_s=60,
                tp=2,
            ),
            PipelineSpec(
                name="mid", rollout_trajectories=384, trajectories_per_gpu_s=1.0, train_s=60
            ),
            PipelineSpec(
                name="fast", rollout_trajectories=192, trajectories_per_gpu_s=2.0, train_s=45
            ),
        ),
    ),
    Scenario(
        name="4 on 16 GPUs, one stalls, one late",
        gpus=16,
        duration_s=3600,
        pipelines=(
            PipelineSpec(
                name="a", rollout_trajectories=768, trajectories_per_gpu_s=1.0, train_s=60
            ),
            PipelineSpec(
                name="b",
                rollout_trajectories=512,
                trajectories_per_gpu_s=1.5,
                train_s=90,
                tp=2,
            ),
            PipelineSpec(
                name="stall",
                rollout_trajectories=256,
                trajectories_per_gpu_s=1.0,
                train_s=120,
                stall_at_s=900,
                stall_s=600,
            ),
            PipelineSpec(
                name="late",
                rollout_trajectories=512,
                trajectories_per_gpu_s=1.0,
                train_s=60,
                arrive_s=1800,
            ),
        ),
    ),
)


@attrs.define
class _Job:
    spec: PipelineSpec
    rng: random.Random | None
    generation_mapping: tuple[str, ...] = ()
    phase: str = "absent"  # absent, rollout, wait_train, train
    completed: float = 0.0
    #: This step's draws: trajectories per GPU-second and training seconds.
    rate: float = 0.0
    train_s: float = 0.0
    train_left_s: float = 0.0
    #: When the granted training GPUs are free of the engines that slept on them.
    train_ready_s: float = math.inf
    #: Awake generation ranks and the time each starts producing (after its wake).
    rank_ready_s: dict[int, float] = attrs.Factory(dict)
    step_started_s: float = 0.0
    step_times: list[float] = attrs.Factory(list)
    waiting_since: float | None = None
    longest_wait_s: float = 0.0

    def stalled(self, t: float) -> bool:
        at = self.spec.stall_at_s
        return at is not None and at <= t < at + self.spec.stall_s

    def draw(self, scenario: Scenario) -> None:
        """This step's generation rate and training time (jittered when seeded)."""
        rate_jitter = train_jitter = 1.0
        if self.rng is not None:
            rate_jitter = self.rng.uniform(1 - scenario.rate_jitter, 1 + scenario.rate_jitter)
            train_jitter = self.rng.uniform(1 - scenario.train_jitter, 1 + scenario.train_jitter)
        self.rate = self.spec.trajectories_per_gpu_s * rate_jitter
        self.train_s = self.spec.train_s * train_jitter

    def producing_gpus(self, t: float) -> int:
        return sum(self.spec.tp for ready in self.rank_ready_s.values() if ready <= t)


@attrs.frozen(kw_only=True)
class Result:
    """One run's figures."""

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
    #: Generation ranks put to sleep while their pipeline was generating, and ranks woken.
    preemptions: int
    wakes: int

    @property
    def pipeline_mean_step_s(self) -> float:
        """Mean step time over pipelines (each pipeline's mean step time, averaged)."""
        return sum(self.mean_step_s.values()) / len(self.mean_step_s)

    @property
    def worst_step_s(self) -> float:
        """The slowest pipeline's mean step time."""
        return max(self.mean_step_s.values())


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
    tp = scenario.pipelines[index].tp
    return block, generation[: len(generation) - len(generation) % tp]


def _solo_step_s(spec: PipelineSpec, gpus: int) -> float:
    """The pipeline's step time alone on ``gpus`` GPUs (no wake or sleep)."""
    usable = gpus - gpus % spec.tp
    return spec.rollout_trajectories / (usable * spec.trajectories_per_gpu_s) + spec.train_s


def make_planner(planner_name: str, settings: PlannerSettings = DEO_SETTINGS) -> Planner:
    """The planner a name in :data:`PLANNERS` stands for (deo's, and static's within each
    partition, with ``settings``)."""
    return RlixPlanner() if planner_name == "rlix" else planner_for(settings)


def run(
    scenario: Scenario,
    planner_name: str,
    seed: int | None = None,
    settings: PlannerSettings = DEO_SETTINGS,
) -> Result:
    """Simulate ``scenario`` under ``planner_name`` (static, rlix or deo); ``seed`` jitters each
    step's generation rate and training time (None: no jitter); ``settings``: deo's planner
    settings (rlix's planner has none)."""
    shared = planner_name != "static"
    arbiter = ArbiterReducer(planner=make_planner(planner_name, settings))
    jobs = {
        p.name: _Job(spec=p, rng=None if seed is None else random.Random(f"{seed}/{p.name}"))
        for p in scenario.pipelines
    }
    gpu_ready_s: dict[str, float] = {}
    counts = {"refused": 0, "preemptions": 0, "wakes": 0}
    #: GPU-seconds whose output a preemption threw away (not busy after all).
    lost_gpu_s = 0.0
    t = 0.0

    def step(event: Any) -> None:
        nonlocal lost_gpu_s
        for command in arbiter.step(event):
            if isinstance(command, RaiseAlert):
                counts["refused"] += 1
            elif isinstance(command, ShrinkGeneration):
                job = jobs[command.pipeline]
                for gpu in command.gpus:
                    gpu_ready_s[gpu] = t + scenario.sleep_s
                for rank in command.ranks:
                    ready = job.rank_ready_s.pop(rank, math.inf)
                    if job.phase == "rollout" and ready <= t and not job.stalled(t):
                        # In-flight trajectories are aborted by the sleep: the GPU-seconds
                        # that produced them were not useful work after all.
                        lost_s = min(scenario.preempt_lost_s, t - ready)
                        lost = min(job.completed, lost_s * job.rate * job.spec.tp)
                        job.completed -= lost
                        lost_gpu_s += lost / job.rate
                        counts["preemptions"] += 1
            elif isinstance(command, ExpandGeneration):
                job = jobs[command.pipeline]
                tp = job.spec.tp
                for rank in command.ranks:
                    bundle = job.generation_mapping[rank * tp : (rank + 1) * tp]
                    free_s = max([t, *(gpu_ready_s.get(g, 0.0) for g in bundle)])
                    job.rank_ready_s[rank] = free_s + scenario.wake_s
                    counts["wakes"] += 1
            elif isinstance(command, GrantGpus) and command.priority is not Priority.GENERATION:
                job = jobs[command.pipeline]
                job.train_ready_s = max([t, *(gpu_ready_s.get(g, 0.0) for g in command.gpus)])

    declared = tuple(str(g) for g in range(scenario.gpus))
    step(ArbiterGpusDeclared(t=0.0, gpus=declared, planner=settings))
    lost = sorted(scenario.lost)
    busy_gpu_s = 0.0
    idle_gpu_s = 0.0
    wasted_gpu_s = 0.0
    start = min(p.arrive_s for p in scenario.pipelines)
    while t < scenario.duration_s:
        while lost and lost[0][0] <= t:
            step(GpuLost(t=t, gpu_id=lost.pop(0)[1], error="simulated loss"))
        for index, job in enumerate(jobs.values()):
            name = job.spec.name
            if job.phase == "absent" and t >= job.spec.arrive_s:
                train_gpus, generation = _mappings(scenario, index, shared)
                job.generation_mapping = generation
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
                _start_rollout(step, job, t, scenario, release=None)
                job.waiting_since = t
        state = arbiter.state
        if t >= start:
            idle_gpu_s += len(state.idle)
        for job in jobs.values():
            if job.phase == "absent":
                continue
            pipeline = state.pipelines[job.spec.name]
            gen = pipeline.clusters["gen"]
            train = pipeline.clusters["train"]
            awake = len(gen.active_gpus())
            if job.phase != "rollout" or job.stalled(t):
                wasted_gpu_s += awake
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
                if stalled:
                    continue
                gpus = job.producing_gpus(t)
                busy_gpu_s += gpus
                job.completed += gpus * job.rate
                target = job.spec.rollout_trajectories
                if job.completed >= target:
                    job.phase = "wait_train"
                    job.waiting_since = t
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
                job.train_left_s = job.train_s
            if job.phase == "train":
                running = not stalled and t >= job.train_ready_s
                busy_gpu_s += len(train.held) if running else 0
                if running:
                    job.train_left_s -= 1.0
                if job.train_left_s <= 0:
                    job.step_times.append(t + 1.0 - job.step_started_s)
                    job.train_ready_s = math.inf
                    _start_rollout(step, job, t + 1.0, scenario, release="train")
                    job.waiting_since = t
        t += 1.0
    progress = []
    for index, job in enumerate(jobs.values()):
        present_s = scenario.duration_s - job.spec.arrive_s
        share = len(_block(scenario, index))
        progress.append(len(job.step_times) * _solo_step_s(job.spec, share) / present_s)
    usable_gpu_s = scenario.gpus * (scenario.duration_s - start)
    return Result(
        planner=planner_name,
        steps={j.spec.name: len(j.step_times) for j in jobs.values()},
        mean_step_s={
            j.spec.name: (sum(j.step_times) / len(j.step_times)) if j.step_times else math.inf
            for j in jobs.values()
        },
        busy_fraction=(busy_gpu_s - lost_gpu_s) / usable_gpu_s,
        fairness=min(progress) / max(progress) if max(progress) > 0 else 0.0,
        longest_wait_s=max(j.longest_wait_s for j in jobs.values()),
        refused_plans=counts["refused"],
        idle_fraction=idle_gpu_s / usable_gpu_s,
        wasted_fraction=wasted_gpu_s / usable_gpu_s,
        preemptions=counts["preemptions"],
        wakes=counts["wakes"],
    )


def _start_rollout(step: Any, job: _Job, t: float, scenario: Scenario, release: str | None) -> None:
    """A new rollout, as a training loop starts one: clear the last rollout's progress, ask
    for generation (releasing ``release`` in the same step) with an estimate, report the new
    rollout's target, open the rollout (durable demand)."""
    name = job.spec.name
    job.phase = "rollout"
    job.completed = 0.0
    job.step_started_s = t
    job.draw(scenario)
    target = job.spec.rollout_trajectories
    step(ProgressCleared(t=t, pipeline=name))
    if release is None:
        step(
            GpusRequested(
                t=t,
                pipeline=name,
                cluster="gen",
                priority=Priority.GENERATION,
                estimate_trajectories=target,
            )
        )
    else:
        step(
            GpusReleasedAndRequested(
                t=t,
                pipeline=name,
                release_cluster=release,
                cluster="gen",
                priority=Priority.GENERATION,
                estimate_trajectories=target,
            )
        )
    step(
        ProgressReported(
            t=t,
            pipeline=name,
            stream="rollout",
            target_trajectories=target,
            completed_trajectories=0,
        )
    )
    step(RolloutOpened(t=t, pipeline=name))


PLANNERS = ("static", "rlix", "deo")
SEEDS = (1, 2, 3)


@attrs.frozen(kw_only=True)
class Summary:
    """A scenario's figures under one planner, averaged over seeds (longest wait: the maximum)."""

    planner: str
    runs: tuple[Result, ...]

    def _mean(self, values: Sequence[float]) -> float:
        return statistics.fmean(values)

    @property
    def mean_step_s(self) -> dict[str, float]:
        names = self.runs[0].mean_step_s
        return {n: self._mean([r.mean_step_s[n] for r in self.runs]) for n in names}

    @property
    def pipeline_mean_step_s(self) -> float:
        return self._mean([r.pipeline_mean_step_s for r in self.runs])

    @property
    def worst_step_s(self) -> float:
        return self._mean([r.worst_step_s for r in self.runs])

    @property
    def busy_fraction(self) -> float:
        return self._mean([r.busy_fraction for r in self.runs])

    @property
    def fairness(self) -> float:
        return self._mean([r.fairness for r in self.runs])

    @property
    def longest_wait_s(self) -> float:
        return max(r.longest_wait_s for r in self.runs)

    @property
    def preemptions(self) -> float:
        return self._mean([r.preemptions for r in self.runs])

    @property
    def refused_plans(self) -> int:
        return sum(r.refused_plans for r in self.runs)


def summarize(
    scenario: Scenario,
    planner_name: str,
    seeds: Sequence[int] = SEEDS,
    settings: PlannerSettings = DEO_SETTINGS,
) -> Summary:
    """``scenario`` under ``planner_name``, once per seed."""
    runs = tuple(run(scenario, planner_name, seed, settings) for seed in seeds)
    return Summary(planner=planner_name, runs=runs)


#: Relative tolerance under which two step times, or two busy fractions, count as a tie.
TIE = 0.005


def compare(ours: Summary, theirs: Summary) -> dict[str, bool]:
    """Whether ``ours`` beats ``theirs`` (strictly better beyond :data:`TIE`) and whether it is
    no worse (within :data:`TIE`) on mean step time over pipelines, the worst pipeline's mean
    step time, and GPU busy fraction."""
    mean = ours.pipeline_mean_step_s / theirs.pipeline_mean_step_s - 1
    worst = ours.worst_step_s / theirs.worst_step_s - 1
    busy = ours.busy_fraction / theirs.busy_fraction - 1
    return {
        "step_beats": mean < -TIE and worst <= TIE,
        "step_no_worse": mean <= TIE and worst <= TIE,
        "busy_beats": busy > TIE,
        "busy_no_worse": busy >= -TIE,
    }


def _delta(ours: float, theirs: float) -> str:
    return f"{(ours / theirs - 1):+.1%}"


def _word(verdict: dict[str, bool], figure: str) -> str:
    if verdict[f"{figure}_beats"]:
        return "beats"
    return "ties" if verdict[f"{figure}_no_worse"] else "loses"


#: Options that set an engine cost of every scenario, and the Scenario field each sets.
_COST_OPTIONS = {"--wake-s": "wake_s", "--sleep-s": "sleep_s", "--preempt-lost-s": "preempt_lost_s"}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--seeds", type=int, default=len(SEEDS), help="seeds per scenario (1, 2, ...)"
    )
    parser.add_argument("--scenario", help="run only scenarios whose name contains this")
    costs = parser.add_argument_group(
        "engine costs (every scenario's; to try the planner where engines wake slower or faster)"
    )
    for option, field in _COST_OPTIONS.items():
        costs.add_argument(option, type=float, metavar="S", dest=field)
    parser.add_argument(
        "--move-cost-s",
        type=float,
        metavar="S",
        help=f"deo's move_cost_s (default {DEO_SETTINGS.move_cost_s:g})",
    )
    args = parser.parse_args(argv)
    if args.seeds < 1:
        parser.error(f"--seeds must be at least 1, got {args.seeds}")
    costs_s: dict[str, Any] = {}  # Scenario fields (floats)
    for option, field in _COST_OPTIONS.items():
        value = getattr(args, field)
        if value is not None and not 0 <= value < math.inf:
            parser.error(f"{option} must be a number >= 0, got {value}")
        if value is not None:
            costs_s[field] = value
    settings = DEO_SETTINGS
    if args.move_cost_s is not None:
        try:
            settings = attrs.evolve(DEO_SETTINGS, move_cost_s=args.move_cost_s)
        except InvalidEvent as exc:
            parser.error(f"--move-cost-s: {exc}")
    seeds = tuple(range(1, args.seeds + 1))
    command = "python bench/arbiter.py" + (f" --seeds {args.seeds}" if args.seeds != 3 else "")
    if args.scenario:
        command += f" --scenario {args.scenario!r}"
    command += "".join(f" {o} {costs_s[f]:g}" for o, f in _COST_OPTIONS.items() if f in costs_s)
    if args.move_cost_s is not None:
        command += f" --move-cost-s {args.move_cost_s:g}"
    print(f"command: {command}")
    print(f"seeds: {list(seeds)}; figures are means over seeds (longest wait: the maximum)")
    for scenario in SCENARIOS:
        if args.scenario and args.scenario not in scenario.name:
            continue
        scenario = attrs.evolve(scenario, **costs_s)
        print(
            f"\n### {scenario.name} ({scenario.duration_s:.0f} s simulated, wake"
            f" {scenario.wake_s:g} s, sleep {scenario.sleep_s:g} s, preemption loses"
            f" {scenario.preempt_lost_s:g} s)\n"
        )
        names = [p.name for p in scenario.pipelines]
        header = ["planner", *(f"{n} step s" for n in names)]
        header += ["mean step s", "worst step s", "GPU busy", "fairness", "longest wait s"]
        header += ["preemptions", "refused plans"]
        print("| " + " | ".join(header) + " |")
        print("|" + "---|" * len(header))
        summaries = {p: summarize(scenario, p, seeds, settings) for p in PLANNERS}
        for planner, summary in summaries.items():
            cells = [planner]
            cells += [f"{summary.mean_step_s[n]:.0f}" for n in names]
            cells += [
                f"{summary.pipeline_mean_step_s:.1f}",
                f"{summary.worst_step_s:.1f}",
                f"{summary.busy_fraction:.1%}",
                f"{summary.fairness:.2f}",
                f"{summary.longest_wait_s:.0f}",
                f"{summary.preemptions:.0f}",
                str(summary.refused_plans),
            ]
            print("| " + " | ".join(cells) + " |")
        deo = summaries["deo"]
        for other in ("static", "rlix"):
            theirs = summaries[other]
            verdict = compare(deo, theirs)
            goal = (
                verdict["step_beats"] and verdict["busy_beats"]
                if other == "static"
                else verdict["step_no_worse"] and verdict["busy_no_worse"]
            )
            print(
                f"\ndeo vs {other}: mean step"
                f" {_delta(deo.pipeline_mean_step_s, theirs.pipeline_mean_step_s)}, worst step"
                f" {_delta(deo.worst_step_s, theirs.worst_step_s)}, busy"
                f" {(deo.busy_fraction - theirs.busy_fraction) * 100:+.1f} points:"
                f" {_word(verdict, 'step')} on step time, {_word(verdict, 'busy')} on busy;"
                f" goal ({'beat' if other == 'static' else 'never worse'})"
                f" {'met' if goal else 'missed'}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
