"""core.policies.buffer.addition (rule 3): workers added before the queue leaves the band.

Batch 64 sequences throughout. Each test drives the policy with samples as the reducer would
(``desired`` is the count the reducer applied) and checks what it measured or decided.
"""

from __future__ import annotations

from core.records import replace
from tests.core.buffer_helpers import probe, settled


def test_a_trainer_that_steps_seldom_is_fed_before_the_queue_leaves_the_band() -> None:
    # A step per 40 s (D = 1.6 seq/s), a 10 s start-up, p = 0.2 seq/s/worker (need 8): 5
    # workers drain 0.6 seq/s. The queue (50 seq) is inside the band [32, 96] and would not
    # empty within a start-up, but within a step it falls below the band's bottom, where the
    # trainer starts to wait: the pool grows now, not once the queue has left the band.
    slow = settled(queue_seqs=50.0, demand_seqs_s=1.6, fast_demand_seqs_s=1.6,
                   per_worker_seqs_s=0.2, production_seqs_s=1.0, last_active=5, last_desired=5,
                   startup_s=10.0)  # fmt: skip
    decision = probe(slow, 5, steps=0)
    assert decision.target >= 8, decision.reason
    assert "batches in 40s" in decision.reason
    # A trainer that steps many times per start-up (a step per 2 s, a 20 s start-up), the same
    # queue falling by 1.5 seq/s: it stays inside the band for the start-up and the pool holds.
    fast = settled(queue_seqs=50.0, per_worker_seqs_s=4.35, production_seqs_s=30.5,
                   last_active=7, last_desired=7)  # fmt: skip
    assert probe(fast, 7, steps=0).target == 7


def test_an_addition_with_the_pool_in_place_marks_the_count_short() -> None:
    # 8 workers for a while, p measured over its window, and the queue would empty within a
    # start-up (8 x 4 < 36 seq/s): more, and 8 is short.
    memory = settled(queue_seqs=40.0, active_changed_t=0.0, production_seen_s=300.0,
                     demand_seqs_s=36.0, fast_demand_seqs_s=36.0)  # fmt: skip
    decision = probe(memory, 8)
    assert decision.target >= 9, decision.reason
    assert decision.memory.short_workers == 8
    # The cold start's pool, just in place: no mark (its p is from the first groups).
    fresh = replace(memory, active_changed_t=95.0, production_seen_s=30.0)
    assert probe(fresh, 8).memory.short_workers is None


def test_workers_just_up_defer_a_reaction_to_the_queue_not_to_a_demand_they_cannot_meet() -> None:
    # 8 workers, the last of them active for 2 s (their first groups still in generation),
    # the queue low (40 seq). What the trainer takes (32 seq/s) the 8 make once their groups
    # are in: the pool waits for them.
    warming = settled(queue_seqs=40.0, last_up_t=90.0, active_changed_t=98.0)
    held = probe(warming, 8)
    assert held.target == 8, held.reason
    # The trainer sped up: it takes 64 seq/s, twice what the whole pool makes. No group in
    # generation changes that: the pool grows now, not a settle time later.
    faster = replace(warming, demand_seqs_s=64.0, fast_demand_seqs_s=64.0)
    decision = probe(faster, 8, steps=2)
    assert decision.target >= 16, decision.reason
