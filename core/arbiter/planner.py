"""The planners: who gets which GPUs next, as a :class:`~core.arbiter.plan.Plan` with reasons.

A planner is a small pure object with one method, ``plan(state) -> Plan``, run by the reducer
after each event (see :class:`Planner`). Two are here: :class:`GapRatioPlanner`, deo's, and
:class:`RlixPlanner`, rlix's rule as published, kept as a baseline for the benchmarks.

Both serve requests in two phases.

**Priorities.** Waiting non-generation requests are served in priority order (INITIALIZATION 0
first, GENERATION 6 last; FIFO within a priority). Such a request needs its cluster's whole
device mapping, and may take GPUs from generation only: each active generation rank on its
mapping is put to sleep (a whole bundle of ``tp`` GPUs at a time). Memory-exclusive holders are
never preempted; a request they block waits. deo shrinks generation for a request only when the
request is granted in the same plan, and a waiting request reserves its mapping against requests
of lower priority (no priority inversion, no shrink that serves nobody), except when it is
blocked only by its own pipeline, or by another pipeline's holder that is *overstaying*: it has
held its GPUs past its limit, ``reserve_factor`` times the longest of its last holds (at least
``reserve_min_s``), or ``reserve_s`` while none of its holds is measured (a holder that may
never let go must not hold up the requests behind it that can be served from other GPUs; one
whose ordinary step is long is not overstaying; the reservation comes back once that holder lets
go). A grant that passes such a request says so in its reason.

**Gap ratio (rlix).** Generation GPUs are shared among pipelines by their remaining work. Per
pipeline with a generation cluster, from the latest progress report of each stream ``i``
(``T_i = max(target_i, 1)``, ``remaining_i = T_i - clamp(completed_i, 0, T_i)``)::

    R = sum_i remaining_i            (remaining trajectories)
    w = R * tp                       (weight: GPUs scale with tensor-parallel size)
    rho = w / sum_p w_p              (share)
    B = idle GPUs usable by an eligible generation cluster + every active generation GPU

rlix sets ``target = max(floor(rho * B / tp + 0.5) * tp, tp)`` and then repeatedly wakes ONE
rank of the acceptor with the largest ``(rho - active / B) / rho``, on an idle bundle when there is
one, else by shrinking donors (pipelines above their target, each keeping ``max(1, target/tp)``
bundles).

**Time-to-finish gap (deo).** deo shares by the GPU-seconds each pipeline still needs, so that
a pipeline whose GPUs turn out trajectories faster gets fewer of them, and moves a generating
rank only when the move pays for its wake, sleep and lost in-flight work::

    r    = trajectories per awake generation GPU-second, measured over the awake GPU-seconds
           of each span between reports and smoothed (observe_rate);
           not measured yet: the mean of the measured ones, or 1/tp (then W = R * tp, as rlix)
    W    = R / r                         (remaining work, GPU-seconds)
    t(g) = W / g                         (time to finish on g awake GPUs)
    f    = step factor, once the steps of at least two eligible pipelines are measured (else 1):
           N = time from a generation phase's end to the next one's start (its training and
               the rest), S = time from one phase's start to the next one's (its step), both
               measured by the arbiter from requests, releases and rollouts, smoothed;
           c = T / r + M * N   (GPU-seconds a step costs: T its rollout's trajectories, M the
                                GPUs its non-generation clusters map)
           s = S / c ** (1/3)  (normalised step),  f = (s / mean_p s_p) ** step_weight
    W'   = W * f                             (weighted work: what shares and moves compare)
    rho = W' / sum_p W'_p,  targets apportioned from rho * B in bundles (one-bundle floor first)

Steps proportional to ``c ** (1/3)`` are where the sum of squared step times is least for the
GPU-seconds there are (between the least mean step, ``c ** (1/2)``, and equal steps): a pipeline
whose step is long for what it costs gets more of the budget, one whose step is short less.
Times to finish below are those of the weighted work.

1. Idle bundles first, up to each target, the pipeline with the longest ``t`` first, on the
   bundle least likely to be claimed back soon (GPUs no other pipeline trains on first, then
   those whose owner finishes its rollout last).
2. Then, while an acceptor is below its target (longest ``t`` first), it takes one bundle from
   donors above their target, if the move shortens the longer of the two times to finish,
   ``max(t_a(g_a), t_d(g_d)) - max(t_a(g_a + tp), t_d(g_d - n))``, by more than ``hysteresis``
   of it and (both rates measured) by more than ``move_cost_s`` seconds. A donor with no work
   left always gives; one left with work and no GPU never does; an acceptor with no GPU always
   takes (the floor).
3. Idle bundles that no target can use go to eligible pipelines that can place them.

Cordoned GPUs (deo's health rules or an operator) get nothing new, and a rank awake on one is
its cluster's first to shrink: it is put to sleep while its cluster is above its target (before
any healthy rank of it goes to another pipeline; the targets are then computed again without
it), or when an idle healthy bundle of its cluster can take its place (a rank sleeps there and
another wakes: a rank's bundle is fixed). Otherwise it keeps generating.

A generation request is answered only once one of its ranks is awake.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Protocol

import attrs

from core.arbiter.model import (
    PLANNER_SETTINGS_UNRECORDED,
    ArbiterState,
    Cluster,
    ClusterSpec,
    Pipeline,
    PlannerSettings,
)
from core.arbiter.plan import ClusterKey, GpuOp, Plan, RankOp, merge_rank_ops

__all__ = [
    "Demand",
    "GapRatioPlanner",
    "Planner",
    "RlixPlanner",
    "Share",
    "observe_phase",
    "observe_rate",
    "overstaying",
    "planner_for",
]


class Planner(Protocol):
    """What the reducer asks of a planner."""

    @property
    def name(self) -> str:
        """A short name for alerts and benchmark tables."""
        ...

    def plan(self, state: ArbiterState) -> Plan:
        """The grants, shrinks and expansions to make now (frees are the reducer's)."""
        ...

    def overstay_limit(self, cluster: Cluster) -> tuple[float, str]:
        """Seconds ``cluster`` may hold its GPUs before it is overstaying (inf: never), and the
        rule that gave them, in words."""
        ...


@attrs.frozen(slots=True, kw_only=True)
class Demand:
    """A generation cluster's claim: ``remaining`` trajectories, and whether it competes."""

    remaining: int
    eligible: bool
    #: A silent pipeline's probe: at most one bundle.
    probe: bool = False


@attrs.frozen(slots=True, kw_only=True)
class Share:
    """A generation cluster as the planner sees it: its demand, target and awake GPUs."""

    remaining: int
    eligible: bool
    probe: bool
    target_gpus: int
    active_gpus: int


class _Board:
    """A planner's scratch copy of ownership, changed operation by operation."""

    def __init__(self, state: ArbiterState) -> None:
        self.state = state
        # A cordoned GPU is no place for anything new: to this plan it is as if lost.
        self.usable = state.usable() - state.cordoned
        self.idle = set(state.idle) - state.cordoned
        self.specs: dict[ClusterKey, ClusterSpec] = {}
        self.holder: dict[str, ClusterKey] = {}
        self.awake: dict[str, tuple[ClusterKey, int]] = {}
        self.active: dict[ClusterKey, set[int]] = {}
        self.shrinks: list[RankOp] = []
        self.expands: list[RankOp] = []
        self.grants: list[GpuOp] = []
        #: Ranks put to sleep in this plan: not woken again in the same plan.
        self.slept: set[tuple[ClusterKey, int]] = set()
        #: The pipelines whose non-generation clusters map each GPU (who may claim it back).
        self.homes: dict[str, set[str]] = {}
        #: Each pipeline's generation cluster.
        self.generation: dict[str, ClusterKey] = {}
        #: Remaining work in GPU-seconds, and the step factor's reason, per generation cluster
        #: (for the reasons; the plan compares weighted work).
        self.gpu_s: dict[ClusterKey, float] = {}
        self.step_notes: dict[ClusterKey, str] = {}
        for pipeline_id, cluster in state.clusters():
            key = (pipeline_id, cluster.spec.name)
            self.specs[key] = cluster.spec
            if cluster.spec.is_generation:
                self.generation[pipeline_id] = key
            else:
                for gpu in cluster.spec.device_mapping:
                    self.homes.setdefault(gpu, set()).add(pipeline_id)
            for gpu in cluster.held:
                self.holder[gpu] = key
            self.active[key] = set(cluster.active_ranks)
            for rank in cluster.active_ranks:
                for gpu in cluster.spec.bundle(rank):
                    self.awake[gpu] = (key, rank)

    def active_gpus(self, key: ClusterKey) -> int:
        return len(self.active.get(key, ())) * self.specs[key].tp_size

    def shrink(self, key: ClusterKey, rank: int, reason: str) -> None:
        self.active[key].discard(rank)
        self.slept.add((key, rank))
        for gpu in self.specs[key].bundle(rank):
            del self.awake[gpu]
            if gpu in self.usable and gpu not in self.holder:
                self.idle.add(gpu)
        self.shrinks.append(RankOp(pipeline=key[0], cluster=key[1], ranks=(rank,), reason=reason))

    def expand(self, key: ClusterKey, rank: int, reason: str) -> None:
        self.active[key].add(rank)
        for gpu in self.specs[key].bundle(rank):
            self.awake[gpu] = (key, rank)
            self.idle.discard(gpu)
        self.expands.append(RankOp(pipeline=key[0], cluster=key[1], ranks=(rank,), reason=reason))

    def grant(self, key: ClusterKey, reason: str) -> None:
        gpus = self.specs[key].device_mapping
        for gpu in gpus:
            self.holder[gpu] = key
            self.idle.discard(gpu)
        self.grants.append(GpuOp(pipeline=key[0], cluster=key[1], gpus=gpus, reason=reason))

    def idle_ranks(self, key: ClusterKey) -> list[int]:
        """The asleep ranks of ``key`` that may wake on their bundle now: placeable, and every
        GPU of the bundle idle."""
        spec = self.specs[key]
        return [
            r
            for r in range(spec.ranks)
            if r not in self.active[key]
            and self.placeable(key, r)
            and all(g in self.idle for g in spec.bundle(r))
        ]

    def placeable(self, key: ClusterKey, rank: int) -> bool:
        """Whether rank ``rank``'s bundle could ever run now: usable and not held."""
        if (key, rank) in self.slept:
            return False
        bundle = self.specs[key].bundle(rank)
        return all(g in self.usable and g not in self.holder for g in bundle)

    def result(self) -> Plan:
        return Plan(
            shrinks=merge_rank_ops(self.shrinks),
            grants=tuple(self.grants),
            expands=merge_rank_ops(self.expands),
        )


#: A bundle to wake: its score (lower wins), its rank, and the donor ranks it shrinks.
_Choice = tuple[tuple[int, tuple[int, float], float, int, int], int, list[tuple[ClusterKey, int]]]


def _name(key: ClusterKey) -> str:
    return f"{key[0]}/{key[1]}"


def _acceptors(
    board: _Board,
    eligible: Iterable[ClusterKey],
    targets: dict[ClusterKey, int],
    stuck: set[ClusterKey],
) -> list[ClusterKey]:
    """The eligible clusters below their target that can still wake a rank (not stuck)."""
    return [
        k
        for k in eligible
        if k not in stuck
        and board.active_gpus(k) < targets[k]
        and len(board.active[k]) < board.specs[k].dp_limit
    ]


def _priorities(board: _Board, shrink_when_blocked: bool, planner: Planner) -> None:
    """Serve waiting non-generation requests in priority order (see the module's docstring).

    A blocked request reserves its mapping against requests of lower priority, except when it
    is blocked only by its own pipeline, or by another pipeline's holder that is overstaying
    (``planner.overstay_limit``): such a holder may never let go, and requests behind it that
    can be served from the GPUs it does not hold are served, their grants saying whom they
    pass. Once that holder lets go, the request reserves again."""
    now = board.state.now
    #: GPUs a request would have reserved but for an overstaying holder: who waits, and why.
    passed: dict[str, str] = {}
    waiting = sorted(
        (cluster.request.priority, cluster.request.seq, (pipeline_id, cluster.spec.name))
        for pipeline_id, cluster in board.state.clusters()
        if cluster.request is not None and not cluster.spec.is_generation
    )
    reserved: dict[str, ClusterKey] = {}
    for priority, _, key in waiting:
        mapping = board.specs[key].device_mapping
        if not all(g in board.usable for g in mapping):
            # A GPU of its mapping is cordoned: it waits, and reserves nothing meanwhile (the
            # cordon may last).
            continue
        held_by = {board.holder[g] for g in mapping if g in board.holder} - {key}
        blocked = bool(held_by) or any(g in reserved for g in mapping)
        # A request blocked only by its own pipeline's clusters waits for that pipeline to
        # release (release-then-request); it reserves nothing, so that a pipeline that never
        # releases cannot hold up everyone queued behind it.
        reserves = blocked and not (
            {p for p, _ in held_by} == {key[0]} and not any(g in reserved for g in mapping)
        )
        others = {holder for holder in held_by if holder[0] != key[0]}
        overstaying = _overstaying_holders(board, planner, others, now)
        if overstaying and reserves:
            reserves = False
            waits = f"{_name(key)} ({priority.name}), which waits for {'; '.join(overstaying)}"
            for gpu in mapping:
                passed.setdefault(gpu, waits)
        if blocked and not shrink_when_blocked:
            if reserves:
                for gpu in mapping:
                    reserved.setdefault(gpu, key)
            continue
        why = f"{_name(key)} ({priority.name}) needs its device mapping {list(mapping)}"
        for gpu in mapping:
            if gpu in board.awake:
                donor, rank = board.awake[gpu]
                board.shrink(donor, rank, f"{why}: generation preempted")
        if blocked:
            if reserves:
                for gpu in mapping:
                    reserved.setdefault(gpu, key)
            continue
        ahead = sorted({passed[g] for g in mapping if g in passed})
        board.grant(key, f"{why}: granted" + "".join(f", ahead of {w}" for w in ahead))


def _overstaying_holders(
    board: _Board, planner: Planner, holders: Iterable[ClusterKey], now: float
) -> list[str]:
    """The holders among ``holders`` that are overstaying, each described with how long it has
    held its GPUs and its limit."""
    found = []
    for holder in sorted(holders):
        held_s = _held_for_s(board, holder, now)
        limit_s, rule = planner.overstay_limit(board.state.pipelines[holder[0]].clusters[holder[1]])
        if held_s >= limit_s:
            found.append(f"{_name(holder)} holding GPUs for {held_s:.0f}s ({rule})")
    return found


def overstaying(state: ArbiterState, planner: Planner) -> dict[str, str]:
    """The holders that block a waiting request of another pipeline and are overstaying
    (``pipeline/cluster`` -> what they hold up, in words): each of them has an alert."""
    found: dict[str, str] = {}
    for pipeline_id, cluster in state.clusters():
        request = cluster.request
        if request is None or cluster.spec.is_generation:
            continue
        for holder_id, holder in state.clusters():
            if holder_id == pipeline_id or not set(holder.held) & set(cluster.spec.device_mapping):
                continue
            if holder.held_t is None:
                continue
            held_s = state.now - holder.held_t
            limit_s, rule = planner.overstay_limit(holder)
            if held_s >= limit_s:
                name = f"{holder_id}/{holder.spec.name}"
                found.setdefault(
                    name,
                    f"{name} has held GPUs {list(holder.held)} for {held_s:.0f}s ({rule}) while"
                    f" {pipeline_id}/{cluster.spec.name} ({request.priority.name}) waits for"
                    f" them",
                )
    return found


def _held_for_s(board: _Board, key: ClusterKey, now: float) -> float:
    """How long ``key`` has held its GPUs (0 if it was granted in this plan)."""
    held_t = board.state.pipelines[key[0]].clusters[key[1]].held_t
    if held_t is None or not board.state.pipelines[key[0]].clusters[key[1]].held:
        return 0.0
    return now - held_t


def _remaining(state: ArbiterState, pipeline_id: str) -> int | None:
    """R from the latest progress reports, or None with no report."""
    progress = state.pipelines[pipeline_id].progress
    if not progress:
        return None
    return sum(p.remaining for p in progress.values())


#: Weight of a new sample in the smoothed generation rate.
RATE_SMOOTHING = 0.2
#: Seconds a rate sample spans at least (shorter spans are noisy: ranks just woken produce
#: nothing yet).
RATE_WINDOW_S = 5.0


def observe_rate(pipeline: Pipeline, now: float, *, over_awake_gpu_s: bool = True) -> Pipeline:
    """``pipeline`` after a progress report at ``now``, with its generation rate measured: the
    trajectories completed since the last mark, over the awake generation GPU-seconds since
    then (counted across every wake and sleep in the span; ``over_awake_gpu_s`` False: the
    seconds since the mark times the GPUs awake now, as deo's first planner measured). A
    sample is taken once it spans :data:`RATE_WINDOW_S` and shows progress (a stall lowers the
    next sample instead of making the rate zero); it is smoothed exponentially. Fewer completed
    trajectories than at the mark (a new rollout) or no awake GPU-second start a new mark."""
    completed = sum(max(p.completed_trajectories, 0) for p in pipeline.progress.values())
    pipeline = pipeline.gpu_time_counted(now)
    cluster = pipeline.generation()
    gpus = 0 if cluster is None else len(cluster.active_gpus())
    mark_t = pipeline.rate_mark_t
    new_mark = attrs.evolve(
        pipeline, rate_mark_t=now, rate_mark_completed=completed, rate_gpu_s=0.0, rate_counted_t=now
    )
    if mark_t is None or completed < pipeline.rate_mark_completed:
        return new_mark
    span_s = now - mark_t
    gpu_s = pipeline.rate_gpu_s if over_awake_gpu_s else gpus * span_s
    idle = gpu_s <= 0 < span_s if over_awake_gpu_s else gpus == 0
    if idle:  # nothing awake over the span: what it completed says nothing of a rate
        return new_mark
    done = completed - pipeline.rate_mark_completed
    if span_s < RATE_WINDOW_S or done == 0:
        return pipeline
    sample = done / gpu_s
    old = pipeline.trajectories_per_gpu_s
    rate = sample if old is None else old + RATE_SMOOTHING * (sample - old)
    return attrs.evolve(new_mark, trajectories_per_gpu_s=rate)


#: Weight of a new sample in a pipeline's smoothed non-generation time and step period.
STEP_SMOOTHING = 0.3


def observe_phase(before: Pipeline | None, after: Pipeline, now: float) -> Pipeline:
    """``after`` (the pipeline after an event at ``now``; ``before``: before it, None if it was
    not registered) with its generation phases followed (:meth:`Pipeline.generating`). When a
    phase starts, the time since the last one ended is a sample of its non-generation time and
    the time since the last one started a sample of its step period (each smoothed
    exponentially); when a phase ends, the time is marked. The arbiter learns each pipeline's
    step this way from what it already hears (requests, releases, rollouts opened and closed)."""
    was = before is not None and before.generating()
    generating = after.generating()
    if generating == was:
        return after
    if not generating:
        return attrs.evolve(after, generation_ended_t=now)
    non_generation_s, step_s = after.non_generation_s, after.step_s
    if after.generation_ended_t is not None:
        non_generation_s = _smoothed(non_generation_s, now - after.generation_ended_t)
    if after.step_started_t is not None:
        step_s = _smoothed(step_s, now - after.step_started_t)
    return attrs.evolve(after, step_started_t=now, non_generation_s=non_generation_s, step_s=step_s)


def _smoothed(old: float | None, sample: float) -> float:
    return sample if old is None else old + STEP_SMOOTHING * (sample - old)


#: The exponent of a pipeline's GPU-seconds per step in its normalised step (see
#: :meth:`GapRatioPlanner.step_factors`): step times proportional to the cube root of what a
#: step costs minimise the sum of squared step times for the GPU-seconds there are.
STEP_EXPONENT = 1 / 3


def _rates(state: ArbiterState, keys: Iterable[ClusterKey]) -> dict[ClusterKey, float]:
    """Trajectories per GPU-second per generation cluster: measured, else the mean of the
    measured ones, else 1 per rank (``1 / tp`` per GPU, which makes the weight rlix's
    ``R * tp``)."""
    measured = {
        k: rate
        for k in keys
        if (rate := state.pipelines[k[0]].trajectories_per_gpu_s) is not None and rate > 0
    }
    mean = sum(measured.values()) / len(measured) if measured else None
    return {
        k: measured.get(k, mean if mean is not None else 1.0 / _spec(state, k).tp_size)
        for k in keys
    }


def _spec(state: ArbiterState, key: ClusterKey) -> ClusterSpec:
    return state.pipelines[key[0]].clusters[key[1]].spec


@attrs.frozen(slots=True)
class GapRatioPlanner:
    """deo's planner: the time-to-finish gap (the module's docstring has the rule and its
    formula), with rlix's known flaws fixed.

    - Demand is durable and counted once: an open rollout or a waiting request makes a pipeline
      eligible (so a pipeline preempted to zero competes before it reports again), and adds no
      ``R += T`` boost (rlix's boost double-counts the rollout).
    - A request with no progress and no estimate counts as one trajectory (rlix skips it, so it
      waits forever); a waiting request always counts at least one.
    - A pipeline awake with no demand is a donor with target 0 (rlix does not see it, so its GPUs
      can never be reclaimed); its ranks stay awake until someone needs them.
    - Shares follow remaining GPU-seconds ``W = R / rate``, not remaining trajectories: rlix
      gives a pipeline with fast trajectories as many GPUs as a slow one with the same count.
    - Shares see whole steps, not rollouts alone: the arbiter measures each pipeline's step and
      non-generation time from what it hears, and weights its work by its normalised step
      (:meth:`step_factors`), so a pipeline slow for what its steps cost catches up.
    - Targets are apportioned in bundles and sum to at most the budget: first one bundle to each
      eligible pipeline with work left (most work first, while bundles last), then one
      bundle at a time to the pipeline furthest below ``rho * B``; a target never exceeds the
      ranks the cluster can place (``max_dp_size``, lost or held GPUs) (rlix's targets can sum past
      the budget, and give a bundle to pipelines with nothing left).
    - Idle GPUs are filled before anyone is shrunk, and a generating rank moves only when the
      move pays (hysteresis): rlix moves ranks on every change of the ratio, and each move
      costs a wake, a sleep and the trajectories in flight.
    - Donors are pipelines above their target; a donor never goes below it. Among bundles to
      wake, an idle one wins, then the one least likely to be claimed back by another
      pipeline's training, then the one whose donors finish soonest after the move (protect
      the donors with the most work), then the fewest ranks shrunk, then the lowest rank.
    - A non-generation request shrinks generation only when it is granted in the same plan.
    - Idle bundles that no target can use (a share may sit where its owner cannot place it) go to
      eligible pipelines that can place them, most remaining work first.
    - A pipeline with no waiting request that has shown no life (no progress report, request or
      rollout opened) for ``stale_after_s`` seconds is *silent*: a hung rollout must not keep GPUs
      from the others (rlix keeps them). A silent pipeline gets at most one bundle, as a probe: for
      ``stale_after_s`` after it woke from zero ranks; then it is a donor with target 0, and its
      next probe comes ``2 * stale_after_s`` after the last one. Any sign of life ends it. (A
      pipeline preempted to zero cannot report; its probe lets it show it is alive.)
    """

    name: str = "deo"
    #: Seconds without a sign of life after which a pipeline is silent (None: never).
    stale_after_s: float | None = 60.0
    #: A rank is taken from a donor that is generating only when the move shortens the longer
    #: of the two pipelines' times to finish by this fraction of it and by more than
    #: ``move_cost_s`` seconds: a move costs a wake, a sleep and the donor's trajectories in
    #: flight (about 12 s of the moved GPUs' output with vLLM's level-1 sleep), and each rank
    #: placed on another pipeline's training GPUs is preempted again when that training comes:
    #: shares must not churn (``bench/arbiter.py``: 60 s against 30 s, fewer moves and busier
    #: GPUs on every scenario).
    hysteresis: float = 0.1
    move_cost_s: float = 60.0
    #: A request blocked by another pipeline's holder stops reserving its other GPUs against
    #: lower priorities once that holder is overstaying: it has held its GPUs for
    #: ``reserve_factor`` times the longest of its last holds (at least ``reserve_min_s``), or,
    #: none measured (or ``reserve_factor`` None), for ``reserve_s``. ``reserve_s`` None: never.
    reserve_s: float | None = 3600.0
    reserve_factor: float | None = 3.0
    reserve_min_s: float = 60.0
    #: The gain ``k`` of the step factor (:meth:`step_factors`); 0: shares by remaining
    #: GPU-seconds alone.
    step_weight: float = 2.0

    def __attrs_post_init__(self) -> None:
        self.settings()  # the same checks as the recorded settings, naming the field

    def settings(self, *, rate_over_awake_gpu_s: bool = True) -> PlannerSettings:
        """These parameters as the settings the log records."""
        return PlannerSettings(
            name="deo",
            stale_after_s=self.stale_after_s,
            hysteresis=self.hysteresis,
            move_cost_s=self.move_cost_s,
            reserve_s=self.reserve_s,
            reserve_factor=self.reserve_factor,
            reserve_min_s=self.reserve_min_s,
            rate_over_awake_gpu_s=rate_over_awake_gpu_s,
            step_weight=self.step_weight,
        )

    def overstay_limit(self, cluster: Cluster) -> tuple[float, str]:
        if self.reserve_s is None:
            return math.inf, "never overstaying"
        if self.reserve_factor is None or not cluster.holds_s:
            return self.reserve_s, f"past reserve_s {self.reserve_s:.0f}s"
        longest_s = max(cluster.holds_s)
        limit_s = max(self.reserve_factor * longest_s, self.reserve_min_s)
        return limit_s, (
            f"past {limit_s:.0f}s, {self.reserve_factor:g} x its longest recent hold"
            f" {longest_s:.0f}s, at least reserve_min_s {self.reserve_min_s:.0f}s"
        )

    def demand(self, state: ArbiterState) -> dict[ClusterKey, Demand]:
        found: dict[ClusterKey, Demand] = {}
        for pipeline_id, pipeline in state.pipelines.items():
            cluster = pipeline.generation()
            if cluster is None:
                continue
            waiting = cluster.request is not None
            wants = waiting or pipeline.rollout_open
            remaining = _remaining(state, pipeline_id)
            if remaining is None:
                estimate = cluster.request.estimate_trajectories if cluster.request else None
                remaining = (estimate or 1) if wants else 0
            if waiting:
                remaining = max(remaining, 1)
            eligible = remaining > 0 and (wants or bool(cluster.active_ranks))
            probe = False
            limit = self.stale_after_s
            silent = limit is not None and state.now - pipeline.activity_t > limit
            if eligible and not waiting and silent and limit is not None:
                woken = pipeline.woken_t
                since = math.inf if woken is None else state.now - woken
                probe = since <= limit if cluster.active_ranks else since > 2 * limit
                eligible = probe
            found[(pipeline_id, cluster.spec.name)] = Demand(
                remaining=remaining if eligible else 0, eligible=eligible, probe=probe
            )
        return found

    def work(
        self, state: ArbiterState, demand: dict[ClusterKey, Demand]
    ) -> dict[ClusterKey, float]:
        """Each generation cluster's remaining work in GPU-seconds: ``R / rate``."""
        rates = _rates(state, demand)
        return {k: d.remaining / rates[k] for k, d in demand.items()}

    def step_factors(
        self, state: ArbiterState, demand: dict[ClusterKey, Demand]
    ) -> dict[ClusterKey, tuple[float, str]]:
        """Per eligible generation cluster whose pipeline's step is measured, the factor its
        remaining work is weighted by in the shares, and why, in words.

        ``c = T / r + M * N`` is what one step costs in GPU-seconds (``T`` its rollout's
        trajectories, ``r`` its rate, ``M`` the GPUs its other clusters map, ``N`` its measured
        non-generation time); ``s = S / c ** (1/3)`` its normalised step (``S`` its measured
        step period); the factor is ``(s / mean s) ** step_weight`` over the pipelines measured
        (at least two). A pipeline whose step is long for what it costs gets more of the
        budget, one whose step is short less, until normalised steps are even: that is where
        the sum of squared step times is least (``S`` proportional to ``c ** (1/3)``), between
        the least mean step (``c ** (1/2)``) and equal steps (the slowest pipeline first)."""
        if not self.step_weight:
            return {}
        rates = _rates(state, demand)
        normalised: dict[ClusterKey, tuple[float, float, float]] = {}
        for key, d in demand.items():
            pipeline = state.pipelines[key[0]]
            step_s, non_generation_s = pipeline.step_s, pipeline.non_generation_s
            if not d.eligible or step_s is None or non_generation_s is None:
                continue
            if not pipeline.progress:
                continue
            trajectories = sum(max(p.target_trajectories, 1) for p in pipeline.progress.values())
            others = sum(
                len(c.spec.device_mapping)
                for c in pipeline.clusters.values()
                if not c.spec.is_generation
            )
            cost = trajectories / rates[key] + others * non_generation_s
            normalised[key] = (step_s / cost**STEP_EXPONENT, step_s, cost)
        if len(normalised) < 2:
            return {}
        mean = sum(n for n, _, _ in normalised.values()) / len(normalised)
        found = {}
        for key, (n, step_s, cost) in normalised.items():
            factor = (n / mean) ** self.step_weight
            found[key] = (
                factor,
                f"step {step_s:.0f}s for {cost:.0f} GPU-s, {n / mean:.2f} x the mean normalised"
                f" step: weight x{factor:.2f}",
            )
        return found

    def claims(
        self, state: ArbiterState, demand: dict[ClusterKey, Demand], work: dict[ClusterKey, float]
    ) -> dict[ClusterKey, float]:
        """Each generation cluster's remaining work weighted by its step factor
        (:meth:`step_factors`): what the shares, targets and moves compare."""
        factors = self.step_factors(state, demand)
        return {k: w * factors[k][0] if k in factors else w for k, w in work.items()}

    def shares(self, state: ArbiterState) -> dict[ClusterKey, Share]:
        """Each generation cluster's demand, target and awake GPUs as this planner sees ``state``
        (for ``deo status`` and metrics; targets are those of the next plan)."""
        board = _Board(state)
        _priorities(board, shrink_when_blocked=False, planner=self)
        demand = self.demand(state)
        eligible = sorted(k for k, d in demand.items() if d.eligible)
        work = self.claims(state, demand, self.work(state, demand))
        probes = {k for k in eligible if demand[k].probe}
        targets = self._targets(board, eligible, work, probes) if eligible else {}
        return {
            key: Share(
                remaining=d.remaining,
                eligible=d.eligible,
                probe=d.probe,
                target_gpus=targets.get(key, 0),
                active_gpus=len(state.pipelines[key[0]].clusters[key[1]].active_gpus()),
            )
            for key, d in demand.items()
        }

    def plan(self, state: ArbiterState) -> Plan:
        board = _Board(state)
        _priorities(board, shrink_when_blocked=False, planner=self)
        demand = self.demand(state)
        eligible = sorted(k for k, d in demand.items() if d.eligible)
        remaining = {k: demand[k].remaining for k in demand}
        board.gpu_s = self.work(state, demand)
        board.step_notes = {k: why for k, (_, why) in self.step_factors(state, demand).items()}
        # From here on "work" is the weighted work: time to finish is that of the weighted work.
        work = self.claims(state, demand, board.gpu_s)
        probes = {k for k in eligible if demand[k].probe}
        targets = self._targets(board, eligible, work, probes)
        while _leave_cordoned(board, targets, work):
            # The GPUs left are no share any more: the targets are those of what is left.
            targets = self._targets(board, eligible, work, probes)
        if not eligible:
            return board.result()
        # Idle GPUs first: waking on them takes nothing from anyone.
        self._fill_idle(board, eligible, targets, remaining, work, probes, within_targets=True)
        stuck: set[ClusterKey] = set()
        while True:
            acceptors = _acceptors(board, eligible, targets, stuck)
            if not acceptors:
                break
            key = max(acceptors, key=lambda k: (_finish_s(board, work, k), remaining[k], k))
            if not self._wake_one(board, key, targets, remaining, work):
                stuck.add(key)
        self._fill_idle(board, eligible, targets, remaining, work, probes, within_targets=False)
        return board.result()

    def _fill_idle(
        self,
        board: _Board,
        eligible: list[ClusterKey],
        targets: dict[ClusterKey, int],
        remaining: dict[ClusterKey, int],
        work: dict[ClusterKey, float],
        probes: set[ClusterKey],
        *,
        within_targets: bool,
    ) -> None:
        """Wake ranks on idle bundles, the pipeline with the longest time to finish first: up to
        each target (``within_targets``), or past targets for idle bundles that no target could
        use (targets are shares of a budget, and a share may sit where its owner cannot place
        it: nothing waits while GPUs it can use are idle)."""
        while True:
            woken = False
            for key in sorted(eligible, key=lambda k: (-_finish_s(board, work, k), k)):
                spec = board.specs[key]
                limit = 1 if key in probes else spec.dp_limit
                if len(board.active[key]) >= limit:
                    continue
                if within_targets and board.active_gpus(key) + spec.tp_size > targets[key]:
                    continue
                free = board.idle_ranks(key)
                if not free:
                    continue
                rank = min(free, key=lambda r: (_claim_risk(board, work, key, r), r))
                why = (
                    f"below its target of {targets[key]} GPUs"
                    if within_targets
                    else "takes idle GPUs no other pipeline's target can use"
                )
                board.expand(
                    key,
                    rank,
                    f"gap ratio: {_name(key)} {why} ({_left(board, key, remaining, work)});"
                    " woken on idle GPUs",
                )
                woken = True
                break
            if not woken:
                return

    def _targets(
        self,
        board: _Board,
        eligible: list[ClusterKey],
        work: dict[ClusterKey, float],
        probes: set[ClusterKey],
    ) -> dict[ClusterKey, int]:
        usable_for_generation = {g for k in eligible for g in board.specs[k].device_mapping}
        budget = len(board.idle & usable_for_generation) + len(board.awake)
        total = sum(work[k] for k in eligible)
        share = {k: budget * work[k] / total for k in eligible}
        cap = {
            k: min(
                board.specs[k].dp_limit,
                # Ranks it can wake, and those awake already (on a cordoned GPU too).
                sum(
                    1
                    for r in range(board.specs[k].ranks)
                    if r in board.active[k] or board.placeable(k, r)
                ),
                1 if k in probes else board.specs[k].ranks,
            )
            * board.specs[k].tp_size
            for k in eligible
        }
        targets = dict.fromkeys(board.specs, 0)
        left = budget
        for k in sorted(eligible, key=lambda k: (-work[k], k)):
            tp = board.specs[k].tp_size
            if cap[k] >= tp and tp <= left:
                targets[k] = tp
                left -= tp
        while True:
            open_ = [
                k
                for k in eligible
                if targets[k] + board.specs[k].tp_size <= cap[k] and board.specs[k].tp_size <= left
            ]
            if not open_:
                return targets
            k = min(open_, key=lambda k: (-(share[k] - targets[k]), -work[k], k))
            targets[k] += board.specs[k].tp_size
            left -= board.specs[k].tp_size

    def _wake_one(
        self,
        board: _Board,
        key: ClusterKey,
        targets: dict[ClusterKey, int],
        remaining: dict[ClusterKey, int],
        work: dict[ClusterKey, float],
    ) -> bool:
        spec = board.specs[key]
        finish_s = _finish_s(board, work, key)
        best: _Choice | None = None
        for rank in range(spec.ranks):
            if rank in board.active[key] or not board.placeable(key, rank):
                continue
            donors = sorted({board.awake[g] for g in spec.bundle(rank) if g in board.awake})
            taken: dict[ClusterKey, int] = {}
            for donor, _ in donors:
                taken[donor] = taken.get(donor, 0) + board.specs[donor].tp_size
            if any(
                d == key
                or board.active_gpus(d) - n < targets.get(d, 0)
                or not self._worth_moving(
                    (finish_s, _finish_s(board, work, key, spec.tp_size)),
                    (_finish_s(board, work, d), _finish_s(board, work, d, -n)),
                    timed=_measured(board, key, d),
                )
                for d, n in taken.items()
            ):
                continue
            score = (
                1 if donors else 0,
                _claim_risk(board, work, key, rank),
                max((_finish_s(board, work, d, -n) for d, n in taken.items()), default=0.0),
                len(donors),
                rank,
            )
            if best is None or score < best[0]:
                best = (score, rank, donors)
        if best is None:
            return False
        _, rank, donors = best
        for donor, donor_rank in donors:
            board.shrink(
                donor,
                donor_rank,
                f"gap ratio: {_name(donor)} is above its target of {targets.get(donor, 0)} GPUs"
                f" and gives GPUs to {_name(key)}, which needs longer to finish",
            )
        source = f"from {', '.join(_name(d) for d, _ in donors)}" if donors else "on idle GPUs"
        board.expand(
            key,
            rank,
            f"gap ratio: {_name(key)} is below its target of {targets[key]} GPUs"
            f" ({_left(board, key, remaining, work)}); woken {source}",
        )
        return True

    def _worth_moving(
        self,
        acceptor_s: tuple[float, float],
        donor_s: tuple[float, float],
        *,
        timed: bool,
    ) -> bool:
        """Whether moving a bundle pays: ``acceptor_s`` and ``donor_s`` are each side's time to
        finish before and after the move. It must shorten the longer of the two by
        ``hysteresis`` of it, and (``timed``: both rates measured, so the times are seconds) by
        more than ``move_cost_s``."""
        if donor_s[0] == 0.0:
            return True  # the donor has nothing left to generate
        if donor_s[1] == math.inf:
            return False  # the donor would be left with work and no GPU
        if acceptor_s[0] == math.inf:
            return True  # the acceptor has work and no GPU
        before = max(acceptor_s[0], donor_s[0])
        gain = before - max(acceptor_s[1], donor_s[1])
        if gain <= self.hysteresis * before:
            return False
        return not timed or gain > self.move_cost_s


def _cordoned_ranks(board: _Board, key: ClusterKey) -> list[int]:
    """``key``'s awake ranks whose bundle has a cordoned GPU."""
    cordoned = board.state.cordoned
    spec = board.specs[key]
    return [r for r in sorted(board.active[key]) if set(spec.bundle(r)) & cordoned]


def _leave_cordoned(
    board: _Board, targets: dict[ClusterKey, int], work: dict[ClusterKey, float]
) -> bool:
    """Generation off cordoned GPUs (deo's health rules or an operator cordoned them: they are
    being emptied); whether a rank left one. A rank's bundle is fixed, so a rank cannot move:
    one awake on a cordoned GPU is the first of its cluster to shrink. While the cluster is
    above its target it shrinks them, before any healthy rank of it is given to another
    pipeline; every other one is put to sleep once the cluster can wake another rank in its
    place on an idle healthy bundle (the cluster keeps as many awake GPUs). The rest keep
    generating where they are: putting them to sleep would serve nobody."""
    left = False
    for key in sorted(board.generation.values()):
        for rank in _cordoned_ranks(board, key):
            gpus = sorted(set(board.specs[key].bundle(rank)) & board.state.cordoned)
            if board.active_gpus(key) > targets.get(key, 0):
                board.shrink(
                    key,
                    rank,
                    f"GPUs {gpus} are cordoned and {_name(key)} is above its target of"
                    f" {targets.get(key, 0)} GPUs: its rank there is the first to shrink",
                )
                left = True
                continue
            free = board.idle_ranks(key)
            if not free:
                continue
            instead = min(free, key=lambda r: (_claim_risk(board, work, key, r), r))
            board.shrink(
                key,
                rank,
                f"GPUs {gpus} are cordoned: {_name(key)} rank {rank} sleeps, rank {instead} wakes"
                " in its place on idle healthy GPUs",
            )
            board.expand(
                key,
                instead,
                f"{_name(key)} rank {instead} wakes on idle healthy GPUs in place of rank {rank},"
                f" whose GPUs {gpus} are cordoned",
            )
            left = True
    return left


def _claim_risk(
    board: _Board, work: dict[ClusterKey, float], key: ClusterKey, rank: int
) -> tuple[int, float]:
    """How soon rank ``rank`` of ``key`` may be preempted by another pipeline's training (lower
    is safer): (0, 0) on GPUs no other pipeline's non-generation cluster maps (its own
    training takes them back only when it has released generation anyway); else (1, -t) where
    t is the shortest time to finish among those pipelines' rollouts (the sooner one finishes,
    the sooner its training claims its GPUs; one with no rollout work may claim them any
    time)."""
    others = {p for g in board.specs[key].bundle(rank) for p in board.homes.get(g, ())}
    others.discard(key[0])
    if not others:
        return (0, 0.0)
    soonest = min(
        _finish_s(board, work, board.generation[p]) if p in board.generation else 0.0
        for p in others
    )
    return (1, -soonest)


def _measured(board: _Board, *keys: ClusterKey) -> bool:
    """Whether every one of ``keys`` has a measured generation rate."""
    return all(board.state.pipelines[k[0]].trajectories_per_gpu_s is not None for k in keys)


def _left(
    board: _Board, key: ClusterKey, remaining: dict[ClusterKey, int], work: dict[ClusterKey, float]
) -> str:
    """What ``key`` has left, in words: GPU-seconds only once its rate is measured; with its
    step factor when it has one."""
    gpu_s = board.gpu_s.get(key, work[key])
    note = f"; {board.step_notes[key]}" if key in board.step_notes else ""
    if _measured(board, key):
        return f"{remaining[key]} trajectories, {gpu_s:.0f} GPU-s remaining{note}"
    if any(p.trajectories_per_gpu_s is not None for p in board.state.pipelines.values()):
        return (
            f"{remaining[key]} trajectories, about {gpu_s:.0f} GPU-s remaining at the mean"
            f" measured rate (its own not measured yet){note}"
        )
    return (
        f"{remaining[key]} trajectories remaining, weight {gpu_s:.0f}"
        f" (rate not measured yet: R x tp){note}"
    )


def _finish_s(
    board: _Board, work: dict[ClusterKey, float], key: ClusterKey, change_gpus: int = 0
) -> float:
    """Seconds ``key`` needs to finish its remaining work on its awake GPUs (plus
    ``change_gpus``): infinite with none and work left, 0 with no work."""
    left = work.get(key, 0.0)
    if left <= 0:
        return 0.0
    gpus = board.active_gpus(key) + change_gpus
    return left / gpus if gpus > 0 else math.inf


@attrs.frozen(slots=True)
class RlixPlanner:
    """rlix's planner as published (after its PR #16), flaws included, for comparison.

    Demand per pipeline: from progress reports, else a request's positive estimate (R = T = e),
    else the pipeline is skipped; a pipeline with a waiting request or an open rollout gets
    ``R += T``. ``target = max(floor(rho * B / tp + 0.5) * tp, tp)`` for every eligible pipeline;
    the acceptor with the largest ``(rho - active/B) / rho`` (then gap, then id) wakes one rank,
    on an idle bundle if any, else taking from donors above target that keep
    ``max(1, target/tp)`` bundles, preferring donors with the most remaining work, then the lowest
    rank. A non-generation request shrinks generation on its mapping even when it must still wait.
    """

    name: str = "rlix"

    def overstay_limit(self, cluster: Cluster) -> tuple[float, str]:
        return math.inf, "rlix: never overstaying"

    def demand(self, state: ArbiterState) -> dict[ClusterKey, tuple[int, int]]:
        """(R, T) per eligible generation cluster."""
        found: dict[ClusterKey, tuple[int, int]] = {}
        for pipeline_id, pipeline in state.pipelines.items():
            cluster = pipeline.generation()
            if cluster is None:
                continue
            wants = cluster.request is not None or pipeline.rollout_open
            progress = pipeline.progress
            if progress:
                remaining = sum(p.remaining for p in progress.values())
                total = sum(max(p.target_trajectories, 1) for p in progress.values())
            else:
                estimate = cluster.request.estimate_trajectories if cluster.request else None
                if not estimate:
                    continue
                remaining = total = estimate
            if wants:
                remaining += total
            if (wants or cluster.active_ranks) and remaining > 0:
                found[(pipeline_id, cluster.spec.name)] = (remaining, total)
        return found

    def plan(self, state: ArbiterState) -> Plan:
        board = _Board(state)
        _priorities(board, shrink_when_blocked=True, planner=self)
        demand = self.demand(state)
        eligible = sorted(demand)
        if not eligible:
            return board.result()
        usable = {g for k in eligible for g in board.specs[k].device_mapping}
        budget = len(board.idle & usable) + sum(board.active_gpus(k) for k in eligible)
        if budget == 0:
            return board.result()
        weight = {k: demand[k][0] * board.specs[k].tp_size for k in eligible}
        total = sum(weight.values())
        rho = {k: weight[k] / total for k in eligible}
        targets = {
            k: max(
                int(rho[k] * budget / board.specs[k].tp_size + 0.5) * board.specs[k].tp_size,
                board.specs[k].tp_size,
            )
            for k in eligible
        }
        stuck: set[ClusterKey] = set()
        while True:
            acceptors = _acceptors(board, eligible, targets, stuck)
            if not acceptors:
                break
            key = min(
                acceptors,
                key=lambda k: (
                    -(rho[k] - board.active_gpus(k) / budget) / rho[k],
                    -(targets[k] - board.active_gpus(k)),
                    k,
                ),
            )
            if not self._wake_one(board, key, targets, demand, eligible):
                stuck.add(key)
        return board.result()

    def _wake_one(
        self,
        board: _Board,
        key: ClusterKey,
        targets: dict[ClusterKey, int],
        demand: dict[ClusterKey, tuple[int, int]],
        eligible: Iterable[ClusterKey],
    ) -> bool:
        spec = board.specs[key]
        visible = set(eligible)
        best: tuple[tuple[int, int, int], int, list[tuple[ClusterKey, int]]] | None = None
        for rank in range(spec.ranks):
            if rank in board.active[key] or not board.placeable(key, rank):
                continue
            donors = sorted({board.awake[g] for g in spec.bundle(rank) if g in board.awake})
            taken: dict[ClusterKey, int] = {}
            for donor, _ in donors:
                taken[donor] = taken.get(donor, 0) + 1
            ok = True
            for d, n in taken.items():
                keep = max(1, targets.get(d, 0) // board.specs[d].tp_size)
                over = board.active_gpus(d) > targets.get(d, 0)
                if d == key or d not in visible or not over or len(board.active[d]) - n < keep:
                    ok = False
            if not ok:
                continue
            score = (
                1 if donors else 0,
                -sum(demand[d][0] for d in taken),
                rank,
            )
            if best is None or score < best[0]:
                best = (score, rank, donors)
        if best is None:
            return False
        _, rank, donors = best
        for donor, donor_rank in donors:
            board.shrink(
                donor, donor_rank, f"rlix gap ratio: {_name(donor)} gives GPUs to {_name(key)}"
            )
        board.expand(key, rank, f"rlix gap ratio: {_name(key)} below target {targets[key]}")
        return True


def planner_for(settings: PlannerSettings | None) -> Planner:
    """The planner the recorded ``settings`` describe (None: a log that recorded none, which
    replays with :data:`~core.arbiter.model.PLANNER_SETTINGS_UNRECORDED`)."""
    chosen = PLANNER_SETTINGS_UNRECORDED if settings is None else settings
    if chosen.name == "rlix":
        return RlixPlanner()
    return GapRatioPlanner(
        stale_after_s=chosen.stale_after_s,
        hysteresis=chosen.hysteresis,
        move_cost_s=chosen.move_cost_s,
        reserve_s=chosen.reserve_s,
        reserve_factor=chosen.reserve_factor,
        reserve_min_s=chosen.reserve_min_s,
        step_weight=chosen.step_weight,
    )
