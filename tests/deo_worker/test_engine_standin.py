"""The stand-in engine as a real process: completions, sleep and wake, metrics, failures."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator

import anyio
import httpx
import pytest
from engine_standins import Standin
from prometheus_client.parser import text_string_to_metric_families
from real_gpu import cuda_torch
from waiting import wait_for

from deo_worker.engine_standin import EngineStandin

MIB = 1024 * 1024
DEADLINE_S = 60.0

RUNNING = {"vllm": "vllm:num_requests_running", "sglang": "sglang:num_running_reqs"}
WAITING = {"vllm": "vllm:num_requests_waiting", "sglang": "sglang:num_queue_reqs"}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(params=["vllm", "sglang"])
def standin(request: pytest.FixtureRequest) -> Iterator[Standin]:
    with Standin(request.param, memory_mib=128, tokens_per_s=50, max_concurrency=2) as engine:
        yield engine


def gauges(url: str, engine: str) -> tuple[float, float]:
    """(running, waiting) read from /metrics with prometheus-client's parser."""
    text = httpx.get(url + "/metrics", timeout=10).text
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return values[RUNNING[engine]], values[WAITING[engine]]


async def wait_for_gauges(url: str, engine: str, expected: tuple[float, float]) -> None:
    with anyio.fail_after(DEADLINE_S):
        while gauges(url, engine) != expected:
            await anyio.sleep(0.05)


def sse_chunks(body: str) -> list[str]:
    return [line[len("data: ") :] for line in body.splitlines() if line.startswith("data: ")]


def test_completion_streams_token_chunks_then_done(standin: Standin) -> None:
    with httpx.Client(base_url=standin.url, timeout=30) as client:
        models = client.get("/v1/models").json()
        assert models["data"][0]["id"] == "standin-model"
        body = {"model": "standin-model", "prompt": "hi", "max_tokens": 5, "stream": True}
        with client.stream("POST", "/v1/completions", json=body) as response:
            assert response.headers["content-type"].startswith("text/event-stream")
            text = "".join(response.iter_text())
        chunks = sse_chunks(text)
        assert chunks[-1] == "[DONE]"
        parsed = [json.loads(chunk) for chunk in chunks[:-1]]
        assert len(parsed) == 6  # five tokens, then the chunk that says why it finished
        assert parsed[-1]["choices"][0]["finish_reason"] == "length"
        assert all(p["system_fingerprint"] == f"standin-{standin.port}" for p in parsed)
        chat = client.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
        ).json()
        assert chat["choices"][0]["message"]["content"] == " t0 t1 t2"
        assert chat["usage"]["completion_tokens"] == 3


def sleep_route(engine: str) -> tuple[str, dict[str, object] | None]:
    return ("/sleep?level=1", None) if engine == "vllm" else ("/release_memory_occupation", {})


def wake_route(engine: str) -> tuple[str, dict[str, object] | None]:
    return ("/wake_up", None) if engine == "vllm" else ("/resume_memory_occupation", {})


def test_sleep_frees_the_memory_and_wake_takes_it_back(standin: Standin) -> None:
    awake = standin.rss_bytes()
    assert awake > 128 * MIB
    path, body = sleep_route(standin.engine)
    assert httpx.post(standin.url + path, json=body, timeout=30).status_code == 200
    asleep = standin.rss_bytes()
    assert awake - asleep > 0.9 * 128 * MIB, (awake, asleep)
    if standin.engine == "vllm":
        assert httpx.get(standin.url + "/is_sleeping").json() == {"is_sleeping": True}
    # Asleep, the engine is still alive: /health answers 200 (vLLM's rule).
    assert httpx.get(standin.url + "/health").status_code == 200
    path, body = wake_route(standin.engine)
    assert httpx.post(standin.url + path, json=body, timeout=30).status_code == 200
    assert standin.rss_bytes() - asleep > 0.9 * 128 * MIB
    if standin.engine == "vllm":
        assert httpx.get(standin.url + "/is_sleeping").json() == {"is_sleeping": False}
    reply = httpx.post(standin.url + "/v1/completions", json={"max_tokens": 2}, timeout=30)
    assert reply.json()["choices"][0]["finish_reason"] == "length"


@pytest.mark.anyio
async def test_metrics_count_running_and_waiting_requests(standin: Standin) -> None:
    async with httpx.AsyncClient(base_url=standin.url, timeout=60) as client:
        finished: list[str] = []

        async def complete() -> None:
            reply = await client.post("/v1/completions", json={"max_tokens": 10_000})
            finished.append(reply.json()["choices"][0]["finish_reason"])

        async with anyio.create_task_group() as tasks:
            for _ in range(3):
                tasks.start_soon(complete)
            # max_concurrency 2: two run, the third waits.
            await wait_for_gauges(standin.url, standin.engine, (2.0, 1.0))
            if standin.engine == "vllm":
                await client.post("/sleep?level=0&mode=abort")
            else:
                await client.post("/pause_generation", json={"mode": "abort"})
        assert finished == ["abort"] * 3
        assert gauges(standin.url, standin.engine) == (0.0, 0.0)


@pytest.mark.anyio
async def test_vllm_sleep_aborts_in_flight_and_holds_new_requests_until_wake() -> None:
    with Standin("vllm", tokens_per_s=20) as standin:
        async with httpx.AsyncClient(base_url=standin.url, timeout=60) as client:
            results: dict[str, str] = {}

            async def complete(name: str) -> None:
                reply = await client.post("/v1/completions", json={"max_tokens": 1000})
                assert reply.status_code == 200
                results[name] = reply.json()["choices"][0]["finish_reason"]

            async with anyio.create_task_group() as tasks:
                tasks.start_soon(complete, "before")
                await wait_for_gauges(standin.url, "vllm", (1.0, 0.0))
                assert (await client.post("/sleep?level=2")).status_code == 200
                with anyio.fail_after(DEADLINE_S):
                    while "before" not in results:
                        await anyio.sleep(0.05)
                assert results["before"] == "abort"
                tasks.start_soon(complete, "asleep")
                await wait_for_gauges(standin.url, "vllm", (0.0, 1.0))
                assert "asleep" not in results
                assert (await client.post("/wake_up")).status_code == 200
                await wait_for_gauges(standin.url, "vllm", (1.0, 0.0))
                # The woken request now generates to its end; abort it to finish the test.
                assert (await client.post("/sleep?level=0")).status_code == 200
            assert results["asleep"] == "abort"


async def complete(client: httpx.AsyncClient) -> None:
    await client.post("/v1/completions", json={"max_tokens": 10_000})


@pytest.mark.anyio
async def test_sglang_flush_refused_while_busy_and_generation_fails_while_released() -> None:
    with Standin("sglang", tokens_per_s=20) as standin:
        async with httpx.AsyncClient(base_url=standin.url, timeout=60) as client:
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(complete, client)
                await wait_for_gauges(standin.url, "sglang", (1.0, 0.0))
                refused = await client.post("/flush_cache")
                assert refused.status_code == 400
                assert "running" in refused.json()["error"]["message"]
                paused = await client.post("/pause_generation", json={"mode": "abort"})
                assert paused.status_code == 200
                await wait_for_gauges(standin.url, "sglang", (0.0, 0.0))
            assert (await client.post("/release_memory_occupation", json={})).json() is None
            assert (await client.post("/flush_cache")).status_code == 200
            assert (await client.post("/continue_generation", json={})).status_code == 200
            failed = await client.post("/v1/completions", json={"max_tokens": 1})
            assert failed.status_code == 500
            assert "memory released" in failed.json()["error"]["message"]


def test_sglang_answers_503_while_starting() -> None:
    standin = Standin("sglang", startup_s=600).start(wait=False)
    try:
        with httpx.Client(base_url=standin.url, timeout=10) as client:
            health = wait_for(
                "the stand-in to listen",
                lambda: client.get("/health"),
                DEADLINE_S,
                interval_s=0.05,
                retry_on=(httpx.TransportError,),
            )
            assert health.status_code == 503
            assert client.post("/v1/completions", json={"max_tokens": 1}).status_code == 503
    finally:
        standin.stop()


def test_injected_failures_answer_before_any_body() -> None:
    with Standin("vllm") as standin, httpx.Client(base_url=standin.url, timeout=30) as client:
        client.post("/standin/fail_next", json={"count": 2, "status": 502})
        statuses = [client.post("/v1/completions", json={"max_tokens": 1}).status_code]
        statuses.append(client.post("/v1/completions", json={"max_tokens": 1}).status_code)
        statuses.append(client.post("/v1/completions", json={"max_tokens": 1}).status_code)
        assert statuses == [502, 502, 200]


@pytest.mark.skipif(cuda_torch(), reason="PyTorch with CUDA is here: --memory-on gpu works")
def test_memory_on_a_gpu_without_pytorch_and_cuda_is_refused_by_name() -> None:
    argv = ["--port", "1", "--engine", "vllm", "--memory-on", "gpu"]
    proc = subprocess.run(
        [sys.executable, "-m", "deo_worker.engine_standin", *argv],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert re.search(r"--memory-on gpu(: PyTorch sees no CUDA device| needs PyTorch)", proc.stderr)


def test_memory_on_an_unknown_place_is_refused() -> None:
    with pytest.raises(ValueError, match="--memory-on must be host or gpu, got 'disk'"):
        EngineStandin(engine="vllm", port=1, memory_on="disk")
