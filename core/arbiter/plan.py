"""A plan: everything one arbiter step changes in GPU ownership, as lists of operations.

The reducer builds one plan per event (the event's own frees and removals, then the planner's
grants, shrinks and expansions), checks it with :func:`core.arbiter.invariants.plan_violations`
and only then applies it with :func:`apply_plan` and turns it into commands. Operations apply in
the order frees, shrinks, removals, grants, expansions.
"""

from __future__ import annotations

from collections.abc import Iterable

import attrs

from core.arbiter.model import HOLDS_KEPT, ArbiterState, Cluster, Pipeline

__all__ = ["ClusterKey", "GpuOp", "Plan", "RankOp", "apply_plan", "merge_rank_ops"]

#: (pipeline id, cluster name)
ClusterKey = tuple[str, str]


@attrs.frozen(slots=True, kw_only=True)
class GpuOp:
    """A cluster gives back (a free) or receives (a grant) ``gpus``."""

    pipeline: str
    cluster: str
    gpus: tuple[str, ...]
    reason: str

    @property
    def key(self) -> ClusterKey:
        return (self.pipeline, self.cluster)


@attrs.frozen(slots=True, kw_only=True)
class RankOp:
    """Generation ``ranks`` of a cluster go to sleep (a shrink) or wake (an expansion)."""

    pipeline: str
    cluster: str
    ranks: tuple[int, ...]
    reason: str

    @property
    def key(self) -> ClusterKey:
        return (self.pipeline, self.cluster)


@attrs.frozen(slots=True, kw_only=True)
class Plan:
    """One step's ownership changes; ``removed`` lists clusters of pipelines that leave."""

    frees: tuple[GpuOp, ...] = ()
    shrinks: tuple[RankOp, ...] = ()
    removed: tuple[ClusterKey, ...] = ()
    grants: tuple[GpuOp, ...] = ()
    expands: tuple[RankOp, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.frees or self.shrinks or self.removed or self.grants or self.expands)

    def then(self, other: Plan) -> Plan:
        """This plan followed by ``other`` in the same step, with the rank operations of each
        cluster merged into one (each cluster appears once per list)."""
        return Plan(
            frees=self.frees + other.frees,
            shrinks=merge_rank_ops(self.shrinks + other.shrinks),
            removed=self.removed + other.removed,
            grants=self.grants + other.grants,
            expands=merge_rank_ops(self.expands + other.expands),
        )


def merge_rank_ops(ops: Iterable[RankOp]) -> tuple[RankOp, ...]:
    """One operation per cluster, its ranks sorted, its reasons joined (first-seen order)."""
    merged: dict[ClusterKey, RankOp] = {}
    for op in ops:
        seen = merged.get(op.key)
        if seen is None:
            merged[op.key] = attrs.evolve(op, ranks=tuple(sorted(op.ranks)))
            continue
        reasons = (
            seen.reason if op.reason in seen.reason.split("; ") else f"{seen.reason}; {op.reason}"
        )
        merged[op.key] = attrs.evolve(
            seen, ranks=tuple(sorted({*seen.ranks, *op.ranks})), reason=reasons
        )
    return tuple(merged.values())


def _with_cluster(state: ArbiterState, key: ClusterKey, cluster: Cluster) -> ArbiterState:
    pipeline = state.pipelines[key[0]]
    clusters = {**pipeline.clusters, key[1]: cluster}
    pipelines = {**state.pipelines, key[0]: attrs.evolve(pipeline, clusters=clusters)}
    return attrs.evolve(state, pipelines=pipelines)


def _cluster(state: ArbiterState, key: ClusterKey) -> Cluster | None:
    pipeline: Pipeline | None = state.pipelines.get(key[0])
    return None if pipeline is None else pipeline.clusters.get(key[1])


def _gpu_time_counted(state: ArbiterState, key: ClusterKey) -> ArbiterState:
    """``state`` with the awake GPU-seconds of ``key``'s pipeline counted up to now, before its
    generation's ranks change."""
    pipeline = state.pipelines.get(key[0])
    if pipeline is None:
        return state
    counted = pipeline.gpu_time_counted(state.now)
    if counted is pipeline:
        return state
    return attrs.evolve(state, pipelines={**state.pipelines, key[0]: counted})


def apply_plan(state: ArbiterState, plan: Plan) -> ArbiterState:
    """``state`` with ``plan`` carried out. Operations naming a cluster that does not exist are
    skipped (the plan checks report them); ``idle`` is updated operation by operation, so the
    checks can compare it with what the clusters hold."""
    usable = state.usable()
    idle = set(state.idle)
    for op in plan.frees:
        cluster = _cluster(state, op.key)
        if cluster is not None:
            holds_s = cluster.holds_s
            if cluster.held_t is not None:
                holds_s = (*holds_s, state.now - cluster.held_t)[-HOLDS_KEPT:]
            freed = attrs.evolve(cluster, held=(), held_t=None, holds_s=holds_s)
            state = _with_cluster(state, op.key, freed)
            idle |= set(op.gpus) & usable
    for rank_op in plan.shrinks:
        state = _gpu_time_counted(state, rank_op.key)
        cluster = _cluster(state, rank_op.key)
        if cluster is not None:
            state = _with_cluster(
                state,
                rank_op.key,
                attrs.evolve(cluster, active_ranks=cluster.active_ranks - set(rank_op.ranks)),
            )
            idle |= {g for r in rank_op.ranks for g in cluster.spec.bundle(r)} & usable
    gone = {pipeline_id for pipeline_id, _ in plan.removed}
    if gone:
        kept = {p: v for p, v in state.pipelines.items() if p not in gone}
        state = attrs.evolve(state, pipelines=kept)
    for op in plan.grants:
        cluster = _cluster(state, op.key)
        if cluster is not None:
            state = _with_cluster(
                state, op.key, attrs.evolve(cluster, held=op.gpus, held_t=state.now)
            )
            idle -= set(op.gpus)
    for rank_op in plan.expands:
        state = _gpu_time_counted(state, rank_op.key)
        cluster = _cluster(state, rank_op.key)
        if cluster is not None:
            state = _with_cluster(
                state,
                rank_op.key,
                attrs.evolve(cluster, active_ranks=cluster.active_ranks | set(rank_op.ranks)),
            )
            idle -= {g for r in rank_op.ranks for g in cluster.spec.bundle(r)}
    return attrs.evolve(state, idle=frozenset(idle))
