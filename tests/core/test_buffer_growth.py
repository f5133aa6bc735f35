"""core.policies.buffer.growth (rule 2): a starving trainer grows the pool, unless production
stopped or the shared inference saturates.

Batch 64 sequences throughout. Each test drives the policy with samples as the reducer would
(``desired`` is the count the reducer applied) and checks what it measured or decided.
"""

from __future__ import annotations

from typing import Any

from core.policies import BufferMemory, BufferPolicy
from core.records import replace
from tests.core.buffer_helpers import ctx, probe, settled


def test_a_starving_trainer_grows_the_pool_in_proportion_to_how_long_it_waited() -> None:
    # The queue always under half a batch for the last start-up: double.
    always = settled(queue_seqs=8.0, last_queued_seqs=8, hungry_share=1.0, last_desired=10)
    decision = probe(always, 10, queued=8)
    assert decision.target == 20, decision.reason
    assert "trainer starving" in decision.reason
    # A quarter of the samples: x1.25.
    some = settled(queue_seqs=20.0, last_queued_seqs=20, hungry_share=0.25, last_desired=10)
    assert probe(some, 10, queued=20).target >= 13
    # Within a start-up of an applied addition it waits for the added workers.
    recent = settled(
        queue_seqs=8.0, last_queued_seqs=8, hungry_share=1.0, last_up_t=90.0, last_desired=10
    )
    assert probe(recent, 10, queued=8).target < 20


def seen_to_speed_up(**changes: Any) -> BufferMemory:
    """10 workers, none of the last start-up's samples hungry, and the trainer seen to speed up
    10 s ago from 16 to 32 seq/s while a batch waited."""
    fields: dict[str, Any] = {
        "hungry_share": 0.0,
        "last_desired": 10,
        "sped_up_t": 90.0,
        "sped_up_from_seqs_s": 16.0,
    }
    return settled(**(fields | changes))


def test_a_trainer_seen_to_speed_up_grows_the_pool_by_its_rise_at_once() -> None:
    # Hungry at none of the samples of the last start-up but this one (x1.1), but the trainer
    # was seen to speed up 10 s ago, from 16 to 32 seq/s, while a batch waited: it needs up to
    # twice the pool that fed it, and the hungry share would take a start-up (20 s) to show it.
    memory = seen_to_speed_up(queue_seqs=20.0)
    decision = probe(memory, 10, queued=20)
    assert decision.target == 20, decision.reason
    assert "the trainer sped up x2.0" in decision.reason
    # By its rise only: from 24 to 32 seq/s, x1.33.
    assert probe(replace(memory, sped_up_from_seqs_s=24.0), 10, queued=20).target == 14
    # And never past max_up_factor: from 8 to 32 seq/s still doubles.
    assert probe(replace(memory, sped_up_from_seqs_s=8.0), 10, queued=20).target == 20
    # Three start-ups on (60 s), the hungry share sizes the growth again.
    stale = replace(memory, sped_up_t=30.0)
    assert probe(stale, 10, queued=20).target == 11
    assert probe(replace(memory, sped_up_t=None), 10, queued=20).target == 11


def test_a_starving_trainer_grows_by_the_quick_rate_read_when_the_speed_up_was_seen() -> None:
    # Seen to speed up from 16 to 32 seq/s (after a pause, say); starving since, its quick
    # rate reads only what the pool makes (20 seq/s, x1.4 on this sample). It takes twice
    # what it did: the growth doubles the pool.
    memory = seen_to_speed_up(queue_seqs=20.0, fast_demand_seqs_s=20.0, sped_up_to_seqs_s=32.0)
    decision = probe(memory, 10, queued=20)
    assert decision.target == 20, decision.reason
    assert "the trainer sped up x2.0" in decision.reason
    # Without that reading, the quick rate alone: x1.4.
    assert probe(replace(memory, sped_up_to_seqs_s=0.0), 10, queued=20).target == 14


def test_a_queue_under_a_batch_after_a_speed_up_is_starving_whatever_its_average() -> None:
    # Samples at 44 and 48 of a 64-sequence batch, Q 46 (0.72 batch): above the 0.6 batch a
    # starving queue averages, so alone they read as a queue low in the band. But the trainer
    # was seen to speed up 10 s ago from 16 to 32 seq/s: it takes each batch as the envs make
    # it (samples fall mid-way through a batch), and the demand it shows is what they make.
    memory = seen_to_speed_up(queue_seqs=46.0, last_queued_seqs=44)
    decision = probe(memory, 10, queued=48)
    assert decision.target == 20, decision.reason
    assert "trainer starving" in decision.reason
    # No speed-up seen lately: a queue at 0.72 batch is not read as starving.
    for quiet in (replace(memory, sped_up_t=None), replace(memory, sped_up_t=30.0)):
        assert "trainer starving" not in probe(quiet, 10, queued=48).reason
    # A sample of a batch or more: the trainer found one waiting.
    assert "trainer starving" not in probe(memory, 10, queued=64).reason
    # Start-ups of a second: three of them end before the first growth's groups land, so the
    # speed-up counts for 10 s at least (here 7 s after it was seen).
    quick = replace(memory, startup_s=1.0, sped_up_t=95.0)
    assert probe(quick, 10, queued=48).target == 20
    assert "trainer starving" not in probe(replace(quick, sped_up_t=91.0), 10, queued=48).reason


def grown_while_starving(**changes: Any) -> BufferMemory:
    """A trainer still starving after the last growth took 10 workers making 40 seq/s to 20."""
    fields: dict[str, Any] = {
        "queue_seqs": 8.0,
        "last_queued_seqs": 8,
        "hungry_share": 1.0,
        "last_active": 20,
        "probe_workers": 10,
        "probe_seqs_s": 40.0,
        "probe_t": 60.0,
        "last_up_t": 60.0,
        "last_desired": 20,
    }
    return settled(**(fields | changes))


def test_growth_that_already_shows_in_production_goes_on_before_the_settle_times() -> None:
    # The grown pool active for 20 s of the two settle times (2 x 60 s) saturation is judged
    # over; the averaged production already reads 65 seq/s (+62% for +100% workers, and still
    # rising). Not saturated: the trainer grows again now rather than waiting them out.
    memory = grown_while_starving(production_seqs_s=65.0, active_changed_t=80.0)
    decision = probe(memory, 20, queued=8)
    assert decision.target > 20, decision.reason
    # A rise of less than half of what was added is not judged before the settle times.
    slow = replace(memory, production_seqs_s=55.0)
    held = probe(slow, 20, queued=8)
    assert held.target == 20, held.reason
    assert "warming up" in held.reason


def test_a_growth_is_judged_on_what_the_grown_pool_made_not_on_the_average() -> None:
    # The average over the settle time still reads 45 seq/s (it holds the pool before the
    # growth), but over the 30 s since the new workers were in the pool made 76 seq/s: not
    # saturated, and the trainer grows again now rather than waiting out two settle times.
    memory = grown_while_starving(
        production_seqs_s=45.0,
        active_changed_t=65.0,
        probe_made_seqs=76.0 * 30,
        probe_made_s=30.0,
    )
    grown = probe(memory, 20, queued=8)
    assert grown.target > 20, grown.reason
    # What it made rose by a tenth for twice the workers: too few steps to call saturation on
    # (heavy tails make them noisy), so the average decides, after its settle times.
    flat = replace(memory, probe_made_seqs=44.0 * 30)
    assert "warming up" in probe(flat, 20, queued=8).reason
    # Measured for less than 30 s (and eight steps): the average decides, and waits.
    early = replace(memory, probe_made_s=10.0, probe_made_seqs=760.0)
    assert "warming up" in probe(early, 20, queued=8).reason


def test_what_the_grown_pool_makes_counts_once_its_workers_are_past_their_first_groups() -> None:
    base = grown_while_starving()
    # Active for 2 s: their first groups are still in generation.
    fresh = probe(replace(base, active_changed_t=100.0), 20, queued=72)
    assert fresh.memory.probe_made_s == 0.0
    # Active for a settle time (four steps, 10 s at least): 2 s in which 72 - 8 + 64 entered.
    warm = probe(replace(base, active_changed_t=80.0), 20, queued=72)
    assert warm.memory.probe_made_s == 2.0
    assert warm.memory.probe_made_seqs == 128.0


def test_growth_goes_on_once_the_trainers_quick_rate_shows_the_workers_added() -> None:
    # Start-ups of 2 s: 10 workers grew to 20 8 s ago, active for 4 s (their first groups still
    # in generation by the settle time, four steps or 10 s). The starving trainer's quick rate
    # read 40 seq/s at the growth and reads 64 now, a step a second (+60% for +100% workers):
    # their groups are in, and the trainer still starves, so the pool grows again now.
    memory = settled(
        queue_seqs=8.0,
        last_queued_seqs=8,
        hungry_share=1.0,
        startup_s=2.0,
        last_active=20,
        last_desired=20,
        last_up_t=94.0,
        active_changed_t=98.0,
        up_from_workers=10,
        up_from_seqs_s=40.0,
        fast_demand_seqs_s=64.0,
        demand_seqs_s=64.0,
    )
    grown = probe(memory, 20, queued=8, steps=2)
    assert grown.target > 20, grown.reason
    assert "trainer starving" in grown.reason
    # A rise of less than half of what the added workers make: still warming up.
    flat = replace(memory, fast_demand_seqs_s=52.0, demand_seqs_s=52.0)
    held = probe(flat, 20, queued=8, steps=1)
    assert held.target == 20, held.reason
    # Not starving (a batch and more queued), the rise says nothing of warming: no growth.
    fed = replace(memory, queue_seqs=80.0, last_queued_seqs=80)
    assert probe(fed, 20, queued=80, steps=2).target <= 20


def test_a_production_outage_holds_the_pool() -> None:
    # A settled pool of 8 (p = 4 seq/s, the trainer fed); then nothing enters the queue and the
    # trainer takes nothing for ten minutes. Every worker reported active at once.
    policy, memory, count = BufferPolicy(), settled(), 8
    decisions = []
    for i in range(1, 301):
        t = 100.0 + 2 * i
        decision = policy.decide(ctx(t, 0, 50, current=count, max_workers=100), memory)
        memory, count = decision.memory, decision.target
        decisions.append(decision)
    # (At its onset a few seconds without production read as a dip: one small growth.)
    assert max(d.target for d in decisions) <= 10, [d.reason for d in decisions]
    assert "production stopped" in decisions[-1].reason, decisions[-1].reason
    # No reason claims a production nobody measured.
    assert not any("seq/s, " in d.reason and "make" in d.reason for d in decisions)


def grown_short_of_its_workers(**changes: Any) -> BufferMemory:
    """The last growth went from 10 active workers making 40 seq/s to 20 active, and p fell
    to 2.1: 42 seq/s, two settle times (2 x 30 steps of 2 s) after the workers came."""
    fields: dict[str, Any] = {
        "per_worker_seqs_s": 2.1,
        "production_seqs_s": 42.0,
        "probe_t": 40.0,
        "last_up_t": None,
        "active_changed_t": -100.0,
    }
    return grown_while_starving(**(fields | changes))


def test_saturation_stops_growth_and_sheds() -> None:
    # Inference, not workers, is the limit: hold what makes 42 seq/s, 11.
    decision = probe(grown_short_of_its_workers(), 20, queued=8)
    assert decision.target == 11, decision.reason
    assert "saturates" in decision.reason
    after = decision.memory
    assert after.saturated_workers == 11
    # While it holds, a starving trainer adds nothing.
    later = replace(after, last_t=200.0, last_advance_t=200.0)
    assert probe(later, 11, queued=8, desired=11).target == 11


def test_a_removal_after_a_growth_voids_its_saturation_test() -> None:
    # The same figures, but the pool went down after that growth (and came back to 20 by
    # another rule): the pool that grew is gone, and what this one makes, later, says
    # nothing about saturation (groups that grow longer over a run make less per worker
    # whatever the count). The starving trainer grows the pool.
    decision = probe(grown_short_of_its_workers(last_down_t=50.0), 20, queued=8)
    assert decision.target > 20, decision.reason
    assert "saturates" not in decision.reason
