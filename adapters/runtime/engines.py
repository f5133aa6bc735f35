"""Engine control: deo's sleep, wake and readiness calls to each engine's own HTTP API.

The core decides (``SleepEngine``, ``WakeEngine``, ``VerifyAsleep``); :class:`EngineControl`
carries each command out in a task of its own, every call with the command's timeout, and
reports the outcome as an event (``EngineAsleep``, ``EngineAwake``, ``EngineSleepFailed``,
``EngineWakeFailed``): a call never leaves an engine in a state nobody recorded. It also watches
starting engines' ``/health`` and reports each ready (``WorkerReady``) once it answers 200 from
a socket the engine's own process holds (checked where the engine runs,
:mod:`adapters.runtime.engine_hosts`: a server of another program on the engine's port is never
taken for the engine), and
asks active engines' ``/health`` every ``ACTIVE_HEALTH_INTERVAL_S``: each 200 is a sign of life
(a heartbeat), so that a pool's ``heartbeat_grace_s`` replaces an engine that is alive but
answers nothing (wedged), and never a healthy one (starting engines count as seen: their
``start_timeout_s`` judges them). Each engine is reached at the address its executor gives
(:class:`~adapters.runtime.engine_hosts.EngineHosts`: 127.0.0.1 on deo's machine, the node's
address over Ray) and its port.

The routes, per engine (see docs/engines.md):

- vLLM (launched with ``VLLM_SERVER_DEV_MODE=1``, which deo sets, and ``--enable-sleep-mode``):
  sleep is ``POST /reset_prefix_cache`` then ``POST /sleep?level=N``, wake ``POST /wake_up``;
  both are confirmed by ``GET /is_sleeping``, which is also how an engine adopted after a restart
  is asked whether it sleeps. A call that fails (an error, or no answer within its timeout) is
  checked the same way before it is reported failed: an engine that slept (or woke) though its
  answer was lost is reported asleep (awake), so the core never retries or replaces an engine
  over a late answer, nor sends a second call (after a restart) that finds the work done.
- SGLang (launched with ``--enable-memory-saver``): sleep is ``POST /flush_cache`` then ``POST
  /release_memory_occupation``; wake is ``POST /resume_memory_occupation``. ``/flush_cache``
  refuses while requests run (a drain that timed out): generation is then paused, aborting them,
  and ``POST /continue_generation`` after the wake lets it run again. SGLang has no route that
  says whether it sleeps: deo's log is the record.

:class:`FanOut` hands every command to several executors (the processes and this).
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Sequence
from typing import Any

import anyio
import httpx
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from adapters.runtime.engine_hosts import (
    LOCAL_ENGINE_HOST,
    EngineHosts,
    LocalEngineHosts,
    base_url,
)
from adapters.runtime.runner import Executor
from core import Command, DeoError, Event, State, UnknownSubject, WorkerReady, WorkerState
from core.commands import SleepEngine, VerifyAsleep, WakeEngine
from core.events import EngineAsleep, EngineAwake, EngineSleepFailed, EngineWakeFailed

__all__ = ["EngineCallFailed", "EngineControl", "FanOut", "engine_url"]

log = logging.getLogger("deo.engines")

#: How often starting engines' /health is asked.
HEALTH_INTERVAL_S = 0.5
#: Each /health call gives up after this long (a starting engine may not listen yet).
HEALTH_TIMEOUT_S = 2.0

#: How often active engines' /health is asked (each 200 is a sign of life).
ACTIVE_HEALTH_INTERVAL_S = 1.0

#: How often a paused SGLang engine's cache flush is tried again while its aborts land.
FLUSH_RETRY_S = 0.1

_Control = SleepEngine | WakeEngine | VerifyAsleep


def engine_url(port: int, host: str = LOCAL_ENGINE_HOST) -> str:
    """An engine's base URL: on ``host`` (by default loopback, beside deo) at ``port``."""
    return base_url(host, port)


class EngineCallFailed(DeoError):
    """A control call answered with an error, or not as the engine should have."""


class FanOut:
    """An executor that hands each command to every executor it holds, in order."""

    def __init__(self, *executors: Executor) -> None:
        self.executors = executors

    async def execute(self, command: Command) -> None:
        for executor in self.executors:
            await executor.execute(command)


async def _call(
    client: httpx.AsyncClient, method: str, url: str, *, json: Any = None, params: Any = None
) -> httpx.Response:
    response = await client.request(method, url, json=json, params=params)
    if response.status_code != 200:
        raise EngineCallFailed(
            f"{method} {url.split('/', 3)[-1]}: HTTP {response.status_code} "
            f"{response.text[:200].strip()}"
        )
    return response


async def _is_sleeping(client: httpx.AsyncClient, base: str) -> bool:
    answer = (await _call(client, "GET", f"{base}/is_sleeping")).json()
    if not isinstance(answer, dict) or not isinstance(answer.get("is_sleeping"), bool):
        raise EngineCallFailed(f"GET /is_sleeping: unexpected answer {answer!r}")
    return bool(answer["is_sleeping"])


async def sleep_engine(
    client: httpx.AsyncClient, command: SleepEngine, host: str = LOCAL_ENGINE_HOST
) -> None:
    """Release the memory of one engine on ``host``; :class:`EngineCallFailed` or an httpx
    error if it did not."""
    base = engine_url(command.port, host)
    if command.engine == "vllm":
        await _call(client, "POST", f"{base}/reset_prefix_cache")
        await _call(client, "POST", f"{base}/sleep", params={"level": command.level})
        if not await _is_sleeping(client, base):
            raise EngineCallFailed("POST /sleep answered 200 but /is_sleeping says awake")
        return
    flushed = await client.post(f"{base}/flush_cache")
    if flushed.status_code == 400:
        # Requests still run (the drain timed out): abort them, as the engine cannot release
        # memory under running requests, and flush once the aborts have landed.
        await _call(client, "POST", f"{base}/pause_generation", json={"mode": "abort"})
        with anyio.move_on_after(command.timeout_s):
            while (flushed := await client.post(f"{base}/flush_cache")).status_code == 400:
                await anyio.sleep(FLUSH_RETRY_S)
    if flushed.status_code != 200:
        raise EngineCallFailed(
            f"POST flush_cache: HTTP {flushed.status_code} {flushed.text[:200].strip()}"
        )
    await _call(client, "POST", f"{base}/release_memory_occupation", json={})


async def wake_engine(
    client: httpx.AsyncClient, command: WakeEngine, host: str = LOCAL_ENGINE_HOST
) -> None:
    """Take back the memory of one engine on ``host``; :class:`EngineCallFailed` or an httpx
    error if it did not."""
    base = engine_url(command.port, host)
    if command.engine == "vllm":
        await _call(client, "POST", f"{base}/wake_up")
        if await _is_sleeping(client, base):
            raise EngineCallFailed("POST /wake_up answered 200 but /is_sleeping says asleep")
        return
    await _call(client, "POST", f"{base}/resume_memory_occupation", json={})
    # Harmless when generation was never paused; needed when a sleep had to pause it.
    await _call(client, "POST", f"{base}/continue_generation", json={})


async def _confirm(
    client: httpx.AsyncClient, command: SleepEngine | WakeEngine, host: str, why: str
) -> tuple[bool, str]:
    """After a failed sleep or wake call, ask the engine (vLLM: ``/is_sleeping``) whether the
    call's work was done anyway: True if it was, else False and the failure's description with
    what the engine said added."""
    wanted = isinstance(command, SleepEngine)
    try:
        asleep = await _is_sleeping(client, engine_url(command.port, host))
    except (httpx.HTTPError, EngineCallFailed, ValueError) as exc:
        return False, f"{why}; /is_sleeping: {_describe(exc)}"
    if asleep is wanted:
        log.info("%s: %s, but /is_sleeping says the call's work is done", command.worker_id, why)
        return True, why
    return False, f"{why}; /is_sleeping says {'awake' if wanted else 'asleep'}"


def _describe(exc: BaseException) -> str:
    if isinstance(exc, EngineCallFailed):
        return str(exc)
    if isinstance(exc, httpx.TimeoutException | TimeoutError):
        return f"no answer in time ({type(exc).__name__})"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


class EngineControl:
    """Carries out engine commands over HTTP and watches starting engines' health.

    ``state`` returns the runner's current state (which engines are starting, on which port);
    ``saw``, if given, takes each active engine's sign of life (the runner's ``saw``).
    ``hosts`` says where each engine runs (by default: all on deo's machine).
    :meth:`execute` never blocks the runner: commands queue for :meth:`run`, which carries each
    out in its own task until cancelled.
    """

    def __init__(
        self,
        emit: Callable[[Event], None],
        *,
        clock: Callable[[], float],
        state: Callable[[], State],
        health_interval_s: float = HEALTH_INTERVAL_S,
        saw: Callable[[str], None] | None = None,
        active_health_interval_s: float = ACTIVE_HEALTH_INTERVAL_S,
        hosts: EngineHosts | None = None,
    ) -> None:
        self._emit = emit
        self._hosts: EngineHosts = hosts if hosts is not None else LocalEngineHosts()
        self._saw = saw
        self._active_health_interval_s = active_health_interval_s
        self._clock = clock
        self._state = state
        self._health_interval_s = health_interval_s
        send, receive = anyio.create_memory_object_stream[_Control](math.inf)
        self._send: MemoryObjectSendStream[_Control] = send
        self._receive: MemoryObjectReceiveStream[_Control] = receive
        #: Starting engines already reported ready (reported once each).
        self._reported: set[str] = set()
        #: Starting engines whose port another process holds (logged once each).
        self._foreign: set[str] = set()

    async def execute(self, command: Command) -> None:
        """Queue an engine command; anything else is another executor's."""
        if isinstance(command, SleepEngine | WakeEngine | VerifyAsleep):
            self._send.send_nowait(command)

    async def run(self) -> None:
        """Carry out queued commands and watch starting engines, until cancelled."""
        async with httpx.AsyncClient() as client, anyio.create_task_group() as tg:
            tg.start_soon(self._watch_health, client)
            if self._saw is not None:
                tg.start_soon(self._watch_active, client, self._saw)
            async for command in self._receive:
                tg.start_soon(self._carry_out, command)

    async def _carry_out(self, command: _Control) -> None:
        t = self._clock
        worker_id = command.worker_id
        # Its own client: every call of this command gives up after the command's timeout, and
        # the calls together too (a sleep is several calls), and the check of a failed one after
        # half as long again, within the core's deadline (twice the timeout) for the answer.
        host = self._hosts.engine_host(worker_id)
        async with httpx.AsyncClient(timeout=httpx.Timeout(command.timeout_s)) as call:
            try:
                if host is None:
                    raise EngineCallFailed("the address of its node is not known (yet)")
                with anyio.fail_after(command.timeout_s):
                    await self._call(call, command, host)
            except (httpx.HTTPError, EngineCallFailed, ValueError, TimeoutError) as exc:
                why = (
                    f"no answer in time (its calls took over {command.timeout_s:g} s)"
                    if isinstance(exc, TimeoutError)
                    else _describe(exc)
                )
                log.warning("%s: %s failed: %s", worker_id, type(command).__name__, why)
                if (
                    isinstance(command, SleepEngine | WakeEngine)
                    and command.engine == "vllm"
                    and host is not None
                ):
                    failed, done = why, False
                    why = f"{failed}; /is_sleeping: no answer in time"
                    with anyio.move_on_after(command.timeout_s / 2):
                        done, why = await _confirm(call, command, host, failed)
                    if done:
                        event = EngineAsleep if isinstance(command, SleepEngine) else EngineAwake
                        self._emit(event(t=t(), worker_id=worker_id))
                        return
                if isinstance(command, SleepEngine):
                    self._emit(EngineSleepFailed(t=t(), worker_id=worker_id, error=why))
                elif isinstance(command, WakeEngine):
                    self._emit(EngineWakeFailed(t=t(), worker_id=worker_id, error=why))
                # A failed check changes nothing: the log's record stands, the next restart asks
                # again, and a wake finds out.

    async def _call(self, call: httpx.AsyncClient, command: _Control, host: str) -> None:
        """Carry out ``command`` on the engine at ``host`` and report its success (failures
        raise)."""
        t, worker_id = self._clock, command.worker_id
        if isinstance(command, SleepEngine):
            await sleep_engine(call, command, host)
            self._emit(EngineAsleep(t=t(), worker_id=worker_id))
        elif isinstance(command, WakeEngine):
            await wake_engine(call, command, host)
            self._emit(EngineAwake(t=t(), worker_id=worker_id))
        elif command.engine == "vllm":
            asleep = await _is_sleeping(call, engine_url(command.port, host))
            event = EngineAsleep if asleep else EngineAwake
            self._emit(event(t=t(), worker_id=worker_id))

    async def _watch_health(self, client: httpx.AsyncClient) -> None:
        while True:
            starting = self._starting_engines(self._state())
            self._reported &= {worker_id for worker_id, _ in starting}
            self._foreign &= {worker_id for worker_id, _ in starting}
            async with anyio.create_task_group() as tg:
                for worker_id, port in starting:
                    if worker_id not in self._reported:
                        tg.start_soon(self._check_health, client, worker_id, port)
            await anyio.sleep(self._health_interval_s)

    async def _watch_active(self, client: httpx.AsyncClient, saw: Callable[[str], None]) -> None:
        async def ask(worker_id: str, port: int) -> None:
            host = self._hosts.engine_host(worker_id)
            if host is None:
                return  # not adopted yet: no sign of life, and none of death either
            with contextlib.suppress(httpx.HTTPError):
                url = f"{engine_url(port, host)}/health"
                if (await client.get(url, timeout=HEALTH_TIMEOUT_S)).status_code == 200:
                    # Unknown only if it was never made; gone since is ignored by ``saw``.
                    with contextlib.suppress(UnknownSubject):
                        saw(worker_id)

        while True:
            state = self._state()
            # A starting engine may load for minutes before it answers: its start_timeout_s
            # judges it, not the heartbeat grace.
            for worker_id, _ in self._starting_engines(state):
                with contextlib.suppress(UnknownSubject):
                    saw(worker_id)
            async with anyio.create_task_group() as tg:
                for worker_id, port in self._engines(state, WorkerState.ACTIVE):
                    tg.start_soon(ask, worker_id, port)
            await anyio.sleep(self._active_health_interval_s)

    @staticmethod
    def _starting_engines(state: State) -> Sequence[tuple[str, int]]:
        return EngineControl._engines(state, WorkerState.STARTING)

    @staticmethod
    def _engines(state: State, wanted: WorkerState) -> Sequence[tuple[str, int]]:
        found = []
        for worker in state.workers.values():
            pool = state.pools.get(worker.pool)
            if (
                worker.state is wanted
                and worker.port is not None
                and pool is not None
                and pool.spec.is_engine
            ):
                found.append((worker.worker_id, worker.port))
        return found

    async def _check_health(self, client: httpx.AsyncClient, worker_id: str, port: int) -> None:
        host = self._hosts.engine_host(worker_id)
        if host is None:
            return  # not placed yet
        try:
            url = f"{engine_url(port, host)}/health"
            response = await client.get(url, timeout=HEALTH_TIMEOUT_S)
        except httpx.HTTPError:
            return  # not listening yet (vLLM listens once its engine is up)
        if response.status_code != 200:
            return
        worker = self._state().workers.get(worker_id)
        pid = None if worker is None else worker.pid
        owned: bool | None = None
        if pid is not None:
            try:
                owned = await self._hosts.engine_port_owned(worker_id, port, pid)
            except Exception as exc:  # its machine cannot be asked now: asked again next round
                log.info("%s: cannot tell whose port %d is now: %s", worker_id, port, exc)
                return
        if owned is False:
            # Something else answers on the engine's port (the engine could not bind it): never
            # ready, so nothing is routed there; the engine exits, or its start timeout ends it.
            if worker_id not in self._foreign:
                self._foreign.add(worker_id)
                log.warning(
                    "%s: port %d is held by another process, not by the engine (pid %d): not ready",
                    worker_id,
                    port,
                    pid,
                )
            return
        self._reported.add(worker_id)
        self._emit(WorkerReady(t=self._clock(), worker_id=worker_id))
