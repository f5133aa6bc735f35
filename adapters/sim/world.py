"""The simulated world: an Atropos-style trainer and env workers in simulated time.

The world knows nothing of deo's core. It emits the events a real deployment's sources and
executors would report (:meth:`World.next_event`) and carries out the commands it is given
(:meth:`World.carry_out`); :mod:`adapters.sim.driver` connects it to the real reducer.

Theory of operation
-------------------
Time advances from one scheduled item to the next (a heap ordered by time, then by the order
items were scheduled, so equal times resolve the same way on every machine) or to the next group
completion, whichever comes first.

* Trainer: takes one batch of ``batch_size_seqs`` sequences per step, FIFO, when at least a batch
  is queued and it is neither busy nor paused; otherwise it waits (starves). A step takes the
  phase's ``step_s`` times the step's drawn factor. Pauses stop it taking batches (a step in
  progress finishes).
* Workers: ``SpawnWorker`` holds the GPUs from then until the worker exits. The worker produces
  its drawn start-up time later (``startup_s`` times a factor). A producing worker keeps up to
  ``groups_in_flight`` groups in generation, limited as atroposlib's ``BaseEnv`` limits its
  concurrency (``atroposlib/envs/base.py``, 0.4.0): at most ``max_batches_offpolicy *
  batch_size / group_size - queued groups`` groups, so none starts while
  ``max_batches_offpolicy`` batches are queued.
* Off-policy stop and discard, as ``BaseEnv.env_manager`` does it: once the queue holds
  ``max_batches_offpolicy`` batches, every worker cancels all its groups in generation (their
  prompts go back to its backlog; the generation done is wasted), a draining worker too (its
  loop runs on through a drain, :mod:`deo_worker.atropos`), which then exits. A worker below its
  full concurrency (one of its groups just completed) also cancels its oldest groups beyond the
  room left (``add_train_workers``). Discarded groups and their wasted generation seconds are
  counted.
* Groups: latency = the pool's mean at the group's start times the group's drawn factor
  (:mod:`adapters.sim.draws`: the k-th group started gets the k-th factor under any controller),
  rounded to the millisecond so that a last-bit difference in a platform's ``math`` library cannot
  change a run. With shared inference capacity every group progresses at speed
  ``min(1, capacity / groups in generation)`` (processor sharing), tracked on a virtual clock.
* Commands: DrainWorker stops a worker starting groups; it exits (code 0) when its last group
  completes. TerminateWorker / KillWorker end it at once (signal 15 / 9), losing its groups.
  A command for a worker whose process has not started yet applies when it starts (the core
  repeats drains and stops then); a stop of a worker that never started cancels its start.
* Faults: see :data:`adapters.sim.scenario.FAULT_KINDS`.

Randomness comes only from :class:`adapters.sim.draws.Draws`: the same seed, the same world.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from typing import Any, ClassVar

import attrs

from adapters.sim.draws import Draws
from adapters.sim.scenario import EnvPool, Fault, Scenario
from core import (
    Command,
    DrainWorker,
    Event,
    GpuLost,
    GpuSampled,
    KillWorker,
    LoadSampled,
    QueueSampled,
    ScalePool,
    SourceDown,
    SpawnWorker,
    TerminateWorker,
    Tick,
    WorkerExited,
    WorkerReady,
    WorkerStarted,
)

__all__ = ["SeriesPoint", "World", "WorldRecord"]

TICK_S = 1.0
GIB = 1024**3
GPU_MEMORY_BYTES = 80 * GIB
#: Memory a worker's engine holds on its GPU.
WORKER_MEMORY_BYTES = 60 * GIB


@attrs.frozen(slots=True, kw_only=True)
class SeriesPoint:
    """The world at one sample time (counts summed over pools)."""

    t: float
    #: Workers counting toward the pools' size: spawned, not told to stop, not exited.
    workers: int
    #: Workers producing (started, ready, not draining).
    active_workers: int
    #: The sum of the pools' targets (the last ScalePool of each).
    target: int
    queued_batches: float
    trainer_waiting: bool
    trainer_step: int


@attrs.frozen(slots=True, kw_only=True)
class WorkerSpan:
    """One worker's life: GPUs held from ``spawned_t`` until ``exited_t`` (None: still running)."""

    worker_id: str
    pool: str
    cost: int
    spawned_t: float
    exited_t: float | None


@attrs.frozen(slots=True, kw_only=True)
class ScaleRecord:
    t: float
    pool: str
    previous: int
    target: int
    source: str


@attrs.frozen(slots=True, kw_only=True)
class WorldRecord:
    """What happened, for the metrics: everything measured, nothing derived."""

    duration_s: float
    steps: int
    #: Intervals [start, end) the trainer waited for a batch outside pauses.
    starved: tuple[tuple[float, float], ...]
    #: Sequences consumed per lag (trainer steps between the group being queued and its batch).
    lag_seqs: dict[int, int]
    spans: tuple[WorkerSpan, ...]
    scales: tuple[ScaleRecord, ...]
    series: tuple[SeriesPoint, ...]
    groups_completed: int
    groups_lost: int
    #: Groups cancelled by the off-policy stop and the generation seconds they had spent.
    groups_discarded: int = 0
    discarded_generation_s: float = 0.0
    #: Groups started, all pools: the first this many latencies drawn are the ones the run met.
    groups_started: int = 0


@attrs.define(slots=True, eq=False)
class _Group:
    worker: _Worker
    finish_v: float
    seqs: int
    started_t: float
    cancelled: bool = False


@attrs.define(slots=True, eq=False)
class _Worker:
    worker_id: str
    pool: EnvPool
    gpus: tuple[str, ...]
    spawned_t: float
    pid: int | None = None
    started: bool = False
    producing: bool = False
    draining: bool = False
    exited_t: float | None = None
    groups: list[_Group] = attrs.field(factory=list)

    @property
    def counted(self) -> bool:
        return self.exited_t is None and not self.draining


class World:
    """The simulated trainer, workers, GPUs and faults of one scenario."""

    def __init__(self, scenario: Scenario) -> None:
        self.scenario = scenario
        self.duration_s = scenario.duration_s
        self.trainer = scenario.trainer
        self.batch_seqs = scenario.trainer.batch_size_seqs
        self.now = 0.0
        self._heap: list[tuple[float, int, str, Any]] = []
        self._order = 0
        self._outbox: deque[Event] = deque()
        self.draws = Draws(scenario)
        self._lowest_limit_seqs = self.batch_seqs * min(
            pool.max_batches_offpolicy for pool in scenario.pools
        )
        self._groups_started = {pool.name: 0 for pool in scenario.pools}
        self._workers_spawned = {pool.name: 0 for pool in scenario.pools}
        # Groups in generation, on a virtual clock that runs at the inference speed.
        self._capacity = scenario.inference.max_concurrent_groups if scenario.inference else None
        self._virtual = 0.0
        self._completions: list[tuple[float, int, _Group]] = []
        self._in_flight = 0
        # Trainer and queue: [sequences left, batches taken when the group was queued].
        self._queue: deque[list[int]] = deque()
        self.queued_seqs = 0
        self.steps = 0
        # Batches taken out of the queue (what an atroposlib API server's step counter counts),
        # and those taken but not yet stepped on (a trainer that takes every full batch at once).
        self.taken = 0
        self._held = 0
        self._busy = False
        self._paused = 0
        self._waiting_since: float | None = None
        self._starved: list[tuple[float, float]] = []
        self._lag_seqs: dict[int, int] = {}
        # Workers and GPUs.
        self.workers: dict[str, _Worker] = {}
        self._next_pid = 1000
        self._throttle: dict[str, float] = {}
        self._lost_gpus: set[str] = set()
        self._holder: dict[str, _Worker] = {}
        self._targets: dict[str, int] = {pool.name: 0 for pool in scenario.pools}
        self._scales: list[ScaleRecord] = []
        self._series: list[SeriesPoint] = []
        self.groups_completed = 0
        self.groups_lost = 0
        self.groups_discarded = 0
        self.discarded_generation_s = 0.0
        self._done = False

        self._at(0.0, "trainer", None)
        self._at(TICK_S, "tick", 1)
        self._at(scenario.sample_interval_s, "sample", 1)
        if scenario.gpu_count:
            self._at(scenario.gpu_sample_interval_s, "gpu_sample", 1)
        for pause in scenario.trainer.pauses:
            self._at(pause.at_s, "pause", pause)
            self._at(pause.end_s, "resume", pause)
        for fault in scenario.faults:
            self._at(fault.at_s, "fault", fault)
            if fault.kind == "gpu_throttle" and fault.duration_s is not None:
                self._at(fault.end_s, "unthrottle", fault)

    # --- observation ------------------------------------------------------------------------------

    @property
    def waiting(self) -> bool:
        """The trainer waits for a batch (starves) now."""
        return self._waiting_since is not None

    @property
    def in_flight(self) -> int:
        """Groups in generation, all pools."""
        return self._in_flight

    def speed(self) -> float:
        """How fast groups progress now (1: nominal; below 1 when inference is saturated)."""
        if self._capacity is None or self._in_flight <= self._capacity:
            return 1.0
        return self._capacity / self._in_flight

    # --- the event loop ---------------------------------------------------------------------------

    def next_event(self) -> Event | None:
        """Advance to the next event for the core; None once the scenario's duration is over."""
        while not self._outbox:
            if self._done or not self._process_next(self.duration_s):
                self._done = True
                return None
        return self._outbox.popleft()

    def run_until(self, t: float) -> list[Event]:
        """Advance to ``t`` (at most the scenario's end); the events for the core on the way.

        For tests and tools that drive the world without a reducer: commands are carried out by
        calling :meth:`carry_out` in between.
        """
        limit = min(t, self.duration_s)
        events: list[Event] = []
        while True:
            events.extend(self._outbox)
            self._outbox.clear()
            if not self._process_next(limit):
                return events

    def _process_next(self, limit: float) -> bool:
        """Process the next scheduled item or group completion at or before ``limit``; False
        (time advanced to ``limit``) when there is none."""
        t_item = self._heap[0][0] if self._heap else math.inf
        t_group, group = self._next_completion()
        t = min(t_item, t_group)
        if t > limit:
            if limit > self.now:
                self._advance(limit)
            return False
        self._advance(t)
        if group is not None and t_group <= t_item:
            heapq.heappop(self._completions)
            self._virtual = max(self._virtual, group.finish_v)
            self._complete(group)
        else:
            _, _, kind, data = heapq.heappop(self._heap)
            self._HANDLERS[kind](self, data)
        return True

    def _at(self, t: float, kind: str, data: Any) -> None:
        self._order += 1
        heapq.heappush(self._heap, (t, self._order, kind, data))

    def _emit(self, event: Event) -> None:
        self._outbox.append(event)

    def _next_completion(self) -> tuple[float, _Group | None]:
        heap = self._completions
        while heap and heap[0][2].cancelled:
            heapq.heappop(heap)
        if not heap:
            return math.inf, None
        finish_v, _, group = heap[0]
        if self._capacity is None:
            return finish_v, group  # the virtual clock is the real one
        return self.now + max(finish_v - self._virtual, 0.0) / self.speed(), group

    def _advance(self, t: float) -> None:
        if self._capacity is None:
            self._virtual = t
        else:
            self._virtual += (t - self.now) * self.speed()
        self.now = t

    # --- trainer ----------------------------------------------------------------------------------

    def _try_step(self) -> None:
        t = self.now
        if self._busy or self._paused:
            return
        if self._held:
            self._held -= 1
            self._step(t)
            return
        if self.queued_seqs < self.batch_seqs:
            if self._waiting_since is None:
                self._waiting_since = t
            return
        self._stop_waiting()
        # atroposlib's /batch takes every full batch queued and hands out the rest on the
        # trainer's next calls; its step counter counts the batches taken.
        batches = self.queued_seqs // self.batch_seqs if self.trainer.fetch_all else 1
        need = batches * self.batch_seqs
        taken_before = self.steps
        lags = self._lag_seqs
        while need:
            head = self._queue[0]
            take = min(head[0], need)
            lag = taken_before - head[1]
            lags[lag] = lags.get(lag, 0) + take
            head[0] -= take
            need -= take
            if not head[0]:
                self._queue.popleft()
        self.queued_seqs -= batches * self.batch_seqs
        self.taken += batches
        self._held = batches - 1
        self._step(t)
        self._fill_all()  # the queue shrank: workers held back by the off-policy limit resume

    def _step(self, t: float) -> None:
        step_s = self.trainer.step_s_at(t) * self.draws.step_factor(self.steps)
        self.steps += 1
        self._busy = True
        self._at(t + max(round(step_s, 3), 0.001), "trainer", None)

    def _stop_waiting(self) -> None:
        if self._waiting_since is not None:
            if self.now > self._waiting_since:
                self._starved.append((self._waiting_since, self.now))
            self._waiting_since = None

    def _on_trainer(self, _: None) -> None:
        self._busy = False
        self._try_step()

    def _on_pause(self, _: Any) -> None:
        self._paused += 1
        self._stop_waiting()

    def _on_resume(self, _: Any) -> None:
        self._paused -= 1
        self._try_step()

    # --- groups -----------------------------------------------------------------------------------

    def _limit(self, pool: EnvPool) -> int:
        """Groups one worker of ``pool`` may have in generation now (atroposlib's rule)."""
        room = pool.max_batches_offpolicy * self.batch_seqs // pool.group_size
        room -= self.queued_seqs // pool.group_size
        return min(pool.groups_in_flight, room)

    def _fill(self, worker: _Worker) -> None:
        pool = worker.pool
        limit = self._limit(pool)
        while worker.producing and len(worker.groups) < limit:
            self._start_group(worker)

    def _fill_all(self) -> None:
        for worker in self.workers.values():  # spawn order: deterministic
            if worker.producing:
                self._fill(worker)

    def _start_group(self, worker: _Worker) -> None:
        pool = worker.pool
        mean = pool.latency_mean_at(self.now, self.duration_s)
        k = self._groups_started[pool.name]
        self._groups_started[pool.name] = k + 1
        latency = mean * self.draws.latency_factor(pool.name, k)
        factor = max((self._throttle.get(g, 1.0) for g in worker.gpus), default=1.0)
        work = max(round(latency * factor, 3), 0.001)
        group = _Group(
            worker=worker,
            finish_v=self._virtual + work,
            seqs=pool.group_size,
            started_t=self.now,
        )
        worker.groups.append(group)
        self._in_flight += 1
        self._order += 1
        heapq.heappush(self._completions, (group.finish_v, self._order, group))

    def _complete(self, group: _Group) -> None:
        worker = group.worker
        worker.groups.remove(group)
        self._in_flight -= 1
        self.groups_completed += 1
        self._queue.append([group.seqs, self.steps])
        self.queued_seqs += group.seqs
        self._try_step()
        self._stop_at_offpolicy_limit()
        if worker.draining:
            self._end_drain_if_done(worker)
        elif worker.producing:
            self._trim(worker)
            self._fill(worker)

    def _stop_at_offpolicy_limit(self) -> None:
        """At the off-policy limit every worker cancels its groups in generation, a draining one
        too (BaseEnv's loop runs on through a drain; it only starts nothing new); a draining
        worker left with none exits."""
        if self.queued_seqs < self._lowest_limit_seqs:
            return
        for worker in list(self.workers.values()):
            pool = worker.pool
            if (
                worker.exited_t is None
                and worker.groups
                and self.queued_seqs >= pool.max_batches_offpolicy * self.batch_seqs
            ):
                self._discard(worker, len(worker.groups))
                self._end_drain_if_done(worker)

    def _trim(self, worker: _Worker) -> None:
        """A worker below full concurrency cancels its oldest groups beyond the room left."""
        excess = len(worker.groups) - max(self._limit(worker.pool), 0)
        if excess > 0:
            self._discard(worker, excess)

    def _discard(self, worker: _Worker, count: int) -> None:
        for group in worker.groups[:count]:
            group.cancelled = True
            self.discarded_generation_s += self.now - group.started_t
        del worker.groups[:count]
        self._in_flight -= count
        self.groups_discarded += count

    def _cancel_groups(self, worker: _Worker) -> None:
        for group in worker.groups:
            group.cancelled = True
        self._in_flight -= len(worker.groups)
        self.groups_lost += len(worker.groups)
        worker.groups.clear()

    # --- workers ----------------------------------------------------------------------------------

    def carry_out(self, command: Command) -> None:
        """Carry out one of the core's commands at the current time."""
        if isinstance(command, SpawnWorker):
            self._spawn(command)
        elif isinstance(command, ScalePool):
            self._targets[command.pool] = command.target
            self._scales.append(
                ScaleRecord(
                    t=self.now,
                    pool=command.pool,
                    previous=command.previous,
                    target=command.target,
                    source=command.source,
                )
            )
        elif isinstance(command, (DrainWorker, TerminateWorker, KillWorker)):
            worker = self.workers.get(command.worker_id)
            if worker is None or worker.exited_t is not None:
                return
            if isinstance(command, DrainWorker):
                self._drain(worker)
            else:
                # At once; a worker whose process has not come up yet never starts.
                self._exit(worker, signal=15 if isinstance(command, TerminateWorker) else 9)
        # CordonGpu, UncordonGpu and alerts change nothing in the world.

    def _spawn(self, command: SpawnWorker) -> None:
        pool = self.scenario.pool(command.pool)
        worker = _Worker(
            worker_id=command.worker_id, pool=pool, gpus=command.gpus, spawned_t=self.now
        )
        self.workers[worker.worker_id] = worker
        for gpu in worker.gpus:
            self._holder[gpu] = worker
        k = self._workers_spawned[pool.name]
        self._workers_spawned[pool.name] = k + 1
        startup_s = round(pool.startup_s * self.draws.startup_factor(pool.name, k), 3)
        if pool.require_ready:
            self._at(self.now + min(1.0, startup_s), "started", worker)
            self._at(self.now + startup_s, "ready", worker)
        else:
            self._at(self.now + startup_s, "started", worker)

    def _on_started(self, worker: _Worker) -> None:
        if worker.exited_t is not None:
            return
        self._next_pid += 1
        worker.pid = self._next_pid
        worker.started = True
        self._emit(
            WorkerStarted(
                t=self.now,
                worker_id=worker.worker_id,
                pid=worker.pid,
                start_time=round(self.now * 100),  # clock ticks since boot, as /proc reports
            )
        )
        for fault in self.scenario.faults:
            if (
                fault.kind == "crash_loop"
                and fault.covers(self.now)
                and (fault.pool or self.scenario.pools[0].name) == worker.pool.name
            ):
                self._at(self.now + fault.exit_after_s, "crash", worker)
                break
        if worker.draining:
            self._end_drain_if_done(worker)  # drained before it started: nothing in flight
        elif not worker.pool.require_ready:
            self._start_producing(worker)

    def _on_ready(self, worker: _Worker) -> None:
        if worker.exited_t is not None:
            return
        self._emit(WorkerReady(t=self.now, worker_id=worker.worker_id))
        if not worker.draining:
            self._start_producing(worker)

    def _start_producing(self, worker: _Worker) -> None:
        worker.producing = True
        self._fill(worker)

    def _drain(self, worker: _Worker) -> None:
        if worker.draining:
            return
        worker.draining = True
        worker.producing = False
        self._end_drain_if_done(worker)

    def _end_drain_if_done(self, worker: _Worker) -> None:
        """A draining worker exits (code 0) once it has started and no group is left."""
        if worker.draining and worker.started and not worker.groups and worker.exited_t is None:
            self._exit(worker, exit_code=0)

    def _exit(
        self, worker: _Worker, *, exit_code: int | None = None, signal: int | None = None
    ) -> None:
        self._cancel_groups(worker)
        worker.producing = False
        worker.exited_t = self.now
        for gpu in worker.gpus:
            if self._holder.get(gpu) is worker:
                del self._holder[gpu]
        self._emit(
            WorkerExited(t=self.now, worker_id=worker.worker_id, exit_code=exit_code, signal=signal)
        )

    def _on_crash(self, worker: _Worker) -> None:
        if worker.exited_t is None:
            self._exit(worker, exit_code=1)

    # --- faults -----------------------------------------------------------------------------------

    def _on_fault(self, fault: Fault) -> None:
        pool_name = fault.pool or self.scenario.pools[0].name
        if fault.kind == "gpu_throttle":
            assert fault.gpu is not None
            self._throttle[str(fault.gpu)] = fault.factor
        elif fault.kind == "gpu_loss":
            gpu = str(fault.gpu)
            self._lost_gpus.add(gpu)
            self._throttle.pop(gpu, None)
            self._emit(GpuLost(t=self.now, gpu_id=gpu, error="fell off the bus (simulated)"))
            holder = self._holder.get(gpu)
            if holder is not None and holder.exited_t is None:
                self._exit(holder, exit_code=1)
        elif fault.kind == "worker_crash":
            victims = [
                w
                for w in self.workers.values()
                if w.pool.name == pool_name and w.producing and w.exited_t is None
            ]
            for worker in victims[: fault.count]:  # oldest first
                self._exit(worker, exit_code=1)
        # crash_loop acts as workers start, source_down as samples are taken.

    def _on_unthrottle(self, fault: Fault) -> None:
        self._throttle.pop(str(fault.gpu), None)

    # --- periodic ---------------------------------------------------------------------------------

    def _on_tick(self, k: int) -> None:
        self._emit(Tick(t=self.now))
        self._at((k + 1) * TICK_S, "tick", k + 1)

    def _source_down(self, pool: str) -> bool:
        return any(
            f.kind == "source_down" and f.covers(self.now) and (f.pool is None or f.pool == pool)
            for f in self.scenario.faults
        )

    def _on_sample(self, k: int) -> None:
        t = self.now
        for pool in self.scenario.pools:
            name = pool.name
            if self._source_down(name):
                self._emit(SourceDown(t=t, pool=name, error="connection refused (simulated)"))
                continue
            self._emit(
                QueueSampled(
                    t=t,
                    pool=name,
                    queued_sequences=self.queued_seqs,
                    batch_size_seqs=self.batch_seqs,
                    trainer_step=self.taken,
                )
            )
            in_flight = sum(
                len(w.groups) for w in self.workers.values() if w.producing and w.pool is pool
            )
            self._emit(LoadSampled(t=t, pool=name, in_flight_requests=in_flight))
        live = [w for w in self.workers.values() if w.exited_t is None]
        self._series.append(
            SeriesPoint(
                t=t,
                workers=sum(1 for w in live if w.counted),
                active_workers=sum(1 for w in live if w.producing),
                target=sum(self._targets.values()),
                queued_batches=self.queued_seqs / self.batch_seqs,
                trainer_waiting=self.waiting,
                trainer_step=self.steps,
            )
        )
        self._at((k + 1) * self.scenario.sample_interval_s, "sample", k + 1)

    def _on_gpu_sample(self, k: int) -> None:
        for gpu in self.scenario.gpu_ids:
            if gpu in self._lost_gpus:
                continue
            factor = self._throttle.get(gpu)
            self._emit(
                GpuSampled(
                    t=self.now,
                    gpu_id=gpu,
                    memory_used_bytes=WORKER_MEMORY_BYTES if gpu in self._holder else 0,
                    memory_total_bytes=GPU_MEMORY_BYTES,
                    temperature_c=92.0 if factor else 55.0,
                    throttle_reasons=frozenset({"thermal"}) if factor else frozenset(),
                )
            )
        self._at((k + 1) * self.scenario.gpu_sample_interval_s, "gpu_sample", k + 1)

    _HANDLERS: ClassVar[dict[str, Any]] = {
        "trainer": _on_trainer,
        "pause": _on_pause,
        "resume": _on_resume,
        "started": _on_started,
        "ready": _on_ready,
        "crash": _on_crash,
        "fault": _on_fault,
        "unthrottle": _on_unthrottle,
        "tick": _on_tick,
        "sample": _on_sample,
        "gpu_sample": _on_gpu_sample,
    }

    # --- the end ----------------------------------------------------------------------------------

    def finish(self) -> WorldRecord:
        """What happened up to the end of the scenario (call once next_event returned None)."""
        end = self.duration_s
        starved = list(self._starved)
        if self._waiting_since is not None and end > self._waiting_since:
            starved.append((self._waiting_since, end))
        return WorldRecord(
            duration_s=end,
            steps=self.steps,
            starved=tuple(starved),
            lag_seqs=dict(sorted(self._lag_seqs.items())),
            spans=tuple(
                WorkerSpan(
                    worker_id=w.worker_id,
                    pool=w.pool.name,
                    cost=w.pool.cost_per_worker,
                    spawned_t=w.spawned_t,
                    exited_t=w.exited_t,
                )
                for w in self.workers.values()
            ),
            scales=tuple(self._scales),
            series=tuple(self._series),
            groups_completed=self.groups_completed,
            groups_lost=self.groups_lost,
            groups_discarded=self.groups_discarded,
            discarded_generation_s=self.discarded_generation_s,
            groups_started=sum(self._groups_started.values()),
        )
