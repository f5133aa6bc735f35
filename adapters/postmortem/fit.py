"""Read what a recorded run shows of its world, measure it, and fit a simulator scenario to it.

:func:`read_run` streams a log once into :class:`RunFacts` (queue samples, worker lives, faults,
scaling decisions). :func:`observe` measures the run from those facts the way a simulated run is
measured (starvation share, worker-hours, queue depth, scaling actions), and :func:`fit_scenario`
turns them into a :class:`~adapters.sim.scenario.Scenario` with one sentence per fitted value
saying what it was fitted from.

What a log shows, and how each value is read from it:

* Trainer demand: ``QueueSampled.trainer_step`` advancing. From one step start to the next with a
  batch queued at every sample in between, the trainer was fed, so that span is its step time;
  per window, merged into phases where it moves by more than a quarter. While it starves its
  demand is hidden: such a window only bounds the step time (the time it ran over the steps it
  took), and keeps its phase unless that bound says the trainer got faster. Each change is then
  moved from its window's edge to the step where the spans on either side split best, and each
  phase's step time read from its own spans.
* Pauses: a batch queued and no step for far longer than a step takes.
* Starvation: non-paused time less the time the steps it took kept it busy.
* Group size: the greatest common divisor of the sequences produced between samples (groups reach
  the queue whole). Groups in flight per worker: ``LoadSampled`` over producing workers, else the
  policy's ``capacity_per_worker``, else assumed. Group latency: Little's law where the queue
  stayed a batch below the off-policy limit with the same workers for a while (no pipeline
  filling, no discards), else production per producing worker; then calibrated by simulation
  (:func:`fit_scenario`). Latency growth: the same reading in the first and last thirds. Its
  spread is not visible in samples of a queue: lognormal sigma 0.8 is assumed.
* Start-up: SpawnWorker to WorkerReady (``require_ready``). Without it, SpawnWorker to
  WorkerStarted plus the time a started worker took to first grow the queue, beyond a group's
  latency, read from workers that started with none other producing.
* Faults: a worker exit deo did not ask for (no drain or stop before it) is a crash; exits within
  the configuration's ``early_exit_s`` of the start are a crash loop; ``GpuLost`` a lost GPU;
  ``SourceDown`` a source outage. Throttling and inference saturation are not fitted.
"""

from __future__ import annotations

import bisect
import itertools
import math
import statistics
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import attrs

from adapters.log import LogProblem
from adapters.outputs import FITTED_BY
from adapters.postmortem.engine import recorded_events
from adapters.sim.scenario import FAULT_KINDS, EnvPool, Fault, Pause, Phase, Scenario, TrainerSpec
from core import (
    Config,
    Configured,
    DeoError,
    GpuLost,
    LoadSampled,
    PoolSpec,
    QueueSampled,
    SourceDown,
    WorkerExited,
    WorkerReady,
    WorkerStarted,
)
from core.policies import PolicyCatalog

__all__ = [
    "FitError",
    "Fitted",
    "calibrated",
    "Observed",
    "RunFacts",
    "fit_scenario",
    "observe",
    "read_run",
    "scenario_toml",
]

#: Fewer queue samples than this, or a shorter run, is too little to fit.
MIN_SAMPLES = 20
MIN_DURATION_S = 20.0
#: Off-policy limit assumed when the policy's parameters do not give it (atroposlib's default).
DEFAULT_OFFPOLICY_BATCHES = 3
#: Groups in flight per worker assumed when the log has no in-flight samples.
DEFAULT_GROUPS_IN_FLIGHT = 2
DEFAULT_LATENCY_SIGMA = 0.8
#: A step time that moves by more than this share starts a new phase.
PHASE_CHANGE = 0.25


class FitError(DeoError, ValueError):
    """The log cannot be fitted; the message says why."""


@attrs.define(slots=True)
class WorkerLife:
    """One worker as the log shows it (times from the run's start)."""

    worker_id: str
    gpus: int
    spawned_t: float
    started_t: float | None = None
    ready_t: float | None = None
    stop_asked_t: float | None = None
    exited_t: float | None = None
    exit_code: int | None = None
    signal: int | None = None
    gpu_ids: tuple[str, ...] = ()


@attrs.define(slots=True)
class RunFacts:
    """Everything the fit and the measurements use, read from one log."""

    path: Path
    config: Config
    pool: PoolSpec
    t0: float
    end_t: float = 0.0
    #: (t, queued sequences, batch size, trainer step) of the pool's QueueSampled.
    queue: list[tuple[float, int, int, int]] = attrs.field(factory=list)
    #: (t, groups in flight) of its LoadSampled.
    load: list[tuple[float, int]] = attrs.field(factory=list)
    workers: dict[str, WorkerLife] = attrs.field(factory=dict)
    gpu_lost: list[tuple[float, str]] = attrs.field(factory=list)
    source_down: list[float] = attrs.field(factory=list)
    #: (t, previous, target) of the policy's ScalePool commands.
    scales: list[tuple[float, int, int]] = attrs.field(factory=list)
    reconfigured: int = 0
    problems: list[LogProblem] = attrs.field(factory=list)
    #: The trainer takes every full batch queued at once (atroposlib's ``/batch``): its step
    #: counter counts batches taken, and the queue read excludes those it holds.
    fetch_all: bool = False
    #: Fetches of two batches or more that the trainer was seen to hold (see :func:`_fetch_all`).
    held_fetches: int = 0
    #: ``queue`` as a trainer that takes one batch per step would show it: steps placed between
    #: fetches, held batches counted as queued (``queue`` itself when ``fetch_all`` is False).
    trainer_queue: list[tuple[float, int, int, int]] = attrs.field(factory=list)

    @property
    def duration_s(self) -> float:
        return self.end_t - self.t0


def read_run(path: Path) -> RunFacts:
    """The facts of the log at ``path``, read from its events and the commands it recorded
    (nothing re-reduced: a log of another deo or other settings reads as it ran);
    :class:`FitError` when it has none to fit."""
    problems: list[LogProblem] = []
    facts: RunFacts | None = None
    for step in recorded_events(path, problems=problems):
        event = step.event
        if facts is None:
            if not isinstance(event, Configured):
                continue
            pools = event.config.pools
            if len(pools) != 1:
                names = ", ".join(p.name for p in pools) or "none"
                raise FitError(
                    f"{path}: the what-if fits runs of one pool; this one has {len(pools)} "
                    f"({names})"
                )
            facts = RunFacts(path=path, config=event.config, pool=pools[0], t0=event.t)
        _take(facts, event, step.commands)
    if facts is None:
        raise FitError(f"{path}: no Configured event: nothing says what ran")
    facts.problems = problems
    facts.held_fetches, facts.fetch_all = _fetch_all(facts.queue)
    facts.trainer_queue = (
        _one_per_step(facts.queue, facts.duration_s) if facts.fetch_all else facts.queue
    )
    return facts


def _fetch_all(queue: list[tuple[float, int, int, int]]) -> tuple[int, bool]:
    """Whether the trainer takes every full batch at once (atroposlib's ``/batch`` does: it takes
    all full batches out of the queue, counts them all as steps, and hands them out one per
    call): fetches of two batches or more, each followed by a sample with a batch queued and no
    step. A trainer taking one batch per step would have taken that batch unless its step
    outlasted a whole sample interval right after taking two batches within one. Fetch-all
    when at least 3 such fetches and a third of all multi-batch fetches are seen."""
    multi = held = 0
    for previous, sample, after in zip(queue, queue[1:], queue[2:], strict=False):
        taken = sample[3] - previous[3]
        if taken >= 2:
            multi += 1
            held += after[3] == sample[3] and after[1] >= after[2]
    return held, held >= 3 and 3 * held >= multi


def _one_per_step(
    queue: list[tuple[float, int, int, int]], end_s: float
) -> list[tuple[float, int, int, int]]:
    """``queue`` of a fetch-all trainer as a one-batch-per-step trainer would show it (see
    :func:`_unroll`), each run of the trainer's step counter on its own: a counter that goes
    down is a restarted trainer, which counts its batches from there."""
    out: list[tuple[float, int, int, int]] = []
    begin = 0
    for index in range(1, len(queue) + 1):
        if index == len(queue) or queue[index][3] < queue[index - 1][3]:
            stop_s = end_s if index == len(queue) else queue[index][0]
            out += _unroll(queue[begin:index], stop_s)
            begin = index
    return out


#: Step times of fed spans this close to a fetch (before or after) stand for its own.
NEARBY_S = 30.0


def _unroll(
    queue: list[tuple[float, int, int, int]], end_s: float
) -> list[tuple[float, int, int, int]]:
    """``queue`` (time-ordered, one trainer counter that never goes down) of a fetch-all
    trainer as a one-batch-per-step trainer would show it.

    Each fetch is placed in the middle of the sample interval it shows in; the k batches it
    took are stepped on one after another until the next fetch: evenly over the span when a
    batch was queued at the sample before the next fetch (the trainer fetched the moment it was
    done), else at the step time of the fed spans nearby (it waited for data before fetching).
    Sorted times and bisection keep it O(n log n) in the samples: a week of samples is read in
    seconds.
    """
    if not queue:
        return []
    times = [sample[0] for sample in queue]
    fetches = [
        ((a[0] + b[0]) / 2, b[3] - a[3]) for a, b in itertools.pairwise(queue) if b[3] > a[3]
    ]
    # For each fetch: was a batch queued at the sample just before the next fetch (and after
    # this one)?
    fed_before: list[bool] = []
    for index, (t, _) in enumerate(fetches):
        if index + 1 == len(fetches):
            fed_before.append(False)
            continue
        last = bisect.bisect_left(times, fetches[index + 1][0]) - 1
        fed_before.append(last >= 0 and times[last] > t and queue[last][1] >= queue[last][2])
    fed_steps = [
        (t, (fetches[i + 1][0] - t) / k)
        for i, (t, k) in enumerate(fetches)
        if fed_before[i] and i + 1 < len(fetches)
    ]
    fed_times = [at for at, _ in fed_steps]
    overall = statistics.median(s for _, s in fed_steps) if fed_steps else None
    starts: list[float] = []
    for i, (t, k) in enumerate(fetches):
        stop = fetches[i + 1][0] if i + 1 < len(fetches) else end_s
        even = (stop - t) / k
        if fed_before[i]:
            step_s = even
        else:
            low = bisect.bisect_left(fed_times, t - NEARBY_S)
            high = bisect.bisect_right(fed_times, t + NEARBY_S)
            nearby = statistics.median(s for _, s in fed_steps[low:high]) if high > low else overall
            step_s = even if nearby is None else min(even, nearby)
        starts += [t + n * step_s for n in range(k)]
    first = queue[0][3]
    out = []
    for t, queued, batch, taken in queue:
        started = first + bisect.bisect_right(starts, t)
        held = max(taken - started, 0)
        out.append((t, queued + held * batch, batch, min(started, taken)))
    return out


def _take(facts: RunFacts, event: Any, commands: list[Any]) -> None:
    t = event.t - facts.t0
    facts.end_t = max(facts.end_t, event.t)
    name = facts.pool.name
    if isinstance(event, Configured):
        if event.config != facts.config:
            facts.reconfigured += 1
    elif isinstance(event, QueueSampled):
        if event.pool == name:
            facts.queue.append(
                (t, event.queued_sequences, event.batch_size_seqs, event.trainer_step)
            )
    elif isinstance(event, LoadSampled):
        if event.pool == name:
            facts.load.append((t, event.in_flight_requests))
    elif isinstance(event, SourceDown):
        if event.pool == name:
            facts.source_down.append(t)
    elif isinstance(event, GpuLost):
        facts.gpu_lost.append((t, event.gpu_id))
    elif isinstance(event, (WorkerStarted, WorkerReady, WorkerExited)):
        life = facts.workers.get(event.worker_id)
        if life is not None:
            if isinstance(event, WorkerStarted):
                life.started_t = t
            elif isinstance(event, WorkerReady):
                life.ready_t = t
            else:
                life.exited_t = t
                life.exit_code = event.exit_code
                life.signal = event.signal
    for command in commands:
        kind = command.get("@")
        if kind == "SpawnWorker" and command.get("pool") == name:
            gpus = tuple(command.get("gpus", ()))
            facts.workers[command["worker_id"]] = WorkerLife(
                worker_id=command["worker_id"],
                gpus=max(facts.pool.gpus_per_worker, 1),
                spawned_t=t,
                gpu_ids=gpus,
            )
        elif kind in ("DrainWorker", "TerminateWorker", "KillWorker"):
            life = facts.workers.get(command.get("worker_id", ""))
            if life is not None and life.stop_asked_t is None:
                life.stop_asked_t = t
        elif (
            kind == "ScalePool"
            and command.get("pool") == name
            and command.get("source") == "policy"
        ):
            facts.scales.append((t, int(command["previous"]), int(command["target"])))


# --- the trainer -------------------------------------------------------------------------------


@attrs.frozen(slots=True, kw_only=True)
class Interval:
    start: float
    end: float
    steps: int
    #: Sequences that reached the queue in it.
    produced: int
    fed: bool
    q_start: int
    q_end: int

    @property
    def dt(self) -> float:
        return self.end - self.start


def _intervals(
    facts: RunFacts, samples: list[tuple[float, int, int, int]] | None = None
) -> list[Interval]:
    """The intervals between ``samples`` (the queue as read; the trainer's view:
    ``facts.trainer_queue``)."""
    samples = facts.queue if samples is None else samples
    out: list[Interval] = []
    for (t1, q1, batch, s1), (t2, q2, _, s2) in itertools.pairwise(samples):
        steps = max(s2 - s1, 0)  # a trainer restarted from step 0 took none
        out.append(
            Interval(
                start=t1,
                end=t2,
                steps=steps,
                produced=max(q2 - q1 + steps * batch, 0),
                fed=q1 >= batch and q2 >= batch,
                q_start=q1,
                q_end=q2,
            )
        )
    return out


@attrs.frozen(slots=True, kw_only=True)
class TrainerFit:
    batch_size_seqs: int
    phases: tuple[tuple[float, float], ...]  # (from t, step s)
    pauses: tuple[tuple[float, float], ...]  # [start, end)
    #: Per window: (start, end, running seconds, steps).
    windows: tuple[tuple[float, float, float, int], ...]
    fed_s: float
    #: Running seconds in windows where the trainer was never seen fed: its demand was hidden.
    hidden_s: float = 0.0
    #: Per window: whether its step time was measured.
    seen: tuple[bool, ...] = ()

    def step_s_at(self, t: float) -> float:
        step = self.phases[0][1]
        for at_s, step_s in self.phases:
            if t >= at_s:
                step = step_s
        return step


def _pause_overlap(pauses: Iterable[tuple[float, float]], start: float, end: float) -> float:
    return sum(max(min(end, b) - max(start, a), 0.0) for a, b in pauses)


def fit_trainer(facts: RunFacts, intervals: list[Interval]) -> TrainerFit:
    batch = facts.queue[-1][2]
    fed = [i for i in intervals if i.fed]
    fed_s = sum(i.dt for i in fed)
    fed_steps = sum(i.steps for i in fed)
    all_steps = sum(i.steps for i in intervals)
    if not all_steps:
        raise FitError(f"{facts.path}: the trainer took no step: there is no demand to fit")
    # A first guess, for the thresholds below: where it was fed, else its pace overall.
    typical = fed_s / fed_steps if fed_steps else sum(i.dt for i in intervals) / all_steps
    # Pauses: runs of intervals with a batch queued and no step for far longer than a step.
    pause_min_s = max(30.0, 6.0 * typical)
    pauses: list[tuple[float, float]] = []
    run_start: float | None = None
    last_end = 0.0
    for interval in [*intervals, None]:
        quiet = interval is not None and interval.fed and interval.steps == 0
        if quiet and interval is not None:
            if run_start is None:
                run_start = interval.start
            last_end = interval.end
            continue
        if run_start is not None and last_end - run_start >= pause_min_s:
            # The step in progress at its start ends about a step later.
            start = min(run_start + typical / 2, last_end)
            pauses.append((start, last_end))
        run_start = None
    # Step time, outside pauses, from spans the trainer was fed throughout: from one step start
    # to the next, with a batch queued at every sample in between (the next step started the
    # moment the one before ended). A start is placed in the middle of the sample interval it
    # shows in. Where steps are shorter than samples, from intervals with a batch queued at both
    # ends instead. (Choosing intervals by the queue at either end alone biases the count: a
    # take empties the queue, and a deep queue means a take is near.)
    spans: list[tuple[float, float, int]] = []  # (t, seconds, steps)
    in_pause = [_pause_overlap(pauses, i.start, i.end) > 0 for i in intervals]
    per_interval = typical < statistics.median(i.dt for i in intervals)
    if per_interval:
        spans = [
            (i.start, i.dt, i.steps)
            for i, paused in zip(intervals, in_pause, strict=True)
            if i.fed and not paused
        ]
    else:
        last: float | None = None
        fed_since = False
        for i, paused in zip(intervals, in_pause, strict=True):
            if paused:
                last = None
                continue
            if i.steps:
                middle = (i.start + i.end) / 2
                if last is not None and fed_since and i.q_start >= batch and i.steps == 1:
                    spans.append((middle, middle - last, 1))
                last = middle if i.steps == 1 else None
                fed_since = i.q_end >= batch
            else:
                fed_since = fed_since and i.q_end >= batch
    fed_s = sum(seconds for _, seconds, _ in spans)
    # Short runs get shorter windows (at least six), so that their phases can show.
    window_s = max(min(30.0, facts.duration_s / 6), 20.0 * typical)
    end = facts.duration_s
    windows: list[tuple[float, float, float, int]] = []
    measured: list[float | None] = []
    start = 0.0
    while start < end:
        stop = min(start + window_s, end)
        inside = [i for i in intervals if start <= i.start < stop]
        running = (stop - start) - _pause_overlap(pauses, start, stop)
        steps = sum(i.steps for i in inside)
        fed_inside = [span for span in spans if start <= span[0] < stop]
        f_s = sum(seconds for _, seconds, _ in fed_inside)
        f_steps = sum(steps for _, _, steps in fed_inside)
        enough = f_steps >= 5 and f_s >= window_s / 4
        measured.append(f_s / f_steps if enough else None)
        windows.append((start, stop, running, steps))
        start = stop
    # Phases: consecutive windows whose measured step time stays within PHASE_CHANGE of the
    # phase's mean. A window the trainer was never fed in hides its demand: it only bounds the
    # step time (at most the time it ran over the steps it took); it keeps the phase unless that
    # bound says the trainer got faster. A new phase starts where the last one was last
    # measured (or at the end of a pause in between: a trainer restarted at a new speed): a
    # trainer that sped up and starved at once shows its new step time only later.
    phases: list[tuple[float, float]] = []
    current: list[float] = []
    measured_end = 0.0
    hidden_s = 0.0
    any_measured = any(value is not None for value in measured)
    for (w_start, w_stop, running, steps), value in zip(windows, measured, strict=True):
        if value is None:
            if running <= 0:
                continue
            hidden_s += running
            if steps < 3:
                continue
            bound = running / steps
            if any_measured and not current:
                continue  # before the first measured window: start-up, not demand
            if current and bound >= statistics.fmean(current) * (1 - PHASE_CHANGE):
                continue
            value = bound
        if current and abs(value / statistics.fmean(current) - 1) > PHASE_CHANGE:
            phases[-1] = (phases[-1][0], statistics.fmean(current))
            current = []
        if not current:
            begins = measured_end
            for _, pause_end in pauses:
                if measured_end <= pause_end <= w_start:
                    begins = pause_end
            phases.append((begins if phases else 0.0, value))
        current.append(value)
        measured_end = w_stop
    if current:
        phases[-1] = (phases[-1][0], statistics.fmean(current))
    if not phases:
        phases.append((0.0, typical))
    # A span (t, seconds, steps) covers [t, t + seconds) read per interval, and ends at t read
    # step to step.
    covered = [(t, t + sec, n) if per_interval else (t - sec, t, n) for t, sec, n in spans]
    phases = _placed(phases, covered, [b for _, b in pauses], end)
    return TrainerFit(
        batch_size_seqs=batch,
        phases=tuple((round(a, 1), round(s, 3)) for a, s in phases),
        pauses=tuple((round(a, 1), round(b, 1)) for a, b in pauses),
        windows=tuple(windows),
        fed_s=fed_s,
        hidden_s=hidden_s,
        seen=tuple(value is not None for value in measured),
    )


def _placed(
    phases: list[tuple[float, float]],
    spans: list[tuple[float, float, int]],
    pause_ends: list[float],
    end: float,
) -> list[tuple[float, float]]:
    """Each change of step time moved from its window's edge to where the spans show it.

    Phases are found window by window, so a change inside a window is first placed at one of its
    edges and the window's step time mixes both speeds. Between the phases before and after a
    change, the spans (start, end, steps) are split where the step times on either side are
    closest to their own means (least squares on log step times). Spans show only where the
    trainer was fed, so a gap around the split is starvation: a trainer that sped up starves
    from its first fast step (the change goes to the end of the last slow span); one that
    slowed down is fed again from its first slow step (the change goes to the start of the
    first slow span). Each phase's step time is then read from its own spans where it has five
    steps or more; one left with fewer joins the phase before, and so does one within
    PHASE_CHANGE of it. A phase that begins at the end of a pause (a trainer restarted) stays,
    and so does one whose best split leaves one speed on both sides (within PHASE_CHANGE): there
    the least cost is noise, not a change.
    """
    if len(phases) < 2 or not spans:
        return phases
    spans = sorted(spans)
    placed = list(phases)
    for k in range(1, len(placed)):
        begin = placed[k][0]
        if begin in pause_ends:
            continue
        low = placed[k - 1][0]
        high = placed[k + 1][0] if k + 1 < len(placed) else end
        around = [span for span in spans if span[0] >= low and span[1] <= high]
        if len(around) < 4:
            continue
        logs = [(math.log((b - a) / n), n) for a, b, n in around if b > a and n > 0]
        if len(logs) != len(around):
            continue
        split = _best_split(logs)
        if split is None:
            continue
        before, after = logs[:split], logs[split:]
        if abs(_mean(after) - _mean(before)) <= math.log1p(PHASE_CHANGE):
            # One speed on both sides (a window that straddled a change read as a phase of its
            # own, and the change before has moved to where it happened): every split costs
            # about the same, so the least one is rounding. The phase stays, and is read as
            # part of its neighbour below.
            continue
        # Slower: fed again from the first slow step. Faster: starving from the last slow one.
        slower = _mean(after) > _mean(before)
        moved = around[split][0] if slower else around[split - 1][1]
        if low < moved < high:
            placed[k] = (moved, placed[k][1])
    read: list[tuple[float, float]] = []
    for k, (begin, step_s) in enumerate(placed):
        stop = placed[k + 1][0] if k + 1 < len(placed) else end
        inside = [(b - a, n) for a, b, n in spans if a >= begin and b <= stop]
        steps = sum(n for _, n in inside)
        if steps >= 5:
            step_s = sum(seconds for seconds, _ in inside) / steps
            if read and abs(step_s / read[-1][1] - 1) <= PHASE_CHANGE:
                continue  # the same speed as the phase before: one phase
            read.append((begin, step_s))
        elif steps and read and begin not in pause_ends:
            continue  # left with too few steps to tell a speed: part of the phase before
        else:
            read.append((begin, step_s))  # hidden (the trainer never fed): the window's bound
    return read


def _mean(logs: list[tuple[float, int]]) -> float:
    """The mean of log step times, weighted by steps."""
    return sum(value * n for value, n in logs) / sum(n for _, n in logs)


def _best_split(logs: list[tuple[float, int]]) -> int | None:
    """The split of ``logs`` (log step times, weighted by steps) into a head of at least two and
    a tail of at least two whose spreads (steps times the squared distance from the side's mean)
    sum least; the first of equal ones. None with fewer than four.

    One pass over running sums (of steps, and of their distances from the overall mean and the
    squares of those, which keeps the sums small): a long log has tens of thousands of spans.
    """
    center = _mean(logs) if logs else 0.0
    sums = [(0.0, 0.0, 0.0)]
    for value, n in logs:
        weight, first, second = sums[-1]
        distance = value - center
        sums.append((weight + n, first + n * distance, second + n * distance * distance))

    def spread(lo: int, hi: int) -> float:
        weight = sums[hi][0] - sums[lo][0]
        first = sums[hi][1] - sums[lo][1]
        return sums[hi][2] - sums[lo][2] - first * first / weight

    best: tuple[float, int] | None = None
    for split in range(2, len(logs) - 1):
        cost = spread(0, split) + spread(split, len(logs))
        if best is None or cost < best[0]:
            best = (cost, split)
    return None if best is None else best[1]


# --- measuring a run ---------------------------------------------------------------------------


@attrs.frozen(slots=True, kw_only=True)
class Observed:
    """A run's figures as read from its log (the same for a recorded and a simulated run)."""

    starvation_share: float
    worker_hours: float
    mean_queue_batches: float
    scale_actions: int
    reversals: int
    crashes: int


def observe(facts: RunFacts, trainer: TrainerFit | None = None) -> Observed:
    """Measure the run in ``facts`` (see the module docstring for how)."""
    intervals = _intervals(facts)
    if trainer is None:
        trainer = fit_trainer(facts, _intervals(facts, facts.trainer_queue))
    running = busy = 0.0
    for (start, stop, run_s, steps), seen in zip(trainer.windows, trainer.seen, strict=True):
        running += run_s
        window_busy = steps * trainer.step_s_at((start + stop) / 2)
        # Where the trainer was never seen fed, its step time is only bounded: never count more
        # busy time than there was.
        busy += window_busy if seen else min(window_busy, run_s)
    starved = min(max(running - busy, 0.0), running)
    end = facts.duration_s
    worker_s = 0.0
    for life in facts.workers.values():
        stop_t = end if life.exited_t is None else min(life.exited_t, end)
        worker_s += life.gpus * max(stop_t - life.spawned_t, 0.0)
    depth = [
        (i.q_start / facts.queue[0][2]) * i.dt
        for i in intervals
        if _pause_overlap(trainer.pauses, i.start, i.end) < i.dt / 2
    ]
    depth_s = sum(
        i.dt for i in intervals if _pause_overlap(trainer.pauses, i.start, i.end) < i.dt / 2
    )
    reversals, previous = 0, 0
    for _, before, after in facts.scales:
        if after == before:
            continue
        direction = 1 if after > before else -1
        reversals += direction == -previous
        previous = direction
    return Observed(
        starvation_share=starved / running if running > 0 else 0.0,
        worker_hours=worker_s / 3600.0,
        mean_queue_batches=sum(depth) / depth_s if depth_s > 0 else 0.0,
        scale_actions=len(facts.scales),
        reversals=reversals,
        crashes=len(_crashes(facts)),
    )


# --- the env pool and faults -------------------------------------------------------------------


def _crashes(facts: RunFacts) -> list[WorkerLife]:
    lost = {(t, gpu) for t, gpu in facts.gpu_lost}
    out = []
    for life in facts.workers.values():
        if life.exited_t is None or life.stop_asked_t is not None:
            continue
        if life.exit_code == 0 and life.signal is None:
            continue
        if any(abs(life.exited_t - t) < 1e-6 and gpu in life.gpu_ids for t, gpu in lost):
            continue  # its GPU was lost: that fault, not a crash of its own
        out.append(life)
    return out


def _active(facts: RunFacts, t: float) -> int:
    """Workers producing at ``t``: up, not asked to stop, not exited."""
    ready = facts.pool.require_ready
    n = 0
    for life in facts.workers.values():
        up = life.ready_t if ready else life.started_t
        if up is None or up > t:
            continue
        if life.stop_asked_t is not None and life.stop_asked_t <= t:
            continue
        if life.exited_t is not None and life.exited_t <= t:
            continue
        n += 1
    return n


@attrs.frozen(slots=True, kw_only=True)
class PoolFit:
    group_size: int
    groups_in_flight: int
    latency_mean_s: float
    latency_sigma: float
    latency_growth: float
    startup_s: float
    startup_sigma: float
    max_batches_offpolicy: int
    notes: tuple[str, ...]


def _policy_number(spec: PoolSpec, key: str) -> float | None:
    value = spec.policy.params.get(key)
    return float(value) if isinstance(value, (int, float)) else None


def fit_pool(facts: RunFacts, intervals: list[Interval], trainer: TrainerFit) -> PoolFit:
    notes: list[str] = []
    batch = trainer.batch_size_seqs
    produced = [i.produced for i in intervals if i.produced > 0]
    group = 0
    for amount in produced:
        group = math.gcd(group, amount)
    if group < 1:
        raise FitError(f"{facts.path}: no sequence reached the queue: nothing to fit")
    notes.append(
        f"groups of {group} sequences: the greatest common divisor of the {len(produced)} "
        f"amounts that reached the queue between samples"
    )
    limit = _policy_number(facts.pool, "max_batches_offpolicy")
    offpolicy = int(limit) if limit else DEFAULT_OFFPOLICY_BATCHES
    notes.append(
        f"off-policy limit {offpolicy} batches: "
        + ("the policy's max_batches_offpolicy" if limit else "atroposlib's default (not logged)")
    )
    # Groups in flight per worker: from in-flight samples, else the policy's, else assumed.
    load = dict(facts.load)
    given = _policy_number(facts.pool, "capacity_per_worker")
    shares = []
    for t, groups in facts.load:
        n = _active(facts, t)
        if n:
            shares.append(groups / n)
    if shares:
        shares.sort()
        capacity = max(1, round(shares[int(0.9 * (len(shares) - 1))]))
        capacity_from = "the 90th percentile of in-flight groups per producing worker"
    elif given:
        capacity, capacity_from = int(given), "the policy's capacity_per_worker"
    else:
        capacity = DEFAULT_GROUPS_IN_FLIGHT
        capacity_from = "assumed: the log has no in-flight samples"
    # Intervals where every producing worker had its full concurrency (the same workers
    # throughout, no pause, the queue a batch below the off-policy limit).
    changes = sorted(
        t
        for life in facts.workers.values()
        for t in (
            life.ready_t if facts.pool.require_ready else life.started_t,
            life.stop_asked_t,
            life.exited_t,
        )
        if t is not None
    )
    # At the off-policy limit every worker discards its groups in generation and starts afresh:
    # a pipeline filling again, like a new worker's.
    changes = sorted(
        [*changes, *(t for t, q, _, _ in facts.queue if q >= (offpolicy - 0.5) * batch)]
    )

    def steady(
        settle_s: float, limit_seqs: float = (offpolicy - 1) * batch
    ) -> list[tuple[float, float, int, float, float | None]]:
        # (t, dt, producing workers, sequences produced, groups in flight)
        out: list[tuple[float, float, int, float, float | None]] = []
        for interval in intervals:
            if _pause_overlap(trainer.pauses, interval.start, interval.end) > 0:
                continue
            if max(interval.q_start, interval.q_end) > limit_seqs:
                continue  # near the limit: groups in generation may be discarded
            k = bisect.bisect_right(changes, interval.end)
            if k and changes[k - 1] > interval.start - settle_s:
                continue  # a worker came or went: its pipeline is filling or emptying
            n = _active(facts, interval.start)
            if n >= 1:
                out.append(
                    (interval.start, interval.dt, n, interval.produced, load.get(interval.start))
                )
        return out

    per_worker = steady(0.0)
    if not per_worker:  # always near the limit: a rough first reading, calibrated below
        per_worker = steady(0.0, math.inf)
    settled_enough = False
    if per_worker:
        first = sum(x[3] for x in per_worker) / sum(x[1] * x[2] for x in per_worker)
        if first > 0:
            settled = steady(2 * capacity * group / first)
            if sum(x[1] for x in settled) >= 60.0:
                per_worker, settled_enough = settled, True
    if not per_worker:
        raise FitError(
            f"{facts.path}: no worker produced outside a pause: production per worker cannot "
            f"be measured"
        )
    worker_s = sum(dt * n for _, dt, n, _, _ in per_worker)
    rate = sum(seqs for *_, seqs, _ in per_worker) / worker_s  # sequences/s per worker
    loads = [groups for *_, groups in per_worker if groups is not None]
    if loads:
        in_flight = statistics.fmean(loads)
        completed = sum(seqs for _, _, _, seqs, g in per_worker if g is not None) / group
        span = sum(dt for _, dt, _, _, g in per_worker if g is not None)
        latency = in_flight / (completed / span) if completed else capacity * group / rate
        notes.append(
            f"{capacity} groups in flight per worker ({capacity_from}); group latency "
            f"{latency:.2f} s mean: Little's law, {in_flight:.1f} groups in generation over "
            f"{completed / span:.2f} completed/s"
        )
    else:
        latency = capacity * group / rate
        notes.append(
            f"{capacity} groups in flight per worker ({capacity_from}); group latency "
            f"{latency:.2f} s mean: {capacity} x {group} sequences over {rate:.2f} sequences/s "
            f"per producing worker ({worker_s:.0f} worker-seconds)"
        )
    # Latency growth: the same reading in the first and last thirds, where both have enough.
    third = facts.duration_s / 3
    growth = 1.0
    early = _little([x for x in per_worker if x[0] < third], group)
    late = _little([x for x in per_worker if x[0] >= 2 * third], group)
    if settled_enough and early is not None and late is not None:
        # Latency grows linearly from L to g * L: the thirds' means are in the ratio
        # (1 + 5x/6) / (1 + x/6), x = g - 1.
        ratio = min(late / early, 4.5)
        growth = max(0.2, 1 + 6 * (ratio - 1) / (5 - ratio))
        if abs(growth - 1) < 0.15:
            growth = 1.0
        else:
            latency = latency * 2 / (1 + growth)  # the fitted value is the latency at the start
            notes.append(
                f"latency grows {growth:.2f}x over the run: {early:.2f} s in the first third, "
                f"{late:.2f} s in the last"
            )
    notes.append(
        f"latency spread: lognormal sigma {DEFAULT_LATENCY_SIGMA} assumed (a queue sampled "
        f"every few seconds does not show single groups)"
    )
    sigma = DEFAULT_LATENCY_SIGMA
    if not settled_enough:
        notes.append(
            "the queue rarely stayed a batch below the off-policy limit for long with the same "
            "workers (groups were discarded), so that latency reading is rough"
        )
    startup, startup_sigma = _startup(facts, intervals, latency, notes)
    return PoolFit(
        group_size=group,
        groups_in_flight=capacity,
        latency_mean_s=round(latency, 3),
        latency_sigma=sigma,
        latency_growth=round(growth, 3),
        startup_s=startup,
        startup_sigma=startup_sigma,
        max_batches_offpolicy=offpolicy,
        notes=tuple(notes),
    )


def _little(
    samples: list[tuple[float, float, int, float, float | None]], group: int
) -> float | None:
    """Mean group latency by Little's law over ``samples`` with in-flight counts: groups in
    generation over groups completed per second; None with under a minute of them."""
    loaded = [(dt, seqs, groups) for _, dt, _, seqs, groups in samples if groups is not None]
    span = sum(dt for dt, _, _ in loaded)
    completed = sum(seqs for _, seqs, _ in loaded) / group
    if span < 60.0 or completed < 10:
        return None
    in_flight = sum(dt * groups for dt, _, groups in loaded) / span
    return in_flight / (completed / span)


def _startup(
    facts: RunFacts, intervals: list[Interval], latency_s: float, notes: list[str]
) -> tuple[float, float]:
    ready = facts.pool.require_ready
    times = []
    for life in facts.workers.values():
        up = life.ready_t if ready else life.started_t
        if up is not None:
            times.append(max(up - life.spawned_t, 0.0))
    if not times:
        raise FitError(f"{facts.path}: no worker came up: start-up time cannot be measured")
    extra_s, seen = (0.0, 0) if ready else _unready_s(facts, intervals, latency_s)
    mean = statistics.fmean(times) + extra_s
    positive = [math.log(x) for x in times if x > 0]
    sigma = statistics.pstdev(positive) if len(positive) >= 3 else 0.0
    sigma = round(min(sigma, 1.0), 2)
    read = f"SpawnWorker to {'WorkerReady' if ready else 'WorkerStarted'} of {len(times)} workers"
    if extra_s >= 0.05:
        read += (
            f", plus {extra_s:.1f} s a started worker took to produce beyond a group's latency "
            f"(first queue growth after it started, from {seen} worker(s) that started with "
            f"none other producing)"
        )
    notes.append(f"start-up {mean:.1f} s mean, spread {sigma} (log-sd): {read}")
    return round(mean, 3), sigma


def _unready_s(facts: RunFacts, intervals: list[Interval], latency_s: float) -> tuple[float, int]:
    """Without ``require_ready``, WorkerStarted is not producing: the mean time a started worker
    took to first grow the queue beyond a group's latency and a sample interval, and the number
    of workers it is read from. Only workers that started while no other was producing (and none
    had produced since the last sample) show it: otherwise the growth is not theirs alone."""
    sample_s = _sample_interval(facts)
    starts = [i.start for i in intervals]
    extras = []
    for life in facts.workers.values():
        up = life.started_t
        if up is None or _active(facts, up) > 1:
            continue
        at = bisect.bisect_right(starts, up) - 1
        if at >= 0 and intervals[at].start < up and intervals[at].produced > 0:
            continue  # the queue was already growing as it started
        first = next((i for i in intervals[max(at, 0) :] if i.produced > 0 and i.end > up), None)
        if first is None:
            continue
        if life.exited_t is not None and life.exited_t < first.start:
            continue
        produced_t = max((first.start + first.end) / 2, up)
        extras.append(max(produced_t - up - latency_s - sample_s, 0.0))
    return (statistics.fmean(extras), len(extras)) if extras else (0.0, 0)


def fit_faults(facts: RunFacts, notes: list[str]) -> list[Fault]:
    faults: list[Fault] = []
    early_s = facts.pool.crash_loop.early_exit_s
    crashes = sorted(_crashes(facts), key=lambda life: life.exited_t or 0.0)
    early = [
        c for c in crashes if c.started_t is not None and (c.exited_t or 0) - c.started_t < early_s
    ]
    later = [c for c in crashes if c not in early]
    # Early exits close together: one crash-loop window.
    groups: list[list[WorkerLife]] = []
    for life in early:
        if groups and (life.exited_t or 0) - (groups[-1][-1].exited_t or 0) < 4 * early_s:
            groups[-1].append(life)
        else:
            groups.append([life])
    for lives in groups:
        if len(lives) < 2:
            later.extend(lives)
            continue
        first = min(life.started_t or 0.0 for life in lives)
        last = max(life.started_t or 0.0 for life in lives)
        after = statistics.median((life.exited_t or 0) - (life.started_t or 0) for life in lives)
        faults.append(
            Fault(
                kind="crash_loop",
                at_s=round(first, 1),
                duration_s=round(max(last - first, 1.0) + 1.0, 1),
                exit_after_s=round(max(after, 0.1), 2),
            )
        )
        notes.append(
            f"crash loop {first:.0f}-{last:.0f} s: {len(lives)} workers exited within "
            f"{early_s:g} s of starting without being asked"
        )
    by_t: dict[float, int] = {}
    for life in later:
        t = round(life.exited_t or 0.0, 1)
        by_t[t] = by_t.get(t, 0) + 1
    for t, count in sorted(by_t.items()):
        faults.append(Fault(kind="worker_crash", at_s=t, count=count))
        notes.append(f"worker crash at {t:.0f} s: {count} exit(s) deo did not ask for")
    gpu_index = {gpu: i for i, gpu in enumerate(facts.config.gpus)}
    for t, gpu in facts.gpu_lost:
        if gpu in gpu_index:
            faults.append(Fault(kind="gpu_loss", at_s=round(t, 1), gpu=gpu_index[gpu]))
            notes.append(f"GPU {gpu} lost at {t:.0f} s (GpuLost)")
    outages = _runs(facts.source_down, _sample_interval(facts))
    for start, stop in outages:
        faults.append(Fault(kind="source_down", at_s=round(start, 1), duration_s=stop - start))
        notes.append(f"source down {start:.0f}-{stop:.0f} s (SourceDown)")
    return sorted(faults, key=lambda f: f.at_s)


def _sample_interval(facts: RunFacts) -> float:
    gaps = [b[0] - a[0] for a, b in zip(facts.queue, facts.queue[1:], strict=False)]
    return round(statistics.median(gaps), 3) if gaps else 2.0


def _runs(times: list[float], interval: float) -> Iterator[tuple[float, float]]:
    start: float | None = None
    last = 0.0
    for t in sorted(times):
        if start is not None and t - last > 2.5 * interval:
            yield start, round(last + interval, 1)
            start = None
        if start is None:
            start = t
        last = t
    if start is not None:
        yield start, round(last + interval, 1)


# --- the scenario ------------------------------------------------------------------------------


@attrs.frozen(slots=True, kw_only=True)
class Fitted:
    """The fitted scenario, how the recorded run measured, and what was fitted from what."""

    scenario: Scenario
    observed: Observed
    notes: tuple[str, ...]


def fit_scenario(
    facts: RunFacts, name: str, policies: PolicyCatalog, *, calibrate: bool = True
) -> Fitted:
    """Fit a scenario to the run in ``facts``; :class:`FitError` when the log is too short.

    With ``calibrate`` the group latency is then refined by simulation: the fitted scenario runs
    under the recorded policy and the latency is moved until the simulated run reads, from its
    log, what the recorded one reads: groups in generation per group completed per second where
    the log has in-flight samples, else production per producing worker-second. (Discards at the
    off-policy limit hide the latency from any direct reading.)
    """
    if len(facts.queue) < MIN_SAMPLES or facts.duration_s < MIN_DURATION_S:
        raise FitError(
            f"{facts.path}: too short to fit: {facts.duration_s:.0f} s and {len(facts.queue)} "
            f"queue samples of pool {facts.pool.name!r} (at least {MIN_DURATION_S:g} s and "
            f"{MIN_SAMPLES} samples)"
        )
    intervals = _intervals(facts)
    trainer = fit_trainer(facts, _intervals(facts, facts.trainer_queue))
    observed = observe(facts, trainer)
    notes: list[str] = []
    if facts.fetch_all:
        notes.append(
            f"the trainer takes every full batch queued at once (atroposlib's /batch): its step "
            f"counter counts batches taken ({facts.held_fetches} fetches of several batches held "
            f"while a batch waited); its steps are placed between fetches, held batches counted "
            f"as queued, and the fitted trainer fetches the same way"
        )
    phases = ", ".join(f"{s:.2f} s from {a:.0f} s" for a, s in trainer.phases)
    window = trainer.windows[0][1] - trainer.windows[0][0]
    if any(trainer.seen):
        measured_from = (
            f"measured over {trainer.fed_s:.0f} s of step-to-step spans with a batch queued "
            f"throughout (the trainer was the bottleneck), per {window:.0f} s window"
        )
    else:
        measured_from = (
            f"the pace it kept, per {window:.0f} s window: too few step-to-step spans had a "
            f"batch queued throughout to measure it"
        )
    notes.append(
        f"trainer: batches of {trainer.batch_size_seqs} sequences; step time {phases}: "
        f"{measured_from}"
    )
    if trainer.hidden_s > 0.05 * facts.duration_s:
        notes.append(
            f"in windows covering {trainer.hidden_s:.0f} s of running "
            f"({trainer.hidden_s / facts.duration_s:.0%} of the run) too few steps had a batch "
            f"queued throughout to measure the step time: it is only bounded there (at most "
            f"the pace it kept), so starvation there may read low"
        )
    for start, stop in trainer.pauses:
        notes.append(
            f"pause {start:.0f}-{stop:.0f} s: a batch queued and no trainer step for "
            f"{stop - start:.0f} s"
        )
    pool = fit_pool(facts, intervals, trainer)
    notes.extend(pool.notes)
    faults = fit_faults(facts, notes)
    spec = facts.pool
    env = EnvPool(
        name=spec.name,
        group_size=pool.group_size,
        groups_in_flight=pool.groups_in_flight,
        latency_mean_s=pool.latency_mean_s,
        latency_sigma=pool.latency_sigma,
        latency_growth=pool.latency_growth,
        startup_s=pool.startup_s,
        startup_sigma=pool.startup_sigma,
        require_ready=spec.require_ready,
        gpus_per_worker=spec.gpus_per_worker,
        min_workers=spec.min_workers,
        max_workers=spec.max_workers,
        max_starting=spec.max_starting,
        max_batches_offpolicy=pool.max_batches_offpolicy,
        policy=spec.policy,
        stabilization_s=spec.stabilization_s,
        drain_timeout_s=spec.drain_timeout_s,
        metrics_stale_s=spec.metrics_stale_s,
        start_timeout_s=spec.start_timeout_s,
        crash_loop=spec.crash_loop,
    )
    first_step = trainer.phases[0][1]
    scenario = Scenario(
        name=name,
        description=f"fitted to {facts.path.name} {FITTED_BY}",
        duration_s=round(facts.duration_s, 1),
        seed=1,
        sample_interval_s=_sample_interval(facts),
        gpus=len(facts.config.gpus) or None,
        trainer=TrainerSpec(
            batch_size_seqs=trainer.batch_size_seqs,
            step_s=first_step,
            phases=tuple(Phase(at_s=a, step_s=s) for a, s in trainer.phases[1:]),
            pauses=tuple(Pause(at_s=a, duration_s=b - a) for a, b in trainer.pauses),
            fetch_all=facts.fetch_all,
        ),
        pools=(env,),
        faults=tuple(faults),
    )
    if facts.reconfigured:
        notes.append(
            f"the run was reconfigured {facts.reconfigured} time(s); the fit keeps its first "
            f"configuration"
        )
    fitted = Fitted(scenario=scenario, observed=observed, notes=tuple(notes))
    return calibrated(facts, fitted, policies) if calibrate else fitted


def calibrated(facts: RunFacts, fitted: Fitted, policies: PolicyCatalog) -> Fitted:
    """``fitted`` with its group latency calibrated by simulation (see :func:`fit_scenario`)."""
    notes = list(fitted.notes)
    scenario = _calibrate(facts, fitted.scenario, policies, notes)
    return attrs.evolve(fitted, scenario=scenario, notes=tuple(notes))


def production_per_worker_s(facts: RunFacts, start: float = 0.0, end: float = math.inf) -> float:
    """Sequences that reached the queue over the seconds workers spent producing (up, not
    asked to stop), between ``start`` and ``end`` (the whole run by default)."""
    end = min(end, facts.duration_s)
    produced = sum(i.produced for i in _intervals(facts) if start <= i.start < end)
    worker_s = 0.0
    for life in facts.workers.values():
        up = life.ready_t if facts.pool.require_ready else life.started_t
        if up is None:
            continue
        stops = [t for t in (life.stop_asked_t, life.exited_t, end) if t is not None]
        worker_s += max(min(stops) - max(up, start), 0.0)
    return produced / worker_s if worker_s > 0 else 0.0


#: Simulated runs the latency calibration may take, and how close it must come.
CALIBRATION_RUNS = 8
CALIBRATION_TOLERANCE = 0.03
CALIBRATION_SEEDS = 2


def apparent_latency_s(facts: RunFacts, group_size: int) -> float:
    """Groups in generation over groups completed per second, the whole run (0 without
    in-flight samples). Not the latency itself: groups discarded at the off-policy limit count
    as in flight and never complete. It grows with the latency, and a simulated run shows it the
    same way, which is what calibration needs."""
    load = dict(facts.load)
    in_flight_s = completed = 0.0
    for interval in _intervals(facts):
        groups = load.get(interval.start)
        if groups is not None:
            in_flight_s += groups * interval.dt
            completed += interval.produced / group_size
    return in_flight_s / completed if completed > 0 else 0.0


def _calibrate(
    facts: RunFacts, scenario: Scenario, policies: PolicyCatalog, notes: list[str]
) -> Scenario:
    from adapters.sim.driver import simulate  # the simulator is only needed here

    pool = scenario.pools[0]
    # The reading to match, and whether it rises (True) or falls with the latency.
    if facts.load:
        what = "groups in generation per group completed per second"
        unit = "s"

        def reading(run: RunFacts) -> float:
            return apparent_latency_s(run, pool.group_size)

        rising = True
    else:
        what = "sequences per producing worker-second"
        unit = ""

        def reading(run: RunFacts) -> float:
            return production_per_worker_s(run)

        rising = False
    target = reading(facts)
    if target <= 0:
        return scenario

    def with_latency(latency: float) -> Scenario:
        return attrs.evolve(scenario, pools=(attrs.evolve(pool, latency_mean_s=latency),))

    def measured(latency: float) -> float:
        values = []
        with tempfile.TemporaryDirectory(prefix="deo-fit-") as tmp:
            for seed in range(1, CALIBRATION_SEEDS + 1):
                log = Path(tmp) / f"fit{seed}.jsonl"
                run = attrs.evolve(with_latency(latency), seed=seed)
                simulate(run, log_path=log, policies=policies)
                values.append(reading(read_run(log)))
        return statistics.fmean(values)

    # Bisect on a log scale.
    low, high = pool.latency_mean_s * 0.2, pool.latency_mean_s * 2.0
    best, best_error = pool.latency_mean_s, math.inf
    latency = pool.latency_mean_s
    for _ in range(CALIBRATION_RUNS):
        value = measured(latency)
        error = value / target - 1
        if abs(error) < abs(best_error):
            best, best_error = latency, error
        if abs(error) <= CALIBRATION_TOLERANCE:
            break
        if (error > 0) == rising:
            high = latency
        else:
            low = latency
        latency = math.sqrt(low * high)
    best = round(best, 3)
    notes.append(
        f"group latency calibrated to {best:.2f} s mean: the fitted run under the recorded policy "
        f"({CALIBRATION_SEEDS} seeds) then reads {target * (1 + best_error):.3f}{unit} {what} "
        f"against the recorded {target:.3f}{unit}"
    )
    return with_latency(best)


# --- writing the scenario ----------------------------------------------------------------------


def _literal(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        escaped = value.replace("\\", "\\\\").replace('"', '\\"')
        return f'"{escaped}"'
    raise TypeError(f"no TOML literal for {value!r}")


def _inline(values: dict[str, Any]) -> str:
    return "{ " + ", ".join(f"{k} = {_literal(v)}" for k, v in values.items()) + " }"


def scenario_toml(scenario: Scenario, header: Iterable[str] = ()) -> str:
    """``scenario`` as a scenario file ``deo simulate`` and ``deo bench`` read."""
    lines = [f"# {line}" for line in header]
    lines += [
        f"name = {_literal(scenario.name)}",
        f"description = {_literal(scenario.description)}",
        f"duration_s = {_literal(scenario.duration_s)}",
        f"seed = {scenario.seed}",
        f"sample_interval_s = {_literal(scenario.sample_interval_s)}",
    ]
    if scenario.gpus is not None:
        lines.append(f"gpus = {scenario.gpus}")
    trainer = scenario.trainer
    lines += [
        "",
        "[trainer]",
        f"batch_size_seqs = {trainer.batch_size_seqs}",
        f"step_s = {_literal(trainer.step_s)}",
    ]
    if trainer.fetch_all:
        lines.append("fetch_all = true")
    if trainer.phases:
        items = ", ".join(_inline({"at_s": p.at_s, "step_s": p.step_s}) for p in trainer.phases)
        lines.append(f"phases = [{items}]")
    if trainer.pauses:
        items = ", ".join(
            _inline({"at_s": p.at_s, "duration_s": p.duration_s, "kind": p.kind})
            for p in trainer.pauses
        )
        lines.append(f"pauses = [{items}]")
    for pool in scenario.pools:
        lines += ["", f"[pools.{pool.name}]"]
        for field in attrs.fields(EnvPool):
            if field.name in ("name", "policy", "crash_loop"):
                continue
            lines.append(f"{field.name} = {_literal(getattr(pool, field.name))}")
        lines += ["", f"[pools.{pool.name}.policy]", f"name = {_literal(pool.policy.name)}"]
        for key, value in pool.policy.params.items():
            lines.append(f"{key} = {_literal(value)}")
        lines += ["", f"[pools.{pool.name}.crash_loop]"]
        for field in attrs.fields(type(pool.crash_loop)):
            lines.append(f"{field.name} = {_literal(getattr(pool.crash_loop, field.name))}")
    for fault in scenario.faults:
        lines += ["", "[[faults]]", f"kind = {_literal(fault.kind)}", f"at_s = {fault.at_s!r}"]
        required, optional = FAULT_KINDS[fault.kind]
        for key in sorted(required | optional):
            value = getattr(fault, key)
            if value is not None:
                lines.append(f"{key} = {_literal(value)}")
    return "\n".join(lines) + "\n"
