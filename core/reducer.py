"""The reducer: ``reduce(state, event) -> (state, commands)``, and :class:`Reducer` around it.

Each step works on a private copy-on-write view of the state (``_Step``), so the state passed in
is never touched and an event that raises leaves nothing half-applied. Worker lifecycle changes go
through :func:`core.lifecycle.next_state`; placement, scaling and escalation live here.

Order inside a step: the event's own handler first, then reconciliation of the pools it may have
affected (spawn up to each pool's target, drain the excess).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from core import commands as c
from core import events as e
from core.config import Config, PoolSpec
from core.errors import ConfigError, InvalidEvent
from core.invariants import raise_on_violation
from core.lifecycle import COUNTED, Trigger, WorkerState, next_state
from core.policies import PolicyContext, build
from core.records import replace
from core.state import Gpu, PoolState, State, Worker, split_worker_id

__all__ = ["Reducer", "reduce"]

S = WorkerState

#: Stop causes that are deo's own decision: such exits are never counted as crashes.
PLANNED_STOPS = frozenset({"scale_down", "operator", "pool_removed", "gpu_lost", "gpu_errors"})
#: Cordon causes that clear by themselves after clean samples (the rest need an operator).
STICKY_CAUSES = frozenset({"operator", "errors", "lost", "unkillable_worker"})


#: The last workers dict counted and its counts (see _Step.pool_counts); holding the dict keeps
#: its identity from being reused by another.
_counted_for: tuple[object, dict[str, tuple[int, int]]] = (None, {})


def reduce(state: State, event: e.Event) -> tuple[State, list[c.Command]]:
    """One step of the fold.

    Raises :class:`~core.errors.InvalidEvent` on bad input; the state given is left unchanged.
    """
    if type(event) is e.WorkerHeartbeat:
        return _heartbeat_only(state, event), []
    handler = _HANDLERS.get(type(event))
    if handler is None:
        raise InvalidEvent(f"{type(event).__name__} is not an event the reducer knows")
    step = _Step(state, event.t)
    handler(step, event)
    return step.finish()


class Reducer:
    """Feed events, read commands. ``state`` is the state after the last accepted event.

    With ``check_invariants=True`` every step is checked against :mod:`core.invariants` and a
    violation raises :class:`~core.errors.InvariantViolation` (a bug in deo, never bad input).
    """

    def __init__(self, state: State | None = None, *, check_invariants: bool = False) -> None:
        self.state = state if state is not None else State()
        self.check_invariants = check_invariants

    def step(self, event: e.Event) -> list[c.Command]:
        before = self.state
        after, commands = reduce(before, event)
        if self.check_invariants:
            raise_on_violation(before, event, after, commands)
        self.state = after
        return commands


class _Step:
    """The mutable workspace of one step; copies each collection before its first write."""

    def __init__(self, state: State, t: float) -> None:
        self.base = state
        # Time never goes backwards: a late event is taken at the current time.
        self.t = max(state.now, t)
        self.config = state.config
        self.pools = state.pools
        self.workers = state.workers
        self.gpus = state.gpus
        self.last_seen = state.last_seen
        self.paused_all = state.paused_all
        self.alerts = state.alerts
        self.commands: list[c.Command] = []
        self._owned: set[str] = set()
        self.dirty_pools: set[str] = set()

    # --- copy-on-write ---------------------------------------------------------------------------

    def _own(self, name: str) -> Any:
        if name not in self._owned:
            setattr(self, name, dict(getattr(self, name)))
            self._owned.add(name)
        return getattr(self, name)

    def put_worker(self, worker: Worker) -> None:
        self._own("workers")[worker.worker_id] = worker

    def drop_worker(self, worker_id: str) -> None:
        del self._own("workers")[worker_id]
        if worker_id in self.last_seen:
            del self._own("last_seen")[worker_id]

    def seen(self, worker_id: str) -> None:
        self._own("last_seen")[worker_id] = self.t

    def put_pool(self, pool: PoolState) -> None:
        self._own("pools")[pool.spec.name] = pool

    def put_gpu(self, gpu: Gpu) -> None:
        self._own("gpus")[gpu.gpu_id] = gpu

    def finish(self) -> tuple[State, list[c.Command]]:
        if self.dirty_pools:
            self.reconcile(sorted(self.dirty_pools))
        state = replace(
            self.base,
            now=self.t,
            config=self.config,
            pools=self.pools,
            workers=self.workers,
            gpus=self.gpus,
            last_seen=self.last_seen,
            paused_all=self.paused_all,
            alerts=self.alerts,
        )
        return state, self.commands

    # --- lookups ---------------------------------------------------------------------------------

    def pool(self, name: str, event: e.Event) -> PoolState:
        pool = self.pools.get(name)
        if pool is None:
            known = ", ".join(sorted(self.pools)) or "none declared"
            raise InvalidEvent(f"{type(event).__name__}: unknown pool {name!r} (pools: {known})")
        return pool

    def worker(self, worker_id: str, event: e.Event) -> Worker | None:
        """The live worker, None if it already exited (a late report), or an error if unknown."""
        worker = self.workers.get(worker_id)
        if worker is not None:
            return worker
        parsed = split_worker_id(worker_id)
        if parsed is not None:
            pool = self.pools.get(parsed[0])
            if pool is not None and parsed[1] < pool.next_index:
                return None
        raise InvalidEvent(f"{type(event).__name__}: unknown worker {worker_id!r}")

    def gpu(self, gpu_id: str, event: e.Event) -> Gpu:
        gpu = self.gpus.get(gpu_id)
        if gpu is None:
            known = ", ".join(self.gpus) or "none declared"
            raise InvalidEvent(f"{type(event).__name__}: unknown GPU {gpu_id!r} (GPUs: {known})")
        return gpu

    # --- alerts ----------------------------------------------------------------------------------

    def raise_alert(self, alert: str, subject: str, reason: str) -> None:
        if (alert, subject) not in self.alerts:
            self.alerts = self.alerts | {(alert, subject)}
            self.commands.append(c.RaiseAlert(alert=alert, subject=subject, reason=reason))

    def resolve_alert(self, alert: str, subject: str, reason: str) -> None:
        if (alert, subject) in self.alerts:
            self.alerts = self.alerts - {(alert, subject)}
            self.commands.append(c.ResolveAlert(alert=alert, subject=subject, reason=reason))

    # --- worker transitions ----------------------------------------------------------------------

    def transition(self, worker: Worker, trigger: Trigger, **changes: Any) -> Worker:
        state = next_state(worker.worker_id, worker.state, trigger)
        updated = replace(worker, state=state, **changes)
        self.put_worker(updated)
        return updated

    def drain(self, worker: Worker, cause: str, why: str) -> None:
        spec = self.pools[worker.pool].spec
        deadline = self.t + spec.drain_timeout_s
        self.transition(worker, Trigger.DRAIN, deadline_t=deadline, stop_cause=cause)
        self.commands.append(
            c.DrainWorker(
                worker_id=worker.worker_id,
                pid=worker.pid,
                signal=spec.drain_signal,
                deadline_t=deadline,
                reason=why,
            )
        )
        self.dirty_pools.add(worker.pool)

    def terminate(self, worker: Worker, cause: str, why: str) -> None:
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

    def exit_worker(self, worker: Worker, *, failure: bool, why: str) -> None:
        """The worker is gone: free its GPUs, count a failure if it was one, let the pool react."""
        next_state(worker.worker_id, worker.state, Trigger.EXIT)  # validates the transition
        self.drop_worker(worker.worker_id)
        pool = self.pools[worker.pool]
        rules = pool.spec.crash_loop
        if failure:
            failures = pool.failures + 1
            backoff = rules.backoff_s(failures)
            pool = replace(
                pool,
                failures=failures,
                last_failure_t=self.t,
                backoff_until_t=self.t + backoff,
            )
            if failures >= rules.alert_after:
                self.raise_alert(
                    "crash_loop",
                    pool.spec.name,
                    f"{failures} early failures in a row (last: {worker.worker_id} {why}); "
                    f"next spawn in {backoff:g}s",
                )
        elif self.proves_healthy(pool, worker):
            pool = self._reset_failures(pool, f"{worker.worker_id} ran {rules.early_exit_s:g}s")
        if pool.removed and not any(w.pool == pool.spec.name for w in self.workers.values()):
            del self._own("pools")[pool.spec.name]
            self.dirty_pools.discard(pool.spec.name)
            self.resolve_pool_alerts(pool.spec.name, "pool removed")
            return
        self.put_pool(pool)
        self.dirty_pools.add(pool.spec.name)

    def proves_healthy(self, pool: PoolState, worker: Worker) -> bool:
        """A worker started since the pool's last failure has stayed up for ``early_exit_s``.

        Only such a worker ends a crash loop: an old worker that keeps running says nothing about
        the slot that keeps crashing beside it.
        """
        started = worker.started_t
        if started is None or self.t - started < pool.spec.crash_loop.early_exit_s:
            return False
        return pool.last_failure_t is None or started >= pool.last_failure_t

    def _reset_failures(self, pool: PoolState, why: str) -> PoolState:
        if pool.failures == 0:
            return pool
        self.resolve_alert("crash_loop", pool.spec.name, f"healthy run: {why}")
        return replace(pool, failures=0, backoff_until_t=0.0)

    def resolve_pool_alerts(self, pool: str, why: str) -> None:
        for alert, subject in sorted(self.alerts):
            if subject == pool:
                self.resolve_alert(alert, subject, why)

    def is_failure(self, worker: Worker) -> bool:
        if worker.stop_cause in PLANNED_STOPS:
            return False
        rules = self.pools[worker.pool].spec.crash_loop
        return worker.started_t is None or self.t - worker.started_t < rules.early_exit_s

    # --- reconciliation --------------------------------------------------------------------------

    def reconcile(self, names: Iterable[str]) -> None:
        """Spawn up to each named pool's target and drain what exceeds it."""
        by_pool: dict[str, list[Worker]] = {}
        held: set[str] = set()
        for worker in self.workers.values():
            held.update(worker.gpus)
            if worker.state in COUNTED:
                by_pool.setdefault(worker.pool, []).append(worker)
        free = [
            gpu_id
            for gpu_id in self.config.gpus
            if gpu_id not in held and gpu_id in self.gpus and not self.gpus[gpu_id].causes
        ]
        for name in names:
            pool = self.pools.get(name)
            if pool is None:
                continue
            counted = by_pool.get(name, [])
            count, target = len(counted), pool.target
            if count > target:
                self._shrink(pool, counted, count - target)
                count = target
            elif count < target:
                count = self._grow(pool, count, free)
            else:
                self.resolve_alert("no_free_gpus", name, f"{name} reached {target} workers")
            self._check_min(pool, count)

    def _shrink(self, pool: PoolState, counted: list[Worker], excess: int) -> None:
        def victim_order(w: Worker) -> tuple[int, int, int]:
            on_cordoned = any(self.gpus[g].causes for g in w.gpus if g in self.gpus)
            # Cordoned GPUs first, then workers not yet producing, newest first.
            return (0 if on_cordoned else 1, 0 if w.state is not S.ACTIVE else 1, -w.index)

        why = f"{pool.spec.name} has {len(counted)} workers, target {pool.target}" + (
            " (pool removed)" if pool.removed else ""
        )
        cause = "pool_removed" if pool.removed else "scale_down"
        for worker in sorted(counted, key=victim_order)[:excess]:
            self.drain(worker, cause, why)

    def _grow(self, pool: PoolState, count: int, free: list[str]) -> int:
        """Spawn toward the target; returns the new count."""
        spec = pool.spec
        name = spec.name
        if self.t < pool.backoff_until_t:
            return count  # crash-loop backoff; _check_min alerts if this leaves the pool below min
        index = pool.next_index
        while count < pool.target:
            if len(free) < spec.gpus_per_worker:
                self.raise_alert(
                    "no_free_gpus",
                    name,
                    f"{name} wants {pool.target} workers, has {count}: needs "
                    f"{spec.gpus_per_worker} free healthy GPU(s), {len(free)} available",
                )
                break
            gpus = tuple(free[: spec.gpus_per_worker])
            del free[: spec.gpus_per_worker]
            worker_id = f"{name}-{index}"
            env = dict(spec.env)
            env.update(CUDA_VISIBLE_DEVICES=",".join(gpus), DEO_WORKER_ID=worker_id, DEO_POOL=name)
            placed = f" on GPU {','.join(gpus)}" if gpus else ""
            self.put_worker(
                Worker(
                    worker_id=worker_id,
                    pool=name,
                    index=index,
                    state=S.REQUESTED,
                    gpus=gpus,
                    requested_t=self.t,
                )
            )
            self.commands.append(
                c.SpawnWorker(
                    worker_id=worker_id,
                    pool=name,
                    argv=spec.render_argv(worker_id=worker_id, index=index, gpus=gpus),
                    gpus=gpus,
                    env=env,
                    reason=f"{name} has {count} workers, target {pool.target}: starting "
                    f"{worker_id}{placed}",
                )
            )
            index += 1
            count += 1
        else:
            self.resolve_alert("no_free_gpus", name, f"{name} reached {pool.target} workers")
        if index != pool.next_index:
            self.put_pool(replace(pool, next_index=index))
        return count

    def _check_min(self, pool: PoolState, counted: int) -> None:
        name = pool.spec.name
        minimum = 0 if pool.removed else pool.spec.min_workers
        if counted >= minimum:
            self.resolve_alert("below_min", name, f"{name} has {counted} >= min {minimum} workers")
            return
        if self.t < pool.backoff_until_t:
            why = f"crash-loop backoff until t={pool.backoff_until_t:g}"
        else:
            why = f"no free healthy GPU for {pool.spec.gpus_per_worker} per worker"
        self.raise_alert("below_min", name, f"{name} has {counted} < min {minimum} workers: {why}")

    # --- scaling decisions -----------------------------------------------------------------------

    def set_desired(self, pool: PoolState, target: int, source: str, why: str) -> PoolState:
        spec = pool.spec
        target = min(max(target, spec.min_workers), spec.max_workers)
        if target == pool.desired:
            return pool
        if source == "policy" and target < pool.desired and pool.last_scale_up_t is not None:
            since = self.t - pool.last_scale_up_t
            if since < spec.stabilization_s:
                return pool  # no flapping: hold within the stabilization window
        self.commands.append(
            c.ScalePool(
                pool=spec.name, previous=pool.desired, target=target, source=source, reason=why
            )
        )
        changes: dict[str, Any] = {"desired": target}
        if source == "policy" and target > pool.desired:
            changes["last_scale_up_t"] = self.t
        self.dirty_pools.add(spec.name)
        return replace(pool, **changes)

    def sampled(self, pool: PoolState, event: e.QueueSampled | e.LoadSampled) -> None:
        name = pool.spec.name
        changes: dict[str, Any] = {"last_sample_t": self.t, "source_error": None}
        changes["queue" if isinstance(event, e.QueueSampled) else "load"] = event
        self.resolve_alert("source_down", name, "pressure source answered again")
        self.resolve_alert("pressure_stale", name, "fresh pressure sample")
        if isinstance(event, e.QueueSampled):
            self.check_backlog(pool.spec, event)
        policy = build(pool.spec.policy)
        if policy.reacts_to is not type(event):
            self.put_pool(replace(pool, **changes))
            return
        counted, active = self.pool_counts().get(name, (0, 0))
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
            ),
            pool.policy_memory,
        )
        pool = replace(pool, policy_memory=decision.memory, **changes)
        if not (self.paused_all or pool.paused or pool.pinned is not None or pool.removed):
            pool = self.set_desired(pool, decision.target, "policy", decision.reason)
        self.put_pool(pool)

    def check_backlog(self, spec: PoolSpec, sample: e.QueueSampled) -> None:
        """Report a queue growing past what the trainer can use (the policy scales down)."""
        queued_batches = sample.queued_sequences / sample.batch_size_seqs
        if queued_batches > spec.queue_alert_batches:
            self.raise_alert(
                "queue_backlog",
                spec.name,
                f"{queued_batches:.1f} batches queued, more than the {spec.queue_alert_batches:g} "
                f"the trainer can use before the data goes stale",
            )
        else:
            self.resolve_alert(
                "queue_backlog", spec.name, f"queue back to {queued_batches:.1f} batches"
            )

    def pool_counts(self) -> dict[str, tuple[int, int]]:
        """(counted, active) workers per pool. Samples arrive far more often than workers change
        (heartbeats no longer touch the worker records), so the counts of a state's workers are
        remembered by the identity of its dict: it is never mutated once a step has finished."""
        global _counted_for
        workers = self.workers
        if "workers" not in self._owned and _counted_for[0] is workers:
            return _counted_for[1]
        counts: dict[str, tuple[int, int]] = {}
        for w in workers.values():
            counted, active = counts.get(w.pool, (0, 0))
            counts[w.pool] = (counted + (w.state in COUNTED), active + (w.state is S.ACTIVE))
        if "workers" not in self._owned:
            _counted_for = (workers, counts)
        return counts

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


# --- handlers ------------------------------------------------------------------------------------


def _tick(step: _Step, event: e.Tick) -> None:
    t = step.t
    last_seen = step.last_seen
    grace = {name: pool.spec.heartbeat_grace_s for name, pool in step.pools.items()}
    for worker in tuple(step.workers.values()):  # dict order is deterministic: spawn order
        state = worker.state
        if state is S.ACTIVE:  # the common case, settled here without further lookups
            limit = grace[worker.pool]
            if limit is None or t - last_seen.get(worker.worker_id, t) <= limit:
                continue
        spec = step.pools[worker.pool].spec
        if state in (S.DRAINING, S.STOPPING):
            assert worker.deadline_t is not None
            if t < worker.deadline_t:
                continue
            if state is S.DRAINING:
                step.terminate(
                    worker,
                    "drain_deadline",
                    f"{worker.worker_id} still running {spec.drain_timeout_s:g}s after the "
                    f"drain signal: SIGTERM",
                )
            elif not worker.killed:
                step.transition(
                    worker, Trigger.KILL, killed=True, deadline_t=t + spec.stop_timeout_s
                )
                step.commands.append(
                    c.KillWorker(
                        worker_id=worker.worker_id,
                        pid=worker.pid,
                        reason=f"{worker.worker_id} still running {spec.stop_timeout_s:g}s after "
                        f"SIGTERM: SIGKILL to its process group",
                    )
                )
            elif worker.pid is None:
                why = f"{worker.worker_id} never started"
                step.exit_worker(worker, failure=step.is_failure(worker), why=why)
            else:
                why = f"{worker.worker_id} did not exit {spec.stop_timeout_s:g}s after SIGKILL"
                step.raise_alert("unkillable_worker", worker.worker_id, why + "; GPUs cordoned")
                for gpu_id in worker.gpus:
                    gpu = step.gpus.get(gpu_id)
                    if gpu is not None:
                        step.set_causes(gpu, gpu.causes | {"unkillable_worker"}, None, why)
                step.exit_worker(worker, failure=False, why=why)
            continue
        if state is S.REQUESTED and t - worker.requested_t >= spec.start_timeout_s:
            step.terminate(
                worker,
                "start_timeout",
                f"{worker.worker_id} not started {spec.start_timeout_s:g}s after it was requested",
            )
        elif (
            state is S.STARTING
            and spec.require_ready
            and worker.started_t is not None
            and (t - worker.started_t >= spec.start_timeout_s)
        ):
            step.terminate(
                worker,
                "start_timeout",
                f"{worker.worker_id} not ready {spec.start_timeout_s:g}s after starting",
            )
        elif (
            state in (S.STARTING, S.ACTIVE)
            and spec.heartbeat_grace_s is not None
            and t - last_seen.get(worker.worker_id, t) > spec.heartbeat_grace_s
        ):
            step.terminate(
                worker,
                "hung",
                f"{worker.worker_id} silent for {t - last_seen[worker.worker_id]:.0f}s > grace "
                f"{spec.heartbeat_grace_s:g}s: hung, replacing it",
            )
    for name in sorted(step.pools):
        pool = step.pools[name]
        spec = pool.spec
        if pool.failures:
            healthy = [
                w
                for w in step.workers.values()
                if w.pool == name and w.state is S.ACTIVE and step.proves_healthy(pool, w)
            ]
            if healthy:
                step.put_pool(
                    step._reset_failures(
                        pool, f"{healthy[0].worker_id} up {spec.crash_loop.early_exit_s:g}s"
                    )
                )
        stale = pool.last_sample_t is not None and t - pool.last_sample_t > spec.metrics_stale_s
        if stale and ("pressure_stale", name) not in step.alerts:
            assert pool.last_sample_t is not None
            step.raise_alert(
                "pressure_stale",
                name,
                f"no pressure sample for {t - pool.last_sample_t:.0f}s > "
                f"{spec.metrics_stale_s:g}s: holding {pool.target} workers",
            )
        # Time alone changes a pool's count only when a crash-loop backoff has run out, or when
        # an alert says it is short (of GPUs, of its minimum): reconcile just those.
        if (pool.failures and t >= pool.backoff_until_t) or any(
            subject == name for _, subject in step.alerts
        ):
            step.dirty_pools.add(name)
    for gpu_id in sorted(step.gpus):
        step.expire_transient_cordon(step.gpus[gpu_id])


def _configured(step: _Step, event: e.Configured) -> None:
    config: Config = event.config
    held = {g: w.worker_id for w in step.workers.values() for g in w.gpus}
    for gpu_id, worker_id in sorted(held.items()):
        if gpu_id not in config.gpus:
            raise ConfigError(
                f"gpus: GPU {gpu_id!r} is held by worker {worker_id}; drain it before removing "
                f"the GPU from the configuration"
            )
    step.config = config
    gpus = step._own("gpus")
    for gpu_id in list(gpus):
        if gpu_id not in config.gpus:
            del gpus[gpu_id]
    for gpu_id in config.gpus:
        if gpu_id not in gpus:
            gpus[gpu_id] = Gpu(gpu_id=gpu_id)
    declared = {p.name for p in config.pools}
    for spec in config.pools:
        policy = build(spec.policy)  # raises ConfigError naming the bad parameter
        pool = step.pools.get(spec.name)
        if pool is None:
            initial = policy.initial_target(spec.min_workers, spec.max_workers)
            pool = step.set_desired(
                PoolState(spec=spec, desired=0), initial, "config", f"pool {spec.name} declared"
            )
            step.put_pool(pool)
            continue
        memory = pool.policy_memory if pool.spec.policy == spec.policy else None
        pinned = pool.pinned
        if pinned is not None:
            pinned = min(max(pinned, spec.min_workers), spec.max_workers)
        updated = replace(pool, spec=spec, removed=False, policy_memory=memory, pinned=pinned)
        if pool.failures and pool.last_failure_t is not None:
            # Changed backoff rules apply to the crash loop in progress.
            backoff = spec.crash_loop.backoff_s(pool.failures)
            updated = replace(updated, backoff_until_t=pool.last_failure_t + backoff)
        # A policy that never reacts to pressure (static) sets its count from configuration.
        wanted = (
            policy.initial_target(spec.min_workers, spec.max_workers)
            if policy.reacts_to is None
            else pool.desired
        )
        step.put_pool(step.set_desired(updated, wanted, "config", f"pool {spec.name} reconfigured"))
    for name, pool in sorted(step.pools.items()):
        if name not in declared and not pool.removed:
            if any(w.pool == name for w in step.workers.values()):
                step.put_pool(replace(pool, removed=True))
                step.dirty_pools.add(name)
            else:
                del step._own("pools")[name]
                step.resolve_pool_alerts(name, "pool removed")
    step.dirty_pools.update(step.pools)  # the GPU inventory may have changed for every pool


def _paused(step: _Step, event: e.AutoscalingPaused) -> None:
    if event.pool is None:
        step.paused_all = True
    else:
        step.put_pool(replace(step.pool(event.pool, event), paused=True))


def _resumed(step: _Step, event: e.AutoscalingResumed) -> None:
    if event.pool is None:
        step.paused_all = False
        for _name, pool in list(step.pools.items()):
            if pool.paused:
                step.put_pool(replace(pool, paused=False))
    else:
        step.put_pool(replace(step.pool(event.pool, event), paused=False))


def _pinned(step: _Step, event: e.PoolPinned) -> None:
    pool = step.pool(event.pool, event)
    spec = pool.spec
    if event.count is None:
        if pool.pinned is not None:
            step.put_pool(replace(pool, pinned=None, desired=pool.pinned))
        return
    if not spec.min_workers <= event.count <= spec.max_workers:
        raise InvalidEvent(
            f"PoolPinned: count {event.count} is outside pool {spec.name!r} bounds "
            f"[{spec.min_workers}, {spec.max_workers}]"
        )
    if event.count != pool.target:
        step.commands.append(
            c.ScalePool(
                pool=spec.name,
                previous=pool.target,
                target=event.count,
                source="operator",
                reason=f"operator pinned {spec.name} at {event.count} workers",
            )
        )
    step.put_pool(replace(pool, pinned=event.count))
    step.dirty_pools.add(spec.name)


def _drain_requested(step: _Step, event: e.DrainRequested) -> None:
    worker = step.worker(event.worker_id, event)
    if worker is None or worker.state not in COUNTED:
        return  # already leaving
    step.drain(worker, "operator", f"operator asked to drain {worker.worker_id}")


def _cordon_requested(step: _Step, event: e.GpuCordonRequested) -> None:
    gpu = step.gpu(event.gpu_id, event)
    step.set_causes(gpu, gpu.causes | {"operator"}, gpu.clean_since_t, "operator cordon")


def _uncordon_requested(step: _Step, event: e.GpuUncordonRequested) -> None:
    gpu = step.gpu(event.gpu_id, event)
    step.set_causes(gpu, frozenset(), step.t, "operator uncordon")
    for alert in ("gpu_errors", "gpu_lost"):
        step.resolve_alert(alert, gpu.gpu_id, "operator uncordon")


def _sampled(step: _Step, event: e.QueueSampled | e.LoadSampled) -> None:
    step.sampled(step.pool(event.pool, event), event)


def _source_down(step: _Step, event: e.SourceDown) -> None:
    pool = step.pool(event.pool, event)
    step.put_pool(replace(pool, source_error=event.error))
    step.raise_alert(
        "source_down",
        pool.spec.name,
        f"pressure source of {pool.spec.name} down ({event.error}): holding {pool.target} workers",
    )


def _started(step: _Step, event: e.WorkerStarted) -> None:
    worker = step.worker(event.worker_id, event)
    if worker is None:
        return
    if worker.pid is not None:
        raise InvalidEvent(
            f"WorkerStarted: worker {worker.worker_id!r} already started as pid {worker.pid}"
        )
    spec = step.pools[worker.pool].spec
    worker = step.transition(
        worker,
        Trigger.STARTED,
        pid=event.pid,
        start_time=event.start_time,
        started_t=step.t,
    )
    step.seen(worker.worker_id)
    if worker.state is S.STARTING and not spec.require_ready:
        step.transition(worker, Trigger.READY)
    elif worker.state is S.DRAINING:
        assert worker.deadline_t is not None
        step.commands.append(
            c.DrainWorker(
                worker_id=worker.worker_id,
                pid=worker.pid,
                signal=spec.drain_signal,
                deadline_t=worker.deadline_t,
                reason=f"{worker.worker_id} started after its drain was decided",
            )
        )
    elif worker.state is S.STOPPING:
        _repeat_stop(step, worker, "started after it was told to stop")


def _repeat_stop(step: _Step, worker: Worker, why: str) -> None:
    if worker.killed:
        step.commands.append(
            c.KillWorker(
                worker_id=worker.worker_id, pid=worker.pid, reason=f"{worker.worker_id} {why}"
            )
        )
    else:
        assert worker.deadline_t is not None
        step.commands.append(
            c.TerminateWorker(
                worker_id=worker.worker_id,
                pid=worker.pid,
                deadline_t=worker.deadline_t,
                reason=f"{worker.worker_id} {why}",
            )
        )


def _ready(step: _Step, event: e.WorkerReady) -> None:
    worker = step.worker(event.worker_id, event)
    if worker is None:
        return
    if worker.state is S.STARTING:
        step.transition(worker, Trigger.READY)
        step.seen(worker.worker_id)
    elif worker.state is S.REQUESTED:
        next_state(worker.worker_id, worker.state, Trigger.READY)  # raises: not started yet
    else:
        step.seen(worker.worker_id)


def _heartbeat_only(state: State, event: e.WorkerHeartbeat) -> State:
    """The most frequent event, reduced without a full step: it only refreshes one worker."""
    t = max(state.now, event.t)
    worker = state.workers.get(event.worker_id)
    if worker is None:
        _Step(state, t).worker(event.worker_id, event)  # a late heartbeat, or an error
        return replace(state, now=t)
    last_seen = dict(state.last_seen)
    last_seen[worker.worker_id] = t
    return replace(state, now=t, last_seen=last_seen)


def _exited(step: _Step, event: e.WorkerExited) -> None:
    worker = step.worker(event.worker_id, event)
    if worker is None:
        return
    if event.signal is not None:
        how = f"killed by signal {event.signal}"
    else:
        how = f"exited with code {event.exit_code}"
    failure = step.is_failure(worker)
    step.exit_worker(worker, failure=failure, why=how)


def _spawn_failed(step: _Step, event: e.SpawnFailed) -> None:
    worker = step.worker(event.worker_id, event)
    if worker is None:
        return
    if worker.pid is not None:
        raise InvalidEvent(
            f"SpawnFailed: worker {worker.worker_id!r} is running as pid {worker.pid}"
        )
    step.exit_worker(worker, failure=True, why=f"failed to spawn: {event.error}")


def _adopted(step: _Step, event: e.WorkerAdopted) -> None:
    worker = step.worker(event.worker_id, event)
    if worker is None:
        raise InvalidEvent(f"WorkerAdopted: worker {event.worker_id!r} already exited")
    if worker.pid is None:
        raise InvalidEvent(f"WorkerAdopted: worker {event.worker_id!r} never started")
    step.seen(worker.worker_id)
    spec = step.pools[worker.pool].spec
    if worker.state is S.DRAINING:
        # The drain signal may never have left before the restart: sending it again is harmless.
        assert worker.deadline_t is not None
        step.commands.append(
            c.DrainWorker(
                worker_id=worker.worker_id,
                pid=worker.pid,
                signal=spec.drain_signal,
                deadline_t=worker.deadline_t,
                reason=f"{worker.worker_id} adopted while draining: drain signal repeated",
            )
        )
    elif worker.state is S.STOPPING:
        _repeat_stop(step, worker, "adopted while stopping: signal repeated")


def _lost(step: _Step, event: e.WorkerLost) -> None:
    worker = step.worker(event.worker_id, event)
    if worker is None:
        return
    step.exit_worker(worker, failure=False, why=f"lost: {event.reason}")


def _gpu_sampled(step: _Step, event: e.GpuSampled) -> None:
    gpu = step.gpus.get(event.gpu_id)
    if gpu is None:
        return  # a GPU outside the configured inventory
    rules = step.config.cordon
    transient: set[str] = set(event.throttle_reasons & rules.throttle_reasons)
    notes = [f"throttled ({r})" for r in sorted(transient)]
    if event.temperature_c >= rules.max_temperature_c:
        transient.add("thermal")
        notes.append(f"{event.temperature_c:g} C >= {rules.max_temperature_c:g} C")
    if event.memory_total_bytes:
        fraction = event.memory_used_bytes / event.memory_total_bytes
        # Full memory is normal on a GPU our own worker holds (an engine reserves it).
        if fraction >= rules.max_memory_fraction and not any(
            gpu.gpu_id in w.gpus for w in step.workers.values()
        ):
            transient.add("memory")
            notes.append(f"memory {fraction:.0%} used by others >= {rules.max_memory_fraction:.0%}")
    changes: dict[str, Any] = {
        "memory_used_bytes": event.memory_used_bytes,
        "memory_total_bytes": event.memory_total_bytes,
        "temperature_c": event.temperature_c,
    }
    if not (transient or event.new_errors):
        if gpu.clean_since_t is None:
            changes["clean_since_t"] = step.t
        gpu = replace(gpu, **changes)
        step.put_gpu(gpu)
        step.expire_transient_cordon(gpu)
        return
    gpu = replace(gpu, **changes)
    causes = set(gpu.causes)
    if event.new_errors:
        causes.add("errors")
        notes.append(f"{event.new_errors} new XID/ECC error(s)")
    why = f"GPU {gpu.gpu_id}: " + "; ".join(notes)
    step.set_causes(gpu, frozenset(causes | transient), None, why)
    if event.new_errors:
        step.raise_alert("gpu_errors", gpu.gpu_id, why)
        for worker in step.workers_on(gpu.gpu_id):
            if worker.state in COUNTED:
                step.drain(worker, "gpu_errors", f"{why}: moving {worker.worker_id} elsewhere")


def _gpu_lost(step: _Step, event: e.GpuLost) -> None:
    gpu = step.gpus.get(event.gpu_id)
    if gpu is None:
        return
    why = f"GPU {gpu.gpu_id} lost: {event.error}"
    step.set_causes(gpu, gpu.causes | {"lost"}, None, why)
    step.raise_alert("gpu_lost", gpu.gpu_id, why)
    for worker in step.workers_on(gpu.gpu_id):
        if worker.state in COUNTED or worker.state is S.DRAINING:
            step.terminate(worker, "gpu_lost", f"{why}: {worker.worker_id} replaced elsewhere")


_HANDLERS: dict[type, Callable[[_Step, Any], None]] = {
    e.Tick: _tick,
    e.Configured: _configured,
    e.AutoscalingPaused: _paused,
    e.AutoscalingResumed: _resumed,
    e.PoolPinned: _pinned,
    e.DrainRequested: _drain_requested,
    e.GpuCordonRequested: _cordon_requested,
    e.GpuUncordonRequested: _uncordon_requested,
    e.QueueSampled: _sampled,
    e.LoadSampled: _sampled,
    e.SourceDown: _source_down,
    e.WorkerStarted: _started,
    e.WorkerReady: _ready,
    e.WorkerExited: _exited,
    e.SpawnFailed: _spawn_failed,
    e.WorkerAdopted: _adopted,
    e.WorkerLost: _lost,
    e.GpuSampled: _gpu_sampled,
    e.GpuLost: _gpu_lost,
}
