"""core.policies.buffer.saturation: short at the pool's maximum, the search for the count a
shared inference saturates at.

Batch 64 sequences throughout. Each test drives the policy with samples as the reducer would
(``desired`` is the count the reducer applied) and checks what it measured or decided.
"""

from __future__ import annotations

from typing import Any

import pytest

from core.policies import BufferMemory
from core.records import replace
from tests.core.buffer_helpers import probe, settled


def test_starving_at_the_maximum_tries_fewer_workers_when_production_per_worker_fell() -> None:
    # At the maximum (20), starving, p 2.0 against a best of 4.0: a quarter fewer, to see
    # whether production falls with them.
    memory = settled(
        queue_seqs=8.0,
        last_queued_seqs=8,
        hungry_share=1.0,
        per_worker_seqs_s=2.0,
        best_per_worker_seqs_s=4.0,
        production_seqs_s=40.0,
        last_active=20,
        last_desired=20,
    )
    decision = probe(memory, 20, queued=8, max_workers=20)
    assert decision.target == 15, decision.reason
    assert "whether the shared inference saturates" in decision.reason
    after = decision.memory
    assert after.shed_workers == 20
    assert after.shed_seqs_s == pytest.approx(40.0, rel=0.05)  # this sample folded in
    # 200 s later 15 workers still make 39 seq/s: saturated. With the queue back in the band
    # the pool stays at 15.
    held = replace(after, last_t=300.0, last_advance_t=300.0, production_seqs_s=39.0)
    fed = replace(held, queue_seqs=40.0)
    judged = probe(fed, 15, queued=40, active=15, max_workers=20, desired=15)
    assert judged.target == 15, judged.reason
    assert judged.memory.saturated_workers == 15
    assert "saturates, holding 15 workers" in judged.reason
    # Had production fallen with the workers (30 seq/s), it goes back to the maximum.
    fell = probe(replace(held, production_seqs_s=30.0), 15, queued=8, active=15,
                 max_workers=20, desired=15)  # fmt: skip
    assert fell.target == 20, fell.reason
    assert fell.memory.saturated_workers is None


def test_the_fall_is_read_where_production_per_worker_falls_not_over_the_whole_window() -> None:
    # At the maximum (20) for longer than the window, starving: p over the window still reads
    # 3.0 (the pool before the last workers came weighs in it), 75% of its best of 4.0, but
    # over the window's recent quarter it reads 2.4 with the same 20 workers. The shared
    # inference saturated: the test comes now, not once the whole window has caught up (20
    # minutes of 32 workers where 24 made as much, on the scenario inference_saturation).
    memory = settled(
        last_t=1000.0,
        last_advance_t=1000.0,
        queue_seqs=8.0,
        last_queued_seqs=8,
        hungry_share=1.0,
        per_worker_seqs_s=3.0,
        recent_per_worker_seqs_s=2.4,
        best_per_worker_seqs_s=4.0,
        production_seqs_s=48.0,
        production_seen_s=300.0,
        last_active=20,
        last_desired=20,
        active_changed_t=600.0,
    )
    decision = probe(memory, 20, queued=8, max_workers=20)
    assert decision.target == 15, decision.reason
    assert "fell from 4.00 to 2.3" in decision.reason  # (this sample folded in)
    # With workers come within the window, the recent quarter may be theirs: not read as a
    # fall (at most the smaller test of a pool that shows no sign of saturation).
    recent = probe(replace(memory, active_changed_t=900.0), 20, queued=8, max_workers=20)
    assert "fell from" not in recent.reason
    assert recent.target >= 20 - 20 // 8


def saturated_series(**changes: Any) -> BufferMemory:
    """Starving at 24 workers, after removals from 40 that the shared inference absorbed (80
    seq/s made throughout): the count of 24 was removed to 21 at t = 100 and is being judged."""
    fields: dict[str, Any] = {
        "queue_seqs": 8.0,
        "last_queued_seqs": 8,
        "hungry_share": 1.0,
        "demand_seqs_s": 80.0,
        "fast_demand_seqs_s": 80.0,
        "per_worker_seqs_s": 3.5,
        "best_per_worker_seqs_s": 3.5,
        "production_seqs_s": 73.5,
        "last_active": 21,
        "last_desired": 21,
        "last_down_t": 100.0,
        "last_t": 400.0,
        "last_advance_t": 400.0,
        "shed_workers": 24,
        "shed_seqs_s": 80.0,
        "shed_t": 100.0,
        "capacity_seqs_s": 80.0,
        "saturated_workers": 24,
        "saturated_until_t": 10_000.0,
    }
    fields.update(changes)
    return settled(**fields)


def test_a_saturated_pool_still_short_goes_to_the_count_its_best_rate_makes_the_capacity() -> None:
    # 24 workers made as much as 27 did (80 seq/s) and the trainer still waits: the knee is
    # lower still. Workers once made 3.5 seq/s each (sharing only lowers that), so 23 make the
    # 80: the knee is no higher, and 23 is the next count tried.
    memory = saturated_series(
        shed_workers=27, production_seqs_s=80.0, last_active=24, last_desired=24
    )
    decision = probe(memory, 24, queued=40, steps=2, active=24, max_workers=40)
    assert decision.target == 23, decision.reason
    assert "saturates; still short, trying 23 workers" in decision.reason
    after = decision.memory
    assert (after.shed_workers, after.saturated_workers) == (24, 24)
    assert after.capacity_seqs_s == pytest.approx(80.0, rel=0.02)
    # Far above that count, at most half the pool at a time.
    crowded = saturated_series(shed_workers=54, production_seqs_s=80.0, last_active=48)
    halved = probe(crowded, 48, queued=40, steps=2, active=48, max_workers=64)
    assert halved.target == 24, halved.reason
    # Fed again (the queue in the band), it holds where it is.
    fed = replace(memory, queue_seqs=60.0)
    held = probe(fed, 24, queued=60, active=24, max_workers=40)
    assert held.target == 24, held.reason
    assert held.memory.shed_workers == 0


def test_below_that_count_each_saturated_step_is_twice_the_last_within_its_cost() -> None:
    # The best rate measured is this pool's own (80 seq/s over 24, 3.3 each): it puts the knee
    # at no more than 25, no help at 24. The last step removed 3 of 27 (a ninth): this one
    # twice that share, 5 of 24 (steps of 0.8 s and 20-s start-ups: a step past the knee is
    # judged and undone within 68 s, so up to a quarter costs less than 36 s of production).
    memory = saturated_series(
        shed_workers=27,
        production_seqs_s=80.0,
        last_active=24,
        last_desired=24,
        per_worker_seqs_s=3.3,
        best_per_worker_seqs_s=3.3,
    )
    decision = probe(memory, 24, queued=40, steps=2, active=24, max_workers=40)
    assert decision.target == 19, decision.reason
    # With 300-s start-ups a step past the knee would cost 5 minutes: an eighth at a time.
    slow = replace(memory, startup_s=300.0, startups_seen=3)
    careful = probe(slow, 24, queued=40, steps=2, active=24, max_workers=40)
    assert careful.target == 21, careful.reason


def test_the_step_that_passes_the_knee_places_it() -> None:
    # 21 workers make 73.5 seq/s (3.5 each, unshared), 24 made 80: the knee lies between, at
    # the count that makes 80 at 3.5 per worker: 23 workers, held for 30 start-ups.
    decision = probe(saturated_series(), 21, queued=27, steps=2, active=21, max_workers=40)
    assert decision.target == 23, decision.reason
    assert "below the knee" in decision.reason
    after = decision.memory
    assert after.saturated_workers == 23
    assert after.saturated_until_t == pytest.approx(402.0 + 30 * 20.0)
    assert after.shed_workers == 0
    # That production per worker is the best from then on: a higher one measured long before
    # (shorter groups then) would put the next search's first step below the knee.
    stale = probe(saturated_series(best_per_worker_seqs_s=7.0), 21, queued=27, steps=2,
                  active=21, max_workers=40)  # fmt: skip
    assert stale.target == 23, stale.reason
    assert stale.memory.best_per_worker_seqs_s == pytest.approx(3.5, rel=0.02)
    # Without a saturated step before (the first test removed these), production that fell
    # with the workers means no saturation: back to the maximum.
    first = saturated_series(saturated_workers=None, saturated_until_t=0.0, production_seqs_s=64.0)
    back = probe(first, 21, queued=8, steps=2, active=21, max_workers=40)
    assert back.target == 40, back.reason
    assert "not saturated" in back.reason


def test_a_fall_already_clear_is_judged_before_the_second_settle_time() -> None:
    # Production is averaged over 24 s here (30 steps of 0.8 s). 36 s after the removal the
    # average has taken in 78% of the change and already shows a fall of 8%: judged now, on
    # the level it is heading for (71.6 seq/s), so the pool is not kept below the knee.
    early = saturated_series(shed_t=366.0, production_seqs_s=73.6)
    decision = probe(early, 21, queued=27, steps=2, active=21, max_workers=40)
    assert "below the knee" in decision.reason, decision.reason
    assert decision.target == 24
    # Within the first settle time nothing is judged.
    too_early = saturated_series(shed_t=386.0, production_seqs_s=73.6)
    waiting = probe(too_early, 21, queued=27, steps=2, active=21, max_workers=40)
    assert waiting.target == 21, waiting.reason
    assert "measuring what they make" in waiting.reason


def test_a_fall_of_less_than_half_the_workers_removed_is_measured_longer() -> None:
    # 21 workers make 76 of the 80 seq/s 24 made: 5% less for 12.5% fewer workers. Saturated
    # still with some noise, or the knee passed part of the way: measured for longer.
    memory = saturated_series(shed_t=342.0, production_seqs_s=76.0)
    decision = probe(memory, 21, queued=32, steps=2, active=21, max_workers=40)
    assert decision.target == 21, decision.reason
    assert "measuring longer" in decision.reason
    assert decision.memory.shed_workers == 24
    # Four settle times after the removal it is told: the knee between 21 and 24.
    later = saturated_series(shed_t=250.0, production_seqs_s=76.0)
    told = probe(later, 21, queued=32, steps=2, active=21, max_workers=40)
    assert "below the knee" in told.reason, told.reason
    assert told.target == 23


def test_a_saturation_test_that_filled_the_queue_is_void() -> None:
    # The queue reached the off-policy limit after the removal: the envs held back, so what
    # the smaller pool made is not what it can make.
    memory = saturated_series(limit_t=300.0)
    decision = probe(memory, 21, queued=8, active=21, max_workers=40)
    assert decision.target == 21, decision.reason
    assert "filled the queue: no saturation test" in decision.reason
    assert decision.memory.shed_workers == 0


def test_a_pool_saturated_from_its_first_measurement_is_tested_with_an_eighth() -> None:
    # 40 workers (the maximum) from the start, each making 2 seq/s: p never fell, because it
    # was never measured with fewer. Starving: an eighth fewer, to see.
    memory = settled(
        queue_seqs=8.0,
        hungry_share=1.0,
        demand_seqs_s=80.0,
        fast_demand_seqs_s=80.0,
        per_worker_seqs_s=2.0,
        best_per_worker_seqs_s=2.0,
        production_seqs_s=80.0,
        production_seen_s=300.0,
        fewest_measured_workers=40,
        last_active=40,
        last_desired=40,
    )
    decision = probe(memory, 40, queued=40, steps=2, max_workers=40)
    assert decision.target == 35, decision.reason
    assert "never measured with fewer workers" in decision.reason
    assert decision.memory.shed_workers == 40
    # With 5-minute start-ups a test that finds no saturation keeps its workers away for two
    # settle times and a start-up (348 s here): 4 of 40 (35 s of the pool's production), not 5.
    slow = replace(memory, startup_s=300.0, startups_seen=3)
    small = probe(slow, 40, queued=40, steps=2, max_workers=40)
    assert small.target == 36, small.reason
    # However long the start-ups, a sixteenth at least: a smaller fall is lost in the noise.
    slower = replace(memory, startup_s=3000.0, startups_seen=3)
    least = probe(slower, 40, queued=40, steps=2, max_workers=40)
    assert least.target == 38, least.reason
    # Once measured at 38 (that test made, whatever it found), no test tries 38 again.
    again = probe(
        replace(slower, fewest_measured_workers=38), 40, queued=40, steps=2, max_workers=40
    )
    assert again.target == 40, again.reason
    # Measured at 30 workers before (as much per worker): no sign of saturation, no test.
    known = probe(
        replace(memory, fewest_measured_workers=30), 40, queued=40, steps=2, max_workers=40
    )
    assert known.target == 40, known.reason
    # A trainer with a batch queued is not worth the test's cost.
    fed = probe(replace(memory, queue_seqs=70.0), 40, queued=70, max_workers=40)
    assert fed.target == 40, fed.reason
