"""A costly resource shared by the tests that ask for one fixture, and ended after the last of
them in the run, not at the end of the session (so that its processes do not stay up, taking CPU
and memory, through every test that follows).

The fixture stays function-scoped and hands out the one shared resource. A conftest imports the
hooks below (``pytest_collection_finish``, ``pytest_runtest_teardown``, ``pytest_sessionfinish``),
which end every :class:`LastUse` made in the process at the right time.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from typing import Any, Generic, TypeVar

import pytest

T = TypeVar("T")


class LastUse(Generic[T]):
    """``start()`` on the first :meth:`get`, ``stop(resource)`` after the last test of the run
    that uses ``fixture`` (or at the end of the session, whichever comes first)."""

    def __init__(self, fixture: str, start: Callable[[], T], stop: Callable[[T], None]) -> None:
        self.fixture = fixture
        self._start = start
        self._stop = stop
        self._resource: T | None = None
        self._last: pytest.Item | None = None
        self.starts = 0
        _ALL.append(self)

    def get(self) -> T:
        """The shared resource, started now if it is not up."""
        if self._resource is None:
            self._resource = self._start()
            self.starts += 1
        return self._resource

    def collected(self, items: Sequence[pytest.Item]) -> None:
        """Note the last of the run's ``items`` (after selection) that uses the fixture."""
        users = [item for item in items if self.fixture in getattr(item, "fixturenames", ())]
        self._last = users[-1] if users else None

    def after(self, item: pytest.Item) -> None:
        """Called after ``item``'s teardown: the resource ends if no later test uses it."""
        if item is self._last:
            self.close()

    def close(self) -> None:
        """End the resource if it is up (a later :meth:`get` starts another)."""
        resource, self._resource = self._resource, None
        if resource is not None:
            self._stop(resource)


_ALL: list[LastUse[Any]] = []


def pytest_collection_finish(session: pytest.Session) -> None:
    for resource in _ALL:
        resource.collected(session.items)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Generator[None, None, None]:
    try:
        return (yield)  # the test's own fixtures end first (they may still use the resource)
    finally:
        for resource in _ALL:
            resource.after(item)


def pytest_sessionfinish(session: pytest.Session) -> None:
    for resource in _ALL:
        resource.close()  # a run stopped early (-x, ^C)
