"""The drain deadline: fixed when the configuration gives seconds, measured from the pool's own
drains when it says "auto" (the default)."""

from __future__ import annotations

from typing import Any

import pytest

from core import (
    Command,
    Config,
    ConfigError,
    Configured,
    DrainRequested,
    DrainWorker,
    PolicySpec,
    PoolSpec,
    Reducer,
    Refused,
    TerminateWorker,
    Tick,
    WorkerExited,
    WorkerStarted,
    WorkerState,
    decode,
    drains,
    encode,
)
from core.config import AUTO

T0 = 1_795_350_000.0


def spec(**overrides: Any) -> PoolSpec:
    fields: dict[str, Any] = {
        "name": "envs",
        "argv": ["python", "env.py"],
        "max_workers": 1,
        "policy": PolicySpec(name="static", params={"count": 1}),
    }
    fields.update(overrides)
    return PoolSpec(**fields)


def of(kind: type, commands: list[Command]) -> list[Any]:
    return [c for c in commands if isinstance(c, kind)]


def start_requested(reducer: Reducer, t: float) -> None:
    for worker in list(reducer.state.workers.values()):
        if worker.state is WorkerState.REQUESTED:
            reducer.step(
                WorkerStarted(
                    t=t, worker_id=worker.worker_id, pid=1000 + worker.index, start_time=1
                )
            )


def running(pool: PoolSpec) -> Reducer:
    reducer = Reducer(check_invariants=True)
    reducer.step(Configured(t=T0, config=Config(pools=[pool])))
    start_requested(reducer, T0)
    return reducer


def drain_once(reducer: Reducer, t: float, takes_s: float) -> tuple[DrainWorker, bool, float]:
    """Drain the pool's active worker at ``t``; it exits after ``takes_s`` unless its deadline
    comes first (then deo's SIGTERM ends it). The drain command, whether it was cut, and when
    the worker exited. The replacement the pool asks for is started at once."""
    [active] = [w for w in reducer.state.workers.values() if w.state is WorkerState.ACTIVE]
    [drain] = of(DrainWorker, reducer.step(DrainRequested(t=t, worker_id=active.worker_id)))
    start_requested(reducer, t)
    cut = t + takes_s >= drain.deadline_t
    if cut:
        [term] = of(TerminateWorker, reducer.step(Tick(t=drain.deadline_t + 0.5)))
        assert "after the drain signal" in term.reason
        end = drain.deadline_t + 1.0
        reducer.step(WorkerExited(t=end, worker_id=active.worker_id, signal=15))
    else:
        end = t + takes_s
        reducer.step(WorkerExited(t=end, worker_id=active.worker_id, exit_code=0))
    assert active.worker_id not in reducer.state.workers
    return drain, cut, end


def test_a_configured_number_is_the_deadline_whatever_the_drains_took() -> None:
    pool = spec(drain_timeout_s=20)
    measured = tuple((300.0, False) for _ in range(drains.WINDOW_DRAINS))
    assert drains.drain_timeout(pool, measured) == (
        20.0,
        "drain_timeout_s set in the configuration",
    )


def test_auto_starts_from_the_start_value_until_enough_drains_are_measured() -> None:
    pool = spec()
    assert pool.drain_timeout_s == AUTO  # the default
    few = tuple((100.0, False) for _ in range(drains.MIN_DRAINS - 1))
    seconds, why = drains.drain_timeout(pool, few)
    assert seconds == drains.START_S
    assert f"{drains.MIN_DRAINS - 1} of {drains.MIN_DRAINS} drains measured" in why


def test_auto_is_a_high_quantile_of_the_latest_drains_times_the_margin() -> None:
    # Twenty drains of 1..20 s: the 95th percentile is 19 s; 1.5 x 19 = 28.5 -> 28 s (whole).
    measured = tuple((float(s), False) for s in range(1, 21))
    seconds, why = drains.drain_timeout(spec(), measured)
    assert seconds == round(drains.MARGIN * 19.0)
    assert "p95 19.0s of the last 20 drains" in why
    # Only the latest WINDOW_DRAINS count: old long drains are forgotten.
    old = tuple((1000.0, False) for _ in range(10))
    assert drains.drain_timeout(spec(), old + measured * 2)[0] == seconds


@pytest.mark.parametrize(
    ("drain_s", "expected", "said"),
    [(1.0, drains.FLOOR_S, "floor"), (5000.0, drains.CAP_S, "cap")],
)
def test_a_measured_deadline_stays_within_its_floor_and_cap(
    drain_s: float, expected: float, said: str
) -> None:
    measured = tuple((drain_s, False) for _ in range(drains.MIN_DRAINS))
    seconds, why = drains.drain_timeout(spec(), measured)
    assert seconds == expected
    assert said in why


def test_engine_pools_in_auto_wait_the_start_value() -> None:
    engines = PoolSpec(
        name="gen",
        kind="engine",
        engine="vllm",
        argv=["vllm", "serve", "--port", "{port}"],
        ports=(18000, 18003),
        max_workers=2,
    )
    assert drains.engine_drain_timeout_s(engines) == drains.START_S
    assert drains.engine_drain_timeout_s(spec(drain_timeout_s=30.0)) == 30.0


@pytest.mark.parametrize(("value", "said"), [("soon", "'soon'"), (True, "True"), (0, "> 0")])
def test_a_drain_timeout_that_is_neither_seconds_nor_auto_is_refused(value: Any, said: str) -> None:
    with pytest.raises(ConfigError, match=r"pools\.envs\.drain_timeout_s") as raised:
        spec(drain_timeout_s=value)
    assert said in str(raised.value)


def test_cut_drains_lengthen_the_deadline_until_drains_end_on_their_own() -> None:
    reducer = running(spec())
    t = T0 + 1
    cuts = []
    for _ in range(12):
        _, cut, t = drain_once(reducer, t, takes_s=100.0)
        cuts.append(cut)
        t += 5.0
    pool = reducer.state.pools["envs"]
    # The first MIN_DRAINS drains run at the start value (60 s) and are cut; then 1.5 x the
    # length they were allowed (60 s) -> 90 s, still cut, -> 135 s: no longer cut.
    assert cuts == [True] * (drains.MIN_DRAINS + 1) + [False] * (11 - drains.MIN_DRAINS)
    seconds, why = drains.drain_timeout(pool.spec, pool.drains)
    assert seconds > 100.0
    assert "cut at their deadline" in why
    assert [cut for _, cut in pool.drains] == cuts
    assert [seconds for seconds, _ in pool.drains[: drains.MIN_DRAINS + 1]] == [60.0] * 3 + [90.0]


def measured_at_15_s() -> tuple[Reducer, float]:
    """A pool whose three drains took 10 s (deadline 15 s), and when the next may start."""
    reducer = running(spec())
    t = T0 + 1
    for _ in range(drains.MIN_DRAINS):
        _, _, t = drain_once(reducer, t, takes_s=10.0)
        t += 1
    pool = reducer.state.pools["envs"]
    assert drains.drain_timeout(pool.spec, pool.drains)[0] == 15.0
    return reducer, t


@pytest.mark.parametrize("late_s", [0.5, 600.0, 3600.0])
def test_a_drain_cut_by_a_late_tick_counts_the_length_it_was_allowed(late_s: float) -> None:
    # deo stalled (or was down) for late_s past the deadline: the first tick after the stall
    # judges nothing, the next one cuts the drain. It ran 15 s that deo allowed; the rest is
    # deo's lateness, not the drain's length.
    reducer, t = measured_at_15_s()
    [active] = [w for w in reducer.state.workers.values() if w.state is WorkerState.ACTIVE]
    [drain] = of(DrainWorker, reducer.step(DrainRequested(t=t, worker_id=active.worker_id)))
    start_requested(reducer, t)
    late_t = drain.deadline_t + late_s
    commands = reducer.step(Tick(t=late_t)) + reducer.step(Tick(t=late_t + 1.0))
    [term] = of(TerminateWorker, commands)
    assert term.worker_id == active.worker_id
    reducer.step(WorkerExited(t=late_t + 2.0, worker_id=active.worker_id, signal=15))
    pool = reducer.state.pools["envs"]
    assert pool.drains[-1] == (15.0, True)
    seconds, why = drains.drain_timeout(pool.spec, pool.drains)
    assert seconds == 22.0  # 1.5 x 15 s: one cut grows the deadline by the margin, no more
    assert "cap" not in why


def test_an_exit_seen_only_after_the_deadline_counts_at_most_the_deadline() -> None:
    # deo was down past the deadline; on restart it sees the worker gone before any tick.
    reducer, t = measured_at_15_s()
    [active] = [w for w in reducer.state.workers.values() if w.state is WorkerState.ACTIVE]
    [drain] = of(DrainWorker, reducer.step(DrainRequested(t=t, worker_id=active.worker_id)))
    start_requested(reducer, t)
    reducer.step(WorkerExited(t=drain.deadline_t + 3600.0, worker_id=active.worker_id, exit_code=0))
    pool = reducer.state.pools["envs"]
    assert pool.drains[-1] == (15.0, False)
    assert drains.drain_timeout(pool.spec, pool.drains)[0] == 22.0


def test_each_drain_says_its_deadline_and_why() -> None:
    reducer = running(spec())
    drain, _, end = drain_once(reducer, T0 + 1, takes_s=3.0)
    assert drain.deadline_t == pytest.approx(T0 + 1 + drains.START_S)
    start = f"drain deadline {drains.START_S:g}s (auto: 0 of {drains.MIN_DRAINS} drains measured"
    assert start in drain.reason
    assert reducer.state.pools["envs"].drains == ((3.0, False),)
    t = end
    for _ in range(drains.MIN_DRAINS):
        drain, cut, t = drain_once(reducer, t + 1, takes_s=30.0)
        assert not cut
    # One drain of 3 s, then MIN_DRAINS of 30 s: p95 30 s -> 45 s.
    last = drains.MIN_DRAINS + 1
    measured = f"drain deadline 45s (auto: 1.5 x p95 30.0s of the last {last} drains)"
    assert measured in drain_once(reducer, t + 1, takes_s=1.0)[0].reason


def test_a_fixed_deadline_keeps_the_reason_without_a_measurement() -> None:
    reducer = running(spec(drain_timeout_s=5.0))
    drain, cut, _ = drain_once(reducer, T0 + 1, takes_s=30.0)
    assert cut
    assert drain.deadline_t == pytest.approx(T0 + 6.0)
    assert "drain deadline" not in drain.reason
    # A fixed deadline needs no measurement, but the drains are kept: "auto" later has them.
    assert reducer.state.pools["envs"].drains == ((5.0, True),)


def test_a_worker_drained_before_it_started_is_not_measured() -> None:
    reducer = Reducer(check_invariants=True)
    reducer.step(Configured(t=T0, config=Config(pools=[spec()])))
    [drain] = of(DrainWorker, reducer.step(DrainRequested(t=T0 + 1, worker_id="envs-0")))
    assert drain.pid is None
    reducer.step(WorkerStarted(t=T0 + 2, worker_id="envs-0", pid=1000, start_time=1))
    reducer.step(WorkerExited(t=T0 + 3, worker_id="envs-0", exit_code=0))
    assert reducer.state.pools["envs"].drains == ()


def test_the_sigterm_of_a_worker_drained_before_it_started_names_its_measured_deadline() -> None:
    reducer, t = measured_at_15_s()
    [active] = [w for w in reducer.state.workers.values() if w.state is WorkerState.ACTIVE]
    reducer.step(DrainRequested(t=t, worker_id=active.worker_id))
    # Its replacement is drained before it started: not measured, but given the measured 15 s.
    [requested] = [w for w in reducer.state.workers.values() if w.state is WorkerState.REQUESTED]
    [drain] = of(DrainWorker, reducer.step(DrainRequested(t=t + 1, worker_id=requested.worker_id)))
    assert drain.deadline_t == t + 1 + 15.0 and "drain deadline 15s" in drain.reason
    reducer.step(WorkerStarted(t=t + 2, worker_id=requested.worker_id, pid=4242, start_time=1))
    terms = of(TerminateWorker, reducer.step(Tick(t=drain.deadline_t + 0.5)))
    [term] = [c for c in terms if c.worker_id == requested.worker_id]
    assert "still running 15s after the drain signal (its measured deadline)" in term.reason


def test_the_sigterm_of_a_drain_at_the_start_value_does_not_call_it_measured() -> None:
    reducer = running(spec())
    [active] = [w for w in reducer.state.workers.values() if w.state is WorkerState.ACTIVE]
    [drain] = of(DrainWorker, reducer.step(DrainRequested(t=T0 + 1, worker_id=active.worker_id)))
    assert drain.deadline_t == T0 + 1 + drains.START_S
    [term] = of(TerminateWorker, reducer.step(Tick(t=drain.deadline_t + 0.5)))
    assert f"still running {drains.START_S:g}s after the drain signal (the start value" in (
        term.reason
    )
    assert "measured deadline" not in term.reason


@pytest.mark.parametrize(
    ("change", "kept"),
    [
        ({"max_workers": 3}, True),
        ({"policy": PolicySpec(name="static", params={"count": 2}), "max_workers": 2}, True),
        ({"drain_timeout_s": 30.0}, True),
        ({"argv": ["python", "other_env.py"]}, False),
        ({"env": {"ENV_GROUP_SIZE": "64"}}, False),
    ],
    ids=["max-workers", "policy", "drain-timeout", "argv", "env"],
)
def test_a_pool_that_runs_another_program_measures_its_drains_again(
    change: dict[str, Any], kept: bool
) -> None:
    reducer, t = measured_at_15_s()
    measured = reducer.state.pools["envs"].drains
    reducer.step(Configured(t=t, config=Config(pools=[spec(**change)])))
    assert reducer.state.pools["envs"].drains == (measured if kept else ())


def test_the_measured_drains_survive_the_log_and_a_replay() -> None:
    reducer = running(spec())
    t = T0 + 1
    for takes_s in (4.0, 8.0, 100.0):
        _, _, t = drain_once(reducer, t, takes_s)
        t += 1
    assert decode(encode(reducer.state)) == reducer.state
    # A worker in the middle of a drain keeps when it started.
    [active] = [w for w in reducer.state.workers.values() if w.state is WorkerState.ACTIVE]
    reducer.step(DrainRequested(t=t, worker_id=active.worker_id))
    draining = reducer.state.workers[active.worker_id]
    assert draining.drain_started_t == t
    assert decode(encode(draining)) == draining


def test_a_drain_of_a_worker_that_already_exited_is_refused() -> None:
    reducer = running(spec(drain_timeout_s=30.0))
    drain_once(reducer, T0 + 10, takes_s=2.0)
    before = reducer.state
    with pytest.raises(Refused, match="worker 'envs-0' already exited"):
        reducer.step(DrainRequested(t=T0 + 20, worker_id="envs-0"))
    assert reducer.state is before
    # Its replacement drains as asked, and a second request while it drains changes nothing.
    assert of(DrainWorker, reducer.step(DrainRequested(t=T0 + 21, worker_id="envs-1")))
    assert reducer.step(DrainRequested(t=T0 + 22, worker_id="envs-1")) == []
