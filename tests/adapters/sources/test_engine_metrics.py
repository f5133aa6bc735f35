"""The engine metrics source against real stand-in engines and hand-written /metrics text."""

from __future__ import annotations

import socket

import anyio
import httpx
import pytest
from engine_standins import Standin

from adapters.router import EngineEndpoint
from adapters.sources.engine_metrics import (
    EngineLoad,
    EngineMetricsSource,
    parse_engine_load,
    sample_engine_metrics,
)
from bench.ports import reserve_port
from core import ConfigError, EngineLoadSampled, LoadSampled, SourceDown

VLLM_TEXT = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 1.0
vllm:num_requests_waiting{engine="1",model_name="m"} 0.0
# TYPE vllm:request_success_total counter
vllm:request_success_total{engine="0",finished_reason="stop",model_name="m"} 12.0
"""

SGLANG_TEXT = """\
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{engine_type="unified",model_name="m",pp_rank="0",tp_rank="0"} 7.0
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{engine_type="unified",model_name="m",pp_rank="0",tp_rank="0"} 4.0
"""


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def clock() -> float:
    return 5.0


def test_parse_sums_the_series_of_each_engine_kind() -> None:
    assert parse_engine_load("vllm", VLLM_TEXT) == EngineLoad(
        running_requests=5, waiting_requests=1
    )
    assert parse_engine_load("sglang", SGLANG_TEXT) == EngineLoad(
        running_requests=7, waiting_requests=4
    )


def test_parse_names_the_missing_metric() -> None:
    # vLLM's names in an SGLang pool: the operator configured the wrong engine.
    with pytest.raises(ValueError, match="no sglang:num_running_reqs or sglang:num_queue_reqs"):
        parse_engine_load("sglang", VLLM_TEXT)


def test_an_unknown_engine_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"pools\.gen\.engine: no metric names known for 'tgi'"):
        EngineMetricsSource(pool="gen", engine="tgi")


@pytest.mark.anyio
@pytest.mark.parametrize("engine", ["vllm", "sglang"])
async def test_engines_under_load_become_per_engine_and_pool_samples(engine: str) -> None:
    source = EngineMetricsSource(pool="gen", engine=engine, timeout_s=10)
    with (
        Standin(engine, max_concurrency=2, tokens_per_s=20) as busy,
        Standin(engine) as idle,
    ):
        client = httpx.AsyncClient(timeout=60)
        endpoints = [
            EngineEndpoint(worker_id="busy", base_url=busy.url, routable=True),
            EngineEndpoint(worker_id="idle", base_url=idle.url, routable=True),
        ]

        async def complete() -> None:
            await client.post(busy.url + "/v1/completions", json={"max_tokens": 10_000})

        async with anyio.create_task_group() as tasks:
            for _ in range(3):
                tasks.start_soon(complete)
            # Every request is counted as waiting until it takes a slot: wait for the
            # settled state (two running, one waiting), not merely three in flight.
            settled = [
                EngineLoadSampled(
                    t=5.0, pool="gen", worker_id="busy", in_flight_requests=3, waiting_requests=1
                ),
                EngineLoadSampled(t=5.0, pool="gen", worker_id="idle", in_flight_requests=0),
                LoadSampled(t=5.0, pool="gen", in_flight_requests=3),
            ]
            with anyio.fail_after(60):
                while True:
                    events = await sample_engine_metrics(client, source, endpoints, clock)
                    if events == settled:
                        break
                    await anyio.sleep(0.05)
            # The router knows of requests the engine has not seen yet: the larger count wins.
            routed = await sample_engine_metrics(client, source, endpoints, clock, {"idle": 2})
            assert routed[1] == EngineLoadSampled(
                t=5.0, pool="gen", worker_id="idle", in_flight_requests=2
            )
            assert routed[-1] == LoadSampled(t=5.0, pool="gen", in_flight_requests=5)
            if engine == "vllm":
                await client.post(busy.url + "/sleep?level=0&mode=abort")
            else:
                await client.post(busy.url + "/pause_generation", json={"mode": "abort"})
        await client.aclose()


@pytest.mark.anyio
async def test_an_unreadable_engine_is_reported_never_counted_as_idle() -> None:
    source = EngineMetricsSource(pool="gen", engine="vllm", timeout_s=0.5)
    # A socket that listens but never answers: the read must give up at timeout_s.
    with socket.create_server(("127.0.0.1", 0)) as silent, Standin("vllm") as live:
        endpoints = [
            EngineEndpoint(worker_id="live", base_url=live.url, routable=True),
            EngineEndpoint(
                worker_id="refused", base_url=f"http://127.0.0.1:{reserve_port()}", routable=True
            ),
            EngineEndpoint(
                worker_id="silent",
                base_url=f"http://127.0.0.1:{silent.getsockname()[1]}",
                routable=True,
            ),
            EngineEndpoint(worker_id="wrong", base_url=live.url + "/nothing", routable=True),
        ]
        async with httpx.AsyncClient() as client:
            events = await sample_engine_metrics(client, source, endpoints, clock)
    assert events[0] == EngineLoadSampled(t=5.0, pool="gen", worker_id="live", in_flight_requests=0)
    assert len(events) == 2
    down = events[1]
    assert isinstance(down, SourceDown)
    assert down.error.startswith("3 of 4 engine(s) unreadable: refused (")
    assert "silent (" in down.error and "no answer within 0.5 s" in down.error
    assert "wrong (" in down.error and "404" in down.error
