"""adapters.runtime.engine_pools: the pool's load counts the requests waiting in its router for
an engine (none is awake), so that the pool is seen busy rather than idle."""

from __future__ import annotations

import anyio
import httpx
import pytest

from adapters.router import serve_router
from adapters.runtime.engine_pools import _poll, bind_routers
from core import Config, Configured, Event, LoadSampled, PolicySpec, PoolSpec, Reducer

DEADLINE_S = 60.0


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.anyio
async def test_requests_waiting_in_the_router_count_in_the_pool_load() -> None:
    spec = PoolSpec(
        name="gen",
        kind="engine",
        engine="vllm",
        argv=["serve", "--port", "{port}"],
        ports=(18000, 18003),
        max_workers=2,
        policy=PolicySpec(name="static", params={"count": 1}),
    )
    config = Config(pools=[spec])
    reducer = Reducer()
    reducer.step(Configured(t=0.0, config=config))  # gen-0 requested: nothing is awake
    [pool] = bind_routers(config, lambda: reducer.state, metrics_interval_s=0.05)
    emitted: list[Event] = []

    def loads() -> list[int]:
        return [e.in_flight_requests for e in emitted if isinstance(e, LoadSampled)]

    with anyio.fail_after(DEADLINE_S):
        async with anyio.create_task_group() as tasks:
            ports: list[int] = []
            tasks.start_soon(lambda: serve_router(pool.router, started=ports.append))
            tasks.start_soon(_poll, pool, lambda: reducer.state, emitted.append, lambda: 1.0)
            while not ports or not loads():
                await anyio.sleep(0.02)
            assert loads()[-1] == 0  # idle: nothing sent yet
            async with httpx.AsyncClient(timeout=60) as client:
                url = f"http://127.0.0.1:{ports[0]}/v1/completions"

                async def send() -> None:
                    await client.post(url, json={"prompt": "x"})

                for _ in range(2):
                    tasks.start_soon(send)
                while pool.router.waiting_requests < 2:
                    await anyio.sleep(0.02)
                seen = len(emitted)
                while not loads()[seen:] or loads()[-1] != 2:
                    await anyio.sleep(0.02)
                tasks.cancel_scope.cancel()
