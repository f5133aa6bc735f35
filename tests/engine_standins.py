"""Stand-in engines (deo_worker.engine_standin) as real processes, for tests of engine pools."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from types import TracebackType

import httpx
from spawned import stop_process
from waiting import wait_for

from bench.ports import reserve_port

REPO = Path(__file__).resolve().parents[1]
START_DEADLINE_S = 60.0


def rss_bytes(pid: int) -> int:
    """Resident memory of process ``pid`` (a stand-in's weights and KV cache live there)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


class Standin:
    """One ``python -m deo_worker.engine_standin`` process on a free loopback port."""

    def __init__(
        self,
        engine: str = "vllm",
        *,
        memory_mib: int = 16,
        tokens_per_s: float = 200.0,
        max_concurrency: int = 16,
        startup_s: float = 0.0,
        port: int | None = None,
        control_delay_s: float = 0.0,
    ) -> None:
        self.engine = engine
        self.port = port or reserve_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.argv = [
            sys.executable,
            "-m",
            "deo_worker.engine_standin",
            "--port",
            str(self.port),
            "--engine",
            engine,
            "--memory-mib",
            str(memory_mib),
            "--tokens-per-s",
            str(tokens_per_s),
            "--max-concurrency",
            str(max_concurrency),
            "--startup-s",
            str(startup_s),
            "--control-delay-s",
            str(control_delay_s),
        ]
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, wait: bool = True) -> Standin:
        env = dict(os.environ)
        env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
        self.proc = subprocess.Popen(self.argv, env=env, cwd=REPO)
        if wait:
            self.wait_healthy()
        return self

    def wait_healthy(self, deadline_s: float = START_DEADLINE_S) -> None:
        def healthy() -> bool:
            assert self.proc is not None and self.proc.poll() is None, "the stand-in exited"
            return httpx.get(self.url + "/health", timeout=5).status_code == 200

        wait_for(
            f"the stand-in on {self.url} to be healthy",
            healthy,
            deadline_s,
            interval_s=0.05,
            retry_on=(httpx.TransportError,),
        )

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def rss_bytes(self) -> int:
        return rss_bytes(self.pid)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc, grace_s=30.0)

    def __enter__(self) -> Standin:
        return self.start()

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
