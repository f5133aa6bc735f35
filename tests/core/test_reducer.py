"""Direct tests of the reducer's transitions, one behaviour at a time."""

from __future__ import annotations

import itertools
from typing import Any

import attrs
import pytest

from core import (
    AutoscalingPaused,
    AutoscalingResumed,
    Command,
    Config,
    ConfigError,
    Configured,
    CordonGpu,
    CordonRules,
    CrashLoopRules,
    DrainRequested,
    DrainWorker,
    Event,
    GpuCordonRequested,
    GpuLost,
    GpuSampled,
    GpuUncordonRequested,
    IllegalTransition,
    InvalidEvent,
    KillWorker,
    LoadSampled,
    PolicySpec,
    PoolPinned,
    PoolSpec,
    QueueSampled,
    RaiseAlert,
    Reducer,
    ResolveAlert,
    ScalePool,
    SourceDown,
    SpawnFailed,
    SpawnWorker,
    TerminateWorker,
    Tick,
    UncordonGpu,
    WorkerAdopted,
    WorkerExited,
    WorkerHeartbeat,
    WorkerLost,
    WorkerReady,
    WorkerStarted,
    WorkerState,
    decode,
    encode,
)
from core.invariants import state_violations
from core.records import replace

GB = 1 << 30


def pool(name: str = "envs", **overrides: Any) -> PoolSpec:
    fields: dict[str, Any] = {
        "name": name,
        "argv": ["python", "env.py", "--id", "{worker_id}"],
        "min_workers": 0,
        "max_workers": 8,
        "policy": PolicySpec(name="static", params={"count": 2}),
    }
    fields.update(overrides)
    return PoolSpec(**fields)


def static(count: int) -> PolicySpec:
    return PolicySpec(name="static", params={"count": count})


def make(*pools: PoolSpec, gpus: int = 0, **config: Any) -> tuple[Reducer, list[Command]]:
    """A reducer with ``pools`` configured at t=0 (invariants checked on every step)."""
    reducer = Reducer(check_invariants=True)
    spec = Config(pools=pools or (pool(),), gpus=[str(i) for i in range(gpus)], **config)
    return reducer, reducer.step(Configured(t=0.0, config=spec))


def of(kind: type, commands: list[Command]) -> list[Any]:
    return [c for c in commands if isinstance(c, kind)]


def start_all(reducer: Reducer, t: float) -> None:
    for i, worker in enumerate(sorted(reducer.state.workers.values(), key=lambda w: w.index)):
        if worker.state is WorkerState.REQUESTED:
            reducer.step(
                WorkerStarted(t=t, worker_id=worker.worker_id, pid=100 + worker.index, start_time=i)
            )


def states(reducer: Reducer) -> dict[str, str]:
    return {w.worker_id: w.state.value for w in reducer.state.workers.values()}


# --- configuration and placement -----------------------------------------------------------------


def test_declaring_a_pool_spawns_its_workers_with_identity_in_env() -> None:
    _, commands = make(pool(env={"MODE": "train"}))
    [scale] = of(ScalePool, commands)
    assert (scale.previous, scale.target, scale.source) == (0, 2, "config")
    spawns = of(SpawnWorker, commands)
    assert [s.worker_id for s in spawns] == ["envs-0", "envs-1"]
    assert spawns[1].argv == ("python", "env.py", "--id", "envs-1")
    assert spawns[1].env == {
        "MODE": "train",
        "CUDA_VISIBLE_DEVICES": "",
        "DEO_WORKER_ID": "envs-1",
        "DEO_POOL": "envs",
    }


def test_gpus_are_assigned_exclusively_as_cuda_visible_devices() -> None:
    reducer, commands = make(pool(gpus_per_worker=2, policy=static(3)), gpus=5)
    spawns = of(SpawnWorker, commands)
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in spawns] == ["0,1", "2,3"]
    assert ("no_free_gpus", "envs") in reducer.state.alerts
    assert of(RaiseAlert, commands)[0].reason.endswith("1 available")


def test_pools_share_one_gpu_inventory() -> None:
    gpu_pool = pool("engines", gpus_per_worker=1, policy=static(2))
    cpu_pool = pool("envs", policy=static(3))
    _reducer, commands = make(gpu_pool, cpu_pool, gpus=2)
    spawns = of(SpawnWorker, commands)
    assert sorted(s.worker_id for s in spawns) == [
        "engines-0",
        "engines-1",
        "envs-0",
        "envs-1",
        "envs-2",
    ]
    held = [g for s in spawns for g in s.gpus]
    assert sorted(held) == ["0", "1"]


def test_reconfiguring_clamps_the_target_and_drains_the_excess() -> None:
    reducer, _ = make(pool(policy=static(4)))
    start_all(reducer, 1.0)
    commands = reducer.step(
        Configured(t=2.0, config=Config(pools=[pool(policy=static(4), max_workers=2)]))
    )
    assert [(s.previous, s.target) for s in of(ScalePool, commands)] == [(4, 2)]
    drained = of(DrainWorker, commands)
    assert sorted(d.worker_id for d in drained) == ["envs-2", "envs-3"]  # newest first
    assert reducer.state.counted("envs") == 2


def test_removing_a_pool_drains_it_then_forgets_it() -> None:
    reducer, _ = make(pool(), pool("other", policy=static(1)))
    start_all(reducer, 1.0)
    commands = reducer.step(
        Configured(t=2.0, config=Config(pools=[pool("other", policy=static(1))]))
    )
    assert sorted(d.worker_id for d in of(DrainWorker, commands)) == ["envs-0", "envs-1"]
    assert reducer.state.pools["envs"].removed
    reducer.step(WorkerExited(t=3.0, worker_id="envs-0", exit_code=0))
    assert "envs" in reducer.state.pools
    commands = reducer.step(WorkerExited(t=3.5, worker_id="envs-1", exit_code=0))
    assert commands == []
    assert "envs" not in reducer.state.pools


def test_a_pool_declared_again_numbers_its_workers_on_from_the_removed_one() -> None:
    # `deo stop --drain` removes every pool; the restart declares them again: a worker id
    # never repeats in one log (its output file, its token and the postmortem's rows are its).
    reducer, _ = make(pool())
    start_all(reducer, 1.0)
    reducer.step(Configured(t=2.0, config=Config(pools=[])))
    for t, worker_id in ((3.0, "envs-0"), (3.5, "envs-1")):
        reducer.step(WorkerExited(t=t, worker_id=worker_id, exit_code=0))
    assert "envs" not in reducer.state.pools
    assert decode(encode(reducer.state)) == reducer.state  # what a snapshot keeps
    # A late report about a worker of the removed pool is a no-op, as for a declared one.
    assert reducer.step(WorkerExited(t=4.0, worker_id="envs-1", exit_code=0)) == []
    commands = reducer.step(Configured(t=5.0, config=Config(pools=[pool()])))
    assert sorted(s.worker_id for s in of(SpawnWorker, commands)) == ["envs-2", "envs-3"]
    assert "envs" not in reducer.state.removed_next_index


def test_removing_a_held_gpu_is_refused_and_changes_nothing() -> None:
    reducer, _ = make(pool(gpus_per_worker=1, policy=static(1)), gpus=2)
    before = reducer.state
    with pytest.raises(ConfigError, match="GPU '0' is held by worker envs-0"):
        reducer.step(Configured(t=1.0, config=Config(pools=[pool(gpus_per_worker=1)], gpus=["1"])))
    assert reducer.state is before


# --- lifecycle -----------------------------------------------------------------------------------


def test_worker_becomes_active_on_start_unless_it_must_report_ready() -> None:
    reducer, _ = make(pool("a", policy=static(1)), pool("b", policy=static(1), require_ready=True))
    start_all(reducer, 1.0)
    assert states(reducer) == {"a-0": "active", "b-0": "starting"}
    reducer.step(WorkerReady(t=2.0, worker_id="b-0"))
    assert states(reducer)["b-0"] == "active"


def test_ready_before_start_is_an_illegal_transition_and_changes_nothing() -> None:
    reducer, _ = make()
    before = reducer.state
    with pytest.raises(IllegalTransition, match="'envs-0' is requested: it cannot take 'ready'"):
        reducer.step(WorkerReady(t=1.0, worker_id="envs-0"))
    assert reducer.state is before


def test_worker_never_ready_is_replaced_after_start_timeout() -> None:
    reducer, _ = make(pool(policy=static(1), require_ready=True, start_timeout_s=30))
    start_all(reducer, 1.0)
    assert reducer.step(Tick(t=30.0)) == []
    commands = reducer.step(Tick(t=31.0))
    [term] = of(TerminateWorker, commands)
    assert term.worker_id == "envs-0" and "not ready 30s after starting" in term.reason
    assert "raise start_timeout_s" in term.reason
    # A failed start: its slot's replacement follows the crash-loop backoff (1 s for a first).
    assert of(SpawnWorker, commands) == []
    assert [s.worker_id for s in of(SpawnWorker, reducer.step(Tick(t=32.0)))] == ["envs-1"]


def test_workers_that_never_start_within_the_timeout_raise_a_crash_loop_naming_it() -> None:
    reducer, _ = make(pool(policy=static(1), start_timeout_s=30))
    alerts, stopped = [], []
    for second in range(1, 200):  # none ever starts: each is stopped at the timeout and exits
        commands = reducer.step(Tick(t=float(second)))
        alerts += of(RaiseAlert, commands)
        for term in of(TerminateWorker, commands):
            stopped.append(second)
            exited = WorkerExited(t=second + 0.5, worker_id=term.worker_id, signal=15)
            alerts += of(RaiseAlert, reducer.step(exited))
    # Each replacement is the failed slot's successor: it backs off (1, 2, 4 ... s) and the
    # third failure in a row raises the alert, naming the setting.
    assert stopped[:4] == [30, 61, 93, 127]
    [alert] = alerts
    assert alert.alert == "crash_loop" and alert.reason.startswith("3 early failures in a row")
    assert "not started 30s after it was requested (raise start_timeout_s" in alert.reason
    assert reducer.state.pools["envs"].failures >= 3


def test_a_replacement_waiting_for_a_leaving_workers_gpu_is_no_gpu_shortage() -> None:
    reducer, _ = make(pool(policy=static(2), gpus_per_worker=1), gpus=2)
    start_all(reducer, 0.5)
    # An operator drains envs-0: its replacement needs the GPU envs-0 frees when it exits.
    commands = reducer.step(DrainRequested(t=1.0, worker_id="envs-0"))
    assert of(SpawnWorker, commands) == [] and of(RaiseAlert, commands) == []
    assert ("no_free_gpus", "envs") not in reducer.state.alerts
    commands = reducer.step(WorkerExited(t=5.0, worker_id="envs-0", exit_code=0))
    [spawn] = of(SpawnWorker, commands)
    assert spawn.gpus == ("0",)
    # A GPU that will not come free (cordoned under a leaving worker) is a shortage.
    reducer.step(DrainRequested(t=6.0, worker_id="envs-1"))
    commands = reducer.step(GpuCordonRequested(t=7.0, gpu_id="1"))
    assert ("no_free_gpus", "envs") in reducer.state.alerts


def test_silent_worker_is_hung_and_replaced_after_its_grace_period() -> None:
    reducer, _ = make(pool(policy=static(1), heartbeat_grace_s=10))
    start_all(reducer, 0.0)
    reducer.step(WorkerHeartbeat(t=8.0, worker_id="envs-0"))
    assert reducer.step(Tick(t=18.0)) == []  # 10 s since the heartbeat: not past the grace yet
    commands = reducer.step(Tick(t=18.5))
    [term] = of(TerminateWorker, commands)
    assert "silent for 10s > grace 10s" in term.reason
    # Hung within early_exit_s of starting: a failure of its slot, replaced after the backoff.
    assert of(SpawnWorker, commands) == []
    assert [s.worker_id for s in of(SpawnWorker, reducer.step(Tick(t=19.5)))] == ["envs-1"]


def test_a_worker_silent_since_it_started_is_a_failed_start_one_silent_later_is_not() -> None:
    rules = CrashLoopRules(early_exit_s=5.0)
    reducer, _ = make(pool(policy=static(1), heartbeat_grace_s=10, crash_loop=rules))
    start_all(reducer, 0.0)
    # Never a sign of life after it started, found silent past early_exit_s: a failed start.
    [term] = of(TerminateWorker, reducer.step(Tick(t=10.5)))
    assert "silent for 10s" in term.reason
    assert reducer.state.pools["envs"].last_failure_t == 10.5
    assert of(SpawnWorker, reducer.step(Tick(t=11.0))) == []  # its slot's backoff (1 s)
    [spawn] = of(SpawnWorker, reducer.step(Tick(t=11.5)))
    reducer.step(WorkerExited(t=11.6, worker_id="envs-0", signal=15))
    reducer.step(WorkerStarted(t=12.0, worker_id=spawn.worker_id, pid=300, start_time=300))
    # The next one heartbeats past early_exit_s, then goes silent: a hung worker, not a failed
    # start; replaced at once, and no failure counted.
    reducer.step(WorkerHeartbeat(t=20.0, worker_id=spawn.worker_id))
    commands = reducer.step(Tick(t=30.5))
    assert [t.worker_id for t in of(TerminateWorker, commands)] == [spawn.worker_id]
    assert len(of(SpawnWorker, commands)) == 1
    assert reducer.state.pools["envs"].last_failure_t == 10.5


def test_drain_escalates_to_sigterm_then_sigkill_then_gives_up() -> None:
    reducer, _ = make(pool(policy=static(1), drain_timeout_s=20, stop_timeout_s=5))
    start_all(reducer, 0.0)
    [drain] = of(DrainWorker, reducer.step(DrainRequested(t=1.0, worker_id="envs-0")))
    assert (drain.signal, drain.deadline_t, drain.pid) == ("SIGUSR1", 21.0, 100)
    assert reducer.step(Tick(t=20.9)) == []
    [term] = of(TerminateWorker, reducer.step(Tick(t=21.0)))
    assert term.deadline_t == 26.0
    [kill] = of(KillWorker, reducer.step(Tick(t=26.0)))
    assert "process group" in kill.reason
    commands = reducer.step(Tick(t=31.0))
    assert [a.alert for a in of(RaiseAlert, commands)] == ["unkillable_worker"]
    assert [c.gpu_id for c in of(CordonGpu, commands)] == []  # a CPU worker holds no GPU
    assert "envs-0" not in reducer.state.workers


def test_unkillable_worker_gpus_are_cordoned() -> None:
    reducer, _ = make(pool(policy=static(1), gpus_per_worker=1, stop_timeout_s=5), gpus=2)
    start_all(reducer, 0.0)
    reducer.step(GpuLost(t=1.0, gpu_id="0", error="fell off the bus"))
    reducer.step(Tick(t=6.0))  # SIGKILL
    commands = reducer.step(Tick(t=11.0))
    assert any(c.gpu_id == "0" for c in of(CordonGpu, commands))
    assert "unkillable_worker" in reducer.state.gpus["0"].causes


def test_exit_after_drain_is_not_a_crash_and_the_worker_is_replaced() -> None:
    reducer, _ = make(pool(policy=static(1)))
    start_all(reducer, 0.0)
    commands = reducer.step(DrainRequested(t=1.0, worker_id="envs-0"))
    assert [s.worker_id for s in of(SpawnWorker, commands)] == ["envs-1"]  # replaced at once
    reducer.step(WorkerExited(t=2.0, worker_id="envs-0", exit_code=0))
    assert reducer.state.pools["envs"].failures == 0


def test_drain_of_a_worker_not_started_yet_is_repeated_once_it_starts() -> None:
    reducer, _ = make(pool(policy=static(2)))
    reducer.step(PoolPinned(t=1.0, pool="envs", count=1))
    [requested] = [w for w in reducer.state.workers.values() if w.state is WorkerState.DRAINING]
    commands = reducer.step(
        WorkerStarted(t=2.0, worker_id=requested.worker_id, pid=7, start_time=1)
    )
    [drain] = of(DrainWorker, commands)
    assert drain.pid == 7 and "started after its drain" in drain.reason


# --- crash loops ---------------------------------------------------------------------------------


def test_crash_loop_backs_off_exponentially_alerts_and_resets() -> None:
    rules = CrashLoopRules(early_exit_s=30, backoff_base_s=2, backoff_cap_s=8, alert_after=3)
    reducer, _ = make(pool(policy=static(1), min_workers=1, crash_loop=rules))
    t, spawn_times = 0.0, [0.0]
    for failure in range(1, 6):
        worker = next(iter(reducer.state.workers))
        reducer.step(WorkerStarted(t=t + 0.5, worker_id=worker, pid=failure, start_time=failure))
        commands = reducer.step(WorkerExited(t=t + 1, worker_id=worker, exit_code=1))
        assert of(SpawnWorker, commands) == [], f"failure {failure}: respawned without backoff"
        delay = min(8, 2 * 2 ** (failure - 1))  # 2, 4, 8, 8, 8
        assert reducer.state.pools["envs"].backoff_until_t == t + 1 + delay, failure
        raised = [a.alert for a in of(RaiseAlert, commands)]
        assert ("crash_loop" in raised) == (failure == 3), failure  # raised once, at alert_after
        assert "below_min" in raised, failure  # min 1, nothing running during the backoff
        assert reducer.step(Tick(t=t + 1 + delay - 0.1)) == [] or failure == 1
        spawned = of(SpawnWorker, reducer.step(Tick(t=t + 1 + delay)))
        assert len(spawned) == 1, failure
        t = t + 1 + delay
        spawn_times.append(t)
    gaps = [b - a for a, b in itertools.pairwise(spawn_times)]
    assert gaps == [3.0, 5.0, 9.0, 9.0, 9.0]  # 1 s of life + 2, 4, 8, 8, 8 s of backoff
    worker = next(iter(reducer.state.workers))
    reducer.step(WorkerStarted(t=t + 1, worker_id=worker, pid=99, start_time=99))
    commands = reducer.step(Tick(t=t + 31))  # up for early_exit_s: healthy
    assert [(r.alert, r.subject) for r in of(ResolveAlert, commands)] == [("crash_loop", "envs")]
    assert reducer.state.pools["envs"].failures == 0


def test_below_min_during_backoff_raises_an_alert() -> None:
    reducer, _ = make(pool(policy=static(1), min_workers=1))
    commands = reducer.step(SpawnFailed(t=1.0, worker_id="envs-0", error="exec: no such file"))
    [alert] = of(RaiseAlert, commands)
    assert alert.alert == "below_min" and "crash-loop backoff" in alert.reason
    commands = reducer.step(Tick(t=2.0))
    assert len(of(SpawnWorker, commands)) == 1
    assert [r.alert for r in of(ResolveAlert, commands)] == ["below_min"]


def test_a_late_or_repeated_exit_is_a_no_op_but_an_unknown_worker_is_an_error() -> None:
    reducer, _ = make()
    start_all(reducer, 0.0)
    reducer.step(WorkerExited(t=100.0, worker_id="envs-0", exit_code=0))
    state = reducer.state
    assert reducer.step(WorkerExited(t=101.0, worker_id="envs-0", exit_code=0)) == []
    assert reducer.step(WorkerHeartbeat(t=101.0, worker_id="envs-0")) == []
    assert reducer.state.workers == state.workers
    with pytest.raises(InvalidEvent, match="unknown worker 'envs-99'"):
        reducer.step(WorkerExited(t=102.0, worker_id="envs-99", exit_code=0))


# --- restart adoption ----------------------------------------------------------------------------


def test_adopting_a_draining_worker_repeats_its_drain_and_keeps_the_deadline() -> None:
    reducer, _ = make(pool(policy=static(1), drain_timeout_s=30))
    start_all(reducer, 0.0)
    reducer.step(DrainRequested(t=1.0, worker_id="envs-0"))
    [drain] = of(DrainWorker, reducer.step(WorkerAdopted(t=5.0, worker_id="envs-0")))
    assert drain.deadline_t == 31.0
    commands = reducer.step(WorkerLost(t=6.0, worker_id="envs-1", reason="no such process"))
    assert [s.worker_id for s in of(SpawnWorker, commands)] == ["envs-2"]
    assert reducer.state.pools["envs"].failures == 0


# --- GPUs ----------------------------------------------------------------------------------------


def sample(t: float, gpu: str = "0", **overrides: Any) -> GpuSampled:
    fields: dict[str, Any] = {
        "t": t,
        "gpu_id": gpu,
        "memory_used_bytes": 0,
        "memory_total_bytes": 80 * GB,
        "temperature_c": 60.0,
    }
    fields.update(overrides)
    return GpuSampled(**fields)


def test_thermal_throttle_cordons_until_clean_for_the_hysteresis_period() -> None:
    reducer, _ = make(
        pool(policy=static(0), gpus_per_worker=1), gpus=2, cordon=CordonRules(uncordon_after_s=60)
    )
    [cordon] = of(CordonGpu, reducer.step(sample(1.0, throttle_reasons={"thermal"})))
    assert cordon.causes == frozenset({"thermal"})
    reducer.step(PoolPinned(t=2.0, pool="envs", count=2))
    assert [w.gpus for w in reducer.state.workers.values()] == [("1",)]  # not on the cordoned 0
    assert reducer.step(sample(10.0)) == []  # clean from now on
    reducer.step(sample(40.0, throttle_reasons={"thermal"}))  # relapse restarts the clock
    reducer.step(sample(50.0))
    assert reducer.step(Tick(t=109.0)) == []
    commands = reducer.step(Tick(t=110.0))
    assert of(UncordonGpu, commands)[0].gpu_id == "0"
    assert [s.gpus for s in of(SpawnWorker, commands)] == [("0",)]


def test_memory_used_by_others_cordons_a_free_gpu_only() -> None:
    reducer, _ = make(pool(policy=static(1), gpus_per_worker=1), gpus=2)
    assert reducer.step(sample(1.0, "0", memory_used_bytes=79 * GB)) == []  # ours: normal
    [cordon] = of(CordonGpu, reducer.step(sample(1.0, "1", memory_used_bytes=79 * GB)))
    assert cordon.causes == frozenset({"memory"}) and "99% used by others" in cordon.reason


def test_gpu_errors_cordon_stickily_and_move_workers_elsewhere() -> None:
    reducer, _ = make(
        pool(policy=static(1), gpus_per_worker=1), gpus=2, cordon=CordonRules(uncordon_after_s=1)
    )
    start_all(reducer, 0.0)
    commands = reducer.step(sample(1.0, new_errors=2))
    assert [d.worker_id for d in of(DrainWorker, commands)] == ["envs-0"]
    assert [s.gpus for s in of(SpawnWorker, commands)] == [("1",)]
    assert [a.alert for a in of(RaiseAlert, commands)] == ["gpu_errors"]
    reducer.step(sample(2.0))
    reducer.step(Tick(t=100.0))
    assert reducer.state.gpus["0"].causes == {"errors"}  # needs an operator
    commands = reducer.step(GpuUncordonRequested(t=101.0, gpu_id="0"))
    assert of(UncordonGpu, commands) and of(ResolveAlert, commands)


def test_lost_gpu_terminates_its_workers_and_replaces_them_elsewhere() -> None:
    reducer, _ = make(pool(policy=static(1), gpus_per_worker=1, min_workers=1), gpus=2)
    start_all(reducer, 0.0)
    commands = reducer.step(GpuLost(t=1.0, gpu_id="0", error="XID 79"))
    [term] = of(TerminateWorker, commands)
    assert term.worker_id == "envs-0" and "XID 79" in term.reason
    assert [s.gpus for s in of(SpawnWorker, commands)] == [("1",)]
    reducer.step(WorkerExited(t=2.0, worker_id="envs-0", signal=15))
    assert reducer.state.pools["envs"].failures == 0  # deo's decision, not a crash


def test_operator_cordon_and_unknown_gpu() -> None:
    reducer, _ = make(pool(policy=static(0), gpus_per_worker=1), gpus=1)
    [cordon] = of(CordonGpu, reducer.step(GpuCordonRequested(t=1.0, gpu_id="0")))
    assert cordon.causes == {"operator"}
    reducer.step(Tick(t=1000.0))
    assert reducer.state.gpus["0"].causes == {"operator"}
    with pytest.raises(InvalidEvent, match="unknown GPU '7'"):
        reducer.step(GpuCordonRequested(t=1001.0, gpu_id="7"))
    assert reducer.step(sample(1002.0, "7")) == []  # samples of GPUs outside the inventory


# --- pressure, policies and overrides ------------------------------------------------------------


def queue(t: float, queued: int, step: int, batch: int = 64) -> QueueSampled:
    return QueueSampled(
        t=t, pool="envs", queued_sequences=queued, batch_size_seqs=batch, trainer_step=step
    )


def stalled(spec: PoolSpec) -> tuple[Reducer, list[RaiseAlert], float, int]:
    """A buffer pool whose trainer waits each time the queue falls from the off-policy limit
    with nothing landing (a step per 2 s, 10 s waits), four times."""
    reducer, _ = make(spec)
    start_all(reducer, 0.5)
    t, step, raised = 1.0, 0, []
    for _ in range(4):
        for queued, steps in [(192, 0), (128, 1), (64, 1), (0, 1)] + [(0, 0)] * 5:
            t, step = t + 2.0, step + steps
            raised += of(RaiseAlert, reducer.step(queue(t, queued=queued, step=step)))
    return reducer, raised, t, step


def test_what_a_policy_reports_is_an_alert_on_its_pool_until_it_no_longer_does() -> None:
    spec = pool(policy=PolicySpec(name="buffer"), min_workers=4, max_workers=4)
    reducer, raised, t, step = stalled(spec)
    [alert] = raised
    assert (alert.alert, alert.subject) == ("offpolicy_stalls", "envs")
    assert "raise max_batches_offpolicy" in alert.reason
    assert ("offpolicy_stalls", "envs") in reducer.state.alerts
    # Fed for half an hour (a group landing every sample): the policy stops reporting it.
    resolved = []
    for _ in range(1000):
        t, step = t + 2.0, step + 1
        resolved += of(ResolveAlert, reducer.step(queue(t, queued=96, step=step)))
    assert [r.alert for r in resolved] == ["offpolicy_stalls"]
    assert ("offpolicy_stalls", "envs") not in reducer.state.alerts


def test_a_policy_alert_is_resolved_once_the_pool_has_another_policy() -> None:
    spec = pool(policy=PolicySpec(name="buffer"), min_workers=4, max_workers=4)
    reducer, raised, t, step = stalled(spec)
    assert [a.alert for a in raised] == ["offpolicy_stalls"]
    # The same policy with other parameters still reports it (its memory is kept).
    retuned = attrs.evolve(spec, policy=PolicySpec(name="buffer", params={"band_batches": 0.4}))
    commands = reducer.step(Configured(t=t + 0.5, config=Config(pools=[retuned], gpus=[])))
    assert of(ResolveAlert, commands) == []
    changed = attrs.evolve(spec, policy=static(4))
    commands = reducer.step(Configured(t=t + 1.0, config=Config(pools=[changed], gpus=[])))
    [resolved] = of(ResolveAlert, commands)
    assert resolved.alert == "offpolicy_stalls"
    assert "static" in resolved.reason
    assert ("offpolicy_stalls", "envs") not in reducer.state.alerts
    assert of(RaiseAlert, reducer.step(queue(t + 2.0, queued=0, step=step))) == []


def test_a_sample_the_policy_does_not_decide_on_leaves_its_alerts_alone() -> None:
    # A buffer pool sent in-flight counts besides its queue (the simulator sends both): the
    # alert its queue samples report is neither resolved nor raised again on each of them.
    spec = pool(policy=PolicySpec(name="buffer"), min_workers=4, max_workers=4)
    reducer, raised, t, step = stalled(spec)
    assert [a.alert for a in raised] == ["offpolicy_stalls"]
    alerts = []
    for _ in range(20):
        t, step = t + 2.0, step + 1
        load = LoadSampled(t=t, pool="envs", in_flight_requests=16)
        alerts += of(ResolveAlert, reducer.step(load))
        commands = reducer.step(queue(t + 1.0, queued=0, step=step))
        alerts += of(RaiseAlert, commands) + of(ResolveAlert, commands)
    assert alerts == []
    assert ("offpolicy_stalls", "envs") in reducer.state.alerts


def hpa_pool(**overrides: Any) -> PoolSpec:
    policy = PolicySpec(
        name="hpa",
        params={
            "target_per_worker": 4.0,
            "scale_down_stabilization_s": 0.0,
            "scale_up_pods": 1000,  # the reducer's rules here, not Kubernetes' rate limit
        },
    )
    return pool(policy=policy, min_workers=1, max_workers=10, stabilization_s=60, **overrides)


def test_policy_scales_on_fresh_samples_within_bounds() -> None:
    reducer, _ = make(hpa_pool())
    start_all(reducer, 0.0)
    # 1 worker, 20 in flight / (1 x 4) = 5.0 -> ceil(1 x 5) = 5
    [scale] = of(ScalePool, reducer.step(LoadSampled(t=1.0, pool="envs", in_flight_requests=20)))
    assert (scale.previous, scale.target, scale.source) == (1, 5, "policy")
    # 5 workers, 400 in flight -> 100 wanted, clamped to max 10
    [scale] = of(ScalePool, reducer.step(LoadSampled(t=2.0, pool="envs", in_flight_requests=400)))
    assert scale.target == 10


def test_no_scale_down_within_the_stabilization_window() -> None:
    reducer, _ = make(hpa_pool())
    start_all(reducer, 0.0)
    reducer.step(LoadSampled(t=1.0, pool="envs", in_flight_requests=20))  # up to 5
    assert of(ScalePool, reducer.step(LoadSampled(t=60.0, pool="envs", in_flight_requests=0))) == []
    [scale] = of(ScalePool, reducer.step(LoadSampled(t=61.0, pool="envs", in_flight_requests=0)))
    assert (scale.previous, scale.target) == (5, 1)


def test_a_removal_the_stabilization_window_holds_shows_in_the_state_until_it_ends() -> None:
    reducer, _ = make(hpa_pool())
    start_all(reducer, 0.0)
    reducer.step(LoadSampled(t=1.0, pool="envs", in_flight_requests=20))  # up to 5
    assert reducer.state.pools["envs"].held is None
    reducer.step(LoadSampled(t=30.0, pool="envs", in_flight_requests=0))
    held = reducer.state.pools["envs"].held
    assert held is not None
    assert (held.target, held.since_t, held.until_t) == (1, 30.0, 61.0)
    assert held.reason  # the policy's own
    # Checked as part of invariant 4: a hold at or above the count in force is no removal.
    assert state_violations(reducer.state) == []
    pools = dict(reducer.state.pools)
    pools["envs"] = replace(pools["envs"], held=replace(held, target=5))
    [violation] = state_violations(replace(reducer.state, pools=pools))
    assert violation.startswith("4: pool envs holds back")
    # Asked again, it is still held since the first time.
    reducer.step(LoadSampled(t=45.0, pool="envs", in_flight_requests=4))
    held = reducer.state.pools["envs"].held
    assert held is not None and (held.target, held.since_t) == (1, 30.0)
    # The policy asks for the count it has: nothing is held.
    reducer.step(LoadSampled(t=50.0, pool="envs", in_flight_requests=20))
    assert reducer.state.pools["envs"].held is None
    reducer.step(LoadSampled(t=55.0, pool="envs", in_flight_requests=0))
    assert reducer.state.pools["envs"].held is not None
    # Once the window ends the removal goes through, and nothing is held any more.
    [scale] = of(ScalePool, reducer.step(LoadSampled(t=61.0, pool="envs", in_flight_requests=0)))
    assert scale.target == 1 and reducer.state.pools["envs"].held is None


def test_a_pinned_pool_holds_no_removal_for_the_window() -> None:
    reducer, _ = make(hpa_pool())
    start_all(reducer, 0.0)
    reducer.step(LoadSampled(t=1.0, pool="envs", in_flight_requests=20))  # up to 5
    reducer.step(LoadSampled(t=30.0, pool="envs", in_flight_requests=0))
    assert reducer.state.pools["envs"].held is not None
    reducer.step(PoolPinned(t=31.0, pool="envs", count=5))
    reducer.step(LoadSampled(t=32.0, pool="envs", in_flight_requests=0))
    assert reducer.state.pools["envs"].held is None


def test_a_pool_removed_and_declared_again_starts_without_its_scaling_history() -> None:
    # Removed with no worker left, the pool is gone with its last scale-up: declared again it
    # is a new pool, free to scale down at once.
    hpa = PolicySpec(name="hpa", params={"target_per_worker": 4.0})
    hog = pool("hog", min_workers=1, max_workers=1, gpus_per_worker=1)
    reducer = Reducer(check_invariants=True)

    def declare(*pools: PoolSpec) -> list[Command]:
        return reducer.step(Configured(t=0.0, config=Config(pools=[hog, *pools], gpus=["0"])))

    declare(pool("judges", max_workers=1, gpus_per_worker=1, policy=hpa))  # no GPU left for it
    [up] = of(ScalePool, reducer.step(LoadSampled(t=0.0, pool="judges", in_flight_requests=1)))
    assert up.source == "policy" and up.target == 1
    declare()
    assert "judges" not in reducer.state.pools
    static = PolicySpec(name="static", params={"count": 1})
    declare(pool("judges", max_workers=1, policy=static))
    declare(pool("judges", max_workers=1, policy=hpa, stabilization_s=10.0))
    [down] = of(ScalePool, reducer.step(LoadSampled(t=0.0, pool="judges", in_flight_requests=0)))
    assert (down.previous, down.target, down.source) == (1, 0, "policy")


def test_source_down_and_stale_samples_hold_the_count() -> None:
    reducer, _ = make(hpa_pool(metrics_stale_s=30))
    start_all(reducer, 0.0)
    reducer.step(LoadSampled(t=1.0, pool="envs", in_flight_requests=8))  # 2 workers
    commands = reducer.step(SourceDown(t=100.0, pool="envs", error="connection refused"))
    assert of(RaiseAlert, commands) == []  # one failed read: held, no alert yet
    assert reducer.state.pools["envs"].source_error == "connection refused"
    commands = reducer.step(SourceDown(t=102.0, pool="envs", error="connection refused"))
    assert [a.alert for a in of(RaiseAlert, commands)] == ["source_down"]
    commands = reducer.step(Tick(t=200.0))
    assert [a.alert for a in of(RaiseAlert, commands)] == ["pressure_stale"]
    assert of(ScalePool, commands) == [] and reducer.state.pools["envs"].desired == 2
    commands = reducer.step(LoadSampled(t=201.0, pool="envs", in_flight_requests=0))
    assert sorted(r.alert for r in of(ResolveAlert, commands)) == ["pressure_stale", "source_down"]
    assert [s.target for s in of(ScalePool, commands)] == [1]


def test_a_source_failing_now_and_then_raises_no_alert() -> None:
    reducer, _ = make(hpa_pool())
    start_all(reducer, 0.0)
    alerts = []
    for i in range(30):  # every third read fails, never two in a row
        t = 1.0 + 2.0 * i
        if i % 3 == 2:
            commands = reducer.step(SourceDown(t=t, pool="envs", error="read timed out"))
        else:
            commands = reducer.step(LoadSampled(t=t, pool="envs", in_flight_requests=8))
        alerts += of(RaiseAlert, commands) + of(ResolveAlert, commands)
    assert [a for a in alerts if a.alert == "source_down"] == []


def test_pause_freezes_the_count_but_still_replaces_crashed_workers() -> None:
    reducer, _ = make(hpa_pool())
    start_all(reducer, 0.0)
    reducer.step(AutoscalingPaused(t=1.0))
    assert of(ScalePool, reducer.step(LoadSampled(t=2.0, pool="envs", in_flight_requests=40))) == []
    commands = reducer.step(WorkerExited(t=100.0, worker_id="envs-0", exit_code=1))
    assert len(of(SpawnWorker, commands)) == 1
    reducer.step(AutoscalingResumed(t=101.0))
    [scale] = of(ScalePool, reducer.step(LoadSampled(t=102.0, pool="envs", in_flight_requests=40)))
    assert scale.target == 10


def test_pin_overrides_the_policy_until_unpinned() -> None:
    reducer, _ = make(hpa_pool())
    start_all(reducer, 0.0)
    [scale] = of(ScalePool, reducer.step(PoolPinned(t=1.0, pool="envs", count=3)))
    assert (scale.source, scale.target) == ("operator", 3)
    assert len(of(SpawnWorker, reducer.step(Tick(t=1.5)))) == 0
    assert reducer.state.counted("envs") == 3
    assert (
        of(ScalePool, reducer.step(LoadSampled(t=2.0, pool="envs", in_flight_requests=400))) == []
    )
    with pytest.raises(InvalidEvent, match=r"count 11 is outside pool 'envs' bounds \[1, 10\]"):
        reducer.step(PoolPinned(t=3.0, pool="envs", count=11))
    reducer.step(PoolPinned(t=4.0, pool="envs", count=None))
    assert reducer.state.pools["envs"].desired == 3


def test_unknown_pool_is_refused_and_changes_nothing() -> None:
    reducer, _ = make()
    before = reducer.state
    with pytest.raises(InvalidEvent, match="unknown pool 'nope'"):
        reducer.step(LoadSampled(t=1.0, pool="nope", in_flight_requests=1))
    assert reducer.state is before


def test_time_never_goes_backwards() -> None:
    reducer, _ = make()
    reducer.step(Tick(t=50.0))
    reducer.step(Tick(t=10.0))
    assert reducer.state.now == 50.0


@pytest.mark.parametrize(
    ("make_event", "message"),
    [
        (lambda: Tick(t=-1.0), "Tick.t must be a finite number"),
        (lambda: Tick(t=float("nan")), "Tick.t must be a finite number"),
        (lambda: queue(1.0, -5, 0), r"queued_sequences must be an integer in \[0, 2\*\*63\)"),
        (lambda: queue(1.0, 2**64, 0), "queued_sequences must be an integer in"),
        (lambda: queue(1.0, 5, 0, batch=0), "batch_size_seqs must be >= 1"),
        (lambda: sample(1.0, memory_used_bytes=2, memory_total_bytes=1), "exceeds"),
        (lambda: WorkerStarted(t=1.0, worker_id="x-1", pid=-3, start_time=0), "pid"),
    ],
)
def test_malformed_events_are_refused_on_construction(make_event: Any, message: str) -> None:
    with pytest.raises(InvalidEvent, match=message):
        make_event()


def test_a_refused_event_leaves_the_state_untouched_even_after_partial_work() -> None:
    # The second pool is valid, the third has a bad policy parameter: nothing may be applied.
    reducer, _ = make()
    before = reducer.state
    bad = pool("bad", policy=PolicySpec(name="hpa", params={"target_per_worker": -1.0}))
    with pytest.raises(ConfigError, match="target_per_worker"):
        reducer.step(Configured(t=1.0, config=Config(pools=[pool(), pool("more"), bad])))
    assert reducer.state is before
    assert set(before.pools) == {"envs"}


def test_the_input_state_is_never_mutated() -> None:
    reducer, _ = make(pool(policy=static(3)))
    snapshot = attrs.evolve(reducer.state)
    workers = dict(reducer.state.workers)
    start_all(reducer, 1.0)
    reducer.step(DrainRequested(t=2.0, worker_id="envs-0"))
    assert snapshot.workers == workers
    assert all(w.state is WorkerState.REQUESTED for w in snapshot.workers.values())


def events_for_determinism() -> list[Event]:
    return [
        Configured(t=0.0, config=Config(pools=[hpa_pool()], gpus=["0"])),
        WorkerStarted(t=1.0, worker_id="envs-0", pid=5, start_time=5),
        LoadSampled(t=2.0, pool="envs", in_flight_requests=30),
        Tick(t=3.0),
        WorkerExited(t=4.0, worker_id="envs-0", exit_code=3),
        Tick(t=10.0),
    ]


def test_same_events_same_commands() -> None:
    runs = []
    for _ in range(2):
        reducer = Reducer()
        runs.append([reducer.step(ev) for ev in events_for_determinism()])
    assert runs[0] == runs[1]
    assert any(runs[0])


def test_a_queue_deeper_than_the_trainer_can_use_raises_an_alert_until_it_drains() -> None:
    reducer, _ = make(pool(queue_alert_batches=4.0))
    # 4 batches of 64 exactly: not more than the trainer can use
    assert not of(RaiseAlert, reducer.step(queue(1.0, queued=256, step=0)))
    # 4.5 batches: alert, once
    [alert] = of(RaiseAlert, reducer.step(queue(2.0, queued=288, step=0)))
    assert (alert.alert, alert.subject) == ("queue_backlog", "envs")
    assert "4.5 batches queued" in alert.reason
    assert not of(RaiseAlert, reducer.step(queue(3.0, queued=300, step=0)))
    # back to 1 batch: resolved
    [resolved] = of(ResolveAlert, reducer.step(queue(4.0, queued=64, step=3)))
    assert resolved.alert == "queue_backlog"
    assert ("queue_backlog", "envs") not in reducer.state.alerts
