"""deo across regimes drawn at random: how often its targets hold outside the shipped scenarios.

Run from the repository root::

    .venv/bin/python bench/regimes.py                   # 100 regimes (about a minute on 2 cores)
    .venv/bin/python bench/regimes.py --count 20 --seed 7

Each regime is ``bench/scenarios/steady.toml`` with its parameters drawn from the ranges users
meet (:data:`RANGES`): the trainer's step time and batch, the group latency (lognormal, or
Pareto with a tail index down to 1.1), groups in flight per worker, the start-up, the pool's
maximum, a latency that grows or shrinks over the run, a change of the trainer's speed, an
evaluation pause; 30 simulated minutes each, every invariant of the core checked after every
event. deo's default policy runs on each, and its figures are read against the reactive oracle
on the same realized world (``docs/scenarios.md``).

Regimes whose need (demand over production per worker at the mean latency, at its largest over
the run) exceeds the pool's maximum are counted apart: the trainer starves there under any
controller, and avoidable starvation is measured over the little time the oracle feeds it.

Where deo misses the starvation target, fixed pools of a few counts around the need run on the
same realized world (:func:`best_fixed`): the reactive oracle is a fluid model without
atroposlib's cancellations at the off-policy limit, so where groups outlast what the queue holds
there it counts as avoidable a wait that no fixed count avoids either. The report says how much
of each miss the best of them leaves too.

It prints one line per regime and the summary, and writes the summary to
``docs/benchmarks.md`` between the ``<!-- regimes:start -->`` and ``<!-- regimes:end -->``
markers. Exit status: 0 when written, 2 on bad input, 1 when a regime crashed or broke an
invariant (the report names it).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import attrs

from adapters.sim.driver import simulate
from adapters.sim.metrics import worker_hours_ratio_since
from adapters.sim.scenario import load_scenario
from bench.harness import (
    AVOIDABLE_STARVATION,
    DEFAULT_OUT,
    DEFAULT_SCENARIOS,
    WORKER_HOURS_X_ORACLE,
    BenchError,
    check_out,
    write_section,
)

START_MARK = "<!-- regimes:start -->"
END_MARK = "<!-- regimes:end -->"
MARKS = (START_MARK, END_MARK)
BASE = DEFAULT_SCENARIOS / "steady.toml"
DURATION_S = 1800
#: Worker-hours are also compared from here on: past the cold start (every worker the pool may
#: have, for a start-up, before any rate is known), what a long run pays for.
SETTLED_FROM_S = DURATION_S / 2
#: The fixed counts tried where deo misses the starvation target, as shares of the need (and
#: the pool's maximum).
FIXED_SHARES = (0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 3.0)

#: What a regime draws, for the report (the draw itself is :func:`draw`).
RANGES = (
    ("trainer step", "0.5, 1, 2, 5, 10, 20 or 45 s, x 0.8-1.2; log-sd 0.2 in 3 of 10"),
    ("batch", "64, 128, 256, 512 or 1024 sequences"),
    ("group latency", "1, 3, 8, 15, 30, 60 or 90 s, x 0.8-1.2; lognormal (log-sd 0.8), or "
     "Pareto (index 1.1, 1.3, 1.6 or 2.5) in 3 of 10"),
    ("groups in flight", "1, 2, 4 or 8 per worker (groups of 8)"),
    ("start-up", "5, 10, 30, 60, 120 or 240 s"),
    ("pool maximum", "8, 16, 32, 64 or 128 workers"),
    ("latency over the run", "x 0.5, 2 or 3 by the end in 3 of 10"),
    ("trainer speed", "step time x 0.4 or x 2.5 at 10 minutes in 3 of 10"),
    ("pause", "a 5-minute evaluation at 15 minutes in 2 of 10"),
)  # fmt: skip


@attrs.frozen(slots=True, kw_only=True)
class Regime:
    index: int
    overrides: dict[str, str]
    #: Workers the trainer needs at the mean latency, at the most over the run.
    need: float
    max_workers: int

    @property
    def feasible(self) -> bool:
        return self.need <= self.max_workers

    def describe(self) -> str:
        o = self.overrides
        tail = (
            f"Pareto {o['pools.envs.latency_alpha']}"
            if "pools.envs.latency_alpha" in o
            else "lognormal"
        )
        extra = [
            f"latency x{o['pools.envs.latency_growth']}"
            if "pools.envs.latency_growth" in o
            else "",
            "a speed change" if "trainer.phases" in o else "",
            "a pause" if "trainer.pauses" in o else "",
        ]
        return (
            f"step {o['trainer.step_s']} s, batch {o['trainer.batch_size_seqs']}, groups "
            f"{o['pools.envs.latency_mean_s']} s ({tail}) x{o['pools.envs.groups_in_flight']}, "
            f"start-up {o['pools.envs.startup_s']} s, need {self.need:.1f} of "
            f"{self.max_workers}" + "".join(f", {e}" for e in extra if e)
        )


@attrs.frozen(slots=True, kw_only=True)
class Outcome:
    regime: Regime
    avoidable: float = 0.0
    hours_x: float = 0.0
    #: The worker-hours ratio from ``SETTLED_FROM_S`` on.
    settled_hours_x: float = 0.0
    reversals_h: float = 0.0
    #: Where deo misses the starvation target: the fixed count that starves least avoidably on
    #: the same world (of :func:`fixed_counts`), and its avoidable starvation.
    fixed_count: int | None = None
    fixed_avoidable: float | None = None
    error: str | None = None

    @property
    def beyond_fixed(self) -> float:
        """Avoidable starvation beyond what the best fixed count tried leaves (all of it where
        none was tried)."""
        if self.fixed_avoidable is None:
            return self.avoidable
        return max(self.avoidable - self.fixed_avoidable, 0.0)


def draw(index: int, seed: int) -> Regime:
    """Regime ``index`` of the series ``seed``: the same arguments, the same regime."""
    rng = random.Random(f"{seed}/{index}")
    step = rng.choice([0.5, 1, 2, 5, 10, 20, 45]) * rng.uniform(0.8, 1.2)
    batch = rng.choice([64, 128, 256, 512, 1024])
    latency = rng.choice([1, 3, 8, 15, 30, 60, 90]) * rng.uniform(0.8, 1.2)
    in_flight = rng.choice([1, 2, 4, 8])
    most = rng.choice([8, 16, 32, 64, 128])
    o = {
        "duration_s": str(DURATION_S),
        "seed": str(seed * 1000 + index),
        "trainer.step_s": f"{step:.2f}",
        "trainer.batch_size_seqs": str(batch),
        "pools.envs.group_size": "8",
        "pools.envs.latency_mean_s": f"{latency:.2f}",
        "pools.envs.groups_in_flight": str(in_flight),
        "pools.envs.startup_s": str(rng.choice([5, 10, 30, 60, 120, 240])),
        "pools.envs.max_workers": str(most),
    }
    if rng.random() < 0.3:
        o["trainer.step_sigma"] = "0.2"
    if rng.random() < 0.3:
        o["pools.envs.latency_dist"] = '"pareto"'
        o["pools.envs.latency_alpha"] = str(rng.choice([1.1, 1.3, 1.6, 2.5]))
    growth = 1.0
    if rng.random() < 0.3:
        growth = rng.choice([0.5, 2.0, 3.0])
        o["pools.envs.latency_growth"] = str(growth)
    fastest = step
    if rng.random() < 0.3:
        later = step * rng.choice([0.4, 2.5])
        fastest = min(step, later)
        o["trainer.phases"] = f"[{{ at_s = 600, step_s = {later:.2f} }}]"
    if rng.random() < 0.2:
        o["trainer.pauses"] = '[{ at_s = 900, duration_s = 300, kind = "eval" }]'
    per_worker = in_flight * 8 / (latency * max(growth, 1.0))
    return Regime(index=index, overrides=o, need=batch / fastest / per_worker, max_workers=most)


def fixed_counts(regime: Regime) -> list[int]:
    """The fixed pools tried on ``regime``: :data:`FIXED_SHARES` of its need, and its maximum."""
    counts = {min(max(round(regime.need * share), 1), regime.max_workers) for share in FIXED_SHARES}
    return sorted(counts | {regime.max_workers})


def best_fixed(regime: Regime) -> tuple[int, float]:
    """The fixed count of :func:`fixed_counts` that starves least avoidably on ``regime``'s
    realized world (the fewest workers among equals), and that avoidable starvation."""
    tried = []
    for count in fixed_counts(regime):
        static = f'{{ name = "static", count = {count} }}'
        scenario = load_scenario(BASE, {**regime.overrides, "pools.envs.policy": static})
        tried.append((simulate(scenario).metrics.avoidable_starvation_share, count))
    avoidable, count = min(tried)
    return count, avoidable


def run(regime: Regime) -> Outcome:
    """deo's default policy on ``regime``, every invariant checked; where it misses the
    starvation target, the best fixed count too."""
    try:
        scenario = load_scenario(BASE, regime.overrides)
        result = simulate(scenario, check_invariants=True)
    except Exception as exc:  # a crash or a broken invariant is the finding: report it
        return Outcome(regime=regime, error=f"{type(exc).__name__}: {exc}"[:300])
    metrics = result.metrics
    outcome = Outcome(
        regime=regime,
        avoidable=metrics.avoidable_starvation_share,
        hours_x=metrics.worker_hours_ratio,
        settled_hours_x=worker_hours_ratio_since(result, SETTLED_FROM_S),
        reversals_h=metrics.reversals_per_hour,
    )
    if regime.feasible and outcome.avoidable > AVOIDABLE_STARVATION:
        count, avoidable = best_fixed(regime)
        outcome = attrs.evolve(outcome, fixed_count=count, fixed_avoidable=avoidable)
    return outcome


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]


def _fixed(outcome: Outcome) -> str:
    if outcome.fixed_count is None or outcome.fixed_avoidable is None:
        return ""
    return f" ({outcome.fixed_avoidable:.2%} with the best fixed count, {outcome.fixed_count})"


def render(outcomes: list[Outcome], command: str) -> str:
    ran = [o for o in outcomes if o.error is None]
    feasible = [o for o in ran if o.regime.feasible]
    short = [o for o in ran if not o.regime.feasible]
    broken = [o for o in outcomes if o.error is not None]
    lines = [
        START_MARK,
        "## deo across regimes drawn at random (`bench/regimes.py`)",
        "",
        f"- Command: `{command}`",
        f"- Regimes: {len(outcomes)}, each 30 simulated minutes of `steady.toml` with its "
        "parameters drawn from the ranges below, deo's default policy, every invariant checked "
        f"after every event: {len(broken)} crashed or broke an invariant.",
        f"- Feasible ({len(feasible)}): the pool's maximum covers the need at the mean latency. "
        f"The rest ({len(short)}) starve under any controller; there deo holds "
        + (
            f"a median {statistics.median(o.hours_x for o in short):.2f} x the oracle's "
            "worker-hours."
            if short
            else "none."
        ),
        "",
        "| drawn | from |",
        "|---|---|",
        *(f"| {what} | {values} |" for what, values in RANGES),
        "",
    ]
    if feasible:
        starve_ok = sum(o.avoidable <= AVOIDABLE_STARVATION for o in feasible)
        hours_ok = sum(o.hours_x <= WORKER_HOURS_X_ORACLE for o in feasible)
        both_ok = sum(
            o.avoidable <= AVOIDABLE_STARVATION and o.hours_x <= WORKER_HOURS_X_ORACLE
            for o in feasible
        )
        settled_ok = sum(o.settled_hours_x <= WORKER_HOURS_X_ORACLE for o in feasible)
        avoid = [o.avoidable for o in feasible]
        hours = [o.hours_x for o in feasible]
        settled = [o.settled_hours_x for o in feasible]
        beyond = [o.beyond_fixed for o in feasible]
        beyond_ok = sum(b <= AVOIDABLE_STARVATION for b in beyond)
        n = len(feasible)
        late = f"{SETTLED_FROM_S / 60:.0f} minutes"
        lines += [
            "| on the feasible regimes | share | median | 90th percentile |",
            "|---|---:|---:|---:|",
            f"| avoidable starvation <= {AVOIDABLE_STARVATION:.0%} | {starve_ok}/{n} | "
            f"{statistics.median(avoid):.2%} | {_quantile(avoid, 0.9):.2%} |",
            f"| worker-hours <= {WORKER_HOURS_X_ORACLE} x the oracle's | {hours_ok}/{n} | "
            f"{statistics.median(hours):.2f} | {_quantile(hours, 0.9):.2f} |",
            f"| avoidable starvation <= {AVOIDABLE_STARVATION:.0%} beyond the best fixed "
            f"count's | {beyond_ok}/{n} | {statistics.median(beyond):.2%} | "
            f"{_quantile(beyond, 0.9):.2%} |",
            f"| both | {both_ok}/{n} | | |",
            f"| worker-hours after {late} <= {WORKER_HOURS_X_ORACLE} x the oracle's | "
            f"{settled_ok}/{n} | {statistics.median(settled):.2f} | "
            f"{_quantile(settled, 0.9):.2f} |",
            "",
            f"Worker-hours after {late} leave out the cold start (every worker the pool may "
            "have, for a start-up, before any rate is known; over a half-hour regime with "
            "long start-ups it outweighs the rest): what a long run pays for.",
            "",
            "Beyond the best fixed count: where deo misses the starvation target, fixed pools "
            f"of {', '.join(f'{s:g}' for s in FIXED_SHARES)} x the need and the pool's maximum "
            "run on the same realized world, and the least avoidable starvation among them is "
            "taken off deo's. The reactive oracle is a fluid model without atroposlib's "
            "cancellations at the off-policy limit: where groups outlast what the queue holds "
            "there, it counts as avoidable a wait no fixed count avoids either (where the "
            "trainer then waits a step or more with nothing landing, deo raises "
            "`offpolicy_stalls`, naming the limit that would avoid it).",
            "",
            "The five feasible regimes with the most avoidable starvation, the five with the "
            f"most worker-hours, and the five with the most after {late}:",
            "",
        ]
        worst = sorted(feasible, key=lambda o: -o.avoidable)[:5]
        worst += sorted(feasible, key=lambda o: -o.hours_x)[:5]
        worst += sorted(feasible, key=lambda o: -o.settled_hours_x)[:5]
        lines += [
            f"- #{o.regime.index}: {o.avoidable:.2%} avoidable{_fixed(o)}, {o.hours_x:.2f} x "
            f"({o.settled_hours_x:.2f} x after {late}), {o.reversals_h:.0f} reversals/h; "
            f"{o.regime.describe()}"
            for o in worst
        ]
    if broken:
        lines += ["", "Crashed or broke an invariant:", ""]
        lines += [f"- #{o.regime.index} ({o.regime.describe()}): {o.error}" for o in broken]
    lines.append(END_MARK)
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--count", type=int, default=100, help="regimes (default 100)")
    parser.add_argument("--seed", type=int, default=1, help="series of regimes (default 1)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--jobs", type=int, default=2, help="processes (default 2)")
    args = parser.parse_args(argv)
    if args.count < 1 or args.jobs < 1:
        parser.error("--count and --jobs must be at least 1")
    try:
        check_out(args.out, MARKS)
    except BenchError as exc:
        print(f"regimes: {exc}", file=sys.stderr)
        return 2
    regimes = [draw(i, args.seed) for i in range(args.count)]
    outcomes = []
    with ProcessPoolExecutor(args.jobs) as pool:
        for done, outcome in enumerate(pool.map(run, regimes), start=1):
            outcomes.append(outcome)
            figures = (
                outcome.error
                if outcome.error
                else f"avoidable {outcome.avoidable:.2%}{_fixed(outcome)}, "
                f"{outcome.hours_x:.2f} x ({outcome.settled_hours_x:.2f} x settled)"
            )
            print(f"[{done}/{args.count}] #{outcome.regime.index}: {figures}", flush=True)
    given = sys.argv[1:] if argv is None else list(argv)
    section = render(outcomes, " ".join(["python bench/regimes.py", *given]))
    print(section)
    write_section(args.out, section, MARKS)
    return 1 if any(o.error for o in outcomes) else 0


if __name__ == "__main__":
    sys.exit(main())
