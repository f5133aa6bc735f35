"""The runner: one loop that logs each event, reduces it and hands the commands to an executor.

Sources (ticks, pressure pollers, the HTTP API, the process executor's reports) send events into
one channel; the runner is the only writer of the log:

    event -> log (write-ahead) -> Reducer.step -> log the commands -> flush -> executor.execute

Operator actions arrive through :meth:`Runner.submit`, which waits for the reducer's answer so an
API caller learns whether its request was accepted: the commands, or the very error the core
refused the event with (its class says why, down to the HTTP status the API answers with).
Cancelling :meth:`Runner.run` stops the loop and leaves workers running: the control plane's
death must not kill work.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections import deque
from collections.abc import Callable
from typing import Protocol

import anyio
import attrs
import orjson
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from adapters.log import EventLog
from adapters.runtime.liveness import Liveness
from core import Command, DeoError, Event, InvalidEvent, Reducer, State, Tick

__all__ = ["Decision", "Executor", "Runner", "Stopping"]

log = logging.getLogger("deo.runner")

#: How many recent decisions the runner keeps for status pages.
RECENT_DECISIONS = 50


class Executor(Protocol):
    """Carries commands out; reports results as events through the channel it was given."""

    async def execute(self, command: Command) -> None: ...


@attrs.frozen(slots=True)
class Decision:
    """A command the runner produced, with the time of the event that caused it."""

    t: float
    command: Command


class Stopping(DeoError):
    """deo stopped before it handled a submitted event: nothing was logged for it."""

    http_status = 503


@attrs.define(slots=True)
class _Item:
    event: Event
    reply: MemoryObjectSendStream[list[Command] | DeoError] | None = None


class Runner:
    """The loop around the core. Build it, then ``await runner.run()`` in a task group."""

    def __init__(
        self,
        log_: EventLog,
        reducer: Reducer,
        executor: Executor,
        *,
        clock: Callable[[], float],
        tick_interval_s: float = 1.0,
        on_handled: Callable[[Event], None] | None = None,
    ) -> None:
        self.log = log_
        #: Called with each accepted event once it is durable, before its commands run.
        self.on_handled = on_handled
        self.reducer = reducer
        #: What readers see: the state as of the last batch the log holds durably.
        self._durable_state = reducer.state
        self.executor = executor
        self.clock = clock
        self.tick_interval_s = tick_interval_s
        self.decisions: deque[Decision] = deque(maxlen=RECENT_DECISIONS)
        send, receive = anyio.create_memory_object_stream[_Item](math.inf)
        self._send: MemoryObjectSendStream[_Item] = send
        self._receive: MemoryObjectReceiveStream[_Item] = receive
        self.events_handled = 0
        #: Set by :meth:`request_stop`; ``deo run`` watches it.
        self.stop_requested = anyio.Event()
        self.drain_on_stop = False
        #: Set by a stop without a drain asked for while a drain before stopping goes on: stop
        #: at once, as a second signal does (the workers keep draining; a restart adopts them).
        self.stop_now = anyio.Event()
        self.liveness = Liveness()

    def request_stop(self, *, drain: bool) -> None:
        """Ask ``deo run`` to stop, after draining every worker when ``drain`` is true (a stop
        without a drain during one ends the wait for it)."""
        if self.stop_requested.is_set() and self.drain_on_stop and not drain:
            self.stop_now.set()
        self.drain_on_stop = self.drain_on_stop or drain
        self.stop_requested.set()

    @property
    def state(self) -> State:
        """The state after the last event the log holds durably.

        Readers (the API, status pages) never see a state a restart could not recover: an
        alert shown before its record reached the disk would vanish after a kill -9.
        """
        return self._durable_state

    def emit(self, event: Event) -> None:
        """Queue an event from a source; never blocks (the channel is unbounded).

        Once the loop has stopped, an event from a source still winding down is dropped: it
        could no longer be logged, and the sources must not fail the shutdown.
        """
        with contextlib.suppress(anyio.ClosedResourceError):
            self._send.send_nowait(_Item(event))

    async def submit(self, event: Event) -> list[Command]:
        """Queue an event and wait for the commands it produced.

        Raises the :class:`DeoError` the core refused the event with (a "rejected" record in the
        log says the same), or :class:`Stopping` if deo stopped before handling it.
        """
        reply_send, reply_receive = anyio.create_memory_object_stream[list[Command] | DeoError](1)
        try:
            await self._send.send(_Item(event, reply_send))
        except anyio.ClosedResourceError:
            reply_send.close()
            reply_receive.close()
            raise Stopping("deo is stopping") from None
        async with reply_receive:
            try:
                answer = await reply_receive.receive()
            except anyio.EndOfStream:
                raise Stopping("deo is stopping") from None
        if isinstance(answer, DeoError):
            raise answer
        return answer

    async def run(self) -> None:
        """Handle events until cancelled; ticks every ``tick_interval_s``."""
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._ticks)
            try:
                await self._loop()
            finally:
                tg.cancel_scope.cancel()
                self._send.close()
                self._record_the_rest()
                self._receive.close()

    def _record_the_rest(self) -> None:
        """Log (not carry out) what was still queued at the stop, so no observation is lost: a
        worker exit seen just before stopping stays an exit, not a loss found at restart. Its
        commands are logged unexecuted, as after a crash; the restart reconciles them."""
        while True:
            try:
                item = self._receive.receive_nowait()
            except (anyio.WouldBlock, anyio.EndOfStream):
                self.log.flush()
                self._durable_state = self.reducer.state
                return
            if item.reply is not None:
                item.reply.close()  # the submitter is told deo is stopping
            else:
                self._step(item.event)

    def saw(self, worker_id: str) -> None:
        """Note a sign of life of a worker (a heartbeat); the next tick records it if the core
        needs it (:class:`~adapters.runtime.liveness.Liveness`).

        Raises :class:`~core.errors.UnknownSubject` for a worker deo never made; a worker that
        already exited is ignored."""
        self.liveness.saw(self.reducer.state, worker_id, self.clock())

    async def _ticks(self) -> None:
        while True:
            await anyio.sleep(self.tick_interval_s)
            t = self.clock()
            # The sightings first: the tick judges with them.
            for seen in self.liveness.records(self.reducer.state, t, self.tick_interval_s):
                self.emit(seen)
            self.emit(Tick(t=t, interval_s=self.tick_interval_s))

    async def _loop(self) -> None:
        async for item in self._receive:
            batch = [item]
            # Everything already waiting shares one flush (one fsync per batch of records).
            while True:
                try:
                    batch.append(self._receive.receive_nowait())
                except anyio.WouldBlock:
                    break
            outcomes = [self._step(queued.event) for queued in batch]
            # fsync and snapshots block: off the event loop, and finished even when cancelled,
            # because the commands are carried out only once they are durable (write-ahead).
            state = self.reducer.state
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(self._persist, state)
            self._durable_state = state
            for queued, outcome in zip(batch, outcomes, strict=True):
                if queued.reply is not None:
                    async with queued.reply:
                        # The caller may have gone (an HTTP client hung up): its answer is in
                        # the log either way, and the loop must not die of it.
                        with contextlib.suppress(anyio.BrokenResourceError):
                            await queued.reply.send(outcome)
                if isinstance(outcome, list):
                    if self.on_handled is not None:
                        self.on_handled(queued.event)
                    for command in outcome:
                        await self.executor.execute(command)

    def _persist(self, state: State) -> None:
        self.log.flush()
        self.log.maybe_snapshot(state)

    def _step(self, event: Event) -> list[Command] | DeoError:
        self.events_handled += 1
        try:
            commands = self.log.record(self.reducer, event)
        except DeoError as exc:
            log.warning("refused %s: %s", type(event).__name__, exc)
            return exc
        except orjson.JSONEncodeError as exc:
            # Nothing was written for it (records are encoded before they are buffered).
            log.error("cannot log %s: %s", type(event).__name__, exc)
            return InvalidEvent(f"{type(event).__name__} cannot be logged: {exc}")
        for command in commands:
            self.decisions.append(Decision(t=self.reducer.state.now, command=command))
            log.info("%s: %s", type(command).__name__, command.reason)
        return commands
