"""Batched liveness: sightings recorded once a tick, only as often as the grace needs."""

from __future__ import annotations

import random
from typing import Any

import pytest

from adapters.runtime.liveness import UNJUDGED_REFRESH_S, Liveness
from core import (
    Config,
    Configured,
    PolicySpec,
    PoolSpec,
    Reducer,
    TerminateWorker,
    Tick,
    UnknownSubject,
    WorkerExited,
    WorkersSeen,
    WorkerStarted,
)

GRACE_S = 4.0


def running(count: int, grace_s: float | None = GRACE_S) -> Reducer:
    spec = PoolSpec(
        name="envs",
        argv=["w"],
        max_workers=count,
        heartbeat_grace_s=grace_s,
        policy=PolicySpec(name="static", params={"count": count}),
    )
    reducer = Reducer(check_invariants=True)
    reducer.step(Configured(t=0.0, config=Config(pools=[spec])))
    for k in range(count):
        reducer.step(WorkerStarted(t=0.0, worker_id=f"envs-{k}", pid=100 + k, start_time=k))
    return reducer


def test_a_sighting_is_recorded_once_the_record_is_a_quarter_grace_old() -> None:
    reducer, liveness = running(2), Liveness()
    liveness.saw(reducer.state, "envs-0")
    assert liveness.due(reducer.state, 0.5) is None  # recorded at 0.0: 0.5 s < 1 s
    seen = liveness.due(reducer.state, 1.0)
    assert seen == WorkersSeen(t=1.0, worker_ids={"envs-0"})
    assert liveness.due(reducer.state, 2.0) is None  # nothing new since


def test_pools_that_judge_no_heartbeat_refresh_rarely() -> None:
    reducer, liveness = running(1, grace_s=None), Liveness()
    liveness.saw(reducer.state, "envs-0")
    assert liveness.due(reducer.state, UNJUDGED_REFRESH_S - 1) is None
    assert liveness.due(reducer.state, UNJUDGED_REFRESH_S) is not None


def test_sightings_of_exited_workers_are_dropped_and_unknown_ones_refused() -> None:
    reducer, liveness = running(2), Liveness()
    liveness.saw(reducer.state, "envs-1")
    reducer.step(WorkerExited(t=50.0, worker_id="envs-1", exit_code=0))
    assert liveness.due(reducer.state, 60.0) is None
    liveness.saw(reducer.state, "envs-1")  # late: ignored, no error
    with pytest.raises(UnknownSubject, match="unknown worker 'envs-7'"):
        liveness.saw(reducer.state, "envs-7")


def simulate(seed: int, beat_s: float, stops: dict[str, float]) -> dict[str, Any]:
    """Workers beat every ``beat_s`` (jittered) until their time in ``stops``; deo ticks every
    second, recording through :class:`Liveness`. Returns when each worker was found hung and how
    many ids were recorded."""
    rng = random.Random(seed)
    reducer, liveness = running(8), Liveness()
    next_beat = {w: rng.uniform(0, beat_s) for w in reducer.state.workers}
    hung: dict[str, float] = {}
    recorded = 0
    t = 0.0
    for _ in range(120):
        tick_t = t + 1.0
        for worker_id in sorted(next_beat):
            while next_beat[worker_id] <= tick_t:
                if next_beat[worker_id] < stops.get(worker_id, float("inf")):
                    liveness.saw(reducer.state, worker_id)
                next_beat[worker_id] += beat_s * rng.uniform(0.8, 1.2)
        t = tick_t
        seen = liveness.due(reducer.state, t)
        if seen is not None:
            recorded += len(seen.worker_ids)
            reducer.step(seen)
        for command in reducer.step(Tick(t=t, interval_s=1.0)):
            if isinstance(command, TerminateWorker):
                hung[command.worker_id] = t
    return {"hung": hung, "recorded": recorded}


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("beat_s", [0.3, 1.0, 2.5])
def test_batching_blames_no_beating_worker_and_still_finds_the_silent_one(
    seed: int, beat_s: float
) -> None:
    result = simulate(seed, beat_s, stops={"envs-3": 40.0})
    assert set(result["hung"]) == {"envs-3"}
    # Not before it was silent for its grace (its last beat was within one interval before it
    # stopped), and late by at most a quarter grace of record resolution and a tick or two.
    assert 40.0 - 1.2 * beat_s + GRACE_S < result["hung"]["envs-3"] <= 40.0 + GRACE_S * 1.25 + 2.0
    # One id per worker per quarter grace (1 s) at most, whatever the heartbeat rate.
    assert result["recorded"] <= 8 * 120
