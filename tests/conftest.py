"""Fixtures shared across the test tree: a real atroposlib trajectory API server, a Ray cluster."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from hypothesis import settings
from last_use import (  # the hooks end the Ray cluster after its last test
    LastUse,
    pytest_collection_finish,
    pytest_runtest_teardown,
    pytest_sessionfinish,
)
from spawned import stop_process
from waiting import wait_for

from adapters.log import SIMULATED
from adapters.sim.driver import simulate
from adapters.sim.scenario import EnvPool, Fault, Scenario

REPO = Path(__file__).resolve().parents[1]

#: `pytest --hypothesis-profile=ci-long` explores the property tests further than a default run.
settings.register_profile("ci-long", max_examples=150)


def write_simulated_log(path: Path) -> None:
    """A realistic event log: 15 simulated minutes of an Atropos-style loop, a worker crash.
    Its header is a real run's (without the simulator's mark), so that ``deo run``'s recovery
    and restart, which refuse a simulated run's log, can be tested on it."""
    scenario = Scenario(
        name="log-fixture",
        duration_s=900.0,
        seed=7,
        pools=(EnvPool(name="envs", max_workers=24, gpus_per_worker=0, startup_s=5.0),),
        faults=(Fault(kind="worker_crash", at_s=200),),
    )
    simulate(scenario, log_path=path)
    header, rest = path.read_bytes().split(b"\n", 1)
    fields = orjson.loads(header)
    assert fields.pop("world") == SIMULATED
    path.write_bytes(orjson.dumps(fields) + b"\n" + rest)


def deo_command() -> tuple[list[str], dict[str, str]]:
    """The installed `deo` console script, or the same entry point through this Python."""
    env = dict(os.environ)
    script = Path(sys.executable).with_name("deo")
    if script.exists():
        return [str(script)], env
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    code = "import sys; from adapters.cli import main; sys.exit(main())"
    return [sys.executable, "-c", code], env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class AtroposApi:
    """atroposlib's API server (`run-api`) as a real process on a loopback port."""

    def __init__(self, log_path: Path, port: int | None = None) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> AtroposApi:
        argv = [sys.executable, "-m", "uvicorn", "atroposlib.api.server:app"]
        argv += ["--host", "127.0.0.1", "--port", str(self.port), "--log-level", "warning"]
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        proc = self.proc

        def answers() -> bool:
            assert proc.poll() is None, "the atroposlib API server exited"
            httpx.get(self.url + "/status", timeout=1).raise_for_status()
            return True

        try:
            wait_for("the atroposlib API server", answers, retry_on=(httpx.HTTPError,))
        except AssertionError as error:
            raise AssertionError(f"{error}: {self.log_path.read_text()}") from None
        return self

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)
        self.proc = None

    def register_trainer(self, batch_size_seqs: int) -> None:
        """POST /register as a trainer would, then GET /batch once (that lets envs register)."""
        body = {
            "wandb_group": "test",
            "wandb_project": "test",
            "batch_size": batch_size_seqs,
            "max_token_len": 64,
            "checkpoint_dir": "",
            "save_checkpoint_interval": 0,
            "starting_step": 0,
            "num_steps": 1000,
        }
        httpx.post(self.url + "/register", json=body, timeout=30).raise_for_status()
        httpx.get(self.url + "/batch", timeout=30).raise_for_status()


@pytest.fixture
def atropos_api(tmp_path: Path) -> Iterator[AtroposApi]:
    api = AtroposApi(tmp_path / "atropos-api.log").start()
    try:
        yield api
    finally:
        api.stop()


def _start_ray_cluster() -> Any:
    from test_ray import RayCluster

    return RayCluster()


#: The Ray cluster of the run, shared by every test that asks for ``ray_cluster``.
RAY_CLUSTER: LastUse[Any] = LastUse("ray_cluster", _start_ray_cluster, lambda c: c.shutdown())


@pytest.fixture
def ray_cluster() -> Any:
    """A Ray cluster of several nodes on this machine (``test_ray.RayCluster``), started once for
    every Ray test of the run (Ray's start-up is slow) and shut down after the last of them, so
    that it does not stay up through the rest of the suite. Only the tests that ask for it import
    Ray."""
    return RAY_CLUSTER.get()


__all__ = ["pytest_collection_finish", "pytest_runtest_teardown", "pytest_sessionfinish"]
