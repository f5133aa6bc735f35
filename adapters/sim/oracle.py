"""Two references for a scenario, both on its realized world (:mod:`adapters.sim.draws`).

* The **reactive oracle** is the realistic bound deo's targets are measured against: a controller
  that knows the present perfectly (the trainer's consumption now, the pools' true production per
  worker, the GPUs alive, the inference capacity) but not the future. It holds, at every moment,
  the workers that cover the present consumption; a worker it asks for produces its start-up
  later, and no more than the pool's ``max_starting`` start at once (the reducer holds every
  policy to that); it cannot know how long a pause will last, so it keeps its workers for one
  start-up time into a pause and then lets them go to the minimum (the ski-rental rule: never
  paying more than twice what foresight would). Its starvation intervals are the "unavoidable"
  ones: starvation outside them is what a controller could have avoided.
* The **lower bound** (:class:`LowerBound`) is clairvoyant: no controller on this realized world
  can do better than it on either axis. Starvation: every pool at its maximum from t = 0 (with the
  fastest start-up drawn, ``max_starting`` at a time), a buffer filled up to the off-policy limit
  whenever it can be, groups at the realized mean rate; no controller starves less. Worker-hours,
  for a trainer that takes ``steps`` steps: the generation those batches need, the realized
  latencies of the first groups drawn (each worker runs at most ``groups_in_flight`` at once, at
  most nominal speed), the cheapest sequences first across pools, plus one start-up, and never
  below the pools' ``min_workers`` held throughout. Idle workers, off-policy waits and discards,
  restarts after pauses and faults only add to any real controller's cost.

Both are fluid models on a grid of ``GRID_S`` seconds, with production per worker at the pool's
realized mean rate: ``groups_in_flight * group_size / (latency mean at t * realized mean factor)``,
the realized mean factor being the mean of the latency factors of the groups the run needs.
``docs/scenarios.md`` derives both.
"""

from __future__ import annotations

import functools
import math
from collections import deque
from collections.abc import Callable

import attrs

from adapters.sim.draws import Draws
from adapters.sim.scenario import EnvPool, Scenario

__all__ = [
    "GRID_S",
    "LowerBound",
    "OraclePoint",
    "OracleResult",
    "oracle",
    "worker_hours_bound",
]

GRID_S = 1.0
#: Start-up draws looked at for the fastest possible start, per worker a pool may hold.
_STARTUP_DRAWS_PER_WORKER = 4


@attrs.frozen(slots=True, kw_only=True)
class OraclePoint:
    t: float
    #: Workers the reactive oracle holds (all pools), start-up included.
    workers: int
    #: What they cost: GPUs held (a CPU worker counts one), as ``worker_hours`` counts them.
    gpus: int
    #: The trainer's consumption and the most the pools could produce, sequences/s.
    consumption_seqs_s: float
    capacity_seqs_s: float


@attrs.frozen(slots=True, kw_only=True)
class LowerBound:
    """What no controller can beat on this realized world (see the module docstring)."""

    #: The fewest worker-hours (GPU-hours) that can feed ``steps`` trainer steps.
    worker_hours: float
    #: The least starvation any controller can get (share of the non-paused time), the grid
    #: cells it falls in, and the seconds of it in each cell.
    starvation_share: float
    starved: tuple[tuple[float, float], ...]
    starved_cells: tuple[float, ...]
    #: Trainer steps taken when it starves only in ``starved``: the most any controller gets.
    steps: int
    first_batch_t: float


@attrs.frozen(slots=True, kw_only=True)
class OracleResult:
    """The reactive oracle's cost, starvation and series, and the clairvoyant lower bound."""

    #: The reactive oracle's worker-hours (GPU-hours): the reference for deo's cost target.
    worker_hours: float
    #: Share of the non-paused time the reactive oracle's trainer starves.
    unavoidable_starvation_share: float
    #: The grid cells [start, end) in which the reactive oracle's trainer starves, at least in
    #: part (the first: the run's start), and the seconds it starves in each cell.
    unavoidable: tuple[tuple[float, float], ...]
    unavoidable_cells: tuple[float, ...]
    #: When the reactive oracle's first batch is ready.
    first_batch_t: float
    series: tuple[OraclePoint, ...]
    bound: LowerBound


def _realized_factors(scenario: Scenario) -> dict[str, float]:
    """Per pool, the mean latency factor of the groups a run at full consumption needs."""
    draws = Draws(scenario)
    trainer = scenario.trainer
    seqs = 0.0
    t = 0.0
    while t < scenario.duration_s:
        if not trainer.paused_at(t):
            seqs += trainer.batch_size_seqs / trainer.step_s_at(t) * GRID_S
        t += GRID_S
    factors = {}
    for pool in scenario.pools:
        count = max(math.ceil(seqs / pool.group_size), 1)
        values = draws.latency_factors(pool.name, count)
        factors[pool.name] = sum(values) / len(values)
    return factors


def _allocate(
    scenario: Scenario,
    t: float,
    demand_seqs_s: float,
    gpus_alive: int,
    mean_s: Callable[[EnvPool, float], float],
) -> tuple[dict[str, int], float]:
    """Workers per pool covering ``demand_seqs_s`` at ``t`` (as far as bounds allow) and what
    they produce, sequences/s."""
    rates = {
        pool.name: pool.groups_in_flight * pool.group_size / mean_s(pool, t)
        for pool in scenario.pools
    }
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
        produced += groups * pool.group_size / mean_s(pool, t)

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
            else math.ceil(remaining / rates[pool.name] - 1e-6)  # not one more for float noise
        )
        if groups_left != math.inf:  # workers beyond the inference capacity add nothing
            wanted = min(wanted, math.ceil(groups_left / pool.groups_in_flight))
        add(pool, wanted)
    return counts, produced


def _production(
    scenario: Scenario, t: float, counts: dict[str, int], mean_s: Callable[[EnvPool, float], float]
) -> float:
    """Sequences/s that ``counts`` producing workers make at ``t`` (inference capacity shared)."""
    groups = {p.name: counts.get(p.name, 0) * p.groups_in_flight for p in scenario.pools}
    total = sum(groups.values())
    share = 1.0
    if scenario.inference is not None and total > scenario.inference.max_concurrent_groups:
        share = scenario.inference.max_concurrent_groups / total
    return sum(
        groups[p.name] * share * p.group_size / mean_s(p, t)
        for p in scenario.pools
        if groups[p.name]
    )


def _first_batch_t(
    scenario: Scenario,
    asked: dict[str, list[tuple[float, int]]],
    mean_s: Callable[[EnvPool, float], float],
) -> float:
    """The earliest a first batch is ready with the workers ``asked`` for (per pool: when, how
    many), each producing its pool's start-up after it is asked for.

    Sequences done by time tau ~ sum over waves of N x groups_in_flight x group_size x
    M(tau - asked_t - startup), where M(x) = F(x) + max(x / mean - 1, 0) approximates the groups
    done per slot: the latency CDF for the first round, the mean rate after it.
    """
    batch = scenario.trainer.batch_size_seqs
    duration = scenario.duration_s

    def done(tau: float) -> float:
        total = 0.0
        slots_left = (
            math.inf
            if scenario.inference is None
            else float(scenario.inference.max_concurrent_groups)
        )
        for pool in scenario.pools:
            for asked_t, n in asked.get(pool.name, ()):
                up_t = asked_t + pool.startup_s
                elapsed = tau - up_t
                if elapsed <= 0 or not n or slots_left <= 0:
                    continue
                mean = mean_s(pool, up_t)
                slots = min(n * pool.groups_in_flight, slots_left)
                slots_left -= slots
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


def _earliest_first_batch_t(
    scenario: Scenario, counts: dict[str, int], startup_s: dict[str, float]
) -> float:
    """No controller's first batch is ready earlier, on this realized world.

    With S slots (``counts`` workers x ``groups_in_flight``), only the first S + m - 1 groups
    drawn can be among the first m to complete (a later group starts only after a completion),
    and each completes no earlier than the fastest start-up plus its own latency. So the first
    batch (m groups; the cheapest pool's groups when there are several) is ready no earlier than
    the fastest start-up plus the m-th smallest of those latencies.
    """
    draws = Draws(scenario)
    batch = scenario.trainer.batch_size_seqs
    duration = scenario.duration_s
    finishes: list[tuple[float, int]] = []
    for pool in scenario.pools:
        slots = counts.get(pool.name, 0) * pool.groups_in_flight
        if not slots:
            continue
        groups = math.ceil(batch / pool.group_size)
        fastest_mean = min(
            pool.latency_mean_at(0.0, duration), pool.latency_mean_at(duration, duration)
        )
        for factor in draws.latency_factors(pool.name, slots + groups - 1):
            finishes.append((startup_s[pool.name] + fastest_mean * factor, pool.group_size))
    finishes.sort()
    seqs = 0
    for t, size in finishes:
        seqs += size
        if seqs >= batch:
            return min(t, duration)
    return duration


def _waves_up(t: float, startup_s: float, pool: EnvPool) -> int:
    """The most workers of ``pool`` that can produce at ``t`` when each takes ``startup_s`` to
    start and at most ``max_starting`` start at once."""
    if startup_s <= 0:
        return pool.max_workers
    return min(pool.max_starting * math.floor(t / startup_s + 1e-9), pool.max_workers)


def _started_at_most(wanted: list[int], span: int, most_starting: int) -> list[int]:
    """The count held, cell by cell, by a controller that wants ``wanted`` but has at most
    ``most_starting`` workers starting at once (each takes ``span`` cells to start), as the
    reducer's ``max_starting`` allows: the rest are asked for as those come up. A count that
    falls lets the workers still starting go first (they make nothing yet)."""
    held: list[int] = []
    starts: deque[list[int]] = deque()  # [cell asked for, workers] still starting
    starting = count = 0
    for i, want in enumerate(wanted):
        while starts and starts[0][0] <= i - span:
            starting -= starts.popleft()[1]
        if want < count:
            drop = count - want
            while drop and starts:
                let_go = min(starts[-1][1], drop)
                starts[-1][1] -= let_go
                starting -= let_go
                drop -= let_go
                if not starts[-1][1]:
                    starts.pop()
            count = want
        else:
            asked = min(want - count, most_starting - starting)
            if asked > 0:
                starts.append([i, asked])
                starting += asked
                count += asked
        held.append(count)
    return held


def _window(
    values: list[int], span: int, pick: Callable[[int, int], bool], ahead: bool
) -> list[int]:
    """result[i] = the extreme (by ``pick(new, kept)``: new replaces kept) of ``values`` over
    [i, i + span] (``ahead``) or [i - span, i]."""
    n = len(values)
    result = [0] * n
    window: deque[int] = deque()
    order = range(n - 1, -1, -1) if ahead else range(n)
    for i in order:
        while window and pick(values[i], values[window[-1]]):
            window.pop()
        window.append(i)
        while abs(window[0] - i) > span:
            window.popleft()
        result[i] = values[window[0]]
    return result


def _fluid_queue(
    scenario: Scenario,
    paused: list[bool],
    production: list[float],
    consumption: list[float],
    first_t: float,
) -> tuple[float, tuple[tuple[float, float], ...], tuple[float, ...]]:
    """Starved seconds, the cells with any starvation (as intervals) and the starved seconds per
    cell: nothing until ``first_t``, then a fluid queue starting at one batch, fed by
    ``production``, drained by ``consumption``, capped at the off-policy limit."""
    batch = scenario.trainer.batch_size_seqs
    cap_seqs = float(max(p.max_batches_offpolicy for p in scenario.pools) * batch)
    starving = [False] * len(paused)
    per_cell = [0.0] * len(paused)
    starved_s = 0.0
    queue = float(batch)
    for i in range(len(paused)):
        t = i * GRID_S
        if paused[i]:
            if t >= first_t:
                queue = min(queue + production[i] * GRID_S, cap_seqs)
            continue
        if t + GRID_S <= first_t:
            starving[i] = True
            per_cell[i] = GRID_S
            continue
        share = 1.0
        if t < first_t:  # the cell the first batch arrives in
            share = (t + GRID_S - first_t) / GRID_S
            per_cell[i] = GRID_S - share * GRID_S
            starving[i] = True
        inflow = production[i] * GRID_S * share
        outflow = consumption[i] * GRID_S * share
        if queue + inflow >= outflow:
            queue = min(queue + inflow - outflow, cap_seqs)
        else:
            per_cell[i] += (1.0 - (queue + inflow) / outflow) * GRID_S * share
            starving[i] = True
            queue = 0.0
    starved_s = sum(per_cell)
    intervals: list[tuple[float, float]] = []
    for i, flag in enumerate(starving):
        if not flag:
            continue
        start, end = i * GRID_S, min((i + 1) * GRID_S, scenario.duration_s)
        if intervals and intervals[-1][1] == start:
            intervals[-1] = (intervals[-1][0], end)
        else:
            intervals.append((start, end))
    return starved_s, tuple(intervals), tuple(per_cell)


def _steps_taken(scenario: Scenario, paused: list[bool], starved_cells: tuple[float, ...]) -> int:
    """An upper bound on the trainer steps taken when it starves only ``starved_cells`` seconds
    per cell: its busy time filled with steps back to back, plus one per pause (a step in progress
    when a pause starts finishes in it) and the one in progress at the end."""
    trainer = scenario.trainer
    draws = Draws(scenario)
    steps = 0
    need = trainer.step_s_at(0.0) * draws.step_factor(0)
    for i, is_paused in enumerate(paused):
        available = 0.0 if is_paused else GRID_S - starved_cells[i]
        while available > 1e-12:
            take = min(available, need)
            available -= take
            need -= take
            if need <= 1e-12:
                steps += 1
                done_t = (i + 1) * GRID_S - available
                need = trainer.step_s_at(done_t) * draws.step_factor(steps)
    return steps + 1 + len(trainer.pauses)


def worker_hours_bound(scenario: Scenario, steps: int, groups_started: int | None = None) -> float:
    """The fewest worker-hours (GPU-hours) in which a controller feeds ``steps`` trainer steps on
    ``scenario``'s realized world (see the module docstring).

    The groups trained on are among the first ``groups_started`` drawn (per pool; None: exactly
    the first ones needed); each occupies a slot for its whole latency, so the bound takes the
    fastest of them. A run that started more groups than it trained on (discarded at the
    off-policy limit, lost to faults) may have kept only fast ones: pass its count to bound it.
    """
    draws = Draws(scenario)
    duration = scenario.duration_s
    needed_seqs = steps * scenario.trainer.batch_size_seqs
    # (GPU-seconds per sequence, sequences) of every group that could be among those trained on.
    offers: list[tuple[float, int]] = []
    floor_s = 0.0
    for pool in scenario.pools:
        cost = pool.cost_per_worker
        fastest_mean = min(
            pool.latency_mean_at(0.0, duration), pool.latency_mean_at(duration, duration)
        )
        count = max(math.ceil(needed_seqs / pool.group_size), groups_started or 0)
        for factor in draws.latency_factors(pool.name, count):
            slot_s = fastest_mean * factor / pool.groups_in_flight
            offers.append((cost * slot_s / pool.group_size, pool.group_size))
        floor_s += pool.min_workers * cost * duration
    offers.sort()
    work_s, seqs = 0.0, 0
    for per_seq, size in offers:
        if seqs >= needed_seqs:
            break
        work_s += per_seq * size
        seqs += size
    if needed_seqs:
        work_s += min(
            p.cost_per_worker
            * p.startup_s
            * min(
                draws.startup_factor(p.name, k)
                for k in range(_STARTUP_DRAWS_PER_WORKER * max(p.max_workers, 1))
            )
            for p in scenario.pools
        )
    return max(work_s, floor_s) / 3600.0


@functools.lru_cache(maxsize=64)
def oracle(scenario: Scenario) -> OracleResult:
    """The reactive oracle and the lower bound for ``scenario`` (see the module docstring)."""
    duration = scenario.duration_s
    trainer = scenario.trainer
    batch = trainer.batch_size_seqs
    cells = max(math.ceil(duration / GRID_S), 1)
    factors = _realized_factors(scenario)

    def mean_s(pool: EnvPool, t: float) -> float:
        return pool.latency_mean_at(t, duration) * factors[pool.name]

    losses = sorted(f.at_s for f in scenario.faults if f.kind == "gpu_loss")
    crashes = [
        (f.at_s, f.pool or scenario.pools[0].name, f.count)
        for f in scenario.faults
        if f.kind == "worker_crash"
    ]
    total_gpus = scenario.gpu_count
    needed: dict[str, list[int]] = {pool.name: [0] * cells for pool in scenario.pools}
    most: dict[str, list[int]] = {pool.name: [0] * cells for pool in scenario.pools}
    consumption: list[float] = []
    capacity: list[float] = []
    paused: list[bool] = []
    for i in range(cells):
        t = i * GRID_S
        gpus = total_gpus - sum(1 for at in losses if at <= t)
        is_paused = trainer.paused_at(t)
        c = 0.0 if is_paused else batch / trainer.step_s_at(t)
        counts, _ = _allocate(scenario, t, c, gpus, mean_s)
        for name, n in counts.items():
            needed[name][i] = n
        counts_max, produced_max = _allocate(scenario, t, math.inf, gpus, mean_s)
        for name, n in counts_max.items():
            most[name][i] = n
        consumption.append(c)
        capacity.append(produced_max)
        paused.append(is_paused)

    # --- the lower bound: every pool at its maximum, the fastest start-up drawn -----------------
    draws = Draws(scenario)
    fastest_startup = {
        p.name: p.startup_s
        * min(
            draws.startup_factor(p.name, k)
            for k in range(_STARTUP_DRAWS_PER_WORKER * max(p.max_workers, 1))
        )
        for p in scenario.pools
    }
    bound_first = _earliest_first_batch_t(scenario, {n: most[n][0] for n in most}, fastest_startup)
    # At most max_starting of a pool start at once, none faster than the fastest start-up: by t,
    # at most max_starting x floor(t / fastest) of its workers produce.
    bound_capacity = [
        _production(
            scenario,
            i * GRID_S,
            {
                p.name: min(most[p.name][i], _waves_up(i * GRID_S, fastest_startup[p.name], p))
                for p in scenario.pools
            },
            mean_s,
        )
        for i in range(cells)
    ]
    bound_starved_s, bound_starved, bound_cells = _fluid_queue(
        scenario, paused, bound_capacity, consumption, bound_first
    )
    active_s = GRID_S * sum(1 for flag in paused if not flag)
    bound_steps = _steps_taken(scenario, paused, bound_cells)
    bound = LowerBound(
        worker_hours=worker_hours_bound(scenario, bound_steps),
        starvation_share=bound_starved_s / active_s if active_s else 0.0,
        starved=bound_starved,
        starved_cells=bound_cells,
        steps=bound_steps,
        first_batch_t=bound_first,
    )

    # --- the reactive oracle ---------------------------------------------------------------------
    gpu_pool = next((p for p in scenario.pools if p.gpus_per_worker), None)
    held: dict[str, list[int]] = {}
    producing: dict[str, list[int]] = {}
    for pool in scenario.pools:
        name = pool.name
        span = math.ceil(pool.startup_s / GRID_S)
        pool_held = list(needed[name])
        # Into a pause: keep the workers one start-up time, then the minimum.
        for pause in trainer.pauses:
            start = math.ceil(pause.at_s / GRID_S)
            before = pool_held[start - 1] if 0 < start <= cells else pool.min_workers
            for i in range(start, min(math.ceil(pause.end_s / GRID_S), cells)):
                pool_held[i] = (
                    before if i * GRID_S < pause.at_s + pool.startup_s else pool.min_workers
                )
        pool_held = _started_at_most(pool_held, span, pool.max_starting)
        held[name] = pool_held
        # Producing: the workers held continuously for a start-up time, less those a fault took
        # within the last start-up time (their replacements are still starting) beyond the ones
        # it was letting go anyway.
        steady = _window(pool_held, span, lambda new, kept: new <= kept, ahead=False)
        recent_most = _window(pool_held, span, lambda new, kept: new >= kept, ahead=False)
        taken = [0] * cells
        for at in losses if pool is gpu_pool else ():
            for i in range(
                math.ceil(at / GRID_S), min(math.ceil((at + pool.startup_s) / GRID_S), cells)
            ):
                taken[i] += 1
        for at, pool_name, count in crashes:
            if pool_name != name:
                continue
            for i in range(
                math.ceil(at / GRID_S), min(math.ceil((at + pool.startup_s) / GRID_S), cells)
            ):
                taken[i] += count
        producing[name] = [
            max(
                min(steady[i], pool_held[i] - max(taken[i] - (recent_most[i] - pool_held[i]), 0)), 0
            )
            if i >= span
            else 0
            for i in range(cells)
        ]
    production = [
        _production(scenario, i * GRID_S, {n: producing[n][i] for n in producing}, mean_s)
        for i in range(cells)
    ]
    # The waves asked for before the first batch (a count that grows, max_starting at a time).
    asked: dict[str, list[tuple[float, int]]] = {}
    for name, pool_held in held.items():
        before = 0
        for i, count in enumerate(pool_held):
            if count > before:
                asked.setdefault(name, []).append((i * GRID_S, count - before))
            before = count
    first = max(_first_batch_t(scenario, asked, mean_s), bound_first)
    starved_s, intervals, cells_starved = _fluid_queue(
        scenario, paused, production, consumption, first
    )
    worker_hours = (
        sum(sum(held[p.name]) * p.cost_per_worker for p in scenario.pools) * GRID_S / 3600.0
    )
    series = tuple(
        OraclePoint(
            t=i * GRID_S,
            workers=sum(held[p.name][i] for p in scenario.pools),
            gpus=sum(held[p.name][i] * p.cost_per_worker for p in scenario.pools),
            consumption_seqs_s=consumption[i],
            capacity_seqs_s=capacity[i],
        )
        for i in range(cells)
    )
    return OracleResult(
        worker_hours=worker_hours,
        unavoidable_starvation_share=starved_s / active_s if active_s else 0.0,
        unavoidable=intervals,
        unavoidable_cells=cells_starved,
        first_batch_t=first,
        series=series,
        bound=bound,
    )
