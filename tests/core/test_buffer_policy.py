"""core.policies.buffer: deo's default policy, from its measurements to its decisions.

Batch 64 sequences throughout. Each test drives the policy with samples as the reducer would
(``desired`` is the count the reducer applied) and checks what it measured or decided.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from core import Config, ConfigError, Configured, PolicySpec, PoolSpec, Reducer
from core.events import QueueSampled
from core.policies import BufferMemory, BufferPolicy, Decision, PolicyContext
from core.records import replace
from core.vocabulary import AlertName

BATCH = 64


def ctx(
    t: float,
    queued: int,
    step: int,
    *,
    current: int,
    active: int | None = None,
    desired: int | None = None,
    max_workers: int = 100,
    batch: int = BATCH,
    last_failure_t: float | None = None,
) -> PolicyContext:
    return PolicyContext(
        t=t,
        pool="p",
        current=current,
        active=current if active is None else active,
        min_workers=0,
        max_workers=max_workers,
        desired=current if desired is None else desired,
        last_failure_t=last_failure_t,
        queue=QueueSampled(
            t=t, pool="p", queued_sequences=queued, batch_size_seqs=batch, trainer_step=step
        ),
    )


def settled(**changes: Any) -> BufferMemory:
    """Windows full: D = 32 seq/s (a step per 2 s), p = 4 seq/s/worker (n = 8), Q = 80 seq,
    start-up 20 s measured, a production spread of 0 (target 1 batch, band [32, 96] seq)."""
    fields: dict[str, Any] = {
        "last_t": 100.0,
        "last_queued_seqs": 80,
        "last_step": 50,
        "last_active": 8,
        "queue_seqs": 80.0,
        "demand_seqs_s": 32.0,
        "fast_demand_seqs_s": 32.0,
        "last_advance_t": 100.0,
        "per_worker_seqs_s": 4.0,
        "production_seqs_s": 32.0,
        "queue_seen_s": 4.0,
        "demand_seen_s": 60.0,
        "production_seen_s": 120.0,
        "last_desired": 8,
        "startup_s": 20.0,
        "startups_seen": 8,
        "probe_t": 1.0,
    }
    fields.update(changes)
    if "queue_seqs" in changes and "last_queued_seqs" not in changes:
        fields["last_queued_seqs"] = round(changes["queue_seqs"])
    return BufferMemory(**fields)


def probe(
    memory: BufferMemory,
    count: int,
    *,
    queued: int | None = None,
    steps: int = 1,
    policy: BufferPolicy | None = None,
    **extra: Any,
) -> Decision:
    """Decide 2 s after ``memory`` on a sample of ``queued`` (default: the smoothed queue)."""
    queued = round(memory.queue_seqs) if queued is None else queued
    return (policy or BufferPolicy()).decide(
        ctx(memory.last_t + 2.0, queued, memory.last_step + steps, current=count, **extra),
        memory,
    )


# --- cold start ----------------------------------------------------------------------------------


def test_cold_start_starts_every_worker_without_opening_the_stabilization_window() -> None:
    decision = BufferPolicy().decide(ctx(0.0, 0, 0, current=1, max_workers=12), None)
    assert decision.target == 12
    assert decision.stabilize is False  # the excess is shed as soon as the rates are known
    assert "rates not measured yet" in decision.reason


def test_a_running_pool_without_rates_holds_rather_than_starting_every_worker() -> None:
    # 40 workers active, the trainer at step 500, no rates in memory (the policy just took the
    # pool over, or production stopped): not a cold pool.
    decision = BufferPolicy().decide(ctx(0.0, 10, 500, current=40, max_workers=128), None)
    assert decision.target == 40, decision.reason
    assert "40 workers active -> hold 40" in decision.reason
    # Before any worker is active it is.
    cold = BufferPolicy().decide(ctx(0.0, 10, 500, current=4, active=0, max_workers=128), None)
    assert cold.target == 128, cold.reason


def test_without_rates_the_target_reads_the_spread_in_sequences() -> None:
    # A spread of half a batch (32 sequences): target 1.5 batches, not the 2-batch ceiling
    # that a spread read as 32 batches would give.
    memory = settled(
        demand_seqs_s=None,
        fast_demand_seqs_s=None,
        last_advance_t=None,
        queue_seqs=112.0,
        spread_var_seqs2=32.0**2,
        spreads_seen=5,
    )
    decision = probe(memory, 8, queued=112, steps=0)
    assert "target 1.5;" in decision.reason, decision.reason
    assert decision.target == 8


def test_reconfiguring_the_parameters_keeps_the_measurements() -> None:
    def config(target_batches: float) -> Config:
        spec = PolicySpec(name="buffer", params={"target_batches": target_batches})
        return Config(pools=[PoolSpec(name="envs", argv=["env"], max_workers=128, policy=spec)])

    reducer = Reducer(check_invariants=True)
    reducer.step(Configured(t=0.0, config=config(1.5)))
    reducer.step(
        QueueSampled(t=1.0, pool="envs", queued_sequences=0, batch_size_seqs=BATCH, trainer_step=0)
    )
    measured = reducer.state.pools["envs"].policy_memory
    assert isinstance(measured, BufferMemory)
    reducer.step(Configured(t=2.0, config=config(2.0)))
    assert reducer.state.pools["envs"].policy_memory == measured
    # Another policy starts afresh.
    hpa = PolicySpec(name="hpa")
    other = Config(pools=[PoolSpec(name="envs", argv=["env"], max_workers=128, policy=hpa)])
    reducer.step(Configured(t=3.0, config=other))
    assert reducer.state.pools["envs"].policy_memory is None


@pytest.mark.parametrize(
    "key", ["max_up_factor", "down_cooldown_s", "integral_s", "refill_s", "startup_prior_s"]
)
@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
def test_a_parameter_that_is_not_finite_is_refused(key: str, value: float) -> None:
    with pytest.raises(ConfigError, match=f"policy.{key} must be a finite number"):
        BufferPolicy(**{key: value})


def test_cold_start_with_a_full_queue_holds() -> None:
    decision = BufferPolicy().decide(ctx(0.0, 200, 0, current=5, active=2), None)
    assert (decision.target, decision.stabilize) == (5, True)
    assert "hold 5" in decision.reason


# --- what was applied ----------------------------------------------------------------------------


def test_the_timers_follow_what_the_reducer_applied() -> None:
    policy = BufferPolicy(max_down_fraction=1.0)
    high = settled(queue_seqs=150.0, demand_seqs_s=16.0, fast_demand_seqs_s=16.0)
    removal = probe(high, 8, policy=policy)
    assert removal.target < 8
    # The reducer dropped it (stabilization): desired still 8 at the next sample.
    dropped = probe(removal.memory, 8, policy=policy)
    assert dropped.memory.last_down_t is None
    # Applied: desired fell; the removal is dated to the sample that asked for it.
    applied = policy.decide(ctx(104.0, 150, 52, current=8, desired=removal.target), removal.memory)
    assert applied.memory.last_down_t == 102.0
    # An addition clamped away (desired unchanged) is no addition either.
    assert probe(settled(queue_seqs=10.0), 8).memory.last_up_t is None


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


# --- decisions -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("queue", "count", "expected", "why"),
    [
        (64.0, 8, 8, "hold 8"),  # at the target
        (90.0, 12, 12, "hold 12"),  # above the target, inside the band (<= 96)
        # below the band and not refilling (8 x 4 - 32 = 0 seq/s): one more worker
        (20.0, 8, 9, "-> 9 workers"),
        # above the band: to balance (32 / 4 = 8), at most a quarter at once
        (130.0, 10, 8, "stepping down to 8"),
        (130.0, 20, 15, "stepping down to 15"),
        (130.0, 8, 8, "hold 8"),
    ],
)
def test_band_decisions(queue: float, count: int, expected: int, why: str) -> None:
    decision = probe(settled(queue_seqs=queue), count)
    assert decision.target == expected, decision.reason
    assert why in decision.reason


def test_a_queue_held_up_near_the_limit_bounds_production_per_worker_from_below() -> None:
    # 40 workers hold the queue at 2.3 batches (above the band, below 0.8 of the limit), near
    # the limit 1 s ago: they make at least D / 40 = 0.8 seq/s each, where p, measured only
    # after the visits there, reads 0.5 (a need of 64: the pool would be held as short).
    def decide(limit_t: float | None, queue: float = 150.0) -> Decision:
        memory = settled(queue_seqs=queue, per_worker_seqs_s=0.5, recent_per_worker_seqs_s=0.5,
                         limit_t=limit_t, last_active=40, last_desired=40)  # fmt: skip
        return probe(memory, 40)

    held = decide(limit_t=99.0)
    assert "0.80 seq/s per worker" in held.reason
    assert held.target == 39, held.reason  # the pool steps down as at the limit
    # Not near the limit for longer than a settle time (4 steps, 10 s at least): p as measured.
    assert "0.50 seq/s per worker" in decide(limit_t=50.0).reason
    assert decide(limit_t=None).target == 40
    # Inside the band the queue may be falling: p as measured.
    assert "0.50 seq/s per worker" in decide(limit_t=99.0, queue=90.0).reason


def test_never_removes_while_the_latest_sample_is_not_above_the_band() -> None:
    # The smoothed queue reads 2 batches (above the band top 96), the sample just drained.
    decision = probe(settled(queue_seqs=130.0), 10, queued=16)
    assert decision.target == 10
    assert "last 0.25" in decision.reason


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


def test_saturation_stops_growth_and_sheds() -> None:
    # The last growth went from 10 active workers making 40 seq/s to 20 active, and p fell
    # to 2.1: 42 seq/s. Inference, not workers, is the limit: hold what makes that, 11.
    memory = grown_while_starving(
        per_worker_seqs_s=2.1,
        production_seqs_s=42.0,
        probe_t=40.0,
        last_up_t=None,
        active_changed_t=-100.0,  # two settle times (2 x 30 steps of 2 s) ago
    )
    decision = probe(memory, 20, queued=8)
    assert decision.target == 11, decision.reason
    assert "saturates" in decision.reason
    after = decision.memory
    assert after.saturated_workers == 11
    # While it holds, a starving trainer adds nothing.
    later = replace(after, last_t=200.0, last_advance_t=200.0)
    assert probe(later, 11, queued=8, desired=11).target == 11


def test_an_explicit_target_is_kept() -> None:
    policy = BufferPolicy(target_batches=2.0)
    assert policy.target(settled(spread_var_seqs2=1e9, spreads_seen=5), BATCH) == 2.0
    auto = BufferPolicy()
    assert auto.target(settled(), BATCH) == 1.0
    # A spread of a batch over a start-up: a deeper buffer, never past the limit minus 1.
    assert auto.target(settled(spread_var_seqs2=64.0**2, spreads_seen=5), BATCH) == 2.0


@settings(max_examples=150, deadline=None)
@given(
    fraction=st.sampled_from([0.05, 0.25, 1.0]),
    batch=st.integers(min_value=1, max_value=128),
    samples=st.lists(
        st.tuples(
            st.floats(min_value=0.5, max_value=60.0),  # seconds since the previous sample
            st.integers(min_value=0, max_value=1000),  # queued sequences
            st.integers(min_value=0, max_value=3),  # trainer steps taken
            st.integers(min_value=0, max_value=40),  # counted workers
            st.integers(min_value=0, max_value=40),  # active (capped at counted)
        ),
        min_size=1,
        max_size=30,
    ),
)
def test_properties(
    fraction: float, batch: int, samples: list[tuple[float, int, int, int, int]]
) -> None:
    policy = BufferPolicy(max_down_fraction=fraction)
    memory, t, step = None, 0.0, 0
    for dt, queued, steps, current, active in samples:
        t, step = t + dt, step + steps
        context = ctx(t, queued, step, current=current, active=min(active, current), batch=batch)
        decision = policy.decide(context, memory)
        after = decision.memory
        assert decision.target >= 0
        assert decision.reason
        if decision.target < current and "saturat" in decision.reason:
            # shedding what the shared inference cannot serve: to the count measured to make
            # what the pool makes, or a test of at most a quarter of the pool
            tested = decision.target >= current - max(1, current // 4) and after.shed_workers
            assert after.saturated_workers == decision.target or tested
        elif decision.target < current:
            # removals: at most a quarter (or the fraction) at once, only from above the band
            # as smoothed and as last sampled, never without a demand estimate; at the
            # off-policy limit, workers not yet up may all go (they make nothing yet)
            if "not yet up" in decision.reason or "still starting" in decision.reason:
                assert decision.target >= context.active
            if "not yet up" in decision.reason:
                assert queued >= 0.8 * policy.max_batches_offpolicy * batch
            elif "still starting" not in decision.reason:
                assert decision.target >= current - max(1, math.floor(current * fraction))
            band_top = (policy.target(after, batch) + policy.band_batches) * batch
            assert after.queue_seqs > band_top
            assert queued > band_top
            assert after.demand_seqs_s is not None
        memory = after


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
    # queue held at the limit takes a worker at a time.
    sagged = run([192] * 5 + [128] + [192] * 6)
    assert sagged[-1] == 38, sagged
    # A backlog above the limit (groups in flight when it was reached landed on top) stays
    # full whatever the pool makes: no proof.
    backlog = run([320] * 12)
    assert backlog[-1] == 38, backlog


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


# --- what no count fixes ---------------------------------------------------------------------


def stall_cycles(cycles: int, *, landing_seqs: int = 0, wait_samples: int = 5) -> list[Decision]:
    """Every 2 s: the queue at the off-policy limit (3 batches), the trainer taking it down a
    batch a sample (``landing_seqs`` landing meanwhile), then waiting ``wait_samples`` samples
    on what is left, until a burst fills it to the limit again."""
    memory, decisions = settled(queue_seqs=192.0), []
    for _ in range(cycles):
        queued, samples = 3 * BATCH, [(3 * BATCH, 0)]
        for _ in range(3):
            queued = queued - BATCH + landing_seqs
            samples.append((queued, 1))
        samples += [(queued, 0)] * wait_samples
        for queued, steps in samples:
            decision = probe(memory, 8, queued=queued, steps=steps)
            memory = decision.memory
            decisions.append(decision)
    return decisions


def test_a_trainer_left_waiting_each_time_the_queue_falls_from_the_limit_is_reported() -> None:
    # Groups that outlast the two steps the queue above one batch lasts: nothing lands from the
    # limit down, and the trainer waits 10 s (five of its steps) each time. The third time in
    # 30 minutes is reported, naming the remedy; more workers would not shorten the wait.
    decisions = stall_cycles(3)
    assert all(not d.alerts for d in decisions[:-5])
    # Meanwhile the pool never grows: the wait is not a short pool.
    assert max(d.target for d in decisions) == 8
    assert "less than a batch landed since the queue left the off-policy limit" in (
        decisions[-1].reason
    )
    (alert, reason) = decisions[-1].alerts[0]
    assert alert is AlertName.OFFPOLICY_STALLS
    assert "3 times in 30 minutes" in reason and "raise max_batches_offpolicy" in reason
    # The last wait (from under a batch to the refill) was 12 s, six steps of 2 s: a limit six
    # batches higher would have covered it.
    assert "to 9 at least (the last wait was 12s)" in reason
    # A batch landing as the queue falls (the envs make again after a take): not a stall.
    assert not any(d.alerts for d in stall_cycles(4, landing_seqs=24))
    # Less than a batch (a group now and then): the trainer still waits, a stall.
    assert stall_cycles(3, landing_seqs=8)[-1].alerts
    # The trainer taking its last batch and a group landing within a step: not a stall.
    assert not any(d.alerts for d in stall_cycles(4, wait_samples=0))


def test_a_trainer_restart_that_empties_the_queue_is_not_a_stall() -> None:
    # At the limit, then the trainer (or the API server) restarts: its step goes back to 0 and
    # the queue is empty. Not the trainer taking what the envs stopped making.
    memory = stall_cycles(2)[-1].memory
    decision = probe(memory, 8, queued=192, steps=0)
    restarted = decision.memory
    for _ in range(6):
        decision = BufferPolicy().decide(ctx(restarted.last_t + 2.0, 0, 0, current=8), restarted)
        restarted = decision.memory
    assert len(restarted.stall_times) == 2 and not decision.alerts


def test_stalls_older_than_the_window_are_forgotten() -> None:
    memory = stall_cycles(3)[-1].memory
    decision = probe(memory, 8, queued=64, steps=0)
    assert decision.alerts
    # Reported until no stall is left in the window: one aged out, still reported.
    first_gone = replace(memory, last_t=memory.stall_times[0] + 1800.0)
    assert probe(first_gone, 8, queued=96, steps=1).alerts
    # Half an hour after the last, fed throughout: no longer reported.
    later = replace(memory, last_t=memory.stall_times[-1] + 1800.0)
    assert not probe(later, 8, queued=96, steps=1).alerts
