"""The arbiter's plan checks: rlix's eleven plan invariants, and one of deo's.

:func:`plan_violations` checks a :class:`~core.arbiter.plan.Plan` against the state it is meant
for, before anything of it runs, and returns one message per violation, each starting with its
number (empty when the plan is sound). The reducer refuses a plan with any violation: the state
stays as it was and an alert carries the messages.

1. Each cluster appears at most once per operation list.
2. Only generation clusters are shrunk or expanded; only other clusters are granted or freed.
3. Nothing is allocated (granted, expanded) to a cluster that is removed in the same plan.
4. Idle and allocated GPUs are disjoint.
5. A shrink names only active ranks, an expansion only inactive ones (and no rank both).
6. GPUs lie within the cluster's device mapping: a grant is the whole mapping, a freed GPU is
   one the cluster held, an expanded rank exists and its bundle is exactly ``tp_size`` GPUs of
   the mapping.
7. A generation cluster's active ranks are at most its ``max_dp_size``.
8. Conservation: idle + allocated = every usable (not lost) GPU.
9. No double free: a GPU is freed at most once, and only by the cluster that holds it.
10. No GPU is owned twice: at most one memory-exclusive holder or one active rank per GPU (an
    asleep rank may share a holder's GPU); no rank appears twice.
11. Removed, shrunk and expanded clusters exist.
12. (deo) Nothing is granted or woken on a lost GPU.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from core.arbiter.model import ArbiterState, Cluster
from core.arbiter.plan import ClusterKey, GpuOp, Plan, RankOp, apply_plan

__all__ = ["ALL_CHECKS", "plan_violations", "state_violations"]

#: The numbers of the checks, for tests and docs.
ALL_CHECKS = tuple(range(1, 13))


def _cluster(state: ArbiterState, key: ClusterKey) -> Cluster | None:
    pipeline = state.pipelines.get(key[0])
    return None if pipeline is None else pipeline.clusters.get(key[1])


def _name(key: ClusterKey) -> str:
    return f"{key[0]}/{key[1]}"


def _once_per_list(plan: Plan) -> list[str]:
    found = []
    lists: tuple[tuple[str, Iterable[GpuOp | RankOp]], ...] = (
        ("frees", plan.frees),
        ("shrinks", plan.shrinks),
        ("grants", plan.grants),
        ("expands", plan.expands),
    )
    for label, ops in lists:
        for key, count in Counter(op.key for op in ops).items():
            if count > 1:
                found.append(f"1: cluster {_name(key)} appears {count} times in {label}")
    for key, count in Counter(plan.removed).items():
        if count > 1:
            found.append(f"1: cluster {_name(key)} appears {count} times in removed")
    return found


def state_violations(state: ArbiterState) -> list[str]:
    """What must hold of any arbiter state (checks 4, 7, 8 and 10)."""
    found: list[str] = []
    usable = state.usable()
    holders: Counter[str] = Counter()
    awake: Counter[str] = Counter()
    for pipeline_id, cluster in state.clusters():
        key = (pipeline_id, cluster.spec.name)
        holders.update(cluster.held)
        awake.update(cluster.active_gpus())
        if len(cluster.active_ranks) > cluster.spec.dp_limit:
            found.append(
                f"7: {_name(key)} has {len(cluster.active_ranks)} active ranks, more than its"
                f" limit {cluster.spec.dp_limit}"
            )
    allocated = {g for g in holders} | {g for g in awake}
    both = sorted(state.idle & allocated)
    if both:
        found.append(f"4: GPUs both idle and allocated: {both}")
    missing = sorted(usable - state.idle - allocated)
    extra = sorted(state.idle - usable)
    if missing or extra:
        found.append(
            f"8: idle + allocated != usable GPUs (unaccounted: {missing}, idle but not usable:"
            f" {extra})"
        )
    for gpu in sorted(allocated):
        if holders[gpu] > 1:
            found.append(f"10: GPU {gpu} held by {holders[gpu]} clusters")
        if awake[gpu] > 1:
            found.append(f"10: GPU {gpu} used by {awake[gpu]} active ranks")
        if holders[gpu] and awake[gpu]:
            found.append(f"10: GPU {gpu} held memory-exclusively and used by an active rank")
    return found


def plan_violations(state: ArbiterState, plan: Plan) -> list[str]:
    """Every check ``plan`` fails against ``state``, the state it is meant for."""
    found = _once_per_list(plan)
    removed = set(plan.removed)
    usable = state.usable()
    for key in plan.removed:
        if _cluster(state, key) is None:
            found.append(f"11: removed cluster {_name(key)} does not exist")
    # Frees and grants: non-generation clusters and their own GPUs.
    freed: Counter[str] = Counter()
    for op in plan.frees:
        cluster = _cluster(state, op.key)
        freed.update(op.gpus)
        if cluster is None:
            found.append(f"11: freed cluster {_name(op.key)} does not exist")
            continue
        if cluster.spec.is_generation:
            found.append(f"2: generation cluster {_name(op.key)} freed (it shrinks instead)")
        not_held = sorted(set(op.gpus) - set(cluster.held))
        if not_held:
            found.append(f"9: {_name(op.key)} frees GPUs it does not hold: {not_held}")
    for gpu, count in sorted(freed.items()):
        if count > 1:
            found.append(f"9: GPU {gpu} freed {count} times")
    for op in plan.grants:
        cluster = _cluster(state, op.key)
        if op.key in removed:
            found.append(f"3: {_name(op.key)} granted and removed in one plan")
        if cluster is None:
            found.append(f"11: granted cluster {_name(op.key)} does not exist")
            continue
        if cluster.spec.is_generation:
            found.append(f"2: generation cluster {_name(op.key)} granted (it expands instead)")
        if sorted(op.gpus) != sorted(cluster.spec.device_mapping):
            found.append(
                f"6: {_name(op.key)} granted {list(op.gpus)}, not its device mapping"
                f" {list(cluster.spec.device_mapping)}"
            )
        if set(op.gpus) - usable:
            found.append(f"12: {_name(op.key)} granted lost GPUs {sorted(set(op.gpus) - usable)}")
    # Shrinks and expansions: generation clusters and their own ranks.
    shrunk: dict[ClusterKey, set[int]] = {}
    for label, ops in (("shrunk", plan.shrinks), ("expanded", plan.expands)):
        for rank_op in ops:
            cluster = _cluster(state, rank_op.key)
            if cluster is None:
                found.append(f"11: {label} cluster {_name(rank_op.key)} does not exist")
                continue
            if not cluster.spec.is_generation:
                found.append(f"2: {label} cluster {_name(rank_op.key)} is not a generation cluster")
                continue
            for rank, count in Counter(rank_op.ranks).items():
                if count > 1:
                    found.append(f"10: rank {rank} of {_name(rank_op.key)} {label} twice")
            ranks = set(rank_op.ranks)
            if label == "shrunk":
                shrunk[rank_op.key] = ranks
                inactive = sorted(ranks - cluster.active_ranks)
                if inactive:
                    found.append(f"5: {_name(rank_op.key)} shrinks inactive ranks {inactive}")
                continue
            if rank_op.key in removed:
                found.append(f"3: {_name(rank_op.key)} expanded and removed in one plan")
            active = sorted(ranks & cluster.active_ranks)
            if active:
                found.append(f"5: {_name(rank_op.key)} expands active ranks {active}")
            both = sorted(ranks & shrunk.get(rank_op.key, set()))
            if both:
                found.append(f"5: {_name(rank_op.key)} shrinks and expands ranks {both}")
            for rank in sorted(ranks):
                bundle = cluster.spec.bundle(rank)
                if len(bundle) != cluster.spec.tp_size or not set(bundle) <= set(
                    cluster.spec.device_mapping
                ):
                    found.append(
                        f"6: rank {rank} of {_name(rank_op.key)} has no bundle of"
                        f" {cluster.spec.tp_size} GPUs in its mapping"
                    )
                elif set(bundle) - usable:
                    found.append(
                        f"12: rank {rank} of {_name(rank_op.key)} woken on lost GPUs"
                        f" {sorted(set(bundle) - usable)}"
                    )
    return found + state_violations(apply_plan(state, plan))
