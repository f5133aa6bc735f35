"""The end of ``deo demo`` from hand-made log steps: every decision shown, worker-seconds, and a
static pool of the same maximum simulated on the demo's own trainer."""

from __future__ import annotations

from adapters.demo.summary import facts_of, render, simulate_static
from core import (
    Configured,
    PolicySpec,
    PoolSpec,
    ScalePool,
    SpawnWorker,
    Tick,
    WorkerExited,
    WorkerHeartbeat,
    WorkerReady,
    WorkersSeen,
)
from core.config import Config


def spawn(i: int) -> SpawnWorker:
    return SpawnWorker(
        worker_id=f"envs-{i}", pool="envs", argv=("env",), gpus=(), env={}, reason="scale up"
    )


def scale(previous: int, target: int, source: str = "policy", reason: str = "") -> ScalePool:
    return ScalePool(
        pool="envs",
        previous=previous,
        target=target,
        source=source,
        reason=reason or f"to {target}",
    )


POOL = PoolSpec(name="envs", argv=["env"], min_workers=1, max_workers=4)
STEPS: list[tuple[float, object, list[object]]] = [
    (100.0, Configured(t=100.0, config=Config(pools=[POOL])), [scale(0, 1, "config"), spawn(0)]),
    (101.0, Tick(t=101.0), [scale(1, 3), spawn(1), spawn(2)]),
    (102.5, WorkerHeartbeat(t=102.5, worker_id="envs-1"), []),
    (103.0, WorkerHeartbeat(t=103.0, worker_id="envs-1"), []),  # only the first counts
    (104.0, WorkerHeartbeat(t=104.0, worker_id="envs-2"), []),
    (110.0, Tick(t=110.0), [scale(3, 2)]),
    (115.0, Tick(t=115.0), [scale(2, 4, reason="queue short -> 6 workers")]),
    (111.0, WorkerExited(t=111.0, worker_id="envs-2", exit_code=0, signal=None), []),
    (120.0, Tick(t=120.0), []),
]


def test_facts_are_every_policy_decision_worker_seconds_and_start_ups() -> None:
    facts = facts_of(STEPS)
    assert facts.span_s == 20.0
    # The configuration's count is not the policy's decision.
    assert [(d.t_s, d.previous, d.target, d.reason) for d in facts.decisions] == [
        (1.0, 1, 3, "to 3"),
        (10.0, 3, 2, "to 2"),
        (15.0, 2, 4, "queue short -> 6 workers"),
    ]
    # envs-0: 100 -> 120 (still running), envs-1: 101 -> 120, envs-2: 101 -> 111.
    assert facts.worker_s == 20.0 + 19.0 + 10.0
    assert facts.startups_s == (1.5, 3.0)


def test_a_start_up_ends_at_the_first_sighting_or_readiness_report() -> None:
    # deo run records heartbeats as one WorkersSeen per tick; a ready worker reports itself.
    steps = [
        STEPS[0],
        STEPS[1],
        (102.5, WorkersSeen(t=102.5, worker_ids={"envs-1"}), []),
        (103.0, WorkerReady(t=103.0, worker_id="envs-2"), []),
        (104.0, WorkersSeen(t=104.0, worker_ids={"envs-1", "envs-2"}), []),  # neither counts
    ]
    assert facts_of(steps).startups_s == (1.5, 2.0)


def test_the_summary_says_what_a_static_pool_would_have_done_and_shows_every_decision() -> None:
    estimate = simulate_static(
        duration_s=60.0,
        batch_size_seqs=32,
        step_s=(1.0, 0.4, 2.5),
        group_size=8,
        groups_in_flight=2,
        latency_s=1.5,
        latency_sigma=0.5,
        max_batches_offpolicy=3,
        startup_s=1.0,
        pool=PoolSpec(
            name="envs",
            argv=["env"],
            min_workers=1,
            max_workers=8,
            policy=PolicySpec(name="buffer"),
        ),
    )
    # 8 workers make 8 x 2 x 8 / 1.5 = 85 seq/s: more than the fastest phase's 80 seq/s, so a
    # static pool at its maximum hardly waits once started.
    assert estimate.static_workers == 8
    assert 0.0 <= estimate.static_wait_s < 3.0
    assert estimate.policy_wait_s >= 0.0
    lines: list[str] = []
    facts = facts_of(STEPS)
    render(
        steps=30,
        waited_s=2.0,
        busy_span_s=20.0,
        first_batch_s=1.0,
        facts=facts,
        estimate=estimate,
        policy="buffer",
        out=lines.append,
    )
    text = "\n".join(lines)
    assert "waited 2.0s for data after its first batch (10% of the time)" in text
    assert "against a static pool of 8 workers (this pool's maximum): it would have waited" in text
    # 8 workers x 20 s = 160 worker-seconds against 49 here.
    assert "and used 160 worker-seconds; deo used 49: 111 saved (69%), for" in text
    assert "simulated the same way, buffer waits" in text
    assert "decisions: 3 scaling decisions by the buffer policy:" in text
    assert "      1.0s  up 1 -> 3 workers: to 3" in lines
    assert "     10.0s  down 3 -> 2 workers: to 2" in lines
    # The policy asked for 6; the pool's maximum held it at 4, and the line says so.
    assert (
        "     15.0s  up 2 -> 4 workers: queue short -> 6 workers (4: the pool's maximum)" in lines
    )
