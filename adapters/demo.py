"""``deo demo``: an Atropos-style training loop in simulated time, run by the real core and log.

A trainer pulls batches of 64 sequences at a step time that changes during the run (fast, then
faster, then slow); environment workers produce groups of 8 sequences with random latency, stop
producing while three batches are queued (atroposlib's ``max_batches_offpolicy``), start after a
delay, drain on request and sometimes crash. deo's default buffer policy scales them. Every event
and command goes through :class:`adapters.log.EventLog`, so the run ends with a log that
``deo replay`` verifies. Same seed, same run.
"""

from __future__ import annotations

import heapq
import random
import sys
from pathlib import Path
from typing import Any, TextIO

import attrs

from adapters.log import EventLog
from adapters.replay import replay
from core import (
    Command,
    Config,
    Configured,
    DrainWorker,
    Event,
    KillWorker,
    PolicySpec,
    PoolSpec,
    QueueSampled,
    Reducer,
    ScalePool,
    SpawnWorker,
    TerminateWorker,
    Tick,
    WorkerExited,
    WorkerStarted,
)

__all__ = ["DemoSettings", "run_demo"]


@attrs.frozen(slots=True, kw_only=True)
class DemoSettings:
    duration_s: float = 900.0
    batch_size_seqs: int = 64
    group_size: int = 8
    #: (from time, seconds per trainer step) phases.
    step_phases: tuple[tuple[float, float], ...] = ((0.0, 4.0), (300.0, 2.0), (600.0, 8.0))
    group_latency_mean_s: float = 4.0
    startup_s: float = 5.0
    max_batches_offpolicy: int = 3
    sample_every_s: float = 2.0
    crash_at_s: float = 200.0
    seed: int = 7


def _step_time(settings: DemoSettings, t: float) -> float:
    current = settings.step_phases[0][1]
    for start, step_s in settings.step_phases:
        if t >= start:
            current = step_s
    return current


class _World:
    """The simulated trainer and env workers, reacting to deo's commands."""

    def __init__(self, settings: DemoSettings) -> None:
        self.s = settings
        self.rng = random.Random(settings.seed)
        self.queue: list[tuple[float, int, str, Any]] = []
        self.order = 0
        self.queued_seqs = 0
        self.step = 0
        self.trainer_busy_until = 0.0
        self.waiting_since: float | None = 0.0
        self.waited_s = 0.0
        self.running: dict[str, int] = {}  # worker id -> pid
        self.draining: set[str] = set()
        self.next_pid = 1000
        self.crashed = False
        self.worker_seconds = 0.0

    def at(self, t: float, kind: str, data: Any = None) -> None:
        self.order += 1
        heapq.heappush(self.queue, (t, self.order, kind, data))

    def carry_out(self, t: float, command: Command) -> None:
        if isinstance(command, SpawnWorker):
            self.at(t + self.s.startup_s, "started", command.worker_id)
        elif isinstance(command, DrainWorker) and command.worker_id in self.running:
            self.draining.add(command.worker_id)
            self.at(t + self.rng.uniform(0.5, 3.0), "exit", (command.worker_id, 0))
        elif isinstance(command, (TerminateWorker, KillWorker)):
            self.at(t + 0.1, "exit", (command.worker_id, -15))

    def produce(self, t: float, worker_id: str) -> None:
        latency = self.rng.lognormvariate(0, 0.6) * self.s.group_latency_mean_s / 1.2
        self.at(t + latency, "group", worker_id)

    def trainer(self, t: float) -> None:
        batch = self.s.batch_size_seqs
        if t < self.trainer_busy_until:
            return
        if self.queued_seqs >= batch:
            if self.waiting_since is not None:
                self.waited_s += t - self.waiting_since
                self.waiting_since = None
            self.queued_seqs -= batch
            self.step += 1
            self.trainer_busy_until = t + _step_time(self.s, t)
            self.at(self.trainer_busy_until, "trainer")
        elif self.waiting_since is None:
            self.waiting_since = t


def run_demo(log_path: Path, settings: DemoSettings | None = None, out: TextIO = sys.stdout) -> int:
    """Run the demo, writing its log to ``log_path``; returns 0 when the log replays exactly."""
    s = settings or DemoSettings()
    for stale in (log_path, log_path.with_name(log_path.name + ".snapshot")):
        stale.unlink(missing_ok=True)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    world = _World(s)
    pool = PoolSpec(
        name="envs",
        argv=["python", "-m", "atropos_env", "--slot", "{index}"],
        min_workers=1,
        max_workers=24,
        policy=PolicySpec(name="buffer", params={"max_batches_offpolicy": s.max_batches_offpolicy}),
        stabilization_s=60.0,
    )
    log, _ = EventLog.open(log_path, fsync=False)
    reducer = Reducer(check_invariants=True)
    decisions: list[str] = []

    def feed(event: Event) -> None:
        for command in log.record(reducer, event):
            if isinstance(command, ScalePool):
                change = f"{command.previous:>2} -> {command.target:<2}"
                decisions.append(f"t={event.t:6.1f}s  {change} {command.reason}")
            world.carry_out(event.t, command)

    print(
        f"deo demo: a trainer pulling {s.batch_size_seqs}-sequence batches, env workers producing "
        f"groups of {s.group_size}, deo's buffer policy in between ({s.duration_s:g}s simulated)",
        file=out,
    )
    feed(Configured(t=0.0, config=Config(pools=[pool])))
    world.at(0.0, "trainer")
    world.at(s.sample_every_s, "sample")
    world.at(s.crash_at_s, "crash")
    next_report = 60.0
    last_t = 0.0
    while world.queue:
        t, _, kind, data = heapq.heappop(world.queue)
        if t > s.duration_s:
            break
        world.worker_seconds += len(world.running) * (t - last_t)
        last_t = t
        if kind == "started":
            world.next_pid += 1
            world.running[data] = world.next_pid
            feed(WorkerStarted(t=t, worker_id=data, pid=world.next_pid, start_time=int(t * 100)))
            if data not in world.draining:
                world.produce(t, data)
        elif kind == "group" and data in world.running:
            full = world.queued_seqs >= s.max_batches_offpolicy * s.batch_size_seqs
            if not full:
                world.queued_seqs += s.group_size
                world.trainer(t)
            if data in world.draining:
                continue
            world.produce(t, data)
        elif kind == "exit" and data[0] in world.running:
            worker_id, code = data
            del world.running[worker_id]
            world.draining.discard(worker_id)
            feed(
                WorkerExited(
                    t=t,
                    worker_id=worker_id,
                    exit_code=code if code >= 0 else None,
                    signal=-code if code < 0 else None,
                )
            )
        elif kind == "crash" and world.running:
            victim = sorted(world.running)[0]
            world.at(t, "exit", (victim, 1))
        elif kind == "trainer":
            world.trainer(t)
        elif kind == "sample":
            feed(Tick(t=t))
            feed(
                QueueSampled(
                    t=t,
                    pool="envs",
                    queued_sequences=world.queued_seqs,
                    batch_size_seqs=s.batch_size_seqs,
                    trainer_step=world.step,
                )
            )
            world.at(t + s.sample_every_s, "sample")
        log.flush()
        if t >= next_report:
            waited = world.waited_s + (
                t - world.waiting_since if world.waiting_since is not None else 0
            )
            print(
                f"  t={t:5.0f}s  workers {len(world.running):>2}  queue "
                f"{world.queued_seqs / s.batch_size_seqs:4.2f} batches  "
                f"trainer step {world.step:>3}  waiting {waited / t:5.1%}  "
                f"(step time {_step_time(s, t):g}s)",
                file=out,
            )
            next_report += 60.0
    log.close()
    end = min(last_t, s.duration_s)
    if world.waiting_since is not None:
        world.waited_s += end - world.waiting_since
    print("\ndecisions:", file=out)
    for line in decisions[:12]:
        print(f"  {line}", file=out)
    if len(decisions) > 12:
        print(f"  ... {len(decisions) - 12} more (see the replay)", file=out)
    problems: list[Any] = []
    events = mismatches = 0
    for step in replay(log_path, problems=problems):
        events += 1
        mismatches += not step.matches
    print(
        f"\nsummary: trainer waited {world.waited_s / end:.1%} of {end:.0f}s, reached step "
        f"{world.step}; {world.worker_seconds / 3600:.2f} worker-hours; {len(decisions)} scaling "
        f"decisions",
        file=out,
    )
    verdict = "replays exactly" if not mismatches and not problems else "DOES NOT replay exactly"
    print(f"log: {log_path} ({events} events) {verdict}", file=out)
    print(f"replay it: deo replay {log_path}", file=out)
    return 0 if verdict == "replays exactly" else 1
