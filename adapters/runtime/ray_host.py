"""The Ray actor that owns one worker's process on a Ray node.

See :mod:`adapters.runtime.ray_executor` for how deo uses it.

A :class:`WorkerHost` is a plain class; the executor makes it a detached, named Ray actor, one per
worker, named ``worker:WORKER_ID`` in the namespace of the deo log. It starts the worker from its
argv (never a shell) in a session of its own, with stdin /dev/null and stdout and stderr appended
to the worker log path it is given (a path on the node), and:

- signals it as the local executor does: the drain signal to the worker alone, SIGTERM and SIGKILL
  to its whole process group, each after checking the process is still the one started (pid and
  ``/proc`` start time);
- keeps the exit code once the worker ends, until deo has read it and removes the actor, so an
  exit that happens while deo is down is still reported with its code after a restart;
- for an engine, fills ``{host}`` in its argv with the node's address (the one Ray knows the node
  by, which deo reaches the engine at), reports that address, and says whether the socket
  listening on the engine's port is the engine's (from the node's ``/proc``: a server of another
  program on the port is never taken for the engine);
- ties the worker to itself: the worker gets SIGKILL when the actor's process dies (Linux
  ``PR_SET_PDEATHSIG``), so a removed actor or a dead Raylet leaves no orphan behind.

The actor is asynchronous: every method runs on one event-loop thread that lives as long as the
actor, which is what the death signal is tied to. This module does not import Ray; it is loaded
on the Ray nodes, where deo must be installed.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from adapters.runtime.port_owner import port_held_by
from adapters.runtime.processes import process_start_time
from core.config import fill_engine_host

__all__ = ["NODE_ENV", "WorkerHost"]

#: The Ray node id a worker runs on, in its environment (its GPU ids name the node too).
NODE_ENV = "DEO_RAY_NODE_ID"
#: prctl(2) option: the signal this process gets when its parent thread dies.
_PR_SET_PDEATHSIG = 1


def _load_prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl: Callable[..., int] = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return prctl


#: Looked up here, not in the child: between fork and exec of a threaded process (an actor is
#: one) the child must do as little as it can.
_PRCTL = _load_prctl()


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)


class WorkerHost:
    """Owns one worker process on the node it was placed on. Methods return plain values."""

    def __init__(self) -> None:
        self._popen: subprocess.Popen[bytes] | None = None
        self._start_time: int | None = None
        self._error: str | None = None
        self._exit: tuple[int | None, int | None] | None = None
        self._host: str | None = None

    async def start(
        self, argv: Sequence[str], env: Mapping[str, str], log_path: str, engine: bool = False
    ) -> dict[str, Any]:
        """Start the worker (once: a repeated call answers what the first did); an ``engine``
        gets the node's address for ``{host}`` in its argv.

        Returns ``pid``, ``start_time``, ``node_id``, ``host`` (the node's address, for an
        engine; None otherwise), ``ray_gpu_ids`` (the GPUs Ray reserved for this actor), or
        ``error`` saying why it could not be started."""
        if self._popen is None and self._error is None:
            if engine:
                self._host = _node_address()
                argv = fill_engine_host(argv, self._host)
            self._launch(list(argv), dict(env), log_path)
        return await self.info()

    def _launch(self, argv: list[str], env: dict[str, str], log_path: str) -> None:
        if not argv:
            self._error = "cannot execute an empty argv"
            return
        try:
            os.makedirs(os.path.dirname(log_path) or ".", exist_ok=True)
            log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            self._error = f"cannot open the worker log {log_path!r} on its node: {exc.strerror}"
            return
        env[NODE_ENV] = _node_id()
        try:
            self._popen = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log_fd,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                preexec_fn=_die_with_parent,  # the actor's loop thread outlives the child
            )
        except (OSError, ValueError, subprocess.SubprocessError) as exc:
            self._error = f"cannot execute {argv[0]!r}: {exc}"
            return
        finally:
            os.close(log_fd)
        self._start_time = process_start_time(self._popen.pid)

    async def info(self) -> dict[str, Any]:
        """What this host knows: the process, the node, and the exit once there is one."""
        popen = self._popen
        if popen is not None and self._exit is None:
            self._poll(popen)
        return {
            "pid": None if popen is None else popen.pid,
            "start_time": self._start_time,
            "node_id": _node_id(),
            "host": self._host,
            "ray_gpu_ids": [str(gpu) for gpu in _ray_gpu_ids()],
            "error": self._error,
            "exit": self._exit,
        }

    async def wait(self, poll_interval_s: float = 0.2) -> tuple[int | None, int | None]:
        """Wait for the worker to end: (exit code, None) or (None, signal number)."""
        popen = self._popen
        if popen is None:
            return (None, None)
        while self._exit is None:
            self._poll(popen)
            if self._exit is None:
                await asyncio.sleep(poll_interval_s)
        return self._exit

    def _poll(self, popen: subprocess.Popen[bytes]) -> None:
        code = popen.poll()  # reaps it: no zombie is left
        if code is not None:
            self._exit = (None, -code) if code < 0 else (code, None)

    async def port_held(self, port: int) -> bool | None:
        """Whether the socket listening on ``port`` on this node is held by the worker (or its
        session): True, False (by another process), None (``/proc`` cannot say, or no worker)."""
        popen = self._popen
        if popen is None or self._exit is not None:
            return None
        # A scan of /proc: off the actor's loop, which signals and reports exits meanwhile.
        return await asyncio.to_thread(port_held_by, port, popen.pid)

    async def signal(self, name: str, group: bool) -> bool:
        """Send signal ``name`` to the worker (its whole group when ``group``); False if it is
        gone. The identity check and the signal run with nothing in between."""
        popen = self._popen
        if popen is None or self._exit is not None:
            return False
        sig = signal.Signals[name]
        if popen.poll() is not None or process_start_time(popen.pid) != self._start_time:
            return False
        try:
            if group:
                os.killpg(popen.pid, sig)
            else:
                os.kill(popen.pid, sig)
        except ProcessLookupError:
            return False
        return True


def _node_id() -> str:
    import ray  # only ever called inside a Ray actor

    return str(ray.get_runtime_context().get_node_id())


def _node_address() -> str:
    """The address Ray knows this node by (``ray start --node-ip-address``), as the node's Raylet
    gave it to this worker process: no call to the head."""
    import ray

    return str(ray.util.get_node_ip_address())  # type: ignore[no-untyped-call]


def _ray_gpu_ids() -> list[Any]:
    import ray

    return list(ray.get_gpu_ids())


class GpuAgent:
    """Reads the health of some GPUs of the node it was placed on, with deo's NVML readers.

    ``backend`` and ``file`` are ``[nvml]``'s; in ``file`` a ``{node}`` is replaced by the node's
    deo name, so that each node can have its own file. ``indices`` are the GPUs' CUDA indices on
    the node. :meth:`read` answers readings by index, or the error that kept it from reading.
    """

    def __init__(self, node: str, backend: str, file: str | None, indices: Sequence[str]) -> None:
        self._node = node
        self._backend = backend
        self._file = None if file is None else file.replace("{node}", node)
        self._indices = list(indices)
        self._reader: Any = None
        self._error: str | None = None

    def _open(self) -> None:
        from pathlib import Path

        from adapters.sources.nvml import NvmlSettings, NvmlUnavailable, import_pynvml, open_reader

        try:
            nvml = import_pynvml() if self._backend in ("auto", "pynvml") else None
            settings = NvmlSettings(
                backend=self._backend, file=None if self._file is None else Path(self._file)
            )
            self._reader = open_reader(settings, {i: i for i in self._indices}, nvml)
        except NvmlUnavailable as exc:
            self._error = f"NVML unavailable on node {self._node}: {exc}"

    def read(self) -> dict[str, Any] | str:
        """Readings by CUDA index (:data:`~adapters.sources.nvml.GpuReading`), or an error."""
        if self._reader is None and self._error is None:
            self._open()
        if self._reader is None:
            return self._error or f"GPU health not read on node {self._node}"
        try:
            readings: dict[str, Any] = self._reader.read()
        except Exception as exc:  # a source never takes deo down
            return f"{type(exc).__name__}: {exc}"
        return readings
