"""The controller benchmark behind ``deo bench``: every scenario under every policy, side by side.

For each scenario file (``bench/scenarios/*.toml``) the harness runs, in the simulator and through
the real reducer:

* ``deo``: deo's default policy (``buffer``, default parameters, the scenario's pool settings);
* every baseline of :func:`bench.baselines.baseline_specs` (the DEO proposal, Ray Serve, verl,
  the Kubernetes HPA, a static pool at its maximum), parameterised from the scenario's first pool;
* the reactive oracle (:func:`adapters.sim.oracle.oracle`: knows the present perfectly, not the
  future), the reference for cost and for the starvation a controller could not avoid, and the
  clairvoyant lower bound nothing beats on the same realized world.

It prints one progress line per scenario x policy, writes a section of ``docs/benchmarks.md``
between :data:`START_MARK` and :data:`END_MARK` (everything outside them is kept), and draws one
PNG per scenario. deo's targets are checked per scenario (:func:`check_targets`) and reported;
missing one is a result, not an error.

A scenario is *jitter-only* when nothing in it changes over time except the random latencies: no
trainer phases or pauses, no faults, no latency drift. On those a controller has no reason to
move back and forth, so deo must not flap there.
"""

from __future__ import annotations

import datetime as dt
import math
import os
import stat
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from adapters.sim.driver import simulate
from adapters.sim.oracle import oracle
from adapters.sim.scenario import Scenario, ScenarioError, load_scenario
from bench.baselines import CATALOG, baseline_specs
from core.config import PolicySpec
from core.errors import DeoError

__all__ = [
    "DEFAULT_OUT",
    "DEFAULT_PLOTS",
    "DEFAULT_SCENARIOS",
    "DEO",
    "END_MARK",
    "ORACLE",
    "START_MARK",
    "BenchError",
    "Check",
    "Metrics",
    "OracleRun",
    "PolicyRun",
    "ScenarioReport",
    "Series",
    "check_every_seed",
    "check_targets",
    "find_scenarios",
    "is_jitter_only",
    "lineup",
    "plot_scenario",
    "render_section",
    "replace_section",
    "run_bench",
    "run_scenario",
    "run_seeds",
    "write_atomically",
]

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_SCENARIOS = ROOT / "bench" / "scenarios"
DEFAULT_OUT = ROOT / "docs" / "benchmarks.md"
DEFAULT_PLOTS = ROOT / "docs" / "bench"
START_MARK = "<!-- deo_bench:start -->"
END_MARK = "<!-- deo_bench:end -->"

DEO = "deo"
ORACLE = "oracle"

#: deo's targets, per scenario: starvation beyond the reactive oracle's (a share of the non-paused
#: time it does not starve), worker-hours over the reactive oracle's, mean lag in trainer steps.
AVOIDABLE_STARVATION = 0.01
WORKER_HOURS_X_ORACLE = 1.15
MEAN_LAG_STEPS = 1.5
#: Reversals of scaling direction per hour, over any span, on jitter-only scenarios.
REVERSALS_PER_HOUR = 2.0
#: Differences below these are ties when comparing with a baseline (float noise, not results).
_SHARE_TIE = 1e-9
_HOURS_TIE = 1e-9


class BenchError(DeoError):
    """Input the benchmark cannot use; the message names what is wrong and where."""


# --- results -------------------------------------------------------------------------------------


@attrs.frozen(slots=True, kw_only=True)
class Metrics:
    """One run's figures, as the simulator measured them."""

    #: Share of the non-paused time the trainer waited for a batch.
    starvation_share: float
    #: Starvation beyond the reactive oracle's, episode by episode (adapters.sim.metrics).
    avoidable_starvation_share: float
    #: GPU-hours held by workers (a 0-GPU worker counts one per hour).
    worker_hours: float
    #: Trainer steps between a sequence being queued and trained on.
    mean_lag_steps: float
    p95_lag_steps: float
    scale_actions: int
    #: Reversals of scaling direction over any span, and per hour of the run.
    flaps: int
    reversals_per_hour: float = 0.0
    #: Groups cancelled at the off-policy limit (their generation wasted).
    groups_discarded: int = 0


@attrs.frozen(slots=True, kw_only=True)
class Series:
    """Worker count and trainer waiting over time, for the plots."""

    t_s: tuple[float, ...]
    workers: tuple[int, ...]
    #: Cumulative seconds the trainer waited (outside pauses) up to each t.
    waited_s: tuple[float, ...]


@attrs.frozen(slots=True, kw_only=True)
class PolicyRun:
    name: str
    spec: PolicySpec
    pool_overrides: dict[str, Any]
    metrics: Metrics
    series: Series
    elapsed_s: float


@attrs.frozen(slots=True, kw_only=True)
class OracleRun:
    """The reactive oracle (the reference for the targets) and the clairvoyant lower bound."""

    worker_hours: float
    unavoidable_starvation_share: float
    series: Series
    elapsed_s: float
    bound_worker_hours: float = 0.0
    bound_starvation_share: float = 0.0


@attrs.frozen(slots=True, kw_only=True)
class Check:
    """One of deo's targets on one scenario."""

    target: str
    value: str
    ok: bool
    #: A word or two naming the target in the overview table ("lag", "worker-hours").
    short: str = ""


@attrs.frozen(slots=True, kw_only=True)
class ScenarioReport:
    name: str
    description: str
    path: Path
    jitter_only: bool
    #: Which pool the baselines' parameters come from, and what they are.
    baseline_source: str
    oracle: OracleRun
    #: deo first, then the baselines in line-up order.
    runs: tuple[PolicyRun, ...]
    #: The trainer's pauses [start, end) and the faults (time, what), for the plots.
    pauses: tuple[tuple[float, float], ...] = ()
    faults: tuple[tuple[float, str], ...] = ()
    #: The seed this report's runs had, and the reports of the same scenario under the other
    #: seeds of a ``--seeds`` run (empty: one seed).
    seed: int = 1
    seeds: tuple[ScenarioReport, ...] = ()

    @property
    def every_seed(self) -> tuple[ScenarioReport, ...]:
        """This report and those of the other seeds, in seed order."""
        return (self, *self.seeds)

    @property
    def deo(self) -> PolicyRun:
        return self.runs[0]

    @property
    def baselines(self) -> tuple[PolicyRun, ...]:
        return self.runs[1:]


# --- scenarios and the line-up -------------------------------------------------------------------


def find_scenarios(directory: Path, only: Sequence[str] = ()) -> list[Path]:
    """The scenario files of ``directory`` (``*.toml``, by name), those named in ``only`` if any.

    Raises :class:`BenchError` for a missing or empty directory or an unknown name.
    """
    if not directory.exists():
        raise BenchError(f"--scenarios {directory}: no such directory")
    if not directory.is_dir():
        raise BenchError(f"--scenarios {directory}: not a directory")
    paths = sorted(directory.glob("*.toml"))
    if not paths:
        raise BenchError(f"--scenarios {directory}: no scenario files (*.toml) in it")
    if not only:
        return paths
    by_name = {path.stem: path for path in paths}
    unknown = [name for name in only if name not in by_name]
    if unknown:
        raise BenchError(
            f"--only {' '.join(unknown)}: no such scenario in {directory} "
            f"(scenarios: {', '.join(sorted(by_name))})"
        )
    return [by_name[name] for name in dict.fromkeys(only)]


def is_jitter_only(scenario: Scenario) -> bool:
    """Nothing changes over the run but the random latencies (see the module docstring)."""
    trainer = scenario.trainer
    return (
        not trainer.phases
        and not trainer.pauses
        and not scenario.faults
        and all(pool.latency_growth == 1.0 for pool in scenario.pools)
    )


def lineup(scenario: Scenario) -> tuple[dict[str, tuple[PolicySpec, dict[str, Any]]], str]:
    """deo and every baseline for ``scenario``: name -> (policy spec, pool overrides), in order,
    and a sentence saying where the baselines' parameters come from.

    The baselines are parameterised from the first pool (group size, groups in flight); the
    static baseline holds the largest pool maximum, which the reducer clamps to each pool's own.
    """
    first = scenario.pools[0]
    largest = max(pool.max_workers for pool in scenario.pools)
    specs: dict[str, tuple[PolicySpec, dict[str, Any]]] = {DEO: (PolicySpec(name="buffer"), {})}
    specs.update(
        baseline_specs(
            group_size=first.group_size,
            groups_in_flight=first.groups_in_flight,
            max_workers=largest,
        )
    )
    source = (
        f"pool `{first.name}`: group size {first.group_size}, {first.groups_in_flight} groups "
        f"in flight per worker, static at {largest}"
    )
    if len(scenario.pools) > 1:
        others = ", ".join(f"`{p.name}`" for p in scenario.pools[1:])
        source += f" (applied to {others} as well)"
    return specs, source


# --- running -------------------------------------------------------------------------------------


def _waited(points: Sequence[tuple[float, bool]], end_s: float) -> tuple[float, ...]:
    """Cumulative waiting at each point from (t, waiting) samples, each held until the next."""
    total = 0.0
    out = []
    for i, (t, waiting) in enumerate(points):
        out.append(total)
        following = points[i + 1][0] if i + 1 < len(points) else end_s
        if waiting:
            total += max(following - t, 0.0)
    return tuple(out)


def _run_policy(
    scenario: Scenario, name: str, spec: PolicySpec, overrides: dict[str, Any]
) -> PolicyRun:
    started = time.perf_counter()
    result = simulate(scenario, spec, pool_overrides=overrides, policies=CATALOG)
    elapsed = time.perf_counter() - started
    m = result.metrics
    metrics = Metrics(
        starvation_share=float(m.starvation_share),
        avoidable_starvation_share=float(m.avoidable_starvation_share),
        worker_hours=float(m.worker_hours),
        mean_lag_steps=float(m.mean_lag_steps),
        p95_lag_steps=float(m.p95_lag_steps),
        scale_actions=int(m.scale_actions),
        flaps=int(m.flaps),
        reversals_per_hour=float(m.reversals_per_hour),
        groups_discarded=int(m.groups_discarded),
    )
    points = result.series
    series = Series(
        t_s=tuple(p.t for p in points),
        workers=tuple(p.active_workers for p in points),
        waited_s=_waited([(p.t, p.trainer_waiting) for p in points], scenario.duration_s),
    )
    return PolicyRun(
        name=name,
        spec=spec,
        pool_overrides=dict(overrides),
        metrics=metrics,
        series=series,
        elapsed_s=elapsed,
    )


def _run_oracle(scenario: Scenario) -> OracleRun:
    started = time.perf_counter()
    result = oracle(scenario)
    elapsed = time.perf_counter() - started
    t_s = tuple(p.t for p in result.series)
    waited = []
    total = 0.0
    for seconds in result.unavoidable_cells:  # one per series point
        waited.append(total)
        total += seconds
    return OracleRun(
        worker_hours=result.worker_hours,
        unavoidable_starvation_share=result.unavoidable_starvation_share,
        bound_worker_hours=result.bound.worker_hours,
        bound_starvation_share=result.bound.starvation_share,
        series=Series(
            t_s=t_s, workers=tuple(p.workers for p in result.series), waited_s=tuple(waited)
        ),
        elapsed_s=elapsed,
    )


def run_scenario(
    path: Path, scenario: Scenario, *, progress: Callable[[str], None] = print
) -> ScenarioReport:
    """Run ``scenario`` (read from ``path``) under deo, every baseline and the oracle."""
    specs, source = lineup(scenario)
    width = max(len(name) for name in (*specs, ORACLE))
    runs = []
    for name, (spec, overrides) in specs.items():
        run = _run_policy(scenario, name, spec, overrides)
        m = run.metrics
        progress(
            f"{scenario.name}  {name:<{width}}  {run.elapsed_s:6.1f}s  starvation "
            f"{_pct(m.starvation_share)}  worker-hours {m.worker_hours:.2f}"
        )
        runs.append(run)
    oracle_run = _run_oracle(scenario)
    progress(
        f"{scenario.name}  {ORACLE:<{width}}  {oracle_run.elapsed_s:6.1f}s  starvation "
        f"{_pct(oracle_run.unavoidable_starvation_share)} (unavoidable)  worker-hours "
        f"{oracle_run.worker_hours:.2f}; lower bound: starvation "
        f"{_pct(oracle_run.bound_starvation_share)}  worker-hours "
        f"{oracle_run.bound_worker_hours:.2f}"
    )
    return ScenarioReport(
        name=scenario.name,
        description=scenario.description,
        path=path,
        jitter_only=is_jitter_only(scenario),
        baseline_source=source,
        oracle=oracle_run,
        runs=tuple(runs),
        seed=scenario.seed,
        pauses=tuple((p.at_s, p.end_s) for p in scenario.trainer.pauses),
        faults=tuple(
            (f.at_s, f.kind if f.gpu is None else f"{f.kind} {f.gpu}") for f in scenario.faults
        ),
    )


def run_seeds(
    path: Path, scenario: Scenario, seeds: int, *, progress: Callable[[str], None] = print
) -> ScenarioReport:
    """:func:`run_scenario` under ``seeds`` seeds: the scenario's own, then the next ones; the
    first seed's report, holding the others' in ``seeds``."""
    reports = []
    for k in range(seeds):
        seeded = attrs.evolve(scenario, seed=scenario.seed + k)

        def tagged(line: str, seed: int = seeded.seed) -> None:
            progress(f"{line}  [seed {seed}]" if seeds > 1 else line)

        reports.append(run_scenario(path, seeded, progress=tagged))
    return attrs.evolve(reports[0], seeds=tuple(reports[1:]))


# --- deo's targets -------------------------------------------------------------------------------


def _pct(share: float) -> str:
    return "n/a" if math.isnan(share) else f"{share * 100:.2f}%"


def _steps(value: float) -> str:
    return "n/a" if math.isnan(value) else f"{value:.2f}"


def _not_dominated(deo: Metrics, other: Metrics) -> tuple[bool, str]:
    """deo is strictly better than ``other`` on starvation or on worker-hours (so never worse on
    both); otherwise why not."""
    starvation = deo.starvation_share - other.starvation_share
    hours = deo.worker_hours - other.worker_hours
    if starvation < -_SHARE_TIE or hours < -_HOURS_TIE:
        return True, ""
    return False, (
        f"starvation {_pct(deo.starvation_share)} vs {_pct(other.starvation_share)}, "
        f"worker-hours {deo.worker_hours:.2f} vs {other.worker_hours:.2f}"
    )


def check_targets(report: ScenarioReport) -> tuple[Check, ...]:
    """deo's targets on one scenario (see ``docs/benchmarks.md`` for their rationale)."""
    deo = report.deo.metrics
    unavoidable = report.oracle.unavoidable_starvation_share
    oracle_hours = report.oracle.worker_hours
    if oracle_hours > 0:
        hours = (
            f"{deo.worker_hours:.2f} = {deo.worker_hours / oracle_hours:.2f} x {oracle_hours:.2f}"
        )
    else:  # no ratio to give: the oracle needed no worker at all
        hours = f"{deo.worker_hours:.2f} (the oracle held no worker)"
    checks = [
        Check(
            target=f"starvation <= {AVOIDABLE_STARVATION:.0%} beyond the reactive oracle's",
            short="starvation",
            value=f"{_pct(deo.avoidable_starvation_share)} (all: {_pct(deo.starvation_share)}, "
            f"unavoidable {_pct(unavoidable)})",
            ok=deo.avoidable_starvation_share <= AVOIDABLE_STARVATION + _SHARE_TIE,
        ),
        Check(
            target=f"worker-hours <= {WORKER_HOURS_X_ORACLE:g} x oracle",
            short="worker-hours",
            value=hours,
            ok=deo.worker_hours <= WORKER_HOURS_X_ORACLE * oracle_hours + _HOURS_TIE,
        ),
        Check(
            target=f"mean lag <= {MEAN_LAG_STEPS:g} steps",
            short="lag",
            value=_steps(deo.mean_lag_steps),
            ok=deo.mean_lag_steps <= MEAN_LAG_STEPS,  # NaN (nothing trained) fails
        ),
    ]
    if report.jitter_only:
        checks.append(
            Check(
                target=f"<= {REVERSALS_PER_HOUR:g} reversals per hour (jitter-only)",
                short="reversals",
                value=f"{deo.reversals_per_hour:.1f} ({deo.flaps})",
                ok=deo.reversals_per_hour <= REVERSALS_PER_HOUR,
            )
        )
    failures = []
    for run in report.baselines:
        ok, why = _not_dominated(deo, run.metrics)
        if not ok:
            failures.append(f"{run.name} ({why})")
    checks.append(
        Check(
            target="against every baseline: better on starvation or on worker-hours",
            short="a baseline",
            value="yes" if not failures else "better on neither against " + "; ".join(failures),
            ok=not failures,
        )
    )
    return tuple(checks)


def check_every_seed(report: ScenarioReport) -> tuple[Check, ...]:
    """deo's targets judged on every seed of ``report``: one is met only where it is met on
    each; the value shown is the first seed's, or that of the first seed that missed it."""
    per_seed = [check_targets(r) for r in report.every_seed]
    if len(per_seed) == 1:
        return per_seed[0]
    seeds = [r.seed for r in report.every_seed]
    combined = []
    for i, first in enumerate(per_seed[0]):
        checks = [checks[i] for checks in per_seed]
        missed = [k for k, check in enumerate(checks) if not check.ok]
        if not missed:
            value = f"{first.value} (seed {seeds[0]}); met on all {len(seeds)} seeds"
        else:
            names = ", ".join(str(seeds[k]) for k in missed)
            value = (
                f"missed on {len(missed)} of {len(seeds)} seeds ({names}); seed "
                f"{seeds[missed[0]]}: {checks[missed[0]].value}"
            )
        combined.append(Check(target=first.target, value=value, ok=not missed, short=first.short))
    return tuple(combined)


# --- the report ----------------------------------------------------------------------------------

_HEADER = (
    "| policy | starvation % | worker-hours | x oracle | mean lag (steps) | p95 lag | "
    "scale actions | reversals (per hour) | groups discarded |"
)
_RULE = "|---|---:|---:|---:|---:|---:|---:|---:|---:|"

_POLICY_NOTES: dict[str, str] = {
    DEO: "deo's default policy (`buffer`), default parameters",
    "deo-proposal": "the Atropos DEO proposal (PR #438): pressure = queued groups / batch "
    "sequences, target 1.0, dead band 0.2, 60 s cooldown, at most 4 workers a step, scaling up "
    "on a deep queue (as published)",
    "deo-corrected": "the same rule with its units and direction corrected: pressure = queued "
    "batches, target 1.0, more workers on a short queue (same dead band, cooldown, step cap)",
    "ray-serve": "Ray Serve's default policy: ceil(mean in flight over 30 s / target), target "
    "= 2/5 of a worker's groups in flight (default target 2 of max_ongoing_requests 5), 30 s "
    "upscale / 600 s downscale delay",
    "verl": "verl's elastic scheduler rule (core `threshold`): load ratio = in flight / (groups "
    "in flight per worker x workers), thresholds 0.5 / 0.8, cooldowns 30 s up / 60 s down, 10 s "
    "stability, one worker a step",
    "k8s-hpa": "Kubernetes HPA (core `hpa`): ceil(in flight / target per worker), target 80% "
    "of a worker's groups in flight, tolerance 0.1, 300 s scale-down stabilization",
    "static": "a fixed pool at its maximum",
    ORACLE: "the reactive oracle: holds, at every moment, the workers that cover the present "
    "consumption, each producing a start-up after it asks (at most the pool's max_starting "
    "starting at once, as for every policy); keeps its workers one start-up into a "
    "pause; its starvation is the unavoidable share. The lower bound below it is clairvoyant: "
    "no controller beats it on either axis on the same realized world",
}


def _relative(path: Path, start: Path) -> str:
    try:
        return Path(os.path.relpath(path.resolve(), start.resolve())).as_posix()
    except ValueError:  # another drive
        return path.resolve().as_posix()


def _run_row(run: PolicyRun, oracle_hours: float) -> str:
    m = run.metrics
    ratio = f"{m.worker_hours / oracle_hours:.2f}" if oracle_hours > 0 else "n/a"
    name = f"**{run.name}**" if run.name == DEO else run.name
    return (
        f"| {name} | {_pct(m.starvation_share)} | {m.worker_hours:.2f} | {ratio} | "
        f"{_steps(m.mean_lag_steps)} | {_steps(m.p95_lag_steps)} | {m.scale_actions} | "
        f"{m.flaps} ({m.reversals_per_hour:.1f}) | {m.groups_discarded} |"
    )


def _mean_worst(values: Sequence[float], show: Callable[[float], str], worst: str = "max") -> str:
    """``mean (worst)`` over seeds; NaN (nothing trained) is the worst of all."""
    if any(math.isnan(v) for v in values):
        return f"{show(math.nan)} ({show(math.nan)})"
    pick = max(values) if worst == "max" else min(values)
    return f"{show(sum(values) / len(values))} ({show(pick)})"


def _hours(value: float) -> str:
    return f"{value:.2f}"


def _ratio(value: float) -> str:
    """A ratio to the oracle's worker-hours; "n/a" where the oracle held no worker."""
    return "n/a" if math.isinf(value) else f"{value:.2f}"


def _seeded_rows(report: ScenarioReport) -> list[str]:
    """The table's rows over every seed: per figure the mean and, in brackets, the worst."""
    reports = report.every_seed
    oracles = [r.oracle for r in reports]
    oracle_hours = [o.worker_hours for o in oracles]

    def ratio(hours: float, reference: float) -> float:
        return hours / reference if reference > 0 else math.inf

    rows = [
        f"| oracle (reactive) | "
        f"{_mean_worst([o.unavoidable_starvation_share for o in oracles], _pct)} | "
        f"{_mean_worst(oracle_hours, _hours)} | 1.00 | - | - | - | - | - |",
        f"| lower bound (clairvoyant) | "
        f"{_mean_worst([o.bound_starvation_share for o in oracles], _pct)} | "
        f"{_mean_worst([o.bound_worker_hours for o in oracles], _hours)} | "
        f"{_mean_worst([ratio(o.bound_worker_hours, o.worker_hours) for o in oracles], _ratio)}"
        " | - | - | - | - | - |",
    ]
    for i, run in enumerate(report.runs):
        ms = [r.runs[i].metrics for r in reports]
        name = f"**{run.name}**" if run.name == DEO else run.name
        ratios = [ratio(m.worker_hours, h) for m, h in zip(ms, oracle_hours, strict=True)]
        rows.append(
            f"| {name} | {_mean_worst([m.starvation_share for m in ms], _pct)} | "
            f"{_mean_worst([m.worker_hours for m in ms], _hours)} | "
            f"{_mean_worst(ratios, _ratio)} | "
            f"{_mean_worst([m.mean_lag_steps for m in ms], _steps)} | "
            f"{_mean_worst([m.p95_lag_steps for m in ms], _steps)} | "
            f"{_mean_worst([float(m.scale_actions) for m in ms], lambda v: f'{v:.0f}')} | "
            f"{_mean_worst([m.reversals_per_hour for m in ms], lambda v: f'{v:.1f}')} | "
            f"{_mean_worst([float(m.groups_discarded) for m in ms], lambda v: f'{v:.0f}')} |"
        )
    return rows


def render_section(
    reports: Sequence[ScenarioReport],
    *,
    command: str,
    out_dir: Path,
    plots: Mapping[str, Path],  # by scenario file stem
    now: dt.datetime | None = None,
) -> str:
    """The markdown between the markers: the command, then per scenario its table, deo's checks
    and its plot (linked relative to ``out_dir``, where the document lives)."""
    now = now or dt.datetime.now(dt.UTC)
    met = sum(all(check.ok for check in check_every_seed(r)) for r in reports)
    seeds = max((len(r.every_seed) for r in reports), default=1)
    lines = [
        START_MARK,
        "## Controllers: deo against the published policies (`deo bench`)",
        "",
        f"- Command: `{command}`",
        f"- Date: {now:%Y-%m-%d %H:%M} UTC",
        f"- Scenarios: {len(reports)}; deo met every target on {met} of them.",
        "- Every policy runs in the simulator through the real reducer, the same seed for all."
        + (
            f" Each scenario runs under {seeds} seeds (its own and the next ones): every figure "
            "is the mean over the seeds and, in brackets, the worst seed's (for the oracle and "
            "the bound: the largest; the reversals column gives reversals per hour); a target "
            "is met only if it is met on every seed. The plot shows the first seed."
            if seeds > 1
            else ""
        ),
        "  Starvation: share of the non-paused time the trainer waited for a batch. "
        "Worker-hours: GPU-hours held (a CPU worker counts one an hour). Lag: trainer steps "
        "between a sequence being queued and trained on. Reversals: a scaling decision whose "
        "direction undoes the one before it, however long after.",
        "- Policies:",
    ]
    lines += [f"  - `{name}`: {note}" for name, note in _POLICY_NOTES.items()]
    lines += [
        f"- deo's targets, per scenario: starvation at most {AVOIDABLE_STARVATION:.0%} beyond "
        f"the reactive oracle's (over minutes it does not starve in, and over each stretch it "
        f"does as a whole); worker-hours at most "
        f"{WORKER_HOURS_X_ORACLE:g} x the reactive oracle's; mean lag at most "
        f"{MEAN_LAG_STEPS:g} steps; at most "
        f"{REVERSALS_PER_HOUR:g} reversals of direction per hour on jitter-only scenarios "
        "(nothing changes but the random latencies); against every baseline, never worse on both "
        "starvation and worker-hours: strictly better on at least one of them.",
    ]
    lines += _overview(reports)
    for report in reports:
        lines += ["", f"### {_title(report)}", ""]
        if report.description:
            lines += [report.description.strip(), ""]
        lines += [
            f"Scenario file `{report.path.name}`; baseline parameters from "
            f"{report.baseline_source}.",
            "",
            _HEADER,
            _RULE,
        ]
        if report.seeds:
            lines += _seeded_rows(report)
        else:
            lines += _single_rows(report)
        lines += ["", "| deo target | value | result |", "|---|---|---|"]
        for check in check_every_seed(report):
            lines.append(f"| {check.target} | {check.value} | {'met' if check.ok else 'MISSED'} |")
        plot = plots.get(report.path.stem)
        if plot is not None:
            lines += [
                "",
                f"![{report.name}: workers and trainer waiting]({_relative(plot, out_dir)})",
            ]
    lines.append(END_MARK)
    return "\n".join(lines) + "\n"


def _title(report: ScenarioReport) -> str:
    return report.name + (" (jitter-only)" if report.jitter_only else "")


def _anchor(title: str) -> str:
    """The fragment a markdown renderer (GitHub's) gives a heading."""
    kept = "".join(c for c in title.lower() if c.isalnum() or c in " -_")
    return kept.replace(" ", "-")


def _overview(reports: Sequence[ScenarioReport]) -> list[str]:
    """One row per scenario: deo's worst seed on each target's figure, and the targets it
    missed on some seed (the scenario's own section gives the mean and every check)."""
    lines = [
        "",
        "deo on every scenario, at its worst seed (each figure the worst of the seeds; a target "
        "is missed where any seed misses it):",
        "",
        "| scenario | avoidable starvation | worker-hours x oracle | mean lag (steps) | "
        "reversals per hour | targets missed |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for report in reports:
        runs = [(r.deo.metrics, r.oracle.worker_hours) for r in report.every_seed]
        ratios = [m.worker_hours / h if h > 0 else math.inf for m, h in runs]
        lags = [m.mean_lag_steps for m, _ in runs]
        lag = math.nan if any(math.isnan(v) for v in lags) else max(lags)
        missed = [c.short for c in check_every_seed(report) if not c.ok]
        title = _title(report)
        lines.append(
            f"| [{title}](#{_anchor(title)}) | "
            f"{_pct(max(m.avoidable_starvation_share for m, _ in runs))} | "
            f"{_ratio(max(ratios))} | {_steps(lag)} | "
            f"{max(m.reversals_per_hour for m, _ in runs):.1f} | {', '.join(missed) or 'none'} |"
        )
    return lines


def _single_rows(report: ScenarioReport) -> list[str]:
    """The table's rows for one seed."""
    oracle_run = report.oracle
    lines = [
        f"| oracle (reactive) | {_pct(oracle_run.unavoidable_starvation_share)} | "
        f"{oracle_run.worker_hours:.2f} | 1.00 | - | - | - | - | - |"
    ]
    bound_ratio = (
        f"{oracle_run.bound_worker_hours / oracle_run.worker_hours:.2f}"
        if oracle_run.worker_hours > 0
        else "n/a"
    )
    lines.append(
        f"| lower bound (clairvoyant) | {_pct(oracle_run.bound_starvation_share)} | "
        f"{oracle_run.bound_worker_hours:.2f} | {bound_ratio} | - | - | - | - | - |"
    )
    lines += [_run_row(run, oracle_run.worker_hours) for run in report.runs]
    return lines


def replace_section(
    text: str,
    section: str,
    *,
    where: str = "document",
    marks: tuple[str, str] = (START_MARK, END_MARK),
) -> str:
    """``text`` with the part between the markers (``marks``: deo bench's by default) replaced by
    ``section`` (markers included), or with ``section`` appended when it has no markers yet.
    Everything else is kept as is."""
    start_mark, end_mark = marks
    start, end = text.find(start_mark), text.find(end_mark)
    if start == -1 and end == -1:
        return (text.rstrip("\n") + "\n\n" if text.strip() else "") + section
    if start == -1 or end == -1 or end < start:
        raise BenchError(
            f"{where}: the markers {start_mark} and {end_mark} must both be present, in that "
            "order (fix or remove them)"
        )
    if text.count(start_mark) > 1 or text.count(end_mark) > 1:
        raise BenchError(f"{where}: the markers {start_mark} / {end_mark} appear more than once")
    rest = text[end + len(end_mark) :]
    return text[:start] + section + rest.removeprefix("\n")


def check_out(out: Path, marks: tuple[str, str] = (START_MARK, END_MARK)) -> None:
    """Check, before a bench runs, that its section (``marks``) of ``out`` can be written.

    Raises :class:`BenchError` naming ``out`` when it is a folder or a scenario, cannot be read
    or written, or its markers are broken.
    """
    if out.is_dir():
        raise BenchError(f"--out {out}: a folder; give the markdown file to write")
    if out.suffix == ".toml":
        raise BenchError(f"--out {out}: a .toml file (a scenario?); give a markdown file")
    _check_writable_folder(out.parent, f"--out {out}")
    replace_section(_read_out(out), "", where=f"--out {out}", marks=marks)


def check_plots_dir(plots_dir: Path) -> None:
    """Make ``plots_dir`` before a bench runs (:class:`BenchError` where it cannot be)."""
    if plots_dir.exists() and not plots_dir.is_dir():
        raise BenchError(f"--plots {plots_dir}: a file, not a folder")
    _check_writable_folder(plots_dir, f"--plots {plots_dir}")


def _check_writable_folder(folder: Path, where: str) -> None:
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise BenchError(f"{where}: cannot make its folder {folder}: {exc.strerror}") from None
    if not os.access(folder, os.W_OK | os.X_OK):
        raise BenchError(f"{where}: its folder {folder} is not writable")


def write_section(out: Path, section: str, marks: tuple[str, str] = (START_MARK, END_MARK)) -> None:
    """Put ``section`` between ``marks`` in ``out`` (appended when it has none yet), atomically."""
    updated = replace_section(_read_out(out), section, where=f"--out {out}", marks=marks)
    write_atomically(out, updated)


def _read_out(out: Path) -> str:
    try:
        return out.read_text(encoding="utf-8") if out.exists() else ""
    except (OSError, UnicodeDecodeError) as exc:
        raise BenchError(f"--out {out}: cannot read it ({exc})") from None


def write_atomically(path: Path, text: str) -> None:
    """Replace ``path``'s text at once (a link: the file it points to), keeping its mode."""
    path = path.resolve()
    path.parent.mkdir(parents=True, exist_ok=True)
    mode = stat.S_IMODE(path.stat().st_mode) if path.exists() else 0o644
    with tempfile.NamedTemporaryFile(
        "w", encoding="utf-8", dir=path.parent, prefix=f".{path.name}.", delete=False
    ) as tmp:
        tmp.write(text)
    os.chmod(tmp.name, mode)
    os.replace(tmp.name, path)


# --- plots ---------------------------------------------------------------------------------------


def _final_min(series: Series) -> float:
    return series.waited_s[-1] / 60 if series.waited_s else 0.0


def _waiting_scale_min(report: ScenarioReport) -> float:
    """The top of the waiting axis, in minutes: room for deo, the oracle and the median policy,
    so that one policy starving all run long does not flatten every other line."""
    finals = sorted(_final_min(run.series) for run in report.runs)
    median = finals[len(finals) // 2]
    return max(
        1.5 * _final_min(report.deo.series),
        1.5 * _final_min(report.oracle.series),
        1.2 * median,
        0.5,
    )


def plot_scenario(report: ScenarioReport, path: Path) -> None:
    """Producing workers (top: started, not draining, so start-ups show) and cumulative trainer
    waiting (bottom) over time, every policy against the reactive oracle (its workers held on
    top, its unavoidable waiting below); pauses shaded, faults marked. A policy whose waiting runs
    off the bottom axis says so in the legend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scale_min = _waiting_scale_min(report)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 7), sharex=True)
    try:
        for run in report.runs:
            minutes = [t / 60 for t in run.series.t_s]
            waited_min = [w / 60 for w in run.series.waited_s]
            width = 2.2 if run.name == DEO else 1.1
            label = run.name
            if waited_min and waited_min[-1] > scale_min:
                label += f" (waited {waited_min[-1]:.0f} min, off scale)"
            top.step(minutes, run.series.workers, where="post", linewidth=width, label=label)
            bottom.plot(minutes, waited_min, linewidth=width)
        oracle_series = report.oracle.series
        oracle_minutes = [t / 60 for t in oracle_series.t_s]
        top.step(
            oracle_minutes,
            oracle_series.workers,
            where="post",
            label="reactive oracle: workers held",
            color="black",
            linestyle="--",
            linewidth=1.2,
        )
        bottom.plot(
            oracle_minutes,
            [w / 60 for w in oracle_series.waited_s],
            label="reactive oracle: unavoidable waiting",
            color="black",
            linestyle=":",
            linewidth=1.4,
        )
        bottom.legend(loc="upper left", fontsize="small")
        for start, end in report.pauses:
            for axes in (top, bottom):
                axes.axvspan(start / 60, end / 60, color="orange", alpha=0.15, linewidth=0)
        for at, what in report.faults:
            for axes in (top, bottom):
                axes.axvline(at / 60, color="red", linewidth=0.8, alpha=0.7)
            top.annotate(
                what,
                (at / 60, 0.02),
                xycoords=("data", "axes fraction"),
                rotation=90,
                fontsize=7,
                color="red",
                va="bottom",
                ha="right",
            )
        top.set_ylabel("producing workers")
        top.set_title(f"{report.name}: workers and trainer waiting")
        # One legend beside the plots, for both: the lines stay visible where policies overlap.
        top.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
        bottom.set_ylim(0, scale_min)
        bottom.set_ylabel("trainer waited (min, cumulative)")
        bottom.set_xlabel("time (min; orange: trainer paused, red: faults)")
        for axes in (top, bottom):
            axes.grid(True, alpha=0.3)
        fig.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=90)
    finally:
        plt.close(fig)


# --- the whole run -------------------------------------------------------------------------------


def _load_all(paths: Iterable[Path]) -> list[tuple[Path, Scenario]]:
    loaded = []
    for path in paths:
        try:
            # With the baselines: a scenario may name one as its pools' policy.
            loaded.append((path, load_scenario(path, policies=CATALOG)))
        except ScenarioError as exc:
            message = str(exc)
            raise BenchError(
                message if message.startswith(str(path)) else f"{path}: {message}"
            ) from None
    return loaded


def run_bench(
    scenarios_dir: Path,
    *,
    only: Sequence[str] = (),
    out: Path,
    plots_dir: Path,
    command: str,
    progress: Callable[[str], None] = print,
    seeds: int = 1,
) -> list[ScenarioReport]:
    """Run every scenario of ``scenarios_dir`` (or those in ``only``) under ``seeds`` seeds (the
    scenario's own and the next ones), write the section of ``out`` and one PNG per scenario
    (its first seed) into ``plots_dir``; the reports (each holding its other seeds').

    Everything that can be wrong with the input (the directory, the names, a scenario file, the
    markers of ``out``) is checked before anything runs, and raises :class:`BenchError`.
    """
    if seeds < 1:
        raise BenchError(f"--seeds {seeds}: at least 1")
    scenarios = _load_all(find_scenarios(scenarios_dir, only))
    check_out(out)
    check_plots_dir(plots_dir)
    reports = []
    plots: dict[str, Path] = {}
    for i, (path, scenario) in enumerate(scenarios, 1):
        progress(f"[{i}/{len(scenarios)}] {scenario.name} ({path.name})")
        report = run_seeds(path, scenario, seeds, progress=progress)
        reports.append(report)
        plot_path = plots_dir / f"{path.stem}.png"
        plot_scenario(report, plot_path)
        plots[path.stem] = plot_path
        missed = [c.target for c in check_every_seed(report) if not c.ok]
        progress(
            f"{scenario.name}: deo met every target" + (" on every seed" if seeds > 1 else "")
            if not missed
            else f"{scenario.name}: deo missed {len(missed)}: {'; '.join(missed)}"
        )
    section = render_section(reports, command=command, out_dir=out.parent, plots=plots)
    write_section(out, section)
    progress(f"wrote {out} and {len(plots)} plot(s) in {plots_dir}")
    return reports
