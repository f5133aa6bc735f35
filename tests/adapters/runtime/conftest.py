"""Fixtures shared by the runtime tests: one Ray cluster for every Ray test module of a session."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[Any]:
    """A Ray cluster of several nodes on this machine (``test_ray.RayCluster``), started once:
    Ray's start-up is slow. Ray is imported only by the modules that ask for it."""
    from test_ray import RayCluster

    started = RayCluster()
    try:
        yield started
    finally:
        started.shutdown()
