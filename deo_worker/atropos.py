"""Drain an atroposlib ``BaseEnv`` on deo's signal, without changing atroposlib.

``BaseEnv.env_manager()`` is atroposlib's rollout loop: every 0.1 s it reads ``GET /status-env``,
re-reads ``config.max_num_workers`` (``BaseEnv.get_status``) and, while ``len(workers)`` is below
it, starts rollout tasks (``add_train_workers``) that post their groups to ``/scored_data`` when
they finish. :func:`serve_until_drained` runs that loop as a task and, when the drain signal
comes, sets the worker limit to 0 — the loop then starts nothing new — waits until the rollouts in
flight have posted, stops the loop, tells the trajectory API the env is gone
(``POST /disconnect-env``) and returns, so the process exits 0 before deo's drain deadline.

What it relies on, as atroposlib 0.4.0 has it (``atroposlib/envs/base.py``), duck-typed so that
atroposlib need not be importable here:

- ``env.env_manager()`` — the coroutine ``serve`` runs (or ``rollout_manager``, see below);
- ``env.config.max_num_workers`` — writable; ``get_status`` copies it to ``env.max_num_workers``
  on every loop, and the loop starts workers only while ``len(env.workers) < max_num_workers``;
- ``env.max_num_workers`` — set to 0 too, so the limit holds before the next ``get_status``;
- ``env.workers`` — the set of in-flight rollout tasks (``asyncio.Task``). BaseEnv replaces the
  set rather than clearing it, so it is re-read on every look; finished tasks leave it;
- ``env.env_id`` — set by ``register_env`` (absent before: nothing to disconnect);
- ``env.config.rollout_server_url`` — the trajectory API.

While the drain waits, BaseEnv's own rules still apply: if the queue reaches
``max_batches_offpolicy`` batches, or a rollout outlives ``worker_timeout``, BaseEnv cancels it
(the queue needs no more data). An evaluation in progress is not waited for.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar, cast

import httpx

from deo_worker.drain import Drain
from deo_worker.heartbeat import Heartbeat
from deo_worker.ready import report_ready_async

__all__ = ["DEFAULT_DRAIN_TIMEOUT_S", "disconnect_env", "drainable", "serve_until_drained"]

log = logging.getLogger("deo_worker.atropos")

#: Below the 60 s a drain gets from deo until it has measured the pool's drains (``drain_timeout_s
#: = "auto"``, the default), so the env gives up on stragglers and exits 0 before deo escalates to
#: SIGTERM. deo measures the drains this makes: raise it where groups take longer.
DEFAULT_DRAIN_TIMEOUT_S = 50.0

#: How long cancelled stragglers get to unwind, and how long ``/disconnect-env`` may take.
_UNWIND_S = 2.0
_DISCONNECT_TIMEOUT_S = 5.0
#: How often the env is looked at for its registration (an ``env_id``).
_REGISTRATION_POLL_S = 0.1

_Env = TypeVar("_Env")


def _in_flight(env: Any) -> set[asyncio.Future[Any]]:
    return {task for task in env.workers if not task.done()}


async def _finish_in_flight(env: Any, drain_timeout_s: float) -> int:
    """Wait for ``env.workers`` to empty; at the deadline cancel what is left and count it."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + drain_timeout_s
    while pending := _in_flight(env):
        remaining_s = deadline - loop.time()
        if remaining_s <= 0:
            for task in pending:
                task.cancel()
            await asyncio.wait(pending, timeout=_UNWIND_S)
            log.warning(
                "drain: %d rollouts still running after %gs, cancelled",
                len(pending),
                drain_timeout_s,
            )
            return len(pending)
        # FIRST_COMPLETED, then look again: a worker loop that was mid-way may still add one.
        await asyncio.wait(pending, timeout=remaining_s, return_when=asyncio.FIRST_COMPLETED)
    return 0


async def disconnect_env(rollout_server_url: str, env_id: int, *, attempts: int = 1) -> bool:
    """``POST {rollout_server_url}/disconnect-env`` for ``env_id``; True when the API took it.

    Best effort: a failure is logged, not raised (the env is leaving either way). ``attempts``
    retries a request that failed outright (a server that just failed may have closed the
    connection).
    """
    url = f"{rollout_server_url.rstrip('/')}/disconnect-env"
    for attempt in range(1, attempts + 1):
        try:
            async with httpx.AsyncClient(timeout=_DISCONNECT_TIMEOUT_S) as client:
                response = await client.post(url, json={"env_id": env_id})
            response.raise_for_status()
            answer = response.json()
            break
        except (httpx.HTTPError, ValueError) as exc:
            if attempt == attempts:
                what = f"{type(exc).__name__}: {exc}"
                log.warning("POST %s for env %s failed: %s", url, env_id, what)
                return False
    if not isinstance(answer, dict) or answer.get("status") != "success":
        log.warning("POST %s for env %s answered %r", url, env_id, answer)
        return False
    return True


async def _stop(task: asyncio.Future[Any]) -> None:
    task.cancel()
    await asyncio.wait({task}, timeout=_UNWIND_S)


async def serve_until_drained(
    env: Any,
    *,
    drain: Drain | None = None,
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S,
    heartbeat: Heartbeat | None = None,
    heartbeat_interval_s: float = 1.0,
    rollout_manager: Callable[[], Awaitable[Any]] | None = None,
    ready_on_registration: bool = True,
) -> int:
    """Run ``env``'s rollout loop until deo drains it (or the loop ends); then disconnect.

    ``env`` is an atroposlib ``BaseEnv`` (0.4.0; see the module docstring for the attributes
    used). ``drain``: the drain to wait for; by default one is installed for SIGUSR1 for the
    duration of the call. ``drain_timeout_s``: how long in-flight rollouts may take to finish
    once the drain began; what is still running then is cancelled (keep it below the pool's
    ``drain_timeout_s``). ``heartbeat``: sent every ``heartbeat_interval_s`` while serving; by
    default :meth:`Heartbeat.from_environ`. ``rollout_manager``: the coroutine function to run
    instead of ``env.env_manager`` (:func:`drainable` passes BaseEnv's own).
    ``ready_on_registration``: once the env has registered with the trajectory API (it has an
    ``env_id``), tell deo the worker is ready (:func:`deo_worker.ready.report_ready_async`), for
    pools with ``require_ready = true``.

    Returns how many in-flight rollouts were cancelled at the drain deadline (0 when all
    finished, or when the loop ended by itself). An exception from the rollout loop before the
    drain propagates (after a best-effort disconnect); the caller exits 0 when this returns.
    Must run under asyncio, as BaseEnv does.
    """
    if not drain_timeout_s > 0:
        raise ValueError(
            f"serve_until_drained: drain_timeout_s must be > 0, got {drain_timeout_s!r}"
        )
    own_drain = drain is None
    active_drain = Drain() if drain is None else drain
    if active_drain.requested:  # drained while it started up: nothing was registered yet
        log.info("drain requested before serving: not starting")
        if own_drain:
            active_drain.close()
        return 0
    run_manager = rollout_manager if rollout_manager is not None else env.env_manager
    manager = asyncio.ensure_future(run_manager())
    beating = asyncio.ensure_future(
        (heartbeat or Heartbeat.from_environ()).run(heartbeat_interval_s)
    )
    drained = asyncio.ensure_future(active_drain.wait())
    announcing = asyncio.ensure_future(
        _ready_once_registered(env) if ready_on_registration else asyncio.sleep(0)
    )
    try:
        await asyncio.wait({manager, drained}, return_when=asyncio.FIRST_COMPLETED)
        if not drained.done():  # the loop ended by itself (total_steps reached) or failed
            await _disconnect(env)
            manager.result()  # a failure is a crash: raise it
            return 0
        log.info("drain requested: no new rollouts, %d in flight", len(_in_flight(env)))
        env.config.max_num_workers = 0
        env.max_num_workers = 0
        abandoned = await _finish_in_flight(env, drain_timeout_s)
        if manager.done() and not manager.cancelled() and manager.exception() is not None:
            log.warning("rollout loop failed while draining: %r", manager.exception())
        await _stop(manager)
        await _disconnect(env)
        log.info("drained: %d rollouts cancelled at the deadline", abandoned)
        return abandoned
    finally:
        for task in (manager, beating, drained, announcing):
            task.cancel()
        await asyncio.wait({manager, beating, drained, announcing}, timeout=_UNWIND_S)
        if own_drain:
            active_drain.close()


async def _ready_once_registered(env: Any) -> None:
    """Report ready to deo once ``env`` has an ``env_id``: the trajectory API knows it then."""
    while getattr(env, "env_id", None) is None:
        await asyncio.sleep(_REGISTRATION_POLL_S)
    if await report_ready_async():
        log.info("registered as env %s: reported ready", env.env_id)


async def _disconnect(env: Any) -> None:
    env_id = getattr(env, "env_id", None)
    if env_id is None:  # drained before it registered: the API does not know it
        return
    await disconnect_env(env.config.rollout_server_url, env_id)


def drainable(
    env_cls: type[_Env], *, drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S
) -> type[_Env]:
    """A subclass of the BaseEnv class ``env_cls`` whose ``serve`` drains on deo's signal.

    ``drainable(MyEnv).cli()`` keeps atroposlib's whole command line (``serve --env.* --openai.*``)
    and runs the env through :func:`serve_until_drained`. The SIGUSR1 handler is installed by
    this call, before the env is built, so a drain while it loads tokenizers is not lost.
    """
    drain = Drain()
    original: Callable[[Any], Awaitable[Any]] = env_cls.env_manager  # type: ignore[attr-defined]

    async def env_manager(self: Any) -> None:
        await serve_until_drained(
            self,
            drain=drain,
            drain_timeout_s=drain_timeout_s,
            rollout_manager=lambda: original(self),
        )

    namespace = {
        "env_manager": env_manager,
        "__module__": env_cls.__module__,
        "__doc__": env_cls.__doc__,
        "__qualname__": env_cls.__qualname__,
    }
    return cast(type[_Env], type(env_cls.__name__, (env_cls,), namespace))
