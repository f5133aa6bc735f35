"""adapters.runtime.port_owner against real sockets and processes, and EngineControl refusing to
take another program's server on an engine's port for the engine."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator

import anyio
import pytest
from engine_standins import Standin

from adapters.runtime.engines import EngineControl
from adapters.runtime.port_owner import listening_inodes, port_held_by
from core import Config, Configured, Event, PolicySpec, PoolSpec, Reducer, State, WorkerStarted

DEADLINE_S = 60.0


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def other_process() -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    yield proc
    proc.kill()
    proc.wait(timeout=30)


def test_a_listening_socket_is_found_held_by_its_process_and_no_other(
    other_process: subprocess.Popen[bytes],
) -> None:
    if not os.path.exists("/proc/net/tcp"):
        pytest.skip("no /proc/net/tcp on this system")
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        assert len(listening_inodes(port)) == 1
        assert port_held_by(port, os.getpid()) is True
        assert port_held_by(port, other_process.pid) is False
    assert port_held_by(port, os.getpid()) is None  # nothing listens: unknown


@pytest.mark.anyio
async def test_a_server_of_another_process_on_the_engine_port_is_never_taken_as_ready(
    other_process: subprocess.Popen[bytes],
) -> None:
    if not os.path.exists("/proc/net/tcp"):
        pytest.skip("no /proc/net/tcp on this system")
    # The stand-in answers /health on the engine's port, but the engine is another process.
    with Standin("sglang", memory_mib=8) as foreign:
        spec = PoolSpec(
            name="gen",
            kind="engine",
            engine="sglang",
            argv=["serve", "--port", "{port}"],
            ports=(foreign.port, foreign.port),
            max_workers=1,
            policy=PolicySpec(name="static", params={"count": 1}),
        )
        reducer = Reducer()
        reducer.step(Configured(t=0.0, config=Config(pools=[spec])))
        started = WorkerStarted(t=0.5, worker_id="gen-0", pid=other_process.pid, start_time=1)
        reducer.step(started)
        events: list[Event] = []
        rounds = 0

        def state() -> State:
            nonlocal rounds
            rounds += 1
            return reducer.state

        control = EngineControl(
            events.append, clock=lambda: 1.0, state=state, health_interval_s=0.05
        )
        with anyio.fail_after(DEADLINE_S):
            async with anyio.create_task_group() as tg:
                tg.start_soon(control.run)
                while rounds < 20:  # many /health answers, each from the foreign server
                    await anyio.sleep(0.02)
                tg.cancel_scope.cancel()
        assert events == []  # the engine's own server is ready: test_engine_control.py
