"""core.policies.buffer.measure: demand, start-up and production per worker, from queue samples
alone.

Batch 64 sequences throughout. Each test drives the policy with samples as the reducer would
(``desired`` is the count the reducer applied) and checks what it measured or decided.
"""

from __future__ import annotations

from typing import Any

import pytest

from core.policies import BufferMemory, BufferPolicy
from core.policies.buffer.constants import REFILL_TAKES
from core.records import replace
from tests.core.buffer_helpers import ctx, settled

# --- measurements --------------------------------------------------------------------------------


def test_demand_comes_from_step_advances_without_sampling_ripple() -> None:
    # A trainer stepping every 5 s, sampled every 2 s: advances are seen after 4 or 6 s, yet
    # the estimate (a running mean over the spans while the window fills) is exactly 64 / 5.
    policy = BufferPolicy()
    memory = None
    for k in range(26):
        t = 2.0 * k
        memory = policy.decide(ctx(t, 100, int(t // 5), current=4), memory).memory
    assert memory is not None
    # First advance seen at t=6 (step 1), last at t=50 (step 10): 9 steps over 44 s.
    assert memory.demand_seqs_s == pytest.approx(9 * 64 / 44)


@pytest.mark.parametrize("step_s", [0.5, 6.0])  # 4x faster or 3x slower than 2 s
def test_a_trainer_that_changes_speed_is_believed_within_a_few_steps(step_s: float) -> None:
    policy = BufferPolicy()
    memory = settled(demand_seqs_s=32.0, fast_demand_seqs_s=32.0, demand_seen_s=60.0)
    t, step, progress = 100.0, 50, 0.0
    for _ in range(10 if step_s > 2 else 3):
        progress += 2.0 / step_s
        taken = int(progress) - (step - 50)
        t, step = t + 2.0, step + taken
        memory = policy.decide(ctx(t, 80, step, current=8), memory).memory
    assert memory.demand_seqs_s is not None
    assert memory.demand_seqs_s == pytest.approx(64 / step_s, rel=0.35)


def test_a_speed_up_is_believed_within_ten_of_the_new_steps() -> None:
    # 4 s steps, then 0.5 s, sampled every second: two new steps per sample. The quick estimate
    # averages step times over steps, so ten of the new steps move it most of the way (over
    # three old steps' worth of seconds, as before, it read 81 seq/s of the 128 here).
    policy = BufferPolicy()
    memory = settled(demand_seqs_s=16.0, fast_demand_seqs_s=16.0, demand_seen_s=120.0)
    t, step = 100.0, 50
    for _ in range(5):
        t, step = t + 1.0, step + 2
        memory = policy.decide(ctx(t, 80, step, current=8), memory).memory
    assert memory.demand_seqs_s is not None
    assert memory.demand_seqs_s >= 0.7 * 128


def test_a_speed_up_restarts_the_queue_average() -> None:
    # Steps of 2 s, the queue averaged at 150 seq; then three steps in 2 s, the queue emptied to
    # 8: the average over the slower steps is another trainer's (it would read 2 batches while
    # every sample finds less than one), so it starts again from the sample.
    policy = BufferPolicy()
    memory = settled(queue_seqs=150.0, last_queued_seqs=150)
    faster = policy.decide(ctx(102.0, 8, 53, current=8), memory).memory
    assert isinstance(faster, BufferMemory)
    assert faster.queue_seqs == 8.0
    # Read while batches waited, the speed-up is the trainer's: recorded with the demand
    # before it (a starving trainer's growths follow it, rule 2).
    assert faster.sped_up_t == 102.0
    assert faster.sped_up_from_seqs_s == 32.0
    # Starving (less than a batch before the interval), the quick rate is what the pool
    # makes: a rise there is workers added or jitter, not the trainer.
    starving = replace(memory, queue_seqs=8.0, last_queued_seqs=8)
    pool_made = policy.decide(ctx(102.0, 8, 53, current=8), starving).memory
    assert isinstance(pool_made, BufferMemory)
    assert pool_made.sped_up_t is None
    # The same emptier sample at the same step rate is averaged in.
    same = policy.decide(ctx(102.0, 8, 51, current=8), memory).memory
    assert isinstance(same, BufferMemory)
    assert same.queue_seqs > 8.0
    # And so is one after a slow-down (no step in 6 s).
    slower = policy.decide(ctx(106.0, 8, 50, current=8), replace(memory, last_advance_t=100.0))
    assert isinstance(slower.memory, BufferMemory)
    assert slower.memory.queue_seqs > 8.0


def test_an_addition_records_the_pool_and_the_rate_it_grew_from() -> None:
    # Applied between two samples (the reducer's desired count rose from 8 to 12).
    policy = BufferPolicy()
    memory = settled(fast_demand_seqs_s=30.0)
    grown = policy.decide(ctx(102.0, 40, 51, current=12, active=8, desired=12), memory).memory
    assert isinstance(grown, BufferMemory)
    assert (grown.up_from_workers, grown.up_from_seqs_s) == (8, 30.0)
    assert grown.last_up_t == 100.0


def test_production_per_worker_that_falls_is_read_from_the_recent_quarter_of_its_window() -> None:
    # The same 8 workers for 5 minutes made 4 seq/s each; their groups grow longer and they make
    # 3 (the trainer takes 3 batches per 8 s sample, as much as they make, so the queue stays
    # put). After 96 s the 300 s average still reads 3.73; the quarter-window one reads 3.28 and
    # sizes the pool.
    policy = BufferPolicy()
    memory = settled(
        demand_seqs_s=24.0,
        fast_demand_seqs_s=24.0,
        production_seen_s=300.0,
        active_changed_t=-300.0,
    )
    t, step = 100.0, 50
    for _ in range(12):
        t, step = t + 8.0, step + 3
        decision = policy.decide(ctx(t, 80, step, current=8), memory)
        memory = decision.memory
    assert memory.per_worker_seqs_s == pytest.approx(3.73, abs=0.01)
    assert memory.recent_per_worker_seqs_s == pytest.approx(3.28, abs=0.01)
    assert "3.28 seq/s per worker" in decision.reason, decision.reason
    # The same fall right after workers came may be a shared inference saturating (more
    # workers would not help): the whole window's p sizes the pool.
    assert policy.per_worker(memory) == memory.recent_per_worker_seqs_s
    crowded = replace(memory, active_changed_t=t - 100.0)
    assert policy.per_worker(crowded) == memory.per_worker_seqs_s


def test_start_up_is_measured_from_counted_to_active() -> None:
    policy = BufferPolicy()
    memory = policy.decide(ctx(0.0, 0, 0, current=4, active=0), None).memory
    assert memory.pending_t == (0.0,) * 4
    memory = policy.decide(ctx(2.0, 0, 0, current=6, active=0), memory).memory
    assert memory.pending_t == (0.0,) * 4 + (0.0,) * 2  # counted since the previous sample
    memory = policy.decide(ctx(32.0, 0, 0, current=6, active=3), memory).memory
    assert memory.startup_s == pytest.approx(32.0)
    assert memory.pending_t == (0.0,) * 3
    assert policy.startup(memory) == pytest.approx(32.0)
    # Before any is seen, the oldest still starting sets a floor under the prior (30 s).
    cold = policy.decide(ctx(50.0, 0, 0, current=2, active=0), None).memory
    cold = policy.decide(ctx(95.0, 0, 0, current=2, active=0), cold).memory
    assert policy.startup(cold) == pytest.approx(45.0)


def test_production_is_not_measured_near_the_limit_nor_just_after_workers_came() -> None:
    # batch 10, limit 0.8 x 5 x 10 = 40 seq
    policy = BufferPolicy(max_batches_offpolicy=5.0)
    memory = policy.decide(ctx(100.0, 0, 0, current=1, batch=10), None).memory
    memory = policy.decide(ctx(110.0, 10, 0, current=1, batch=10), memory).memory
    assert memory.per_worker_seqs_s == pytest.approx(1.0)  # the first: (10 - 0) / 10 s / 1
    memory = policy.decide(ctx(120.0, 45, 0, current=1, batch=10), memory).memory
    assert memory.per_worker_seqs_s == pytest.approx(1.0)  # 45 >= 40: the envs held back
    memory = policy.decide(ctx(130.0, 35, 1, current=2, batch=10), memory).memory
    assert memory.per_worker_seqs_s == pytest.approx(1.0)  # a worker just came
    assert memory.active_changed_t == 130.0


def test_a_censored_production_is_measured_afresh_once_groups_can_land() -> None:
    # 8 workers fed a trainer taking 32 seq/s, but p read 0 (its intervals all fell where
    # nothing could land: the envs restarting after the off-policy limit). The first interval
    # in which groups land (64 seq in 2 s, 4 seq/s per worker) replaces it: averaged in over
    # the window, p would read a few percent of that for minutes, and the pool stay at need / p.
    policy = BufferPolicy()
    memory = settled(per_worker_seqs_s=0.0, recent_per_worker_seqs_s=0.0)
    after = policy.decide(ctx(102.0, 80, 51, current=8), memory).memory
    assert after.per_worker_seqs_s == pytest.approx(4.0)
    assert after.recent_per_worker_seqs_s == pytest.approx(4.0)
    # A p that is not censored (3 seq/s against 4 delivered) is averaged as before.
    memory = settled(per_worker_seqs_s=3.0, recent_per_worker_seqs_s=3.0)
    after = policy.decide(ctx(102.0, 80, 51, current=8), memory).memory
    assert 3.0 < after.per_worker_seqs_s < 3.1


def test_p_read_soon_after_the_limit_gives_way_to_the_first_interval_away_from_it() -> None:
    # A cold start hovering near the limit measured p at 1.3 seq/s per worker, only in
    # intervals soon after it (the groups it cancelled were still in generation). The first
    # interval away from the limit (64 seq in 2 s by 8 workers: 4 seq/s each) starts p afresh:
    # averaged with those, p would read 2.1 after a hundred seconds away, and a pool back
    # near the limit would hold that for the rest of the run.
    policy = BufferPolicy()
    memory = settled(
        per_worker_seqs_s=1.3,
        recent_per_worker_seqs_s=1.3,
        production_seen_s=24.0,
        near_limit_p=True,
        limit_t=60.0,
    )
    after = policy.decide(ctx(102.0, 80, 51, current=8), memory).memory
    assert after.per_worker_seqs_s == pytest.approx(4.0)
    assert after.recent_per_worker_seqs_s == pytest.approx(4.0)
    assert (after.near_limit_p, after.restarted_away_p) == (False, True)
    # The next interval is averaged with it, over the seconds measured since.
    later = policy.decide(ctx(104.0, 48, 52, current=8), after).memory
    assert later.per_worker_seqs_s == pytest.approx((4.0 + 2.0) / 2)
    # From then on an interval soon after the limit stands in no longer, even for a p
    # measured for less than a settle time.
    near = replace(later, limit_t=103.0, production_seen_s=2.0)
    held = policy.decide(ctx(106.0, 80, 53, current=8), near).memory
    assert held.per_worker_seqs_s == later.per_worker_seqs_s
    # Without intervals from near the limit behind it, p is averaged as before.
    plain = policy.decide(ctx(102.0, 80, 51, current=8), replace(memory, near_limit_p=False))
    assert 1.3 < plain.memory.per_worker_seqs_s < 2.0


def test_a_speed_up_seen_through_the_quick_average_is_seen_against_the_demand_before_it() -> None:
    # 7-s steps (36.6 seq/s), then 3.5 s, one advance per sample. The quick estimate averages
    # step times over three steps, and the demand follows it half-way while it reads 10-25%
    # off: compared with that demand, it never reads 25% above it. Compared with the demand
    # before the rise began, the speed-up is seen on the second of the new steps.
    policy = BufferPolicy()
    memory = settled(
        demand_seqs_s=256 / 7,
        fast_demand_seqs_s=256 / 7,
        demand_seen_s=210.0,
        last_t=100.0,
        last_advance_t=100.0,
        queue_seqs=400.0,
        last_queued_seqs=400,
    )
    seen = []
    t, step = 100.0, 50
    for _ in range(6):
        t, step = t + 3.5, step + 1
        memory = policy.decide(ctx(t, 400, step, current=12, batch=256), memory).memory
        seen.append(memory.sped_up_t)
    assert seen[0] is None
    assert seen[1] == pytest.approx(107.0)
    assert memory.sped_up_from_seqs_s == pytest.approx(256 / 7, rel=0.02)
    assert memory.demand_seqs_s == pytest.approx(256 / 3.5, rel=0.2)


def test_a_trainer_back_from_a_pause_faster_than_it_went_is_seen_to_speed_up() -> None:
    # 16 seq/s before a pause; the trainer resumed and, a batch waiting, stepped every 2 s
    # (32 seq/s). The demand is measured afresh after a pause, so against the fresh average
    # the quick rate never reads high; against the demand before the pause it reads twice
    # that: a speed-up, with the quick rate then kept (a starving trainer's soon reads only
    # what the pool makes).
    paused = settled(
        demand_seqs_s=16.0,
        fast_demand_seqs_s=None,
        demand_seen_s=0.0,
        resumed_t=98.0,
        queue_seqs=192.0,
        last_queued_seqs=192,
    )
    memory = BufferPolicy().decide(ctx(102.0, 128, 51, current=8), paused).memory
    assert memory.demand_seqs_s == pytest.approx(32.0)
    assert memory.sped_up_t == 102.0
    assert memory.sped_up_from_seqs_s == 16.0
    assert memory.sped_up_to_seqs_s == pytest.approx(32.0)
    # Back at the pace it went: no speed-up.
    same = replace(paused, last_advance_t=98.0)
    assert BufferPolicy().decide(ctx(102.0, 128, 51, current=8), same).memory.sped_up_t is None


@pytest.mark.parametrize("landed", [40, 0])
def test_a_cold_pool_is_measured_over_a_settle_time_not_on_the_interval_its_workers_came(
    landed: int,
) -> None:
    # batch 32, the off-policy limit at 0.8 x 3 x 32 = 76.8 seq: 8 workers making 6 seq/s each
    # (24 seq per 0.5 s sample) for a trainer that takes every full batch queued each 2 s, so
    # the queue comes near the limit every cycle (the envs hold back at 3 batches). The
    # interval in which 7 workers came reads 80 seq/s per worker (40 sequences: their first
    # groups landed at once, counted as the one worker active throughout) or 0 (none yet).
    policy = BufferPolicy()

    def sample(memory: BufferMemory | None, t: float, queued: int, step: int, current: int) -> Any:
        context = ctx(t, queued, step, current=current, batch=32, max_workers=8)
        return policy.decide(context, memory).memory

    memory = sample(None, 0.0, 0, 0, 1)
    queued, step = landed, 0
    memory = sample(memory, 0.5, queued, step, 8)
    assert memory.per_worker_seqs_s is None
    readings = []
    for k in range(2, 80):
        queued = min(queued + 24, 96)
        if k % 4 == 0:
            step, queued = step + queued // 32, queued % 32
        memory = sample(memory, 0.5 * k, queued, step, 8)
        readings.append(memory.per_worker_seqs_s)
    # Measured from the intervals with the same 8 workers, not left at a single interval's.
    assert all(p is None or p < 12.0 for p in readings), readings
    assert memory.per_worker_seqs_s is not None
    assert memory.per_worker_seqs_s == pytest.approx(6.0, rel=0.25)


def test_refills_of_the_full_queue_are_timed_in_worker_seconds() -> None:
    # 8 workers hold the queue at the off-policy limit (3 batches); samples every 2 s.
    policy = BufferPolicy()
    memory = settled(queue_seqs=192.0, full_since_t=100.0, full_since_step=50)

    def sample(queued: int, step: int, active: int = 8) -> BufferMemory:
        t = memory.last_t + 2.0
        return policy.decide(ctx(t, queued, step, current=active), memory).memory

    memory = sample(192, 51)  # taken and full again within the interval: 2 s x 8 workers
    assert memory.refills_worker_s == (16.0,)
    memory = sample(128, 52)  # taken, a batch short at the next sample...
    memory = sample(128, 52)
    memory = sample(192, 52)  # ...full again 6 s after the sample before the take
    assert memory.refills_worker_s == (16.0, 48.0)
    assert memory.refill_t == memory.last_t
    # A removal carries them (a smaller pool refills in fewer worker-seconds; over the
    # interval it came in, the count before it counts); workers that come start them again.
    memory = sample(192, 53, active=6)
    assert memory.refills_worker_s == (16.0, 48.0, 16.0)
    memory = sample(192, 54, active=6)
    assert memory.refills_worker_s == (16.0, 48.0, 16.0, 12.0)
    memory = sample(192, 55, active=9)
    assert memory.refills_worker_s == ()
    # Only the last REFILL_TAKES count.
    for step in range(56, 61):
        memory = sample(192, step, active=9)
    assert memory.refills_worker_s == (18.0,) * REFILL_TAKES
    # Taken again before it was full: no proof.
    memory = sample(128, 61, active=9)
    memory = sample(128, 62, active=9)
    assert memory.refills_worker_s == ()
    # A backlog above the limit (groups in flight when it was reached landed on top) is
    # still full after a take whatever the pool makes: not timed.
    memory = sample(320, 62, active=9)
    memory = sample(256, 63, active=9)
    assert memory.refills_worker_s == ()
