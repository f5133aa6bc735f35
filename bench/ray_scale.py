"""deo's cost at the scale of a large Ray cluster, by simulation: 10,000 workers on 1,250 nodes.

Run from the repository root::

    .venv/bin/python bench/ray_scale.py                 # 600 s of cluster time: one keep-alive
    .venv/bin/python bench/ray_scale.py --window-s 60 --gpu-keepalive-s 60   # quicker, same mix
    .venv/bin/python bench/ray_scale.py --nvml-interval-s 0   # GPU health off
    .venv/bin/python bench/ray_scale.py --gpu-keepalive-s 0   # every GPU reading logged
    .venv/bin/python bench/ray_scale.py --workers 16 --nodes 2 --window-s 30   # a smoke run

One pool of ``--workers`` one-GPU workers on ``--nodes`` nodes (GPUs ``nN:I``) is brought up (not
timed), then ``--window-s`` seconds of cluster time are generated at the rates deo would see with
the Ray executor, and each event goes through the real reducer and the real event log
(``EventLog.record``, no fsync), as ``deo run`` handles it:

- a heartbeat from every worker each ``--heartbeat-s`` (5 s, each at its own phase), noted by
  the runner's :class:`~adapters.runtime.liveness.Liveness` as deo does, and a ``Tick`` each
  ``--tick-s`` (1 s) with the ``WorkersSeen`` records the runner writes before it (the pool's
  grace is ``--grace-s``, 30 s);
- a reading of every GPU each ``--nvml-interval-s`` (deo's NVML default, 2 s), temperatures
  jittering by a degree, through deo's ``GpuMonitor`` and its filter, as the per-node NVML
  agents' readings go: only those that matter to the cordon rules, and one per GPU per
  ``--gpu-keepalive-s``, become ``GpuSampled`` records (0: every reading);
- a ``LoadSampled`` for the pool each second;
- worker exits at ``--exits-per-worker-hour`` (Ray actor deaths, crashes; 0.36: one a second
  at 10,000 workers): each ``WorkerExited`` makes the core respawn, and the replacement's
  ``WorkerStarted`` follows 2 s later.

It prints deo's CPU time per second of cluster time (cores at that rate), the log's bytes per day
at that rate, and the time to handle each event (a decision is made when its event is handled: a
tick's decisions are late by the time the events queued before it take). Targets: under one core,
under 1 GB of log a day, every tick handled within one tick.
"""

from __future__ import annotations

import argparse
import heapq
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import attrs
import orjson

from adapters.log import EventLog
from adapters.runtime.liveness import Liveness
from adapters.sources.nvml import GpuHealth, GpuMonitor, NvmlSettings, held_gpus, sample_filter
from core import (
    Config,
    Configured,
    Event,
    LoadSampled,
    PolicySpec,
    PoolSpec,
    Reducer,
    SpawnWorker,
    Tick,
    WorkerExited,
    WorkersSeen,
    WorkerStarted,
)

GIB = 2**30


def build_config(workers: int, nodes: int, grace_s: float) -> Config:
    per_node = -(-workers // nodes)
    gpus = [f"n{node}:{index}" for node in range(nodes) for index in range(per_node)][:workers]
    pool = PoolSpec(
        name="gen",
        argv=("python", "-m", "engine"),
        min_workers=0,
        max_workers=workers,
        gpus_per_worker=1,
        heartbeat_grace_s=grace_s,
        policy=PolicySpec(name="static", params={"count": workers}),
    )
    return Config(pools=(pool,), gpus=gpus)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--workers", type=int, default=10_000, help="one-GPU workers in the pool (10,000)"
    )
    parser.add_argument(
        "--nodes", type=int, default=1_250, help="nodes the workers' GPUs are spread over"
    )
    parser.add_argument(
        "--window-s",
        type=float,
        default=600.0,
        help="cluster time measured (600: one GPU keep-alive, so each falls in it once)",
    )
    parser.add_argument("--tick-s", type=float, default=1.0, help="deo's tick interval")
    parser.add_argument(
        "--nvml-interval-s",
        type=float,
        default=2.0,
        help="seconds between readings of every GPU (0: GPU health off)",
    )
    parser.add_argument(
        "--exits-per-worker-hour",
        type=float,
        default=0.36,
        help="worker exits per worker per hour, each replaced (0.36: one a second at 10,000)",
    )
    parser.add_argument("--grace-s", type=float, default=30.0, help="the pool's heartbeat_grace_s")
    parser.add_argument(
        "--heartbeat-s", type=float, default=5.0, help="seconds between a worker's heartbeats"
    )
    parser.add_argument(
        "--gpu-keepalive-s",
        type=float,
        default=NvmlSettings().keepalive_s,
        help="nvml.keepalive_s: a steady GPU's reading is logged this often (0: every reading)",
    )
    args = parser.parse_args(argv)
    command = "bench/ray_scale.py " + " ".join(sys.argv[1:] if argv is None else argv)
    print(f"$ .venv/bin/python {command.strip()}")

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "scale.jsonl"
        log, _ = EventLog.open(path, fsync=False, snapshot_every=10**12)
        reducer = Reducer()
        config = build_config(args.workers, args.nodes, args.grace_s)
        t = 0.0
        started = time.perf_counter()
        pending = _apply(log, reducer, Configured(t=t, config=config))
        # Bring-up: every spawn starts (not timed).
        while pending:
            t += 0.001
            spawn = pending.pop()
            pending += _apply(
                log, reducer, WorkerStarted(t=t, worker_id=spawn.worker_id, pid=1, start_time=1)
            )
        # Every worker seen an hour later, as the window starts (its record is fresh).
        t = float(int(t) + 3600)
        _apply(log, reducer, WorkersSeen(t=t, worker_ids=set(reducer.state.workers)))
        # The window starts an hour after bring-up: the exits are of workers past the pool's
        # early-exit window, not a crash loop.
        log.flush()
        live = sorted(reducer.state.workers)
        print(
            f"bring-up: {len(live):,} workers on {len(config.gpus):,} GPUs of {args.nodes:,} "
            f"nodes in {time.perf_counter() - started:.1f} s (not timed)",
            flush=True,
        )
        settings = NvmlSettings(keepalive_s=args.gpu_keepalive_s)
        monitor = GpuMonitor(
            list(config.gpus),
            sample_filter(
                settings, lambda: reducer.state.config.cordon, lambda: held_gpus(reducer.state)
            ),
        )
        if args.nvml_interval_s > 0:
            # The GPUs' first readings, one poll before the window (each is sent once).
            first, _ = monitor.step(_readings(config.gpus, 0), t - args.nvml_interval_s)
            for sample in first:
                _apply(log, reducer, sample)
            log.flush()
        bytes_before = path.stat().st_size

        events = _schedule(args, t, live)
        liveness = Liveness()
        phase = {
            worker_id: (i * 0.618034 % 1.0) * args.heartbeat_s for i, worker_id in enumerate(live)
        }
        previous_tick_t = t
        cpu = 0.0
        per_kind: dict[str, list[float]] = {}
        counts: Counter[str] = Counter()
        polls = 0
        restarts: list[tuple[float, int, str]] = []
        serial = 0
        end_t = t + args.window_s
        while events:
            event_t, _, event = heapq.heappop(events)
            if event_t >= end_t:
                break
            if isinstance(event, Tick):
                # Heartbeats since the last tick, each noted with its time (Runner.saw).
                cpu_start = time.process_time()
                state = reducer.state
                for worker_id in state.workers:
                    offset = phase.get(worker_id, 0.0)
                    beat_t = event_t - (event_t - offset) % args.heartbeat_s
                    if beat_t > previous_tick_t:
                        liveness.saw(state, worker_id, beat_t)
                previous_tick_t = event_t
                # The runner records the sightings due, then the tick (Runner._ticks).
                extras: list[Event] = list(liveness.records(state, event_t, args.tick_s))
                cpu += time.process_time() - cpu_start
                spawned: list[SpawnWorker] = []
                for extra in (*extras, event):
                    cpu += _timed(log, reducer, extra, per_kind, counts, spawned)
                for spawn in spawned:
                    heapq.heappush(restarts, (event_t + 2.0, serial, spawn.worker_id))
                    serial += 1
                while restarts and restarts[0][0] <= event_t:
                    _, _, worker_id = heapq.heappop(restarts)
                    start = WorkerStarted(t=event_t, worker_id=worker_id, pid=2, start_time=2)
                    cpu += _timed(log, reducer, start, per_kind, counts)
                # The runner flushes each batch it handled (here: once per tick, the fewest).
                cpu_start = time.process_time()
                log.flush()
                cpu += time.process_time() - cpu_start
                live = sorted(reducer.state.workers)
                continue
            if isinstance(event, _Poll):
                # One poll of every GPU (the agents' answers gathered), through the filter.
                readings = _readings(config.gpus, event.round)  # made on the nodes
                cpu_start = time.process_time()
                samples, _ = monitor.step(readings, event_t)
                cpu += time.process_time() - cpu_start
                for sample in samples:
                    cpu += _timed(log, reducer, sample, per_kind, counts)
                polls += 1
                continue
            if isinstance(event, WorkerExited):
                victim = live[serial % len(live)]
                serial += 7919
                event = WorkerExited(t=event_t, worker_id=victim, exit_code=1)
            commands: list[SpawnWorker] = []
            cpu += _timed(log, reducer, event, per_kind, counts, commands)
            for spawn in commands:
                heapq.heappush(restarts, (event_t + 2.0, serial, spawn.worker_id))
        log.flush()
        written = path.stat().st_size - bytes_before
        bytes_by_kind: Counter[str] = Counter()
        with path.open("rb") as file:
            file.seek(bytes_before)
            for line in file:
                record = orjson.loads(line)
                kind = record["event"]["@"] if record.get("kind") == "event" else record["kind"]
                bytes_by_kind[kind] += len(line)
        alerts = sorted(f"{alert.value} {subject}" for alert, subject in reducer.state.alerts)
        pools = {name: len(reducer.state.workers_of(name)) for name in reducer.state.pools}
        log.close()

    window = args.window_s
    print(f"at the end: workers per pool {pools}; alerts: {', '.join(alerts) or 'none'}")
    print(
        f"events handled in {window:g} s of cluster time: "
        + ", ".join(f"{kind} {n:,}" for kind, n in counts.most_common())
    )
    print(f"deo CPU per second of cluster time: {cpu / window:.3f} s (cores; target < 1)")
    per_day = written / window * 86_400
    print(
        f"log: {written / window / 1024:,.1f} KiB/s = {per_day / GIB:,.2f} GiB/day "
        f"(target < 1); by kind, share of records: "
        + ", ".join(f"{k} {n / max(1, sum(counts.values())):.0%}" for k, n in counts.most_common())
    )
    print(
        "log bytes by record kind: "
        + ", ".join(
            f"{kind} {n / window * 86_400 / GIB:.3f} GiB/day"
            for kind, n in bytes_by_kind.most_common()
        )
    )
    for kind, times in sorted(per_kind.items()):
        times.sort()
        p99 = times[int(0.99 * (len(times) - 1))]
        print(
            f"  {kind:>14}: median {statistics.median(times) * 1e3:8.3f} ms, "
            f"p99 {p99 * 1e3:8.3f} ms, max {times[-1] * 1e3:8.3f} ms"
        )
    # All the events of one tick interval are handled before the next tick's decision: its
    # latency is what a tick interval's events cost.
    per_tick_s = cpu / window * args.tick_s
    within = "yes" if per_tick_s < args.tick_s else "NO"
    print(
        f"decision latency: a tick interval's events take {per_tick_s * 1e3:.0f} ms of the "
        f"{args.tick_s * 1e3:.0f} ms tick; decisions within one tick: {within}"
    )
    return 0


@attrs.frozen(slots=True)
class _Poll:
    """One poll of every GPU's NVML (the per-node agents' answers, gathered)."""

    round: int


def _schedule(
    args: argparse.Namespace, t0: float, live: list[str]
) -> list[tuple[float, int, Event | _Poll]]:
    heap: list[tuple[float, int, Event | _Poll]] = []
    serial = 0

    def push(t: float, event: Event | _Poll) -> None:
        nonlocal serial
        serial += 1
        heap.append((t, serial, event))

    n_ticks = int(args.window_s / args.tick_s) + 1
    for i in range(1, n_ticks + 1):
        t = t0 + i * args.tick_s
        push(t, Tick(t=t, interval_s=args.tick_s))
    for second in range(int(args.window_s) + 1):
        t = t0 + second + 0.5
        push(t, LoadSampled(t=t, pool="gen", in_flight_requests=len(live) * 4))
    if args.nvml_interval_s > 0:
        rounds = int(args.window_s / args.nvml_interval_s) + 1
        for r in range(rounds):
            push(t0 + r * args.nvml_interval_s, _Poll(round=r + 1))
    exits_per_hour = args.exits_per_worker_hour * args.workers
    if exits_per_hour > 0:
        gap = 3600.0 / exits_per_hour
        k = 1
        while k * gap < args.window_s:
            t = t0 + k * gap + 0.25
            push(t, WorkerExited(t=t, worker_id="chosen-when-handled", exit_code=1))
            k += 1
    heapq.heapify(heap)
    return heap


def _readings(gpus: tuple[str, ...], round_: int) -> dict[str, GpuHealth]:
    """Healthy readings whose temperatures jitter by a degree from poll to poll."""
    return {
        gpu: GpuHealth(
            memory_used_bytes=0,  # a freed GPU reads free: replacements may land on it
            memory_total_bytes=80 * GIB,
            temperature_c=65.0 + (i % 7) + (round_ + i) % 3 * 0.5,
        )
        for i, gpu in enumerate(gpus)
    }


def _apply(log: EventLog, reducer: Reducer, event: Event) -> list[SpawnWorker]:
    return [c for c in log.record(reducer, event) if isinstance(c, SpawnWorker)]


def _timed(
    log: EventLog,
    reducer: Reducer,
    event: Event,
    per_kind: dict[str, list[float]],
    counts: Counter[str],
    spawns: list[SpawnWorker] | None = None,
) -> float:
    cpu_start = time.process_time()
    wall_start = time.perf_counter()
    commands = log.record(reducer, event)
    wall = time.perf_counter() - wall_start
    cpu = time.process_time() - cpu_start
    kind = type(event).__name__
    per_kind.setdefault(kind, []).append(wall)
    counts[kind] += 1
    if spawns is not None:
        spawns += [c for c in commands if isinstance(c, SpawnWorker)]
    return cpu


if __name__ == "__main__":
    sys.exit(main())
