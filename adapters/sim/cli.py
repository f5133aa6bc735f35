"""``deo simulate FILE``: run one scenario in the simulator and print its metrics.

The scenario's trainer, env pools and faults run in simulated time against deo's real core; the
table compares the run with the clairvoyant oracle (docs/scenarios.md). ``--set KEY=VALUE``
changes the scenario (``--set trainer.step_s=2 --set pools.envs.policy.target_batches=2``),
``--policy NAME`` gives every pool that policy, ``--plot`` draws the run, ``--log`` writes the
event log that ``deo replay`` verifies.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from adapters.outputs import OutputRefused
from adapters.sim.driver import simulate
from adapters.sim.metrics import SimResult
from adapters.sim.scenario import load_scenario
from core import ConfigError

__all__ = ["add_arguments", "format_result", "main"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare the command's arguments on ``parser``."""
    parser.add_argument("scenario", type=Path, metavar="FILE", help="a scenario TOML file")
    parser.add_argument(
        "--policy",
        metavar="NAME",
        help="give every pool this policy with its default parameters (set them with --set "
        "pools.NAME.policy.PARAM=VALUE); default: the scenario's",
    )
    parser.add_argument(
        "--set",
        dest="settings",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="change a scenario key; the value is a TOML literal (repeatable)",
    )
    parser.add_argument("--plot", type=Path, metavar="PNG", help="draw the run into this file")
    parser.add_argument("--log", type=Path, metavar="JSONL", help="write the event log here")


def _percent(share: float) -> str:
    return f"{share:.1%}"


def format_result(result: SimResult, duration_s: float) -> str:
    """The metrics table ``deo simulate`` prints."""
    m = result.metrics
    ratio = m.worker_hours_ratio
    rows = [
        (
            "trainer starvation",
            _percent(m.starvation_share),
            _percent(m.unavoidable_starvation_share),
        ),
        ("  outside unavoidable", _percent(m.avoidable_starvation_share), ""),
        ("GPU-hours", f"{m.worker_hours:.2f}", f"{m.oracle_worker_hours:.2f}"),
        ("  ratio to oracle", f"{ratio:.2f}x", ""),
        ("mean lag (steps)", f"{m.mean_lag_steps:.2f}", ""),
        ("p95 lag (steps)", f"{m.p95_lag_steps:g}", ""),
        ("trainer steps", str(m.steps), ""),
        ("scale actions", str(m.scale_actions), ""),
        ("flaps", str(m.flaps), ""),
        ("  reversals per hour", f"{m.reversals_per_hour:.1f}", ""),
        ("peak workers", str(m.peak_workers), ""),
        ("groups lost", str(m.groups_lost), ""),
        ("groups discarded (off-policy)", str(m.groups_discarded), ""),
    ]
    head = f"scenario {result.scenario}, policy {result.policy}, {duration_s:g}s simulated"
    width = max(len(r[0]) for r in rows)
    lines = [head, f"{'':{width}}  {result.policy:>10}  {'oracle':>10}"]
    lines += [f"{name:{width}}  {ours:>10}  {theirs:>10}".rstrip() for name, ours, theirs in rows]
    return "\n".join(lines)


#: The formats ``--plot`` writes, by the file's suffix.
PLOT_SUFFIXES = (".png", ".svg", ".pdf")


def plot_path_problem(path: Path) -> str | None:
    """Why ``--plot PATH`` cannot be written (None: it can), told before the run."""
    if path.is_dir():
        return "is a folder: give the plot a file name"
    if not path.parent.is_dir():
        return f"no such folder ({path.parent})"
    if path.suffix.lower() not in PLOT_SUFFIXES:
        return f"the file name must end in {', '.join(PLOT_SUFFIXES)}"
    return None


def _same(a: Path, b: Path) -> bool:
    return a.resolve() == b.resolve()


def main(args: argparse.Namespace) -> int:
    """Run the command; returns the exit status (2: bad file, setting or policy)."""
    if args.plot is not None and (problem := plot_path_problem(args.plot)) is not None:
        print(f"deo simulate: --plot {args.plot}: {problem}", file=sys.stderr)
        return 2
    if args.plot is not None and args.log is not None and _same(args.plot, args.log):
        print(
            f"deo simulate: --plot and --log both name {args.log}: give two files",
            file=sys.stderr,
        )
        return 2
    overrides: dict[str, str] = {}
    for setting in args.settings:
        key, sep, value = setting.partition("=")
        if not sep or not key:
            print(f"deo simulate: --set {setting!r}: expected KEY=VALUE", file=sys.stderr)
            return 2
        overrides[key.strip()] = value.strip()
    if args.policy is not None and not args.policy.strip():
        print("deo simulate: --policy: empty; give a policy's name (e.g. buffer)", file=sys.stderr)
        return 2
    try:
        if args.policy:
            # Every pool's policy table replaced before --set, which may then set its parameters.
            pools = load_scenario(args.scenario).pools
            policy = {
                f"pools.{p.name}.policy": f"{{ name = {json.dumps(args.policy)} }}" for p in pools
            }
            overrides = {**policy, **overrides}
        scenario = load_scenario(args.scenario, overrides)
        result = simulate(scenario, log_path=args.log)
    except ConfigError as exc:
        print(f"deo simulate: {exc}", file=sys.stderr)
        return 2
    except OutputRefused as exc:
        print(f"deo simulate: --log {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        where = f" ({exc.filename})" if exc.filename else ""
        print(f"deo simulate: --log {args.log}: {exc.strerror or exc}{where}", file=sys.stderr)
        return 2
    print(format_result(result, scenario.duration_s))
    if args.log is not None:
        print(f"log: {args.log} (verify it with: deo replay {args.log})")
    if args.plot is not None:
        from adapters.sim.plot import plot

        try:
            plot(result, scenario, args.plot)
        except OSError as exc:
            print(f"deo simulate: --plot {args.plot}: {exc.strerror}", file=sys.stderr)
            return 2
        print(f"plot: {args.plot}")
    return 0
