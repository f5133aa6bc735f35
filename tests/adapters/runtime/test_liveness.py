"""Batched liveness: the bounds on how often a sighting is recorded, and sightings of workers
deo no longer has."""

from __future__ import annotations

import pytest

from adapters.runtime.liveness import UNJUDGED_REFRESH_S, Liveness
from core import UnknownSubject, WorkerExited, WorkersSeen
from tests.adapters.runtime.liveness_helpers import past_first_sightings, running

GRACE_S = 4.0


def test_a_sighting_waits_at_least_a_quarter_grace_whatever_the_tick() -> None:
    reducer, liveness = running(2, GRACE_S), Liveness()
    past_first_sightings(reducer, liveness)
    liveness.saw(reducer.state, "envs-0", 0.2)
    # Two ticks of 2 s would leave nothing of the 4 s grace: a quarter of it (1 s) is the floor.
    assert liveness.records(reducer.state, 0.5, 2.0) == []  # recorded at 0.0: 0.5 s < 1 s
    assert liveness.records(reducer.state, 1.0, 2.0) == [
        WorkersSeen(t=1.0, worker_ids={"envs-0"}, seen_t=1.0)  # rounded up, never past now
    ]
    assert liveness.records(reducer.state, 2.0, 2.0) == []  # nothing new since


def test_pools_that_judge_no_heartbeat_refresh_rarely() -> None:
    reducer, liveness = running(1, grace_s=None), Liveness()
    past_first_sightings(reducer, liveness)
    liveness.saw(reducer.state, "envs-0", 0.5)
    assert liveness.records(reducer.state, UNJUDGED_REFRESH_S - 1, 1.0) == []
    assert liveness.records(reducer.state, UNJUDGED_REFRESH_S, 1.0) != []


def test_a_first_sighting_is_recorded_at_the_next_tick_whatever_the_grace() -> None:
    reducer, liveness = running(2, grace_s=None), Liveness()
    liveness.saw(reducer.state, "envs-0", 2.3)  # came up 2.3 s after its start
    assert liveness.records(reducer.state, 3.0, 1.0) == [
        WorkersSeen(t=3.0, worker_ids={"envs-0"}, seen_t=3.0)
    ]
    liveness.saw(reducer.state, "envs-0", 3.5)  # later ones wait as long as the pool allows
    assert liveness.records(reducer.state, 4.0, 1.0) == []


def test_sightings_of_exited_workers_are_dropped_and_unknown_ones_refused() -> None:
    reducer, liveness = running(2, GRACE_S), Liveness()
    liveness.saw(reducer.state, "envs-1", 40.0)
    reducer.step(WorkerExited(t=50.0, worker_id="envs-1", exit_code=0))
    assert liveness.records(reducer.state, 60.0, 1.0) == []
    assert liveness.pending == frozenset()
    liveness.saw(reducer.state, "envs-1", 61.0)  # late: ignored, no error
    with pytest.raises(UnknownSubject, match="unknown worker 'envs-7'"):
        liveness.saw(reducer.state, "envs-7", 61.0)
