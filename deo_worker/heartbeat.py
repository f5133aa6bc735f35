"""Heartbeats: tell deo this worker is alive.

deo gives every worker two ways to show a sign of life (README, "Running deo next to your
trainer"): touch the file named by ``DEO_HEARTBEAT_FILE``, or
``POST $DEO_API_URL/v1/workers/$DEO_WORKER_ID/heartbeat`` with
``Authorization: Bearer $DEO_WORKER_TOKEN``. :meth:`Heartbeat.from_environ` picks the file when it
is set (no network needed), else the API when its three variables are set, else nothing: outside
deo a heartbeat is a no-op, so the same worker runs by hand too.

A failed heartbeat never raises: it is logged once when beats start failing and once when they
work again, and the worker goes on (deo decides what a silent worker means).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path

import anyio
import httpx

__all__ = [
    "API_URL_ENV",
    "HEARTBEAT_FILE_ENV",
    "WORKER_ID_ENV",
    "WORKER_TOKEN_ENV",
    "Heartbeat",
]

# The names deo uses (adapters/sources/heartbeat.py, adapters/run.py); repeated here so that a
# worker needs nothing of deo but this package.
HEARTBEAT_FILE_ENV = "DEO_HEARTBEAT_FILE"
API_URL_ENV = "DEO_API_URL"
WORKER_TOKEN_ENV = "DEO_WORKER_TOKEN"
WORKER_ID_ENV = "DEO_WORKER_ID"

log = logging.getLogger("deo_worker.heartbeat")


class Heartbeat:
    """Reports this worker alive to deo by a file, the API, both, or (with neither) not at all.

    ``file``: a path whose modification time deo watches. ``api_url``, ``worker_id`` and
    ``token`` together: deo's API, where each beat is one POST taking at most ``timeout_s``.
    """

    def __init__(
        self,
        *,
        file: str | Path | None = None,
        api_url: str | None = None,
        worker_id: str | None = None,
        token: str | None = None,
        timeout_s: float = 2.0,
    ) -> None:
        api = (api_url, worker_id, token)
        if any(api) and not all(api):
            missing = [
                n for n, v in zip(("api_url", "worker_id", "token"), api, strict=True) if not v
            ]
            raise ValueError(
                f"Heartbeat: api_url, worker_id and token go together; missing {missing}"
            )
        if not timeout_s > 0:
            raise ValueError(f"Heartbeat: timeout_s must be > 0, got {timeout_s!r}")
        self.file = Path(file) if file else None
        self.url = f"{api_url.rstrip('/')}/v1/workers/{worker_id}/heartbeat" if api_url else None
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.timeout_s = timeout_s
        self._failing = False

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> Heartbeat:
        """The heartbeat deo asked for in this process's environment (or in ``environ``).

        The file when ``DEO_HEARTBEAT_FILE`` is set; otherwise the API when ``DEO_API_URL``,
        ``DEO_WORKER_ID`` and ``DEO_WORKER_TOKEN`` all are; otherwise a no-op.
        """
        env = os.environ if environ is None else environ
        file = env.get(HEARTBEAT_FILE_ENV)
        if file:
            return cls(file=file)
        api = (env.get(API_URL_ENV), env.get(WORKER_ID_ENV), env.get(WORKER_TOKEN_ENV))
        if all(api):
            return cls(api_url=api[0], worker_id=api[1], token=api[2])
        return cls()

    @property
    def enabled(self) -> bool:
        """False when there is nowhere to report to (not run under deo): beats do nothing."""
        return self.file is not None or self.url is not None

    def beat(self) -> bool:
        """Report alive now; True when every configured channel took it (or none is configured).

        Blocks for at most ``timeout_s`` on the API; from async code use :meth:`beat_async`.
        """
        ok = self._touch()
        if self.url is not None:
            try:
                response = httpx.post(self.url, headers=self._headers, timeout=self.timeout_s)
            except httpx.HTTPError as exc:
                ok = self._failed(f"POST {self.url}: {type(exc).__name__}: {exc}")
            else:
                ok = self._answered(response) and ok
        if ok:
            self._recovered()
        return ok

    async def beat_async(self, client: httpx.AsyncClient | None = None) -> bool:
        """:meth:`beat` without blocking the event loop (asyncio or anyio); ``client``, when
        given, is used for the API call instead of a new one."""
        ok = self._touch()
        if self.url is not None:
            try:
                if client is None:
                    async with httpx.AsyncClient() as own:
                        response = await self._post(own)
                else:
                    response = await self._post(client)
            except httpx.HTTPError as exc:
                ok = self._failed(f"POST {self.url}: {type(exc).__name__}: {exc}")
            else:
                ok = self._answered(response) and ok
        if ok:
            self._recovered()
        return ok

    async def run(self, interval_s: float = 1.0) -> None:
        """Beat every ``interval_s`` until cancelled (returns at once when not enabled)."""
        if not interval_s > 0:
            raise ValueError(f"Heartbeat.run: interval_s must be > 0, got {interval_s!r}")
        if not self.enabled:
            return
        async with httpx.AsyncClient() as client:
            while True:
                await self.beat_async(client)
                await anyio.sleep(interval_s)

    def __repr__(self) -> str:
        return f"Heartbeat(file={self.file}, url={self.url})"

    async def _post(self, client: httpx.AsyncClient) -> httpx.Response:
        assert self.url is not None
        return await client.post(self.url, headers=self._headers, timeout=self.timeout_s)

    def _touch(self) -> bool:
        if self.file is None:
            return True
        try:
            self.file.touch()
        except OSError as exc:
            return self._failed(f"touch {self.file}: {exc}")
        return True

    def _answered(self, response: httpx.Response) -> bool:
        if response.is_success:
            return True
        return self._failed(f"POST {self.url}: {response.status_code} {response.text[:200]}")

    def _failed(self, what: str) -> bool:
        if not self._failing:
            self._failing = True
            log.warning("heartbeat failed: %s (will keep trying)", what)
        return False

    def _recovered(self) -> None:
        if self._failing:
            self._failing = False
            log.warning("heartbeat works again")
