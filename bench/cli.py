"""``deo bench``: every shipped scenario under deo and every published baseline, side by side.

Runs each scenario of ``--scenarios`` (default ``bench/scenarios``) under ``--seeds`` seeds
(default 3: tables give the mean and the worst seed, targets must hold on every seed), under
deo's default policy, the baselines (the Atropos DEO proposal, Ray Serve, verl, the Kubernetes
HPA, a static pool), the reactive oracle and the lower bound; prints one line per scenario and
policy; writes its section of ``--out`` (between ``<!-- deo_bench:start -->`` and
``<!-- deo_bench:end -->``, the rest of the file untouched) and one PNG per scenario into
``--plots``.

Exit status: 0 when the report was written, whether or not deo met its targets (the report says
which it missed); 2 on bad input (a missing scenarios directory, an unknown ``--only`` name, an
invalid scenario file, broken markers in ``--out``).

``deo bench soak`` runs the soak benchmark instead (:mod:`bench.soak`): a real ``deo run`` under
churn, its memory, descriptors, CPU and log growth. ``deo bench engines`` simulates an engine pool
under verl's scheduler and under deo (:mod:`adapters.sim.engines`).
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from adapters.sim import engines as engine_sim
from bench import harness, soak

__all__ = ["HELP", "add_arguments", "main"]

HELP = "run every scenario under every policy; write docs/benchmarks.md"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare the command's arguments on ``parser``."""
    kinds = parser.add_subparsers(dest="bench", metavar="BENCHMARK")
    soak.add_arguments(
        kinds.add_parser(
            "soak",
            help=soak.HELP,
            description=soak.HELP + " (see bench/soak.py)",
        )
    )
    engine_sim.add_arguments(
        kinds.add_parser(
            "engines",
            help=engine_sim.HELP,
            description=engine_sim.HELP + " (see adapters/sim/engines.py)",
        )
    )
    # The scenario benchmark's options default to None, so that one given before `soak` or
    # `engines` (which it would not reach) is told apart from one not given.
    parser.add_argument(
        "--scenarios",
        type=Path,
        metavar="DIR",
        help="directory of scenario files (*.toml); default: bench/scenarios",
    )
    parser.add_argument(
        "--only",
        nargs="+",
        metavar="NAME",
        help="run only these scenarios (file names without .toml)",
    )
    parser.add_argument(
        "--out",
        dest="bench_out",
        type=Path,
        metavar="FILE",
        help="markdown file whose deo_bench section is rewritten; default: docs/benchmarks.md",
    )
    parser.add_argument(
        "--seeds",
        type=_seeds,
        metavar="N",
        help=f"run every scenario under N seeds (its own and the next ones); tables give the "
        f"mean and the worst, targets are judged on every seed; default {DEFAULT_SEEDS}",
    )
    parser.add_argument(
        "--plots",
        type=Path,
        metavar="DIR",
        help="directory for one PNG per scenario; default: docs/bench",
    )


#: Seeds per scenario unless --seeds says otherwise.
DEFAULT_SEEDS = 3


def _seeds(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"at least 1, got {value}")
    return value


def _shown(path: Path) -> str:
    """``path`` as the command line would name it: relative to the repository when inside it."""
    resolved = path.resolve()
    try:
        return resolved.relative_to(harness.ROOT).as_posix()
    except ValueError:
        return str(path)


#: The scenario benchmark's options: (flag, dest, default).
_SCENARIO_OPTIONS: tuple[tuple[str, str, object], ...] = (
    ("--scenarios", "scenarios", harness.DEFAULT_SCENARIOS),
    ("--only", "only", []),
    ("--out", "bench_out", harness.DEFAULT_OUT),
    ("--seeds", "seeds", DEFAULT_SEEDS),
    ("--plots", "plots", harness.DEFAULT_PLOTS),
)


def command_line(args: argparse.Namespace) -> str:
    """The ``deo bench`` invocation ``args`` stand for, with the defaults left out."""
    words = ["deo", "bench"]
    for flag, value, default in (
        ("--scenarios", args.scenarios, harness.DEFAULT_SCENARIOS),
        ("--out", args.bench_out, harness.DEFAULT_OUT),
        ("--plots", args.plots, harness.DEFAULT_PLOTS),
    ):
        if value is not None and Path(value).resolve() != default.resolve():
            words += [flag, _shown(Path(value))]
    if args.seeds not in (None, DEFAULT_SEEDS):
        words += ["--seeds", str(args.seeds)]
    if args.only:
        words += ["--only", *args.only]
    return shlex.join(words)


def main(args: argparse.Namespace) -> int:
    """Run the command; returns the exit status."""
    if args.bench is not None:
        given = [flag for flag, dest, _ in _SCENARIO_OPTIONS if getattr(args, dest, None)]
        if given:
            print(
                f"deo bench {args.bench}: {', '.join(given)}: "
                f"{'an option' if len(given) == 1 else 'options'} of the scenario benchmark "
                f"(`deo bench` alone), not of `deo bench {args.bench}`; see "
                f"`deo bench {args.bench} --help`",
                file=sys.stderr,
            )
            return 2
    if args.bench == "soak":
        return soak.run(args, ["deo", "bench", "soak"])
    if args.bench == "engines":
        return engine_sim.run(args)
    for _, dest, default in _SCENARIO_OPTIONS:
        if getattr(args, dest, None) is None:
            setattr(args, dest, default)

    def progress(line: str) -> None:
        print(line, flush=True)

    try:
        harness.run_bench(
            args.scenarios,
            only=args.only,
            out=args.bench_out,
            plots_dir=args.plots,
            command=command_line(args),
            progress=progress,
            seeds=args.seeds,
        )
    except harness.BenchError as exc:
        print(f"deo bench: error: {exc}", file=sys.stderr)
        return 2
    return 0
