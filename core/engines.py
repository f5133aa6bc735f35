"""What the reducer does for inference engines (pools of kind ``engine``), beside workers.

An engine scaled down goes to sleep rather than exiting: it leaves routing (GOING_TO_SLEEP) until
its in-flight requests reach 0 or its drain timeout passes, is sent the sleep call
(FALLING_ASLEEP), and sleeps once it confirms (SLEEPING), keeping its process, port and GPUs. An
engine scaled up is woken before a new one is started. A failed call is sent again up to the
pool's ``control_attempts``, then the engine is stopped (and, for a wake, replaced). At most
``max_asleep`` engines of a pool sleep; past that, the one asleep longest is stopped.

Each engine gets the lowest port of its pool's range that no live engine holds; a drained engine
is stopped (SIGTERM: engines take no drain signal) once its in-flight requests reach 0.

The functions here work on an :class:`EngineStep` (the part of :class:`~core.step.Step` they
use, so that this module sits below ``core.step``); the handlers are in :data:`ENGINE_HANDLERS`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, Protocol

from core import commands as c
from core import drains
from core import events as e
from core.config import PoolSpec
from core.errors import Refused
from core.lifecycle import ASLEEP, Trigger, WorkerState
from core.records import replace
from core.state import Gpu, PoolState, Worker
from core.vocabulary import AlertName, DecisionSource, StopCause

__all__ = [
    "ENGINE_HANDLERS",
    "EngineStep",
    "call_deadline_s",
    "drain_done",
    "enforce_max_asleep",
    "free_port",
    "on_cordoned_gpu",
    "release",
    "repeat_control",
    "send_to_sleep",
    "shrink",
    "victims",
    "wake_for",
    "wake_one",
]

S = WorkerState


class EngineStep(Protocol):
    """What the engine rules use of a reducer step (:class:`core.step.Step` provides it)."""

    t: float
    pools: Mapping[str, PoolState]
    workers: Mapping[str, Worker]
    gpus: Mapping[str, Gpu]
    worker_counts: Mapping[str, tuple[int, int]]
    commands: list[c.Command]
    dirty_pools: set[str]

    def put_worker(self, worker: Worker) -> None: ...
    def put_pool(self, pool: PoolState) -> None: ...
    def pool(self, name: str, event: e.Event) -> PoolState: ...
    def worker(self, worker_id: str, event: e.Event) -> Worker | None: ...
    def raise_alert(self, alert: AlertName, subject: str, reason: str) -> None: ...
    def resolve_alert(self, alert: AlertName, subject: str, reason: str) -> None: ...
    def transition(self, worker: Worker, trigger: Trigger, **changes: Any) -> Worker: ...
    def came_up(self, worker: Worker) -> None: ...
    def drain(self, worker: Worker, cause: StopCause, why: str) -> None: ...
    def terminate(self, worker: Worker, cause: StopCause, why: str) -> None: ...


def call_deadline_s(spec: PoolSpec) -> float:
    """How long deo waits for the answer to a sleep or wake call before it gives up on the
    engine: the call's own timeout (a confirmation included) and as long again for the report
    to come back."""
    return 2 * spec.control_timeout_s


def free_port(step: EngineStep, spec: PoolSpec) -> int | None:
    """The lowest port of the pool's range that no live engine holds, or None."""
    held = {w.port for w in step.workers.values() if w.port is not None}
    return next((port for port in spec.port_range() if port not in held), None)


def _sleep_command(worker: Worker, spec: PoolSpec, attempt: int, why: str) -> c.SleepEngine:
    assert worker.port is not None and spec.engine is not None, worker
    return c.SleepEngine(
        worker_id=worker.worker_id,
        engine=spec.engine,
        port=worker.port,
        level=spec.sleep_level,
        timeout_s=spec.control_timeout_s,
        attempt=attempt,
        reason=why,
    )


def _wake_command(worker: Worker, spec: PoolSpec, attempt: int, why: str) -> c.WakeEngine:
    assert worker.port is not None and spec.engine is not None, worker
    return c.WakeEngine(
        worker_id=worker.worker_id,
        engine=spec.engine,
        port=worker.port,
        timeout_s=spec.control_timeout_s,
        attempt=attempt,
        reason=why,
    )


# --- sleep ----------------------------------------------------------------------------------------


def _sleep(step: EngineStep, worker: Worker, why: str) -> None:
    """An active engine leaves routing; the sleep call goes once a count reported after that
    says nothing is in flight (a count from while it was routed is forgotten with the
    transition: the router may have sent it requests since), or at the drain timeout."""
    spec = step.pools[worker.pool].spec
    worker = step.transition(
        worker,
        Trigger.SLEEP,
        deadline_t=step.t + drains.engine_drain_timeout_s(spec),
        control_attempts=0,
    )
    step.commands.append(
        c.DrainEngine(
            worker_id=worker.worker_id,
            deadline_t=step.t + drains.engine_drain_timeout_s(spec),
            reason=f"{why}: {worker.worker_id} to sleep once its in-flight requests finish, at "
            f"most {drains.engine_drain_timeout_s(spec):g}s",
        )
    )
    step.dirty_pools.add(worker.pool)


def release(step: EngineStep, worker: Worker, why: str) -> None:
    """Send the sleep call (again, after a failure); its answer is awaited until a deadline."""
    spec = step.pools[worker.pool].spec
    attempt = worker.control_attempts + 1
    step.transition(
        worker,
        Trigger.RELEASE,
        deadline_t=step.t + call_deadline_s(spec),
        control_attempts=attempt,
    )
    step.commands.append(_sleep_command(worker, spec, attempt, why))


def _asleep_of(step: EngineStep, pool: str) -> list[Worker]:
    return [w for w in step.workers.values() if w.pool == pool and w.state in ASLEEP]


def _oldest_sleeping(asleep: list[Worker]) -> Worker | None:
    sleeping = [w for w in asleep if w.state is S.SLEEPING]
    if not sleeping:
        return None
    return min(sleeping, key=lambda w: (w.asleep_t or 0.0, w.index))


def on_cordoned_gpu(step: EngineStep, worker: Worker) -> bool:
    """Whether one of ``worker``'s GPUs is cordoned (by the operator, a GPU error or a limit)."""
    return any(step.gpus[g].causes for g in worker.gpus if g in step.gpus)


def _can_sleep(step: EngineStep, pool: PoolState) -> bool:
    """Whether an active engine of ``pool`` scaled down now would go to sleep (not exit)."""
    spec = pool.spec
    if pool.removed or spec.max_asleep == 0:
        return False
    asleep = _asleep_of(step, spec.name)
    return len(asleep) < spec.max_asleep or _oldest_sleeping(asleep) is not None


def victims(
    step: EngineStep,
    pool: PoolState,
    counted: list[Worker],
    excess: int,
    order: Callable[[Worker], tuple[int, ...]],
) -> list[Worker]:
    """The ``excess`` engines to take out of service, in ``order`` (engines on cordoned GPUs,
    then those not serving yet, newest first), except that while an active engine can go to
    sleep, the active ones go before any starting or waking one: a sleep is undone in seconds,
    a cold start thrown away costs minutes."""
    ranked = sorted(counted, key=order)
    if not _can_sleep(step, pool):
        return ranked[:excess]

    ranked.sort(key=lambda w: (not on_cordoned_gpu(step, w), w.state is not S.ACTIVE))  # stable
    return ranked[:excess]


def shrink(
    step: EngineStep, pool: PoolState, victims: list[Worker], why: str, cause: StopCause
) -> None:
    """Take ``victims`` (counted engines, in the order they should go) out of service: an active
    one sleeps while the pool's ``max_asleep`` allows (the one asleep longest stopped to make
    room), any other is stopped; a removed pool's engines, or one on a cordoned GPU, are drained
    to exit."""
    spec = pool.spec
    for worker in victims:
        on_cordoned = on_cordoned_gpu(step, worker)
        if worker.state is not S.ACTIVE:
            # Not serving yet (or waking): nothing to finish and nothing worth keeping asleep.
            step.terminate(worker, cause, f"{why}: stopping {worker.worker_id} ({worker.state})")
            continue
        if pool.removed or on_cordoned or spec.max_asleep == 0:
            step.drain(worker, cause, why)
            continue
        asleep = _asleep_of(step, spec.name)
        if len(asleep) >= spec.max_asleep:
            oldest = _oldest_sleeping(asleep)
            if oldest is None:  # every sleeper still on its way: this one exits instead
                step.drain(worker, cause, f"{why} ({len(asleep)} going to sleep already)")
                continue
            step.terminate(
                oldest,
                StopCause.MAX_ASLEEP,
                f"{spec.name}: {worker.worker_id} goes to sleep and at most {spec.max_asleep} "
                f"may: stopping {oldest.worker_id}, asleep longest",
            )
        _sleep(step, worker, f"{why}: {worker.worker_id} goes to sleep")


def enforce_max_asleep(step: EngineStep, pool: PoolState) -> None:
    """Stop the engines asleep longest while more than ``max_asleep`` sleep (every one, once the
    pool is removed)."""
    spec = pool.spec
    limit = 0 if pool.removed else spec.max_asleep
    asleep = _asleep_of(step, spec.name)
    while len(asleep) > limit:
        oldest = _oldest_sleeping(asleep)
        victim = oldest or min(asleep, key=lambda w: w.index)
        why = (
            f"pool {spec.name} removed: stopping {victim.worker_id} ({victim.state})"
            if pool.removed
            else f"{spec.name}: {len(asleep)} engines asleep > max_asleep {spec.max_asleep}: "
            f"stopping {victim.worker_id}, asleep longest"
        )
        cause = StopCause.POOL_REMOVED if pool.removed else StopCause.MAX_ASLEEP
        step.terminate(victim, cause, why)
        asleep.remove(victim)


# --- wake -----------------------------------------------------------------------------------------


def _send_wake(step: EngineStep, worker: Worker, attempt: int, why: str) -> None:
    spec = step.pools[worker.pool].spec
    step.transition(
        worker,
        Trigger.WAKE,
        deadline_t=step.t + call_deadline_s(spec),
        control_attempts=attempt,
        asleep_t=None,
    )
    step.commands.append(_wake_command(worker, spec, attempt, why))


def wake_for(step: EngineStep, pool: PoolState, count: int) -> int:
    """Wake engines toward the pool's target before any is started: first those going to sleep
    (their memory is still there: back in routing at once), then those asleep, the one asleep
    shortest first. One on a cordoned GPU is never put back in service there (a new engine
    starts elsewhere). Returns the new count."""
    name = pool.spec.name
    candidates = [
        w
        for w in step.workers.values()
        if w.pool == name
        and w.state in (S.GOING_TO_SLEEP, S.SLEEPING)
        and not on_cordoned_gpu(step, w)
    ]
    candidates.sort(key=lambda w: (w.state is S.SLEEPING, -(w.asleep_t or 0.0), w.index))
    for worker in candidates:
        if count >= pool.target:
            break
        why = f"{name} has {count} engines awake, target {pool.target}"
        if worker.state is S.GOING_TO_SLEEP:
            step.transition(worker, Trigger.WAKE, deadline_t=None, control_attempts=0)
            step.commands.append(
                c.CancelSleep(
                    worker_id=worker.worker_id,
                    reason=f"{why}: {worker.worker_id} stays awake (its sleep call was not sent)",
                )
            )
        else:
            _send_wake(step, worker, 1, f"{why}: waking {worker.worker_id}")
        count += 1
    return count


def send_to_sleep(step: EngineStep, worker: Worker, why: str) -> None:
    """Put one active engine to sleep (it leaves routing first), whatever its pool's target."""
    _sleep(step, worker, why)


def wake_one(step: EngineStep, worker: Worker, why: str) -> None:
    """Wake one engine going to sleep (its sleep call not sent: it stays) or asleep."""
    if worker.state is S.GOING_TO_SLEEP:
        step.transition(worker, Trigger.WAKE, deadline_t=None, control_attempts=0)
        step.commands.append(
            c.CancelSleep(
                worker_id=worker.worker_id,
                reason=f"{why}: {worker.worker_id} stays awake (its sleep call was not sent)",
            )
        )
    elif worker.state is S.SLEEPING:
        _send_wake(step, worker, 1, f"{why}: waking {worker.worker_id}")


# --- handlers -------------------------------------------------------------------------------------


def _engine(step: EngineStep, worker_id: str, event: e.Event) -> tuple[Worker, PoolSpec] | None:
    """The live engine ``worker_id`` with its pool's spec; None if it already exited; refused if
    it is no engine."""
    worker = step.worker(worker_id, event)
    if worker is None:
        return None
    spec = step.pools[worker.pool].spec
    if not spec.is_engine:
        raise Refused(
            f"{type(event).__name__}: {worker_id!r} is a worker of pool {spec.name!r}, not an "
            f"engine (kind = {spec.kind!r})"
        )
    return worker, spec


def _asleep(step: EngineStep, event: e.EngineAsleep) -> None:
    found = _engine(step, event.worker_id, event)
    if found is None:
        return
    worker, spec = found
    if worker.state is S.FALLING_ASLEEP:
        step.transition(
            worker, Trigger.ASLEEP, deadline_t=None, control_attempts=0, asleep_t=step.t
        )
        step.resolve_alert(AlertName.ENGINE_CONTROL, worker.worker_id, "engine asleep")
        step.dirty_pools.add(spec.name)
    elif worker.state is S.SLEEPING:
        step.transition(worker, Trigger.ASLEEP)  # confirmed after a restart
    # Any other state: a late answer (the engine was stopped, or woken since); nothing to do.


def _memory_holders_beside(step: EngineStep, worker: Worker) -> list[str]:
    """The other live workers that hold the memory of one of ``worker``'s GPUs."""
    gpus = set(worker.gpus)
    return sorted(
        other.worker_id
        for other in step.workers.values()
        if other.worker_id != worker.worker_id and other.holds_memory and gpus & set(other.gpus)
    )


def _awake(step: EngineStep, event: e.EngineAwake) -> None:
    found = _engine(step, event.worker_id, event)
    if found is None or found[0].state not in (S.WAKING, S.SLEEPING):
        return
    worker, spec = found
    woke_alone = worker.state is S.SLEEPING  # not woken by deo: something else did
    beside = _memory_holders_beside(step, worker) if woke_alone else []
    if woke_alone:
        outcome = (
            f"beside {', '.join(beside)}, which hold its GPUs' memory: sent back to sleep, not "
            "routed to"
            if beside
            else "back in service"
        )
        step.raise_alert(
            AlertName.ENGINE_CONTROL,
            worker.worker_id,
            f"{worker.worker_id} was to be asleep but says it is awake: {outcome}",
        )
    # The count from before it slept says nothing of what it will be sent: unknown until the
    # next sample, so a later drain waits for one rather than trusting a stale 0.
    worker = step.transition(
        worker,
        Trigger.AWAKE,
        deadline_t=None,
        control_attempts=0,
        asleep_t=None,
        in_flight_requests=None,
    )
    if beside:
        # Two holders of one GPU's memory is deo's invariant 1 broken by the world (alerted
        # until this sleep is confirmed): never routed to, back to sleep at once.
        _sleep(step, worker, f"{worker.worker_id} woke beside {', '.join(beside)}")
        return
    step.resolve_alert(AlertName.ENGINE_CONTROL, worker.worker_id, "engine awake")
    step.came_up(worker)
    step.dirty_pools.add(spec.name)


def _sleep_failed(step: EngineStep, event: e.EngineSleepFailed) -> None:
    found = _engine(step, event.worker_id, event)
    if found is None:
        return
    worker, spec = found
    if worker.state is not S.FALLING_ASLEEP:
        return  # a late answer
    tries = worker.control_attempts
    if tries < spec.control_attempts:
        release(
            step,
            worker,
            f"{worker.worker_id}'s sleep call failed ({event.error}): try "
            f"{tries + 1} of {spec.control_attempts}",
        )
        return
    why = f"{worker.worker_id} failed to sleep {tries} time(s) (last: {event.error}): stopping it"
    step.raise_alert(AlertName.ENGINE_CONTROL, worker.worker_id, why)
    step.terminate(worker, StopCause.SLEEP_FAILED, why)


def _wake_failed(step: EngineStep, event: e.EngineWakeFailed) -> None:
    found = _engine(step, event.worker_id, event)
    if found is None:
        return
    worker, spec = found
    if worker.state is not S.WAKING:
        return  # a late answer
    tries = worker.control_attempts
    if tries < spec.control_attempts:
        _send_wake(
            step,
            worker,
            tries + 1,
            f"{worker.worker_id}'s wake call failed ({event.error}): try "
            f"{tries + 1} of {spec.control_attempts}",
        )
        return
    why = (
        f"{worker.worker_id} failed to wake {tries} time(s) (last: {event.error}): stopping "
        f"and replacing it"
    )
    step.raise_alert(AlertName.ENGINE_CONTROL, worker.worker_id, why)
    step.terminate(worker, StopCause.WAKE_FAILED, why)


def _load_sampled(step: EngineStep, event: e.EngineLoadSampled) -> None:
    found = _engine(step, event.worker_id, event)
    if found is None:
        return
    worker, spec = found
    if spec.name != event.pool:
        raise Refused(
            f"EngineLoadSampled: {event.worker_id!r} is an engine of pool {spec.name!r}, not "
            f"{event.pool!r}"
        )
    if worker.in_flight_requests != event.in_flight_requests:
        # Only a change is recorded: samples come often, and most repeat the last one.
        worker = replace(worker, in_flight_requests=event.in_flight_requests)
        step.put_worker(worker)
    if event.in_flight_requests == 0:
        drain_done(step, worker)


def drain_done(step: EngineStep, worker: Worker) -> None:
    """Nothing is in flight at ``worker``: a drain to sleep sends the sleep call, a drain to exit
    stops the engine (SIGTERM)."""
    if worker.state is S.GOING_TO_SLEEP:
        release(step, worker, f"{worker.worker_id} has no request in flight: sleep call sent")
    elif worker.state is S.DRAINING:
        step.terminate(
            worker,
            worker.stop_cause or StopCause.SCALE_DOWN,
            f"{worker.worker_id} drained: no request in flight, SIGTERM",
        )


def release_at_deadline(step: EngineStep, worker: Worker, spec: PoolSpec) -> None:
    """The drain before a sleep ran out: the sleep call goes now (what is still in flight is
    aborted by the engine; the router retries it elsewhere)."""
    in_flight = "unknown" if worker.in_flight_requests is None else worker.in_flight_requests
    release(
        step,
        worker,
        f"{worker.worker_id} still has {in_flight} request(s) in flight "
        f"{drains.engine_drain_timeout_s(spec):g}s after it left routing: sleep call sent",
    )


def repeat_control(step: EngineStep, worker: Worker) -> None:
    """After a restart, an adopted engine's pending call is sent again (its answer was lost with
    deo), and one the log says sleeps is asked whether it does."""
    spec = step.pools[worker.pool].spec
    if not spec.is_engine or worker.port is None or spec.engine is None:
        return
    why = f"{worker.worker_id} adopted while {worker.state}"
    if worker.state in (S.FALLING_ASLEEP, S.WAKING):
        # The repeated call gets its own time to answer: the old deadline may have passed while
        # deo was down, and would stop (or replace) an engine whose call was never answered.
        step.put_worker(replace(worker, deadline_t=step.t + call_deadline_s(spec)))
    if worker.state is S.FALLING_ASLEEP:
        attempt = worker.control_attempts
        step.commands.append(_sleep_command(worker, spec, attempt, f"{why}: sleep call repeated"))
    elif worker.state is S.WAKING:
        attempt = worker.control_attempts
        step.commands.append(_wake_command(worker, spec, attempt, f"{why}: wake call repeated"))
    elif worker.state is S.SLEEPING:
        step.commands.append(
            c.VerifyAsleep(
                worker_id=worker.worker_id,
                engine=spec.engine,
                port=worker.port,
                timeout_s=spec.control_timeout_s,
                reason=f"{why}: asking it whether it sleeps",
            )
        )


def _wake_requested(step: EngineStep, event: e.EnginesWakeRequested) -> None:
    pool = step.pool(event.pool, event)
    spec = pool.spec
    if not spec.is_engine:
        raise Refused(f"EnginesWakeRequested: pool {spec.name!r} is not an engine pool")
    awake = step.worker_counts.get(spec.name, (0, 0))[0]
    everyone = awake + len(_asleep_of(step, spec.name))
    everyone = min(max(everyone, pool.target, spec.min_workers), spec.max_workers)
    until = None if event.hold_s is None else step.t + event.hold_s
    held = "until autoscaling is resumed" if until is None else f"for {event.hold_s:g}s"
    step.commands.append(
        c.ScalePool(
            pool=spec.name,
            previous=pool.target,
            target=everyone,
            source=DecisionSource.OPERATOR,
            reason=f"operator woke every engine of {spec.name}: {everyone} awake, held {held}",
        )
    )
    step.put_pool(replace(pool, pinned=everyone, wake_held=True, wake_hold_until_t=until))
    step.dirty_pools.add(spec.name)


def end_wake_hold(step: EngineStep, pool: PoolState, why: str) -> PoolState:
    """The pool's wake hold ends: its policy decides again, from the count the hold left."""
    if not pool.wake_held:
        return pool
    target = pool.target
    step.commands.append(
        c.ScalePool(
            pool=pool.spec.name,
            previous=target,
            target=target,
            source=DecisionSource.OPERATOR,
            reason=f"{pool.spec.name}: wake hold ended ({why}): the policy decides again",
        )
    )
    return replace(pool, pinned=None, desired=target, wake_held=False, wake_hold_until_t=None)


#: The reducer's handlers of the engine events.
ENGINE_HANDLERS: Mapping[type, Callable[[EngineStep, Any], None]] = MappingProxyType(
    {
        e.EngineAsleep: _asleep,
        e.EngineAwake: _awake,
        e.EngineSleepFailed: _sleep_failed,
        e.EngineWakeFailed: _wake_failed,
        e.EngineLoadSampled: _load_sampled,
        e.EnginesWakeRequested: _wake_requested,
    }
)
