"""The GPU arbiter on a real GPU: a training request preempts generation, and NVML shows the
engine's GPU memory freed before the grant and taken back after the release.

Runs only where a GPU, its driver and PyTorch with CUDA are here (``real_gpu.NEEDS_GPU``); the
same run with stand-in memory on the host and the NVML file backend is
``test_arbiter_engines_run.py``, which runs everywhere. Here ``deo run`` finds the GPU itself
(``gpus = "auto"``), reads its health from the real NVML, and runs pipeline p1's generation on
one stand-in engine holding ``MEMORY_MIB`` on the GPU (``--memory-on gpu``); pipeline p2's
training loop asks for the same GPU through ``deo_worker.arbiter_client``.
"""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path
from typing import Any

import httpx
from arbiter_deo import ArbiterDeo, standin_engine_pool
from real_gpu import NEEDS_GPU, used_bytes
from waiting import wait_for

from deo_worker.arbiter_client import ArbiterClient, Cluster

pytestmark = NEEDS_GPU

TOKEN = "arbiter-gpu-token"
MEMORY_MIB = 4096
#: A freed or taken allocation shows as at least this much of it (allocator rounding aside).
SEEN_BYTES = MEMORY_MIB * 2**20 * 9 // 10


class Deo(ArbiterDeo):
    """``deo run`` on this machine's GPU 0, read through NVML, with one stand-in engine on it."""

    # A reading goes to the log once it moves by 1% of the GPU's memory (the engine's 4 GiB is 3%
    # of an H200's), and every second regardless.
    GPU_SOURCE = """gpus = "auto"
[nvml]
backend = "pynvml"
interval_s = 0.2
memory_tolerance = 0.01
keepalive_s = 1.0
"""

    def __init__(self, tmp_path: Path) -> None:
        pools = standin_engine_pool(
            "gen",
            engines=1,
            standin_args=["--memory-mib", str(MEMORY_MIB), "--memory-on", "gpu"],
            drain_timeout_s=5.0,
            start_timeout_s=120.0,
            control_timeout_s=60.0,
            stop_timeout_s=5.0,
        )
        super().__init__(tmp_path, TOKEN, arbiter_gpus=["0"], extra_config=pools)

    def engine(self) -> dict[str, Any]:
        [worker] = httpx.get(f"{self.url}/v1/workers", timeout=10).json()["workers"]
        return dict(worker)

    def used_bytes(self) -> int:
        """GPU 0's memory used, as deo's NVML source last read it."""
        gpus = httpx.get(f"{self.url}/global-status", timeout=10).json()["gpus"]
        [gpu] = [g for g in gpus if g["id"] == "0"]
        return int(gpu["memory_used_bytes"] or 0)  # None until its first reading


def test_a_training_grant_comes_once_the_engines_gpu_memory_is_free(tmp_path: Path) -> None:
    baseline = used_bytes("0")
    deo = Deo(tmp_path)
    deo.start()
    pid: int | None = None
    try:
        p1 = ArbiterClient(deo.url, TOKEN, pipeline="p1", poll_s=1.0)
        p2 = ArbiterClient(deo.url, TOKEN, pipeline="p2", poll_s=1.0)
        p1.register([Cluster("gen", "GENERATION", ["0"], engine_pool="gen")])
        p2.register([Cluster("train", "ACTOR_TRAINING", ["0"])])
        p1.open_rollout()
        p1.progress("rollout", 256, 0)
        assert p1.request("gen", "GENERATION", deadline_s=180).gpus == ("0",)
        engine = wait_for(
            "the engine awake", lambda: (found := deo.engine())["state"] == "active" and found
        )
        pid = int(engine["pid"])
        awake = wait_for(
            "deo reading the engine's memory",
            lambda: (used := deo.used_bytes()) >= baseline + SEEN_BYTES and used,
        )

        # Training preempts generation: the grant comes once the engine's sleep freed the GPU.
        grant = p2.request("train", "ACTOR_TRAINING", deadline_s=180)
        assert grant.gpus == ("0",)
        assert used_bytes("0") <= awake - SEEN_BYTES  # freed before the grant, as NVML sees it
        asleep = deo.engine()
        assert (asleep["id"], asleep["pid"], asleep["state"]) == (engine["id"], pid, "sleeping")
        wait_for("deo reading the memory freed", lambda: deo.used_bytes() <= awake - SEEN_BYTES)

        # Released: p1's rollout is open, so the same engine wakes and takes its memory back.
        p2.release("train")
        wait_for("the engine awake again", lambda: deo.engine()["state"] == "active")
        assert deo.engine()["pid"] == pid
        wait_for("deo reading the memory taken back", lambda: deo.used_bytes() >= awake - 2**28)
        p1.close()
        p2.close()
        deo.stop_draining(timeout_s=120)
        wait_for("the GPU memory back to its baseline", lambda: used_bytes("0") < baseline + 2**28)
        deo.replays()
    finally:
        if deo.process is not None and deo.process.poll() is None:
            deo.kill()
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
