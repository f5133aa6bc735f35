"""The API server's front door: deo's own accept loop, a connection cap and request deadlines.

uvicorn parses HTTP; this module decides which connections it gets. A client that opens many
connections and trickles header bytes into each (a "slow header" client) must neither hold the
API nor use up the process's file descriptors, which deo needs to spawn workers:

- **A cap on open connections**, derived from ``RLIMIT_NOFILE``: whatever the configured
  maximum, the cap leaves :data:`DESCRIPTOR_RESERVE` descriptors (beyond those open when the
  server starts) for worker processes, their logs and pidfds.
- **Accepting is deo's**: each connection is accepted here, counted against the cap, then handed
  to uvicorn's protocol (:meth:`asyncio.loop.connect_accepted_socket`). At the cap, the oldest
  connection that is *not* being answered (still sending its request, or idle between requests)
  is closed to make room; when every connection is being answered, accepting waits (the new
  connection waits in the kernel's backlog, which costs no descriptor).
- **A request deadline**: from its opening, and again after each response, a connection has
  ``request_timeout_s`` to deliver one complete request (headers and body); otherwise it is
  closed. A request being answered has no deadline here.
- **An accept that fails** (out of descriptors, from something else in the process) is logged
  once, retried with a pause, and logged once more when accepting works again.

A connection being answered is never cut for another one, so an operator's request, once it has
arrived, is answered; an operator's new connection displaces the oldest slow one.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import resource
import socket
from collections.abc import Callable
from typing import Any

import anyio
import attrs
from uvicorn.protocols.http.h11_impl import H11Protocol

__all__ = [
    "DEFAULT_MAX_CONNECTIONS",
    "DEFAULT_REQUEST_TIMEOUT_S",
    "DESCRIPTOR_RESERVE",
    "ConnectionGuard",
    "GuardCounters",
    "connection_cap",
]

log = logging.getLogger("deo.api")

#: Descriptors the API never takes: for spawning workers (log file, pidfd, exec pipe) and the
#: rest of deo (event log, snapshots, sources).
DESCRIPTOR_RESERVE = 128
DEFAULT_MAX_CONNECTIONS = 256
DEFAULT_REQUEST_TIMEOUT_S = 10.0
#: Fewest connections worth serving: below this the descriptor limit is too low to run deo.
MIN_CONNECTIONS = 8
#: Pause between accepts after one failed for want of descriptors.
ACCEPT_RETRY_S = 0.2

_OUT_OF_RESOURCES = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


def _open_descriptors() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 0


def connection_cap(max_connections: int, *, reserve: int = DESCRIPTOR_RESERVE) -> int:
    """The most connections the API may hold: ``max_connections``, or fewer where
    ``RLIMIT_NOFILE`` leaves less once the descriptors in use and ``reserve`` are set aside.

    Raises ValueError naming the limit when it leaves fewer than :data:`MIN_CONNECTIONS`.
    """
    if max_connections < 1:
        raise ValueError(f"max_connections must be >= 1, got {max_connections}")
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return max_connections
    in_use = _open_descriptors()
    free = soft - in_use - reserve
    if free < MIN_CONNECTIONS:
        raise ValueError(
            f"the open-file limit (ulimit -n {soft}) leaves {max(free, 0)} descriptors for API "
            f"connections after {in_use} in use and {reserve} kept for workers; "
            f"raise it to at least {in_use + reserve + MIN_CONNECTIONS}"
        )
    return min(max_connections, free)


@attrs.define
class GuardCounters:
    """What the guard did, for /metrics (counts since the server started)."""

    open: int = 0
    cap: int = 0
    #: Closed to make room for a newer connection at the cap.
    evicted: int = 0
    #: Closed because no complete request arrived within the deadline.
    timed_out: int = 0
    #: Accepts that failed for want of descriptors or memory.
    accept_errors: int = 0


class _GuardedH11(H11Protocol):
    """uvicorn's HTTP/1.1 protocol with a request deadline; registered with its guard."""

    guard: ConnectionGuard

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deadline: asyncio.TimerHandle | None = None

    @property
    def answering(self) -> bool:
        """A complete request has arrived and its response is not finished."""
        cycle = self.cycle
        return cycle is not None and not cycle.more_body and not cycle.response_complete

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)  # type: ignore[arg-type]
        self.guard.opened(self)
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self.guard.closed(self)
        super().connection_lost(exc)

    def handle_events(self) -> None:
        super().handle_events()
        if self.answering:
            self._disarm()

    def on_response_complete(self) -> None:
        # Armed first: answering a pipelined request (inside the call below) disarms it again.
        self._arm()
        super().on_response_complete()

    def drop(self) -> None:
        """Close the connection now, whatever it was sending."""
        self._disarm()
        if not self.transport.is_closing():
            self.transport.abort()

    def _arm(self) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(self.guard.request_timeout_s, self._expired)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self) -> None:
        self._deadline = None
        if not self.answering and not self.transport.is_closing():
            self.guard.counters.timed_out += 1
            self.drop()


class ConnectionGuard:
    """Accepts connections for uvicorn's protocol, within a cap and with request deadlines."""

    def __init__(
        self, *, cap: int, request_timeout_s: float, counters: GuardCounters | None = None
    ) -> None:
        if cap < 1:
            raise ValueError(f"cap must be >= 1, got {cap}")
        if not request_timeout_s > 0:
            raise ValueError(f"request_timeout_s must be > 0, got {request_timeout_s!r}")
        self.cap = cap
        self.request_timeout_s = request_timeout_s
        self.counters = counters if counters is not None else GuardCounters()
        self.counters.cap = cap
        #: Open connections, oldest first.
        self._open: dict[_GuardedH11, None] = {}
        #: Accepted, not yet handed to their protocol: they hold a descriptor already.
        self._handing_over = 0
        self._room = anyio.Event()

    def protocol_class(self) -> type[H11Protocol]:
        """uvicorn's protocol bound to this guard (give it to ``uvicorn.Config(http=...)``)."""
        guard = self

        class Protocol(_GuardedH11):
            pass

        Protocol.guard = guard
        return Protocol

    @property
    def held(self) -> int:
        """Connections holding a descriptor: open, or accepted and being handed over."""
        return len(self._open) + self._handing_over

    def opened(self, connection: _GuardedH11) -> None:
        self._open[connection] = None
        self.counters.open = len(self._open)

    def closed(self, connection: _GuardedH11) -> None:
        self._open.pop(connection, None)
        self.counters.open = len(self._open)
        self._room.set()

    def shutdown(self) -> None:
        """Ask every connection to close once its response (if any) is sent."""
        for connection in list(self._open):
            connection.shutdown()

    def abort_all(self) -> None:
        for connection in list(self._open):
            connection.drop()

    async def _make_room(self) -> None:
        """Return once one more connection fits, closing the oldest idle or slow one if that
        is what it takes, or waiting for one to close when every connection is answered."""
        while self.held >= self.cap:
            victim = next((c for c in self._open if not c.answering), None)
            if victim is not None:
                self.counters.evicted += 1
                self.closed(victim)  # its descriptor is gone once the loop runs its close
                victim.drop()
                # Let the transport close its socket before accepting another.
                await anyio.sleep(0)
                return
            self._room = anyio.Event()
            # Re-checked on every close and, because a response finishing does not close the
            # connection, every so often.
            with anyio.move_on_after(0.1):
                await self._room.wait()

    async def accept_forever(
        self, listener: socket.socket, protocol: Callable[[], asyncio.Protocol]
    ) -> None:
        """Accept connections on ``listener`` and serve each with a ``protocol()`` (an
        instance of :meth:`protocol_class`), until cancelled."""
        loop = asyncio.get_running_loop()
        listener.setblocking(False)
        failing = False
        while True:
            await anyio.wait_readable(listener)
            # Room is made for a connection that is there, never ahead of one.
            await self._make_room()
            try:
                connection, _address = listener.accept()
            except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                continue
            except OSError as exc:
                if exc.errno not in _OUT_OF_RESOURCES:
                    raise
                self.counters.accept_errors += 1
                if not failing:
                    failing = True
                    log.error(
                        "API: cannot accept connections: %s; retrying every %gs "
                        "(counted in deo_api_accept_errors_total, logged once)",
                        exc.strerror,
                        ACCEPT_RETRY_S,
                    )
                await anyio.sleep(ACCEPT_RETRY_S)
                continue
            if failing:
                failing = False
                log.warning("API: accepting connections again")
            if connection.family in (socket.AF_INET, socket.AF_INET6):
                # asyncio turns Nagle's algorithm off only for sockets whose proto says TCP, and
                # one accepted from socket.create_server's listener says 0: without this, a
                # response written in parts (headers, body) waits ~40 ms for a delayed ACK.
                connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._handing_over += 1
            try:
                await loop.connect_accepted_socket(protocol, connection)
            except OSError:
                connection.close()  # the client hung up before it was served
            finally:
                self._handing_over -= 1
