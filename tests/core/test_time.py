"""Time as the core sees it: stalls of deo itself, batched liveness, bounded start-up, crash
bursts."""

from __future__ import annotations

import time
from typing import Any

import pytest

from core import (
    Command,
    Config,
    ConfigError,
    Configured,
    CrashLoopRules,
    DrainRequested,
    LoadSampled,
    PolicySpec,
    PoolSpec,
    RaiseAlert,
    Reducer,
    ScalePool,
    SpawnWorker,
    TerminateWorker,
    Tick,
    UnknownSubject,
    WorkerExited,
    WorkerHeartbeat,
    WorkerReady,
    WorkersSeen,
    WorkerStarted,
    WorkerState,
    decode,
    encode,
)
from core.handlers import check_seen

T0 = 1_795_350_000.0  # wall-clock seconds, as deo run logs them


def spec(**overrides: Any) -> PoolSpec:
    fields: dict[str, Any] = {
        "name": "envs",
        "argv": ["python", "env.py"],
        "max_workers": 12,
        "policy": PolicySpec(name="static", params={"count": 12}),
    }
    fields.update(overrides)
    return PoolSpec(**fields)


def of(kind: type, commands: list[Command]) -> list[Any]:
    return [c for c in commands if isinstance(c, kind)]


def running(pool: PoolSpec, t: float = T0) -> Reducer:
    """A reducer with ``pool`` configured at ``t`` and every worker it asked for started."""
    reducer = Reducer(check_invariants=True)
    reducer.step(Configured(t=t, config=Config(pools=[pool])))
    start_requested(reducer, t)
    return reducer


def start_requested(reducer: Reducer, t: float) -> list[Command]:
    commands: list[Command] = []
    for worker in list(reducer.state.workers.values()):
        if worker.state is WorkerState.REQUESTED:
            commands += reducer.step(
                WorkerStarted(
                    t=t, worker_id=worker.worker_id, pid=1000 + worker.index, start_time=1
                )
            )
    return commands


def beat_and_tick(reducer: Reducer, t0: float, t1: float, beat_s: float = 0.3) -> list[Command]:
    """Every worker heartbeats every ``beat_s`` and deo ticks every second, from t0 to t1."""
    commands: list[Command] = []
    t = t0
    next_tick = t0 + 1.0
    while t < t1:
        t = round(t + beat_s, 6)
        for worker_id in list(reducer.state.workers):
            reducer.step(WorkerHeartbeat(t=t, worker_id=worker_id))
        if t >= next_tick:
            commands += reducer.step(Tick(t=t, interval_s=1.0))
            next_tick += 1.0
    return commands


# --- a stall of deo itself ---------------------------------------------------------------------


def test_time_deo_did_not_observe_does_not_count_against_healthy_workers() -> None:
    reducer = running(spec(heartbeat_grace_s=5.0))
    assert beat_and_tick(reducer, T0, T0 + 10) == []
    # deo stopped for 20 s: the first tick after it, then heartbeats arrive, then the next tick.
    stalled = reducer.step(Tick(t=T0 + 30, interval_s=1.0))
    assert stalled == [] and reducer.state.last_tick_skipped
    assert reducer.step(Tick(t=T0 + 31, interval_s=1.0)) == []  # queued beats not in yet: credit
    commands = beat_and_tick(reducer, T0 + 31, T0 + 45)
    assert of(TerminateWorker, commands) == []
    assert len(reducer.state.workers) == 12


def test_a_worker_silent_before_the_stall_is_still_found_hung() -> None:
    reducer = running(spec(heartbeat_grace_s=5.0, max_workers=1, policy=_static(1)))
    for k in range(1, 4):  # ticks at T0+1..3, no heartbeat after the start at T0
        assert reducer.step(Tick(t=T0 + k, interval_s=1.0)) == []
    assert reducer.step(Tick(t=T0 + 23, interval_s=1.0)) == []  # 20 s stall: judges no one
    # Silent 3 s before the stall plus one interval: 4 s observed. Hung once past 5 s observed.
    assert reducer.step(Tick(t=T0 + 24, interval_s=1.0)) == []
    [term] = of(TerminateWorker, reducer.step(Tick(t=T0 + 25.5, interval_s=1.0)))
    assert "hung" in term.reason


def test_the_first_tick_after_a_stall_leaves_deadlines_to_the_next() -> None:
    reducer = running(spec(max_workers=1, policy=_static(1), drain_timeout_s=5.0))
    reducer.step(Tick(t=T0 + 1, interval_s=1.0))
    reducer.step(DrainRequested(t=T0 + 1.5, worker_id="envs-0"))
    # The drain deadline passes while deo is stopped; the worker's exit is queued behind the tick.
    assert of(TerminateWorker, reducer.step(Tick(t=T0 + 20, interval_s=1.0))) == []
    reducer.step(WorkerExited(t=T0 + 20.1, worker_id="envs-0", exit_code=0))
    assert reducer.state.pools["envs"].failures == 0
    # Had it not exited, the next tick escalates: the worker did have its time.
    reducer = running(spec(max_workers=1, policy=_static(1), drain_timeout_s=5.0))
    reducer.step(Tick(t=T0 + 1, interval_s=1.0))
    reducer.step(DrainRequested(t=T0 + 1.5, worker_id="envs-0"))
    reducer.step(Tick(t=T0 + 20, interval_s=1.0))
    assert len(of(TerminateWorker, reducer.step(Tick(t=T0 + 21, interval_s=1.0)))) == 1


def test_a_deo_that_stalls_on_every_tick_still_judges_every_other_one() -> None:
    reducer = running(spec(heartbeat_grace_s=5.0, max_workers=1, policy=_static(1)))
    skipped = []
    t = T0
    for _ in range(6):
        t += 3.0  # every tick three intervals late
        reducer.step(Tick(t=t, interval_s=1.0))
        skipped.append(reducer.state.last_tick_skipped)
    assert skipped == [False, True, False, True, False, True]  # the first has nothing to compare
    assert reducer.state.workers["envs-0"].state is WorkerState.STOPPING  # hung all the same


def test_ticks_without_an_interval_are_judged_as_before() -> None:
    reducer = running(spec(heartbeat_grace_s=5.0, max_workers=1, policy=_static(1)))
    reducer.step(Tick(t=T0 + 1))
    [term] = of(TerminateWorker, reducer.step(Tick(t=T0 + 20)))
    assert "silent for 20s > grace 5s" in term.reason


# --- batched liveness --------------------------------------------------------------------------


def test_workers_seen_refreshes_live_workers_and_skips_exited_ones() -> None:
    reducer = running(spec(heartbeat_grace_s=5.0, max_workers=2, policy=_static(2)))
    reducer.step(WorkerExited(t=T0 + 40, worker_id="envs-0", exit_code=0))  # ran 40 s: no crash
    ids = {"envs-0", "envs-1"}
    assert reducer.step(WorkersSeen(t=T0 + 41, worker_ids=ids)) == []
    assert reducer.state.last_seen["envs-1"] == T0 + 41
    assert "envs-0" not in reducer.state.last_seen


def test_workers_seen_skips_ids_deo_never_made_and_refreshes_the_rest() -> None:
    # A replay with fewer workers (deo replay --set ...max_workers=...) meets recorded batches
    # naming workers it never spawned: the rest of the batch is still refreshed.
    reducer = running(spec(heartbeat_grace_s=5.0, max_workers=2, policy=_static(2)))
    ids = {"envs-1", "envs-99", "judges-0", "nonsense"}
    assert reducer.step(WorkersSeen(t=T0 + 1, worker_ids=ids)) == []
    assert reducer.state.last_seen["envs-1"] == T0 + 1
    assert set(reducer.state.last_seen) <= set(reducer.state.workers)


def test_a_single_sighting_of_a_worker_deo_never_made_is_refused_where_it_enters() -> None:
    reducer = running(spec(max_workers=2, policy=_static(2)))
    with pytest.raises(UnknownSubject, match="unknown worker 'envs-99'"):
        check_seen(reducer.state, "envs-99")
    assert check_seen(reducer.state, "envs-1") is True


def test_old_heartbeat_records_still_reduce_and_round_trip() -> None:
    reducer = running(spec(heartbeat_grace_s=5.0, max_workers=1, policy=_static(1)))
    event = decode(encode(WorkerHeartbeat(t=T0 + 3, worker_id="envs-0")))
    reducer.step(event)
    assert reducer.state.last_seen["envs-0"] == T0 + 3
    seen = WorkersSeen(t=T0 + 4, worker_ids={"envs-0"})
    assert decode(encode(seen)) == seen
    old_tick = decode({"@": "Tick", "t": T0 + 5})
    assert old_tick == Tick(t=T0 + 5) and old_tick.interval_s is None


# --- bounded start-up --------------------------------------------------------------------------


def test_a_huge_pool_starts_a_bounded_number_of_workers_per_step() -> None:
    huge = spec(max_workers=1_000_000, policy=_static(1_000_000), max_starting=8)
    reducer = Reducer(check_invariants=True)
    began = time.monotonic()
    spawned = of(SpawnWorker, reducer.step(Configured(t=T0, config=Config(pools=[huge]))))
    assert time.monotonic() - began < 30  # generous: a bounded step takes milliseconds
    assert len(spawned) == 8
    # As workers come up, more are requested; never more than 8 starting at once.
    for k in range(1, 4):
        more = of(SpawnWorker, start_requested(reducer, T0 + k))
        assert len(more) == 8, k
        starting = [w for w in reducer.state.workers.values() if w.state is WorkerState.REQUESTED]
        assert len(starting) == 8
    assert reducer.state.counted("envs") == 32


def test_workers_that_must_report_ready_start_max_starting_at_a_time() -> None:
    pool = spec(max_workers=6, policy=_static(6), max_starting=2, require_ready=True, min_workers=6)
    reducer = Reducer(check_invariants=True)
    commands = reducer.step(Configured(t=T0, config=Config(pools=[pool])))
    assert [s.worker_id for s in of(SpawnWorker, commands)] == ["envs-0", "envs-1"]
    [alert] = of(RaiseAlert, commands)
    assert alert.alert == "below_min" and "2 starting, at most 2 at once" in alert.reason
    assert of(SpawnWorker, start_requested(reducer, T0 + 1)) == []  # started, not yet ready
    commands = reducer.step(WorkerReady(t=T0 + 2, worker_id="envs-0"))
    assert [s.worker_id for s in of(SpawnWorker, commands)] == ["envs-2"]


def test_max_starting_must_be_positive() -> None:
    with pytest.raises(ConfigError, match=r"pools.envs.max_starting must be >= 1, got 0"):
        spec(max_starting=0)


# --- crash bursts ------------------------------------------------------------------------------


def burst_pool(**overrides: Any) -> PoolSpec:
    rules = CrashLoopRules(early_exit_s=30, backoff_base_s=1, backoff_cap_s=300, alert_after=1)
    return spec(**{"min_workers": 12, "crash_loop": rules, **overrides})


def crash_all(reducer: Reducer, t: float, within_s: float = 3.0) -> list[Command]:
    commands: list[Command] = []
    ids = sorted(reducer.state.workers, key=lambda w: reducer.state.workers[w].index)
    for k, worker_id in enumerate(ids):
        at = t + within_s * k / max(len(ids) - 1, 1)
        commands += reducer.step(WorkerExited(t=at, worker_id=worker_id, exit_code=1))
    return commands


def test_workers_failing_together_each_back_off_once() -> None:
    reducer = running(burst_pool())
    commands = crash_all(reducer, T0 + 5)
    pool = reducer.state.pools["envs"]
    assert pool.failures == 1  # a burst does not deepen: each slot failed once
    # Each slot's replacement waits 1 s after its own failure, none sooner.
    assert all(w.requested_t >= T0 + 6 for w in reducer.state.workers.values())
    reducer.step(Tick(t=T0 + 9))
    assert reducer.state.counted("envs") == 12
    # The replacements failing again is each slot's second failure in a row.
    start_requested(reducer, T0 + 9.5)
    crash_all(reducer, T0 + 10)
    assert reducer.state.pools["envs"].failures == 2
    for text in [c.reason for c in commands if hasattr(c, "reason")]:
        assert "e+09" not in text and "t=1" not in text, text


def test_failures_one_after_another_still_deepen_the_backoff() -> None:
    reducer = running(burst_pool(max_workers=1, min_workers=1, policy=_static(1)))
    t = T0
    for incident in range(1, 5):
        reducer.step(
            WorkerExited(t=t + 1, worker_id=next(iter(reducer.state.workers)), exit_code=1)
        )
        pool = reducer.state.pools["envs"]
        assert pool.failures == incident
        t = pool.backoff_until_t
        reducer.step(Tick(t=t))
        start_requested(reducer, t)


def test_a_decision_during_the_backoff_says_no_worker_runs() -> None:
    policy = PolicySpec(name="hpa", params={"target_per_worker": 1.0, "scale_up_pods": 100})
    reducer = running(burst_pool(policy=policy, min_workers=0))
    reducer.step(LoadSampled(t=T0 + 1, pool="envs", in_flight_requests=4))
    start_requested(reducer, T0 + 1)
    assert reducer.state.counted("envs") == 4
    crash_all(reducer, T0 + 2, within_s=0.0)  # every slot waits until T0 + 3
    [scale] = of(
        ScalePool, reducer.step(LoadSampled(t=T0 + 2.5, pool="envs", in_flight_requests=10))
    )
    assert (scale.previous, scale.target) == (4, 10)
    assert "target only: 0 worker(s) running, crash-loop backoff for another" in scale.reason


def _static(count: int) -> PolicySpec:
    return PolicySpec(name="static", params={"count": count})
