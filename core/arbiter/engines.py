"""A generation cluster run by a deo engine pool: one engine per data-parallel rank, on that
rank's bundle, awake exactly while the arbiter has the rank active.

A cluster registered with ``engine_pool`` hands that pool to the arbiter: its policy no longer
sizes it. Each time the pool is reconciled (the arbiter shrank or expanded the cluster, an engine
confirmed a sleep or a wake, a worker exited), :func:`follow_ranks` compares every rank with its
engine and uses the engine pools' own sleep and wake (every transition in
:mod:`core.lifecycle`'s table):

- an active rank with no engine gets one started on its bundle; one asleep is woken; one going to
  sleep stays awake; a start or a wake waits while another worker holds the memory of a GPU of
  the bundle;
- an asleep rank's active engine goes to sleep (it leaves routing, then the sleep call; its
  memory is released when the engine confirms); one still starting is stopped (it would take
  memory the rank no longer has);
- an engine on no rank's bundle (the mapping changed, a second engine on one bundle) is stopped.

Engine-run clusters may share GPUs (generation time-shared between pipelines, as rlix does): the
arbiter gives each GPU to at most one active rank at a time, and that rank's engine starts or
wakes there only once every other engine there confirmed its sleep or exited. deo's invariant 1
holds throughout: one worker holds a GPU's memory, any number of asleep engines share it.

A sleep that fails the pool's ``control_attempts`` times stops the engine (its process, and
with it its memory, ends), as for any engine pool. Whoever answers a grant of GPUs that
generation held waits for the engines there to be asleep or gone (``deo run``'s API does).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from core import engines
from core.arbiter.model import Cluster
from core.lifecycle import WorkerState
from core.records import replace
from core.state import PoolState, State, Worker
from core.vocabulary import AlertName, StopCause

__all__ = ["AWAKE_OR_WAKING", "follow_ranks", "rank_engines", "stop_engines", "stop_outsiders"]

S = WorkerState


class RankStep(engines.EngineStep, Protocol):
    """What the rank rules use of a reducer step (:class:`core.step.Step` provides it): the
    engine rules' view, the state the step began from, spawning and crash-loop bookkeeping."""

    base: State

    def spawn(
        self,
        pool: PoolState,
        index: int,
        gpus: tuple[str, ...],
        port: int | None,
        attempt: int,
        why: str,
    ) -> None: ...
    def with_retries(
        self, pool: PoolState, retries: tuple[tuple[float, int], ...]
    ) -> PoolState: ...


#: Engines that hold (or are taking) their GPUs' memory.
AWAKE_OR_WAKING = frozenset(
    {S.REQUESTED, S.STARTING, S.ACTIVE, S.WAKING, S.GOING_TO_SLEEP, S.FALLING_ASLEEP}
)
#: States of an engine on its way out: not a rank's engine any more.
_LEAVING = frozenset({S.DRAINING, S.STOPPING, S.KILLED, S.EXITED})


def rank_engines(workers: list[Worker], cluster: Cluster) -> tuple[dict[int, Worker], list[Worker]]:
    """Each rank's engine (the lowest index on its bundle), and the engines on no rank."""
    spec = cluster.spec
    rank_of = {spec.bundle(r): r for r in range(spec.ranks)}
    found: dict[int, Worker] = {}
    strays: list[Worker] = []
    for worker in sorted(workers, key=lambda w: w.index):
        if worker.state in _LEAVING:
            continue
        rank = rank_of.get(worker.gpus)
        if rank is None or rank in found:
            strays.append(worker)
        else:
            found[rank] = worker
    return found, strays


def stop_engines(step: RankStep, pool: str, why: str) -> None:
    """Stop every engine of ``pool`` that is not on its way out already: the cluster it ran
    left (its pipeline unregistered), and the arbiter may give those GPUs to anyone now."""
    for worker in sorted(step.workers.values(), key=lambda w: w.index):
        if worker.pool == pool and worker.state not in _LEAVING:
            step.terminate(worker, StopCause.SCALE_DOWN, f"{why}: stopping {worker.worker_id}")


def stop_outsiders(step: RankStep, bound: Mapping[str, object]) -> None:
    """Stop every worker on the arbiter's GPUs of a pool no cluster of the arbiter runs
    (``bound``: the pools that do): those GPUs are its clusters' alone, and a training
    cluster's hold is no deo worker that would keep them free."""
    arbiter_gpus = set(step.base.arbiter.gpus)
    for worker in sorted(step.workers.values(), key=lambda w: w.worker_id):
        on = sorted(arbiter_gpus & set(worker.gpus))
        if worker.pool in bound or worker.state in _LEAVING or not on:
            continue
        why = f"GPU {','.join(on)} is the arbiter's: stopping {worker.worker_id}"
        step.terminate(worker, StopCause.SCALE_DOWN, why)


def follow_ranks(
    step: RankStep, pool: PoolState, pipeline: str, cluster: Cluster, free: list[str]
) -> None:
    """Bring ``pool``'s engines in line with ``cluster``'s active ranks; an engine is started or
    woken from its sleep only on a bundle whose GPUs are all in ``free`` (reconcile's list: no
    live worker holds their memory, healthy, not cordoned), which it takes from there. Asleep
    engines of other clusters may stay on those GPUs (tenants); an awake one is first put to
    sleep by its own cluster's ranks and confirms it before this rank's engine takes the GPU."""
    name = pool.spec.name
    spec = cluster.spec
    found, strays = rank_engines([w for w in step.workers.values() if w.pool == name], cluster)
    who = f"{pipeline}/{spec.name}"
    for worker in strays:
        step.terminate(
            worker,
            StopCause.SCALE_DOWN,
            f"{worker.worker_id} runs on no rank's bundle of {who}: stopping it",
        )
    wanted = [r for r in sorted(cluster.active_ranks) if r not in found]
    _start_engines(step, pool, who, [(r, spec.bundle(r)) for r in wanted], free)
    for rank in range(spec.ranks):
        engine = found.get(rank)
        if engine is None:
            continue
        if rank in cluster.active_ranks:
            why = f"the arbiter has {who} rank {rank} awake"
            if engine.state is S.GOING_TO_SLEEP:
                engines.wake_one(step, engine, why)  # it still holds its memory
            elif engine.state is S.SLEEPING and all(g in free for g in engine.gpus):
                for gpu in engine.gpus:
                    free.remove(gpu)
                engines.wake_one(step, engine, why)
            # Asleep on a GPU whose memory another worker holds (another cluster's engine on
            # its way to sleep, or a stopping worker): it wakes once that one released it.
            continue
        why = f"the arbiter put {who} rank {rank} to sleep"
        if engine.state is S.ACTIVE:
            engines.send_to_sleep(step, engine, why)
        elif engine.state in (S.REQUESTED, S.STARTING):
            step.terminate(engine, StopCause.SCALE_DOWN, f"{why}: stopping {engine.worker_id}")


def _start_engines(
    step: RankStep,
    pool: PoolState,
    who: str,
    ranks: list[tuple[int, tuple[str, ...]]],
    free: list[str],
) -> None:
    """Start an engine for each of ``ranks`` (active, engine-less; with their bundles) whose
    bundle is free, under
    the pool's crash-loop rules: a failed engine's slot waits for its backoff and its
    replacement carries the failures on (so the ``crash_loop`` alert is raised as for any
    pool)."""
    name = pool.spec.name
    rules = pool.spec.crash_loop
    retries = list(pool.retries)
    if len(retries) > len(ranks):
        # Fewer engines wanted: the slots dropped are the least failed ones.
        retries = sorted(retries, key=lambda retry: -retry[1])[: len(ranks)]
    due = [r for r in retries if r[0] + rules.backoff_s(r[1]) <= step.t]
    waiting = len(retries) - len(due)
    index = pool.next_index
    for rank, bundle in ranks:
        why = f"the arbiter has {who} rank {rank} awake"
        busy = [g for g in bundle if g not in free]
        if busy:
            # Another worker still holds it, or deo cordoned it: the rank waits (its pool is
            # reconciled again when that worker exits or the GPU is uncordoned).
            continue
        if not due and waiting:
            waiting -= 1  # a failed engine's slot waits for its backoff
            continue
        port = engines.free_port(step, pool.spec)
        if port is None:
            step.raise_alert(
                AlertName.NO_FREE_PORTS,
                name,
                f"{why}: every port of {pool.spec.ports} is held by a live engine",
            )
            break
        attempt = 0
        if due:
            retry = due.pop(0)
            retries.remove(retry)
            attempt = retry[1]
        for gpu in bundle:
            free.remove(gpu)
        step.spawn(step.pools[name], index, bundle, port, attempt, why)
        index += 1
    pool = step.pools[name]
    if tuple(retries) != pool.retries or index != pool.next_index:
        step.put_pool(step.with_retries(replace(pool, next_index=index), tuple(retries)))
