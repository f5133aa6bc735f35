"""core.policies.buffer.removal (rule 5): removals above the band, in whole workers, and at the
off-policy limit.

Batch 64 sequences throughout. Each test drives the policy with samples as the reducer would
(``desired`` is the count the reducer applied) and checks what it measured or decided.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable

import pytest

from core.policies import BufferMemory, BufferPolicy, Decision
from core.records import replace
from tests.core.buffer_helpers import ctx, probe, settled

# --- hysteresis in whole workers -----------------------------------------------------------------


def hold_queue(start: BufferMemory, count: int, seconds: float) -> list[Decision]:
    """Samples every 2 s for ``seconds``, the measurements and the count held as they are (only
    the time and what the policy remembers of the excess move on)."""
    decisions, memory = [], start
    for _ in range(round(seconds / 2)):
        decision = probe(memory, count)
        decisions.append(decision)
        after = decision.memory
        memory = replace(
            start,
            last_t=after.last_t,
            last_step=after.last_step,
            last_advance_t=after.last_advance_t,
            excess_since_t=after.excess_since_t,
        )
    return decisions


def test_a_marginal_excess_is_removed_only_once_it_has_lasted() -> None:
    # Need 32 / 4.2 = 7.6 workers; 9 leave 1.4 over, more than the margin with no spread (1)
    # but less than twice it: the queue above the band is not removed from at once, only after
    # 3 start-ups and 8 steps (76 s) of it.
    start = settled(queue_seqs=130.0, per_worker_seqs_s=4.2, last_active=9, last_desired=9)
    decisions = hold_queue(start, 9, 100.0)
    removals = [k for k, d in enumerate(decisions) if d.target < 9]
    assert removals, decisions[-1].reason
    first = removals[0]
    assert 2.0 * first >= 76.0  # the excess was first seen at the first sample
    assert "of the 76s a removal needs" in decisions[0].reason
    assert decisions[first].target == 8
    # Twice the margin over is clear: at once.
    assert probe(settled(queue_seqs=130.0), 10).target == 8


def test_no_removal_leaves_less_than_a_whole_worker_plus_the_spread() -> None:
    # Production wanders by 0.5 worker over a start-up (4 seq/s x 0.5 x 20 s): 9 workers leave
    # 1 over, under the 1.5 a removal needs, however long the queue stays above the band (the
    # target is 1 + 40 / 64 batches, the band's top 136 seq).
    memory = settled(queue_seqs=150.0, spread_var_seqs2=40.0**2, spreads_seen=5, last_active=9)
    decisions = hold_queue(memory, 9, 300.0)
    assert all(d.target == 9 for d in decisions), decisions[-1].reason
    assert "a removal needs 1.50" in decisions[-1].reason
    # 12 leave 4 over, more than twice the margin: down to the need plus the spread, 9.
    assert probe(memory, 12).target == 9


def test_the_spread_counts_over_a_step_where_a_step_outlasts_a_start_up() -> None:
    # Workers that start in a second, production wandering by 8 seq from one second to the
    # next (two groups of four): a trainer stepping every 10 s sees 0.8 seq/s of it, a fifth
    # of a worker, and 5 workers where 1.6 are needed lose a quarter at once.
    wander = {"spread_var_seqs2": 8.0**2, "spreads_seen": 5, "startup_s": 1.0}
    slow = settled(queue_seqs=150.0, demand_seqs_s=6.4, fast_demand_seqs_s=6.4, last_active=5,
                   last_desired=5, **wander)  # fmt: skip
    decision = probe(slow, 5, steps=0)
    assert decision.target == 4, decision.reason
    assert "(a removal needs 1.20) -> stepping down to 4" in decision.reason
    # A trainer stepping every second sees the whole wander: 2 workers of it.
    fast = settled(queue_seqs=150.0, demand_seqs_s=64.0, fast_demand_seqs_s=64.0,
                   last_active=18, last_desired=18, **wander)  # fmt: skip
    decision = probe(fast, 18, steps=2)
    assert decision.target == 18, decision.reason
    assert "(a removal needs 3.00) -> hold 18" in decision.reason


def test_p_measured_before_a_removal_holds_after_it_but_not_after_a_growth() -> None:
    # 40 workers at the off-policy limit, p measured over 100 s of them: the trainer needs 8,
    # and the removal goes by that need (a quarter of the pool, max_down_fraction), not by a
    # twentieth.
    memory = settled(queue_seqs=192.0, last_active=40, last_desired=40, fresh_s=100.0)
    first = probe(memory, 40)
    assert first.target == 30, first.reason
    assert "need 8.00 workers" in first.reason
    # Applied: each of the 30 left makes at least what it made, p is still the pool's, and
    # the next removal (a cooldown later) goes by the need again.
    applied = probe(first.memory, 30, desired=30)
    assert applied.memory.fresh_s >= 100.0
    later = replace(applied.memory, last_down_t=0.0)
    second = probe(later, 30, desired=30)
    assert second.target == 23, second.reason
    assert "need 8.00 workers" in second.reason
    # Workers added may make less each: p is measured afresh, and until it is the pool at
    # the limit steps down by its share (here a tenth), not by the need.
    grown = probe(first.memory, 44, desired=44)
    assert grown.memory.fresh_s == 0.0
    again = probe(replace(grown.memory, last_down_t=0.0), 44, desired=44)
    assert again.target == 40, again.reason
    assert "queue at the off-policy limit -> stepping down to 40" in again.reason


def test_workers_still_starting_beyond_twice_the_need_go_at_once() -> None:
    # A cold pool asked for 40; 12 are up and the need reads 8.04 (D 32 seq/s, p 3.98 with
    # this sample in): a removal takes at most a quarter of the pool (max_down_fraction), but
    # the 28 starting make nothing yet, so those beyond twice the need go with it: 40 -> 17.
    above = settled(queue_seqs=130.0, last_active=12, last_desired=40)
    decision = probe(above, 40, active=12)
    assert decision.target == 17, decision.reason
    assert "stepping down to 17 (the 23 going are still starting; twice the need stays)" in (
        decision.reason
    )
    # More up than that: only the starting ones go (the workers up stay for the usual rules).
    assert probe(replace(above, last_active=20), 40, active=20).target == 20
    # All up: a quarter at a time, as before.
    assert probe(replace(above, last_active=40), 40, active=40).target == 30


def test_no_removal_goes_back_to_a_count_found_short() -> None:
    # 8 workers emptied the queue at this demand (an addition brought a 9th): with the queue
    # above the band and p reading a need of 32 / 4.5 = 7.1, the pool stays at 9.
    short = settled(queue_seqs=130.0, per_worker_seqs_s=4.5, short_workers=8,
                    short_demand_seqs_s=32.0)  # fmt: skip
    decisions = hold_queue(short, 9, 200.0)
    assert all(d.target == 9 for d in decisions), decisions[-1].reason
    assert "8 were short" in decisions[-1].reason
    assert probe(short, 12).target == 9
    # Demand halved (a slower trainer, not the jitter of the estimate): 8 may go.
    slower = replace(short, demand_seqs_s=16.0, fast_demand_seqs_s=16.0, last_advance_t=98.0)
    assert probe(slower, 9).target < 9


def test_a_removal_undone_at_the_same_need_is_a_flap() -> None:
    # The pool went down to 9 when it needed 8 (D 32 seq/s, p 4); an addition back to 10 with
    # the need still 8 undoes a wrong removal: one flap, dated.
    went_down = settled(last_desired=9, last_down_t=60.0, down_need_workers=8.0)
    undone = probe(went_down, 10).memory
    assert (undone.flaps, undone.flaps_t) == (1.0, 102.0)
    assert undone.flap_need_workers == pytest.approx(8.0)
    # A need that rose by more than a tenth since (a faster trainer, slower groups) made the
    # addition: load followed, not a flap.
    assert probe(replace(went_down, down_need_workers=7.0), 10).memory.flaps == 0.0
    # An addition after an addition, or with no removal before it: not a flap either.
    assert probe(replace(went_down, last_up_t=80.0), 10).memory.flaps == 0.0
    assert probe(replace(went_down, last_down_t=None), 10).memory.flaps == 0.0
    # A removal records the need it went down at; a saturation test or a pause let go goes
    # down on purpose and records none, so the addition that undoes it is no flap.
    down = settled(last_desired=12)
    assert probe(down, 9).memory.down_need_workers == pytest.approx(8.0)
    assert probe(replace(down, shed_workers=12), 9).memory.down_need_workers == 0.0
    assert probe(replace(down, workers_before_pause=12), 9).memory.down_need_workers == 0.0


def test_flaps_widen_what_a_removal_keeps_and_fade_over_hours() -> None:
    # Need 32 / 4.4 = 7.3, no spread, removals not capped: 12 workers go to 8 at once; after a
    # flap the removal needs twice the margin and keeps a worker more (the margin, 1 + spread).
    policy = BufferPolicy(max_down_fraction=1.0)
    above = settled(queue_seqs=130.0, last_active=12, last_desired=12, per_worker_seqs_s=4.4)
    assert probe(above, 12, policy=policy).target == 8
    flapped = replace(above, flaps=1.0, flaps_t=100.0)
    decision = probe(flapped, 12, policy=policy)
    assert decision.target == 9, decision.reason
    assert "(a removal needs 2.00, 1.0 removals undone) -> stepping down to 9" in decision.reason
    # Three flaps: a removal needs 4, and 4.7 over is less than twice that: only once it has
    # lasted (3 start-ups and 8 steps).
    thrice = probe(replace(above, flaps=3.0, flaps_t=100.0), 12, policy=policy)
    assert thrice.target == 12, thrice.reason
    assert "a removal needs, 3.0 removals undone -> hold 12" in thrice.reason
    # At the off-policy limit the step down stops short of the need by as much: 40 workers
    # needing 35 step down by a tenth to 36, with three flaps only to 38.
    limit = settled(queue_seqs=192.0, last_active=40, last_desired=40, per_worker_seqs_s=32 / 35)
    assert probe(limit, 40).target == 36
    assert probe(replace(limit, flaps=3.0, flaps_t=100.0), 40).target == 38
    # A flap counts half as much an hour on; at most three count; none once the need has
    # fallen by more than a tenth since the last (a slower trainer: a new load).
    at_need = replace(flapped, flap_need_workers=7.0)
    assert BufferPolicy.flaps(at_need, 100.0 + 3600.0, 7.0) == pytest.approx(0.5)
    assert BufferPolicy.flaps(replace(at_need, flaps=10.0), 100.0, 7.0) == 3.0
    assert BufferPolicy.flaps(at_need, 100.0, 6.0) == 0.0
    # (A trainer slowed to 20 seq/s: need 4.5, the flaps made at 7 no longer count: 12 -> 5.)
    assert probe(replace(at_need, demand_seqs_s=20.0, fast_demand_seqs_s=20.0,
                         last_advance_t=98.0), 12, policy=policy).target == 5  # fmt: skip


def test_a_queue_held_at_the_limit_for_a_cooldown_steps_down_by_up_to_a_tenth() -> None:
    # 40 workers, a queue of 3 batches (at the off-policy limit), a step per 2 s and a 20 s
    # start-up: the two batches above the band cover a shortfall of a fifth of D for a
    # start-up, so a pool held there since the last sample away from the limit steps down by a
    # tenth (the cap), not a twentieth.
    pinned = settled(queue_seqs=192.0, last_active=40, last_desired=40)
    decision = probe(pinned, 40)
    assert decision.target == 36, decision.reason
    assert "stepping down to 36 (at most 10% of the pool, the queue held there for 20s" in (
        decision.reason
    )
    # p measured below its bound D / active there (32 / 40 seq/s per worker): the need is the
    # whole pool, and the step a worker, whatever the share allows; the reason says which.
    bound = probe(replace(pinned, per_worker_seqs_s=32 / 45), 40)
    assert bound.target == 39, bound.reason
    assert "to 39 (at most a worker at a time: production per worker is not measured" in (
        bound.reason
    )
    assert "puts the need at the whole pool" in bound.reason
    # The queue was away from the limit within the cooldown (the last removal may have left
    # the pool near its need): a twentieth.
    left = replace(pinned, away_t=95.0)
    decision = probe(left, 40)
    assert decision.target == 38, decision.reason
    assert "stepping down to 38 (at most a twentieth of the pool at a time)" in decision.reason
    # A trainer stepping every 0.4 s covers less than a twentieth in a start-up: a twentieth.
    fast = replace(pinned, demand_seqs_s=160.0, fast_demand_seqs_s=160.0, per_worker_seqs_s=8.0)
    assert probe(fast, 40, steps=5).target == 38
    # A count found short at this demand: a twentieth, never to it.
    short = replace(pinned, short_workers=30, short_demand_seqs_s=32.0)
    assert probe(short, 40).target == 38
    # A removal share below a tenth is respected.
    assert probe(pinned, 40, policy=BufferPolicy(max_down_fraction=0.05)).target == 38


def test_a_removal_that_left_the_queue_at_the_limit_lets_long_start_ups_step_off_the_bound() -> (
    None
):
    # 40 workers at the off-policy limit, production on its bound (the need reads as the
    # whole pool), a step per 2 s and 60-s start-ups: the pinned share is a fifteenth, but
    # the need on the bound holds each step to a worker. The last removal, a cooldown ago,
    # left the queue at the limit, full at half the samples since: twice that share goes
    # (a worker a start-up would hold the excess for most of an hour).
    held = settled(
        queue_seqs=192.0,
        last_active=40,
        last_desired=40,
        per_worker_seqs_s=32 / 45,
        startup_s=60.0,
        last_down_t=30.0,
        limit_samples=20,
        full_samples=10,
    )
    decision = probe(held, 40)
    assert decision.target == 36, decision.reason
    assert (
        "to 36 (at most 10% of the pool: the queue was full at 52% of the samples, at the "
        "limit since the last removal)" in decision.reason
    )
    # Full at fewer than half the samples: a worker.
    assert probe(replace(held, full_samples=9), 40).target == 39
    # The queue was away from the limit after the last removal (it may have left the pool
    # near its need): a worker.
    assert probe(replace(held, away_t=35.0), 40).target == 39
    # Start-ups of 30 s shed the excess within minutes a worker at a time: a worker.
    assert probe(replace(held, startup_s=30.0), 40).target == 39


def test_a_pool_far_above_the_need_measured_below_the_limit_halves_there() -> None:
    # A cold start brought 40 workers (2-minute start-ups); the queue has stood at the limit
    # since, where each worker makes D / n, but p measured below it (4 seq/s per worker, D 32
    # seq/s) puts the need at 8, a fifth of the pool: half goes, not a twentieth.
    cold = settled(
        queue_seqs=192.0, last_active=40, last_desired=40, startup_s=120.0, cold_workers=40
    )
    decision = probe(cold, 40)
    assert decision.target == 20, decision.reason
    assert (
        "(at most half the pool, to twice the need: a cold start's 40 workers, 5.0 x the need"
        in decision.reason
    )
    # Not a cold start's count: p measured above its bound D / active (0.8 seq/s) puts the
    # same need, so the same half goes.
    decision = probe(replace(cold, cold_workers=0), 40)
    assert decision.target == 20, decision.reason
    assert "(at most half the pool, to twice the need: 40 workers, 5.0 x" in decision.reason
    # Nearer the need, down to twice it, not to half the pool: at 3.75 needs (p 3 seq/s, a
    # need of 10.7) to 22, at 3.1 needs (p 2.5 seq/s, a need of 12.8) to 26.
    nearer = probe(replace(cold, per_worker_seqs_s=3.0), 40)
    assert nearer.target == 22, nearer.reason
    assert probe(replace(cold, per_worker_seqs_s=2.5), 40).target == 26
    # Within 3 needs (p 1 seq/s: a need of 32): the usual share.
    assert 36 <= probe(replace(cold, per_worker_seqs_s=1.0), 40).target < 40
    # A pool not from a cold start with p on its bound (it says nothing of the need), or
    # start-ups under a minute (the shares shed it soon enough; a pool halved to a few
    # workers grows back slowly after a faster trainer): the usual share.
    on_bound = replace(cold, cold_workers=0, per_worker_seqs_s=0.8)
    for other in (on_bound, replace(cold, startup_s=30.0)):
        assert 36 <= probe(other, 40).target < 40
    # A count found short at this demand: never halved towards it.
    assert probe(replace(cold, short_workers=30, short_demand_seqs_s=32.0), 40).target >= 31
    # Within a cooldown (a start-up) of the last removal: nothing.
    assert probe(replace(cold, last_down_t=50.0), 40).target == 40


def test_workers_not_yet_up_are_not_started_once_the_queue_held_the_limit() -> None:
    # 20 of 40 workers up (a cold start goes to the maximum before any rate is known) have
    # held the queue at the off-policy limit for a cooldown: those 20 make what the trainer
    # takes, so the 20 still starting are stopped at once, not a worker per cooldown.
    pinned = settled(queue_seqs=192.0, last_active=20, last_desired=40, away_t=50.0)
    decision = probe(pinned, 40, active=20)
    assert decision.target == 20, decision.reason
    assert "with 20 workers up -> 20 (the 20 not yet up are not needed)" in decision.reason
    # At the limit only since a sample within the cooldown: a worker's first groups all
    # start together and the fastest land first, so a queue that just reached the limit
    # proves nothing yet.
    recent = replace(pinned, away_t=95.0)
    assert probe(recent, 40, active=20).target >= 38
    # Below the limit the workers starting are still wanted.
    assert probe(replace(pinned, queue_seqs=80.0), 40, active=20, queued=80).target == 40
    # Never below a count found short at this demand.
    short = replace(pinned, short_workers=30, short_demand_seqs_s=32.0)
    assert probe(short, 40, active=20).target == 31
    # Within a cooldown (20 s here) of a worker exiting early, those starting may be its
    # replacements (their retries tell a crash loop): the tenth a pool held there sheds.
    assert probe(pinned, 40, active=20, last_failure_t=90.0).target == 36
    assert probe(pinned, 40, active=20, last_failure_t=50.0).target == 20
    # A pool never seen away from the limit (its policy just changed): not the workers up
    # alone held it there; a tenth goes, as for any pool held at the limit.
    assert probe(replace(pinned, away_t=None), 40, active=20).target == 36


def test_a_queue_full_at_every_sample_for_a_cooldown_steps_down_by_a_quarter() -> None:
    # 40 workers whose production was never measured above its bound (p reads 0.5 seq/s, the
    # need the whole pool), the queue full (3 batches) at every 2 s sample while the trainer
    # takes a batch each: a worker at a time at first, then, full for a cooldown (a 20 s
    # start-up), each batch taken was made again within a sample interval, so the pool makes
    # at least twice what the trainer takes: a quarter of it goes.
    def run(queued: list[int]) -> list[int]:
        memory, count, targets = settled(per_worker_seqs_s=0.5, last_active=40), 40, []
        for sample in queued:
            decision = probe(memory, count, queued=sample, desired=count)
            memory, count = decision.memory, decision.target
            targets.append(count)
        return targets

    full = run([192] * 12)
    assert full == [39] * 10 + [30] * 2, full
    # One sample a batch short within the cooldown: the proof starts again; meanwhile the
    # queue, held at the limit and full at 8 of its 9 samples since the last removal, takes
    # its share (a tenth here), not the one worker the need on the bound would leave it.
    sagged = run([192] * 5 + [128] + [192] * 6)
    assert sagged == [39] * 10 + [36] * 2, sagged
    # A backlog above the limit (groups in flight when it was reached landed on top) stays
    # full whatever the pool makes: no proof.
    backlog = run([320] * 12)
    assert backlog[-1] == 38, backlog


def test_a_small_pool_with_long_start_ups_removes_a_worker_only_on_proof() -> None:
    # 8 workers at the off-policy limit whose production rests on its bound (the need reads
    # as the whole pool), a step per 2 s and 240-s start-ups: a worker fewer could leave the
    # trainer an eighth short, which the two batches above the band cover for 4 s, not for
    # the start-up its replacement would take. Held there, with the queue back to full at
    # only a quarter of the samples, the pool holds, and says why.
    def run(queued: list[int], startup_s: float = 240.0) -> list[Decision]:
        memory = settled(per_worker_seqs_s=0.5, queue_seqs=192.0, startup_s=startup_s)
        count, decisions = 8, []
        for sample in queued:
            decision = probe(memory, count, queued=sample, desired=count)
            memory, count = decision.memory, decision.target
            decisions.append(decision)
        return decisions

    sagging = [192, 128, 128, 128] * 3
    held = run(sagging)
    assert [d.target for d in held] == [8] * 12, [d.reason for d in held]
    assert (
        "a worker fewer could leave the trainer 12% short, more than the full queue covers "
        "for a 240s start-up -> hold 8" in held[-1].reason
    )
    # Full again at three samples of four: each take was made again within half a step, so
    # the pool makes at least half as much again as the trainer takes: a worker goes.
    refilled = run([192, 192, 128, 192] * 3)
    removal = next(d for d in refilled if d.target < 8)
    assert removal.target == 7, removal.reason
    assert "at most a worker at a time: the queue was full at 75% of the samples" in (
        removal.reason
    )
    # The count smaller, the proof starts again (and the start-up-long cooldown holds it).
    assert refilled[-1].target == 7
    # With 20-s start-ups the batches above the band cover a worker: it goes either way.
    assert run(sagging, startup_s=20.0)[0].target == 7


def test_the_last_worker_stays_while_the_trainer_takes_batches() -> None:
    # One worker holds the queue at the off-policy limit for a trainer that takes a batch
    # every 2 s (p rests on its bound: the need reads as the pool): with no minimum
    # configured, the descent at the limit stops at one, and says why no more.
    memory = settled(per_worker_seqs_s=0.5, queue_seqs=192.0, last_active=1, last_desired=1)
    for _ in range(20):
        decision = probe(memory, 1, queued=192, desired=1)
        assert decision.target == 1, decision.reason
        memory = decision.memory
    assert decision.reason.endswith("queue at the off-policy limit -> hold 1")


def test_a_pool_that_let_the_queue_fall_from_the_limit_is_short() -> None:
    # 8 workers that held the queue at the off-policy limit (90 s ago) now let it fall below
    # the band with p measured for less than its window: more, and 8 is marked short (a
    # removal at the limit would otherwise bring the pool back to 8, again and again).
    memory = settled(queue_seqs=20.0, last_queued_seqs=64, active_changed_t=0.0, limit_t=10.0)
    decision = probe(memory, 8, queued=16)
    assert decision.target >= 9, decision.reason
    assert decision.memory.short_workers == 8
    # Without the limit since the pool came, the same p does not tell.
    assert probe(replace(memory, limit_t=None), 8, queued=16).memory.short_workers is None
    # A trainer starving after it: the growth marks 8 short too.
    starving = replace(memory, queue_seqs=8.0, last_queued_seqs=8, hungry_share=1.0)
    grown = probe(starving, 8, queued=8)
    assert "trainer starving" in grown.reason and grown.target > 8, grown.reason
    assert grown.memory.short_workers == 8


def forty_at_the_limit(queued: Callable[[int], int]) -> list[tuple[int, Decision]]:
    """40 workers at the off-policy limit whose p was never measured above its bound (the need
    reads as the whole pool), a trainer taking a batch every 20 s, samples every 2 s (the k-th
    finds ``queued(k)`` sequences): each sample's count before it and the decision."""
    memory = settled(
        demand_seqs_s=3.2,
        fast_demand_seqs_s=3.2,
        per_worker_seqs_s=0.08,
        production_seqs_s=3.2,
        last_active=40,
        last_desired=40,
        queue_seqs=192.0,
    )
    count, decisions = 40, []
    for k in range(1, 120):
        sample = ctx(100.0 + 2 * k, queued(k), 50 + k // 10, current=count, desired=count)
        decision = BufferPolicy().decide(sample, memory)
        decisions.append((count, decision))
        memory, count = decision.memory, decision.target
    return decisions


def test_a_pool_that_refills_the_queue_within_a_fraction_of_a_step_halves() -> None:
    # Each take leaves the queue a batch short and it is full again by the next sample but
    # one: the envs restart at every take, so the pool makes a batch from scratch within 4 s
    # x 40 workers = 160 worker-seconds, and 2 x 160 / 20 = 16 workers make twice what the
    # trainer takes. After four such refills half the pool goes (at most half at a time),
    # then half again once the smaller pool has refilled as fast.
    decisions = forty_at_the_limit(lambda k: 128 if k % 10 == 0 else 192)
    halvings = [(n, d) for n, d in decisions if "full again within" in d.reason]
    # (Meanwhile the share rules take a worker, then, the queue full at 9 of 10 samples, a
    # tenth of the pool a cooldown.)
    before, first = halvings[0]
    assert 36 <= before <= 40 and first.target == before - before // 2, first.reason
    # The slowest of the last four refills, each 4 s x the workers then (36 to 40).
    found = re.search(
        r"full again within (\d+) worker-seconds of each of the last 4 takes: "
        r"(\d+) workers make twice what the trainer takes -> stepping down to "
        r"(\d+) \(at most half the pool at a time\)",
        first.reason,
    )
    assert found, first.reason
    worker_s, kept, target = (int(g) for g in found.groups())
    assert 4 * before <= worker_s <= 160 and worker_s % 4 == 0
    assert kept == math.ceil(2 * worker_s / 20) and target == first.target
    assert len(halvings) >= 2 and decisions[-1][1].target <= 10, [d.reason for _, d in halvings]
    # Never below what the refills prove: 4 s x n workers keeps 2 x 4 n / 20 = 0.4 n.
    assert all(d.target >= math.ceil(0.4 * n) for n, d in halvings)


def test_a_take_before_the_queue_is_full_again_is_no_proof() -> None:
    # Each take leaves the queue short until the next take (a batch short after the first,
    # never refilled): nothing is timed, and the pool descends only as the share rules allow
    # (a worker at a time).
    decisions = forty_at_the_limit(lambda k: 192 if k < 10 else 160)
    assert not any("full again within" in d.reason for _, d in decisions)
    last = decisions[-1][1]
    assert last.memory.refills_worker_s == ()
    assert last.target >= 30


def test_the_share_rules_keep_what_the_refills_kept() -> None:
    # 30 workers at the off-policy limit, p resting on its bound (the need reads as the whole
    # pool): the share rules would take a worker a cooldown. Where the last removal on the
    # refills kept 30 (twice what makes a batch from scratch within a step), they hold there.
    memory = settled(per_worker_seqs_s=32 / 30, queue_seqs=192.0, last_active=30, last_desired=30)
    assert probe(memory, 30, queued=192, desired=30).target == 29
    kept = replace(memory, refill_kept_workers=30)
    decision = probe(kept, 30, queued=192, desired=30)
    assert decision.target == 30, decision.reason
    assert decision.reason.endswith(
        "queue at the off-policy limit, 30 kept on the refills -> hold 30"
    )
    # Workers that come start the refills, and what they kept, again.
    came = probe(kept, 31, queued=192, desired=31, active=31)
    assert came.memory.refill_kept_workers == 0


def test_a_queue_full_at_every_sample_steps_below_what_the_refills_kept() -> None:
    # The refills kept 40; the queue then full (3 batches) at every 2 s sample for a cooldown
    # while the trainer takes a batch each proves, without the bound D / active, that the pool
    # makes twice what the trainer takes: a quarter goes, past the refills' count.
    memory = replace(settled(per_worker_seqs_s=0.5, last_active=40), refill_kept_workers=40)
    count, decisions = 40, []
    for _ in range(12):
        decision = probe(memory, count, queued=192, desired=count)
        decisions.append(decision)
        memory, count = decision.memory, decision.target
    assert [d.target for d in decisions] == [40] * 10 + [30] * 2, decisions[-1].reason
    assert decisions[0].reason.endswith("40 kept on the refills -> hold 40")
    assert "the queue full at every sample for 20s at a time" in decisions[10].reason


def test_the_descent_at_the_limit_stops_at_the_need_p_measured_above_its_bound_puts() -> None:
    # 8 workers hold the queue at the off-policy limit (full at every other sample) for a
    # trainer taking 32 seq/s; p was measured below the limit at 4.25 seq/s per worker, above
    # its bound there (32 / 8): the need, 7.5, keeps all 8. (A real Atropos loop went from 2
    # workers to 1 where 1.6 were needed, and its trainer waited.) With p on its bound the
    # need says nothing, and the descent goes on a worker at a time.
    def run(per_worker: float, queued: list[int]) -> list[Decision]:
        memory = settled(queue_seqs=192.0, per_worker_seqs_s=per_worker, last_active=8)
        count, decisions = 8, []
        for sample in queued:
            decision = probe(memory, count, queued=sample, desired=count)
            decisions.append(decision)
            memory, count = decision.memory, decision.target
        return decisions

    measured = run(4.25, [192, 160] * 7)
    assert [d.target for d in measured] == [8] * 14, [d.reason for d in measured]
    assert measured[-1].reason.endswith(
        "queue at the off-policy limit, the need at 4.25 seq/s per worker keeps 8 -> hold 8"
    )
    on_bound = run(4.0, [192, 160] * 7)
    assert [d.target for d in on_bound] == [7] * 10 + [6] * 4, [d.reason for d in on_bound]
    # A queue full at every sample for a cooldown proves a quarter of the pool spare on its
    # own: it goes below that need.
    full = run(4.25, [192] * 12)
    assert full[-1].target == 6, full[-1].reason
    assert "the queue full at every sample" in full[-2].reason


def test_p_measured_where_nothing_could_land_is_not_trusted_over_its_bound() -> None:
    # 40 workers at the off-policy limit feed a trainer taking 32 seq/s: each makes at least
    # 0.8 seq/s. p "measured" over two start-ups at 0.01 seq/s comes from intervals in which
    # nothing could land (the envs restarting after the limit cancelled their groups): it
    # would ask for 3200 workers and hold the pool for good. p rests on what entered the
    # queue per worker, and the pool steps down at the limit as one whose p was never
    # measured: a worker a cooldown (its need on that bound is the whole pool).
    censored = settled(queue_seqs=192.0, last_active=40, last_desired=40,
                       per_worker_seqs_s=0.01, fresh_s=60.0)  # fmt: skip
    assert BufferPolicy().per_worker(censored) == pytest.approx(32.0 / 40)
    decision = probe(censored, 40)
    assert decision.target == 39, decision.reason
    assert "queue at the off-policy limit -> stepping down to 39" in decision.reason
    # The same where nothing landed in any interval p counted (p reads 0): read as measured,
    # the rules fell back on the bound, its need the whole pool, and held 40 for good.
    nothing = replace(censored, per_worker_seqs_s=0.0)
    assert BufferPolicy().per_worker(nothing) == pytest.approx(32.0 / 40)
    decision = probe(nothing, 40)
    assert decision.target == 39, decision.reason
    assert "queue at the off-policy limit -> stepping down to 39" in decision.reason
    # p measured at 4 seq/s over two start-ups is trusted: down by the need (8 workers), a
    # quarter of the pool at a time.
    measured = replace(censored, per_worker_seqs_s=4.0)
    decision = probe(measured, 40)
    assert decision.target == 30, decision.reason
    assert "need 8.00 workers" in decision.reason


def test_a_queue_full_at_most_samples_steps_down_by_what_they_prove() -> None:
    # 40 workers whose p rests on its bound (the need reads as the whole pool), 120-s start-ups,
    # a step per 2 s: the full queue covers a shortfall for two steps, a sixtieth of a
    # start-up, so the share rules take a twentieth. The queue is full at 9 samples in 10 (a
    # take leaves it a batch short now and then): each take was made again within about a
    # sample interval, which proves 90% of a quarter of the pool spare (step / (interval +
    # step), at most max_down_fraction), and each removal takes a tenth (the most a share at
    # the limit takes), not a worker.
    memory, count, targets = settled(per_worker_seqs_s=0.5, last_active=40, startup_s=120.0), 40, []
    for sample in ([192] * 9 + [128]) * 14:
        decision = probe(memory, count, queued=sample, desired=count)
        if decision.target != count:
            targets.append(decision.target)
            assert "full at 90% of the samples" in decision.reason or targets == [39]
        memory, count = decision.memory, decision.target
    assert targets == [39, 36, 33], targets


def test_a_count_found_short_floors_the_descent_at_the_need_its_demand_put() -> None:
    # 6 workers were short at 32 seq/s; the demand estimate now reads 26 (a fifth low: the
    # jitter of the estimate, not a slower trainer). At the limit, the descent stops at the need
    # that the demand which found 6 short puts at p as measured (32 / 4 = 8), not at a worker
    # above the count found short, where the low reading alone would take it (26 / 4 -> 7).
    low = settled(
        queue_seqs=180.0,
        demand_seqs_s=26.0,
        fast_demand_seqs_s=26.0,
        short_workers=6,
        short_demand_seqs_s=32.0,
        last_active=8,
        last_desired=8,
    )
    decision = probe(low, 8)
    assert decision.target == 8, decision.reason
    assert probe(low, 9).target == 8
    # A trainer that slowed by more than a worker makes and by 40%: the floor goes.
    slower = replace(low, demand_seqs_s=16.0, fast_demand_seqs_s=16.0, last_advance_t=98.0)
    assert probe(slower, 8).target < 8
