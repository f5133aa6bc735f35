"""Serving deo's HTTP apps: a listening socket and uvicorn behind deo's own connection guard.

The API (:mod:`adapters.api.app`) and the engine pools' routers (:mod:`adapters.router`) are both
served by :func:`serve`; it sits apart from them so that either can use it without importing the
other.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable

import anyio
import uvicorn
from starlette.applications import Starlette
from uvicorn.server import ServerState

from adapters.api.guard import (
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_REQUEST_TIMEOUT_S,
    ConnectionGuard,
    GuardCounters,
    connection_cap,
)

__all__ = ["LISTEN_BACKLOG", "SHUTDOWN_GRACE_S", "listen", "serve"]

#: How long a cancelled server waits for requests in flight before cutting them off.
SHUTDOWN_GRACE_S = 5

#: Connections the kernel queues for the accept loop (capped by net.core.somaxconn).
LISTEN_BACKLOG = 2048


def listen(host: str, port: int) -> socket.socket:
    """A listening socket for :func:`serve`; bind it early to learn the port before serving."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # A long kernel queue costs no descriptors: connections wait there while the guard is full.
    return socket.create_server((host, port), family=family, backlog=LISTEN_BACKLOG)


async def serve(
    app: Starlette,
    *,
    host: str = "127.0.0.1",
    port: int = 8787,
    started: Callable[[int], None] | None = None,
    sock: socket.socket | None = None,
    max_connections: int = DEFAULT_MAX_CONNECTIONS,
    request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
) -> None:
    """Serve ``app`` until cancelled, then shut down gracefully. Needs the asyncio backend.

    Loopback by default because the GET endpoints are open. ``port=0`` picks a free port;
    ``started(port)`` is called with the actual one once the server listens. ``sock``, from
    :func:`listen`, replaces ``host`` and ``port``. Connections are accepted by a
    :class:`~adapters.api.guard.ConnectionGuard`: at most ``max_connections`` (fewer where the
    open-file limit leaves less beside the descriptors kept for workers), each given
    ``request_timeout_s`` to deliver a complete request. ValueError if the open-file limit is too
    low to serve at all.
    """
    # Bind here rather than in uvicorn: a port in use then raises OSError to the caller, where
    # uvicorn would log it and call sys.exit.
    if sock is None:
        sock = listen(host, port)
    try:
        counters = getattr(app.state, "guard_counters", None)
        guard = ConnectionGuard(
            cap=connection_cap(max_connections),
            request_timeout_s=request_timeout_s,
            counters=counters if isinstance(counters, GuardCounters) else None,
        )
        config = uvicorn.Config(
            app,
            log_level="warning",
            # None keeps uvicorn from replacing the process's logging configuration with its own.
            log_config=None,
            lifespan="off",
        )
        config.load()
        server_state = ServerState()
        protocol = guard.protocol_class()

        def connection() -> asyncio.Protocol:
            return protocol(config=config, server_state=server_state, app_state={})

        if started is not None:
            started(sock.getsockname()[1])
        try:
            await guard.accept_forever(sock, connection)
        finally:
            # Shielded, so that cancelling serve() stops in order: no new connections, idle
            # ones closed, requests in flight given SHUTDOWN_GRACE_S to finish.
            with anyio.CancelScope(shield=True):
                sock.close()
                guard.shutdown()
                with anyio.move_on_after(SHUTDOWN_GRACE_S):
                    while server_state.tasks:
                        await anyio.sleep(0.05)
                for task in list(server_state.tasks):
                    task.cancel()
                guard.abort_all()
    finally:
        sock.close()
