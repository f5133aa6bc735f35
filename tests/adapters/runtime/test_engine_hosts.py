"""Where deo reaches an engine: its executor's address for it, and a URL for that address."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import anyio
import pytest

from adapters.runtime.engine_hosts import (
    LOCAL_ENGINE_HOST,
    ExecutorHosts,
    LocalEngineHosts,
    base_url,
)
from adapters.runtime.engines import engine_url


@pytest.mark.parametrize(
    ("host", "url"),
    [
        ("127.0.0.1", "http://127.0.0.1:8000"),
        ("10.0.3.7", "http://10.0.3.7:8000"),
        ("node-7.cluster", "http://node-7.cluster:8000"),
        ("fd00::7", "http://[fd00::7]:8000"),
        ("[fd00::7]", "http://[fd00::7]:8000"),
    ],
)
def test_an_engines_url_names_its_host(host: str, url: str) -> None:
    assert base_url(host, 8000) == url
    assert engine_url(8000, host) == url


def test_engines_on_deos_machine_are_on_loopback_and_their_ports_checked_here() -> None:
    hosts = LocalEngineHosts()
    assert hosts.engine_host("gen-0") == LOCAL_ENGINE_HOST == "127.0.0.1"
    assert engine_url(8000) == "http://127.0.0.1:8000"

    async def owned(port: int, pid: int) -> bool | None:
        return await hosts.engine_port_owned("gen-0", port, pid)

    other = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True
    )
    try:
        with socket.socket() as listening:
            listening.bind(("127.0.0.1", 0))
            listening.listen()
            port = listening.getsockname()[1]
            assert anyio.run(owned, port, os.getpid()) is True
            assert anyio.run(owned, port, other.pid) is False  # another process's session
    finally:
        other.kill()
        other.wait()


class _Elsewhere:
    """An executor whose engines all run on one other machine, and whose checks fail."""

    def engine_host(self, worker_id: str) -> str | None:
        return None if worker_id == "gen-9" else "10.0.0.5"

    async def engine_port_owned(self, worker_id: str, port: int, pid: int) -> bool | None:
        raise RuntimeError("its node cannot be asked now")


def test_deo_run_asks_the_executor_it_chose() -> None:
    hosts = ExecutorHosts()
    assert hosts.engine_host("gen-0") == "127.0.0.1"  # before the executor is chosen: local
    hosts.use(_Elsewhere())
    assert hosts.engine_host("gen-0") == "10.0.0.5"
    assert hosts.engine_host("gen-9") is None

    async def owned() -> bool | None:
        return await hosts.engine_port_owned("gen-0", 8000, 1)

    with pytest.raises(RuntimeError, match="cannot be asked"):
        anyio.run(owned)
