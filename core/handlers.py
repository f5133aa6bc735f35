"""The reducer's handlers: one function per event type, each working on a :class:`~core.step.Step`.

``HANDLERS`` maps every event type the reducer knows to its handler; a handler changes the state
only through the step (whose lifecycle changes go through :mod:`core.lifecycle`) and appends the
commands its event calls for.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

from core import commands as c
from core import drains, engines
from core import events as e
from core.config import AUTO, Config, PoolSpec
from core.errors import ConfigError, Refused, UnknownSubject
from core.lifecycle import ASLEEP, COUNTED, DEADLINE_ACTIONS, Trigger, WorkerState
from core.policies import POLICY_ALERTS
from core.records import replace
from core.state import Gpu, State, Worker, split_worker_id
from core.step import Step, retry_order, unobserved_s
from core.vocabulary import (
    COUNTED_AT_STOP,
    AlertName,
    CordonCause,
    DecisionSource,
    StopCause,
    as_cordon_causes,
)

__all__ = ["HANDLERS", "check_seen", "heartbeat_only", "seen_only"]

S = WorkerState


def _sigterm(step: Step, worker: Worker, spec: PoolSpec) -> None:
    if worker.state in (S.FALLING_ASLEEP, S.WAKING):
        call = "sleep" if worker.state is S.FALLING_ASLEEP else "wake"
        cause = StopCause.SLEEP_FAILED if call == "sleep" else StopCause.WAKE_FAILED
        why = (
            f"{worker.worker_id} did not answer its {call} call within "
            f"{engines.call_deadline_s(spec):g}s: stopping it"
        )
        step.raise_alert(AlertName.ENGINE_CONTROL, worker.worker_id, why)
        step.terminate(worker, cause, why)
        return
    if spec.is_engine:
        in_flight = "unknown" if worker.in_flight_requests is None else worker.in_flight_requests
        step.terminate(
            worker,
            StopCause.DRAIN_DEADLINE,
            f"{worker.worker_id} still has {in_flight} request(s) in flight "
            f"{drains.engine_drain_timeout_s(spec):g}s after it left routing: SIGTERM",
        )
        return
    if spec.drain_timeout_s != AUTO:
        # The reason older logs recorded for a fixed deadline.
        ran = f"{drains.drain_timeout(spec, ())[0]:g}s after the drain signal"
    else:
        allowed_s, measured = _drain_deadline(worker)
        ran = f"{allowed_s:g}s after the drain signal " + (
            "(its measured deadline)"
            if measured
            else f"(the start value in auto, before {drains.MIN_DRAINS} drains were measured)"
        )
    step.measure_drain(worker, cut=True)
    step.terminate(
        worker, StopCause.DRAIN_DEADLINE, f"{worker.worker_id} still running {ran}: SIGTERM"
    )


def _drain_deadline(worker: Worker) -> tuple[float, bool]:
    """The deadline an auto pool's ``worker`` was given for its drain, in seconds after its
    drain signal, and whether it was measured."""
    if worker.drain_deadline_s is not None:
        return worker.drain_deadline_s, worker.drain_measured
    # A drain begun by a deo that kept only the start of a drain it measured.
    if worker.drain_started_t is not None and worker.deadline_t is not None:
        return round(worker.deadline_t - worker.drain_started_t, 3), True
    return drains.START_S, False


def _sigkill(step: Step, worker: Worker, spec: PoolSpec) -> None:
    step.transition(worker, Trigger.KILL, deadline_t=step.t + spec.stop_timeout_s)
    step.commands.append(
        c.KillWorker(
            worker_id=worker.worker_id,
            pid=worker.pid,
            reason=f"{worker.worker_id} still running {spec.stop_timeout_s:g}s after SIGTERM: "
            f"SIGKILL to its process group",
        )
    )


def _give_up(step: Step, worker: Worker, spec: PoolSpec) -> None:
    if worker.pid is None:
        why = f"{worker.worker_id} never started"
        failure = step.is_failure(worker)
        step.exit_worker(worker, failure=failure, why=why, trigger=Trigger.GIVE_UP)
        return
    # Its process may live on, holding its GPUs: no new worker goes there until a person looks.
    why = f"{worker.worker_id} did not exit {spec.stop_timeout_s:g}s after SIGKILL"
    step.raise_alert(AlertName.UNKILLABLE_WORKER, worker.worker_id, why + "; GPUs cordoned")
    for gpu_id in worker.gpus:
        gpu = step.gpus.get(gpu_id)
        if gpu is not None:
            causes = gpu.causes | {CordonCause.UNKILLABLE_WORKER}
            step.set_causes(gpu, causes, None, why)
    step.exit_worker(worker, failure=False, why=why, trigger=Trigger.GIVE_UP)


#: What each deadline action of the lifecycle (``DEADLINE_ACTIONS``) does besides its transition.
_ON_DEADLINE: Mapping[Trigger, Callable[[Step, Worker, PoolSpec], None]] = MappingProxyType(
    {
        Trigger.RELEASE: engines.release_at_deadline,
        Trigger.TERMINATE: _sigterm,
        Trigger.KILL: _sigkill,
        Trigger.GIVE_UP: _give_up,
    }
)


def _tick(step: Step, event: e.Tick) -> None:
    t = step.t
    unobserved = unobserved_s(step.last_tick_t, t, event.interval_s)
    step.last_tick_t = t
    # The first tick after a stall judges no worker: exits, readiness and heartbeats queued
    # while deo was not running come in first. The next tick judges whatever comes, so even a
    # deo that stalls on every tick still judges every other one.
    skip = unobserved > 0 and not step.last_tick_skipped
    step.last_tick_skipped = skip
    if unobserved > 0:
        _credit_liveness(step, unobserved)
    if not skip:
        _judge_workers(step)
    _tick_pools(step, judge=not skip)
    for gpu_id in sorted(step.gpus):
        step.expire_transient_cordon(step.gpus[gpu_id])


def _credit_liveness(step: Step, unobserved: float) -> None:
    """Time deo did not observe does not count against a worker's heartbeat: every last sign of
    life moves forward by it (never past now). Drain, stop and start deadlines stay: the worker
    had that time, and what it did with it (an exit, a readiness report) is judged on the next
    tick, once the reports queued during the stall are in."""
    t = step.t
    last_seen = step._own("last_seen")
    for worker_id, seen_t in last_seen.items():
        last_seen[worker_id] = min(t, seen_t + unobserved)


#: What a stop for a start timeout advises.
_LONGER = "raise start_timeout_s if the workers take longer to come up"


def _judge_workers(step: Step) -> None:
    """Deadlines, start timeouts and heartbeat expiry of every worker."""
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
        action = DEADLINE_ACTIONS.get(state)
        if action is not None:
            assert worker.deadline_t is not None
            if t >= worker.deadline_t:
                _ON_DEADLINE[action](step, worker, spec)
            continue
        # A worker that never came up is a failed start however long it took; one that went
        # silent is a failure early in its life (as an exit would be) or if it never showed a
        # sign of life once started.
        if state is S.REQUESTED and t - worker.requested_t >= spec.start_timeout_s:
            why = f"not started {spec.start_timeout_s:g}s after it was requested ({_LONGER})"
            step.stop_failed(worker, StopCause.START_TIMEOUT, why, failed=True)
        elif (
            state is S.STARTING
            and spec.awaits_ready
            and worker.started_t is not None
            and (t - worker.started_t >= spec.start_timeout_s)
        ):
            why = f"not ready {spec.start_timeout_s:g}s after starting ({_LONGER})"
            step.stop_failed(worker, StopCause.START_TIMEOUT, why, failed=True)
        elif (
            state in (S.STARTING, S.ACTIVE)
            and spec.heartbeat_grace_s is not None
            and t - last_seen.get(worker.worker_id, t) > spec.heartbeat_grace_s
        ):
            why = (
                f"silent for {t - last_seen[worker.worker_id]:.0f}s > grace "
                f"{spec.heartbeat_grace_s:g}s: hung, replacing it"
            )
            step.stop_failed(worker, StopCause.HUNG, why, failed=step.failed_start(worker))


def _tick_pools(step: Step, *, judge: bool) -> None:
    """End crash loops that a healthy worker disproves, alert on stale pressure (when ``judge``),
    and mark the pools that time alone may change."""
    t = step.t
    for name in sorted(step.pools):
        pool = step.pools[name]
        spec = pool.spec
        if pool.failures:
            pool = step.prove_slots(pool)
            step.put_pool(pool)
        stale = (
            judge
            and pool.last_sample_t is not None
            and t - pool.last_sample_t > spec.metrics_stale_s
        )
        if stale and (AlertName.PRESSURE_STALE, name) not in step.alerts:
            assert pool.last_sample_t is not None
            step.raise_alert(
                AlertName.PRESSURE_STALE,
                name,
                f"no pressure sample for {t - pool.last_sample_t:.0f}s > "
                f"{spec.metrics_stale_s:g}s: holding {pool.target} workers",
            )
        # Time alone changes a pool's count only when a crash-loop backoff has run out, or when
        # an alert says it is short (of GPUs, of its minimum): reconcile just those.
        if pool.wake_held and pool.wake_hold_until_t is not None and t >= pool.wake_hold_until_t:
            step.put_pool(engines.end_wake_hold(step, pool, "its time is up"))
        if (pool.retries and t >= pool.backoff_until_t) or any(
            subject == name for _, subject in step.alerts
        ):
            step.dirty_pools.add(name)


def _configured(step: Step, event: e.Configured) -> None:
    config: Config = event.config
    held = {g: w.worker_id for w in step.workers.values() for g in w.gpus}
    for gpu_id, worker_id in sorted(held.items()):
        if gpu_id not in config.gpus:
            raise ConfigError(
                f"gpus: GPU {gpu_id!r} is held by worker {worker_id}; drain it before removing "
                f"the GPU from the configuration"
            )
    for spec in config.pools:
        live = next((w for w in step.workers.values() if w.pool == spec.name), None)
        old = step.pools.get(spec.name)
        if (
            live is not None
            and old is not None
            and (old.spec.kind, old.spec.engine)
            != (
                spec.kind,
                spec.engine,
            )
        ):
            was = f"{old.spec.kind} ({old.spec.engine or 'no engine'})"
            becomes = f"{spec.kind} ({spec.engine or 'no engine'})"
            raise ConfigError(
                f"pools.{spec.name}.kind: pool {spec.name} is {was} and {live.worker_id} still "
                f"runs; remove the pool (or let it reach 0) before it becomes {becomes}"
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
        policy = step.policies.build(spec.policy)  # raises ConfigError naming the bad parameter
        pool = step.pools.get(spec.name)
        if pool is None:
            initial = policy.initial_target(spec.min_workers, spec.max_workers)
            pool = step.set_desired(
                step.declare_pool(spec),
                initial,
                DecisionSource.CONFIG,
                f"pool {spec.name} declared",
            )
            step.put_pool(pool)
            continue
        # The same policy with other parameters keeps what it measured (rates, start-up): those
        # do not depend on the parameters, and a policy without them acts as on a cold pool.
        same_policy = pool.spec.policy.name == spec.policy.name
        memory = pool.policy_memory if same_policy else None
        if not same_policy:
            # What the old policy reported, nobody reports now: the new one raises its own.
            for alert in POLICY_ALERTS:
                step.resolve_alert(alert, spec.name, f"the pool's policy is now {spec.policy.name}")
        pinned = pool.pinned
        if pinned is not None:
            pinned = min(max(pinned, spec.min_workers), spec.max_workers)
        updated = replace(pool, spec=spec, removed=False, policy_memory=memory, pinned=pinned)
        if _runs_another_program(pool.spec, spec):
            # Its drains measured the program it ran before, whose groups may be far shorter.
            updated = replace(updated, drains=())
        if pool.retries:
            # Changed backoff rules apply to the crash loop in progress.
            rules = spec.crash_loop
            retries = retry_order(pool.retries, rules)
            first_t, first_failures = retries[0]
            updated = replace(
                updated,
                retries=retries,
                backoff_until_t=first_t + rules.backoff_s(first_failures),
            )
        # A policy that never reacts to pressure (static) sets its count from configuration.
        wanted = (
            policy.initial_target(spec.min_workers, spec.max_workers)
            if policy.reacts_to is None
            else pool.desired
        )
        reconfigured = f"pool {spec.name} reconfigured"
        step.put_pool(step.set_desired(updated, wanted, DecisionSource.CONFIG, reconfigured))
    for name, pool in sorted(step.pools.items()):
        if name not in declared and not pool.removed:
            if any(w.pool == name for w in step.workers.values()):
                step.put_pool(replace(pool, removed=True))
                step.dirty_pools.add(name)
            else:
                step.forget_pool(pool)
    step.dirty_pools.update(step.pools)  # the GPU inventory may have changed for every pool


def _runs_another_program(before: PoolSpec, after: PoolSpec) -> bool:
    """Whether a reconfigured pool's workers run another program (command, environment or
    kind): what its workers did before says nothing of how long they take now."""
    return (before.argv, before.env, before.kind) != (after.argv, after.env, after.kind)


def _paused(step: Step, event: e.AutoscalingPaused) -> None:
    if event.pool is None:
        step.paused_all = True
    else:
        step.put_pool(replace(step.pool(event.pool, event), paused=True))


def _resumed(step: Step, event: e.AutoscalingResumed) -> None:
    resumed = "autoscaling resumed"
    if event.pool is None:
        step.paused_all = False
        for _name, pool in list(step.pools.items()):
            if pool.paused or pool.wake_held:
                step.put_pool(engines.end_wake_hold(step, replace(pool, paused=False), resumed))
    else:
        pool = replace(step.pool(event.pool, event), paused=False)
        step.put_pool(engines.end_wake_hold(step, pool, resumed))


def _pinned(step: Step, event: e.PoolPinned) -> None:
    pool = step.pool(event.pool, event)
    spec = pool.spec
    if event.count is None:
        if pool.pinned is not None:
            step.put_pool(
                replace(
                    pool,
                    pinned=None,
                    desired=pool.pinned,
                    wake_held=False,
                    wake_hold_until_t=None,
                )
            )
        return
    if not spec.min_workers <= event.count <= spec.max_workers:
        raise Refused(
            f"PoolPinned: count {event.count} is outside pool {spec.name!r} bounds "
            f"[{spec.min_workers}, {spec.max_workers}]"
        )
    if event.count != pool.target:
        step.commands.append(
            c.ScalePool(
                pool=spec.name,
                previous=pool.target,
                target=event.count,
                source=DecisionSource.OPERATOR,
                reason=f"operator pinned {spec.name} at {event.count} workers",
            )
        )
    step.put_pool(replace(pool, pinned=event.count, wake_held=False, wake_hold_until_t=None))
    step.dirty_pools.add(spec.name)


def _drain_requested(step: Step, event: e.DrainRequested) -> None:
    worker = step.worker(event.worker_id, event)
    if worker is None:
        # An operator who is told "draining" looks for it to finish; it finished before.
        raise Refused(f"DrainRequested: worker {event.worker_id!r} already exited")
    why = f"operator asked to drain {worker.worker_id}"
    if worker.state in (S.FALLING_ASLEEP, S.SLEEPING):
        # Nothing in flight and its memory (being) released: it exits now.
        step.terminate(worker, StopCause.OPERATOR, f"{why} ({worker.state.value}): stopping it")
        return
    if worker.state not in COUNTED and worker.state is not S.GOING_TO_SLEEP:
        return  # already leaving
    step.drain(worker, StopCause.OPERATOR, why)


def _cordon_requested(step: Step, event: e.GpuCordonRequested) -> None:
    gpu = step.gpu(event.gpu_id, event)
    step.set_causes(gpu, gpu.causes | {CordonCause.OPERATOR}, gpu.clean_since_t, "operator cordon")


def _uncordon_requested(step: Step, event: e.GpuUncordonRequested) -> None:
    gpu = step.gpu(event.gpu_id, event)
    step.set_causes(gpu, frozenset(), step.t, "operator uncordon")
    for alert in (AlertName.GPU_ERRORS, AlertName.GPU_LOST):
        step.resolve_alert(alert, gpu.gpu_id, "operator uncordon")


def _cluster_unreachable(step: Step, event: e.ClusterUnreachable) -> None:
    step.raise_alert(
        AlertName.CLUSTER_UNREACHABLE,
        event.address,
        f"the cluster at {event.address} does not answer ({event.error}): no worker is taken "
        f"for lost until it does",
    )


def _cluster_reachable(step: Step, event: e.ClusterReachable) -> None:
    step.resolve_alert(AlertName.CLUSTER_UNREACHABLE, event.address, "the cluster answers again")


def _sampled(step: Step, event: e.QueueSampled | e.LoadSampled) -> None:
    step.sampled(step.pool(event.pool, event), event)


def _source_down(step: Step, event: e.SourceDown) -> None:
    pool = step.pool(event.pool, event)
    step.put_pool(replace(pool, source_error=event.error))
    if pool.source_error is None:
        return  # one failed read between good ones is no outage: alert on the second in a row
    step.raise_alert(
        AlertName.SOURCE_DOWN,
        pool.spec.name,
        f"pressure source of {pool.spec.name} down ({event.error}): holding {pool.target} workers",
    )


def _started(step: Step, event: e.WorkerStarted) -> None:
    worker = step.worker(event.worker_id, event)
    if worker is None:
        return
    if worker.pid is not None:
        raise Refused(
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
    if worker.state is S.STARTING and not spec.awaits_ready:
        step.transition(worker, Trigger.READY)
        step.came_up(worker)
    elif worker.state is S.DRAINING:
        step.signal_drain(worker, f"{worker.worker_id} started after its drain was decided")
    elif worker.state in (S.STOPPING, S.KILLED):
        _repeat_stop(step, worker, "started after it was told to stop")


def _repeat_stop(step: Step, worker: Worker, why: str) -> None:
    if worker.state is S.KILLED:
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


def _ready(step: Step, event: e.WorkerReady) -> None:
    worker = step.worker(event.worker_id, event)
    if worker is None:
        return
    was = worker.state
    step.transition(worker, Trigger.READY)  # refused before the worker started
    step.seen(worker.worker_id)
    if was is S.STARTING:
        step.came_up(worker)


def heartbeat_only(state: State, event: e.WorkerHeartbeat) -> State:
    """One worker's sign of life (older logs; code embedding the core), reduced without a full
    step: it only refreshes that worker."""
    t = max(state.now, event.t)
    worker = state.workers.get(event.worker_id)
    if worker is None:
        Step(state, t).worker(event.worker_id, event)  # a late heartbeat, or an error
        return replace(state, now=t)
    last_seen = state.last_seen.copy()
    last_seen[worker.worker_id] = t
    return replace(state, now=t, last_seen=MappingProxyType(last_seen))


def check_seen(state: State, worker_id: str, what: str = "heartbeat") -> bool:
    """Whether a sign of life of ``worker_id`` refreshes a live worker: True if it is live, False
    if it already exited (a late report), :class:`~core.errors.UnknownSubject` (naming ``what``
    was refused) if deo never made it."""
    if worker_id in state.workers:
        return True
    parsed = split_worker_id(worker_id)
    if parsed is not None:
        next_index = state.next_index_of(parsed[0])
        if next_index is not None and parsed[1] < next_index:
            return False
    raise UnknownSubject(f"{what}: unknown worker {worker_id!r}")


def seen_only(state: State, event: e.WorkersSeen) -> State:
    """A batch of signs of life, reduced without a full step: it only refreshes live workers.

    Workers that exited since they were seen are skipped, and so are those of a pool removed
    since and ids this core never made: a replay under another configuration (``deo replay
    --set``) meets recorded batches naming workers it never spawned, and the rest of the batch
    must still refresh its workers. Unknown ids are refused earlier, where a sighting enters deo
    (:func:`check_seen`), so a live run never logs one."""
    t = max(state.now, event.t)
    seen_t = t if event.seen_t is None else min(t, event.seen_t)
    last_seen = state.last_seen.copy()
    for worker_id in event.worker_ids:
        if worker_id in state.workers:
            last_seen[worker_id] = max(seen_t, last_seen.get(worker_id, seen_t))
    return replace(state, now=t, last_seen=MappingProxyType(last_seen))


def _exited(step: Step, event: e.WorkerExited) -> None:
    worker = step.worker(event.worker_id, event)
    if worker is None:
        return
    if event.signal is not None:
        how = f"killed by signal {event.signal}"
    else:
        how = f"exited with code {event.exit_code}"
    failure = step.is_failure(worker)
    step.exit_worker(worker, failure=failure, why=how)


def _spawn_failed(step: Step, event: e.SpawnFailed) -> None:
    worker = step.worker(event.worker_id, event)
    if worker is None:
        return
    if worker.pid is not None:
        raise Refused(f"SpawnFailed: worker {worker.worker_id!r} is running as pid {worker.pid}")
    # (Not again for one stopped as a failed start: it was counted then.)
    failure = worker.stop_cause not in COUNTED_AT_STOP
    step.exit_worker(worker, failure=failure, why=f"failed to spawn: {event.error}")


def _adopted(step: Step, event: e.WorkerAdopted) -> None:
    worker = step.worker(event.worker_id, event)
    if worker is None:
        raise Refused(f"WorkerAdopted: worker {event.worker_id!r} already exited")
    if worker.pid is None:
        raise Refused(f"WorkerAdopted: worker {event.worker_id!r} never started")
    step.seen(worker.worker_id)
    if worker.state is S.DRAINING:
        # The drain signal may never have left before the restart: sending it again is harmless.
        why = f"{worker.worker_id} adopted while draining: drain signal repeated"
        step.signal_drain(worker, why)
    elif worker.state in (S.STOPPING, S.KILLED):
        _repeat_stop(step, worker, "adopted while stopping: signal repeated")
    else:
        engines.repeat_control(step, worker)


def _lost(step: Step, event: e.WorkerLost) -> None:
    worker = step.worker(event.worker_id, event)
    if worker is None:
        return
    step.exit_worker(worker, failure=False, why=f"lost: {event.reason}")


def _leftovers(step: Step, event: e.LeftoverProcesses) -> None:
    why = f"{event.count} process(es) of {event.worker_id} left running: {event.detail}"
    step.raise_alert(AlertName.LEFTOVER_PROCESSES, event.worker_id, why)


def _leftovers_stopped(step: Step, event: e.LeftoverProcessesStopped) -> None:
    # Resolved once they are gone, so a pool of leaky workers keeps no alert per worker; the
    # log keeps both. Survivors of SIGKILL keep it raised.
    why = f"every process {event.worker_id} left behind is gone"
    step.resolve_alert(AlertName.LEFTOVER_PROCESSES, event.worker_id, why)


def _gpu_sampled(step: Step, event: e.GpuSampled) -> None:
    gpu = step.gpus.get(event.gpu_id)
    if gpu is None:
        return  # a GPU outside the configured inventory
    rules = step.config.cordon
    transient: set[str] = set(as_cordon_causes(event.throttle_reasons & rules.throttle_reasons))
    notes = [f"throttled ({r})" for r in sorted(transient)]
    if event.temperature_c >= rules.max_temperature_c:
        transient.add(CordonCause.THERMAL)
        notes.append(f"{event.temperature_c:g} C >= {rules.max_temperature_c:g} C")
    if event.memory_total_bytes:
        fraction = event.memory_used_bytes / event.memory_total_bytes
        # Full memory is normal on a GPU our own worker holds (an engine reserves it).
        if fraction >= rules.max_memory_fraction and not any(
            gpu.gpu_id in w.gpus for w in step.workers.values()
        ):
            transient.add(CordonCause.MEMORY)
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
        causes.add(CordonCause.ERRORS)
        notes.append(f"{event.new_errors} new XID/ECC error(s)")
    why = f"GPU {gpu.gpu_id}: " + "; ".join(notes)
    step.set_causes(gpu, frozenset(causes | transient), None, why)
    if event.new_errors:
        step.raise_alert(AlertName.GPU_ERRORS, gpu.gpu_id, why)
        for worker in step.workers_on(gpu.gpu_id):
            moving = f"{why}: moving {worker.worker_id} elsewhere"
            if worker.state in COUNTED:
                step.drain(worker, StopCause.GPU_ERRORS, moving)
            elif worker.state in ASLEEP:  # an engine asleep there would wake on a bad GPU
                step.terminate(worker, StopCause.GPU_ERRORS, moving)


def _gpu_lost(step: Step, event: e.GpuLost) -> None:
    gpu = step.gpus.get(event.gpu_id)
    if gpu is None:
        return
    why = f"GPU {gpu.gpu_id} lost: {event.error}"
    step.set_causes(gpu, gpu.causes | {CordonCause.LOST}, None, why)
    step.raise_alert(AlertName.GPU_LOST, gpu.gpu_id, why)
    for worker in step.workers_on(gpu.gpu_id):
        if worker.state in COUNTED or worker.state in ASLEEP or worker.state is S.DRAINING:
            replacing = f"{why}: {worker.worker_id} replaced elsewhere"
            step.terminate(worker, StopCause.GPU_LOST, replacing)


#: Read-only: no handler is added at run time.
HANDLERS: Mapping[type, Callable[[Step, Any], None]] = MappingProxyType(
    {
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
        e.ClusterUnreachable: _cluster_unreachable,
        e.ClusterReachable: _cluster_reachable,
        e.WorkerStarted: _started,
        e.WorkerReady: _ready,
        e.WorkerExited: _exited,
        e.SpawnFailed: _spawn_failed,
        e.WorkerAdopted: _adopted,
        e.WorkerLost: _lost,
        e.LeftoverProcesses: _leftovers,
        e.LeftoverProcessesStopped: _leftovers_stopped,
        e.GpuSampled: _gpu_sampled,
        e.GpuLost: _gpu_lost,
        **engines.ENGINE_HANDLERS,
    }
)
