"""The core's rules at cluster scale: node-local GPU placement, sparse GPU samples, sparse
sightings and crash loops judged per worker slot in large pools."""

from __future__ import annotations

from typing import Any

from core import (
    Config,
    Configured,
    CordonRules,
    GpuSampled,
    PolicySpec,
    PoolSpec,
    RaiseAlert,
    Reducer,
    ResolveAlert,
    SpawnWorker,
    Tick,
    UncordonGpu,
    WorkerExited,
    WorkerStarted,
)
from core.config import node_of
from core.step import take_gpus

GB = 1 << 30


def spawns_of(commands: list[Any]) -> list[SpawnWorker]:
    return [c for c in commands if isinstance(c, SpawnWorker)]


def configure(pool: PoolSpec, gpus: list[str], **config: Any) -> tuple[Reducer, list[Any]]:
    reducer = Reducer(check_invariants=True)
    commands = reducer.step(Configured(t=0.0, config=Config(pools=(pool,), gpus=gpus, **config)))
    return reducer, commands


def gpu_pool(count: int, gpus_per_worker: int, **overrides: Any) -> PoolSpec:
    return PoolSpec(
        name="gen",
        argv=("python", "-m", "engine"),
        max_workers=64,
        gpus_per_worker=gpus_per_worker,
        policy=PolicySpec(name="static", params={"count": count}),
        **overrides,
    )


# --- a worker's GPUs on one node ------------------------------------------------------------------


def test_node_of_a_gpu_id() -> None:
    assert node_of("a:0") == "a"
    assert node_of("node-7:12") == "node-7"
    assert node_of("3") == "" and node_of("GPU-8d2c1e0a") == ""


def test_take_gpus_takes_them_from_one_node() -> None:
    free = ["a:0", "b:0", "b:1", "a:1"]
    assert take_gpus(free, 2) == ("b:0", "b:1")
    assert free == ["a:0", "a:1"]
    assert take_gpus(["a:0", "b:0"], 2) is None
    local = ["0", "1", "2"]
    assert take_gpus(local, 2) == ("0", "1") and local == ["2"]


def test_a_multi_gpu_worker_gets_its_gpus_on_one_node() -> None:
    # One GPU of node a is listed first: in list order a worker would get a:0 and b:0.
    gpus = ["a:0", "b:0", "b:1", "a:1", "c:0"]
    reducer, commands = configure(gpu_pool(3, 2), gpus)
    placed = [spawn.gpus for spawn in spawns_of(commands)]
    assert placed == [("b:0", "b:1"), ("a:0", "a:1")]  # the first node with two free
    assert all(len({g.split(":")[0] for g in gpus}) == 1 for gpus in placed)
    # The third worker would need c:0 and another node's GPU: it waits, and the alert says why.
    [alert] = [a for a in reducer.state.alerts if a[0].value == "no_free_gpus"]
    assert alert[1] == "gen"


def test_local_gpu_ids_are_assigned_in_order_as_before() -> None:
    _, commands = configure(gpu_pool(2, 2), ["0", "1", "2", "3"])
    assert [spawn.gpus for spawn in spawns_of(commands)] == [("0", "1"), ("2", "3")]


# --- sparse GPU samples ---------------------------------------------------------------------------


def sample(t: float, gpu: str = "a:0", **overrides: Any) -> GpuSampled:
    fields: dict[str, Any] = {
        "t": t,
        "gpu_id": gpu,
        "memory_used_bytes": 0,
        "memory_total_bytes": 80 * GB,
        "temperature_c": 60.0,
    }
    fields.update(overrides)
    return GpuSampled(**fields)


def test_a_cordon_ends_on_time_when_clean_samples_are_sparse() -> None:
    # A poller that reports changes sends one clean sample when the GPU cools and then only
    # keep-alives: the time between samples counts as clean, judged on the ticks.
    reducer, _ = configure(gpu_pool(0, 1), ["a:0", "a:1"], cordon=CordonRules(uncordon_after_s=120))
    reducer.step(sample(1.0, temperature_c=95.0))
    assert reducer.state.gpus["a:0"].causes
    reducer.step(sample(10.0, temperature_c=70.0))  # the change: cooled down
    for t in range(11, 130):
        commands = reducer.step(Tick(t=float(t), interval_s=1.0))
        assert not [c for c in commands if isinstance(c, UncordonGpu)], t  # before 10 + 120
    commands = reducer.step(Tick(t=130.0, interval_s=1.0))
    assert [c.gpu_id for c in commands if isinstance(c, UncordonGpu)] == ["a:0"]
    assert not reducer.state.gpus["a:0"].causes


# --- crash loops judged slot by slot -------------------------------------------------------------


def large_pool(workers: int) -> Reducer:
    reducer, _ = configure(
        PoolSpec(
            name="envs",
            argv=("python", "env.py"),
            max_workers=workers,
            max_starting=workers,
            policy=PolicySpec(name="static", params={"count": workers}),
        ),
        [],
    )
    start_requested(reducer, 0.0)
    return reducer


def start_requested(reducer: Reducer, t: float) -> None:
    for worker in list(reducer.state.workers.values()):
        if worker.state.value == "requested":
            reducer.step(
                WorkerStarted(
                    t=t, worker_id=worker.worker_id, pid=1000 + worker.index, start_time=1
                )
            )


def crash_loop_alerted(commands: list[Any]) -> bool:
    return any(isinstance(c, RaiseAlert) and c.alert == "crash_loop" for c in commands)


def test_unrelated_early_exits_in_a_large_pool_delay_only_their_own_slots() -> None:
    # Every second a worker ends its run (planned or not, after minutes: no failure), and the
    # fresh worker started in its place exits early: one early exit a second, each in another
    # slot, as flaky starts on a big cluster give. Each slot's replacement waits its own second.
    workers = 400
    reducer = large_pool(workers)
    old = sorted(reducer.state.workers)
    commands: list[Any] = []
    for k in range(120):
        t = 100.0 + k
        commands += reducer.step(WorkerExited(t=t, worker_id=old[k], exit_code=0))
        [fresh] = [w for w in reducer.state.workers.values() if w.state.value == "requested"][-1:]
        start_requested(reducer, t + 0.1)
        commands += reducer.step(WorkerExited(t=t + 0.5, worker_id=fresh.worker_id, exit_code=1))
        assert reducer.state.pools["envs"].failures == 1, k  # no slot failed twice
        commands += reducer.step(Tick(t=t + 0.9, interval_s=1.0))
        start_requested(reducer, t + 0.95)
    assert not crash_loop_alerted(commands)
    commands = reducer.step(Tick(t=221.0, interval_s=1.0))
    start_requested(reducer, 221.1)
    reducer.step(Tick(t=260.0, interval_s=1.0))  # the last replacements up for early_exit_s
    pool = reducer.state.pools["envs"]
    assert reducer.state.counted("envs") == workers
    assert (pool.failures, pool.retries) == (0, ())


def test_one_slot_crash_looping_in_a_large_pool_backs_off_alone_and_alerts() -> None:
    reducer = large_pool(200)
    rules = reducer.state.pools["envs"].spec.crash_loop
    # envs-0's run ends; the worker started in its place keeps failing within seconds.
    [first] = spawns_of(reducer.step(WorkerExited(t=99.0, worker_id="envs-0", exit_code=0)))
    start_requested(reducer, 99.5)
    t, slot = 100.0, first.worker_id
    commands: list[Any] = []
    for failures in range(1, 5):
        commands = reducer.step(WorkerExited(t=t, worker_id=slot, exit_code=1))
        assert crash_loop_alerted(commands) == (failures == rules.alert_after), failures
        # Meanwhile another worker's planned exit is replaced at once: the pool is not held.
        other = sorted(w for w in reducer.state.workers if w != slot)[failures]
        spawned = spawns_of(reducer.step(WorkerExited(t=t + 0.1, worker_id=other, exit_code=0)))
        assert len(spawned) == 1 and reducer.state.workers[spawned[0].worker_id].attempt == 0
        start_requested(reducer, t + 0.2)
        backoff = rules.backoff_s(failures)
        assert spawns_of(reducer.step(Tick(t=t + backoff - 0.01, interval_s=1.0))) == []
        [retry] = spawns_of(reducer.step(Tick(t=t + backoff, interval_s=1.0)))
        assert reducer.state.workers[retry.worker_id].attempt == failures
        t += backoff
        start_requested(reducer, t + 0.5)
        slot, t = retry.worker_id, t + 1.0
    assert reducer.state.pools["envs"].failures == 4
    commands = reducer.step(Tick(t=t + rules.early_exit_s, interval_s=1.0))  # the slot holds
    assert any(isinstance(c, ResolveAlert) and c.alert == "crash_loop" for c in commands)
    assert reducer.state.pools["envs"].failures == 0
