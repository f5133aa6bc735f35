"""A clairvoyant reference for a scenario: the fewest worker-hours that keep the trainer fed, and
the starvation no controller could avoid. A fluid bound, derived in ``docs/scenarios.md``.

On a grid of ``GRID_S`` seconds, with c(t) the trainer's consumption (``batch_size_seqs /
step_s(t)`` sequences/s, 0 while paused) and p_i(t) = ``groups_in_flight * group_size /
mean latency_i(t)`` one worker's production (Little's law):

* workers needed: every pool holds its ``min_workers``; the rest of c(t) is covered by the pool
  with the fewest GPU-hours per sequence first, ``ceil(remaining / p_i)`` workers, each pool
  bounded by its ``max_workers``, the GPUs still alive and the shared inference capacity (groups
  beyond it add nothing);
* provisioning: a worker needed at t must be requested ``startup_s`` earlier, so the oracle holds
  at t the most workers needed anywhere in [t, t + startup_s];
* unavoidable starvation: until the first batch can possibly be ready (every pool at its maximum
  from t = 0, the first batch's worth of groups done), and afterwards wherever even the maximum
  production, with a buffer filled up to ``max_batches_offpolicy`` batches beforehand, falls
  short of c(t) (a fluid queue).

Faults other than GPU loss are ignored (the oracle places workers on healthy GPUs and knows no
crash), so the oracle stays a lower bound. Two simplifications keep it a *fluid* bound rather
than an exact optimum: workers are whole (``ceil``), which a controller alternating between two
counts can beat slightly; and production is at its mean rate, which real heavy-tailed production
only reaches with some buffer.
"""

from __future__ import annotations

import functools
import math
from collections import deque

import attrs

from adapters.sim.scenario import EnvPool, Scenario

__all__ = ["GRID_S", "OraclePoint", "OracleResult", "oracle"]

GRID_S = 1.0


@attrs.frozen(slots=True, kw_only=True)
class OraclePoint:
    t: float
    #: Workers the oracle holds (all pools), start-up included.
    workers: int
    #: The trainer's consumption and the most the pools could produce, sequences/s.
    consumption_seqs_s: float
    capacity_seqs_s: float


@attrs.frozen(slots=True, kw_only=True)
class OracleResult:
    """The oracle's cost, its unavoidable starvation, and its series (one point per grid cell)."""

    worker_hours: float
    #: Share of the non-paused time the trainer must starve whatever the controller does.
    unavoidable_starvation_share: float
    #: Intervals [start, end) of unavoidable starvation (the first is the run's start).
    unavoidable: tuple[tuple[float, float], ...]
    #: The earliest time a first batch can be ready.
    first_batch_t: float
    series: tuple[OraclePoint, ...]


def _per_worker_seqs_s(pool: EnvPool, t: float, duration_s: float) -> float:
    return pool.groups_in_flight * pool.group_size / pool.latency_mean_at(t, duration_s)


def _allocate(
    scenario: Scenario, t: float, demand_seqs_s: float, gpus_alive: int
) -> tuple[dict[str, int], float]:
    """Workers per pool covering ``demand_seqs_s`` at ``t`` (as far as bounds allow) and what
    they produce, sequences/s."""
    duration = scenario.duration_s
    rates = {pool.name: _per_worker_seqs_s(pool, t, duration) for pool in scenario.pools}
    gpus_left = gpus_alive
    groups_left = (
        math.inf if scenario.inference is None else float(scenario.inference.max_concurrent_groups)
    )
    counts: dict[str, int] = {}
    produced = 0.0

    def add(pool: EnvPool, wanted: int) -> None:
        nonlocal gpus_left, groups_left, produced
        have = counts.get(pool.name, 0)
        n = min(wanted, pool.max_workers - have)
        if pool.gpus_per_worker:
            n = min(n, gpus_left // pool.gpus_per_worker)
        if n <= 0:
            return
        groups = min(n * pool.groups_in_flight, groups_left)
        counts[pool.name] = have + n
        gpus_left -= n * pool.gpus_per_worker
        groups_left -= groups
        produced += groups * pool.group_size / pool.latency_mean_at(t, duration)

    for pool in scenario.pools:
        add(pool, pool.min_workers)
    # Cheapest sequences first: GPU-hours per worker over sequences per worker-second.
    by_cost = sorted(scenario.pools, key=lambda p: (p.cost_per_worker / rates[p.name], p.name))
    for pool in by_cost:
        remaining = demand_seqs_s - produced
        if remaining <= 1e-9 or groups_left <= 0:
            break
        wanted = (
            pool.max_workers
            if math.isinf(remaining)
            else math.ceil(remaining / rates[pool.name] - 1e-9)
        )
        if groups_left != math.inf:  # workers beyond the inference capacity add nothing
            wanted = min(wanted, math.ceil(groups_left / pool.groups_in_flight))
        add(pool, wanted)
    return counts, produced


def _first_batch_t(scenario: Scenario, gpus: int) -> float:
    """The earliest a first batch can be ready: every pool at its maximum from t = 0.

    Sequences done by time tau ~ sum over pools of N_i x groups_in_flight x group_size x
    M_i(tau - startup_i), where M_i(x) = F_i(x) + max(x / mean_i - 1, 0) approximates the groups
    done per slot: the latency CDF for the first round, the mean rate after it.
    """
    batch = scenario.trainer.batch_size_seqs
    counts, _ = _allocate(scenario, 0.0, math.inf, gpus)
    duration = scenario.duration_s

    def done(tau: float) -> float:
        total = 0.0
        for pool in scenario.pools:
            elapsed = tau - pool.startup_s
            n = counts.get(pool.name, 0)
            if elapsed <= 0 or not n:
                continue
            mean = pool.latency_mean_at(pool.startup_s, duration)
            slots = n * pool.groups_in_flight
            if scenario.inference is not None:
                slots = min(slots, scenario.inference.max_concurrent_groups)
            rounds = pool.latency_cdf(elapsed, mean) + max(elapsed / mean - 1.0, 0.0)
            total += slots * pool.group_size * rounds
        return total

    if done(duration) < batch:
        return duration
    low, high = 0.0, duration
    for _ in range(60):
        mid = (low + high) / 2
        if done(mid) >= batch:
            high = mid
        else:
            low = mid
    return high


def _window_max(values: list[int], ahead: int) -> list[int]:
    """result[i] = max(values[i : i + ahead + 1])."""
    result = [0] * len(values)
    window: deque[int] = deque()  # indices with decreasing values
    for i in range(len(values) - 1, -1, -1):
        while window and values[window[-1]] <= values[i]:
            window.pop()
        window.append(i)
        while window[0] > i + ahead:
            window.popleft()
        result[i] = values[window[0]]
    return result


@functools.lru_cache(maxsize=64)
def oracle(scenario: Scenario) -> OracleResult:
    """The clairvoyant fluid bound for ``scenario`` (see the module docstring)."""
    duration = scenario.duration_s
    trainer = scenario.trainer
    batch = trainer.batch_size_seqs
    cells = max(math.ceil(duration / GRID_S), 1)
    losses = sorted(f.at_s for f in scenario.faults if f.kind == "gpu_loss")
    total_gpus = scenario.gpu_count
    needed: dict[str, list[int]] = {pool.name: [0] * cells for pool in scenario.pools}
    consumption: list[float] = []
    capacity: list[float] = []
    paused: list[bool] = []
    for i in range(cells):
        t = i * GRID_S
        gpus = total_gpus - sum(1 for at in losses if at <= t)
        is_paused = trainer.paused_at(t)
        c = 0.0 if is_paused else batch / trainer.step_s_at(t)
        counts, _ = _allocate(scenario, t, c, gpus)
        for name, n in counts.items():
            needed[name][i] = n
        _, most = _allocate(scenario, t, math.inf, gpus)
        consumption.append(c)
        capacity.append(most)
        paused.append(is_paused)

    held = {
        pool.name: _window_max(needed[pool.name], math.ceil(pool.startup_s / GRID_S))
        for pool in scenario.pools
    }
    worker_hours = (
        sum(sum(held[p.name]) * p.cost_per_worker for p in scenario.pools) * GRID_S / 3600.0
    )

    # Unavoidable starvation: the start, then a fluid queue fed at full capacity.
    first = _first_batch_t(scenario, total_gpus)
    cap_seqs = max(p.max_batches_offpolicy for p in scenario.pools) * batch
    starving = [False] * cells
    starved_s = 0.0
    queue = float(batch)
    for i in range(cells):
        t = i * GRID_S
        if paused[i]:
            continue
        if t + GRID_S <= first:
            starving[i] = True
            starved_s += GRID_S
            continue
        share = 1.0
        if t < first:  # the cell the first batch arrives in
            share = (t + GRID_S - first) / GRID_S
            starved_s += GRID_S - share * GRID_S
            starving[i] = True
        inflow = capacity[i] * GRID_S * share
        outflow = consumption[i] * GRID_S * share
        if queue + inflow >= outflow:
            queue = min(queue + inflow - outflow, float(cap_seqs))
        else:
            starved_s += (1.0 - (queue + inflow) / outflow) * GRID_S * share
            starving[i] = True
            queue = 0.0
    intervals: list[tuple[float, float]] = []
    for i, flag in enumerate(starving):
        if not flag:
            continue
        start, end = i * GRID_S, min((i + 1) * GRID_S, duration)
        if intervals and intervals[-1][1] == start:
            intervals[-1] = (intervals[-1][0], end)
        else:
            intervals.append((start, end))
    active_s = GRID_S * sum(1 for flag in paused if not flag)
    series = tuple(
        OraclePoint(
            t=i * GRID_S,
            workers=sum(held[p.name][i] for p in scenario.pools),
            consumption_seqs_s=consumption[i],
            capacity_seqs_s=capacity[i],
        )
        for i in range(cells)
    )
    return OracleResult(
        worker_hours=worker_hours,
        unavoidable_starvation_share=starved_s / active_s if active_s else 0.0,
        unavoidable=tuple(intervals),
        first_batch_t=first,
        series=series,
    )
