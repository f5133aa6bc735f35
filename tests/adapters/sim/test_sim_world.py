"""The simulated world on tiny scenarios, driven by hand (no reducer): expectations computed.

Latencies are made deterministic with ``latency_sigma = 1e-6``: every group then takes its mean
(rounded to the millisecond), so times and counts can be worked out on paper.
"""

from __future__ import annotations

from typing import Any

import attrs

from adapters.sim.scenario import EnvPool, Fault, InferenceSpec, Pause, Scenario, TrainerSpec
from adapters.sim.world import World
from core import (
    DrainWorker,
    Event,
    GpuLost,
    GpuSampled,
    KillWorker,
    LoadSampled,
    QueueSampled,
    SourceDown,
    SpawnWorker,
    TerminateWorker,
    Tick,
    WorkerExited,
    WorkerReady,
    WorkerStarted,
)

EXACT = 1e-6  # latency_sigma that makes every group take its mean latency


def make_scenario(
    *,
    trainer: dict[str, Any] | None = None,
    faults: tuple[Fault, ...] = (),
    inference: InferenceSpec | None = None,
    **pool: Any,
) -> Scenario:
    """A one-pool scenario: groups of 8, 1 in flight, 10 s each, no start-up, 16-seq batches."""
    pool_fields: dict[str, Any] = {
        "group_size": 8,
        "groups_in_flight": 1,
        "latency_mean_s": 10.0,
        "latency_sigma": EXACT,
        "startup_s": 0.0,
        "max_workers": 4,
        "max_batches_offpolicy": 10,
        **pool,
    }
    return Scenario(
        name="tiny",
        duration_s=1000.0,
        sample_interval_s=2.0,
        gpu_sample_interval_s=10.0,
        trainer=TrainerSpec(**{"batch_size_seqs": 16, "step_s": 1.0, **(trainer or {})}),
        pools=(EnvPool(name="envs", **pool_fields),),
        inference=inference,
        faults=faults,
    )


def spawn(world: World, *indices: int) -> None:
    for i in indices:
        world.carry_out(
            SpawnWorker(
                worker_id=f"envs-{i}",
                pool="envs",
                argv=("sim",),
                gpus=(str(i),),
                env={},
                reason="test",
            )
        )


def of(events: list[Event], kind: type) -> list[Any]:
    return [e for e in events if type(e) is kind]


PAUSED = {"pauses": (Pause(at_s=0.0, duration_s=10_000.0),)}  # a trainer that never consumes


def test_trainer_starves_while_less_than_a_batch_is_queued() -> None:
    # One worker, one group of 8 per 10 s; a batch is 16: a step (1 s) every 20 s.
    world = World(make_scenario())
    spawn(world, 0)
    world.run_until(100.0)
    assert world.steps == 5  # at t = 20, 40, 60, 80, 100
    record = world.finish()
    # Waiting [0, 20), then [21, 40), [41, 60), [61, 80), [81, 100): 20 + 4 x 19 = 96 s.
    assert record.starved[:2] == ((0.0, 20.0), (21.0, 40.0))
    assert world.waiting is False  # it took a batch at t = 100


def test_backpressure_stops_new_groups_at_the_offpolicy_limit() -> None:
    # Limit 1 batch = 16 seqs = 2 groups; a worker may hold min(4, 2 - queued groups) in flight.
    world = World(make_scenario(trainer=PAUSED, groups_in_flight=4, max_batches_offpolicy=1))
    spawn(world, 0)
    world.run_until(1.0)
    assert world.in_flight == 2
    world.run_until(500.0)
    assert world.queued_seqs == 16  # both completed at t = 10; none started since
    assert world.in_flight == 0


def test_groups_in_generation_are_discarded_at_the_offpolicy_limit() -> None:
    # Three workers start 2 groups each before any is queued; all would finish at t = 10. The
    # first worker's two fill the 1-batch limit, so the other four are cancelled, as a BaseEnv
    # cancels its running groups at the limit: 10 s of generation each, wasted.
    world = World(make_scenario(trainer=PAUSED, groups_in_flight=4, max_batches_offpolicy=1))
    spawn(world, 0, 1, 2)
    world.run_until(500.0)
    assert world.queued_seqs == 16
    assert world.in_flight == 0
    record = world.finish()
    assert (record.groups_completed, record.groups_discarded) == (2, 4)
    assert record.discarded_generation_s == 40.0
    assert record.groups_lost == 0


def test_groups_started_just_before_the_limit_are_discarded_with_the_rest() -> None:
    # Limit 2 batches = 4 groups; two workers of 2 groups each, all done at t = 10. Worker 0's
    # completions leave room, so it starts 2 new groups; worker 1's fill the queue to the limit,
    # which cancels worker 0's new groups (no generation time spent yet).
    world = World(make_scenario(trainer=PAUSED, groups_in_flight=2, max_batches_offpolicy=2))
    spawn(world, 0, 1)
    world.run_until(30.0)
    assert world.queued_seqs == 32 and world.in_flight == 0
    record = world.finish()
    assert (record.groups_completed, record.groups_discarded) == (4, 2)
    assert record.discarded_generation_s == 0.0


def test_a_draining_workers_groups_are_discarded_at_the_offpolicy_limit_too() -> None:
    # Limit 1 batch = 2 groups. Workers 0 and 1 start 2 groups each, all done at t = 10;
    # worker 1 is drained at t = 5. BaseEnv's loop runs on through a drain (it only starts
    # nothing new), so when worker 0's two groups fill the queue to the limit, worker 1's two
    # are cancelled like any others, not posted on top of it, and its drain ends there.
    world = World(make_scenario(trainer=PAUSED, groups_in_flight=4, max_batches_offpolicy=1))
    spawn(world, 0, 1)
    world.run_until(5.0)
    world.carry_out(
        DrainWorker(worker_id="envs-1", pid=1002, signal="SIGUSR1", deadline_t=65.0, reason="")
    )
    events = world.run_until(500.0)
    assert world.queued_seqs == 16
    exits = of(events, WorkerExited)
    assert [(e.worker_id, e.t, e.exit_code) for e in exits] == [("envs-1", 10.0, 0)]
    record = world.finish()
    assert (record.groups_completed, record.groups_discarded) == (2, 2)
    assert record.groups_lost == 0


def test_the_same_seed_draws_the_same_start_ups_and_step_times() -> None:
    def run(seed: int) -> tuple[list[float], int]:
        scenario = attrs.evolve(
            make_scenario(startup_s=30.0, startup_sigma=0.5, trainer={"step_sigma": 0.5}),
            seed=seed,
        )
        world = World(scenario)
        spawn(world, 0, 1, 2)
        events = world.run_until(400.0)
        return [e.t for e in of(events, WorkerStarted)], world.steps

    first, again, other = run(1), run(1), run(2)
    assert first == again
    assert first != other
    assert len(set(first[0])) == 3 and all(t > 0 for t in first[0])


def test_consumption_lets_held_back_workers_resume() -> None:
    # Limit 2 batches = 4 groups. At t = 10 the worker's 4 groups complete: the queue holds 4
    # groups, so after the first step (t = 10) only 2 may restart; the second step (t = 11)
    # frees the room for the other 2. From then on 2 groups complete at 10k and 2 at 10k + 1.
    world = World(make_scenario(groups_in_flight=4, max_batches_offpolicy=2))
    spawn(world, 0)
    world.run_until(10.5)
    assert (world.steps, world.in_flight) == (1, 2)
    world.run_until(11.0)
    assert (world.steps, world.in_flight) == (2, 4)
    world.run_until(100.5)
    # Steps at 10k and 10k + 1 for k = 1 .. 9, and at t = 100: 19.
    assert world.steps == 19


def test_a_drain_finishes_in_flight_groups_then_exits_cleanly() -> None:
    world = World(make_scenario(trainer=PAUSED, groups_in_flight=4))
    spawn(world, 0)
    events = world.run_until(5.0)
    assert of(events, WorkerStarted)[0].t == 0.0
    assert world.in_flight == 4
    world.carry_out(
        DrainWorker(worker_id="envs-0", pid=1001, signal="SIGUSR1", deadline_t=65.0, reason="")
    )
    assert not of(world.run_until(9.9), WorkerExited)  # still finishing its groups
    events = world.run_until(10.0)
    (exited,) = of(events, WorkerExited)
    assert (exited.t, exited.exit_code, exited.signal) == (10.0, 0, None)
    assert world.queued_seqs == 32  # all four groups were delivered
    assert world.in_flight == 0


def test_terminate_and_kill_lose_in_flight_groups() -> None:
    world = World(make_scenario(trainer=PAUSED, groups_in_flight=4))
    spawn(world, 0, 1)
    world.run_until(5.0)
    world.carry_out(TerminateWorker(worker_id="envs-0", pid=1001, deadline_t=15.0, reason=""))
    world.carry_out(KillWorker(worker_id="envs-1", pid=1002, reason=""))
    events = world.run_until(5.0)
    assert [(e.worker_id, e.signal) for e in of(events, WorkerExited)] == [
        ("envs-0", 15),
        ("envs-1", 9),
    ]
    world.run_until(100.0)
    assert world.queued_seqs == 0
    assert world.finish().groups_lost == 8


def test_commands_before_the_process_starts() -> None:
    world = World(make_scenario(startup_s=30.0))
    spawn(world, 0, 1)
    world.run_until(10.0)
    world.carry_out(
        DrainWorker(worker_id="envs-0", pid=None, signal="SIGUSR1", deadline_t=70.0, reason="")
    )
    world.carry_out(TerminateWorker(worker_id="envs-1", pid=None, deadline_t=20.0, reason=""))
    events = world.run_until(40.0)
    # The drained worker starts (the core repeats the drain then) and leaves at once, cleanly;
    # the terminated one never starts.
    assert [
        (type(e).__name__, e.t)
        for e in events
        if not isinstance(e, (Tick, QueueSampled, LoadSampled, GpuSampled))
    ] == [
        ("WorkerExited", 10.0),
        ("WorkerStarted", 30.0),
        ("WorkerExited", 30.0),
    ]
    exits = of(events, WorkerExited)
    assert (exits[0].worker_id, exits[0].signal) == ("envs-1", 15)
    assert (exits[1].worker_id, exits[1].exit_code) == ("envs-0", 0)
    assert world.groups_completed == 0


def test_start_up_latency_and_readiness() -> None:
    world = World(make_scenario(startup_s=30.0, require_ready=True))
    spawn(world, 0)
    events = world.run_until(40.0)
    assert [
        (type(e).__name__, e.t) for e in events if isinstance(e, (WorkerStarted, WorkerReady))
    ] == [
        ("WorkerStarted", 1.0),
        ("WorkerReady", 30.0),
    ]
    assert world.in_flight == 1  # producing since t = 30; its first group is due at t = 40
    world2 = World(make_scenario(startup_s=30.0))
    spawn(world2, 0)
    (started,) = of(world2.run_until(40.0), WorkerStarted)
    assert started.t == 30.0


def test_a_throttled_gpu_makes_its_worker_slower() -> None:
    throttle = Fault(kind="gpu_throttle", at_s=0.0, gpu=0, factor=3.0, duration_s=100.0)
    world = World(make_scenario(trainer=PAUSED, faults=(throttle,)))
    spawn(world, 0, 1)
    world.run_until(29.0)
    # The worker on GPU 1 delivered at 10 and 20; the one on GPU 0 takes 30 s per group.
    assert world.queued_seqs == 16
    world.run_until(30.0)
    assert world.queued_seqs == 32  # GPU 1's third group and GPU 0's first, both at t = 30
    samples = {e.gpu_id: e for e in of(world.run_until(40.0), GpuSampled)}
    assert samples["0"].throttle_reasons == frozenset({"thermal"})
    assert samples["1"].throttle_reasons == frozenset()
    assert samples["0"].memory_used_bytes > 0 and samples["2"].memory_used_bytes == 0
    # After the throttle ends (t = 100) new groups on GPU 0 take 10 s again.
    world.run_until(120.0)
    assert not of(world.run_until(130.0), GpuSampled)[0].throttle_reasons


def test_inference_saturation_caps_throughput() -> None:
    # Capacity 4 groups at nominal speed; 4 groups in flight per worker, 10 s each.
    def delivered_by(workers: int, t: float) -> int:
        world = World(
            make_scenario(
                trainer=PAUSED,
                groups_in_flight=4,
                inference=InferenceSpec(max_concurrent_groups=4),
                max_batches_offpolicy=100,
            )
        )
        spawn(world, *range(workers))
        world.run_until(t)
        return world.groups_completed

    # One worker: 4 groups every 10 s. Two: 8 groups at half speed, done at 20 s. Four: 16
    # groups at a quarter speed, done at 40 s. Throughput stays 4 groups per 10 s.
    assert [delivered_by(1, t) for t in (9.9, 10.0, 40.0)] == [0, 4, 16]
    assert [delivered_by(2, t) for t in (19.9, 20.0, 40.0)] == [0, 8, 16]
    assert [delivered_by(4, t) for t in (39.9, 40.0)] == [0, 16]


def test_lag_counts_steps_between_queueing_and_consumption() -> None:
    # Paused until 35 s; groups (1 per batch: batch 8 = group 8) arrive at 10, 20, 30, ...
    scenario = make_scenario(
        trainer={"batch_size_seqs": 8, "pauses": (Pause(at_s=0.0, duration_s=35.0),)},
    )
    world = World(attrs.evolve(scenario, duration_s=60.0))
    spawn(world, 0)
    while world.next_event() is not None:
        pass
    record = world.finish()
    # At 35 the trainer takes the groups of 10, 20 and 30 in steps 1, 2, 3 (at 35, 36, 37):
    # lags 0, 1 and 2 steps. The groups of 40, 50 and 60 are taken at once: lag 0.
    assert record.lag_seqs == {0: 32, 1: 8, 2: 8}
    assert record.steps == 6
    # Waiting [38, 40), [41, 50), [51, 60); the pause is not starvation.
    assert record.starved == ((38.0, 40.0), (41.0, 50.0), (51.0, 60.0))


def test_gpu_loss_kills_its_worker_after_reporting_the_loss() -> None:
    loss = Fault(kind="gpu_loss", at_s=15.0, gpu=1)
    world = World(make_scenario(faults=(loss,)))
    spawn(world, 0, 1)
    events = world.run_until(15.0)
    lost = [e for e in events if isinstance(e, (GpuLost, WorkerExited))]
    assert [type(e).__name__ for e in lost] == ["GpuLost", "WorkerExited"]
    gpu_lost, exited = lost
    assert isinstance(gpu_lost, GpuLost) and isinstance(exited, WorkerExited)
    assert (gpu_lost.gpu_id, exited.worker_id, exited.exit_code) == ("1", "envs-1", 1)
    # A lost GPU is no longer sampled.
    assert {e.gpu_id for e in of(world.run_until(20.0), GpuSampled)} == {"0", "2", "3"}


def test_worker_crash_and_crash_loop() -> None:
    crash = Fault(kind="worker_crash", at_s=12.0, count=1)
    loop = Fault(kind="crash_loop", at_s=12.0, duration_s=20.0, exit_after_s=5.0)
    world = World(make_scenario(faults=(crash, loop)))
    spawn(world, 0, 1)
    events = world.run_until(12.0)
    (exited,) = of(events, WorkerExited)
    assert (exited.worker_id, exited.exit_code) == ("envs-0", 1)  # the oldest
    spawn(world, 2)  # started inside the window: exits 5 s later
    events = world.run_until(40.0)
    assert [(e.worker_id, e.t, e.exit_code) for e in of(events, WorkerExited)] == [
        ("envs-2", 17.0, 1)
    ]
    spawn(world, 3)  # after the window: stays up
    assert not of(world.run_until(100.0), WorkerExited)


def test_samples_and_source_outage() -> None:
    down = Fault(kind="source_down", at_s=10.0, duration_s=5.0)
    world = World(make_scenario(faults=(down,)))
    spawn(world, 0)
    events = world.run_until(20.0)
    kinds = [(type(e).__name__, e.t) for e in events if isinstance(e, (QueueSampled, SourceDown))]
    assert kinds == [
        ("QueueSampled", 2.0),
        ("QueueSampled", 4.0),
        ("QueueSampled", 6.0),
        ("QueueSampled", 8.0),
        ("SourceDown", 10.0),
        ("SourceDown", 12.0),
        ("SourceDown", 14.0),
        ("QueueSampled", 16.0),
        ("QueueSampled", 18.0),
        ("QueueSampled", 20.0),
    ]
    assert [e.t for e in of(events, Tick)] == [float(t) for t in range(1, 21)]
    load = of(events, LoadSampled)
    assert load[0].in_flight_requests == 1
    assert of(events, QueueSampled)[-1].queued_sequences == 0  # one group at 10, consumed at 20
    series = world.finish().series
    assert [p.t for p in series][:3] == [2.0, 4.0, 6.0]
    assert series[0].workers == 1 and series[0].active_workers == 1


def test_the_world_ends_at_the_scenario_duration() -> None:
    world = World(attrs.evolve(make_scenario(), duration_s=10.0))
    events = []
    while (event := world.next_event()) is not None:
        events.append(event)
    assert max(e.t for e in events) == 10.0
    assert world.next_event() is None
    assert world.now == 10.0
