"""Drain on deo's signal: finish the work in hand, then exit 0.

deo drains a worker by sending its pool's drain signal (``SIGUSR1`` unless the pool's
``drain_signal`` says otherwise) and waits ``drain_timeout_s`` for it to exit before it escalates
to SIGTERM and SIGKILL. A :class:`Drain` turns that signal into a flag that synchronous code polls
(``while not drain.requested: ...``) and an awaitable that asynchronous code waits on
(``await drain.wait()``, under asyncio or anyio).

Install it first thing in the worker: until a handler is installed, SIGUSR1's default action kills
the process.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
from collections.abc import Iterable
from types import FrameType, TracebackType
from typing import Any

import anyio

__all__ = ["DEFAULT_DRAIN_SIGNALS", "Drain"]

#: deo's default drain signal (core/config.py ``PoolSpec.drain_signal``).
DEFAULT_DRAIN_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGUSR1,)

#: How often :meth:`Drain.wait` looks at the flag where no asyncio loop can be woken (trio).
_POLL_S = 0.05

_Handler = Any  # what signal.signal accepts and returns: a callable, SIG_DFL, SIG_IGN or None


def _to_signal(value: signal.Signals | int | str, where: str) -> signal.Signals:
    try:
        if isinstance(value, str):
            name = value.upper()
            return signal.Signals[name if name.startswith("SIG") else "SIG" + name]
        return signal.Signals(value)
    except (KeyError, ValueError):
        raise ValueError(f"{where}: {value!r} is not a signal") from None


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class Drain:
    """A drain request from deo: a flag set by the drain signal, and a way to wait for it.

    ``Drain()`` installs handlers for ``signals`` (names like ``"SIGUSR1"`` are accepted too) in
    the main thread; :meth:`close` — or leaving a ``with Drain() as drain:`` block — puts the
    previous handlers back. The latest handler installed for a signal wins, so nested drains
    close in reverse order. A second signal changes nothing: draining is already under way.
    """

    def __init__(
        self, signals: Iterable[signal.Signals | int | str] = DEFAULT_DRAIN_SIGNALS
    ) -> None:
        self.signals = tuple(_to_signal(s, "Drain(signals=...)") for s in signals)
        if not self.signals:
            raise ValueError("Drain(signals=...): give at least one signal")
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("Drain() installs signal handlers: create it in the main thread")
        self._requested = False
        self._signal: signal.Signals | None = None
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        self._previous: dict[signal.Signals, _Handler] = {}
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._on_signal)

    @property
    def requested(self) -> bool:
        """True once the drain signal arrived (or :meth:`request` was called)."""
        return self._requested

    @property
    def requested_by(self) -> signal.Signals | None:
        """The signal that asked for the drain; None before, or when :meth:`request` did."""
        return self._signal

    def request(self) -> None:
        """Ask for the drain without a signal (from any thread): same effect as the signal."""
        self._requested = True
        for loop, future in list(self._waiters):
            # Thread- and signal-safe: wakes the loop even when it sleeps in select(). A closed
            # loop raises RuntimeError: nobody is waiting there any more.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_resolve, future)

    async def wait(self) -> None:
        """Return once a drain is requested (at once if it already was)."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # not asyncio (anyio on trio): look at the flag now and then
            while not self._requested:
                await anyio.sleep(_POLL_S)
            return
        future: asyncio.Future[None] = loop.create_future()
        waiter = (loop, future)
        self._waiters.append(waiter)
        try:
            # Looked at after registering, so a signal between the two cannot be missed.
            if not self._requested:
                await future
        finally:
            self._waiters.remove(waiter)

    def close(self) -> None:
        """Put back the handlers that were installed before this drain (idempotent)."""
        for sig, previous in self._previous.items():
            # None: the previous handler was not installed from Python; the default is closest.
            signal.signal(sig, signal.SIG_DFL if previous is None else previous)
        self._previous.clear()

    def __enter__(self) -> Drain:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        names = ",".join(s.name for s in self.signals)
        return f"Drain(signals=({names}), requested={self._requested})"

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self._signal is None and not self._requested:
            self._signal = signal.Signals(signum)
        self.request()
