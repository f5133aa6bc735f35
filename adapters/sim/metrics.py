"""What a simulated run measured, and how each figure is defined.

* ``starvation_share``: time the trainer waited for a batch (free, not paused, fewer than
  ``batch_size_seqs`` sequences queued) over the run's non-paused time.
* ``avoidable_starvation_share``: starvation beyond the reactive oracle's
  (:mod:`adapters.sim.oracle`), over windows of ``AVOIDABLE_WINDOW_S``: a wait in a window the
  oracle does not starve in is avoidable; over each run of consecutive windows the oracle starves
  in (an episode), the seconds the trainer waited less the seconds the oracle's trainer waited
  (never below 0). All over the non-paused time less the oracle's starvation. A partial
  shortfall excuses only its part; comparing an episode as a whole lets a real trainer's waits,
  which come a batch at a time, more in one minute and less in the next, compare with the
  oracle's fluid ones spread evenly (compared window by window, a pool held all along at the
  oracle's own count, short of capacity for most of the run, read 2.5% avoidable).
* ``worker_hours``: GPU-hours, each worker's GPUs from its SpawnWorker until it exits (or the
  run ends); a worker of a pool with ``gpus_per_worker = 0`` counts one worker-hour per hour.
  :func:`worker_hours_ratio_since` gives the ratio to the oracle's over the run's end from a
  time on: past the cold start, where every controller starts before it knows any rate.
* ``mean_lag_steps`` / ``p95_lag_steps``: per consumed sequence, the trainer steps taken between
  its group entering the queue (generation finished) and the step that consumes it: 0 when the
  very next batch takes it. Generation time itself is not counted: it belongs to the environment,
  while the time spent queued is what the controller decides. Sequences still queued at the end
  are not counted.
* ``scale_actions``: ScalePool commands whose source is the policy (configuration and operator
  changes are not the controller's).
* ``flaps``: reversals, per pool, over any span: a policy ScalePool whose direction (up or down)
  reverses the previous policy ScalePool's, however long after it (a 10-minute cycle between 70
  and 128 workers counts as much as a jittery one); ``reversals_per_hour`` divides them by the
  run's hours.
* ``groups_discarded``: groups cancelled at the off-policy limit (generation wasted), and
  ``discarded_generation_s`` the generation seconds they had spent.
"""

from __future__ import annotations

import math

import attrs

from adapters.sim.oracle import GRID_S, OracleResult, worker_hours_bound
from adapters.sim.scenario import Scenario
from adapters.sim.world import SeriesPoint, WorldRecord
from core.vocabulary import DecisionSource

__all__ = ["AVOIDABLE_WINDOW_S", "Metrics", "SimResult", "measure"]

#: Starvation is compared with the reactive oracle's over windows this long.
AVOIDABLE_WINDOW_S = 60.0


@attrs.frozen(slots=True, kw_only=True)
class Metrics:
    """One run's figures (definitions in :mod:`adapters.sim.metrics`)."""

    starvation_share: float
    avoidable_starvation_share: float
    #: The reactive oracle's starvation, for reference.
    unavoidable_starvation_share: float
    worker_hours: float
    #: The reactive oracle's worker-hours.
    oracle_worker_hours: float
    mean_lag_steps: float
    p95_lag_steps: float
    scale_actions: int
    flaps: int
    steps: int
    peak_workers: int
    #: Groups whose generation was lost to a crash, a kill or a lost GPU.
    groups_lost: int
    groups_discarded: int = 0
    discarded_generation_s: float = 0.0
    duration_s: float = 3600.0
    #: The clairvoyant lower bound: its starvation, and its worker-hours for this run's steps.
    bound_starvation_share: float = 0.0
    bound_worker_hours: float = 0.0

    @property
    def reversals_per_hour(self) -> float:
        """Reversals of scaling direction (``flaps``) per hour of the run."""
        return self.flaps * 3600.0 / self.duration_s if self.duration_s > 0 else 0.0

    @property
    def worker_hours_ratio(self) -> float:
        """Worker-hours over the oracle's (infinity if the oracle needs none)."""
        if self.oracle_worker_hours <= 0:
            return float("inf") if self.worker_hours > 0 else 1.0
        return self.worker_hours / self.oracle_worker_hours


@attrs.frozen(slots=True, kw_only=True)
class SimResult:
    """One simulated run: which scenario and policy, the metrics, the series, the oracle."""

    scenario: str
    policy: str
    metrics: Metrics
    #: The world at every sample time.
    series: tuple[SeriesPoint, ...]
    oracle: OracleResult
    #: Everything the world recorded (starvation intervals, worker spans, scaling decisions).
    record: WorldRecord | None = None


def _worker_s(record: WorldRecord, from_s: float) -> float:
    """GPU-seconds the workers held from ``from_s`` to the run's end."""
    end = record.duration_s
    held_s = 0.0
    for span in record.spans:
        exited = end if span.exited_t is None else min(span.exited_t, end)
        held_s += span.cost * max(exited - max(span.spawned_t, from_s), 0.0)
    return held_s


def worker_hours_ratio_since(result: SimResult, from_s: float) -> float:
    """Worker-hours over the reactive oracle's, both counted from ``from_s`` to the run's end
    (infinity if the oracle holds none then)."""
    if result.record is None:
        raise ValueError("the run's record is needed (simulate keeps it)")
    if not 0 <= from_s < result.record.duration_s:
        raise ValueError(
            f"from_s must be within the run [0, {result.record.duration_s:g}), got {from_s!r}"
        )
    oracle_s = sum(p.gpus * GRID_S for p in result.oracle.series if p.t >= from_s)
    held_s = _worker_s(result.record, from_s)
    if oracle_s <= 0:
        return float("inf") if held_s > 0 else 1.0
    return held_s / oracle_s


def _union_length(intervals: list[tuple[float, float]]) -> float:
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        start = max(start, reach)
        if end > start:
            total += end - start
            reach = end
    return total


def _per_cell(intervals: tuple[tuple[float, float], ...], cells: int) -> list[float]:
    """Seconds of ``intervals`` in each grid cell of the oracle."""
    seconds = [0.0] * cells
    for start, end in intervals:
        i = int(start // GRID_S)
        while i < cells and i * GRID_S < end:
            cell_start = i * GRID_S
            seconds[i] += min(end, cell_start + GRID_S) - max(start, cell_start)
            i += 1
    return seconds


def _flaps(scenario: Scenario, record: WorldRecord) -> int:
    flaps = 0
    for pool in scenario.pools:
        previous: int | None = None
        for scale in record.scales:
            if scale.pool != pool.name or scale.source != DecisionSource.POLICY:
                continue
            if scale.target == scale.previous:
                continue
            direction = 1 if scale.target > scale.previous else -1
            if previous is not None and direction == -previous:
                flaps += 1
            previous = direction
    return flaps


def _lag(lag_seqs: dict[int, int]) -> tuple[float, float]:
    total = sum(lag_seqs.values())
    if not total:
        return math.nan, math.nan  # nothing trained: no lag to speak of, and no target met
    mean = sum(lag * n for lag, n in lag_seqs.items()) / total
    seen = 0
    for lag in sorted(lag_seqs):
        seen += lag_seqs[lag]
        if seen >= 0.95 * total:
            return mean, float(lag)
    raise AssertionError("unreachable: the loop covers every sequence")


def _avoidable_s(windows: list[tuple[float, float]]) -> float:
    """Seconds waited beyond the oracle's, from (waited, oracle waited) per window.

    Consecutive windows in which the oracle starves are one episode (a stretch its workers cannot
    feed the trainer through, a start-up after a change): within it the waits are compared as a
    whole, since a trainer short of capacity waits a batch at a time, more in one minute and less
    in the next, around the oracle's even share. Every wait in a window the oracle does not
    starve in is avoidable.
    """
    avoidable_s = episode_waited = episode_oracle = 0.0
    for waited, oracle_waited in windows:
        if oracle_waited > 0:
            episode_waited += waited
            episode_oracle += oracle_waited
            continue
        avoidable_s += max(episode_waited - episode_oracle, 0.0) + waited
        episode_waited = episode_oracle = 0.0
    return avoidable_s + max(episode_waited - episode_oracle, 0.0)


def measure(scenario: Scenario, record: WorldRecord, oracle: OracleResult) -> Metrics:
    """The metrics of one run from what the world recorded and the scenario's oracle."""
    end = record.duration_s
    paused_s = _union_length(
        [(p.at_s, min(p.end_s, end)) for p in scenario.trainer.pauses if p.at_s < end]
    )
    running_s = end - paused_s
    starved_s = sum(stop - start for start, stop in record.starved)
    cells = oracle.unavoidable_cells
    unavoidable_s = sum(cells)
    waited = _per_cell(record.starved, len(cells))
    per = max(round(AVOIDABLE_WINDOW_S / GRID_S), 1)
    windows = [
        (sum(waited[i : i + per]), sum(cells[i : i + per])) for i in range(0, len(cells), per)
    ]
    avoidable_s = _avoidable_s(windows)
    outside_s = running_s - unavoidable_s
    worker_s = _worker_s(record, 0.0)
    mean_lag, p95_lag = _lag(record.lag_seqs)
    return Metrics(
        # (Shares at most 1: a trainer that waited throughout reads 1 + rounding otherwise.)
        starvation_share=min(starved_s / running_s, 1.0) if running_s > 0 else 0.0,
        avoidable_starvation_share=min(avoidable_s / outside_s, 1.0) if outside_s > 0 else 0.0,
        unavoidable_starvation_share=oracle.unavoidable_starvation_share,
        worker_hours=worker_s / 3600.0,
        oracle_worker_hours=oracle.worker_hours,
        mean_lag_steps=mean_lag,
        p95_lag_steps=p95_lag,
        scale_actions=sum(1 for s in record.scales if s.source == DecisionSource.POLICY),
        flaps=_flaps(scenario, record),
        steps=record.steps,
        peak_workers=max((p.workers for p in record.series), default=0),
        groups_lost=record.groups_lost,
        groups_discarded=record.groups_discarded,
        discarded_generation_s=record.discarded_generation_s,
        duration_s=end,
        bound_starvation_share=oracle.bound.starvation_share,
        bound_worker_hours=worker_hours_bound(
            scenario, record.steps, groups_started=record.groups_started or None
        ),
    )
