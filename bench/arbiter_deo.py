"""A real ``deo run`` serving the GPU arbiter over pools of stand-in engines, for the arbiter
benchmarks (``bench.arbiter_run``, ``bench.arbiter_tenancy_run``).

GPU health comes from the NVML file backend (no GPU needed); each engine is
``deo_worker.engine_standin``, a real process holding touched memory that a sleep frees.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import attrs
import httpx

from bench.polling import wait_until
from bench.ports import reserve_port, reserve_port_range

TOKEN = "arbiter-bench-token"
HEALTHY = {
    "memory_used_bytes": 2**30,
    "memory_total_bytes": 80 * 2**30,
    "temperature_c": 45,
    "throttle_reasons": [],
    "errors_total": 0,
}


def engine_pool(name: str, *, engines: int, ports: int, memory_mib: int, drain_s: float) -> str:
    """The TOML of an engine pool of up to ``engines`` stand-ins of ``memory_mib``, one GPU
    each, on ``ports`` reserved loopback ports; started and stopped by the arbiter only."""
    first = reserve_port_range(ports).first
    argv = [sys.executable, "-m", "deo_worker.engine_standin", "--port", "{port}"]
    argv += ["--engine", "vllm", "--memory-mib", str(memory_mib)]
    return f"""
[pools.{name}]
kind = "engine"
engine = "vllm"
argv = {json.dumps(argv)}
gpus_per_worker = 1
max_workers = {engines}
max_asleep = {engines}
ports = [{first}, {first + ports - 1}]
drain_timeout_s = {drain_s}
control_timeout_s = 30
[pools.{name}.policy]
name = "static"
count = 0
"""


@attrs.define
class ArbiterDeo:
    """A running ``deo run``: its URL, and the engine pids seen (killed if left at the end)."""

    url: str
    pids: set[int] = attrs.field(factory=set)


@contextlib.contextmanager
def arbiter_deo(prefix: str, gpus: list[str], pools: str) -> Iterator[ArbiterDeo]:
    """``deo run`` in a temporary directory with ``[arbiter]`` over ``gpus`` and ``pools``
    (TOML), once its arbiter answers; stopped with a drain when the block ends normally, and
    whatever is left of it killed in any case."""
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        workdir = Path(tmp)
        port = reserve_port()
        (workdir / "gpus.json").write_text(json.dumps({g: HEALTHY for g in gpus}))
        config = workdir / "deo.toml"
        config.write_text(
            f"""
[deo]
log = "run.jsonl"
fsync = false
tick_interval_s = 0.1
gpus = {json.dumps(gpus)}
[api]
port = {port}
[nvml]
backend = "file"
file = "gpus.json"
[arbiter]
gpus = {json.dumps(gpus)}
"""
            + pools
        )
        env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
        proc = subprocess.Popen(
            [sys.executable, "-m", "adapters.cli", "run", "--config", str(config)],
            cwd=workdir,
            env={**env, "DEO_TOKEN": TOKEN},
            stdout=(workdir / "deo.out").open("wb"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deo = ArbiterDeo(f"http://127.0.0.1:{port}")
        try:
            wait_until(
                "deo's arbiter",
                lambda: "arbiter" in httpx.get(f"{deo.url}/global-status", timeout=5).json(),
            )
            yield deo
            httpx.post(
                f"{deo.url}/v1/stop",
                json={"drain": True},
                headers={"Authorization": f"Bearer {TOKEN}"},
                timeout=10,
            )
            proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                proc.wait(timeout=20)
            for pid in deo.pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
