"""The drain watch of deo run's engine pools against a stand-in engine as a real process: an
engine's in-flight count is reported only when it was read within one drain."""

from __future__ import annotations

from collections.abc import Callable

import anyio
import pytest
from engine_standins import Standin

from adapters.router import EngineRouter
from adapters.runtime.engine_pools import EnginePool, _watch_drains, engine_endpoints
from adapters.sources.engine_metrics import EngineMetricsSource
from core import (
    Config,
    Configured,
    EngineLoadSampled,
    Event,
    PolicySpec,
    PoolPinned,
    PoolSpec,
    Reducer,
    State,
    WorkerReady,
    WorkerStarted,
    WorkerState,
)

DEADLINE_S = 60.0


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def drains_of_one_engine(port: int) -> tuple[State, State]:
    """The pool's state in a first drain to sleep of its engine, and in a second one begun after
    the first was called off (the engine routed again in between)."""
    spec = PoolSpec(
        name="gen",
        kind="engine",
        engine="vllm",
        argv=["serve", "--port", "{port}"],
        ports=(port, port),
        min_workers=0,
        max_workers=1,
        policy=PolicySpec(name="static", params={"count": 1}),
    )
    reducer = Reducer(check_invariants=True)
    reducer.step(Configured(t=0.0, config=Config(pools=[spec])))
    reducer.step(WorkerStarted(t=1.0, worker_id="gen-0", pid=4242, start_time=1))
    reducer.step(WorkerReady(t=2.0, worker_id="gen-0"))
    reducer.step(PoolPinned(t=3.0, pool="gen", count=0))
    first = reducer.state
    reducer.step(PoolPinned(t=4.0, pool="gen", count=1))  # called off: routed again
    assert reducer.state.workers["gen-0"].state is WorkerState.ACTIVE
    reducer.step(PoolPinned(t=5.0, pool="gen", count=0))
    second = reducer.state
    for state in (first, second):
        assert state.workers["gen-0"].state is WorkerState.GOING_TO_SLEEP
    return first, second


@pytest.mark.anyio
async def test_a_count_read_across_two_drains_is_not_reported() -> None:
    with Standin("vllm", memory_mib=8) as engine:
        first, second = drains_of_one_engine(engine.port)
        reads = 0

        def state() -> State:
            # The watch reads the state before and after each reading of the engines: the first
            # reading begins in the first drain and ends in the second.
            nonlocal reads
            reads += 1
            return first if reads == 1 else second

        reported: list[tuple[int, Event]] = []

        def emit(event: Event) -> None:
            reported.append((reads, event))

        pool = EnginePool(
            spec=second.pools["gen"].spec,
            router=EngineRouter("gen", lambda: engine_endpoints(state(), "gen")),
            sock=None,
            metrics=EngineMetricsSource(pool="gen", engine="vllm"),
            own_source=False,
        )
        clock: Callable[[], float] = lambda: 6.0  # noqa: E731
        with anyio.fail_after(DEADLINE_S):
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(_watch_drains, pool, state, emit, clock)
                while not reported:
                    await anyio.sleep(0.02)
                tasks.cancel_scope.cancel()
        read_at, event = reported[0]
        assert isinstance(event, EngineLoadSampled) and event.in_flight_requests == 0
        assert read_at >= 4  # from the second reading, begun and ended in the second drain
