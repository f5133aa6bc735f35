"""``deo run`` serving the GPU arbiter, as a real process for end-to-end tests: its GPUs' health
comes from the NVML file backend (no GPUs needed), its API listens on a fixed port (a restart
keeps its address, so a client's retries reach it again) and its output is appended to one file
across restarts."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
from waiting import wait_for

from bench.ports import reserve_port, reserve_port_range

GPUS = ["0", "1", "2", "3"]
HEALTHY = {
    "memory_used_bytes": 2**30,
    "memory_total_bytes": 80 * 2**30,
    "temperature_c": 45,
    "throttle_reasons": [],
    "errors_total": 0,
}


def standin_engine_pool(name: str, engines: int, standin_args: list[str], **settings: float) -> str:
    """TOML for engine pool ``name``: up to ``engines`` stand-in engines (vLLM's routes), one GPU
    each and all of them allowed asleep, started only for the arbiter (its policy holds 0).
    ``standin_args`` go to each stand-in (memory, delays); ``settings`` are the pool's keys
    (timeouts, attempts)."""
    first = reserve_port_range(2 * engines).first
    argv = [sys.executable, "-m", "deo_worker.engine_standin", "--port", "{port}"]
    argv += ["--engine", "vllm", *standin_args]
    keys = "".join(f"{key} = {value}\n" for key, value in settings.items())
    return f"""[pools.{name}]
kind = "engine"
engine = "vllm"
argv = {json.dumps(argv)}
gpus_per_worker = 1
min_workers = 0
max_workers = {engines}
max_asleep = {engines}
ports = [{first}, {first + 2 * engines - 1}]
{keys}[pools.{name}.policy]
name = "static"
count = 0
"""


class ArbiterDeo:
    """``deo run`` with ``GPUS``, all healthy, of which ``arbiter_gpus`` are the arbiter's;
    ``extra_config`` is TOML appended to its config (pools, planner settings)."""

    def __init__(
        self,
        tmp_path: Path,
        token: str,
        arbiter_gpus: list[str] = GPUS,
        extra_config: str = "",
    ) -> None:
        self.dir = tmp_path
        self.token = token
        self.log = tmp_path / "run.jsonl"
        (tmp_path / "gpus.json").write_text(json.dumps({g: HEALTHY for g in GPUS}))
        self.port = reserve_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.config = tmp_path / "deo.toml"
        self.write_config(arbiter_gpus, extra_config)
        self.output = tmp_path / "deo.out"
        self.process: subprocess.Popen[bytes] | None = None

    #: deo's GPUs and where their health comes from: ``GPUS``, from the NVML file backend.
    GPU_SOURCE = f"""gpus = {json.dumps(GPUS)}
[nvml]
backend = "file"
file = "gpus.json"
interval_s = 0.5
"""

    def write_config(self, arbiter_gpus: list[str], extra_config: str = "") -> None:
        """Write deo's config, for the next start."""
        self.config.write_text(
            f"""
[api]
port = {self.port}
[deo]
log = "run.jsonl"
tick_interval_s = 0.2
{self.GPU_SOURCE}
[arbiter]
gpus = {json.dumps(arbiter_gpus)}
"""
            + extra_config
        )

    def start(self, *, refused: bool = False) -> None:
        """Start deo and wait until its API serves the arbiter; with ``refused``, a start whose
        configuration deo refuses (it exits without serving), so only start it."""
        before = self.starts()
        env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "adapters.cli", "run", "--config", str(self.config)],
            cwd=self.dir,
            env={**env, "DEO_TOKEN": self.token},
            stdout=self.output.open("ab"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        if refused:
            return
        wait_for("the API", lambda: self.starts() > before)
        # deo announces its API as the server task starts: the first answer may come a moment
        # later, and it has the arbiter (served only once the arbiter's GPUs are durable).
        assert wait_for("the arbiter", self.serves_arbiter, retry_on=(httpx.HTTPError,))

    def serves_arbiter(self) -> bool:
        """Whether deo's global status has an arbiter section yet."""
        status = httpx.get(f"{self.url}/global-status", timeout=5).json()
        return "arbiter" in status

    def starts(self) -> int:
        """How many times deo said where its API is (restarts append to the same output)."""
        if not self.output.exists():
            return 0
        return len(re.findall(r"API on http://", self.output.read_text()))

    def status(self) -> dict[str, Any]:
        """The arbiter section of deo's global status."""
        arbiter: dict[str, Any] = httpx.get(f"{self.url}/global-status", timeout=5).json()[
            "arbiter"
        ]
        return arbiter

    def kill(self) -> None:
        """SIGKILL deo and wait for it."""
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=20)

    def stop(self) -> int:
        """SIGTERM deo; its exit status."""
        assert self.process is not None
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=30)

    def stop_draining(self, timeout_s: float = 60.0) -> None:
        """``POST /v1/stop`` with a drain: deo drains every worker and exits 0."""
        stop = httpx.post(
            f"{self.url}/v1/stop",
            json={"drain": True},
            headers={"Authorization": f"Bearer {self.token}"},
            timeout=10,
        )
        assert stop.status_code == 200, stop.text
        assert self.process is not None
        assert self.process.wait(timeout=timeout_s) == 0

    def replays(self) -> None:
        """``deo replay`` of the log succeeds."""
        proc = subprocess.run(
            [sys.executable, "-m", "adapters.cli", "replay", "-q", str(self.log)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
