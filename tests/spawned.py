"""Processes a test started: whether one is alive, and finding them by a marker in their
environment.

Every ``deo run`` a test starts passes ``TEST_DEO_MARKER=<marker>`` on to its workers, so the
test's clean-up finds each process it made (deo, workers, their children), whatever happened.
The /proc readers are the soak benchmark's (bench/soak.py), which finds its runs the same way.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess

from bench.soak import alive, processes_with

__all__ = ["MARKER_ENV", "alive", "kill_marked", "marked_processes", "stop_process"]

MARKER_ENV = "TEST_DEO_MARKER"


def marked_processes(marker: str) -> list[int]:
    """The pids whose environment holds ``TEST_DEO_MARKER=<marker>``."""
    return processes_with([f"{MARKER_ENV}={marker}"])


def kill_marked(marker: str) -> None:
    """SIGKILL every marked process and its process group (resumed first if it was stopped)."""
    for pid in marked_processes(marker):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGCONT)
            os.killpg(pid, signal.SIGKILL)


def stop_process(proc: subprocess.Popen[bytes], grace_s: float = 60.0) -> None:
    """SIGTERM ``proc`` and reap it; SIGKILL it if it has not exited within ``grace_s`` (a
    server's graceful shutdown waits for its open connections, slowly on a loaded machine)."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=30)
