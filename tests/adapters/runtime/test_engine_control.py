"""adapters.runtime.engines against stand-in engines as real processes: the vLLM and SGLang
sleep and wake routes, is-sleeping checks, failures reported as events, readiness from /health."""

from __future__ import annotations

from collections.abc import Iterator

import anyio
import attrs
import httpx
import pytest
from engine_standins import Standin
from prometheus_client.parser import text_string_to_metric_families

from adapters.runtime.engines import EngineControl
from core import (
    Config,
    Configured,
    Event,
    PolicySpec,
    PoolSpec,
    Reducer,
    WorkerReady,
    WorkerStarted,
)
from core.commands import SleepEngine, VerifyAsleep, WakeEngine
from core.events import EngineAsleep, EngineAwake, EngineSleepFailed, EngineWakeFailed

MIB = 1024 * 1024
DEADLINE_S = 60.0


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(params=["vllm", "sglang"])
def standin(request: pytest.FixtureRequest) -> Iterator[Standin]:
    with Standin(request.param, memory_mib=64, tokens_per_s=20, max_concurrency=2) as engine:
        yield engine


async def carry_out(commands: list[object], reducer: Reducer | None = None) -> list[Event]:
    """Hand ``commands`` to an EngineControl and collect what it reports, one event each."""
    events: list[Event] = []
    control = EngineControl(
        events.append,
        clock=lambda: 1.0,
        state=lambda: (reducer or Reducer()).state,
        health_interval_s=0.05,
    )
    with anyio.fail_after(DEADLINE_S):
        async with anyio.create_task_group() as tg:
            tg.start_soon(control.run)
            for command in commands:
                await control.execute(command)  # type: ignore[arg-type]
            while len(events) < len(commands):
                await anyio.sleep(0.02)
            tg.cancel_scope.cancel()
    return events


def sleep(engine: Standin, timeout_s: float = 10.0) -> SleepEngine:
    return SleepEngine(
        worker_id="gen-0",
        engine=engine.engine,
        port=engine.port,
        level=1,
        timeout_s=timeout_s,
        attempt=1,
        reason="test",
    )


def wake(engine: Standin, port: int | None = None, timeout_s: float = 30.0) -> WakeEngine:
    return WakeEngine(
        worker_id="gen-0",
        engine=engine.engine,
        port=port or engine.port,
        timeout_s=timeout_s,
        attempt=1,
        reason="test",
    )


@pytest.mark.anyio
async def test_sleep_frees_the_memory_and_wake_takes_it_back(standin: Standin) -> None:
    awake = standin.rss_bytes()
    [asleep] = await carry_out([sleep(standin)])
    assert isinstance(asleep, EngineAsleep) and asleep.worker_id == "gen-0"
    released = standin.rss_bytes()
    assert awake - released > 32 * MIB, (awake, released)
    if standin.engine == "vllm":
        verify = VerifyAsleep(
            worker_id="gen-0", engine="vllm", port=standin.port, timeout_s=5, reason="test"
        )
        [confirmed] = await carry_out([verify])
        assert isinstance(confirmed, EngineAsleep)
    [woken] = await carry_out([wake(standin)])
    assert isinstance(woken, EngineAwake)
    assert standin.rss_bytes() - released > 32 * MIB
    if standin.engine == "vllm":
        answer = httpx.get(standin.url + "/is_sleeping", timeout=10).json()
        assert answer == {"is_sleeping": False}


async def running(client: httpx.AsyncClient, engine: str) -> float:
    name = {"vllm": "vllm:num_requests_running", "sglang": "sglang:num_running_reqs"}[engine]
    text = (await client.get("/metrics")).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name
    )


@pytest.mark.anyio
async def test_a_sleep_under_running_requests_still_releases(standin: Standin) -> None:
    # A drain that timed out: requests still run when the sleep call goes.
    body = {"model": "standin-model", "prompt": "x", "max_tokens": 400}
    async with httpx.AsyncClient(base_url=standin.url, timeout=60) as client:
        answers: list[httpx.Response] = []

        async def send() -> None:
            answers.append(await client.post("/v1/completions", json=body))

        async with anyio.create_task_group() as tg:
            tg.start_soon(send)
            with anyio.fail_after(DEADLINE_S):  # running, not just sent
                while await running(client, standin.engine) < 1:
                    await anyio.sleep(0.05)
            [asleep] = await carry_out([sleep(standin)])
            assert isinstance(asleep, EngineAsleep), asleep
        # vLLM aborts what runs (an answer with finish_reason "abort"); SGLang's pause aborts it.
        assert answers and answers[0].status_code in (200, 500)
        [woken] = await carry_out([wake(standin)])
        assert isinstance(woken, EngineAwake)
        # Generation runs again after the wake (SGLang: continued after its pause).
        answer = await client.post("/v1/completions", json={**body, "max_tokens": 2})
        assert answer.status_code == 200


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
@pytest.mark.anyio
async def test_a_sleep_whose_calls_together_outlast_its_timeout_fails_in_time(engine: str) -> None:
    # Each call answers within the timeout, but a sleep is several calls: together they take
    # longer than the core waits (twice the timeout) unless the command as a whole is bounded.
    with Standin(engine, memory_mib=8, control_delay_s=2.0) as standin:
        [failed] = await carry_out([sleep(standin, timeout_s=3.0)])
    # Its calls would have succeeded one by one (6 s for vLLM's three, 4 s for SGLang's two).
    assert isinstance(failed, EngineSleepFailed), failed
    assert "its calls took over 3 s" in failed.error


@pytest.mark.anyio
async def test_calls_to_a_dead_engine_fail_as_events(standin: Standin) -> None:
    port = standin.port
    standin.kill()
    failed = await carry_out([sleep(standin, timeout_s=2.0), wake(standin, port)])
    kinds = sorted(type(event).__name__ for event in failed)
    assert kinds == ["EngineSleepFailed", "EngineWakeFailed"]
    for event in failed:
        assert isinstance(event, EngineSleepFailed | EngineWakeFailed)
        assert "Connect" in event.error


@pytest.mark.anyio
async def test_a_starting_engine_is_reported_ready_once_its_health_answers() -> None:
    with Standin("sglang", memory_mib=8) as engine:
        spec = PoolSpec(
            name="gen",
            kind="engine",
            engine="sglang",
            argv=["serve", "--port", "{port}"],
            ports=(engine.port, engine.port),
            max_workers=1,
            policy=PolicySpec(name="static", params={"count": 1}),
        )
        reducer = Reducer()
        reducer.step(Configured(t=0.0, config=Config(pools=[spec])))
        reducer.step(WorkerStarted(t=0.5, worker_id="gen-0", pid=engine.pid, start_time=1))
        events = await carry_out([None], reducer)  # one event expected, from the watcher
        assert events == [WorkerReady(t=1.0, worker_id="gen-0")]


@pytest.mark.anyio
async def test_a_call_whose_answer_is_late_is_confirmed_before_it_counts_as_failed() -> None:
    # The engine sleeps (wakes) at once but answers after the call's timeout: /is_sleeping says
    # the work was done, so the outcome is asleep (awake), not a failure to retry or replace.
    with Standin("vllm", memory_mib=16) as engine:
        httpx.post(engine.url + "/standin/slow_control", json={"seconds": 60.0}, timeout=10)
        [asleep] = await carry_out([sleep(engine, timeout_s=4.0)])
        assert isinstance(asleep, EngineAsleep)
        assert httpx.get(engine.url + "/is_sleeping", timeout=10).json()["is_sleeping"] is True
        [awake] = await carry_out([wake(engine, timeout_s=4.0)])
        assert isinstance(awake, EngineAwake)


@pytest.mark.anyio
async def test_a_call_that_failed_says_what_the_engine_reports() -> None:
    with Standin("vllm", memory_mib=16) as engine:
        refused = attrs.evolve(sleep(engine), level=7)  # the engine refuses the level: awake
        [failed] = await carry_out([refused])
        assert isinstance(failed, EngineSleepFailed)
        assert "HTTP 400" in failed.error and "/is_sleeping says awake" in failed.error
