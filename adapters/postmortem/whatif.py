"""``deo replay LOG --what-if KEY=VALUE``: the recorded run, replayed closed loop under a change.

Open-loop ``--set`` feeds the recorded inputs to other decisions; the world never answers them.
Here the world answers: a scenario is fitted to the log (:mod:`adapters.postmortem.fit`), run in
the simulator under the recorded configuration and under the changed one, several seeds each, and
both are set beside what the log shows happened. With ``--fitted-out FILE`` the fitted scenario is
written as a scenario file that ``deo simulate`` and ``deo bench`` run; otherwise replay writes
nothing.

The fit error printed (recorded against fitted-under-the-recorded-configuration) says how far to
trust the comparison: the change's effect is the difference between the two simulated columns.
"""

from __future__ import annotations

import statistics
import tempfile
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

import attrs

from adapters.postmortem.fit import (
    FitError,
    Fitted,
    Observed,
    calibrated,
    fit_scenario,
    observe,
    read_run,
    scenario_toml,
)
from adapters.sim.driver import simulate
from adapters.sim.metrics import Metrics
from adapters.sim.scenario import EnvPool, Scenario, ScenarioError, parse_override
from bench.baselines import CATALOG, baseline_specs
from core import ConfigError, DeoError, PolicySpec
from core.config import AUTO

__all__ = ["Change", "FitError", "WhatIfError", "parse_changes", "run_what_if"]

#: Pool settings a --what-if may change (deo's own, per pool), besides the policy.
POOL_KEYS = (
    "min_workers",
    "max_workers",
    "stabilization_s",
    "drain_timeout_s",
    "metrics_stale_s",
    "start_timeout_s",
    "require_ready",
)
#: The type each pool setting takes, for a clear message when a --what-if gives another.
POOL_TYPES: dict[str, tuple[str, tuple[type, ...]]] = {
    "min_workers": ("a whole number", (int,)),
    "max_workers": ("a whole number", (int,)),
    "stabilization_s": ("a number of seconds", (int, float)),
    "drain_timeout_s": ('a number of seconds or "auto"', (int, float, str)),
    "metrics_stale_s": ("a number of seconds", (int, float)),
    "start_timeout_s": ("a number of seconds", (int, float)),
    "require_ready": ("true or false", (bool,)),
}
#: Fit error, as a share of the recorded figure, within which the fit counts as reproducing it;
#: for starvation (compared in points) the allowance is at least STARVATION_FLOOR of time.
FIT_TOLERANCE = 0.10
STARVATION_FLOOR = 0.005
#: Columns the printed text keeps within (a path may run over).
WIDTH = 100


class WhatIfError(DeoError, ValueError):
    """A --what-if that cannot be run; the message names what was wrong."""


@attrs.frozen(slots=True, kw_only=True)
class Change:
    """What a --what-if changes: the policy (None: the recorded one), its parameters, and
    pool settings."""

    policy: str | None = None
    params: dict[str, Any] = attrs.field(factory=dict)
    pool: dict[str, Any] = attrs.field(factory=dict)
    text: tuple[str, ...] = ()


def _policy_names() -> str:
    baselines = baseline_specs(group_size=1, groups_in_flight=1, max_workers=1)
    names = sorted(set(CATALOG.policies) | set(baselines))
    return ", ".join(names)


def parse_changes(items: Sequence[str]) -> Change:
    """``["policy=hpa", "max_workers=16", "policy.target_per_worker=3"]`` -> a :class:`Change`.

    Keys: ``policy`` (a policy or a ``deo bench`` baseline by name), ``policy.PARAM``, a
    parameter of the policy by its bare name, or a pool setting (:data:`POOL_KEYS`).
    :class:`WhatIfError` names the item that is wrong.
    """
    policy: str | None = None
    raw_params: dict[str, Any] = {}
    bare: dict[str, Any] = {}
    pool: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key or not raw:
            raise WhatIfError(
                f"--what-if {item!r}: expected KEY=VALUE, e.g. policy=hpa or max_workers=16"
            )
        value = parse_override(raw)
        if key == "policy":
            if not isinstance(value, str):
                raise WhatIfError(f"--what-if {item!r}: a policy is named by a string")
            baselines = baseline_specs(group_size=1, groups_in_flight=1, max_workers=1)
            if value not in CATALOG.policies and value not in baselines:
                raise WhatIfError(
                    f"--what-if {item!r}: unknown policy {value!r} (policies: {_policy_names()})"
                )
            policy = value
        elif key.startswith("policy."):
            raw_params[key.removeprefix("policy.")] = value
        elif key in POOL_KEYS:
            expected, types = POOL_TYPES[key]
            is_bool = isinstance(value, bool)
            wrong_text = isinstance(value, str) and value != AUTO
            if not isinstance(value, types) or (is_bool and bool not in types) or wrong_text:
                raise WhatIfError(f"--what-if {item!r}: {key} takes {expected}, not {raw!r}")
            pool[key] = value
        else:
            bare[key] = value
    # A bare key names a parameter of the policy, known only once the log is read: marked "?".
    params = {**{f"?{key}": value for key, value in bare.items()}, **raw_params}
    return Change(policy=policy, params=params, pool=pool, text=tuple(items))


def _apply(change: Change, scenario: Scenario) -> Scenario:
    """``scenario`` with ``change`` made to its pool; :class:`WhatIfError` if it does not fit."""
    pool = scenario.pools[0]
    overrides: dict[str, Any] = {}
    if change.policy is None:
        spec = pool.policy
    else:
        baselines = baseline_specs(
            group_size=pool.group_size,
            groups_in_flight=pool.groups_in_flight,
            max_workers=_whole(change.pool.get("max_workers", pool.max_workers)),
        )
        if change.policy in baselines:
            spec, overrides = baselines[change.policy]
        else:
            spec = PolicySpec(name=change.policy)
    cls = CATALOG.policies.get(spec.name)
    known = {field.name for field in attrs.fields(cls)} if cls is not None else set()
    params = dict(spec.params)
    for key, value in change.params.items():
        name = key.removeprefix("?")
        if name not in known:
            where = "" if key.startswith("?") else "policy."
            raise WhatIfError(
                f"--what-if {where}{name}: not a parameter of policy {spec.name!r} nor a pool "
                f"setting (parameters: {', '.join(sorted(known)) or 'none'}; pool settings: "
                f"{', '.join(POOL_KEYS)})"
            )
        params[name] = value
    values = {**overrides, **change.pool}
    try:
        spec = PolicySpec(name=spec.name, params=params)
        changed = attrs.evolve(pool, policy=spec, **values)
        CATALOG.build(changed.world_params(changed.policy, CATALOG))
        changed.pool_spec(policies=CATALOG)
    except (ConfigError, TypeError, ValueError) as exc:
        raise WhatIfError(f"--what-if {' '.join(change.text)}: {exc}") from None
    return attrs.evolve(scenario, pools=(changed,))


def _whole(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise WhatIfError(f"--what-if max_workers={value!r}: expected a whole number >= 1")
    return value


def describe_policy(pool: EnvPool) -> str:
    """``buffer`` or ``hpa (target_per_worker=3.2)``: the policy a pool runs."""
    params = ", ".join(
        f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in pool.policy.params.items()
    )
    return pool.policy.name + (f" ({params})" if params else "")


@attrs.frozen(slots=True, kw_only=True)
class Column:
    """One simulated configuration over several seeds: log readings and exact figures."""

    observed: tuple[Observed, ...]
    metrics: tuple[Metrics, ...]

    def mean(self, key: str) -> float:
        return statistics.fmean(getattr(o, key) for o in self.observed)

    def exact(self, key: str) -> float:
        return statistics.fmean(getattr(m, key) for m in self.metrics)

    def spread(self, key: str) -> tuple[float, float]:
        """The least and greatest exact figure over the seeds."""
        values = [getattr(m, key) for m in self.metrics]
        return min(values), max(values)


def _run(scenario: Scenario, seeds: int) -> Column:
    observed, metrics = [], []
    with tempfile.TemporaryDirectory(prefix="deo-what-if-") as tmp:
        for seed in range(1, seeds + 1):
            log = Path(tmp) / f"seed{seed}.jsonl"
            result = simulate(attrs.evolve(scenario, seed=seed), log_path=log, policies=CATALOG)
            observed.append(observe(read_run(log)))
            metrics.append(result.metrics)
    return Column(observed=tuple(observed), metrics=tuple(metrics))


def fit_error(recorded: float, fitted: float) -> float:
    """(fitted - recorded) / recorded; 0 when both are 0, infinity when only recorded is."""
    if recorded == 0:
        return 0.0 if fitted == 0 else float("inf")
    return (fitted - recorded) / recorded


def run_what_if(
    path: Path,
    items: Sequence[str],
    *,
    seeds: int,
    fitted_out: Path | None,
    out: TextIO,
) -> int:
    """Fit, simulate and print; returns the exit status (``WhatIfError``/``FitError`` raise)."""
    change = parse_changes(items)
    if seeds < 1:
        raise WhatIfError(f"--what-if-seeds {seeds}: at least 1")
    facts = read_run(path)
    try:
        fitted = fit_scenario(facts, f"{path.stem}-fitted", CATALOG, calibrate=False)
    except ScenarioError as exc:  # a run larger than one simulation takes
        raise FitError(f"{path}: the run cannot be simulated: {exc}") from None
    _apply(change, fitted.scenario)  # a change that does not apply fails before the simulations
    fitted = calibrated(facts, fitted, CATALOG)
    changed = _apply(change, fitted.scenario)
    if fitted_out is not None:
        _write_scenario(fitted, fitted_out, path)
    print(
        f"what if {' '.join(change.text)}: {path} ({facts.duration_s:.0f} s, "
        f"{len(facts.queue)} queue samples, {len(facts.workers)} workers)\n"
        f"  fitted to a scenario, run in the simulator closed loop "
        f"({seeds} seed{'s' if seeds > 1 else ''} each)",
        file=out,
    )
    print("fitted from the log:", file=out)
    for note in fitted.notes:
        print(textwrap.fill(note, WIDTH, initial_indent="  - ", subsequent_indent="    "), file=out)
    if fitted_out is not None:
        print(f"wrote the fitted scenario to {fitted_out}", file=out)
        print(f"  (rerun it: deo simulate {fitted_out})", file=out)
    recorded_column = _run(fitted.scenario, seeds)
    changed_column = _run(changed, seeds)
    _table(fitted, recorded_column, changed_column, changed, out)
    return 2 if facts.problems else 0


def _write_scenario(fitted: Fitted, target: Path, log: Path) -> None:
    text = scenario_toml(
        fitted.scenario,
        header=(
            f"Fitted to {log.name} by `deo replay --what-if`: the recorded configuration,",
            "trainer, workers and faults as far as the log shows them.",
        ),
    )
    try:
        target.write_text(text, encoding="utf-8")
    except OSError as exc:
        raise WhatIfError(f"cannot write the fitted scenario to {target}: {exc.strerror}") from None


def _pct(share: float) -> str:
    return f"{share * 100:.2f}%"


def _table(
    fitted: Fitted, recorded: Column, changed: Column, changed_scenario: Scenario, out: TextIO
) -> None:
    then = fitted.observed
    headers = ("", "recorded", "fitted, recorded config", "fitted, what-if")
    rows: list[tuple[str, str, str, str]] = [
        (
            "trainer starvation, log read",
            _pct(then.starvation_share),
            _pct(recorded.mean("starvation_share")),
            _pct(changed.mean("starvation_share")),
        ),
        (
            "  simulator's exact count",
            "",
            _pct(recorded.exact("starvation_share")),
            _pct(changed.exact("starvation_share")),
        ),
        (
            "worker-hours (GPU-hours)",
            f"{then.worker_hours:.2f}",
            f"{recorded.exact('worker_hours'):.2f}",
            f"{changed.exact('worker_hours'):.2f}",
        ),
        (
            "mean queue, batches",
            f"{then.mean_queue_batches:.2f}",
            f"{recorded.mean('mean_queue_batches'):.2f}",
            f"{changed.mean('mean_queue_batches'):.2f}",
        ),
        (
            "  mean lag, trainer steps",
            "",
            f"{recorded.exact('mean_lag_steps'):.2f}",
            f"{changed.exact('mean_lag_steps'):.2f}",
        ),
        (
            "scale actions (reversals)",
            f"{then.scale_actions} ({then.reversals})",
            f"{recorded.mean('scale_actions'):.0f} ({recorded.mean('reversals'):.0f})",
            f"{changed.mean('scale_actions'):.0f} ({changed.mean('reversals'):.0f})",
        ),
        (
            "crashes",
            f"{then.crashes}",
            f"{recorded.mean('crashes'):.0f}",
            f"{changed.mean('crashes'):.0f}",
        ),
    ]
    widths = [max(len(r[i]) for r in (headers, *rows)) for i in range(4)]
    for row in (headers, *rows):
        line = "  " + "  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row))
        print(line.rstrip(), file=out)
    for label, pool in (
        ("recorded", fitted.scenario.pools[0]),
        ("what-if", changed_scenario.pools[0]),
    ):
        policy = f"  {label} policy:".ljust(19) + describe_policy(pool)
        print(textwrap.fill(policy, WIDTH, subsequent_indent=" " * 19), file=out)
    print(
        "  (log read: measured from event logs the same way for the recorded run and the\n"
        "  simulated ones, so those columns compare; the indented rows are the simulator's own\n"
        "  exact figures; simulated figures are means over the seeds)",
        file=out,
    )
    # The fit: the same log reading on both sides. Starvation in points: a relative error on a
    # share near 0 says nothing.
    points = recorded.mean("starvation_share") - then.starvation_share
    allowed = max(STARVATION_FLOOR, FIT_TOLERANCE * then.starvation_share)
    hours = fit_error(then.worker_hours, recorded.mean("worker_hours"))
    ok = abs(points) <= allowed and abs(hours) <= FIT_TOLERANCE
    print(
        f"fit error (fitted under the recorded configuration against the recorded run):\n"
        f"  starvation {points * 100:+.2f} points (allowed {allowed * 100:.2f}), worker-hours "
        f"{_signed(hours)} (allowed {FIT_TOLERANCE:.0%}): {'within' if ok else 'NOT within'}",
        file=out,
    )
    # The change: the simulator's exact figures on both sides (a log reading can hide
    # starvation where the trainer was never seen fed).
    low, high = changed.spread("starvation_share")
    delta_s = changed.exact("starvation_share") - recorded.exact("starvation_share")
    delta_h = fit_error(recorded.exact("worker_hours"), changed.exact("worker_hours"))
    change = (
        f"the change: starvation {delta_s * 100:+.2f} points (seeds {_pct(low)} to "
        f"{_pct(high)}), worker-hours {_signed(delta_h)}: the simulator's exact figures, against "
        f"the fitted run under the recorded configuration"
    )
    if not ok:
        change += (
            ". The fit does not reproduce the recorded run closely: read the change's direction, "
            "not its size"
        )
    print(textwrap.fill(change, WIDTH, subsequent_indent="  "), file=out)


def _signed(share: float) -> str:
    if share == float("inf"):
        return "+inf%"
    return f"{share * 100:+.1f}%"
