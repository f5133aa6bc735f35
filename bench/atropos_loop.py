"""deo against a static pool in a real Atropos loop: the trainer's measured wait and worker-seconds.

Run from the repository root::

    .venv/bin/python bench/atropos_loop.py                 # 2 runs each, 180 s (about 12 minutes)
    .venv/bin/python bench/atropos_loop.py --runs 1 --duration-s 60

Each run is ``deo demo``'s loop, all real processes on loopback: atroposlib's trajectory API
server, a trainer that pulls batches of 32 and counts the seconds it waits for one, and env
workers that make groups of 8 sequences in about a second, one at a time (8 seq/s each), started
and drained by deo. The trainer's step time goes 0.5 s -> 3 s -> 0.3 s over three equal phases
(64 -> 11 -> 107 seq/s: about 8, 2 and 13 workers), the pool may hold 12. Runs alternate between
deo's default policy (``buffer``, with the demo's shortened time constants) and a static pool of
12, so both share the machine's state.

Each run's figures: the trainer's wait after its first batch, as a share of its time from then
(its own count), and the worker-seconds deo's event log gives (each worker from its spawn to its
exit). It prints them and writes a table to ``docs/benchmarks.md`` between the
``<!-- atropos_loop:start -->`` and ``<!-- atropos_loop:end -->`` markers. Exit status: 0 when
written, 2 on bad input, 1 when a run failed (its output says why).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from adapters.demo.loop import DemoOutcome, DemoSettings, measure_demo
from bench.harness import DEFAULT_OUT, BenchError, check_out, write_section

START_MARK = "<!-- atropos_loop:start -->"
END_MARK = "<!-- atropos_loop:end -->"
MARKS = (START_MARK, END_MARK)
POLICIES = ("buffer", "static")


def settings(policy: str, duration_s: float) -> DemoSettings:
    """The loop each run drives (the module docstring says what it is)."""
    return DemoSettings(
        duration_s=duration_s,
        step_s=(0.5, 3.0, 0.3),
        group_latency_s=1.0,
        groups_in_flight=1,
        max_workers=12,
        progress_every_s=10.0,
        policy=policy,
    )


def _share(outcome: DemoOutcome) -> float:
    return outcome.waited_s / outcome.busy_s if outcome.busy_s > 0 else 0.0


def render(outcomes: dict[str, list[DemoOutcome]], command: str, duration_s: float) -> str:
    """The section between the markers: one row per policy, mean and range over its runs."""
    lines = [
        START_MARK,
        "## A real Atropos loop: deo against a static pool (`bench/atropos_loop.py`)",
        "",
        f"- Command: `{command}`",
        f"- Each run: `deo demo`'s loop for {duration_s:g} s, real processes (atroposlib's API "
        "server, a trainer, env workers making groups of 8 in about a second, one at a time), "
        "the trainer's step time 0.5 s -> 3 s -> 0.3 s in three equal phases (about 8, 2 and 13 "
        "workers' worth), at most 12 workers; deo's `buffer` policy with the demo's shortened "
        "time constants against a static pool of 12, runs alternating.",
        "- Waited: the trainer's own count of the seconds it waited for a batch after its first, "
        "as a share of its time from then. Worker-seconds: from deo's event log, each worker from "
        "its spawn to its exit. Mean over the runs, and in brackets the range.",
        "",
        "| policy | runs | trainer waited | worker-seconds | scaling decisions | logs replay |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for policy in POLICIES:
        runs = outcomes.get(policy, [])
        if not runs:
            continue
        shares = [_share(o) for o in runs]
        worker_s = [o.worker_s for o in runs]
        lines.append(
            f"| {policy} | {len(runs)} | {statistics.fmean(shares):.1%} "
            f"({min(shares):.1%}-{max(shares):.1%}) | {statistics.fmean(worker_s):.0f} "
            f"({min(worker_s):.0f}-{max(worker_s):.0f}) | "
            f"{statistics.fmean(o.decisions for o in runs):.0f} | "
            f"{'yes' if all(o.replays for o in runs) else 'NO'} |"
        )
    lines.append(END_MARK)
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--runs", type=int, default=2, help="runs per policy (default 2)")
    parser.add_argument(
        "--duration-s", type=float, default=180.0, help="seconds each run's trainer runs"
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    try:
        for policy in POLICIES:
            settings(policy, args.duration_s)
        check_out(args.out, MARKS)
    except (BenchError, ValueError) as exc:
        print(f"atropos_loop: {exc}", file=sys.stderr)
        return 2
    outcomes: dict[str, list[DemoOutcome]] = {policy: [] for policy in POLICIES}
    with tempfile.TemporaryDirectory(prefix="deo-atropos-loop-") as scratch:
        for run in range(args.runs):
            for policy in POLICIES:
                log = Path(scratch) / f"{policy}-{run}.jsonl"
                said: list[str] = []
                status, outcome = measure_demo(log, settings(policy, args.duration_s), said.append)
                if outcome is None or status != 0:
                    print("\n".join(said))
                    print(f"atropos_loop: the {policy} run {run + 1} failed (status {status})")
                    return 1
                outcomes[policy].append(outcome)
                print(
                    f"[{policy} {run + 1}/{args.runs}] waited {_share(outcome):.1%} of "
                    f"{outcome.busy_s:.0f}s, {outcome.worker_s:.0f} worker-seconds, "
                    f"{outcome.decisions} decisions",
                    flush=True,
                )
    given = sys.argv[1:] if argv is None else list(argv)
    section = render(outcomes, " ".join(["python bench/atropos_loop.py", *given]), args.duration_s)
    print(section)
    write_section(args.out, section, MARKS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
