"""Waiting on a running ``deo run`` from a benchmark, and reading its processes' memory."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import httpx

T = TypeVar("T")


def wait_until(what: str, check: Callable[[], T | None], timeout_s: float = 300.0) -> T:
    """Poll ``check`` until it returns something true (an HTTP error counts as not yet) and
    return that; exit the benchmark naming ``what`` if ``timeout_s`` passes first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            value = check()
        except httpx.HTTPError:
            value = None
        if value:
            return value
        time.sleep(0.02)
    raise SystemExit(f"timed out waiting for {what}")


def rss_bytes(pid: int) -> int:
    """Resident memory of ``pid`` (``VmRSS``); 0 where /proc has none (a zombie)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0
