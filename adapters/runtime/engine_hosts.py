"""Where deo reaches each engine, and whose server answers on an engine's port.

The router, engine control (sleep, wake, flush, readiness and health) and the engine metrics
source reach an engine at ``http://HOST:PORT``: PORT is the core's (``Worker.port``), HOST is
the executor's to say, because only the executor knows the machine an engine runs on. On deo's
own machine (:class:`LocalEngineHosts`) HOST is always 127.0.0.1; with the Ray executor it is the
address of the engine's node (:class:`~adapters.runtime.ray_executor.RayExecutor` is an
:class:`EngineHosts` too).

A server answering ``/health`` on an engine's port is only taken for the engine once the socket
listening there is shown to be held by the engine's own process (or its session): checked on
the machine that runs it, from its ``/proc`` (:mod:`adapters.runtime.port_owner`).
"""

from __future__ import annotations

from typing import Protocol

import anyio

from adapters.runtime.port_owner import port_held_by

__all__ = ["LOCAL_ENGINE_HOST", "EngineHosts", "ExecutorHosts", "LocalEngineHosts", "base_url"]

#: Engines on deo's own machine listen on loopback, and deo reaches them there.
LOCAL_ENGINE_HOST = "127.0.0.1"


class EngineHosts(Protocol):
    """Where each engine runs, as the executor that started it knows."""

    def engine_host(self, worker_id: str) -> str | None:
        """The address deo reaches engine ``worker_id`` at; None while it is not known (the
        engine is not placed yet, or not adopted yet after a restart)."""
        ...

    async def engine_port_owned(self, worker_id: str, port: int, pid: int) -> bool | None:
        """Whether the socket listening on ``port`` where the engine runs is held by its process
        ``pid`` (or its session): True, False (another program's), None (cannot be told). Raises
        when the engine's machine cannot be asked now (the caller asks again later)."""
        ...


class LocalEngineHosts:
    """Engines on deo's own machine: on loopback, their ports checked through this ``/proc``."""

    def engine_host(self, worker_id: str) -> str | None:
        """Always :data:`LOCAL_ENGINE_HOST`."""
        return LOCAL_ENGINE_HOST

    async def engine_port_owned(self, worker_id: str, port: int, pid: int) -> bool | None:
        """:func:`~adapters.runtime.port_owner.port_held_by`, read in a thread (a session's scan
        can take tens of milliseconds)."""
        return await anyio.to_thread.run_sync(port_held_by, port, pid)


class ExecutorHosts:
    """The :class:`EngineHosts` of the executor ``deo run`` uses, chosen after the routers are
    bound (deo binds its ports before it joins a cluster): local until :meth:`use` says
    otherwise."""

    def __init__(self) -> None:
        self._hosts: EngineHosts = LocalEngineHosts()

    def use(self, hosts: EngineHosts) -> None:
        """Ask ``hosts`` from now on."""
        self._hosts = hosts

    def engine_host(self, worker_id: str) -> str | None:
        """The chosen executor's answer."""
        return self._hosts.engine_host(worker_id)

    async def engine_port_owned(self, worker_id: str, port: int, pid: int) -> bool | None:
        """The chosen executor's answer."""
        return await self._hosts.engine_port_owned(worker_id, port, pid)


def base_url(host: str, port: int) -> str:
    """An engine's base URL at ``host`` (an IPv6 address is bracketed) and ``port``."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{port}"
