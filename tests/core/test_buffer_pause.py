"""core.policies.buffer.pause (rule 4): nothing removed while the trainer pauses; a long pause
lets the pool go where asked to.

Batch 64 sequences throughout. Each test drives the policy with samples as the reducer would
(``desired`` is the count the reducer applied) and checks what it measured or decided.
"""

from __future__ import annotations

import pytest

from core import ConfigError
from core.policies import BufferPolicy
from core.records import replace
from tests.core.buffer_helpers import ctx, probe, settled


def test_a_pause_holds_and_demand_is_measured_afresh_after_it() -> None:
    # A batch waits but no step for 102 - 80 = 22 s > 4 steps of 2 s: a pause (or a slowdown).
    paused = probe(settled(queue_seqs=150.0, last_advance_t=80.0), 10, steps=0)
    assert paused.target == 10
    assert "no trainer step for 22s" in paused.reason
    # The trainer steps again: the span was a pause, not a slower trainer; until demand is
    # measured again, nothing is removed.
    resumed = probe(settled(queue_seqs=150.0, last_advance_t=80.0), 10)
    assert resumed.memory.resumed_t == 102.0
    assert resumed.memory.demand_seen_s == 0.0
    assert resumed.memory.demand_seqs_s == 32.0  # the span was not folded in
    assert resumed.target == 10
    assert "since the trainer resumed" in resumed.reason


def test_the_hold_after_a_pause_ends_once_its_demand_is_measured() -> None:
    # Resumed at 50 s, demand measured for 58 of the 60 s (30 steps of 2 s) the hold waits for.
    waiting = settled(queue_seqs=150.0, resumed_t=50.0, demand_seen_s=58.0)
    held = probe(waiting, 10)
    assert held.memory.demand_seen_s == 60.0
    # Measured over the whole window: the pause is over, and the removal rule decides.
    assert held.memory.resumed_t is None
    assert "since the trainer resumed" not in held.reason
    # Later the trainer slows to 3-s steps: the window grows to 90 s, past the 60 s seen. Had
    # the pause been kept, that would hold removals again for 30 of the slower steps.
    slower = replace(held.memory, demand_seqs_s=64 / 3, fast_demand_seqs_s=64 / 3, last_t=102.0)
    later = probe(slower, 10)
    assert "since the trainer resumed" not in later.reason, later.reason
    kept = probe(replace(slower, resumed_t=50.0), 10)
    assert "since the trainer resumed, 89s needed -> hold 10" in kept.reason, kept.reason


def test_a_pause_longer_than_a_start_up_lets_the_pool_go_where_asked_to() -> None:
    release = BufferPolicy(pause_release_startups=1.0)
    # No step for 22 s, longer than a start-up (20 s): the pool goes to its minimum, and
    # remembers the 10 it had.
    before = settled(queue_seqs=150.0, last_advance_t=80.0, fresh_s=100.0, last_active=10)
    paused = probe(before, 10, steps=0, policy=release)
    assert paused.target == 0, paused.reason
    assert "no trainer step for 22s, longer than 20s (1 x the start-up): a pause -> 0" in (
        paused.reason
    )
    assert paused.memory.workers_before_pause == 10
    # Later samples of the same pause keep the count it let go, not the minimum.
    later = replace(paused.memory, last_t=130.0)
    still = release.decide(ctx(132.0, 150, 50, current=0), later)
    assert still.target == 0 and still.memory.workers_before_pause == 10
    # The trainer steps again: the 10 come back at once.
    back = release.decide(ctx(134.0, 86, 51, current=0), still.memory)
    assert back.target == 10, back.reason
    assert "the trainer stepped again after a pause -> 10 workers" in back.reason
    assert back.memory.workers_before_pause is None
    # They are the workers p was measured with: their coming back keeps it the pool's.
    assert back.memory.returning_workers == 10
    half = release.decide(ctx(136.0, 150, 51, current=10, active=5), back.memory)
    assert half.memory.fresh_s >= 100.0 and half.memory.returning_workers == 10
    whole = release.decide(ctx(138.0, 150, 51, current=10, active=10), half.memory)
    assert whole.memory.fresh_s >= 100.0 and whole.memory.returning_workers is None
    more = release.decide(ctx(140.0, 150, 51, current=11, active=11), whole.memory)
    assert more.memory.fresh_s == 0.0  # a worker beyond them is new
    # At most the pool's maximum comes back.
    capped = release.decide(ctx(134.0, 86, 51, current=0, max_workers=8), still.memory)
    assert capped.target == 8
    assert "-> 8 workers (the 10 before it, at the pool's maximum)" in capped.reason
    # Where the reducer held the pool (its stabilization window), nothing was let go: the
    # next step brings nothing back, and the other rules decide.
    held = release.decide(ctx(134.0, 86, 51, current=10), still.memory)
    assert "after a pause" not in held.reason
    assert held.memory.workers_before_pause is None
    # A pause shorter than the start-up, or the default (hold through pauses): held.
    short = BufferPolicy(pause_release_startups=2.0)
    assert (
        probe(settled(queue_seqs=150.0, last_advance_t=80.0), 10, steps=0, policy=short).target
        == 10
    )
    assert probe(settled(queue_seqs=150.0, last_advance_t=60.0), 10, steps=0).target == 10
    with pytest.raises(ConfigError, match="pause_release_startups must be >= 0"):
        BufferPolicy(pause_release_startups=-1.0)
