"""Processes a test started: whether one is alive, and finding them by a marker in their
environment.

Every ``deo run`` a test starts passes ``TEST_DEO_MARKER=<marker>`` on to its workers, so the
test's clean-up finds each process it made (deo, workers, their children), whatever happened.
"""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path

MARKER_ENV = "TEST_DEO_MARKER"


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, ended but not yet reaped, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def marked_processes(marker: str) -> list[int]:
    """The pids whose environment holds ``TEST_DEO_MARKER=<marker>``."""
    mark = f"{MARKER_ENV}={marker}".encode()
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if mark in Path(entry.path, "environ").read_bytes().split(b"\0"):
                    found.append(int(entry.name))
    return found


def kill_marked(marker: str) -> None:
    """SIGKILL every marked process and its process group (resumed first if it was stopped)."""
    for pid in marked_processes(marker):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGCONT)
            os.killpg(pid, signal.SIGKILL)
