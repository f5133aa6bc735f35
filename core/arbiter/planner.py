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
of lower priority (no priority inversion, no shrink that serves nobody).

**Gap ratio.** Generation GPUs are shared among pipelines by their remaining work. Per pipeline
with a generation cluster, from the latest progress report of each stream ``i``
(``T_i = max(target_i, 1)``, ``remaining_i = T_i - clamp(completed_i, 0, T_i)``)::

    R = sum_i remaining_i            (remaining trajectories)
    w = R * tp                       (weight: GPUs scale with tensor-parallel size)
    rho = w / sum_p w_p              (share)
    B = idle GPUs usable by an eligible generation cluster + every active generation GPU

rlix sets ``target = max(floor(rho * B / tp + 0.5) * tp, tp)`` and then repeatedly wakes ONE
rank of the acceptor with the largest ``(rho - active / B) / rho``, on an idle bundle when there is
one, else by shrinking donors (pipelines above their target, each keeping ``max(1, target/tp)``
bundles). deo keeps the weights, the budget and the one-rank-at-a-time loop and changes the
targets and donors (:class:`GapRatioPlanner` lists how and why). A generation request is answered
only once one of its ranks is awake.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Protocol

import attrs

from core.arbiter.model import ArbiterState, ClusterSpec
from core.arbiter.plan import ClusterKey, GpuOp, Plan, RankOp, merge_rank_ops

__all__ = ["Demand", "GapRatioPlanner", "Planner", "RlixPlanner", "Share"]


class Planner(Protocol):
    """What the reducer asks of a planner."""

    @property
    def name(self) -> str:
        """A short name for alerts and benchmark tables."""
        ...

    def plan(self, state: ArbiterState) -> Plan:
        """The grants, shrinks and expansions to make now (frees are the reducer's)."""
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
        self.usable = state.usable()
        self.idle = set(state.idle)
        self.specs: dict[ClusterKey, ClusterSpec] = {}
        self.holder: dict[str, ClusterKey] = {}
        self.awake: dict[str, tuple[ClusterKey, int]] = {}
        self.active: dict[ClusterKey, set[int]] = {}
        self.shrinks: list[RankOp] = []
        self.expands: list[RankOp] = []
        self.grants: list[GpuOp] = []
        #: Ranks put to sleep in this plan: not woken again in the same plan.
        self.slept: set[tuple[ClusterKey, int]] = set()
        for pipeline_id, cluster in state.clusters():
            key = (pipeline_id, cluster.spec.name)
            self.specs[key] = cluster.spec
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


def _priorities(board: _Board, shrink_when_blocked: bool) -> None:
    """Serve waiting non-generation requests in priority order (see the module's docstring)."""
    waiting = sorted(
        (cluster.request.priority, cluster.request.seq, (pipeline_id, cluster.spec.name))
        for pipeline_id, cluster in board.state.clusters()
        if cluster.request is not None and not cluster.spec.is_generation
    )
    reserved: dict[str, ClusterKey] = {}
    for priority, _, key in waiting:
        mapping = board.specs[key].device_mapping
        held_by = {board.holder[g] for g in mapping if g in board.holder} - {key}
        blocked = bool(held_by) or any(g in reserved for g in mapping)
        # A request blocked only by its own pipeline's clusters waits for that pipeline to
        # release (release-then-request); it reserves nothing, so that a pipeline that never
        # releases cannot hold up everyone queued behind it.
        reserves = blocked and not (
            {p for p, _ in held_by} == {key[0]} and not any(g in reserved for g in mapping)
        )
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
        board.grant(key, f"{why}: granted")


def _remaining(state: ArbiterState, pipeline_id: str) -> int | None:
    """R from the latest progress reports, or None with no report."""
    progress = state.pipelines[pipeline_id].progress
    if not progress:
        return None
    return sum(p.remaining for p in progress.values())


@attrs.frozen(slots=True)
class GapRatioPlanner:
    """deo's planner: rlix's gap ratio with its known flaws fixed.

    - Demand is durable and counted once: an open rollout or a waiting request makes a pipeline
      eligible (so a pipeline preempted to zero competes before it reports again), and adds no
      ``R += T`` boost (rlix's boost double-counts the rollout).
    - A request with no progress and no estimate counts as one trajectory (rlix skips it, so it
      waits forever); a waiting request always counts at least one.
    - A pipeline awake with no demand is a donor with target 0 (rlix does not see it, so its GPUs
      can never be reclaimed); its ranks stay awake until someone needs them.
    - Targets are apportioned in bundles and sum to at most the budget: first one bundle to each
      eligible pipeline with work left (most remaining work first, while bundles last), then one
      bundle at a time to the pipeline furthest below ``rho * B``; a target never exceeds the
      ranks the cluster can place (``max_dp_size``, lost or held GPUs) (rlix's targets can sum past
      the budget, and give a bundle to pipelines with nothing left).
    - Donors are pipelines above their target; a donor never goes below it. Among bundles to
      wake, an idle one wins, then the one whose donors have the least remaining work (protect
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

    def shares(self, state: ArbiterState) -> dict[ClusterKey, Share]:
        """Each generation cluster's demand, target and awake GPUs as this planner sees ``state``
        (for ``deo status`` and metrics; targets are those of the next plan)."""
        board = _Board(state)
        _priorities(board, shrink_when_blocked=False)
        demand = self.demand(state)
        eligible = sorted(k for k, d in demand.items() if d.eligible)
        remaining = {k: demand[k].remaining for k in demand}
        probes = {k for k in eligible if demand[k].probe}
        targets = self._targets(board, eligible, remaining, probes) if eligible else {}
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
        _priorities(board, shrink_when_blocked=False)
        demand = self.demand(state)
        eligible = sorted(k for k, d in demand.items() if d.eligible)
        if not eligible:
            return board.result()
        remaining = {k: demand[k].remaining for k in demand}
        probes = {k for k in eligible if demand[k].probe}
        targets = self._targets(board, eligible, remaining, probes)
        stuck: set[ClusterKey] = set()
        while True:
            acceptors = _acceptors(board, eligible, targets, stuck)
            if not acceptors:
                break
            key = min(
                acceptors,
                key=lambda k: (-(targets[k] - board.active_gpus(k)) / targets[k], -remaining[k], k),
            )
            if not self._wake_one(board, key, targets, remaining):
                stuck.add(key)
        self._fill_idle(board, eligible, remaining, probes)
        return board.result()

    def _fill_idle(
        self,
        board: _Board,
        eligible: list[ClusterKey],
        remaining: dict[ClusterKey, int],
        probes: set[ClusterKey],
    ) -> None:
        """Idle bundles that no target could use go to eligible pipelines that can place them,
        most remaining work first (targets are shares of a budget, and a share may sit where
        its owner cannot place it: nothing waits while its own GPUs are idle)."""
        for key in sorted(eligible, key=lambda k: (-remaining[k], k)):
            spec = board.specs[key]
            limit = 1 if key in probes else spec.dp_limit
            for rank in range(spec.ranks):
                if len(board.active[key]) >= limit:
                    break
                if rank in board.active[key] or not board.placeable(key, rank):
                    continue
                if all(g in board.idle for g in spec.bundle(rank)):
                    board.expand(
                        key,
                        rank,
                        f"{_name(key)} takes idle GPUs no other pipeline's target can use"
                        f" ({remaining[key]} trajectories remaining)",
                    )

    def _targets(
        self,
        board: _Board,
        eligible: list[ClusterKey],
        remaining: dict[ClusterKey, int],
        probes: set[ClusterKey],
    ) -> dict[ClusterKey, int]:
        usable_for_generation = {g for k in eligible for g in board.specs[k].device_mapping}
        budget = len(board.idle & usable_for_generation) + len(board.awake)
        weight = {k: remaining[k] * board.specs[k].tp_size for k in eligible}
        total = sum(weight.values())
        share = {k: budget * weight[k] / total for k in eligible}
        cap = {
            k: min(
                board.specs[k].dp_limit,
                sum(1 for r in range(board.specs[k].ranks) if board.placeable(k, r)),
                1 if k in probes else board.specs[k].ranks,
            )
            * board.specs[k].tp_size
            for k in eligible
        }
        targets = dict.fromkeys(board.specs, 0)
        left = budget
        for k in sorted(eligible, key=lambda k: (-remaining[k], k)):
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
            k = min(open_, key=lambda k: (-(share[k] - targets[k]), -remaining[k], k))
            targets[k] += board.specs[k].tp_size
            left -= board.specs[k].tp_size

    def _wake_one(
        self,
        board: _Board,
        key: ClusterKey,
        targets: dict[ClusterKey, int],
        remaining: dict[ClusterKey, int],
    ) -> bool:
        spec = board.specs[key]
        best: tuple[tuple[int, int, int, int], int, list[tuple[ClusterKey, int]]] | None = None
        for rank in range(spec.ranks):
            if rank in board.active[key] or not board.placeable(key, rank):
                continue
            donors = sorted({board.awake[g] for g in spec.bundle(rank) if g in board.awake})
            taken: dict[ClusterKey, int] = {}
            for donor, _ in donors:
                taken[donor] = taken.get(donor, 0) + board.specs[donor].tp_size
            if any(
                d == key or board.active_gpus(d) - n < targets.get(d, 0) for d, n in taken.items()
            ):
                continue
            score = (
                1 if donors else 0,
                sum(remaining.get(d, 0) for d in taken),
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
                f" and gives GPUs to {_name(key)}",
            )
        source = f"from {', '.join(_name(d) for d, _ in donors)}" if donors else "on idle GPUs"
        board.expand(
            key,
            rank,
            f"gap ratio: {_name(key)} is below its target of {targets[key]} GPUs"
            f" ({remaining[key]} trajectories remaining); woken {source}",
        )
        return True


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
        _priorities(board, shrink_when_blocked=True)
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
