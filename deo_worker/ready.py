"""Readiness: tell deo this worker is ready to produce.

A pool with ``require_ready = true`` counts a started worker as ready only once it says so;
one that stays silent past the pool's ``start_timeout_s`` is replaced. A worker says so with
``POST $DEO_API_URL/v1/workers/$DEO_WORKER_ID/ready`` and ``Authorization: Bearer
$DEO_WORKER_TOKEN`` (its own token; deo puts all three in its environment). :func:`report_ready`
and :func:`report_ready_async` do that, retrying while deo cannot take it yet (not reachable,
busy, the worker's start not yet handled). Outside deo (the variables unset) they do nothing, so
the same worker runs by hand too. For a pool that does not require readiness a report is
harmless: deo takes it as a sign of life.

Neither raises: a report deo refuses for good (a wrong token, an unknown worker) or that runs out
of time is logged once and answered False.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Mapping

import anyio
import httpx

from deo_worker.heartbeat import API_URL_ENV, WORKER_ID_ENV, WORKER_TOKEN_ENV

__all__ = ["DEFAULT_READY_TIMEOUT_S", "ready_request", "report_ready", "report_ready_async"]

log = logging.getLogger("deo_worker.ready")

#: How long a report keeps trying; below deo's default ``start_timeout_s`` (60 s).
DEFAULT_READY_TIMEOUT_S = 30.0
_RETRY_S = 0.5
_REQUEST_TIMEOUT_S = 5.0
#: Answers worth asking again after: deo busy or stopping, or the worker's start not handled yet.
_RETRY_STATUSES = frozenset({429, 502, 503, 504})


def ready_request(environ: Mapping[str, str] | None = None) -> tuple[str, dict[str, str]] | None:
    """The URL and headers of this worker's readiness report, from ``environ`` (default: this
    process's environment); None when not run by deo."""
    env = os.environ if environ is None else environ
    url, worker_id, token = (
        env.get(API_URL_ENV),
        env.get(WORKER_ID_ENV),
        env.get(WORKER_TOKEN_ENV),
    )
    if not (url and worker_id and token):
        return None
    return f"{url.rstrip('/')}/v1/workers/{worker_id}/ready", {"Authorization": f"Bearer {token}"}


def _settled(url: str, response: httpx.Response) -> bool | None:
    """True if deo took the report, False if it refused it for good, None to try again."""
    if response.is_success:
        return True
    if response.status_code in _RETRY_STATUSES:
        return None
    log.warning("ready: POST %s: %d %s", url, response.status_code, response.text[:200])
    return False


def report_ready(
    environ: Mapping[str, str] | None = None, *, timeout_s: float = DEFAULT_READY_TIMEOUT_S
) -> bool:
    """Tell deo this worker is ready; True once deo took it (or when not run by deo).

    Blocks for at most about ``timeout_s``; from async code use :func:`report_ready_async`.
    """
    request = ready_request(environ)
    if request is None:
        return True
    url, headers = request
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            settled = _settled(url, httpx.post(url, headers=headers, timeout=_REQUEST_TIMEOUT_S))
        except httpx.HTTPError:
            settled = None
        if settled is not None:
            return settled
        if time.monotonic() + _RETRY_S > deadline:
            log.warning("ready: POST %s: deo did not take it within %gs", url, timeout_s)
            return False
        time.sleep(_RETRY_S)


async def report_ready_async(
    environ: Mapping[str, str] | None = None,
    *,
    timeout_s: float = DEFAULT_READY_TIMEOUT_S,
    client: httpx.AsyncClient | None = None,
) -> bool:
    """:func:`report_ready` without blocking the event loop (asyncio or anyio); ``client``,
    when given, is used instead of a new one."""
    request = ready_request(environ)
    if request is None:
        return True
    url, headers = request
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient() if client is None else contextlib.nullcontext(client) as http:
        while True:
            try:
                response = await http.post(url, headers=headers, timeout=_REQUEST_TIMEOUT_S)
                settled = _settled(url, response)
            except httpx.HTTPError:
                settled = None
            if settled is not None:
                return settled
            if time.monotonic() + _RETRY_S > deadline:
                log.warning("ready: POST %s: deo did not take it within %gs", url, timeout_s)
                return False
            await anyio.sleep(_RETRY_S)
