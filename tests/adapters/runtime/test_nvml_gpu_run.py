"""``deo run`` on a real GPU: NVML finds it, a worker allocates memory on it, deo sees that.

Runs only where an NVIDIA driver answers and this Python has a CUDA build of PyTorch (a worker
needs something that really takes GPU memory); everywhere else it is skipped, and the same paths
are covered by the readings-file tests (``test_nvml_run.py``, ``test_nvml_auto_run.py``).

What it checks, all against the driver: ``gpus = "auto"`` lists the GPUs NVML counts; the worker
deo starts sees exactly the one device deo gave it (``CUDA_VISIBLE_DEVICES``), and it is the GPU
deo names (NVML's UUID); deo's health readings show the worker's allocation as memory used, and
show it freed once deo drained the worker; ``tools/replay`` verifies the log.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from real_gpu import NEEDS_GPU, nvml_gpus
from test_nvml_run import GIB, Deo
from waiting import wait_for

pytestmark = NEEDS_GPU

#: What the worker allocates on its GPU.
ALLOCATION_BYTES = 2 * GIB

#: A worker that takes ALLOCATION_BYTES on the one device it sees, says what it sees, and exits
#: on deo's drain signal (SIGUSR1) or SIGTERM, freeing the memory.
GPU_WORKER = """
import json, os, signal, sys, time
import torch
report, size = sys.argv[1], int(sys.argv[2])
block = torch.ones(size, dtype=torch.uint8, device="cuda")
torch.cuda.synchronize()
properties = torch.cuda.get_device_properties(0)
partial = report + ".partial"
with open(partial, "w") as out:
    json.dump({
        "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "devices": torch.cuda.device_count(),
        "uuid": str(properties.uuid),
        "allocated": int(block.sum().item()),
    }, out)
os.replace(partial, report)
signal.signal(signal.SIGUSR1, lambda *_: sys.exit(0))
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
while True:
    time.sleep(0.1)
"""


def _same_gpu(nvml_uuid: str, torch_uuid: str) -> bool:
    """NVML writes ``GPU-<uuid>``, PyTorch the bare UUID."""
    return nvml_uuid.lower().removeprefix("gpu-") == torch_uuid.lower().removeprefix("gpu-")


def test_a_worker_on_a_real_gpu_is_seen_by_nvml_and_its_memory_freed_after_a_drain(
    tmp_path: Path,
) -> None:
    gpus = nvml_gpus()
    baseline = {g["index"]: g["used"] for g in gpus}
    script = tmp_path / "gpu_worker.py"
    script.write_text(GPU_WORKER)
    report = tmp_path / "worker.json"
    deo = Deo(tmp_path)
    argv = json.dumps([sys.executable, str(script), str(report), str(ALLOCATION_BYTES)])
    config = deo.config.read_text()
    for old, new in (
        ('gpus = ["0", "1", "2"]', 'gpus = "auto"'),
        ('backend = "file"\nfile = "gpus.json"', 'backend = "pynvml"'),
        ("keepalive_s = 1.0", "keepalive_s = 0.5"),
        ("max_workers = 2", "max_workers = 1"),
        ("count = 2", "count = 1"),
    ):
        assert old in config, old
        config = config.replace(old, new)
    config = "\n".join(
        f"argv = {argv}" if line.startswith("argv = ") else line for line in config.splitlines()
    )
    deo.config.write_text(config)
    try:
        deo.start()
        [configured] = [
            r["event"]
            for r in deo.records()
            if r["kind"] == "event" and r["event"]["@"] == "Configured"
        ]
        assert configured["config"]["gpus"] == [g["index"] for g in gpus]

        [worker] = wait_for("the worker active", lambda: deo.workers("active"))
        seen = wait_for(
            "the worker's report", lambda: report.exists() and json.loads(report.read_text())
        )
        [gpu] = worker["gpus"]
        assert seen["devices"] == 1, seen  # CUDA_VISIBLE_DEVICES isolates it
        assert seen["allocated"] == ALLOCATION_BYTES, seen
        [nvml_gpu] = [g for g in gpus if g["index"] == gpu]
        assert _same_gpu(nvml_gpu["uuid"], seen["uuid"]), (nvml_gpu, seen)

        # deo's own readings (its NVML source, through its API) show the allocation...
        used = wait_for(
            "deo reading the worker's memory",
            lambda: (
                (u := deo.gpus()[gpu]["memory_used_bytes"]) >= baseline[gpu] + ALLOCATION_BYTES
                and u
            ),
        )
        assert used <= deo.gpus()[gpu]["memory_total_bytes"]
        # ...and, once deo drained the worker, the memory back.
        response = deo.post("/v1/pools/envs/pin", {"count": 0})
        assert response.status_code == 200, response.text
        wait_for("the worker gone", lambda: not deo.workers())
        wait_for(
            "deo reading the memory freed",
            lambda: deo.gpus()[gpu]["memory_used_bytes"] < baseline[gpu] + ALLOCATION_BYTES // 2,
        )
        samples = deo.samples(gpu)
        assert max(s["memory_used_bytes"] for s in samples) >= baseline[gpu] + ALLOCATION_BYTES
        deo.verified()
    finally:
        deo.cleanup()
