"""deo's invariants as code: the numbered list of DESIGN.md, checkable after every step.

``state_violations(state)`` checks what must hold of any state; ``step_violations(before, event,
after, commands)`` checks what must hold of one step. Both return messages (empty when all is
well); ``raise_on_violation`` turns them into :class:`InvariantViolation`. The property tests
call these after every step of random event sequences; ``Reducer(check_invariants=True)`` calls
them at run time. Invariants 7 (determinism) and 8 (log round-trip) are about whole runs and are
checked by replay and the codec tests.

The GPU arbiter's plan invariants (rlix's eleven plan checks, and one of deo's) are in
:mod:`core.arbiter.invariants`; ``plan_violations`` is re-exported here.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from core import commands as c
from core import drains
from core import events as e
from core.arbiter.invariants import plan_violations
from core.arbiter.invariants import state_violations as arbiter_state_violations
from core.config import AUTO
from core.errors import InvariantViolation
from core.lifecycle import ASLEEP, COUNTED, DEADLINE_ACTIONS
from core.records import replace
from core.state import State, Worker, count_workers
from core.step import STARTING_STATES
from core.vocabulary import COUNTED_AT_STOP, PLANNED_STOPS, AlertName, DecisionSource, StopCause

__all__ = [
    "INVARIANTS_SUBJECT",
    "STATE_CHECK_INTERVAL_S",
    "checked",
    "command_violations",
    "free_healthy_gpus",
    "plan_violations",
    "raise_on_violation",
    "state_violations",
    "step_violations",
]


def free_healthy_gpus(state: State) -> int:
    """GPUs of the inventory that no live worker holds and no cause cordons."""
    held = {g for w in state.workers.values() for g in w.gpus}
    return sum(
        1
        for gpu_id in state.config.gpus
        if gpu_id not in held and gpu_id in state.gpus and not state.gpus[gpu_id].causes
    )


def _on(state: State, gpu_id: str) -> list[str]:
    """The live workers on ``gpu_id``."""
    return [w.worker_id for w in state.workers.values() if gpu_id in w.gpus]


def _crashed(event: e.Event, worker: Worker, t: float, early_exit_s: float) -> bool:
    """Whether ``worker``, gone in this step, ended in what deo must count as a crash."""
    if worker.stop_cause in COUNTED_AT_STOP:
        return False  # counted when deo stopped it (:func:`_failed_at_stop`)
    if isinstance(event, e.SpawnFailed):
        return True
    if isinstance(event, e.WorkerLost) or worker.stop_cause in PLANNED_STOPS:
        return False  # a loss says nothing of the worker; a planned stop is deo's own doing
    if isinstance(event, e.Tick) and worker.pid is not None:
        return False  # given up on after SIGKILL: it did not exit at all
    return worker.started_t is None or t - worker.started_t < early_exit_s


def _failed_at_stop(
    before: Worker, after: Worker, t: float, early_exit_s: float, seen_t: float | None
) -> bool:
    """Whether deo stopped ``before`` in this step for a failure it counts then: a start that
    timed out, or a worker gone silent within ``early_exit_s`` of starting or never seen after
    it started (``seen_t``: its last sign of life)."""
    if before.stop_cause is not None or after.stop_cause not in COUNTED_AT_STOP:
        return False
    started = before.started_t
    if after.stop_cause is StopCause.START_TIMEOUT or started is None:
        return True
    return t - started < early_exit_s or (seen_t if seen_t is not None else started) <= started


def state_violations(state: State) -> list[str]:
    """Everything wrong with ``state`` on its own."""
    found: list[str] = []
    # 1. A GPU is held by at most one live worker that holds its memory (any state but asleep:
    # starting, waking, draining and stopping count); beside it only asleep engines (tenants).
    # Only GPUs of the inventory are held.
    on_gpu: dict[str, list[Worker]] = {}
    for worker in state.workers.values():
        for gpu_id in worker.gpus:
            on_gpu.setdefault(gpu_id, []).append(worker)
    # Most GPUs have one worker in the inventory: only the others need a closer look.
    closer = sorted(g for g, ws in on_gpu.items() if len(ws) > 1 or g not in state.gpus)
    for gpu_id in closer:
        workers = on_gpu[gpu_id]
        holding = sorted(w.worker_id for w in workers if w.holds_memory)
        if len(holding) > 1:
            found.append(
                f"1: GPU {gpu_id} held by {len(holding)} live workers that hold its memory: "
                f"{', '.join(holding)}"
            )
        if len(workers) > 1:
            others = sorted(
                w.worker_id
                for w in workers
                if w.pool not in state.pools or not state.pools[w.pool].spec.is_engine
            )
            if others:
                found.append(
                    f"1: GPU {gpu_id} is shared by {len(workers)} live workers, "
                    f"{', '.join(others)} no engine (only asleep engines share a GPU)"
                )
        if gpu_id not in state.gpus:
            found.append(f"1: GPU {gpu_id} held but not in the inventory")
    # 2. Counted workers within [min, max]; below min only with an alert saying why.
    counted = Counter(w.pool for w in state.workers.values() if w.state in COUNTED)
    for name, pool in state.pools.items():
        n = counted.get(name, 0)
        if n > pool.spec.max_workers:
            found.append(f"2: pool {name} has {n} workers > max {pool.spec.max_workers}")
        if (
            not pool.removed
            and n < pool.spec.min_workers
            and (AlertName.BELOW_MIN, name) not in state.alerts
        ):
            found.append(f"2: pool {name} has {n} < min {pool.spec.min_workers} without an alert")
        # 4. A removal the stabilization window holds back is one, asked for within the window.
        held = pool.held
        if held is not None and not (
            held.target < pool.desired and held.since_t <= min(state.now, held.until_t)
        ):
            found.append(f"4: pool {name} holds back {held} at desired {pool.desired}")
    for name in state.removed_next_index:
        if name in state.pools:
            found.append(f"pool {name} is both declared and removed (a worker id could repeat)")
    for worker in state.workers.values():
        owner = state.pools.get(worker.pool)
        if owner is None:
            found.append(f"worker {worker.worker_id} belongs to no pool")
        elif worker.index >= owner.next_index:
            found.append(f"worker {worker.worker_id} has an index the pool never handed out")
        # 3. Every drain and stop has a deadline (the states with a deadline action), and a
        # measured drain's deadline comes after its start.
        if worker.state in DEADLINE_ACTIONS and worker.deadline_t is None:
            found.append(f"3: worker {worker.worker_id} is {worker.state.value} without a deadline")
        started = worker.drain_started_t
        if started is not None and worker.deadline_t is not None and worker.deadline_t < started:
            found.append(
                f"3: worker {worker.worker_id} drains from {started} to a deadline before it, "
                f"{worker.deadline_t}"
            )
    # 9. Engines: each live engine holds a port no other live worker holds (asleep or not), and
    # no more sleep than the pool's max_asleep.
    ports = Counter(w.port for w in state.workers.values() if w.port is not None)
    for port, count in sorted(ports.items()):
        if count > 1:
            found.append(f"9: port {port} held by {count} live engines")
    for worker in state.workers.values():
        owner = state.pools.get(worker.pool)
        if owner is None or not owner.spec.is_engine:
            continue
        if worker.port is None:  # a changed range leaves live engines their ports
            found.append(f"9: engine {worker.worker_id} holds no port")
    asleep = Counter(w.pool for w in state.workers.values() if w.state in ASLEEP)
    for name, count in sorted(asleep.items()):
        engines = state.pools.get(name)
        if engines is not None and count > engines.spec.max_asleep:
            found.append(
                f"9: pool {name} has {count} engines asleep > max {engines.spec.max_asleep}"
            )
    for worker_id in state.last_seen:
        if worker_id not in state.workers:
            found.append(f"liveness kept for {worker_id}, which is not a live worker")
    # The counts kept up to date step by step are those a recount finds.
    recount = count_workers(state.workers.values())
    if dict(state.worker_counts) != recount:
        found.append(
            f"worker counts (counted, active) {dict(sorted(state.worker_counts.items()))} "
            f"differ from a recount {dict(sorted(recount.items()))}"
        )
    # 3. A pool keeps only its latest drains, each a length of time.
    for name, pool in state.pools.items():
        if len(pool.drains) > drains.WINDOW_DRAINS or any(s < 0 for s, _ in pool.drains):
            found.append(
                f"3: pool {name} keeps drains {pool.drains} (at most {drains.WINDOW_DRAINS})"
            )
    # 5. Backoff follows the rule: a slot that failed n times in a row is replaced delay(n)
    # after its last failure; the pool's failures are its most failed open slot's.
    for name, pool in state.pools.items():
        rules = pool.spec.crash_loop
        if pool.retries:
            expected = min(t + rules.backoff_s(n) for t, n in pool.retries)
            if abs(pool.backoff_until_t - expected) > 1e-9:
                found.append(
                    f"5: pool {name} backs off until {pool.backoff_until_t}, rule says {expected}"
                )
        open_slots = [n for _, n in pool.retries] + [
            w.attempt for w in state.workers.values() if w.pool == name
        ]
        if pool.failures != max(open_slots, default=0):
            found.append(
                f"5: pool {name} counts {pool.failures} failures, its slots {sorted(open_slots)}"
            )
    return found


def step_violations(
    before: State, event: e.Event, after: State, commands: Sequence[c.Command]
) -> list[str]:
    """Everything wrong with one step, including the state it produced (and its arbiter's)."""
    found = state_violations(after)
    if after.arbiter.gpus:
        found += [f"arbiter: {v}" for v in arbiter_state_violations(after.arbiter)]
    found += command_violations(before, event, after, commands)
    t = after.now
    # 2. An alert that a pool is below its min names a real cause: the crash-loop backoff is in
    # force, too few free healthy GPUs are left, or as many workers as may start at once are.
    # Checked where the pool was just reconciled: when the alert is raised, and after a tick
    # (which reconciles every pool with an alert).
    below_min = {
        command.subject
        for command in commands
        if isinstance(command, c.RaiseAlert) and command.alert == AlertName.BELOW_MIN
    }
    if isinstance(event, e.Tick):
        below_min |= {subject for alert, subject in after.alerts if alert == AlertName.BELOW_MIN}
    free = free_healthy_gpus(after) if below_min else 0
    for name in sorted(below_min):
        pool = after.pools.get(name)
        if pool is None or pool.removed:
            continue
        n = after.counted(name)
        backing_off = bool(pool.retries) and t < pool.backoff_until_t
        starting = sum(
            1 for w in after.workers.values() if w.pool == name and w.state in STARTING_STATES
        )
        if starting >= pool.spec.max_starting:
            continue  # the rest follow as these come up
        if (AlertName.NO_FREE_PORTS, name) in after.alerts:
            continue  # every engine port is held
        if n < pool.spec.min_workers and not backing_off and free >= pool.spec.gpus_per_worker:
            found.append(
                f"2: pool {name} has {n} < min {pool.spec.min_workers} workers with {free} free "
                f"healthy GPU(s) and no crash-loop backoff"
            )
    # 5. An early exit deo did not ask for is a crash: its pool counts it and backs off; so is a
    # start that timed out, or a young worker gone silent, counted when deo stops it.
    crashes: Counter[str] = Counter()
    for worker_id, worker in before.workers.items():
        pool = before.pools.get(worker.pool)
        if pool is None:
            continue
        early_exit_s = pool.spec.crash_loop.early_exit_s
        now = after.workers.get(worker_id)
        if now is None:
            crashed = _crashed(event, worker, t, early_exit_s)
        else:
            crashed = _failed_at_stop(worker, now, t, early_exit_s, before.last_seen.get(worker_id))
        if crashed:
            crashes[worker.pool] += 1
    for name, count in sorted(crashes.items()):
        old, new = before.pools[name], after.pools.get(name)
        if new is None:
            continue  # a removed pool, forgotten with its last worker
        # A healthy worker's exit in the same step may reset the count before a crash counts.
        if not (new.last_failure_t == t and new.failures <= old.failures + count):
            found.append(
                f"5: pool {name} had {count} early exit(s) or failed start(s) at t={t} but counts "
                f"{new.failures} failure(s) (was {old.failures}), the last at {new.last_failure_t}"
            )
    # 3. After time passes, no drain or stop is past its deadline without escalation (but the
    # first tick after a stall of deo itself judges no worker: what was queued comes in first).
    if isinstance(event, e.Tick) and not after.last_tick_skipped:
        for worker in after.workers.values():
            if worker.deadline_t is not None and worker.deadline_t <= t:
                found.append(
                    f"3: worker {worker.worker_id} {worker.state.value} past its deadline "
                    f"{worker.deadline_t} at t={t}"
                )
    return found


def command_violations(
    before: State, event: e.Event, after: State, commands: Sequence[c.Command]
) -> list[str]:
    """What one step's commands break (placement, backoff, drain caps, policy decisions): the
    part of :func:`step_violations` that costs only as much as the step's commands."""
    found: list[str] = []
    t = after.now
    for command in commands:
        if isinstance(command, c.SpawnWorker):
            # 1. No new worker on a cordoned GPU (two holding one show in state_violations),
            # and only an engine of a pool the arbiter runs beside asleep engines.
            tenant_pool = command.pool in after.arbiter.engine_pools()
            for gpu_id in command.gpus:
                gpu = after.gpus.get(gpu_id)
                if gpu is None or gpu.causes:
                    found.append(f"1: {command.worker_id} placed on cordoned GPU {gpu_id}")
                beside = sorted(w for w in _on(after, gpu_id) if w != command.worker_id)
                if beside and not tenant_pool:
                    found.append(
                        f"1: {command.worker_id} of {command.pool}, which the arbiter does not "
                        f"run, placed on GPU {gpu_id} beside {', '.join(beside)}"
                    )
            # 5. No failed slot replaced before its backoff has passed.
            pool = before.pools.get(command.pool)
            worker = after.workers.get(command.worker_id)
            if pool is not None and worker is not None and worker.attempt:
                rules = pool.spec.crash_loop
                if not any(
                    n == worker.attempt and t >= failed_t + rules.backoff_s(n)
                    for failed_t, n in pool.retries
                ):
                    found.append(
                        f"5: {command.worker_id} replaces a slot that failed {worker.attempt} "
                        f"time(s) at t={t}, before its backoff ran out ({pool.retries})"
                    )
        elif isinstance(command, c.DrainWorker):
            # 3. A measured drain deadline stays within its cap.
            worker = after.workers.get(command.worker_id)
            pool = after.pools.get(worker.pool) if worker is not None else None
            auto = pool is not None and pool.spec.drain_timeout_s == AUTO
            if auto and command.deadline_t - t > drains.CAP_S + 1e-6:
                found.append(
                    f"3: {command.worker_id} drain deadline {command.deadline_t - t:g}s away, "
                    f"beyond the cap {drains.CAP_S:g}s"
                )
        elif isinstance(command, c.ScalePool) and command.source == DecisionSource.POLICY:
            # 6. Only a fresh sample for the pool lets a policy decide.
            fresh = (
                isinstance(event, (e.QueueSampled, e.LoadSampled)) and event.pool == command.pool
            )
            if not fresh:
                found.append(f"6: policy scaled {command.pool} on {type(event).__name__}")
            # 4. No scale-down within the stabilization window after a scale-up.
            pool = before.pools.get(command.pool)
            if pool is not None and command.target < command.previous:
                last_up = pool.last_scale_up_t
                if last_up is not None and t - last_up < pool.spec.stabilization_s:
                    found.append(
                        f"4: {command.pool} scaled down at t={t}, {t - last_up:g}s after a "
                        f"scale-up (window {pool.spec.stabilization_s:g}s)"
                    )
    return found


#: The subject of the ``invariant_violated`` alert, and how many violations its reason names.
INVARIANTS_SUBJECT = "deo"
_NAMED_VIOLATIONS = 8
#: The whole state is checked at the first tick of each span this long (of event time): its
#: cost grows with the workers, and a violation that lasts is found within one span.
STATE_CHECK_INTERVAL_S = 10.0


def checked(
    before: State, event: e.Event, after: State, commands: list[c.Command]
) -> tuple[State, list[c.Command]]:
    """``after`` and ``commands`` with deo's invariants checked, as every step of ``deo run``,
    the simulator and replay does: each step's commands (:func:`command_violations`, as cheap as
    the step), and at the first tick of every :data:`STATE_CHECK_INTERVAL_S` the whole step and
    state (:func:`step_violations`, whose cost grows with the workers). A violation raises
    ``invariant_violated`` (subject ``deo``) naming what broke; the first whole check that finds
    none resolves it.

    The commands are carried out all the same: the state already holds what they do (a withheld
    spawn would leave a worker deo believes is starting), and a violation is either a fault of
    deo's, which the property tests hunt, or a fact of the world deo must go on repairing (an
    engine found awake beside another after a restart).
    """
    span = STATE_CHECK_INTERVAL_S
    tick = type(event) is e.Tick and before.now // span != after.now // span
    if not tick and not commands:
        return after, commands  # most events: nothing to check (replay reduces millions)
    if tick:
        found = step_violations(before, event, after, commands)
    else:
        found = command_violations(before, event, after, commands)
    key = (AlertName.INVARIANT_VIOLATED, INVARIANTS_SUBJECT)
    if found and key not in after.alerts:
        named = "; ".join(found[:_NAMED_VIOLATIONS])
        more = len(found) - _NAMED_VIOLATIONS
        reason = f"after {type(event).__name__} at t={event.t:g}: {named}" + (
            f"; and {more} more" if more > 0 else ""
        )
        alert = c.RaiseAlert(alert=key[0], subject=key[1], reason=reason)
        return replace(after, alerts=after.alerts | {key}), [*commands, alert]
    if tick and not found and key in after.alerts:
        resolved = c.ResolveAlert(
            alert=key[0], subject=key[1], reason="every invariant holds again"
        )
        return replace(after, alerts=after.alerts - {key}), [*commands, resolved]
    return after, commands


def raise_on_violation(
    before: State, event: e.Event, after: State, commands: Sequence[c.Command]
) -> None:
    """Raise :class:`InvariantViolation` listing every violation of this step, if any."""
    found = step_violations(before, event, after, commands)
    if found:
        raise InvariantViolation(
            f"after {type(event).__name__} at t={event.t}: " + "; ".join(found)
        )
