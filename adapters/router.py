"""An engine pool's OpenAI-compatible router: a small ASGI proxy on httpx.

Clients send ``POST /v1/completions``, ``POST /v1/chat/completions`` and ``GET /v1/models`` to
the router; it sends each request to the *routable* engine with the fewest requests in flight
(ties go to the engine listed first), and passes the answer back as it arrives (streaming
Server-Sent Events are relayed chunk by chunk, never buffered).

Which engines exist and which are routable comes from a provider, a function called for every
request (``deo run`` reads the runner's state: an engine is routable only while ACTIVE, never
while starting, draining, asleep or waking), so the router holds no copy of the pool to go stale.

A request that fails *before its first byte* — connection refused or reset, a timeout while
connecting, or a 5xx status — is sent to another routable engine not yet tried (at most
``max_attempts`` engines). After the first byte has gone to the client nothing is retried: an
engine that dies mid-answer ends the client's connection with an error (an incomplete body), so
no request is ever answered twice. 4xx answers are the client's and are passed through.

The router counts the requests each engine has in flight (sent and not fully answered);
:meth:`EngineRouter.in_flight` is what deo reads, so that a draining engine's drain ends when its
count reaches 0. ``GET /router/engines`` shows them, ``GET /metrics`` exports them, and ``GET
/health`` is 200 while some engine is routable. With no routable engine a request waits up to
``no_engine_wait_s`` for one (an engine waking up) before it is answered 503.
"""

from __future__ import annotations

import socket
import time
from collections.abc import AsyncIterator, Callable, Iterator

import anyio
import httpx
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from adapters.api.serving import serve
from adapters.engine_endpoints import EngineEndpoint, EngineProvider

__all__ = ["MAX_BODY_BYTES", "EngineEndpoint", "EngineProvider", "EngineRouter", "serve_router"]

#: The largest request body the router accepts (prompts can be long); a larger one is refused
#: before it is read in full, so this bounds the memory a request can take.
MAX_BODY_BYTES = 32 * 1024 * 1024
#: Request headers that describe one hop, not the request: never forwarded.
_HOP_HEADERS = frozenset(
    {
        "host",
        "content-length",
        "connection",
        "keep-alive",
        "transfer-encoding",
        "te",
        "upgrade",
        "proxy-authorization",
        "proxy-connection",
        "trailer",
    }
)
#: Failures that happen before an engine has answered anything: safe to retry elsewhere.
_BEFORE_FIRST_BYTE = (
    httpx.ConnectError,
    httpx.ConnectTimeout,
    httpx.RemoteProtocolError,
    httpx.ReadError,
    httpx.WriteError,
    httpx.PoolTimeout,
)


class EngineRouter:
    """Least-requests-in-flight routing over a provider's routable engines, with counts."""

    def __init__(
        self,
        pool: str,
        engines: EngineProvider,
        *,
        max_attempts: int = 3,
        connect_timeout_s: float = 5.0,
        read_timeout_s: float | None = 600.0,
        no_engine_wait_s: float = 30.0,
    ) -> None:
        if max_attempts < 1 or not connect_timeout_s > 0 or no_engine_wait_s < 0:
            raise ValueError(
                "max_attempts must be >= 1, connect_timeout_s > 0 and no_engine_wait_s >= 0"
            )
        self.pool = pool
        self.engines = engines
        self.max_attempts = max_attempts
        self.no_engine_wait_s = no_engine_wait_s
        self.timeout = httpx.Timeout(
            connect=connect_timeout_s, read=read_timeout_s, write=connect_timeout_s, pool=None
        )
        self._in_flight: dict[str, int] = {}
        #: Requests answered, by outcome: "ok" (any status from an engine), "failed" (no engine
        #: answered), "broken" (an engine failed after the first byte), "no_engine".
        self.outcomes: dict[str, int] = {}
        self.retries = 0
        #: Requests waiting for a routable engine (none is awake yet): load no engine reports.
        self.waiting_requests = 0
        self._client: httpx.AsyncClient | None = None

    # -- counts -------------------------------------------------------------------------------

    def in_flight(self) -> dict[str, int]:
        """Requests in flight per engine (worker id), engines with none left out."""
        return {worker: count for worker, count in self._in_flight.items() if count}

    def in_flight_of(self, worker_id: str) -> int:
        return self._in_flight.get(worker_id, 0)

    def _count(self, outcome: str) -> None:
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1

    def _begin(self, worker_id: str) -> None:
        self._in_flight[worker_id] = self._in_flight.get(worker_id, 0) + 1

    def _end(self, worker_id: str) -> None:
        left = self._in_flight.get(worker_id, 0) - 1
        if left > 0:
            self._in_flight[worker_id] = left
        else:
            self._in_flight.pop(worker_id, None)

    # -- choice -------------------------------------------------------------------------------

    def choose(self, tried: set[str]) -> EngineEndpoint | None:
        """The routable engine not in ``tried`` with the fewest requests in flight."""
        best: EngineEndpoint | None = None
        for engine in self.engines():
            if not engine.routable or engine.worker_id in tried:
                continue
            if best is None or self.in_flight_of(engine.worker_id) < self.in_flight_of(
                best.worker_id
            ):
                best = engine
        return best

    async def _choose_waiting(self, tried: set[str]) -> EngineEndpoint | None:
        """:meth:`choose`; on a first try with nothing routable, waits up to
        ``no_engine_wait_s`` for an engine (one may be waking)."""
        engine = self.choose(tried)
        if engine is not None or tried:
            return engine
        deadline = time.monotonic() + self.no_engine_wait_s
        self.waiting_requests += 1
        try:
            while engine is None and time.monotonic() < deadline:
                await anyio.sleep(0.05)
                engine = self.choose(tried)
        finally:
            self.waiting_requests -= 1
        return engine

    # -- proxying -----------------------------------------------------------------------------

    @property
    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
            self._client = httpx.AsyncClient(timeout=self.timeout, limits=limits)
        return self._client

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def forward(self, request: Request) -> Response:
        """Send ``request`` to an engine (retrying before the first byte) and relay the answer."""
        body = await _read_body(request)
        if body is None:
            return _error(413, f"request body over {MAX_BODY_BYTES} bytes")
        headers = [
            (name, value)
            for name, value in request.headers.items()
            if name.lower() not in _HOP_HEADERS
        ]
        tried: set[str] = set()
        last_error = "no engine answered"
        last_failed: tuple[httpx.Response, EngineEndpoint] | None = None
        while len(tried) < self.max_attempts:
            engine = await self._choose_waiting(tried)
            if engine is None:
                break
            if tried:
                self.retries += 1
            tried.add(engine.worker_id)
            url = engine.base_url.rstrip("/") + request.url.path
            upstream = self.client.build_request(
                request.method, url, params=request.query_params, headers=headers, content=body
            )
            self._begin(engine.worker_id)
            try:
                response = await self.client.send(upstream, stream=True)
            except _BEFORE_FIRST_BYTE as exc:
                self._end(engine.worker_id)
                last_error = f"{engine.worker_id} ({engine.base_url}): {type(exc).__name__}"
                continue
            except httpx.HTTPError as exc:
                # A timeout waiting for the answer: the engine may be working on it, so sending
                # it elsewhere could run it twice. The client decides.
                self._end(engine.worker_id)
                self._count("failed")
                status = 504 if isinstance(exc, httpx.TimeoutException) else 502
                return _error(status, f"{engine.worker_id} ({engine.base_url}): {exc!r}")
            except BaseException:
                # Cancelled (the client left): nothing of this request stays counted.
                self._end(engine.worker_id)
                if last_failed is not None:
                    with anyio.CancelScope(shield=True):
                        await last_failed[0].aclose()
                    self._end(last_failed[1].worker_id)
                raise
            if response.status_code >= 500:
                # An error status before any body: another engine may serve it. Keep the last
                # one to pass on if none does.
                if last_failed is not None:
                    await last_failed[0].aclose()
                    self._end(last_failed[1].worker_id)
                last_failed = (response, engine)
                continue
            if last_failed is not None:
                await last_failed[0].aclose()
                self._end(last_failed[1].worker_id)
            return self._relay(response, engine)
        if last_failed is not None:
            return self._relay(*last_failed)
        if not tried:
            self._count("no_engine")
            return _error(503, f"no engine of pool {self.pool!r} is routable")
        self._count("failed")
        return _error(502, f"no engine of pool {self.pool!r} answered: {last_error}")

    def _relay(self, response: httpx.Response, engine: EngineEndpoint) -> Response:
        worker_id = engine.worker_id
        ended = False

        def end() -> None:
            nonlocal ended
            if not ended:
                ended = True
                self._end(worker_id)

        async def body() -> AsyncIterator[bytes]:
            try:
                async for chunk in response.aiter_raw():
                    yield chunk
            except httpx.HTTPError:
                # Past the first byte nothing is retried: the client's answer ends in error.
                self._count("broken")
                raise
            else:
                self._count("ok")
            finally:
                await response.aclose()
                end()

        # The body is relayed as the engine sent it (raw: still encoded, if it was), so its
        # length and encoding headers stay true.
        headers = {
            name: value
            for name, value in response.headers.items()
            if name.lower() not in _HOP_HEADERS or name.lower() == "content-length"
        }
        headers["x-deo-engine"] = worker_id
        return StreamingResponse(
            body(),
            status_code=response.status_code,
            headers=headers,
            # Runs if the client left before the body began (the generator never ran).
            background=BackgroundTask(_close_then, response, end),
        )

    # -- metrics ------------------------------------------------------------------------------

    def collect(self) -> Iterator[Metric]:
        """The router's counts (Prometheus collector protocol)."""
        in_flight = GaugeMetricFamily(
            "deo_router_in_flight_requests",
            "Requests the router has in flight per engine",
            labels=["pool", "worker"],
        )
        for engine in self.engines():
            in_flight.add_metric([self.pool, engine.worker_id], self.in_flight_of(engine.worker_id))
        outcomes = CounterMetricFamily(
            "deo_router_requests",
            "Requests the router answered, by outcome",
            labels=["pool", "outcome"],
        )
        for outcome, count in sorted(self.outcomes.items()):
            outcomes.add_metric([self.pool, outcome], count)
        retries = CounterMetricFamily(
            "deo_router_retries", "Requests sent to another engine after a failure", labels=["pool"]
        )
        retries.add_metric([self.pool], self.retries)
        waiting = GaugeMetricFamily(
            "deo_router_waiting_requests",
            "Requests waiting for a routable engine",
            labels=["pool"],
        )
        waiting.add_metric([self.pool], self.waiting_requests)
        yield from (in_flight, outcomes, retries, waiting)

    # -- the app ------------------------------------------------------------------------------

    def app(self) -> Starlette:
        """The router's ASGI app."""
        registry = CollectorRegistry(auto_describe=False)
        registry.register(self)

        async def proxy(request: Request) -> Response:
            return await self.forward(request)

        async def health(request: Request) -> Response:
            if any(engine.routable for engine in self.engines()):
                return Response(status_code=200)
            return _error(503, f"no engine of pool {self.pool!r} is routable")

        async def engines(request: Request) -> Response:
            listed = [
                {
                    "worker_id": engine.worker_id,
                    "base_url": engine.base_url,
                    "routable": engine.routable,
                    "in_flight_requests": self.in_flight_of(engine.worker_id),
                }
                for engine in self.engines()
            ]
            return JSONResponse({"pool": self.pool, "engines": listed})

        async def metrics(request: Request) -> Response:
            return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

        return Starlette(
            routes=[
                Route("/v1/completions", proxy, methods=["POST"]),
                Route("/v1/chat/completions", proxy, methods=["POST"]),
                Route("/v1/models", proxy, methods=["GET"]),
                Route("/health", health, methods=["GET"]),
                Route("/router/engines", engines, methods=["GET"]),
                Route("/metrics", metrics, methods=["GET"]),
            ]
        )


async def _read_body(request: Request) -> bytes | None:
    """The request's body, or None once it is known to exceed :data:`MAX_BODY_BYTES`: refused
    on its Content-Length before anything is read, or as soon as the bytes read pass it."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        return None
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


async def _close_then(response: httpx.Response, then: Callable[[], None]) -> None:
    await response.aclose()
    then()


def _error(status: int, message: str) -> JSONResponse:
    # OpenAI's error shape, which clients of both engines parse.
    return JSONResponse(
        {"error": {"message": message, "type": "router_error", "code": status}}, status_code=status
    )


async def serve_router(
    router: EngineRouter,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    started: Callable[[int], None] | None = None,
    sock: socket.socket | None = None,
    max_connections: int = 4096,
) -> None:
    """Serve ``router`` on ``host:port`` (loopback by default) until cancelled.

    ``started(port)`` is called with the bound port (``port=0`` picks a free one); ``sock``, a
    socket bound beforehand, replaces ``host`` and ``port``. Rollouts keep
    many requests open at once, so the connection cap is far above the API's.
    """
    try:
        await serve(
            router.app(),
            host=host,
            port=port,
            started=started,
            sock=sock,
            max_connections=max_connections,
        )
    finally:
        with anyio.CancelScope(shield=True):
            await router.aclose()
