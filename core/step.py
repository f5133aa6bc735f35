"""The workspace of one reducer step: a copy-on-write view of the state and the helpers every
handler shares (transitions, drains, exits, reconciliation, scaling, cordons).

``Step`` copies each collection of the state before its first write, so the state a step started
from is never touched and an event that raises leaves nothing half-applied. ``finish`` reconciles
the pools the event may have affected (spawn up to each target, drain the excess) and returns the
new state, whose collections are read-only views of the step's copies, with the commands.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import Any

from core import commands as c
from core import drains, engines
from core import events as e
from core.arbiter.engines import follow_ranks
from core.config import AUTO, VLLM_DEV_MODE_ENV, CrashLoopRules, PoolSpec, node_of
from core.errors import UnknownSubject
from core.lifecycle import COUNTED, LEAVING, Trigger, WorkerState, next_state
from core.policies import BUILT_INS, POLICY_ALERTS, Policy, PolicyCatalog, PolicyContext
from core.records import replace
from core.state import (
    Gpu,
    HeldChange,
    PoolState,
    State,
    Worker,
    next_index_in,
    split_worker_id,
)
from core.vocabulary import (
    COUNTED_AT_STOP,
    PLANNED_STOPS,
    STICKY_CAUSES,
    AlertName,
    DecisionSource,
    StopCause,
)

__all__ = [
    "STALL_FACTOR",
    "STARTING_STATES",
    "Step",
    "retry_order",
    "take_gpus",
    "unobserved_s",
]

S = WorkerState

#: States of a worker that is starting: requested, or started but not yet ready.
STARTING_STATES = frozenset({S.REQUESTED, S.STARTING})

#: A tick later than this many intervals after the previous one follows a stall of deo itself.
STALL_FACTOR = 2.0


def unobserved_s(last_tick_t: float | None, t: float, interval_s: float | None) -> float:
    """How long deo was not observing before a tick at ``t``: 0 unless it comes more than
    :data:`STALL_FACTOR` intervals after the previous tick; then the gap less one interval (the
    time a tick on schedule would have covered)."""
    if interval_s is None or last_tick_t is None:
        return 0.0
    gap = t - last_tick_t
    return gap - interval_s if gap > STALL_FACTOR * interval_s else 0.0


def retry_order(
    retries: Iterable[tuple[float, int]], rules: CrashLoopRules
) -> tuple[tuple[float, int], ...]:
    """Failed slots (failure time, failures in a row) in the order their replacements may
    start: the earliest first, the most failed first among equals."""
    return tuple(sorted(retries, key=lambda r: (r[0] + rules.backoff_s(r[1]), -r[1])))


def take_gpus(free: list[str], count: int) -> tuple[str, ...] | None:
    """Take ``count`` GPUs of one node from ``free`` (in its order; the first node that has
    enough), removing them; None (``free`` untouched) if no node has that many free.

    A worker's GPUs must share a machine: a process sees only its own node's devices."""
    if count <= 0:
        return ()
    by_node: dict[str, list[int]] = {}
    for position, gpu_id in enumerate(free):
        positions = by_node.setdefault(node_of(gpu_id), [])
        positions.append(position)
        if len(positions) == count:
            taken = tuple(free[p] for p in positions)
            for p in reversed(positions):
                del free[p]
            return taken
    return None


class Step:
    """The mutable workspace of one step; copies each collection before its first write.

    ``policies`` builds the pools' policies by name (those already built for a pool's spec are
    kept in its state).
    """

    def __init__(self, state: State, t: float, policies: PolicyCatalog = BUILT_INS) -> None:
        self.base = state
        self.policies = policies
        # Time never goes backwards: a late event is taken at the current time.
        self.t = max(state.now, t)
        self.config = state.config
        self.pools: Mapping[str, PoolState] = state.pools
        self.workers: Mapping[str, Worker] = state.workers
        self.gpus: Mapping[str, Gpu] = state.gpus
        self.last_seen: Mapping[str, float] = state.last_seen
        self.removed_next_index: Mapping[str, int] = state.removed_next_index
        self.worker_counts: Mapping[str, tuple[int, int]] = state.worker_counts
        self.paused_all = state.paused_all
        self.last_tick_t = state.last_tick_t
        self.last_tick_skipped = state.last_tick_skipped
        self.alerts = state.alerts
        self.commands: list[c.Command] = []
        self._owned: set[str] = set()
        self.dirty_pools: set[str] = set()

    # --- copy-on-write ---------------------------------------------------------------------------

    def _own(self, name: str) -> Any:
        """The step's private copy of the collection ``name``, made on the first call."""
        if name not in self._owned:
            setattr(self, name, getattr(self, name).copy())  # the view's copy: a plain dict
            self._owned.add(name)
        return getattr(self, name)

    def _count(self, worker: Worker, delta: int) -> None:
        """Add (or with -1 take away) ``worker``'s part of its pool's worker counts."""
        if worker.state not in COUNTED:
            return
        counts = self._own("worker_counts")
        counted, active = counts.get(worker.pool, (0, 0))
        counted += delta
        if counted:
            counts[worker.pool] = (counted, active + delta * (worker.state is S.ACTIVE))
        else:
            del counts[worker.pool]

    def put_worker(self, worker: Worker) -> None:
        workers = self._own("workers")
        old = workers.get(worker.worker_id)
        workers[worker.worker_id] = worker
        if old is None or old.state is not worker.state:
            if old is not None:
                self._count(old, -1)
            self._count(worker, 1)

    def drop_worker(self, worker_id: str) -> None:
        self._count(self._own("workers").pop(worker_id), -1)
        if worker_id in self.last_seen:
            del self._own("last_seen")[worker_id]

    def seen(self, worker_id: str) -> None:
        self._own("last_seen")[worker_id] = self.t

    def put_pool(self, pool: PoolState) -> None:
        self._own("pools")[pool.spec.name] = pool

    def put_gpu(self, gpu: Gpu) -> None:
        self._own("gpus")[gpu.gpu_id] = gpu

    def finish(self) -> tuple[State, list[c.Command]]:
        """Reconcile the dirty pools; the new state, its collections read-only, and the commands.

        The step must not be used afterwards: the state's views show its copies.
        """
        if self.dirty_pools:
            bound = self.base.arbiter.engine_pools() if self.base.arbiter.pipelines else {}
            if not self.dirty_pools.isdisjoint(bound):
                # An engine of one may have released GPUs another's rank waits for (engine-run
                # clusters may share GPUs): every one follows its ranks again.
                self.dirty_pools.update(n for n in bound if n in self.pools)
            self.reconcile(sorted(self.dirty_pools))
        owned = self._owned
        state = replace(
            self.base,
            now=self.t,
            config=self.config,
            pools=MappingProxyType(self.pools) if "pools" in owned else self.pools,
            workers=MappingProxyType(self.workers) if "workers" in owned else self.workers,
            gpus=MappingProxyType(self.gpus) if "gpus" in owned else self.gpus,
            last_seen=MappingProxyType(self.last_seen) if "last_seen" in owned else self.last_seen,
            removed_next_index=(
                MappingProxyType(self.removed_next_index)
                if "removed_next_index" in owned
                else self.removed_next_index
            ),
            worker_counts=(
                MappingProxyType(self.worker_counts)
                if "worker_counts" in owned
                else self.worker_counts
            ),
            paused_all=self.paused_all,
            last_tick_t=self.last_tick_t,
            last_tick_skipped=self.last_tick_skipped,
            alerts=self.alerts,
        )
        return state, self.commands

    # --- lookups ---------------------------------------------------------------------------------

    def pool(self, name: str, event: e.Event) -> PoolState:
        pool = self.pools.get(name)
        if pool is None:
            known = ", ".join(sorted(self.pools)) or "none declared"
            raise UnknownSubject(f"{type(event).__name__}: unknown pool {name!r} (pools: {known})")
        return pool

    def worker(self, worker_id: str, event: e.Event) -> Worker | None:
        """The live worker, None if it already exited (a late report), or an error if unknown."""
        worker = self.workers.get(worker_id)
        if worker is not None:
            return worker
        parsed = split_worker_id(worker_id)
        if parsed is not None:
            next_index = next_index_in(self.pools, self.removed_next_index, parsed[0])
            if next_index is not None and parsed[1] < next_index:
                return None
        raise UnknownSubject(f"{type(event).__name__}: unknown worker {worker_id!r}")

    def forget_pool(self, pool: PoolState) -> None:
        """Remove ``pool`` (removed from the configuration, its last worker gone), keeping the
        index its next worker would have had."""
        name = pool.spec.name
        del self._own("pools")[name]
        self._own("removed_next_index")[name] = pool.next_index
        self.dirty_pools.discard(name)
        self.resolve_pool_alerts(name, "pool removed")

    def declare_pool(self, spec: PoolSpec) -> PoolState:
        """A new pool's state: numbering its workers on from a pool of that name removed before."""
        next_index = self.removed_next_index.get(spec.name, 0)
        if spec.name in self.removed_next_index:
            del self._own("removed_next_index")[spec.name]
        return PoolState(spec=spec, desired=0, next_index=next_index)

    def gpu(self, gpu_id: str, event: e.Event) -> Gpu:
        gpu = self.gpus.get(gpu_id)
        if gpu is None:
            known = ", ".join(self.gpus) or "none declared"
            raise UnknownSubject(f"{type(event).__name__}: unknown GPU {gpu_id!r} (GPUs: {known})")
        return gpu

    # --- alerts ----------------------------------------------------------------------------------

    def raise_alert(self, alert: AlertName, subject: str, reason: str) -> None:
        if (alert, subject) not in self.alerts:
            self.alerts = self.alerts | {(alert, subject)}
            self.commands.append(c.RaiseAlert(alert=alert, subject=subject, reason=reason))

    def resolve_alert(self, alert: AlertName, subject: str, reason: str) -> None:
        if (alert, subject) in self.alerts:
            self.alerts = self.alerts - {(alert, subject)}
            self.commands.append(c.ResolveAlert(alert=alert, subject=subject, reason=reason))

    # --- worker transitions ----------------------------------------------------------------------

    def transition(self, worker: Worker, trigger: Trigger, **changes: Any) -> Worker:
        """``worker`` after ``trigger``, with ``changes``; an exited worker is forgotten.

        The lifecycle table decides the state: :class:`~core.errors.IllegalTransition` if it has
        no row for the worker's state and ``trigger``, and nothing is changed.
        """
        state = next_state(worker.worker_id, worker.state, trigger)
        if state is S.EXITED:
            self.drop_worker(worker.worker_id)
            return replace(worker, state=state, **changes)
        if state is worker.state and not changes:
            return worker  # a row that keeps the state (a late READY) leaves nothing to record
        if (worker.state is S.ACTIVE) is not (state is S.ACTIVE):
            # An engine's in-flight count holds only for the routing it was taken under: one
            # taken while it was routed is stale once it leaves (the router may have sent it more
            # since), and one from before it was routed again says nothing of what it is sent.
            changes.setdefault("in_flight_requests", None)
        updated = replace(worker, state=state, **changes)
        self.put_worker(updated)
        return updated

    def came_up(self, worker: Worker) -> None:
        """``worker`` is no longer starting: its pool, if short of its target, may start more
        (at most ``max_starting`` start at once)."""
        pool = self.pools[worker.pool]
        if self.worker_counts.get(worker.pool, (0, 0))[0] < pool.target:
            self.dirty_pools.add(worker.pool)

    def drain(self, worker: Worker, cause: StopCause, why: str) -> None:
        pool = self.pools[worker.pool]
        spec = pool.spec
        timeout_s, timeout_why = drains.drain_timeout(spec, pool.drains)
        if spec.drain_timeout_s == AUTO:
            # Fixed deadlines keep the reasons older logs recorded.
            why = f"{why}; drain deadline {timeout_s:g}s ({timeout_why})"
        deadline = self.t + timeout_s
        started = self.t if worker.pid is not None else None
        worker = self.transition(
            worker,
            Trigger.DRAIN,
            deadline_t=deadline,
            stop_cause=cause,
            drain_started_t=started,
            drain_deadline_s=timeout_s,
            drain_measured=drains.is_measured(spec, pool.drains),
        )
        self.signal_drain(worker, why)
        self.dirty_pools.add(worker.pool)
        if spec.is_engine and worker.in_flight_requests == 0:
            # A count reported after the engine left routing (a drain of one going to sleep).
            engines.drain_done(self, worker)

    def signal_drain(self, worker: Worker, why: str) -> None:
        """Send a draining worker its pool's drain signal, with the deadline it already has (an
        engine gets no signal: it leaves routing and stops once nothing is in flight)."""
        assert worker.deadline_t is not None, worker
        if self.pools[worker.pool].spec.is_engine:
            self.commands.append(
                c.DrainEngine(worker_id=worker.worker_id, deadline_t=worker.deadline_t, reason=why)
            )
            return
        self.commands.append(
            c.DrainWorker(
                worker_id=worker.worker_id,
                pid=worker.pid,
                signal=self.pools[worker.pool].spec.drain_signal,
                deadline_t=worker.deadline_t,
                reason=why,
            )
        )

    def measure_drain(self, worker: Worker, cut: bool) -> None:
        """A drain of a worker pool's worker ended: by its exit, or ``cut`` at its deadline; its
        pool keeps how long it ran (the drains an ``"auto"`` deadline is measured from).

        A drain counts at most the length it was allowed: a tick that escalates late (deo was
        stalled or down) or an exit seen only after the deadline says nothing of how much
        longer the drain would have taken, only that it took its whole deadline."""
        pool = self.pools.get(worker.pool)
        if (
            pool is None
            or worker.state is not S.DRAINING
            or worker.drain_started_t is None
            or pool.spec.is_engine
        ):
            return
        assert worker.deadline_t is not None, worker
        seconds = max(min(self.t, worker.deadline_t) - worker.drain_started_t, 0.0)
        self.put_pool(replace(pool, drains=drains.with_drain(pool.drains, seconds, cut)))

    def terminate(self, worker: Worker, cause: StopCause, why: str) -> None:
        """SIGTERM, with the pool's stop deadline; a draining worker keeps its drain's cause."""
        spec = self.pools[worker.pool].spec
        deadline = self.t + spec.stop_timeout_s
        self.transition(
            worker,
            Trigger.TERMINATE,
            deadline_t=deadline,
            stop_cause=worker.stop_cause if worker.state is S.DRAINING else cause,
        )
        self.commands.append(
            c.TerminateWorker(
                worker_id=worker.worker_id, pid=worker.pid, deadline_t=deadline, reason=why
            )
        )
        self.dirty_pools.add(worker.pool)

    def exit_worker(
        self, worker: Worker, *, failure: bool, why: str, trigger: Trigger = Trigger.EXIT
    ) -> None:
        """The worker is gone (``trigger`` leads to EXITED): free its GPUs, count a failure if it
        was one, let the pool react."""
        if trigger is Trigger.EXIT:
            self.measure_drain(worker, cut=False)
        exited = self.transition(worker, trigger)
        assert exited.state is S.EXITED, f"{trigger} leaves {worker.worker_id} {exited.state}"
        pool = self.pools[worker.pool]
        rules = pool.spec.crash_loop
        if failure:
            pool = self.count_failure(pool, worker, why)
        elif worker.attempt and self.proves_healthy(pool, worker):
            pool = self._close_chains(pool, f"{worker.worker_id} ran {rules.early_exit_s:g}s")
        elif worker.attempt:
            pool = self._close_chains(pool, f"{worker.worker_id} stopped")
        if pool.removed and not any(w.pool == pool.spec.name for w in self.workers.values()):
            self.forget_pool(pool)
            return
        self.put_pool(pool)
        self.dirty_pools.add(pool.spec.name)

    def count_failure(self, pool: PoolState, worker: Worker, why: str) -> PoolState:
        """``pool`` with ``worker``'s early end counted against its slot: the slot's own history,
        so a replacement that fails again deepens its slot's backoff, and an unrelated slot's
        failure (in a large pool, any second) delays only its own. A slot that fails
        ``alert_after`` times in a row raises ``crash_loop``."""
        rules = pool.spec.crash_loop
        failures = worker.attempt + 1
        backoff = rules.backoff_s(failures)
        retries = retry_order([*pool.retries, (self.t, failures)], rules)
        pool = self.with_retries(replace(pool, last_failure_t=self.t, incident_t=None), retries)
        if failures >= rules.alert_after:
            self.raise_alert(
                AlertName.CRASH_LOOP,
                pool.spec.name,
                f"{failures} early failures in a row of one worker slot (last: "
                f"{worker.worker_id} {why}); its replacement starts in {backoff:g}s",
            )
        return pool

    def stop_failed(self, worker: Worker, cause: StopCause, why: str, *, failed: bool) -> None:
        """Stop a worker that did not come up or went silent (SIGTERM), counting it against its
        slot now when ``failed``: its replacement is then the slot's next try, after the slot's
        backoff, not a fresh slot (counted at the exit, the failure would find the slot already
        refilled, and a crash loop would go unseen)."""
        pool = self.pools[worker.pool]
        self.terminate(worker, cause, f"{worker.worker_id} {why}")
        if failed:
            self.put_pool(self.count_failure(pool, worker, why))

    def proves_healthy(self, pool: PoolState, worker: Worker) -> bool:
        """A worker has stayed up for ``early_exit_s``: its slot's failures end with it.

        Only such a worker ends its slot's crash loop: an old worker that keeps running says
        nothing about the slot that keeps crashing beside it."""
        started = worker.started_t
        return started is not None and self.t - started >= pool.spec.crash_loop.early_exit_s

    def with_retries(self, pool: PoolState, retries: tuple[tuple[float, int], ...]) -> PoolState:
        """``pool`` with these failed slots waiting, its deepest open slot and next retry time."""
        rules = pool.spec.crash_loop
        name = pool.spec.name
        deepest = max(
            [failures for _, failures in retries]
            + [w.attempt for w in self.workers.values() if w.pool == name and w.attempt]
            + [0]
        )
        next_t = min((t + rules.backoff_s(n) for t, n in retries), default=0.0)
        return replace(pool, retries=retries, failures=deepest, backoff_until_t=next_t)

    def _close_chains(self, pool: PoolState, why: str) -> PoolState:
        pool = self.with_retries(pool, pool.retries)
        if pool.failures < pool.spec.crash_loop.alert_after:
            self.resolve_alert(AlertName.CRASH_LOOP, pool.spec.name, f"healthy run: {why}")
        if pool.failures == 0:
            pool = replace(pool, incident_t=None)
        return pool

    def prove_slots(self, pool: PoolState) -> PoolState:
        """Workers of ``pool`` up for ``early_exit_s`` end their slots' failures (on a tick)."""
        proven = [
            w
            for w in self.workers.values()
            if w.pool == pool.spec.name
            and w.attempt
            and w.state is S.ACTIVE
            and self.proves_healthy(pool, w)
        ]
        if not proven:
            return pool
        for worker in proven:
            self.put_worker(replace(worker, attempt=0))
        rules = pool.spec.crash_loop
        return self._close_chains(pool, f"{proven[0].worker_id} up {rules.early_exit_s:g}s")

    def resolve_pool_alerts(self, pool: str, why: str) -> None:
        for alert, subject in sorted(self.alerts):
            if subject == pool:
                self.resolve_alert(alert, subject, why)

    def freeing(self, free: list[str], gpus_per_worker: int) -> bool:
        """Whether a worker of ``gpus_per_worker`` GPUs fits once the workers on their way out
        (draining or stopping) exit: with ``free``, the healthy GPUs they alone hold (not the
        arbiter's, nor one a staying worker shares)."""
        staying = {g for w in self.workers.values() if w.state not in LEAVING for g in w.gpus}
        arbiter = set(self.base.arbiter.gpus)
        leaving = dict.fromkeys(
            gpu_id
            for worker in self.workers.values()
            if worker.state in LEAVING
            for gpu_id in worker.gpus
            if gpu_id not in staying
            and gpu_id not in arbiter
            and gpu_id in self.gpus
            and not self.gpus[gpu_id].causes
        )
        return bool(leaving) and take_gpus([*free, *leaving], gpus_per_worker) is not None

    def is_failure(self, worker: Worker) -> bool:
        """Whether an exit counts against the worker's slot (see :class:`CrashLoopRules`)."""
        if worker.stop_cause in PLANNED_STOPS or worker.stop_cause in COUNTED_AT_STOP:
            return False  # deo's own doing, or counted when deo stopped it
        return self.started_lately(worker)

    def failed_start(self, worker: Worker) -> bool:
        """Whether a worker found silent failed to come up: it started within ``early_exit_s``,
        or no sign of life came from it after it started."""
        started = worker.started_t
        if started is None or self.started_lately(worker):
            return True
        return self.last_seen.get(worker.worker_id, started) <= started

    def started_lately(self, worker: Worker) -> bool:
        """Never started, or started within its pool's ``crash_loop.early_exit_s``."""
        rules = self.pools[worker.pool].spec.crash_loop
        return worker.started_t is None or self.t - worker.started_t < rules.early_exit_s

    # --- reconciliation --------------------------------------------------------------------------

    def reconcile(self, names: Iterable[str]) -> None:
        """Spawn up to each named pool's target and drain what exceeds it."""
        by_pool: dict[str, list[Worker]] = {}
        held: set[str] = set()  # by a worker that holds their memory
        occupied: set[str] = set()  # by any live worker, asleep engines included
        for worker in self.workers.values():
            occupied.update(worker.gpus)
            if worker.holds_memory:
                held.update(worker.gpus)
            if worker.state in COUNTED:
                by_pool.setdefault(worker.pool, []).append(worker)
        # The arbiter's engines may start or wake beside asleep engines (tenants), never beside
        # a worker that holds the memory.
        free = [
            gpu_id
            for gpu_id in self.config.gpus
            if gpu_id not in held and gpu_id in self.gpus and not self.gpus[gpu_id].causes
        ]
        bound = self.base.arbiter.engine_pools() if self.base.arbiter.pipelines else {}
        # The arbiter's GPUs are its clusters' alone: a pool it does not run never takes one
        # (a training cluster's hold is no deo worker, so nothing else would keep it free), nor
        # a GPU any live worker has.
        arbiter_gpus = set(self.base.arbiter.gpus)
        own_free = [g for g in free if g not in arbiter_gpus and g not in occupied]
        for name in names:
            pool = self.pools.get(name)
            if pool is None:
                continue
            if name in bound and not pool.removed:
                # The arbiter decides which of its engines run (core.arbiter.engines).
                follow_ranks(self, pool, *bound[name], free)
                continue
            counted = by_pool.get(name, [])
            count, target = len(counted), pool.target
            owed = max(0, target - count)
            if len(pool.retries) > owed:
                # Fewer workers wanted: the slots dropped are the least failed ones.
                kept = sorted(pool.retries, key=lambda retry: -retry[1])[:owed]
                pool = self.with_retries(pool, retry_order(kept, pool.spec.crash_loop))
                self.put_pool(pool)
            starting = sum(1 for w in counted if w.state in STARTING_STATES)
            if count > target:
                self._shrink(pool, counted, count - target)
                count = target
            elif count < target:
                count, starting = self._grow(pool, count, starting, own_free)
            else:
                self.resolve_alert(AlertName.NO_FREE_GPUS, name, f"{name} reached {target} workers")
                self.resolve_alert(AlertName.NO_FREE_PORTS, name, f"{name} reached {target}")
            if pool.spec.is_engine:
                engines.enforce_max_asleep(self, self.pools[name])
            self._check_min(pool, count, starting)

    def _shrink(self, pool: PoolState, counted: list[Worker], excess: int) -> None:
        def victim_order(w: Worker) -> tuple[int, int, int]:
            on_cordoned = any(self.gpus[g].causes for g in w.gpus if g in self.gpus)
            # Cordoned GPUs first, then workers not yet producing, newest first.
            return (0 if on_cordoned else 1, 0 if w.state is not S.ACTIVE else 1, -w.index)

        why = f"{pool.spec.name} has {len(counted)} workers, target {pool.target}" + (
            " (pool removed)" if pool.removed else ""
        )
        cause = StopCause.POOL_REMOVED if pool.removed else StopCause.SCALE_DOWN
        victims = sorted(counted, key=victim_order)[:excess]
        if pool.spec.is_engine:
            victims = engines.victims(self, pool, counted, excess, victim_order)
            engines.shrink(self, pool, victims, why, cause)
            return
        for worker in victims:
            self.drain(worker, cause, why)

    def _grow(self, pool: PoolState, count: int, starting: int, free: list[str]) -> tuple[int, int]:
        """Spawn toward the target, at most ``max_starting`` starting at once; returns the new
        count and how many of them are starting."""
        spec = pool.spec
        name = spec.name
        if spec.is_engine:
            # A sleeping engine wakes in seconds; a new one takes minutes: wake first.
            count = engines.wake_for(self, pool, count)
            pool = self.pools[name]
        # Failed slots wait for their backoff and hold their place meanwhile (_check_min alerts
        # if that leaves the pool below min); the rest of the pool spawns as usual.
        rules = spec.crash_loop
        due = [r for r in pool.retries if r[0] + rules.backoff_s(r[1]) <= self.t]
        waiting = len(pool.retries) - len(due)
        retries = list(pool.retries)
        index = pool.next_index
        while count + waiting < pool.target:
            if starting >= spec.max_starting:
                break  # the rest are requested as these come up
            port = engines.free_port(self, spec) if spec.is_engine else None
            if spec.is_engine and port is None:
                self.raise_alert(
                    AlertName.NO_FREE_PORTS,
                    name,
                    f"{name} wants {pool.target} engines, has {count}: every port of "
                    f"{spec.ports} is held by a live engine",
                )
                break
            picked = take_gpus(free, spec.gpus_per_worker)
            if picked is None and self.freeing(free, spec.gpus_per_worker):
                break  # a wait for workers on their way out, not a shortage: no alert
            if picked is None:
                on_one_node = " on one node" if len(free) >= spec.gpus_per_worker else ""
                self.raise_alert(
                    AlertName.NO_FREE_GPUS,
                    name,
                    f"{name} wants {pool.target} workers, has {count}: needs "
                    f"{spec.gpus_per_worker} free healthy GPU(s){on_one_node}, {len(free)} "
                    f"available",
                )
                break
            gpus = picked
            attempt = 0
            if due:
                retry = due.pop(0)
                attempt = retry[1]
                retries.remove(retry)
            self.spawn(
                pool,
                index,
                gpus,
                port,
                attempt,
                f"{name} has {count} workers, target {pool.target}",
            )
            index += 1
            count += 1
            starting += 1
        else:
            self.resolve_alert(
                AlertName.NO_FREE_GPUS, name, f"{name} reached {pool.target} workers"
            )
            self.resolve_alert(AlertName.NO_FREE_PORTS, name, f"{name} reached {pool.target}")
        if len(retries) != len(pool.retries):
            pool = self.with_retries(pool, tuple(retries))  # the replacements are in
        if index != pool.next_index or pool is not self.pools[name]:
            self.put_pool(replace(pool, next_index=index))
        return count, starting

    def spawn(
        self,
        pool: PoolState,
        index: int,
        gpus: tuple[str, ...],
        port: int | None,
        attempt: int,
        why: str,
    ) -> None:
        """Request worker ``index`` of ``pool`` on ``gpus`` (and ``port``, an engine's)."""
        spec = pool.spec
        name = spec.name
        worker_id = f"{name}-{index}"
        env = dict(spec.env)
        devices = ",".join(self.config.device_of(gpu) for gpu in gpus)
        env.update(CUDA_VISIBLE_DEVICES=devices, DEO_WORKER_ID=worker_id, DEO_POOL=name)
        if spec.engine == "vllm":
            env[VLLM_DEV_MODE_ENV] = "1"  # vLLM serves its sleep routes only in dev mode
        placed = f" on GPU {','.join(gpus)}" if gpus else ""
        placed += f" port {port}" if port is not None else ""
        self.put_worker(
            Worker(
                worker_id=worker_id,
                pool=name,
                index=index,
                state=S.REQUESTED,
                gpus=gpus,
                requested_t=self.t,
                port=port,
                attempt=attempt,
            )
        )
        self.commands.append(
            c.SpawnWorker(
                worker_id=worker_id,
                pool=name,
                argv=spec.render_argv(worker_id=worker_id, index=index, gpus=gpus, port=port),
                gpus=gpus,
                env=env,
                port=port,
                reason=f"{why}: starting {worker_id}{placed}",
            )
        )

    def _check_min(self, pool: PoolState, counted: int, starting: int) -> None:
        name = pool.spec.name
        minimum = 0 if pool.removed else pool.spec.min_workers
        if counted >= minimum:
            self.resolve_alert(
                AlertName.BELOW_MIN, name, f"{name} has {counted} >= min {minimum} workers"
            )
            return
        if pool.retries and self.t < pool.backoff_until_t:
            why = f"crash-loop backoff, next spawn in {pool.backoff_until_t - self.t:.0f}s"
        elif starting >= pool.spec.max_starting:
            why = f"{starting} starting, at most {pool.spec.max_starting} at once"
        elif (AlertName.NO_FREE_PORTS, name) in self.alerts:
            why = f"every port of {pool.spec.ports} held"
        else:
            why = f"no free healthy GPU for {pool.spec.gpus_per_worker} per worker"
        self.raise_alert(
            AlertName.BELOW_MIN, name, f"{name} has {counted} < min {minimum} workers: {why}"
        )

    # --- scaling decisions -----------------------------------------------------------------------

    def set_desired(
        self,
        pool: PoolState,
        target: int,
        source: DecisionSource,
        why: str,
        *,
        stabilize: bool = True,
    ) -> PoolState:
        spec = pool.spec
        target = min(max(target, spec.min_workers), spec.max_workers)
        policy = source is DecisionSource.POLICY
        before = pool.held
        if policy and before is not None:
            pool = replace(pool, held=None)  # set again below while the window holds a removal
        if target == pool.desired:
            return pool
        if policy and target < pool.desired and pool.last_scale_up_t is not None:
            since = self.t - pool.last_scale_up_t
            if since < spec.stabilization_s:
                # No flapping: hold within the stabilization window, and say so (status, replay).
                held = HeldChange(
                    target=target,
                    since_t=self.t if before is None else before.since_t,
                    until_t=pool.last_scale_up_t + spec.stabilization_s,
                    reason=why,
                )
                return replace(pool, held=held)
        if pool.failures and self.t < pool.backoff_until_t:
            running = self.worker_counts.get(spec.name, (0, 0))[0]
            why += (
                f" (target only: {running} worker(s) running, crash-loop backoff for another "
                f"{pool.backoff_until_t - self.t:.0f}s)"
            )
        self.commands.append(
            c.ScalePool(
                pool=spec.name, previous=pool.desired, target=target, source=source, reason=why
            )
        )
        changes: dict[str, Any] = {"desired": target, "held": None}  # nothing held back now
        if policy and stabilize and target > pool.desired:
            changes["last_scale_up_t"] = self.t
        self.dirty_pools.add(spec.name)
        return replace(pool, **changes)

    def sampled(self, pool: PoolState, event: e.QueueSampled | e.LoadSampled) -> None:
        name = pool.spec.name
        changes: dict[str, Any] = {"last_sample_t": self.t, "source_error": None}
        changes["queue" if isinstance(event, e.QueueSampled) else "load"] = event
        self.resolve_alert(AlertName.SOURCE_DOWN, name, "pressure source answered again")
        self.resolve_alert(AlertName.PRESSURE_STALE, name, "fresh pressure sample")
        if isinstance(event, e.QueueSampled):
            self.check_backlog(pool.spec, event)
        built = pool.built_policy
        if built is None or built[0] is not pool.spec.policy:
            built = changes["built_policy"] = (
                pool.spec.policy,
                self.policies.build(pool.spec.policy),
            )
        policy: Policy = built[1]
        if policy.reacts_to is not type(event):
            # A policy that does not decide on this kind of sample says nothing on it: what it
            # reported on the kind it decides on stands (a pool may be sent both kinds; a
            # policy that changed resolved its predecessor's alerts when it was configured).
            self.put_pool(replace(pool, **changes))
            return
        # Kept up to date by put_worker and drop_worker: a sample, far more frequent than a worker
        # change, never recounts.
        counted, active = self.worker_counts.get(name, (0, 0))
        decision = policy.decide(
            PolicyContext(
                t=self.t,
                pool=name,
                current=counted,
                active=active,
                min_workers=pool.spec.min_workers,
                max_workers=pool.spec.max_workers,
                queue=changes.get("queue", pool.queue),
                load=changes.get("load", pool.load),
                desired=pool.desired,
                last_failure_t=pool.last_failure_t,
            ),
            pool.policy_memory,
        )
        pool = replace(pool, policy_memory=decision.memory, **changes)
        self.follow_policy_alerts(
            name, dict(decision.alerts), "no longer reported by the pool's policy"
        )
        if not (self.paused_all or pool.paused or pool.pinned is not None or pool.removed):
            pool = self.set_desired(
                pool,
                decision.target,
                DecisionSource.POLICY,
                decision.reason,
                stabilize=decision.stabilize,
            )
        elif pool.held is not None:
            pool = replace(pool, held=None)  # an operator holds the count: no removal is waiting
        self.put_pool(pool)

    def follow_policy_alerts(
        self, pool: str, reported: Mapping[AlertName, str], why_resolved: str
    ) -> None:
        """Keep each alert a policy may report raised on ``pool`` while it is reported."""
        for alert in POLICY_ALERTS:
            if alert in reported:
                self.raise_alert(alert, pool, reported[alert])
            else:
                self.resolve_alert(alert, pool, why_resolved)

    def check_backlog(self, spec: PoolSpec, sample: e.QueueSampled) -> None:
        """Report a queue growing past what the trainer can use (the policy scales down)."""
        queued_batches = sample.queued_sequences / sample.batch_size_seqs
        if queued_batches > spec.queue_alert_batches:
            self.raise_alert(
                AlertName.QUEUE_BACKLOG,
                spec.name,
                f"{queued_batches:.1f} batches queued, more than the {spec.queue_alert_batches:g} "
                f"the trainer can use before the data goes stale",
            )
        else:
            self.resolve_alert(
                AlertName.QUEUE_BACKLOG, spec.name, f"queue back to {queued_batches:.1f} batches"
            )

    # --- GPUs ------------------------------------------------------------------------------------

    def set_causes(
        self, gpu: Gpu, causes: frozenset[str], clean_since_t: float | None, why: str
    ) -> None:
        if causes - gpu.causes:
            self.commands.append(c.CordonGpu(gpu_id=gpu.gpu_id, causes=causes, reason=why))
        elif gpu.causes and not causes:
            self.commands.append(c.UncordonGpu(gpu_id=gpu.gpu_id, reason=why))
        if causes != gpu.causes:
            self.dirty_pools.update(self.pools)
        self.put_gpu(replace(gpu, causes=causes, clean_since_t=clean_since_t))

    def expire_transient_cordon(self, gpu: Gpu) -> None:
        rules = self.config.cordon
        transient = gpu.causes - STICKY_CAUSES
        if transient and gpu.clean_since_t is not None:
            clean_for = self.t - gpu.clean_since_t
            if clean_for >= rules.uncordon_after_s:
                self.set_causes(
                    gpu,
                    gpu.causes & STICKY_CAUSES,
                    gpu.clean_since_t,
                    f"GPU {gpu.gpu_id} clean for {clean_for:.0f}s >= {rules.uncordon_after_s:g}s "
                    f"(was: {', '.join(sorted(transient))})",
                )

    def workers_on(self, gpu_id: str) -> list[Worker]:
        return sorted(
            (w for w in self.workers.values() if gpu_id in w.gpus), key=lambda w: w.worker_id
        )
