"""Sightings recorded as rarely as the grace allows, with the time each was made: a silent worker
is judged hung within a tick of its real deadline, at a fraction of the log's ids."""

from __future__ import annotations

import random
from typing import Any

import pytest

from adapters.runtime.liveness import Liveness
from core import InvalidEvent, TerminateWorker, Tick, WorkersSeen
from tests.adapters.runtime.liveness_helpers import past_first_sightings, running

GRACE_S = 20.0
TICK_S = 1.0


def test_a_sighting_waits_until_the_record_is_nearly_a_grace_old_and_keeps_its_time() -> None:
    reducer, liveness = running(2, GRACE_S), Liveness()
    past_first_sightings(reducer, liveness)
    liveness.saw(reducer.state, "envs-0", 0.4)
    liveness.saw(reducer.state, "envs-1", 1.3)
    assert liveness.records(reducer.state, 17.0, TICK_S) == []  # 17 s < 20 s - 2 ticks
    # Each with when it was seen, rounded up to the tick interval: envs-0, silent since 0.4 s,
    # is judged hung after 21 s, not 38 s.
    assert liveness.records(reducer.state, 18.0, TICK_S) == [
        WorkersSeen(t=18.0, worker_ids={"envs-0"}, seen_t=1.0),
        WorkersSeen(t=18.0, worker_ids={"envs-1"}, seen_t=2.0),
    ]
    assert liveness.pending == frozenset()


def test_a_record_never_moves_a_sign_of_life_back_and_never_ahead_of_its_time() -> None:
    reducer = running(1, GRACE_S)
    reducer.step(WorkersSeen(t=5.0, worker_ids={"envs-0"}))
    reducer.step(WorkersSeen(t=6.0, worker_ids={"envs-0"}, seen_t=2.0))
    assert reducer.state.last_seen["envs-0"] == 5.0
    with pytest.raises(InvalidEvent, match="seen_t"):
        WorkersSeen(t=6.0, worker_ids={"envs-0"}, seen_t=7.0)


def simulate(seed: int, beat_s: float, stops: dict[str, float]) -> dict[str, Any]:
    """Workers beat every ``beat_s`` (jittered) until their time in ``stops``; deo ticks every
    second and records through :meth:`Liveness.records`. Returns when each worker was found hung
    and how many ids were recorded."""
    rng = random.Random(seed)
    reducer, liveness = running(8, GRACE_S), Liveness()
    next_beat = {w: rng.uniform(0, beat_s) for w in reducer.state.workers}
    hung: dict[str, float] = {}
    recorded = 0
    t = 0.0
    for _ in range(120):
        tick_t = t + TICK_S
        beats = sorted((b, w) for w, b in next_beat.items() if b <= tick_t)
        while beats:
            beat_t, worker_id = beats.pop(0)
            if beat_t < stops.get(worker_id, float("inf")):
                liveness.saw(reducer.state, worker_id, beat_t)
            next_beat[worker_id] = beat_t + beat_s * rng.uniform(0.8, 1.2)
            if next_beat[worker_id] <= tick_t:
                beats = sorted([*beats, (next_beat[worker_id], worker_id)])
        t = tick_t
        for seen in liveness.records(reducer.state, t, TICK_S):
            recorded += len(seen.worker_ids)
            reducer.step(seen)
        for command in reducer.step(Tick(t=t, interval_s=TICK_S)):
            if isinstance(command, TerminateWorker):
                hung[command.worker_id] = t
    return {"hung": hung, "recorded": recorded}


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("beat_s", [0.3, 1.0, 2.5])
def test_the_silent_worker_is_judged_within_a_tick_of_its_deadline(
    seed: int, beat_s: float
) -> None:
    stop_t = 40.0
    result = simulate(seed, beat_s, stops={"envs-3": stop_t})
    assert set(result["hung"]) == {"envs-3"}  # no beating worker blamed
    # Its deadline is its last beat (within a beat before it stopped) plus the grace; it is
    # judged on the first tick past it, rounding its sighting up to a tick at most.
    last_beat_after = stop_t - 1.2 * beat_s
    assert last_beat_after + GRACE_S < result["hung"]["envs-3"] <= stop_t + GRACE_S + 2 * TICK_S
    # About one id per worker per grace (less two ticks and the age of the sighting), whatever
    # the heartbeat rate: under half of what a record every quarter grace takes (8 * 120 / 5).
    period_s = GRACE_S - 3 * TICK_S - 1.2 * beat_s
    assert result["recorded"] <= 8 * (120 / period_s + 1) < 8 * 120 / (GRACE_S / 4) / 2
