"""``deo run``: the local runtime, assembled.

Start-up: resolve the device id each configured GPU has for CUDA (from deo's own
CUDA_VISIBLE_DEVICES) into the configuration, open the log (snapshot + tail rebuild the state),
reconcile with the processes that are really there (adopt a worker whose pid still has its
recorded start time, record the rest lost, stop every other process carrying this run's id),
apply the configuration if it changed, then run the runner, the process executor, the HTTP API
and the sources in one task group. deo is the subreaper of its workers' descendants, so what a
worker leaves behind comes to deo, to be stopped and reaped.

SIGINT/SIGTERM stop deo and leave the workers running; a restart adopts them. ``deo stop
--drain`` drains every worker first; a SIGINT/SIGTERM during that drain stops deo without waiting
for it. Once deo is stopping, further SIGINT/SIGTERM are ignored, so the log is always closed
cleanly. SIGHUP, SIGUSR1 and SIGUSR2 are noted and ignored: deo reloads nothing on a signal.

Exit status: 0 after a stop; 2 when start-up is refused (the configuration, the API address, or
the log: in use, not a deo log, unreadable where it held the configuration or the state a
segment starts from), before any worker is touched; 3 when the log, its snapshot or the files
deo keeps beside it (``LOG.token``, ``LOG.worker-secret``) cannot be opened or written (disk
full, file too big, read-only), at start-up or later: deo stops at once, carries out nothing
more and leaves the workers running (a restart adopts them).

Beside the log, ``LOG.worker-secret`` holds the secret the workers' API tokens are derived from
and ``LOG.token`` the operator token deo generated when ``$DEO_TOKEN`` (``api.token_env``) is
unset; with it set, a ``LOG.token`` left from an earlier run is removed.
"""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import anyio
import attrs

from adapters.log import EventLog, LogWriteFailed, fsync_directory
from adapters.runtime.arbiter import ArbiterBoard
from adapters.runtime.config_file import RunSettings, Source, check_loggable
from adapters.runtime.engine_hosts import ExecutorHosts
from adapters.runtime.engine_pools import bind_routers, run_engine_pools
from adapters.runtime.engines import EngineControl, FanOut
from adapters.runtime.live import live_view
from adapters.runtime.processes import (
    DEFAULT_STOP_TIMEOUT_S,
    WORKER_ID_ENV,
    LocalProcesses,
    become_child_subreaper,
    environ_of,
    process_start_time,
    processes_with,
)
from adapters.runtime.runner import Runner

if TYPE_CHECKING:
    from adapters.runtime.ray_executor import RayExecutor
from adapters.sources.atropos import AtroposSource, poll_atropos
from adapters.sources.heartbeat import heartbeat_files
from adapters.sources.json_pressure import poll_json
from core import (
    Config,
    ConfigError,
    Configured,
    DeoError,
    Event,
    Reducer,
    State,
    WorkerAdopted,
    WorkerLost,
    WorkerStarted,
)
from core.arbiter import ArbiterGpusDeclared
from core.drains import START_S, drain_timeout

__all__ = [
    "drain_all_wait_s",
    "find_spawned",
    "reconcile",
    "run",
    "worker_secret_for",
    "worker_secret_path",
    "write_operator_token",
    "write_private",
]

log = logging.getLogger("deo.run")

#: Variables every worker of this run inherits, besides those the core gives each worker
#: (CUDA_VISIBLE_DEVICES, DEO_WORKER_ID, ...), the executor's DEO_HEARTBEAT_FILE and the
#: worker's own token (DEO_WORKER_TOKEN).
API_URL_ENV = "DEO_API_URL"
WORKER_TOKEN_ENV = "DEO_WORKER_TOKEN"
#: Names the log a worker belongs to, so a restart never takes another deo's worker for its own.
RUN_ID_ENV = "DEO_RUN_ID"
GPU_ENV = "CUDA_VISIBLE_DEVICES"
DEVICE_ORDER_ENV = "CUDA_DEVICE_ORDER"
#: SIGINT and SIGTERM stop deo; the others are noted and ignored (their default action would
#: end deo without closing its log).
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
IGNORED_SIGNALS = (signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)


def run_id_of(log_path: Path) -> str:
    """A stable id for one log: a digest of its header line (which holds its creation time)."""
    with log_path.open("rb") as f:
        return hashlib.sha256(f.readline()).hexdigest()[:16]


#: Characters in a worker secret deo generates; a shorter one was cut short while written.
WORKER_SECRET_CHARS = len(secrets.token_urlsafe(32))


def worker_secret_path(log_path: Path) -> Path:
    """Where the worker secret of the log at ``log_path`` is kept: ``LOG.worker-secret``."""
    return log_path.with_name(log_path.name + ".worker-secret")


def worker_secret_for(log_path: Path) -> str:
    """The secret each worker's API token is derived from (:func:`adapters.api.app.worker_token`),
    kept beside the log (mode 0600) so that adopted workers' tokens stay valid.

    A file that is missing, empty, shorter than a generated secret or not text is replaced by a
    new secret: deo never hands out a token before the whole secret is in place (it is written
    to a temporary file, synced and renamed), so no worker holds a token derived from it.
    Raises :class:`OSError` when the file cannot be read or written.
    """
    path = worker_secret_path(log_path)
    try:
        secret = path.read_text(encoding="utf-8").strip()
    except (FileNotFoundError, UnicodeDecodeError):
        secret = ""
    if len(secret) >= WORKER_SECRET_CHARS:
        return secret
    if path.exists():
        log.warning(
            "%s: damaged (%d characters); a new worker secret replaces it", path, len(secret)
        )
    secret = secrets.token_urlsafe(32)
    write_private(path, secret + "\n")
    return secret


def write_operator_token(path: Path, token: str) -> None:
    """Write ``token`` to ``path``, readable by this user alone (mode 0600), replacing it whole.
    Raises :class:`OSError` when it cannot be written."""
    write_private(path, token + "\n")


def write_private(path: Path, text: str) -> None:
    """Replace ``path`` whole with ``text``, readable by this user alone (mode 0600): written to
    ``PATH.partial``, synced, then renamed over ``path``, so a crash or a full disk leaves either
    the old file or the new one, never a part of it. Raises :class:`OSError` (the partial file
    is removed)."""
    partial = path.with_name(path.name + ".partial")
    partial.unlink(missing_ok=True)
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        partial.replace(path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    fsync_directory(path.parent)


def worker_environ(token_env: str, runtime: dict[str, str]) -> dict[str, str]:
    """What workers inherit: deo's environment without the operator token or deo's own
    variables (a worker holding the operator token could act as the operator), plus the
    ``runtime`` variables of this run."""
    environ = {k: v for k, v in os.environ.items() if k != token_env and not k.startswith("DEO_")}
    # NVML numbers GPUs in PCI order, and so do the device ids the core hands out: CUDA's indices
    # must mean the same GPUs, whatever order deo's own environment names.
    environ[DEVICE_ORDER_ENV] = "PCI_BUS_ID"
    return {**environ, **runtime}


def check_device_order(gpus: Sequence[str], visible: str | None) -> None:
    """:class:`ConfigError` if deo's CUDA_VISIBLE_DEVICES holds indices counted in an order
    other than PCI_BUS_ID. deo reads those indices as NVML's, in PCI bus order; under
    FASTEST_FIRST they name other GPUs, and which ones only CUDA knows (deo does not load it)."""
    order = os.environ.get(DEVICE_ORDER_ENV)
    if not gpus or visible is None or order in (None, "PCI_BUS_ID"):
        return
    if any(entry.strip().isdigit() for entry in visible.split(",")):
        raise ConfigError(
            f"deo's {DEVICE_ORDER_ENV}={order!r} with {GPU_ENV}={visible!r}: deo counts GPU "
            f"indices in PCI bus order, as NVML does, and gives workers {DEVICE_ORDER_ENV}="
            f"PCI_BUS_ID; run deo with {DEVICE_ORDER_ENV}=PCI_BUS_ID (indices in that order) or "
            f"name the GPUs by UUID in {GPU_ENV}"
        )


def find_spawned(worker_id: str, run_id: str) -> tuple[int, int] | None:
    """(pid, start time) of a process of this log's started as ``worker_id``, by its environment.

    A crash between starting a worker and logging ``WorkerStarted`` leaves a process the log
    does not name; it carries ``DEO_WORKER_ID`` and its log's ``DEO_RUN_ID`` in its environment,
    which is how it is found (worker ids alone repeat across logs). Two candidates leading their
    own process groups are ambiguous: none is taken.
    """
    matches = processes_with({WORKER_ID_ENV: worker_id, RUN_ID_ENV: run_id})
    # The worker's own children inherit its environment; the worker leads its process group.
    leaders = [pid for pid in matches if _group_of(pid) == pid]
    if len(leaders) > 1:
        log.warning("%s: %d processes claim to be it; adopting none", worker_id, len(leaders))
        return None
    for pid in leaders or sorted(matches):
        start = process_start_time(pid)
        if start is not None:
            return pid, start
    return None


def _group_of(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


async def reconcile(
    state: State,
    processes: LocalProcesses,
    clock: Callable[[], float],
    run_id: str,
    api_url: str | None = None,
) -> list[Event]:
    """Events that bring a recovered state in line with the processes really running.

    An adopted worker given another ``api_url`` by an earlier run (``api.port`` changed across
    the restart) is warned of: what it sends there (heartbeats, reports) no longer arrives."""
    events: list[Event] = []
    for worker in state.workers.values():
        pid, start = worker.pid, worker.start_time
        if pid is None:
            found = find_spawned(worker.worker_id, run_id)
            if found is None:
                events.append(
                    WorkerLost(t=clock(), worker_id=worker.worker_id, reason="never started")
                )
                continue
            pid, start = found
            events.append(
                WorkerStarted(t=clock(), worker_id=worker.worker_id, pid=pid, start_time=start)
            )
        assert start is not None
        if await processes.adopt(worker.worker_id, pid, start, pool=worker.pool):
            events.append(WorkerAdopted(t=clock(), worker_id=worker.worker_id))
            given = (environ_of(pid) or {}).get(API_URL_ENV)
            if api_url is not None and given is not None and given != api_url:
                log.warning(
                    "%s was given %s=%s by an earlier run; deo now listens on %s: what it sends "
                    "deo's API (heartbeats, reports) no longer arrives",
                    worker.worker_id,
                    API_URL_ENV,
                    given,
                    api_url,
                )
        else:
            why = f"pid {pid} is gone or now belongs to another process"
            events.append(WorkerLost(t=clock(), worker_id=worker.worker_id, reason=why))
    return events


async def run(
    settings: RunSettings, *, out: Callable[[str], None] = print, live: bool = False
) -> int:
    """Run until SIGINT/SIGTERM or a stop request; returns the exit status.

    deo owns SIGINT, SIGTERM, SIGHUP, SIGUSR1 and SIGUSR2 from the moment its log is open: none
    of them can end it before the log is closed, and they stay ignored once ``run`` returns (its
    caller is about to exit).

    ``live`` redraws a compact view of pools, workers, GPUs and decisions (for a terminal);
    otherwise decisions go out as log lines.
    """
    from adapters.api.app import build_app, listen, serve, worker_token
    from adapters.api.client import operator_token_path, token_problem
    from adapters.api.guard import connection_cap
    from adapters.sources.nvml import held_gpus, physical_gpu_ids, poll_gpus

    api = settings.api
    try:
        max_connections = connection_cap(api.max_connections)
    except ValueError as exc:
        out(f"deo: api: {exc}")
        return 2
    token_unsendable = token_problem(os.environ.get(api.token_env) or "")
    if token_unsendable is not None:
        out(f"deo: ${api.token_env}: {token_unsendable}; no client could send it")
        return 2
    if not api.loopback:
        reads = (
            "reads (GET) are open to anyone who can reach it (api.open_reads = true)"
            if api.open_reads
            else "every endpoint, reads included, needs the operator token"
        )
        out(f"deo: warning: the API listens on {api.host}, beyond loopback: {reads}")
    clock = steady_wall_clock()
    # Everything that can fail at start-up fails before any worker is touched.
    try:
        # The configuration carries the device ids, so the core writes each worker's
        # CUDA_VISIBLE_DEVICES itself and the log records what the worker was given.
        if settings.executor.kind == "ray":
            devices = {}  # NODE:INDEX ids, resolved on their nodes (docs/ray.md)
        else:
            check_device_order(settings.config.gpus, os.environ.get(GPU_ENV))
            devices = physical_gpu_ids(settings.config.gpus, os.environ.get(GPU_ENV))
        config = attrs.evolve(settings.config, gpu_devices=devices)
        check_loggable(config)  # what the log holds is what the next start and replay apply
    except DeoError as exc:
        out(f"deo: {exc}")
        return 2
    if settings.worker_logs.exists() and not settings.worker_logs.is_dir():
        out(f"deo: deo.worker_logs {settings.worker_logs}: a file, not a folder")
        return 2
    try:
        sock = listen(settings.api.host, settings.api.port)
    except OSError as exc:
        out(f"deo: cannot listen on {settings.api.host}:{settings.api.port}: {exc.strerror}")
        return 2
    try:
        event_log, recovery = EventLog.open(
            settings.log,
            fsync=settings.fsync,
            snapshot_every=settings.snapshot_every,
            segment_bytes=settings.segment_bytes,
            keep_segments=settings.keep_segments,
            alive=lambda pid, start_time: process_start_time(pid) == start_time,
        )
    except DeoError as exc:
        sock.close()
        out(f"deo: {exc}")
        return 3 if isinstance(exc, LogWriteFailed) else 2
    try:
        # Made once the log is known to be deo's, and before any worker: a worker's output
        # has nowhere else to go.
        settings.worker_logs.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        event_log.close()
        sock.close()
        out(f"deo: deo.worker_logs {settings.worker_logs}: cannot make the folder: {exc.strerror}")
        return 2
    for problem in recovery.problems:
        out(f"deo: {settings.log}: {problem}")
    for note in recovery.notes:
        out(f"deo: {settings.log}: {note}")
    if recovery.replayed:
        # From the start, or from where the snapshot (or a segment's state record) left off.
        out(f"deo: rebuilt state from {settings.log} ({recovery.replayed} records replayed)")
    run_id = run_id_of(settings.log)
    token = os.environ.get(api.token_env)
    try:
        if token:
            # A token file from an earlier run would hold a token this run does not accept:
            # `deo stop --log LOG` would send it rather than report that $DEO_TOKEN is needed.
            operator_token_path(settings.log).unlink(missing_ok=True)
        else:
            # Generated for this run and written for the operator's eyes only, never to stdout
            # (which often ends up in a shared log); `deo stop --log LOG` reads it.
            token = secrets.token_urlsafe(24)
            token_path = operator_token_path(settings.log)
            write_operator_token(token_path, token)
            out(f"deo: no ${api.token_env}; operator token written to {token_path} (mode 0600)")
        worker_secret = worker_secret_for(settings.log)
    except OSError as exc:
        event_log.close()
        sock.close()
        out(
            f"deo: cannot write beside {settings.log}: {exc.filename}: {exc.strerror}; its "
            f"directory must be writable by deo"
        )
        return 3
    engine_hosts = ExecutorHosts()  # where engines run: the executor's to say, once chosen
    try:
        engine_pools = bind_routers(
            config,
            lambda: runner.state,
            own_sources=frozenset(source.pool for source in settings.sources),
            hosts=engine_hosts,
        )
    except OSError as exc:
        event_log.close()
        sock.close()
        out(f"deo: cannot listen on {exc.strerror}")
        return 2
    # Past a file size limit, write() should fail with EFBIG (reported, exit 3) rather than
    # the kernel killing deo; workers get the default back (Popen restores SIGXFSZ).
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    port = sock.getsockname()[1]
    url = f"http://{settings.api.host}:{port}"
    runtime_env = {API_URL_ENV: url, RUN_ID_ENV: run_id}

    def emit(event: Event) -> None:
        runner.emit(event)  # the runner, built below around the processes, takes their reports

    def stop_timeout_s(pool: str | None) -> float:
        return _stop_timeout_s(pool, runner.state, config)

    # Orphaned descendants of workers come to deo (not init), to be stopped and reaped.
    subreaper = become_child_subreaper()
    if not subreaper:
        out("deo: cannot become the subreaper of its workers; their orphans go to init")
    processes = LocalProcesses(
        emit,
        clock=clock,
        log_dir=settings.worker_logs,
        environ=worker_environ(settings.api.token_env, runtime_env),
        run_marks={RUN_ID_ENV: run_id},
        stop_timeout_s=stop_timeout_s,
        reap_orphans=subreaper,
        # Each worker's own token: it speaks for that worker alone, and stays out of the log.
        secret_environ=lambda worker_id: {WORKER_TOKEN_ENV: worker_token(worker_secret, worker_id)},
    )
    executor: LocalProcesses | RayExecutor = processes
    if settings.executor.kind == "ray":
        # Imported here only: a run on this machine never loads Ray.
        from adapters.runtime.ray_executor import connect_ray_executor

        try:
            executor = await connect_ray_executor(
                settings,
                emit,
                clock=clock,
                state=lambda: runner.state,
                environ=worker_environ(settings.api.token_env, runtime_env),
                secret_environ=lambda worker_id: {
                    WORKER_TOKEN_ENV: worker_token(worker_secret, worker_id)
                },
                out=out,
            )
        except DeoError as exc:
            event_log.close()
            sock.close()
            out(f"deo: {exc}")
            return 2
        engine_hosts.use(executor)
    engines = EngineControl(
        emit,
        clock=clock,
        state=lambda: runner.state,
        saw=lambda worker_id: runner.saw(worker_id),
        hosts=engine_hosts,
    )
    arbiter = ArbiterBoard(configured=settings.arbiter is not None)
    runner = Runner(
        event_log,
        Reducer(recovery.state),
        FanOut(executor, engines, arbiter),
        clock=clock,
        tick_interval_s=settings.tick_interval_s,
        on_handled=arbiter.handled,
    )
    app = build_app(
        runner,
        token=token,
        worker_secret=worker_secret,
        reads_need_token=not (api.loopback or api.open_reads),
        arbiter=arbiter,
    )
    refused = False
    # Open from here until the log is closed, so no signal can end deo without closing it.
    failed: list[LogWriteFailed] = []
    with anyio.open_signal_receiver(*STOP_SIGNALS, *IGNORED_SIGNALS) as signals:
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(
                    _stop_on_signal, signals, runner, tg.cancel_scope, out, settings.drain_on_signal
                )
                tg.start_soon(executor.run)
                tg.start_soon(engines.run)
                if isinstance(executor, LocalProcesses):
                    found = await reconcile(recovery.state, executor, clock, run_id, url)
                else:
                    found = await executor.reconcile(recovery.state)
                for event in found:
                    runner.emit(event)
                # The state may miss live workers (a log that lost records): nothing is spawned
                # until every process of this run that no adopted worker accounts for is gone.
                await executor.stop_strays()
                # A sweep cut short by the last stop left its alert raised: resolved if nothing
                # of that worker is left now.
                for event in executor.leftovers_gone(recovery.state):
                    runner.emit(event)
                tg.start_soon(runner.run)
                if recovery.state.config != config:
                    try:
                        await runner.submit(Configured(t=clock(), config=config))
                    except DeoError as exc:
                        # e.g. a GPU removed from the file while a worker still holds it
                        out(f"deo: the configuration was refused: {exc}")
                        refused = True
                        tg.cancel_scope.cancel()
                if not refused and not await _declare_arbiter(settings, runner, out):
                    refused = True
                    tg.cancel_scope.cancel()
                if not refused:
                    # Served once the configuration is durable: no reader sees a deo without
                    # its pools. The socket listens already: an early client waits, not refused.
                    tg.start_soon(
                        lambda: serve(
                            app,
                            sock=sock,
                            max_connections=max_connections,
                            request_timeout_s=api.request_timeout_s,
                        )
                    )
                    out(f"deo: API on {url} (log {settings.log})")
                tg.start_soon(
                    heartbeat_files, executor.heartbeat_file, lambda: runner.state, runner.saw
                )
                sampling = anyio.CancelScope()
                tg.start_soon(_sample_pressure, sampling, settings.sources, runner.emit, clock)
                tg.start_soon(
                    run_engine_pools, engine_pools, lambda: runner.state, runner.emit, clock, out
                )
                if config.gpus and settings.executor.kind == "local":
                    tg.start_soon(
                        poll_gpus,
                        settings.nvml,
                        devices,
                        runner.emit,
                        clock,
                        out,
                        lambda: runner.state.config.cordon,
                        lambda: held_gpus(runner.state),
                    )
                if live:
                    tg.start_soon(live_view, runner, _write)
                tg.start_soon(_stop_on_request, runner, tg.cancel_scope, sampling, out)
        except* LogWriteFailed as group:
            failed.append(_first_leaf(group))
        finally:
            sock.close()  # serve closed it already, unless a refusal kept it from serving
            with anyio.CancelScope(shield=True):
                try:
                    event_log.close()
                except LogWriteFailed as exc:  # the last records could not be written either
                    failed.append(exc)
    # Leaving the receiver restored the default actions; from here to the exit of the process
    # (run's caller is ending) a signal could only cut that exit short.
    for signum in (*STOP_SIGNALS, *IGNORED_SIGNALS):
        signal.signal(signum, signal.SIG_IGN)
    if failed:
        out(f"deo: {failed[0]}; stopped, {len(runner.state.workers)} worker(s) left running")
        return 3
    left = len(runner.state.workers)
    out(
        f"deo: stopped; {left} worker(s) left running"
        + (" (a restart adopts them)" if left else "")
    )
    return 2 if refused else 0


async def _declare_arbiter(
    settings: RunSettings, runner: Runner, out: Callable[[str], None]
) -> bool:
    """Declare the ``[arbiter]`` GPUs and planner settings to the arbiter unless the log already
    did (the same GPUs in any order: the log's order stays); False (said why) when it refuses
    them (the log's arbiter shares other GPUs)."""
    wanted = settings.arbiter
    recorded = runner.state.arbiter
    if wanted is None or (set(recorded.gpus), recorded.planner) == (
        set(wanted.gpus),
        wanted.planner,
    ):
        return True
    try:
        await runner.submit(
            ArbiterGpusDeclared(t=runner.clock(), gpus=wanted.gpus, planner=wanted.planner)
        )
    except DeoError as exc:
        out(f"deo: arbiter.gpus was refused: {exc}")
        return False
    return True


def _first_leaf(group: BaseExceptionGroup[LogWriteFailed]) -> LogWriteFailed:
    """The first write failure in ``group`` (task groups nest them)."""
    first = group.exceptions[0]
    return first if isinstance(first, LogWriteFailed) else _first_leaf(first)


def _write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


async def _stop_on_signal(
    signals: AsyncIterator[int],
    runner: Runner,
    scope: anyio.CancelScope,
    out: Callable[[str], None],
    drain_first: bool,
) -> None:
    async for signum in signals:
        name = signal.Signals(signum).name
        if signum not in STOP_SIGNALS:
            out(f"deo: {name}: ignored (deo stops on SIGTERM or SIGINT and reloads nothing)")
        elif drain_first and not runner.stop_requested.is_set():
            out(f"deo: {name}: draining every worker, then stopping (again: stop at once)")
            runner.request_stop(drain=True)
        elif runner.stop_requested.is_set() and runner.drain_on_stop:
            out(
                f"deo: {name}: stopping now, without waiting for the drain (the workers "
                "keep draining; a restart adopts them)"
            )
            scope.cancel()
        else:
            out(f"deo: {name}: stopping (workers keep running)")
            scope.cancel()


def steady_wall_clock() -> Callable[[], float]:
    """Wall time as of now, advancing with the monotonic clock from here: it means the same
    across restarts (the log's times are wall times), and a step of the system clock while
    deo runs (NTP, a VM restored) moves no deadline. (The core never lets time go back, so a
    step back would otherwise hold every grace, drain and backoff for as long as the step.)"""
    origin = time.time() - time.monotonic()
    return lambda: origin + time.monotonic()


def drain_all_wait_s(state: State, now: float) -> float:
    """How long, from ``now``, every worker of ``state`` may take to end once all are drained.

    Drain, SIGTERM, SIGKILL and the give-up after it each have their deadline; past the latest
    the core has ended every worker. A worker already draining keeps the deadline it was given,
    which in ``"auto"`` may be longer than the one a drain would get now.
    """
    bound_s = 0.0
    for worker in state.workers.values():
        pool = state.pools.get(worker.pool)
        stop_s = DEFAULT_STOP_TIMEOUT_S if pool is None else pool.spec.stop_timeout_s
        if worker.deadline_t is not None:
            # Draining: two stop deadlines follow; stopping already: at most two as well.
            left_s = worker.deadline_t - now
        else:
            left_s = START_S if pool is None else drain_timeout(pool.spec, pool.drains)[0]
        bound_s = max(bound_s, left_s + 2 * stop_s)
    return bound_s


def _stop_timeout_s(pool: str | None, state: State, config: Config) -> float:
    """The stop timeout of ``pool`` in the state, or else in the configuration being applied."""
    specs = [p.spec for p in state.pools.values()] + list(config.pools)
    return next((s.stop_timeout_s for s in specs if s.name == pool), DEFAULT_STOP_TIMEOUT_S)


async def _sample_pressure(
    scope: anyio.CancelScope,
    sources: Sequence[Source],
    emit: Callable[[Event], None],
    clock: Callable[[], float],
) -> None:
    """Poll every pool's pressure source until ``scope`` is cancelled."""
    with scope:
        async with anyio.create_task_group() as tg:
            for source in sources:
                if isinstance(source, AtroposSource):
                    tg.start_soon(poll_atropos, source, emit, clock)
                else:
                    tg.start_soon(poll_json, source, emit, clock)


async def _stop_on_request(
    runner: Runner,
    scope: anyio.CancelScope,
    sampling: anyio.CancelScope,
    out: Callable[[str], None],
) -> None:
    await runner.stop_requested.wait()
    if runner.drain_on_stop:
        # Removing every pool makes the core drain (and escalate) every worker. Sampling stops
        # first: a sample for a pool being removed would only be refused.
        sampling.cancel()
        out("deo: stop requested: draining every worker first")
        drained = attrs.evolve(runner.state.config, pools=())
        await runner.submit(Configured(t=runner.clock(), config=drained))
        bound_s = drain_all_wait_s(runner.state, runner.clock())
        with anyio.move_on_after(bound_s + 10 * runner.tick_interval_s):
            while runner.state.workers and not runner.stop_now.is_set():
                await anyio.sleep(0.2)
        if runner.stop_now.is_set():
            out(
                "deo: stop requested without a drain: stopping now (the workers keep "
                "draining; a restart adopts them)"
            )
    out("deo: stop requested")
    scope.cancel()


if __name__ == "__main__":  # pragma: no cover
    sys.exit("use `deo run --config FILE`")
