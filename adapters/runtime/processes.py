"""The local process executor: the core's worker commands carried out with real processes.

:class:`LocalProcesses` turns ``SpawnWorker``, ``DrainWorker``, ``TerminateWorker`` and
``KillWorker`` into processes and signals, and reports what happens as core events
(``WorkerStarted``, ``SpawnFailed``, ``WorkerExited``) handed to an ``emit`` callable, like the
sources (``deo run`` gives it :meth:`Runner.emit <adapters.runtime.runner.Runner.emit>`).

- A worker's environment is what every worker inherits (``environ``) plus the ``SpawnWorker``'s
  ``env`` as the core wrote it (CUDA_VISIBLE_DEVICES among it), so the logged command says what
  the worker got. The executor adds only the path of the worker's heartbeat file
  (``DEO_HEARTBEAT_FILE``), beside its log, and what ``secret_environ`` gives that worker (its
  own API token): secrets stay out of the logged command.

- A worker is started from its argv list (never a shell) in its own session, so it leads its own
  process group; stdin is /dev/null and stdout and stderr are appended to ``LOG_DIR/ID.log``.
- A worker is identified by ``(pid, start_time)``, the start time being field 22 of
  ``/proc/PID/stat``. Every signal is preceded by that check, so a recycled pid that now belongs
  to a stranger is never signalled.
- Drain sends the pool's signal to the worker alone (it decides how to drain its children);
  terminate sends SIGTERM and kill SIGKILL to its whole process group.
- A command for a worker not known yet is remembered and applied once it is spawned (or
  adopted); a command for a worker that already exited is ignored.
- After an orchestrator restart, :meth:`LocalProcesses.adopt` takes over a worker the log says is
  alive if its start time still matches. It is not our child, so its exit is seen by polling
  /proc and its exit code cannot be known.
- When a worker ends, what it leaves behind is stopped (see :class:`LocalProcesses`): its
  descendants that called setsid() or outlived it in its group, found by the variables they
  inherited and, with deo the subreaper of its descendants, by being re-parented to deo.
  :meth:`LocalProcesses.stop_strays` does the same at start-up for processes of the run that no
  adopted worker accounts for.
- :meth:`LocalProcesses.run` watches every known worker and reports each exit exactly once.
  Cancelling it stops the watching, never the workers: the control plane's death must not kill
  the work. Run it again and the watching resumes.

Workers are started with :class:`subprocess.Popen` rather than :func:`anyio.open_process`: on
asyncio, anyio's process is reaped by asyncio's child watcher as soon as it exits, often before
its start time can be read (a fast-exiting child has no identity to report), and asyncio kills a
still-running child whose transport is closed or collected. A plain Popen child is reaped only
here, so its ``/proc`` entry is there to be read until we reap it. Its exit is awaited on a
pidfd (polled where the kernel has none) without blocking the event loop.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import NamedTuple

import anyio
import attrs
from anyio.abc import TaskGroup

from adapters.runtime.engine_hosts import LOCAL_ENGINE_HOST
from adapters.sources.heartbeat import HEARTBEAT_ENV, heartbeat_path
from core import (
    Command,
    DrainWorker,
    Event,
    KillWorker,
    LeftoverProcesses,
    LeftoverProcessesStopped,
    SpawnFailed,
    SpawnWorker,
    State,
    TerminateWorker,
    WorkerExited,
    WorkerStarted,
)
from core.config import fill_engine_host
from core.vocabulary import AlertName

__all__ = [
    "environ_of",
    "WORKER_ID_ENV",
    "LocalProcesses",
    "become_child_subreaper",
    "process_start_time",
    "processes_with",
    "signal_for",
]

log = logging.getLogger("deo.processes")

_Signalling = DrainWorker | TerminateWorker | KillWorker

#: The variable naming the worker a process was started as (the core writes it into every spawn);
#: the worker's descendants inherit it.
WORKER_ID_ENV = "DEO_WORKER_ID"
POOL_ENV = "DEO_POOL"
#: How long a stop of left-over processes waits when the pool's stop timeout is unknown.
DEFAULT_STOP_TIMEOUT_S = 10.0
#: prctl(2) option: orphaned descendants are re-parented to this process instead of init.
_PR_SET_CHILD_SUBREAPER = 36


class _Stat(NamedTuple):
    state: str  # "R", "S", ..., "Z" for a zombie: dead, waiting for its parent to reap it
    start_time: int  # clock ticks since boot
    parent: int  # the parent's pid (after re-parenting, the subreaper's or init's)
    group: int  # the process group id
    session: int  # the session id


def _read_stat(pid: int) -> _Stat | None:
    # Reading procfs is served from kernel memory and never blocks, so no thread is needed.
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            data = stat.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # Field 2 is the command name in parentheses and may itself hold spaces or ")", so the fields
    # are counted from the last ")": after it come field 3 (state) ... field 22 (starttime).
    fields = data[data.rindex(b")") + 1 :].split()
    return _Stat(
        state=fields[0].decode(),
        start_time=int(fields[19]),
        parent=int(fields[1]),
        group=int(fields[2]),
        session=int(fields[3]),
    )


def process_start_time(pid: int) -> int | None:
    """The start time of process ``pid`` (``/proc/PID/stat`` field 22, clock ticks since boot).

    None if there is no such process. With the pid it identifies a process for good: a pid can be
    reused, a (pid, start time) pair cannot.
    """
    if pid <= 0:
        return None
    stat = _read_stat(pid)
    return None if stat is None else stat.start_time


def environ_of(pid: int) -> dict[str, str] | None:
    """The environment process ``pid`` was started with (None: gone, or not ours to read)."""
    return _environ_of(pid)


def _environ_of(pid: int) -> dict[str, str] | None:
    """The environment process ``pid`` was started with; None if it is gone or not ours to
    read (a zombie's reads empty)."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return None
    pairs = (item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
    return {k.decode(errors="replace"): v.decode(errors="replace") for k, v in pairs}


def processes_with(variables: Mapping[str, str]) -> list[int]:
    """The pids of live processes whose environment holds every one of ``variables``."""
    wanted = {f"{k}={v}".encode() for k, v in variables.items()}
    found: list[int] = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            environ = Path(entry.path, "environ").read_bytes()
        except OSError:
            continue  # gone, or not ours to read
        if wanted <= set(environ.split(b"\0")):
            found.append(int(entry.name))
    return found


def _all_pids() -> list[int]:
    return [int(entry.name) for entry in os.scandir("/proc") if entry.name.isdigit()]


def _children() -> list[int]:
    """This process's children (re-parented orphans among them when it is a subreaper)."""
    found: list[int] = []
    try:
        for task in os.scandir("/proc/self/task"):
            found += [int(pid) for pid in Path(task.path, "children").read_text().split()]
        return found
    except OSError:  # a kernel without /proc/PID/task/TID/children: look at every process
        me = os.getpid()
        for entry in os.scandir("/proc"):
            if entry.name.isdigit():
                stat = _read_stat(int(entry.name))
                if stat is not None and stat.parent == me:
                    found.append(int(entry.name))
        return found


def _orphans(children: Iterable[int], stats: Mapping[int, _Stat]) -> list[int]:
    """Those of our ``children`` that came to us as orphans of a worker's descendants.

    Workers start in sessions of their own, and no descendant of theirs can join ours; a child
    this process started otherwise (without a new session) stays in our session. Those are
    somebody else's to watch and reap: a program running deo in-process may have its own.
    """
    ours = os.getsid(0)
    return [pid for pid in children if pid in stats and stats[pid].session != ours]


def become_child_subreaper() -> bool:
    """Make this process the subreaper of its descendants (Linux ``PR_SET_CHILD_SUBREAPER``):
    a worker's child whose parent exits, or that double-forks away, becomes our child instead of
    init's, so it can be found, stopped and reaped. False where the OS has no such thing."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False


@attrs.define
class _Leftover:
    """A process of this run that is no live worker."""

    pid: int
    start_time: int
    worker_id: str | None
    pool: str | None
    how: str  # how it was found, for the alert

    def __str__(self) -> str:
        return f"pid {self.pid} ({self.how})"


@attrs.define
class _Worker:
    worker_id: str
    pid: int
    start_time: int
    #: Our child, or None for an adopted worker (someone else reaps it).
    popen: subprocess.Popen[bytes] | None = None
    #: Readable once the child exits; None when the kernel has no pidfds (then we poll).
    pidfd: int | None = None
    #: A watcher task is running for it.
    watched: bool = False
    #: Set once the exit is known (the child reaped, or the adopted process gone).
    exit: WorkerExited | None = None
    #: Its pool, for the stop timeout of what it leaves behind (None: not known).
    pool: str | None = None
    #: The heartbeat file it was given, where an adopted worker's is not this run's default
    #: (``deo.worker_logs`` changed across the restart).
    heartbeat_file: Path | None = None


def _describe(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.errno is not None:
        return f"{exc.strerror} ({errno.errorcode.get(exc.errno, exc.errno)})"
    return str(exc)


def signal_for(command: _Signalling) -> tuple[signal.Signals, bool]:
    """The signal a command sends and whether it goes to the whole process group."""
    if isinstance(command, DrainWorker):
        try:
            return signal.Signals[command.signal], False
        except KeyError:
            raise ValueError(
                f"DrainWorker for {command.worker_id!r}: {command.signal!r} is not a signal name"
            ) from None
    if isinstance(command, TerminateWorker):
        return signal.SIGTERM, True
    return signal.SIGKILL, True


def _start(
    command: SpawnWorker,
    log_path: Path,
    environ: dict[str, str],
    secrets: Mapping[str, str] | None = None,
) -> subprocess.Popen[bytes] | str:
    """Start the worker's process with ``environ``, the command's env and ``secrets`` (later
    ones win), or say why it could not be started."""
    argv = list(command.argv)  # a list, so Popen executes it directly: never a shell
    if command.port is not None:
        argv = fill_engine_host(argv, LOCAL_ENGINE_HOST)  # engines bind loopback, beside deo
    if not argv:
        return "cannot execute an empty argv"
    try:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        # Append: a respawn or an orchestrator restart never erases what a worker said.
        log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        return f"cannot open the worker log {str(log_path)!r}: {_describe(exc)}"
    try:
        # Popen returns once the exec has succeeded or failed: a few milliseconds of fork and
        # exec, which anyio's open_process also spends on the event loop.
        return subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log_fd,
            stderr=subprocess.STDOUT,
            env={**environ, **command.env, **(secrets or {})},
            start_new_session=True,  # its own process group, and no terminal's signals
        )
    except (OSError, ValueError, subprocess.SubprocessError) as exc:
        return f"cannot execute {argv[0]!r}: {_describe(exc)}"
    finally:
        os.close(log_fd)  # the child has its own copy


def _still_there(leftover: _Leftover) -> bool:
    stat = _read_stat(leftover.pid)
    return stat is not None and stat.state != "Z" and stat.start_time == leftover.start_time


def _signal_leftover(leftover: _Leftover, sig: signal.Signals, groups: set[int]) -> None:
    """Signal ``leftover`` and, when it is in one of ``groups`` (the ended worker's, or one a
    leftover leads), its whole group: the group holds what it started, variables cleared or not.
    The group id is safe to use while the leftover, checked just before, is still in it."""
    # As for workers: the identity check comes right before the signal, with no await between.
    stat = _read_stat(leftover.pid)
    if stat is None or stat.state == "Z" or stat.start_time != leftover.start_time:
        return
    try:
        if stat.group in groups:
            os.killpg(stat.group, sig)
        else:
            os.kill(leftover.pid, sig)
    except ProcessLookupError:
        pass
    except PermissionError as exc:
        log.warning("cannot signal left-over pid %d: %s", leftover.pid, exc)


def _open_pidfd(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except OSError:  # an old kernel or a seccomp filter without pidfd_open: poll instead
        return None


class LocalProcesses:
    """Carries out worker commands with local processes and reports the results as events.

    ``execute`` and ``adopt`` may be called whether or not ``run`` is running, but exits are only
    seen (and children only reaped) while it runs: start ``run`` in a task group beside the code
    that calls ``execute``. ``poll_interval_s`` is how often an adopted worker's /proc entry is
    checked.

    With ``run_marks`` (the variables every worker of this run inherits, such as its run id), what
    a worker leaves behind when it ends is stopped: every process carrying those variables and
    its ``DEO_WORKER_ID``, with ``reap_orphans`` (this process is the subreaper of its
    descendants) every child of ours that is no worker and carries none of those variables, and
    every descendant of these. Each gets SIGTERM (with its process group when that is the
    worker's or its own), then SIGKILL after the pool's ``stop_timeout_s(pool)``. A
    :class:`~core.events.LeftoverProcesses` event names them first, and
    :class:`~core.events.LeftoverProcessesStopped` follows once they are all gone.
    ``reap_orphans`` also reaps those re-parented children once they exit, never a worker (whose
    exit status only its watcher collects).
    """

    def __init__(
        self,
        emit: Callable[[Event], None],
        *,
        clock: Callable[[], float],
        log_dir: Path,
        poll_interval_s: float = 0.5,
        environ: Mapping[str, str] | None = None,
        run_marks: Mapping[str, str] | None = None,
        stop_timeout_s: Callable[[str | None], float] = lambda pool: DEFAULT_STOP_TIMEOUT_S,
        reap_orphans: bool = False,
        secret_environ: Callable[[str], Mapping[str, str]] | None = None,
    ) -> None:
        """``emit`` takes each event and must not block. ``environ`` is what workers inherit
        (default: this process's environment); each spawn's own variables are added to it, then
        ``secret_environ(worker_id)``, the variables of that worker alone that are not logged."""
        if not poll_interval_s > 0:
            raise ValueError(f"poll_interval_s must be > 0, got {poll_interval_s!r}")
        self._emit = emit
        self._clock = clock
        self._log_dir = log_dir
        self._environ = dict(os.environ if environ is None else environ)
        self._secret_environ = secret_environ
        self._poll_interval_s = poll_interval_s
        self._workers: dict[str, _Worker] = {}
        #: Workers whose exit was reported; worker ids are never reused, so later commands for
        #: them are late and ignored.
        self._finished: set[str] = set()
        #: Signalling commands for workers not known yet, applied when they are spawned.
        self._pending: dict[str, list[_Signalling]] = {}
        self._task_group: TaskGroup | None = None
        self._run_marks = dict(run_marks or {})
        self._stop_timeout_s = stop_timeout_s
        self._reap_orphans = reap_orphans

    async def execute(self, command: Command) -> None:
        """Carry out one command; commands with nothing to execute here are ignored.

        A spawn that fails is reported as ``SpawnFailed``, never raised. Drain, terminate and kill
        for a worker not spawned yet are applied once it is; for one that exited they are ignored.
        """
        if isinstance(command, SpawnWorker):
            self._spawn(command)
        elif isinstance(command, DrainWorker | TerminateWorker | KillWorker):
            signal_for(command)  # a bad signal name fails here, not when it is finally applied
            worker = self._workers.get(command.worker_id)
            if worker is not None:
                self._signal(worker, command)
            elif command.worker_id not in self._finished:
                self._pending.setdefault(command.worker_id, []).append(command)

    async def adopt(
        self, worker_id: str, pid: int, start_time: int, *, pool: str | None = None
    ) -> bool:
        """Take over a worker found alive after an orchestrator restart.

        True if process ``pid`` is alive and started at ``start_time``: it is then watched and
        signalled like a worker of ours, and its exit is reported without code or signal (it is
        not our child, so they cannot be known). False otherwise, touching nothing.
        """
        known = self._workers.get(worker_id)
        if known is not None:  # adopted twice: fine if it is the same process
            return known.exit is None and (known.pid, known.start_time) == (pid, start_time)
        if worker_id in self._finished or pid <= 0:
            return False
        stat = _read_stat(pid)
        if stat is None or stat.state == "Z" or stat.start_time != start_time:
            return False
        given = (_environ_of(pid) or {}).get(HEARTBEAT_ENV)
        worker = _Worker(
            worker_id=worker_id,
            pid=pid,
            start_time=start_time,
            pool=pool,
            heartbeat_file=Path(given) if given else None,
        )
        self._workers[worker_id] = worker
        for pending in self._pending.pop(worker_id, []):
            self._signal(worker, pending)
        self._watch(worker)
        return True

    def heartbeat_file(self, worker_id: str) -> Path:
        """The file worker ``worker_id`` touches to say it is alive: the one its environment
        names (an adopted worker keeps the one an earlier run gave it)."""
        worker = self._workers.get(worker_id)
        if worker is not None and worker.heartbeat_file is not None:
            return worker.heartbeat_file
        return heartbeat_path(self._log_dir, worker_id)

    async def run(self) -> None:
        """Watch every known worker and report its exit, until cancelled.

        Cancelling stops the watching and leaves the workers running; a later ``run`` resumes
        watching them, reporting exits that happened meanwhile.
        """
        if self._task_group is not None:
            raise RuntimeError("LocalProcesses.run() is already running")
        try:
            async with anyio.create_task_group() as task_group:
                self._task_group = task_group
                for worker in list(self._workers.values()):
                    self._watch(worker)
                if self._reap_orphans:
                    task_group.start_soon(self._reap_loop, name="reap orphans")
                await anyio.sleep_forever()
        finally:
            self._task_group = None

    async def stop_strays(self) -> int:
        """Stop every process carrying ``run_marks`` whose ``DEO_WORKER_ID`` names no worker
        known here (spawned or adopted): a worker the log lost, or what an ended worker left
        behind while no deo watched. Each worker id found gets a
        :class:`~core.events.LeftoverProcesses` event; returns once all are gone (or survived
        SIGKILL), with how many there were. Call it after adopting, before any spawn."""
        if not self._run_marks:
            return 0
        found = [
            leftover
            for leftover in self._leftovers(None)
            if leftover.worker_id is None or leftover.worker_id not in self._workers
        ]
        by_worker: dict[str, list[_Leftover]] = {}
        for leftover in found:
            by_worker.setdefault(leftover.worker_id or "unknown", []).append(leftover)
        async with anyio.create_task_group() as task_group:
            for worker_id, leftovers in by_worker.items():
                task_group.start_soon(self._stop_leftovers, worker_id, leftovers, None, None)
        return len(found)

    def leftovers_gone(self, state: State) -> list[LeftoverProcessesStopped]:
        """A :class:`~core.events.LeftoverProcessesStopped` for each ``leftover_processes`` alert
        raised in ``state`` with no process of this run left for its worker.

        A sweep cut short (deo stopped while it waited) never reports its processes gone, and
        they may end while no deo watches: call it after :meth:`stop_strays`, which reports
        those still there, so no alert stays raised with nothing behind it. Without
        ``run_marks`` nothing tells this run's processes apart: none is resolved."""
        if not self._run_marks:
            return []
        left = {leftover.worker_id or "unknown" for leftover in self._leftovers(None)}
        return [
            LeftoverProcessesStopped(t=self._clock(), worker_id=subject)
            for alert, subject in sorted(state.alerts)
            if alert is AlertName.LEFTOVER_PROCESSES and subject not in left
        ]

    # --- internals -------------------------------------------------------------------------------

    def _leftovers(self, worker_id: str | None) -> list[_Leftover]:
        """Processes of this run that are no live worker: those carrying ``worker_id`` (any
        worker id when None), this process's children that carry no worker id, and every
        descendant of those (whatever its environment: a child may clear it)."""
        me = os.getpid()
        live = {w.pid for w in self._workers.values() if w.exit is None} | {me}
        stats = {pid: stat for pid in _all_pids() if (stat := _read_stat(pid)) is not None}
        children: dict[int, list[int]] = {}
        for pid, stat in stats.items():
            children.setdefault(stat.parent, []).append(pid)
        marked = set(processes_with(self._run_marks))
        orphans = set(_orphans(children.get(me, ()), stats)) if self._reap_orphans else set()
        found: dict[int, _Leftover] = {}
        for pid in sorted(marked | orphans):
            stat = stats.get(pid)
            if pid in live or stat is None or stat.state == "Z":
                continue
            environ = _environ_of(pid) or {}
            owner = environ.get(WORKER_ID_ENV)
            if pid in marked and owner is not None:
                if worker_id is not None and owner != worker_id:
                    continue  # another worker's, alive or swept on its own exit
                how = "re-parented to deo" if stat.parent == me else f"child of pid {stat.parent}"
            elif owner is None and not any(k in environ for k in self._run_marks):
                how = "re-parented to deo, without deo's variables"
            else:
                continue  # another run's, or ours without a worker id: not to guess about
            found[pid] = _Leftover(pid, stat.start_time, owner, environ.get(POOL_ENV), how)
        # Their descendants, found by parent links while their parents still live.
        queue = list(found)
        while queue:
            parent = found[queue.pop()]
            for pid in children.get(parent.pid, ()):
                stat = stats[pid]
                if pid in found or pid in live or stat.state == "Z":
                    continue
                how = f"child of pid {parent.pid}"
                found[pid] = _Leftover(pid, stat.start_time, parent.worker_id, parent.pool, how)
                queue.append(pid)
        for leftover in found.values():
            stat = stats[leftover.pid]
            if stat.session == leftover.pid:
                leftover.how += ", leads its own session"
        return sorted(found.values(), key=lambda leftover: leftover.pid)

    async def _sweep(self, worker: _Worker) -> None:
        leftovers = self._leftovers(worker.worker_id)
        if leftovers:
            await self._stop_leftovers(worker.worker_id, leftovers, worker.pool, worker.pid)

    async def _stop_leftovers(
        self,
        worker_id: str,
        leftovers: list[_Leftover],
        pool: str | None,
        worker_group: int | None = None,
    ) -> None:
        """SIGTERM, then SIGKILL after the stop timeout, to ``leftovers``; the event first."""
        pool = pool or next((p.pool for p in leftovers if p.pool), None)
        timeout_s = self._stop_timeout_s(pool)
        self._emit(
            LeftoverProcesses(
                t=self._clock(),
                worker_id=worker_id,
                count=len(leftovers),
                detail=", ".join(map(str, leftovers))
                + f"; SIGTERM, then SIGKILL after {timeout_s:g}s",
            )
        )
        groups = {p.pid for p in leftovers} | ({worker_group} if worker_group else set())
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for leftover in leftovers:
                _signal_leftover(leftover, sig, groups)
            with anyio.move_on_after(timeout_s):
                while any(_still_there(p) for p in leftovers):
                    await anyio.sleep(min(0.1, self._poll_interval_s))
        survivors = [str(p) for p in leftovers if _still_there(p)]
        if survivors:  # the alert stays raised
            log.warning("%s: still running after SIGKILL: %s", worker_id, ", ".join(survivors))
        else:
            self._emit(LeftoverProcessesStopped(t=self._clock(), worker_id=worker_id))

    async def _reap_loop(self) -> None:
        # Orphans re-parented to us are reaped here, by pid, never by waiting for any child:
        # a worker's exit status belongs to its watcher (Popen.poll), which must not lose it.
        while True:
            workers = {w.pid for w in self._workers.values() if w.popen is not None}
            children = [pid for pid in _children() if pid not in workers]
            stats = {pid: stat for pid in children if (stat := _read_stat(pid)) is not None}
            for pid in _orphans(children, stats):
                if stats[pid].state == "Z":
                    with contextlib.suppress(ChildProcessError):
                        os.waitpid(pid, os.WNOHANG)
            await anyio.sleep(self._poll_interval_s)

    def _spawn(self, command: SpawnWorker) -> None:
        worker_id = command.worker_id
        if worker_id in self._workers or worker_id in self._finished:
            return  # worker ids are never reused: this is a duplicate, and one process is enough
        environ = {**self._environ, HEARTBEAT_ENV: str(self.heartbeat_file(worker_id))}
        secrets = {} if self._secret_environ is None else self._secret_environ(worker_id)
        started = _start(command, self._log_dir / f"{worker_id}.log", environ, secrets)
        if isinstance(started, str):
            self._pending.pop(worker_id, None)
            self._emit(SpawnFailed(t=self._clock(), worker_id=worker_id, error=started))
            return
        # Only we reap this child, so its /proc entry outlives even an instant exit until we do.
        start_time = process_start_time(started.pid)
        if start_time is None:
            started.kill()
            raise RuntimeError(f"cannot read /proc/{started.pid}/stat: is /proc mounted?")
        worker = _Worker(
            worker_id=worker_id,
            pid=started.pid,
            start_time=start_time,
            popen=started,
            pidfd=_open_pidfd(started.pid),
            pool=command.pool,
        )
        self._workers[worker_id] = worker
        # Spawning has no await, so commands that came before the spawn are the only ones
        # pending, they apply in the order they came, and WorkerStarted is emitted before any
        # watcher could report the exit.
        for pending in self._pending.pop(worker_id, []):
            self._signal(worker, pending)
        self._emit(
            WorkerStarted(
                t=self._clock(), worker_id=worker_id, pid=worker.pid, start_time=start_time
            )
        )
        self._watch(worker)

    def _signal(self, worker: _Worker, command: _Signalling) -> None:
        sig, group = signal_for(command)
        if worker.exit is not None:
            return
        # The identity check and the signal run with no await between them. A child of ours
        # cannot be reaped in between (only our watcher reaps it, on this thread); for an adopted
        # worker a recycle in those microseconds is the remaining, unavoidable race.
        if process_start_time(worker.pid) != worker.start_time:
            return  # gone, and the pid may already belong to a stranger
        try:
            # A worker we started leads its group. An adopted process that does not would put
            # someone else's group (perhaps ours) in the line of fire: signal it alone then.
            if group and os.getpgid(worker.pid) == worker.pid:
                os.killpg(worker.pid, sig)
            else:
                os.kill(worker.pid, sig)
        except ProcessLookupError:
            pass  # it exited just now; its watcher reports it
        except PermissionError as exc:
            # e.g. a worker that switched user: deo cannot signal it. The drain deadline still
            # escalates, and the core raises an alert if the worker never exits.
            log.warning("cannot signal %s (pid %d): %s", worker.worker_id, worker.pid, exc)

    def _watch(self, worker: _Worker) -> None:
        if self._task_group is None or worker.watched:
            return  # run() starts it later, or it is watched already
        worker.watched = True
        self._task_group.start_soon(self._watch_worker, worker, name=f"watch {worker.worker_id}")

    async def _watch_worker(self, worker: _Worker) -> None:
        try:
            if worker.exit is None:
                if worker.popen is not None:
                    worker.exit = await self._child_exit(worker, worker.popen)
                else:
                    await self._adopted_gone(worker)
                    worker.exit = WorkerExited(t=self._clock(), worker_id=worker.worker_id)
            self._emit(worker.exit)
            del self._workers[worker.worker_id]
            self._finished.add(worker.worker_id)
        finally:
            worker.watched = False
        if self._run_marks:
            await self._sweep(worker)

    async def _child_exit(self, worker: _Worker, popen: subprocess.Popen[bytes]) -> WorkerExited:
        # poll() reaps the child once it has exited, so no zombie is left behind.
        while (code := popen.poll()) is None:
            if worker.pidfd is not None:
                await anyio.wait_readable(worker.pidfd)
                # Readable means exited; poll from here on so a pidfd that stays readable while
                # the child is somehow not yet reapable cannot spin the loop.
                os.close(worker.pidfd)
                worker.pidfd = None
            else:
                await anyio.sleep(self._poll_interval_s)
        if worker.pidfd is not None:
            os.close(worker.pidfd)
            worker.pidfd = None
        t = self._clock()
        if code < 0:
            return WorkerExited(t=t, worker_id=worker.worker_id, signal=-code)
        return WorkerExited(t=t, worker_id=worker.worker_id, exit_code=code)

    async def _adopted_gone(self, worker: _Worker) -> None:
        # Not our child: no pidfd wait without a race, no exit code. A zombie counts as gone (it is
        # dead, only not yet reaped by its parent), and so does a pid now started at another time.
        while True:
            stat = _read_stat(worker.pid)
            if stat is None or stat.state == "Z" or stat.start_time != worker.start_time:
                return
            await anyio.sleep(self._poll_interval_s)
