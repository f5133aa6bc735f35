"""core.policies.buffer.policy: deo's default policy, its parameters and the rules in order: the
cold start (rule 1), the count the reducer applied, the band, the properties every decision
keeps, and what no count fixes (the ``offpolicy_stalls`` alert).

Batch 64 sequences throughout. Each test drives the policy with samples as the reducer would
(``desired`` is the count the reducer applied) and checks what it measured or decided.
"""

from __future__ import annotations

import math

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from core import Config, ConfigError, Configured, PolicySpec, PoolSpec, Reducer
from core.events import QueueSampled
from core.policies import BufferMemory, BufferPolicy, Decision
from core.policies.buffer.stalls import floor_after_growth
from core.records import replace
from core.vocabulary import AlertName
from tests.core.buffer_helpers import BATCH, ctx, probe, settled

# --- cold start ----------------------------------------------------------------------------------


def test_cold_start_starts_every_worker_without_opening_the_stabilization_window() -> None:
    decision = BufferPolicy().decide(ctx(0.0, 0, 0, current=1, max_workers=12), None)
    assert decision.target == 12
    assert decision.stabilize is False  # the excess is shed as soon as the rates are known
    assert "rates not measured yet" in decision.reason


def test_a_cold_start_remembers_its_count_until_the_pool_is_measured_off_the_limit() -> None:
    decision = BufferPolicy().decide(ctx(0.0, 0, 0, current=1, max_workers=12), None)
    assert decision.memory.cold_workers == 12
    # Applied (the count goes 1 -> 12): still the cold start's.
    at_limit = replace(settled(queue_seqs=192.0, last_desired=1), cold_workers=12)
    kept = probe(at_limit, 12, desired=12)
    assert kept.memory.cold_workers == 12, kept.reason
    # Grown to a count a measurement asked for: no longer a cold start's.
    assert probe(at_limit, 14, desired=14).memory.cold_workers == 0
    # The queue seen off the limit after it was there (a settle time on): the pool is near its
    # need, whatever brought it there.
    off = replace(at_limit, last_desired=12, limit_t=90.0, queue_seqs=80.0, last_queued_seqs=80)
    assert probe(off, 12, queued=80).memory.cold_workers == 0
    # Off the limit before ever reaching it (the cold start's first batches): still cold.
    assert probe(replace(off, limit_t=None), 12, queued=80).memory.cold_workers == 12


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
        elif decision.target < current and "fewer workers reach the limit" in decision.reason:
            # on stalls at the off-policy limit (from below the band): only once reported, at
            # most a quarter (or the fraction) at once, never below what a growth after such a
            # step brought
            assert len(after.stall_times) >= 3
            share = min(0.25, fraction)
            assert decision.target >= current - math.ceil(current * share)
            assert decision.target >= max(after.stall_floor_workers, 1)
            assert after.stall_shed_workers == decision.target
        elif decision.target < current:
            # removals: at most a quarter (or the fraction) at once, only from above the band
            # as smoothed and as last sampled, never without a demand estimate; at the
            # off-policy limit, workers not yet up may all go (they make nothing yet)
            if "not yet up" in decision.reason or "still starting" in decision.reason:
                assert decision.target >= context.active
            if "not yet up" in decision.reason:
                assert queued >= 0.8 * policy.max_batches_offpolicy * batch
            elif "half the pool, to twice the need" in decision.reason:
                assert decision.target >= math.ceil(current / 2)
            elif "still starting" not in decision.reason:
                assert decision.target >= current - max(1, math.floor(current * fraction))
            band_top = (policy.target(after, batch) + policy.band_batches) * batch
            assert after.queue_seqs > band_top
            assert queued > band_top
            assert after.demand_seqs_s is not None
        memory = after


# --- what no count fixes ---------------------------------------------------------------------


def stall_cycles(cycles: int, *, landing_seqs: int = 0, wait_samples: int = 5) -> list[Decision]:
    """Every 2 s: the queue at the off-policy limit (3 batches), the trainer taking it down a
    batch a sample (``landing_seqs`` landing meanwhile), then waiting ``wait_samples`` samples
    on what is left, until a burst fills it to the limit again."""
    samples: list[tuple[int, int]] = []
    for _ in range(cycles):
        queued = 3 * BATCH
        samples.append((queued, 0))
        for _ in range(3):
            queued = queued - BATCH + landing_seqs
            samples.append((queued, 1))
        samples += [(queued, 0)] * wait_samples
    return decide_each(settled(queue_seqs=192.0), samples)


def decide_each(memory: BufferMemory, samples: list[tuple[int, int]]) -> list[Decision]:
    """Each (queued, trainer steps) sample in turn, 2 s apart, with 8 workers."""
    decisions = []
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
    assert any(
        "less than a batch landed since the queue left the off-policy limit" in d.reason
        for d in decisions[:-5]
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


def test_a_short_pool_landing_what_it_makes_is_not_a_stall() -> None:
    # 8 workers measured at 0.5 seq/s each land 8 sequences a sample, through the trainer's
    # takes from the limit and its waits after: the trainer waits on a short pool, not on
    # groups the limit cancelled, so no wait counts as a stall however often it comes.
    samples: list[tuple[int, int]] = []
    for _ in range(4):
        queued = 3 * BATCH
        samples.append((queued, 0))
        for _ in range(3):
            queued = queued - BATCH + 8
            samples.append((queued, 1))
        for _ in range(4):
            queued += 8
            samples.append((queued, 0))
    decisions = decide_each(settled(queue_seqs=192.0, per_worker_seqs_s=0.5), samples)
    assert not any(d.memory.stall_times for d in decisions), decisions[-1].reason
    assert not any(d.alerts for d in decisions)


def test_a_take_of_every_full_batch_is_not_a_wait_while_the_trainer_steps_through_it() -> None:
    # atroposlib's /batch hands the trainer every full batch at once: from the off-policy limit
    # the queue falls to nothing in one take of 3 batches (the step counter jumps by 3), and
    # the trainer spends 3 steps (6 s) on them while the envs make the next batch. A queue
    # under a batch for a step meanwhile is no wait, however often it comes.
    cycle = [(192, 0), (0, 3), (0, 0), (64, 0), (128, 0), (192, 0)]
    decisions = decide_each(settled(queue_seqs=192.0), cycle * 5)
    assert not any(d.memory.stall_times for d in decisions), decisions[-1].reason
    assert not any(d.alerts for d in decisions)
    # Nothing landing for longer than the steps it took: the trainer waits, a stall.
    stalled = [(192, 0), (0, 3), (0, 0), (0, 0), (0, 0), (64, 0), (128, 0), (192, 0)]
    decisions = decide_each(settled(queue_seqs=192.0), stalled * 3)
    assert decisions[-1].memory.stall_times, decisions[-1].reason


def test_once_stalls_are_reported_each_new_one_takes_a_quarter_of_the_pool() -> None:
    # More workers would bring the queue back to the limit sooner, for the next wait: from the
    # third stall on, each stall takes a quarter of the pool (8 -> 6), and the starvation
    # between them holds it (no growth on the envs' restarts).
    decisions = stall_cycles(3)
    stepped = [(i, d) for i, d in enumerate(decisions) if "fewer workers" in d.reason]
    assert stepped and stepped[0][0] > len(decisions) - 6  # not before the third stall
    first = stepped[0][1]
    assert first.target == 6 and "3 times in" in first.reason
    assert "fewer workers reach the limit less often -> stepping down to 6" in first.reason
    assert first.memory.stall_shed_workers == 6
    # The next samples, still starving a step from the limit, hold: one step per stall.
    memory = first.memory
    for _ in range(3):
        waiting = ctx(memory.last_t + 2.0, 0, memory.last_step, current=6)
        decision = BufferPolicy().decide(waiting, memory)
        memory = decision.memory
        assert decision.target == 6 and "not the pool -> hold 6" in decision.reason
    # A trainer restart (its step back to 0) empties the queue: not the envs starting again.
    restarted = BufferPolicy().decide(ctx(memory.last_t + 2.0, 0, 0, current=6), memory)
    assert "fewer workers" not in restarted.reason and "not the pool" not in restarted.reason


def test_a_growth_after_a_step_on_stalls_is_the_floor_for_the_next_ones() -> None:
    # The pool went below its need (rule 2 or 3 grows it): later stalls step down no lower
    # than what that growth brought (at most the pool's maximum).
    stepped = next(d for d in stall_cycles(3) if "fewer workers" in d.reason)
    context = ctx(stepped.memory.last_t, 0, 0, current=6, max_workers=16)
    growth = Decision(target=9, reason="growing", memory=stepped.memory)
    assert floor_after_growth(context, 6, growth).memory.stall_floor_workers == 9
    beyond = attrs.evolve(growth, target=40)
    assert floor_after_growth(context, 6, beyond).memory.stall_floor_workers == 16
    # Not without a step on stalls before it, nor for a removal.
    plain = attrs.evolve(growth, memory=replace(stepped.memory, stall_shed_workers=0))
    assert floor_after_growth(context, 6, plain) is plain
    removal = attrs.evolve(growth, target=5)
    assert floor_after_growth(context, 6, removal) is removal
    floored = replace(stepped.memory, stall_floor_workers=7, stall_shed_workers=6)
    # The next stall's step (a start-up after the last) keeps the floor: 8 less a quarter is
    # 6, the floor 7.
    memory = replace(floored, last_down_t=floored.stall_times[-1] - 60.0)
    waiting = ctx(memory.last_t + 2.0, 0, memory.last_step, current=8)
    decision = BufferPolicy().decide(waiting, memory)
    assert decision.target == 7 and "stepping down to 7" in decision.reason
    # No stall in the window any more: the floor and the last step are forgotten.
    later = replace(floored, last_t=floored.stall_times[-1] + 1800.0)
    forgotten = probe(later, 8, queued=96, steps=1).memory
    assert forgotten.stall_floor_workers == 0 and forgotten.stall_shed_workers == 0


@given(
    cycles=st.integers(min_value=3, max_value=7),
    workers=st.integers(min_value=1, max_value=60),
    wait_samples=st.integers(min_value=2, max_value=12),
    landing_seqs=st.integers(min_value=0, max_value=16),
    fraction=st.sampled_from([0.05, 0.25, 1.0]),
)
def test_steps_on_stalls_come_one_per_new_stall_and_keep_their_bounds(
    cycles: int, workers: int, wait_samples: int, landing_seqs: int, fraction: float
) -> None:
    # A pool of any size going through stall after stall, each decision applied: a step on
    # stalls only once they are reported, at most a quarter (or max_down_fraction) of the pool,
    # never to no worker, and never twice on one stall; the pool never grows on the waits.
    policy = BufferPolicy(max_down_fraction=fraction)
    memory, t, step, current = settled(queue_seqs=192.0), 100.0, 50, workers
    stepped_on: list[float] = []
    for _ in range(cycles):
        queued = 3 * BATCH
        samples = [(queued, 0)]
        for _ in range(3):
            queued = max(queued - BATCH + landing_seqs, 0)
            samples.append((queued, 1))
        samples += [(queued, 0)] * wait_samples
        for queued, steps in samples:
            t, step = t + 2.0, step + steps
            decision = policy.decide(ctx(t, queued, step, current=current), memory)
            after = decision.memory
            assert decision.target <= current
            if "fewer workers reach the limit" in decision.reason:
                assert len(after.stall_times) >= 3
                assert decision.target >= current - math.ceil(current * min(0.25, fraction))
                assert decision.target >= 1
                assert not stepped_on or after.stall_times[-1] > stepped_on[-1]
                stepped_on.append(after.stall_times[-1])
            current, memory = decision.target, after


def short_stall_cycles(
    cycles: int, *, steps_then: tuple[int, int], landed: tuple[int, int]
) -> list[Decision]:
    """A trainer stepping every 0.5 s, sampled every 2 s: the queue at the limit, two samples
    in which the trainer takes ``steps_then`` batches and ``landed`` sequences land, then
    refilled to the limit by a trainer fed throughout."""
    memory = settled(
        queue_seqs=192.0,
        last_queued_seqs=192,
        demand_seqs_s=128.0,
        fast_demand_seqs_s=128.0,
        production_seqs_s=128.0,
        per_worker_seqs_s=16.0,
    )
    samples: list[tuple[int, int]] = []
    for _ in range(cycles):
        queued = 3 * BATCH
        samples.append((queued, 4))
        for steps, seqs in zip(steps_then, landed, strict=True):
            queued += seqs - steps * BATCH
            samples.append((queued, steps))
        while queued < 3 * BATCH:
            queued = min(queued + BATCH, 3 * BATCH)
            samples.append((queued, 4))
    return decide_each(memory, samples)


def test_waits_shorter_than_the_sample_interval_after_the_limit_are_stalls_too() -> None:
    # The queue lasts 1.5 s past the limit, a group lands, and 80 sequences land within the
    # next 2-s sample: no sample finds the trainer waiting with nothing landed, but from the
    # limit on it took 4 batches in 4 s where it could have taken 8. Waits, and reported.
    decisions = short_stall_cycles(3, steps_then=(3, 1), landed=(8, 80))
    (alert, reason) = decisions[-1].alerts[0]
    assert alert is AlertName.OFFPOLICY_STALLS
    assert "3 times in 30 minutes" in reason and "raise max_batches_offpolicy" in reason
    # About 1.5 s each time (4 s less 4 steps, less the step it may have been in at the
    # limit; the steps, measured, take a little longer than 0.5 s with the waits in them):
    # three batches more would have covered it.
    assert "to 6 at least (the last wait was 1s)" in reason
    # A trainer that kept stepping through the fall (the envs making again at once) took as
    # many as it could: no wait, though a sample found less than a batch with a group landed.
    fed = short_stall_cycles(4, steps_then=(3, 4), landed=(8, 264))
    assert not any(d.alerts for d in fed)
    assert not fed[-1].memory.stall_times


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


def test_a_queue_held_above_the_target_winds_no_integral_that_holds_back_a_refill() -> None:
    # An hour with the queue above the target (the removals hold the pool at 8, the need): a
    # negative integral would only lower the count rule 3 asks when the queue next falls, to
    # the balance ceil(D / p), leaving nothing to refill it with.
    memory = settled(queue_seqs=120.0)
    for _ in range(1800):
        decision = probe(memory, 8)
        assert decision.target == 8, decision.reason
        memory = replace(
            decision.memory,
            queue_seqs=120.0,
            last_queued_seqs=120,
            demand_seqs_s=32.0,
            per_worker_seqs_s=4.0,
        )
    assert memory.integral_seqs_s == 0.0
