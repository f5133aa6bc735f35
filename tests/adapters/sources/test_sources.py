"""Pressure from a JSON endpoint (a real HTTP server), heartbeat files, finding a spawned worker."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from waiting import wait_for

from adapters.api.app import serve
from adapters.run import find_spawned
from adapters.sources.heartbeat import heartbeat_files, heartbeat_path
from adapters.sources.json_pressure import JsonSource, poll_json, read_pressure
from core import (
    Config,
    Configured,
    Event,
    LoadSampled,
    PoolSpec,
    QueueSampled,
    Reducer,
    SourceDown,
    UnknownSubject,
    WorkerStarted,
)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


QUEUE = JsonSource(
    pool="envs",
    url="http://127.0.0.1:1/status",
    queued_sequences="queue.seqs",
    batch_size_seqs="info.batch",
    trainer_step="step",
)


def beside(directory: Path) -> Callable[[str], Path]:
    """Each worker's heartbeat file in ``directory``, as the process executor names it."""
    return lambda worker_id: heartbeat_path(directory, worker_id)


def test_read_pressure_follows_the_field_paths() -> None:
    body = {"queue": {"seqs": 96}, "info": {"batch": 64}, "step": 7}
    assert read_pressure(QUEUE, body, 1.0) == QueueSampled(
        t=1.0, pool="envs", queued_sequences=96, batch_size_seqs=64, trainer_step=7
    )
    load = JsonSource(pool="engines", url="http://x/", in_flight_requests="load")
    assert read_pressure(load, {"load": 3}, 2.0) == LoadSampled(
        t=2.0, pool="engines", in_flight_requests=3
    )


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"info": {"batch": 64}, "step": 7}, "no field 'queue.seqs'"),
        ({"queue": {"seqs": -1}, "info": {"batch": 64}, "step": 7}, "queued_sequences"),
        ([1, 2], "no field"),
    ],
)
def test_a_body_without_usable_pressure_is_a_source_outage(body: Any, message: str) -> None:
    event = read_pressure(QUEUE, body, 1.0)
    assert isinstance(event, SourceDown) and message in event.error


@pytest.mark.anyio
async def test_poll_json_reads_a_real_server_and_reports_it_down_when_it_errs() -> None:
    answers = iter([{"queue": {"seqs": 10}, "info": {"batch": 8}, "step": 1}, None])

    async def status(request: Request) -> JSONResponse:
        body = next(answers, None)
        return JSONResponse(body) if body is not None else JSONResponse({}, status_code=500)

    app = Starlette(routes=[Route("/status", status)])
    events: list[Event] = []
    ports: list[int] = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: serve(app, port=0, started=ports.append))
        with anyio.fail_after(10):
            while not ports:
                await anyio.sleep(0.01)
        source = JsonSource(
            pool="envs",
            url=f"http://127.0.0.1:{ports[0]}/status",
            interval_s=0.05,
            queued_sequences="queue.seqs",
            batch_size_seqs="info.batch",
            trainer_step="step",
        )
        tg.start_soon(poll_json, source, events.append, time.time)
        with anyio.fail_after(10):
            while len(events) < 2:
                await anyio.sleep(0.01)
        tg.cancel_scope.cancel()
    assert isinstance(events[0], QueueSampled) and events[0].queued_sequences == 10
    assert isinstance(events[1], SourceDown) and "500" in events[1].error


@pytest.mark.anyio
async def test_touching_a_heartbeat_file_reports_the_worker_alive(tmp_path: Path) -> None:
    reducer = Reducer()
    spec = PoolSpec(name="envs", argv=["w"], min_workers=1)
    reducer.step(Configured(t=0.0, config=Config(pools=[spec])))
    reducer.step(WorkerStarted(t=0.0, worker_id="envs-0", pid=1, start_time=1))
    seen: list[str] = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(heartbeat_files, beside(tmp_path), lambda: reducer.state, seen.append, 0.02)
        await anyio.sleep(0.1)
        assert seen == []  # no file yet
        heartbeat_path(tmp_path, "envs-0").touch()
        with anyio.fail_after(30):
            while not seen:
                await anyio.sleep(0.01)
        tg.cancel_scope.cancel()
    assert seen == ["envs-0"]


@pytest.mark.anyio
async def test_a_heartbeat_of_a_worker_gone_since_the_last_look_keeps_the_watch(
    tmp_path: Path,
) -> None:
    reducer = Reducer()
    spec = PoolSpec(name="envs", argv=["w"], min_workers=2, max_workers=2)
    reducer.step(Configured(t=0.0, config=Config(pools=[spec])))
    reducer.step(WorkerStarted(t=0.0, worker_id="envs-0", pid=1, start_time=1))
    reducer.step(WorkerStarted(t=0.0, worker_id="envs-1", pid=2, start_time=2))
    seen: list[str] = []

    def saw(worker_id: str) -> None:
        # The runner's saw judges a newer state, where envs-0's pool may be gone already.
        if worker_id == "envs-0":
            raise UnknownSubject("heartbeat: unknown worker 'envs-0'")
        seen.append(worker_id)

    async with anyio.create_task_group() as tg:
        tg.start_soon(heartbeat_files, beside(tmp_path), lambda: reducer.state, saw, 0.02)
        heartbeat_path(tmp_path, "envs-0").touch()
        heartbeat_path(tmp_path, "envs-1").touch()
        with anyio.fail_after(30):
            while not seen:
                await anyio.sleep(0.01)
        tg.cancel_scope.cancel()
    assert seen == ["envs-1"]


def _sleeper(env: dict[str, str]) -> subprocess.Popen[bytes]:
    """A child with ``env`` that outlives the test however slow the machine (it is killed at
    the end), returned once /proc shows it running with ``env``."""
    child = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(3600)"], env=env, start_new_session=True
    )
    marker = f"DEO_RUN_ID={env['DEO_RUN_ID']}".encode()
    wait_for(
        f"child {child.pid} running with its environment",
        lambda: marker in Path(f"/proc/{child.pid}/environ").read_bytes().split(b"\0"),
    )
    return child


def test_find_spawned_finds_this_logs_worker_by_its_environment() -> None:
    worker_id = f"probe-{os.getpid()}"
    env = {**os.environ, "DEO_WORKER_ID": worker_id}
    ours = _sleeper({**env, "DEO_RUN_ID": "ours"})
    theirs = _sleeper({**env, "DEO_RUN_ID": "theirs"})
    try:
        found = find_spawned(worker_id, "ours")
        assert found is not None and found[0] == ours.pid  # not the other log's namesake
        assert find_spawned(worker_id + "-other", "ours") is None
        twin = _sleeper({**env, "DEO_RUN_ID": "ours"})
        try:
            assert find_spawned(worker_id, "ours") is None  # ambiguous: adopt neither
        finally:
            twin.kill()
            twin.wait()
    finally:
        for child in (ours, theirs):
            child.kill()
            child.wait()
