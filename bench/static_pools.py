"""What a fixed pool can reach on each shipped scenario: the reference for deo's targets.

Run from the repository root::

    .venv/bin/python bench/static_pools.py               # every scenario, 3 seeds (~4 minutes)
    .venv/bin/python bench/static_pools.py --only steady --seeds 1

For each scenario of ``bench/scenarios`` and each seed (its own and the next ones, as ``deo
bench`` runs them), the smallest static pool whose avoidable starvation (beyond the reactive
oracle's) is at most 1% is found by bisection over 1..``max_workers``; the largest of those is
the smallest count meeting the starvation target on every seed, and it is run again on the seeds
that needed fewer. Its worker-hours against the reactive oracle and its mean lag are checked
against deo's targets (1.15 x, 1.5 steps). A larger pool holds more worker-hours and, nearly
always, queues deeper (more lag), a smaller one starves on some seed: where that count misses a
target, no fixed count meets it together with the starvation target, and a controller meets it
only by changing its count with the load. The table gives, per scenario, the count, its
worst-seed figures, and which targets a fixed pool meets.

It prints the table and writes it to ``docs/benchmarks.md`` between the
``<!-- static_pools:start -->`` and ``<!-- static_pools:end -->`` markers.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import attrs

from adapters.sim.driver import simulate
from adapters.sim.metrics import Metrics
from adapters.sim.scenario import Scenario, load_scenario
from bench.harness import (
    AVOIDABLE_STARVATION,
    DEFAULT_OUT,
    DEFAULT_SCENARIOS,
    MEAN_LAG_STEPS,
    WORKER_HOURS_X_ORACLE,
    BenchError,
    check_out,
    find_scenarios,
    write_section,
)
from core import PolicySpec

START_MARK = "<!-- static_pools:start -->"
END_MARK = "<!-- static_pools:end -->"
MARKS = (START_MARK, END_MARK)


@attrs.frozen(slots=True, kw_only=True)
class SeedResult:
    """The smallest static count meeting the starvation target on one seed, and its figures."""

    seed: int
    count: int | None  # None: not even the maximum meets it
    metrics: Metrics


def _static(scenario: Scenario, count: int) -> Metrics:
    return simulate(scenario, PolicySpec(name="static", params={"count": count})).metrics


def smallest_fed(scenario: Scenario) -> SeedResult:
    """Bisect for the smallest static count whose avoidable starvation meets the target."""
    high = max(pool.max_workers for pool in scenario.pools)
    best = _static(scenario, high)
    if best.avoidable_starvation_share > AVOIDABLE_STARVATION:
        return SeedResult(seed=scenario.seed, count=None, metrics=best)
    low, found = 0, high  # low starves too much (0 workers always does), found does not
    while found - low > 1:
        middle = (low + found) // 2
        metrics = _static(scenario, middle)
        if metrics.avoidable_starvation_share <= AVOIDABLE_STARVATION:
            found, best = middle, metrics
        else:
            low = middle
    return SeedResult(seed=scenario.seed, count=found, metrics=best)


def _seeded(path: Path, k: int) -> Scenario:
    scenario = load_scenario(path)
    return attrs.evolve(scenario, seed=scenario.seed + k)


def _smallest(job: tuple[Path, int]) -> tuple[str, SeedResult]:
    scenario = _seeded(*job)
    return scenario.name, smallest_fed(scenario)


def _at(job: tuple[Path, int, int]) -> tuple[str, SeedResult]:
    path, k, count = job
    scenario = _seeded(path, k)
    return scenario.name, SeedResult(
        seed=scenario.seed, count=count, metrics=_static(scenario, count)
    )


def render(results: dict[str, list[SeedResult]], seeds: int, command: str) -> str:
    lines = [
        START_MARK,
        "## Static pools: what a fixed count reaches (`bench/static_pools.py`)",
        "",
        f"- Command: `{command}`",
        f"- Seeds: {seeds} per scenario (its own and the next ones); figures are the worst seed's.",
        "- Count: the smallest static pool with avoidable starvation (beyond the reactive "
        f"oracle's) at most {AVOIDABLE_STARVATION:.0%} on every seed (bisection per seed, the "
        "largest of those), its figures on every seed; a larger pool holds more worker-hours "
        "and, nearly always, queues deeper, a smaller one starves on some seed: where that "
        "count misses the worker-hours or the lag target, no fixed count meets that target "
        "together with the starvation target, and a controller meets it only by changing its "
        "count with the load.",
        "",
        "| scenario | count | avoidable starvation | worker-hours x oracle | mean lag (steps) | "
        "a fixed count meets |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for name, rows in results.items():
        if any(row.count is None for row in rows):
            worst = max(row.metrics.avoidable_starvation_share for row in rows)
            lines.append(
                f"| {name} | - | {worst:.2%} at the maximum | - | - | not the starvation target |"
            )
            continue
        count = max(row.count or 0 for row in rows)
        starving = max(row.metrics.avoidable_starvation_share for row in rows)
        hours = max(row.metrics.worker_hours_ratio for row in rows)
        lag = max(row.metrics.mean_lag_steps for row in rows)
        met = ["starvation"]
        if hours <= WORKER_HOURS_X_ORACLE:
            met.append("worker-hours")
        if lag <= MEAN_LAG_STEPS:
            met.append("lag")
        verdict = "all three" if len(met) == 3 else " and ".join(met) + " only"
        lines.append(f"| {name} | {count} | {starving:.2%} | {hours:.2f} | {lag:.2f} | {verdict} |")
    lines.append(END_MARK)
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--scenarios", type=Path, default=DEFAULT_SCENARIOS)
    parser.add_argument("--only", nargs="+", default=(), metavar="NAME")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--jobs", type=int, default=2, help="processes (default 2)")
    args = parser.parse_args(argv)
    if args.seeds < 1 or args.jobs < 1:
        parser.error("--seeds and --jobs must be at least 1")
    try:
        paths = find_scenarios(args.scenarios, args.only)
        check_out(args.out, MARKS)
    except BenchError as exc:
        print(f"static_pools: {exc}", file=sys.stderr)
        return 2
    jobs = [(path, k) for path in paths for k in range(args.seeds)]
    found: dict[str, list[SeedResult]] = {}
    with ProcessPoolExecutor(args.jobs) as pool:
        for done, (name, result) in enumerate(pool.map(_smallest, jobs), start=1):
            found.setdefault(name, []).append(result)
            print(f"[{done}/{len(jobs)}] {name} seed {result.seed}: {result.count}", flush=True)
        # The count that meets the target on every seed is the largest of the seeds' smallest;
        # the seeds that needed fewer are run again at it.
        results: dict[str, list[SeedResult]] = {}
        again = []
        for path in paths:
            name = load_scenario(path).name
            rows = found[name]
            if any(row.count is None for row in rows):
                results[name] = rows
                continue
            count = max(row.count or 0 for row in rows)
            results[name] = [row for row in rows if row.count == count]
            again += [(path, k, count) for k, row in enumerate(rows) if row.count != count]
        for name, result in pool.map(_at, again):
            results[name].append(result)
    given = sys.argv[1:] if argv is None else list(argv)
    section = render(results, args.seeds, " ".join(["python bench/static_pools.py", *given]))
    print(section)
    write_section(args.out, section, MARKS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
