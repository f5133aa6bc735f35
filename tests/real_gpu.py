"""Whether this machine has a real GPU for the tests that need one, and what NVML says of it.

Those tests need an NVIDIA driver (NVML answers) and a Python with a CUDA build of PyTorch (a
worker that really takes GPU memory); everywhere else they are skipped with ``NEEDS_GPU``.
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pynvml
import pytest


def nvml_gpus() -> list[dict[str, Any]]:
    """Every GPU NVML counts: index, UUID and memory used (empty without a driver)."""
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return []
    try:
        found = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            uuid = pynvml.nvmlDeviceGetUUID(handle)
            found.append(
                {
                    "index": str(index),
                    "uuid": uuid.decode() if isinstance(uuid, bytes) else uuid,
                    "used": pynvml.nvmlDeviceGetMemoryInfo(handle).used,
                }
            )
        return found
    finally:
        pynvml.nvmlShutdown()


def used_bytes(index: str) -> int:
    """GPU ``index``'s memory used, as NVML reads it now."""
    [gpu] = [g for g in nvml_gpus() if g["index"] == index]
    used: int = gpu["used"]
    return used


def cuda_torch() -> bool:
    """This Python has PyTorch with a CUDA device (asked in a child: CUDA stays out of pytest)."""
    probe = "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"
    try:
        return subprocess.run([sys.executable, "-c", probe], timeout=120).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


#: Skips a test unless this machine has a GPU that NVML reads and PyTorch can allocate on.
NEEDS_GPU = pytest.mark.skipif(
    not nvml_gpus() or not cuda_torch(),
    reason="needs an NVIDIA driver and PyTorch with CUDA (a real GPU)",
)
