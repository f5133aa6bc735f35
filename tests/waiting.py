"""Waiting on a condition in tests: poll until true, with a deadline that is only a safety net.

A test never waits a fixed time: it polls for the state it needs. The deadline is far beyond
what a passing run needs on a loaded machine, so a slow box makes a test slower, not red.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

#: The default deadline: generous, because the suite runs on busy 2-core machines.
DEADLINE_S = 60.0


def wait_for(
    what: str,
    check: Callable[[], T],
    timeout_s: float = DEADLINE_S,
    *,
    interval_s: float = 0.1,
    retry_on: tuple[type[BaseException], ...] = (),
    between: Callable[[], Any] | None = None,
) -> T:
    """Call ``check`` until it returns something true and return that value.

    ``retry_on`` names exceptions that mean "not yet" (a server still starting); ``between``
    runs before each check (for example to advance a simulated clock). Raises AssertionError
    naming ``what`` when ``timeout_s`` passes.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        if between is not None:
            between()
        try:
            value = check()
        except retry_on:
            pass
        else:
            if value:
                return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(interval_s)
