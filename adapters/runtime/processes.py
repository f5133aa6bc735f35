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

import errno
import logging
import os
import signal
import subprocess
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import NamedTuple

import anyio
import attrs
from anyio.abc import TaskGroup

from adapters.sources.heartbeat import HEARTBEAT_ENV, heartbeat_path
from core import (
    Command,
    DrainWorker,
    Event,
    KillWorker,
    SpawnFailed,
    SpawnWorker,
    TerminateWorker,
    WorkerExited,
    WorkerStarted,
)

__all__ = ["LocalProcesses", "process_start_time"]

log = logging.getLogger("deo.processes")

_Signalling = DrainWorker | TerminateWorker | KillWorker


class _Stat(NamedTuple):
    state: str  # "R", "S", ..., "Z" for a zombie: dead, waiting for its parent to reap it
    start_time: int  # clock ticks since boot


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
    return _Stat(state=fields[0].decode(), start_time=int(fields[19]))


def process_start_time(pid: int) -> int | None:
    """The start time of process ``pid`` (``/proc/PID/stat`` field 22, clock ticks since boot).

    None if there is no such process. With the pid it identifies a process for good: a pid can be
    reused, a (pid, start time) pair cannot.
    """
    if pid <= 0:
        return None
    stat = _read_stat(pid)
    return None if stat is None else stat.start_time


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


def _describe(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.errno is not None:
        return f"{exc.strerror} ({errno.errorcode.get(exc.errno, exc.errno)})"
    return str(exc)


def _signal_for(command: _Signalling) -> tuple[signal.Signals, bool]:
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
    """

    def __init__(
        self,
        emit: Callable[[Event], None],
        *,
        clock: Callable[[], float],
        log_dir: Path,
        poll_interval_s: float = 0.5,
        environ: Mapping[str, str] | None = None,
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

    async def execute(self, command: Command) -> None:
        """Carry out one command; commands with nothing to execute here are ignored.

        A spawn that fails is reported as ``SpawnFailed``, never raised. Drain, terminate and kill
        for a worker not spawned yet are applied once it is; for one that exited they are ignored.
        """
        if isinstance(command, SpawnWorker):
            self._spawn(command)
        elif isinstance(command, DrainWorker | TerminateWorker | KillWorker):
            _signal_for(command)  # a bad signal name fails here, not when it is finally applied
            worker = self._workers.get(command.worker_id)
            if worker is not None:
                self._signal(worker, command)
            elif command.worker_id not in self._finished:
                self._pending.setdefault(command.worker_id, []).append(command)

    async def adopt(self, worker_id: str, pid: int, start_time: int) -> bool:
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
        worker = _Worker(worker_id=worker_id, pid=pid, start_time=start_time)
        self._workers[worker_id] = worker
        for pending in self._pending.pop(worker_id, []):
            self._signal(worker, pending)
        self._watch(worker)
        return True

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
                await anyio.sleep_forever()
        finally:
            self._task_group = None

    # --- internals -------------------------------------------------------------------------------

    def _spawn(self, command: SpawnWorker) -> None:
        worker_id = command.worker_id
        if worker_id in self._workers or worker_id in self._finished:
            return  # worker ids are never reused: this is a duplicate, and one process is enough
        environ = {
            **self._environ,
            HEARTBEAT_ENV: str(heartbeat_path(self._log_dir, worker_id)),
        }
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
        sig, group = _signal_for(command)
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
