"""The engine router in front of real stand-in engines, with a real HTTP client."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager

import anyio
import httpx
import pytest
from engine_standins import Standin

from adapters.router import MAX_BODY_BYTES, EngineEndpoint, EngineRouter, serve_router
from bench.ports import reserve_port

DEADLINE_S = 60.0


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def engines() -> Iterator[list[Standin]]:
    pair = [Standin("vllm", tokens_per_s=20).start(wait=False) for _ in range(2)]
    try:
        for engine in pair:
            engine.wait_healthy()
        yield pair
    finally:
        for engine in pair:
            engine.stop()


class Pool:
    """A provider whose engines and routable flags a test changes."""

    def __init__(self, *urls: str) -> None:
        self.endpoints = [
            EngineEndpoint(worker_id=f"e{i}", base_url=url, routable=True)
            for i, url in enumerate(urls)
        ]

    def __call__(self) -> list[EngineEndpoint]:
        return list(self.endpoints)

    def set_routable(self, worker_id: str, routable: bool) -> None:
        self.endpoints = [
            EngineEndpoint(worker_id=e.worker_id, base_url=e.base_url, routable=routable)
            if e.worker_id == worker_id
            else e
            for e in self.endpoints
        ]


@asynccontextmanager
async def running(router: EngineRouter) -> AsyncIterator[httpx.AsyncClient]:
    async with anyio.create_task_group() as tasks:
        ports: list[int] = []
        tasks.start_soon(lambda: serve_router(router, started=ports.append))
        with anyio.fail_after(DEADLINE_S):
            while not ports:
                await anyio.sleep(0.01)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{ports[0]}", timeout=60) as c:
            yield c
        tasks.cancel_scope.cancel()


async def until(condition: Callable[[], bool]) -> None:
    with anyio.fail_after(DEADLINE_S):
        while not condition():
            await anyio.sleep(0.02)


async def abort_all(engines: list[Standin]) -> None:
    async with httpx.AsyncClient(timeout=30) as client:
        for engine in engines:
            await client.post(engine.url + "/sleep?level=0&mode=abort")


LONG = {"model": "standin-model", "prompt": "x", "max_tokens": 10_000}
BODY = {"model": "standin-model", "prompt": "x", "max_tokens": 2}
SHORT = {"model": "standin-model", "prompt": "x", "max_tokens": 2}


@pytest.mark.anyio
async def test_each_request_goes_to_the_engine_with_fewest_in_flight(
    engines: list[Standin],
) -> None:
    router = EngineRouter("gen", Pool(*(e.url for e in engines)))
    served: list[str] = []
    async with running(router) as client:

        async def complete() -> None:
            reply = await client.post("/v1/completions", json=LONG)
            served.append(reply.headers["x-deo-engine"])

        async with anyio.create_task_group() as tasks:
            for started in range(1, 5):
                tasks.start_soon(complete)
                # One at a time, so that each choice sees the counts of the ones before.
                await until(lambda n=started: sum(router.in_flight().values()) == n)
            assert router.in_flight() == {"e0": 2, "e1": 2}
            listed = (await client.get("/router/engines")).json()["engines"]
            assert [e["in_flight_requests"] for e in listed] == [2, 2]
            await abort_all(engines)
        assert sorted(served) == ["e0", "e0", "e1", "e1"]
        assert router.in_flight() == {}
        metrics = (await client.get("/metrics")).text
        assert 'deo_router_requests_total{outcome="ok",pool="gen"} 4.0' in metrics


@pytest.mark.anyio
async def test_streaming_is_relayed_as_it_arrives(engines: list[Standin]) -> None:
    router = EngineRouter("gen", Pool(engines[0].url))
    async with running(router) as client:
        async with client.stream(
            "POST", "/v1/chat/completions", json={**LONG, "stream": True}
        ) as r:
            assert r.status_code == 200
            lines = r.aiter_lines()
            first = await anext(line async for line in lines if line.startswith("data: "))
            chunk = json.loads(first[len("data: ") :])
            assert chunk["choices"][0]["delta"]["content"] == " t0"
            # The first token came through while the engine still generates the rest.
            assert router.in_flight() == {"e0": 1}
            await abort_all(engines)
            rest = [line async for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        assert router.in_flight() == {}


@pytest.mark.anyio
async def test_no_request_goes_to_an_engine_that_is_not_routable(engines: list[Standin]) -> None:
    pool = Pool(*(e.url for e in engines))
    pool.set_routable("e0", False)  # draining, asleep or starting: the router does not care which
    router = EngineRouter("gen", pool)
    async with running(router) as client:
        served = [
            (await client.post("/v1/completions", json=SHORT)).headers["x-deo-engine"]
            for _ in range(5)
        ]
        assert served == ["e1"] * 5
        engine_metrics = httpx.get(engines[0].url + "/metrics").text
        assert "vllm:request_success_total{" not in engine_metrics
        pool.set_routable("e1", False)
        router.no_engine_wait_s = 0.2
        refused = await client.post("/v1/completions", json=SHORT)
        assert refused.status_code == 503
        assert "no engine of pool 'gen' is routable" in refused.json()["error"]["message"]
        assert (await client.get("/health")).status_code == 503


@pytest.mark.anyio
async def test_a_failure_before_the_first_byte_is_retried_on_another_engine(
    engines: list[Standin],
) -> None:
    dead = f"http://127.0.0.1:{reserve_port()}"  # nothing listens there: connection refused
    router = EngineRouter("gen", Pool(dead, engines[0].url, engines[1].url))
    async with running(router) as client:
        httpx.post(engines[0].url + "/standin/fail_next", json={"count": 1, "status": 503})
        reply = await client.post("/v1/completions", json=SHORT)
        assert reply.status_code == 200
        # e0 refused the connection, e1 answered 503 before any body, e2 served it.
        assert reply.headers["x-deo-engine"] == "e2"
        assert router.retries == 2
        models = await client.get("/v1/models")
        assert models.json()["data"][0]["id"] == "standin-model"
        assert router.retries == 3  # the dead engine again, then e1 answered
        # A 4xx is the client's: passed through, not retried.
        bad = await client.post("/v1/completions", json={"max_tokens": -1})
        assert bad.status_code == 400
        assert bad.headers["x-deo-engine"] == "e1"
        assert router.retries == 4  # only past the dead engine


@pytest.mark.anyio
async def test_an_engine_killed_mid_request_fails_that_request_and_new_ones_go_elsewhere(
    engines: list[Standin],
) -> None:
    router = EngineRouter("gen", Pool(*(e.url for e in engines)))
    async with running(router) as client:
        async with client.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as r:
            assert r.headers["x-deo-engine"] == "e0"
            lines = r.aiter_lines()
            await anext(line async for line in lines if line.startswith("data: "))
            engines[0].kill()
            with pytest.raises(httpx.HTTPError):
                async for _ in lines:
                    pass
        await until(lambda: router.in_flight() == {})
        assert router.outcomes.get("broken") == 1
        # deo has not noticed the death yet: e0 is still listed, chosen (0 in flight), refused,
        # and the request goes to e1.
        for _ in range(3):
            reply = await client.post("/v1/completions", json=SHORT)
            assert reply.status_code == 200
            assert reply.headers["x-deo-engine"] == "e1"


@pytest.mark.anyio
async def test_a_client_that_leaves_mid_stream_is_no_longer_counted(
    engines: list[Standin],
) -> None:
    router = EngineRouter("gen", Pool(engines[0].url))
    async with running(router) as client:
        async with client.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as r:
            lines = r.aiter_lines()
            await anext(line async for line in lines if line.startswith("data: "))
            assert router.in_flight() == {"e0": 1}
        # The client closed its connection: the engine's count must not wait for the engine.
        await until(lambda: router.in_flight() == {})
        await abort_all(engines)


@pytest.mark.anyio
async def test_a_body_declared_over_the_limit_is_refused_before_it_is_read() -> None:
    router = EngineRouter("gen", Pool("http://127.0.0.1:9"))
    async with running(router) as client:
        port = client.base_url.port
        assert port is not None
        # Headers only: the body never comes, so only a refusal on Content-Length answers.
        declared = MAX_BODY_BYTES + 1
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Content-Type: application/json\r\nContent-Length: {declared}\r\n\r\n{{"
        )
        with anyio.fail_after(DEADLINE_S):
            stream = await anyio.connect_tcp("127.0.0.1", port)
            async with stream:
                await stream.send(head.encode())
                answer = await stream.receive()
        assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
        assert router.in_flight() == {}


@pytest.mark.anyio
async def test_a_streamed_body_over_the_limit_is_refused() -> None:
    router = EngineRouter("gen", Pool("http://127.0.0.1:9"))
    sent = 0

    async def chunks() -> AsyncIterator[bytes]:
        nonlocal sent
        chunk = b" " * 2**20
        while sent <= 2 * MAX_BODY_BYTES:
            sent += len(chunk)
            yield chunk

    async with running(router) as client:
        with contextlib.suppress(httpx.TransportError):
            reply = await client.post("/v1/completions", content=chunks())
            assert reply.status_code == 413, reply.text
    assert sent > MAX_BODY_BYTES


@pytest.mark.anyio
async def test_requests_waiting_for_an_engine_are_counted_until_one_is_routable(
    engines: list[Standin],
) -> None:
    pool = Pool(engines[0].url)
    pool.set_routable("e0", False)
    router = EngineRouter("gen", pool)
    async with running(router) as client, anyio.create_task_group() as tasks:
        replies: list[httpx.Response] = []

        async def send() -> None:
            replies.append(await client.post("/v1/completions", json=BODY))

        for _ in range(3):
            tasks.start_soon(send)
        await until(lambda: router.waiting_requests == 3)
        metrics = (await client.get("/metrics")).text
        assert 'deo_router_waiting_requests{pool="gen"} 3.0' in metrics
        pool.set_routable("e0", True)
        await until(lambda: len(replies) == 3)
    assert router.waiting_requests == 0
    assert [reply.status_code for reply in replies] == [200, 200, 200]
