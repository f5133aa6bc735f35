"""One-line descriptions of events, commands and state for people (timeline, explain, status)."""

from __future__ import annotations

import datetime as dt

from core import commands as c
from core import events as e
from core.drains import drain_timeout
from core.lifecycle import WorkerState
from core.state import HeldChange, State, split_worker_id

__all__ = [
    "at",
    "command_line",
    "event_line",
    "event_subject",
    "held_line",
    "pool_summary",
    "state_lines",
]


#: Times above this are Unix wall-clock seconds (deo run); below, seconds of a simulation.
_EPOCH_FROM = 1e9


def at(t: float) -> str:
    """A time as people read it: UTC wall clock for ``deo run`` logs, seconds for simulations."""
    if t >= _EPOCH_FROM:
        stamp = dt.datetime.fromtimestamp(t, dt.UTC)
        return stamp.strftime("%Y-%m-%d %H:%M:%S.") + f"{stamp.microsecond // 100_000}"
    return f"{t:.1f}s"


def event_subject(event: e.Event) -> str | None:
    """The pool an event concerns ("gpus" for GPU events, None for global ones)."""
    pool = getattr(event, "pool", None)
    if isinstance(pool, str):
        return pool
    worker_id = getattr(event, "worker_id", None)
    if isinstance(worker_id, str):
        parsed = split_worker_id(worker_id)
        return parsed[0] if parsed else None
    if hasattr(event, "gpu_id"):
        return "gpus"
    return None


def event_line(event: e.Event) -> str | None:
    """A short description of a notable event, or None for routine ones (ticks, samples)."""
    match event:
        case e.Configured(config=config):
            pools = "; ".join(
                f"{p.name} ({p.policy.name}, {p.min_workers}-{p.max_workers} workers, "
                f"{p.gpus_per_worker} GPU/worker)"
                for p in config.pools
            )
            return f"config     pools {pools or 'none'}; GPUs {','.join(config.gpus) or 'none'}"
        case e.WorkerExited(worker_id=w, exit_code=code, signal=sig):
            if sig is not None:
                how = f"killed by signal {sig}"
            elif code is not None:
                how = f"exited with code {code}"
            else:  # an adopted worker: not deo's child, so its status is not deo's to read
                how = "exited (status unknown: adopted, not deo's child)"
            return f"exit       {w} {how}"
        case e.SpawnFailed(worker_id=w, error=err):
            return f"spawn-fail {w}: {err}"
        case e.WorkerLost(worker_id=w, reason=why):
            return f"lost       {w}: {why}"
        case e.WorkerAdopted(worker_id=w):
            return f"adopted    {w}"
        case e.LeftoverProcesses(worker_id=w, count=n, detail=detail):
            return f"leftovers  {w}: {n} process(es) left running: {detail}"
        case e.LeftoverProcessesStopped(worker_id=w):
            return f"leftovers  {w}: all stopped"
        case e.WorkerStarted(worker_id=w, pid=pid):
            return f"started    {w} pid {pid}"
        case e.SourceDown(pool=p, error=err):
            return f"source     {p} down: {err}"
        case e.ClusterUnreachable(address=addr, error=err):
            return f"cluster    {addr} unreachable: {err}"
        case e.ClusterReachable(address=addr):
            return f"cluster    {addr} answers again"
        case e.GpuLost(gpu_id=g, error=err):
            return f"gpu-lost   GPU {g}: {err}"
        case e.AutoscalingPaused(pool=p):
            return f"operator   pause autoscaling ({p or 'all pools'})"
        case e.AutoscalingResumed(pool=p):
            return f"operator   resume autoscaling ({p or 'all pools'})"
        case e.PoolPinned(pool=p, count=n):
            return f"operator   {'unpin ' + p if n is None else f'pin {p} at {n}'}"
        case e.DrainRequested(worker_id=w):
            return f"operator   drain {w}"
        case e.GpuCordonRequested(gpu_id=g):
            return f"operator   cordon GPU {g}"
        case e.GpuUncordonRequested(gpu_id=g):
            return f"operator   uncordon GPU {g}"
    return None


def command_line(command: c.Command) -> str:
    """A short description of a command with its reason."""
    match command:
        case c.SpawnWorker(worker_id=w):
            what = f"spawn      {w}"
        case c.DrainWorker(worker_id=w, signal=sig, deadline_t=d):
            what = f"drain      {w} ({sig}, deadline {at(d)})"
        case c.TerminateWorker(worker_id=w):
            what = f"terminate  {w}"
        case c.KillWorker(worker_id=w):
            what = f"kill       {w} (process group)"
        case c.ScalePool(pool=p, previous=a, target=b, source=src):
            what = f"scale      {p} {a} -> {b} ({src})"
        case c.CordonGpu(gpu_id=g, causes=causes):
            what = f"cordon     GPU {g} ({', '.join(sorted(causes))})"
        case c.UncordonGpu(gpu_id=g):
            what = f"uncordon   GPU {g}"
        case c.RaiseAlert(alert=a, subject=s):
            what = f"ALERT      {a} {s}"
        case c.ResolveAlert(alert=a, subject=s):
            what = f"resolved   {a} {s}"
        case _:
            what = type(command).__name__
    return f"{what}: {command.reason}"


def pool_summary(state: State, name: str) -> str:
    """Target, overrides and workers by state for one pool."""
    pool = state.pools.get(name)
    if pool is None:
        return f"{name}: not declared"
    by_state: dict[str, int] = {}
    for worker in state.workers.values():
        if worker.pool == name:
            by_state[worker.state.value] = by_state.get(worker.state.value, 0) + 1
    workers = ", ".join(
        f"{by_state[s.value]} {s.value}" for s in WorkerState if s.value in by_state
    )
    flags = [f"desired {pool.desired}"]
    if pool.pinned is not None:
        flags.append(f"pinned {pool.pinned}")
    if pool.paused or state.paused_all:
        flags.append("paused")
    if pool.removed:
        flags.append("removed")
    if pool.failures:
        waits = f", backoff until {at(pool.backoff_until_t)}" if pool.retries else ""
        flags.append(f"{pool.failures} failures{waits}")
    if pool.source_error:
        flags.append(f"source down: {pool.source_error}")
    held = pool.held_at(state.now)
    if held is not None:
        flags.append(held_line(held))
    pressure = ""
    if pool.queue is not None:
        q = pool.queue
        pressure = (
            f"; queue {q.queued_sequences} seqs = {q.queued_sequences / q.batch_size_seqs:.2f} "
            f"batches of {q.batch_size_seqs}, trainer step {q.trainer_step}"
        )
    elif pool.load is not None:
        pressure = f"; {pool.load.in_flight_requests} requests in flight"
    if not pool.spec.is_engine:
        seconds, why = drain_timeout(pool.spec, pool.drains)
        pressure += f"; drain deadline {seconds:g}s ({why})"
    return (
        f"{name}: target {pool.target} ({', '.join(flags)}); workers: {workers or 'none'}{pressure}"
    )


def held_line(held: HeldChange) -> str:
    """A removal the stabilization window holds back, in words."""
    return (
        f"stabilization window holds a removal to {held.target} until {at(held.until_t)}, "
        f"asked since {at(held.since_t)}: {held.reason}"
    )


def state_lines(state: State) -> list[str]:
    """The whole state as readable lines: pools, workers, GPUs, alerts."""
    lines = [f"state at {at(state.now)}" + (" (autoscaling paused)" if state.paused_all else "")]
    lines += ["  " + pool_summary(state, name) for name in sorted(state.pools)]
    for worker in sorted(state.workers.values(), key=lambda w: (w.pool, w.index)):
        gpus = f" GPU {','.join(worker.gpus)}" if worker.gpus else ""
        pid = f" pid {worker.pid}" if worker.pid is not None else ""
        extra = (
            f" ({worker.stop_cause}, deadline {at(worker.deadline_t)})" if worker.deadline_t else ""
        )
        lines.append(f"  worker {worker.worker_id}: {worker.state.value}{pid}{gpus}{extra}")
    for gpu in state.gpus.values():
        status = f"cordoned ({', '.join(sorted(gpu.causes))})" if gpu.causes else "ok"
        temp = f", {gpu.temperature_c:g} C" if gpu.temperature_c is not None else ""
        lines.append(f"  GPU {gpu.gpu_id}: {status}{temp}")
    for alert, subject in sorted(state.alerts):
        lines.append(f"  alert {alert} {subject}")
    return lines
