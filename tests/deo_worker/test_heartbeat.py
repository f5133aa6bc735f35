"""deo_worker/heartbeat.py and deo_worker/ready.py: the file deo watches and deo's real HTTP API
(Runner, Reducer, log)."""

from __future__ import annotations

import functools
import logging
import os
import socket
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import anyio.abc
import attrs
import pytest
from conftest import free_port

from adapters import run as deo_run
from adapters.api.app import build_app, serve, worker_token
from adapters.log import EventLog
from adapters.runtime.runner import Runner
from adapters.sources import heartbeat as heartbeat_source
from core import Command, Config, Configured, PolicySpec, PoolSpec, Reducer, WorkerStarted
from deo_worker import Heartbeat, report_ready, report_ready_async
from deo_worker import heartbeat as heartbeat_module

OPERATOR_TOKEN = "operator-secret"
WORKER_SECRET = "worker-secret"
WORKER_ID = "envs-0"
WORKER_TOKEN = worker_token(WORKER_SECRET, WORKER_ID)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # deo's API server needs it


class Clock:
    def __init__(self) -> None:
        self.t_s = 0.0

    def __call__(self) -> float:
        return self.t_s


class Ignore:
    async def execute(self, command: Command) -> None:
        pass


@attrs.define
class Deo:
    url: str
    runner: Runner
    clock: Clock

    async def seen(self) -> float | None:
        """The worker's last sign of life in the core, after recording the sightings pending
        now, as the runner's next tick would (the tests' runner does not tick)."""
        runner = self.runner
        for sightings in runner.liveness.records(
            runner.state, self.clock(), runner.tick_interval_s
        ):
            await runner.submit(sightings)
        return self.runner.state.last_seen.get(WORKER_ID)


@asynccontextmanager
async def deo_api(
    tmp_path: Path, sock: socket.socket | None = None, *, require_ready: bool = False
) -> AsyncIterator[Deo]:
    """deo's API around a real Runner with one started worker, ``envs-0``; on ``sock`` when
    given, else on a free port; its pool waits for a readiness report with ``require_ready``."""
    log, _ = EventLog.open(tmp_path / "deo.jsonl", fsync=False)
    clock = Clock()
    runner = Runner(log, Reducer(), Ignore(), clock=clock, tick_interval_s=3600.0)
    # Every beat logged, however close together: the tests move the clock between beats.
    app = build_app(
        runner, token=OPERATOR_TOKEN, worker_secret=WORKER_SECRET, min_worker_interval_s=0.0
    )
    ports: list[int] = []
    listening = anyio.Event()

    def started(port: int) -> None:
        ports.append(port)
        listening.set()

    pool = PoolSpec(
        name="envs",
        argv=["python", "env.py"],
        policy=PolicySpec(name="static", params={"count": 1}),
        require_ready=require_ready,
        # A sighting is recorded once the last record is a quarter of this old: the tests move
        # the clock by whole seconds between beats.
        heartbeat_grace_s=0.4,
    )
    async with anyio.create_task_group() as group:
        group.start_soon(runner.run)
        await runner.submit(Configured(t=0.0, config=Config(pools=[pool])))
        await runner.submit(WorkerStarted(t=0.0, worker_id=WORKER_ID, pid=4242, start_time=1))
        group.start_soon(functools.partial(serve, app, port=0, started=started, sock=sock))
        with anyio.fail_after(30):
            await listening.wait()
        yield Deo(f"http://127.0.0.1:{ports[0]}", runner, clock)
        group.cancel_scope.cancel()
    log.close()


async def seen_at(deo: Deo, t_s: float) -> None:
    with anyio.fail_after(30):
        while await deo.seen() != t_s:
            await anyio.sleep(0.01)


def test_the_variable_names_are_deos() -> None:
    assert heartbeat_module.HEARTBEAT_FILE_ENV == heartbeat_source.HEARTBEAT_ENV
    assert heartbeat_module.API_URL_ENV == deo_run.API_URL_ENV
    assert heartbeat_module.WORKER_TOKEN_ENV == deo_run.WORKER_TOKEN_ENV


@pytest.mark.parametrize(
    ("environ", "file", "url"),
    [
        # deo sets all of them: the file wins (no network on the worker's path)
        (
            {
                "DEO_HEARTBEAT_FILE": "/run/w.hb",
                "DEO_API_URL": "http://h:1",
                "DEO_WORKER_ID": "w",
                "DEO_WORKER_TOKEN": "t",
            },
            Path("/run/w.hb"),
            None,
        ),
        (
            {"DEO_API_URL": "http://h:1/", "DEO_WORKER_ID": "w", "DEO_WORKER_TOKEN": "t"},
            None,
            "http://h:1/v1/workers/w/heartbeat",
        ),
        ({"DEO_API_URL": "http://h:1", "DEO_WORKER_ID": "w"}, None, None),  # no token: nothing
        ({}, None, None),
    ],
)
def test_from_environ(environ: dict[str, str], file: Path | None, url: str | None) -> None:
    heartbeat = Heartbeat.from_environ(environ)
    assert (heartbeat.file, heartbeat.url) == (file, url)
    assert heartbeat.enabled == (file is not None or url is not None)


@pytest.mark.anyio
async def test_without_all_of_deos_variables_nothing_is_sent_and_run_returns(
    tmp_path: Path,
) -> None:
    async with deo_api(tmp_path) as deo:
        deo.clock.t_s = 5.0
        # deo's URL and a worker id, but no token: not run by deo, so no beat reaches it.
        heartbeat = Heartbeat.from_environ({"DEO_API_URL": deo.url, "DEO_WORKER_ID": WORKER_ID})
        assert heartbeat.beat() is True
        assert await heartbeat.beat_async() is True
        with anyio.fail_after(30):  # returns instead of beating forever
            await heartbeat.run(0.01)
        # A marker beat, answered only after anything sent before it was handled.
        marker = Heartbeat(api_url=deo.url, worker_id=WORKER_ID, token=WORKER_TOKEN)
        assert deo.runner.liveness.pending == frozenset()
        assert await marker.beat_async() is True
        assert deo.runner.liveness.pending == {WORKER_ID}  # the marker's, no other


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"api_url": "http://h:1", "worker_id": "w"}, r"go together; missing \['token'\]"),
        ({"file": "x", "timeout_s": 0}, "timeout_s must be > 0"),
    ],
)
def test_bad_settings_are_named(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Heartbeat(**kwargs)  # type: ignore[arg-type]


def test_a_beat_touches_the_file(tmp_path: Path) -> None:
    path = tmp_path / "envs-0.heartbeat"
    heartbeat = Heartbeat.from_environ({"DEO_HEARTBEAT_FILE": str(path)})
    assert heartbeat.beat() is True
    assert path.exists()
    os.utime(path, (0, 0))
    assert heartbeat.beat() is True
    assert path.stat().st_mtime > time.time() - 60  # what deo's file watcher looks at


def test_a_failing_file_is_logged_once_and_never_raises(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "gone" / "w.heartbeat"
    heartbeat = Heartbeat(file=path)
    with caplog.at_level(logging.WARNING, logger="deo_worker.heartbeat"):
        assert heartbeat.beat() is False
        assert heartbeat.beat() is False
        path.parent.mkdir()
        assert heartbeat.beat() is True
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2, messages
    assert str(path) in messages[0] and "works again" in messages[1]


@pytest.mark.anyio
async def test_beats_reach_deos_api_sync_and_async(tmp_path: Path) -> None:
    async with deo_api(tmp_path) as deo:
        environ = {"DEO_API_URL": deo.url, "DEO_WORKER_ID": WORKER_ID}
        heartbeat = Heartbeat.from_environ({**environ, "DEO_WORKER_TOKEN": WORKER_TOKEN})
        deo.clock.t_s = 3.0
        assert await heartbeat.beat_async() is True
        assert await deo.seen() == 3.0
        deo.clock.t_s = 4.0
        # The blocking beat, from a thread: this thread runs deo's server.
        assert await anyio.to_thread.run_sync(heartbeat.beat) is True
        assert await deo.seen() == 4.0


@pytest.mark.anyio
async def test_run_keeps_beating(tmp_path: Path) -> None:
    async with deo_api(tmp_path) as deo:
        heartbeat = Heartbeat(api_url=deo.url, worker_id=WORKER_ID, token=WORKER_TOKEN)
        async with anyio.create_task_group() as group:
            group.start_soon(heartbeat.run, 0.02)
            for t_s in (1.0, 2.0, 3.0):
                deo.clock.t_s = t_s
                await seen_at(deo, t_s)
            group.cancel_scope.cancel()


@pytest.mark.anyio
async def test_run_keeps_touching_the_file(tmp_path: Path) -> None:
    path = tmp_path / "envs-0.heartbeat"
    heartbeat = Heartbeat(file=path)
    async with anyio.create_task_group() as group:
        group.start_soon(heartbeat.run, 0.01)
        with anyio.fail_after(30):
            while not path.exists():
                await anyio.sleep(0.01)
        for _ in range(3):  # each time deo would see it stale, a later beat freshens it
            os.utime(path, (0, 0))
            with anyio.fail_after(30):
                while path.stat().st_mtime == 0:
                    await anyio.sleep(0.01)
        group.cancel_scope.cancel()


@pytest.mark.anyio
async def test_cancelling_run_stops_it_even_mid_request_and_hangs_up() -> None:
    requested = anyio.Event()
    hung_up = anyio.Event()

    async def never_answer(client: anyio.abc.SocketStream) -> None:
        async with client:
            await client.receive()
            requested.set()
            try:
                while await client.receive():
                    pass
            except (anyio.EndOfStream, anyio.BrokenResourceError, ConnectionError):
                pass
            hung_up.set()

    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    heartbeat = Heartbeat(
        api_url=f"http://127.0.0.1:{port}", worker_id=WORKER_ID, token=WORKER_TOKEN, timeout_s=600
    )
    async with listener, anyio.create_task_group() as server:
        server.start_soon(listener.serve, never_answer)
        with anyio.fail_after(30):  # far below the beat's 600 s timeout
            async with anyio.create_task_group() as worker:
                worker.start_soon(heartbeat.run, 0.01)
                await requested.wait()
                worker.cancel_scope.cancel()
            await hung_up.wait()
        server.cancel_scope.cancel()


@pytest.mark.anyio
async def test_run_survives_deo_being_down_and_reaches_it_once_it_is_up(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # deo's port, reserved but not yet listening: connections are refused.
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    heartbeat = Heartbeat(api_url=url, worker_id=WORKER_ID, token=WORKER_TOKEN)
    with caplog.at_level(logging.WARNING, logger="deo_worker.heartbeat"):
        async with anyio.create_task_group() as worker:
            worker.start_soon(heartbeat.run, 0.01)
            with anyio.fail_after(30):
                while not caplog.records:
                    await anyio.sleep(0.01)
            sock.listen()
            async with deo_api(tmp_path, sock=sock) as deo:
                deo.clock.t_s = 7.0
                await seen_at(deo, 7.0)
                with anyio.fail_after(30):  # the worker has its answer a moment after deo
                    while len(caplog.records) < 2:
                        await anyio.sleep(0.01)
                worker.cancel_scope.cancel()
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2, messages  # once when failing, once when working again
    assert "ConnectError" in messages[0] and "works again" in messages[1], messages


@pytest.mark.anyio
async def test_a_refused_or_unreachable_api_is_logged_once_and_never_raises(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async with deo_api(tmp_path) as deo:
        wrong = Heartbeat(api_url=deo.url, worker_id=WORKER_ID, token="not-the-token")
        with caplog.at_level(logging.WARNING, logger="deo_worker.heartbeat"):
            assert await wrong.beat_async() is False
            assert await wrong.beat_async() is False
        assert await deo.seen() == 0.0  # only the start
        [refused] = [r.getMessage() for r in caplog.records]
        assert "403" in refused and "/v1/workers/envs-0/heartbeat" in refused
    caplog.clear()
    nobody = Heartbeat(api_url=f"http://127.0.0.1:{free_port()}", worker_id="w", token="t")
    with caplog.at_level(logging.WARNING, logger="deo_worker.heartbeat"):
        assert await nobody.beat_async() is False
        assert nobody.beat() is False
    [unreachable] = [r.getMessage() for r in caplog.records]
    assert "ConnectError" in unreachable


# --- readiness -----------------------------------------------------------------------------------


def worker_environ(deo: Deo, token: str = WORKER_TOKEN) -> dict[str, str]:
    return {"DEO_API_URL": deo.url, "DEO_WORKER_ID": WORKER_ID, "DEO_WORKER_TOKEN": token}


@pytest.mark.anyio
async def test_a_ready_report_makes_a_starting_worker_active(tmp_path: Path) -> None:
    async with deo_api(tmp_path, require_ready=True) as deo:
        assert deo.runner.state.workers[WORKER_ID].state.value == "starting"
        assert await report_ready_async(worker_environ(deo)) is True
        assert deo.runner.state.workers[WORKER_ID].state.value == "active"
        # The blocking one, from a thread (this thread runs deo's server): a sign of life now.
        deo.clock.t_s = 2.0
        assert await anyio.to_thread.run_sync(report_ready, worker_environ(deo)) is True
        assert await deo.seen() == 2.0


@pytest.mark.anyio
async def test_a_ready_report_outside_deo_does_nothing_and_a_refused_one_is_false(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    assert await report_ready_async({}) is True  # not run by deo: nothing to tell
    assert report_ready({"DEO_API_URL": "http://127.0.0.1:1"}) is True
    async with deo_api(tmp_path, require_ready=True) as deo:
        with caplog.at_level(logging.WARNING, logger="deo_worker.ready"):
            refused = await report_ready_async(worker_environ(deo, "not-its-token"))
        assert refused is False
        [message] = [r.getMessage() for r in caplog.records]
        assert "403" in message
        assert deo.runner.state.workers[WORKER_ID].state.value == "starting"


@pytest.mark.anyio
async def test_a_ready_report_waits_for_deo_to_come_up(tmp_path: Path) -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    environ = {
        "DEO_API_URL": f"http://127.0.0.1:{sock.getsockname()[1]}",
        "DEO_WORKER_ID": WORKER_ID,
        "DEO_WORKER_TOKEN": WORKER_TOKEN,
    }
    answers: list[bool] = []

    async def report() -> None:
        answers.append(await report_ready_async(environ, timeout_s=60))

    async with anyio.create_task_group() as worker:
        worker.start_soon(report)
        await anyio.sleep(0.6)  # at least one refused connection first
        sock.listen()
        async with deo_api(tmp_path, sock=sock, require_ready=True) as deo:
            with anyio.fail_after(30):
                while deo.runner.state.workers[WORKER_ID].state.value != "active":
                    await anyio.sleep(0.05)
    assert answers == [True]
