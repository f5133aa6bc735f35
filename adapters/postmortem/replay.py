"""``deo replay``: verify a log, print its timeline, and answer postmortem questions.

Exit status: 0 when every recorded command came out again; 1 on the first divergence (shown with
both sides); 2 when the log has unreadable lines (or events the reducer refuses that the log
records no refusal for) or cannot be opened (what could be read is still replayed and reported),
and on bad input (options that ask different questions, a time or a command the log has not).
"""

from __future__ import annotations

import argparse
import math
import sqlite3
import sys
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

import orjson

from adapters.describe import at, command_line, event_line, event_subject, pool_summary, state_lines
from adapters.log import LogProblem, log_header
from adapters.outputs import is_fitted_scenario, is_sqlite_database, output_problem
from adapters.postmortem.engine import (
    ConfigChange,
    Replayed,
    apply_settings,
    parse_setting,
    replay,
)
from adapters.postmortem.sqlite import export_sqlite
from core import Configured, DeoError, Event, encode
from core.lifecycle import COUNTED

__all__ = ["add_arguments", "run"]

#: At most this many differing decisions are listed by --set.
MAX_DIFFERENCES = 40


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("log", type=Path, help="the JSONL event log to replay")
    parser.add_argument("--at", type=float, metavar="T", help="show the state at time T")
    parser.add_argument(
        "--explain", type=int, metavar="N", help="show the inputs behind command #N"
    )
    parser.add_argument("--sqlite", type=Path, metavar="OUT", help="export to a SQLite database")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="replay under a changed configuration (e.g. pools.envs.max_workers=4); repeatable",
    )
    parser.add_argument(
        "--what-if",
        dest="what_if",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="closed loop: fit a scenario to the log and simulate it under this change beside "
        "the recorded configuration (policy=NAME, a policy parameter, max_workers=N, ...); "
        "repeatable",
    )
    parser.add_argument(
        "--what-if-seeds",
        dest="what_if_seeds",
        type=int,
        metavar="N",
        help="seeds each --what-if configuration is simulated under (default 3)",
    )
    parser.add_argument(
        "--fitted-out",
        dest="fitted_out",
        type=Path,
        metavar="FILE",
        help="write the scenario --what-if fits to FILE (replay writes nothing without it)",
    )
    parser.add_argument(
        "-q", "--quiet", action="store_true", help="no timeline: verify and summarize only"
    )


def run(args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    path: Path = args.log
    if not path.is_file():
        what = "a folder, not a log file" if path.is_dir() else "no such log file"
        print(f"deo replay: {path}: {what}", file=sys.stderr)
        return 2
    if path.stat().st_size == 0:
        print(f"deo replay: {path} is empty: not a deo log (it has no header)", file=sys.stderr)
        return 2
    try:
        header = log_header(path)
    except OSError as exc:
        print(f"deo replay: {path}: cannot be read: {exc.strerror}", file=sys.stderr)
        return 2
    if header is None:
        print(
            f"deo replay: {path} is not a deo log (its first line is no deo log header)",
            file=sys.stderr,
        )
        return 2
    if args.at is not None and not math.isfinite(args.at):
        print(f"deo replay: --at {args.at}: a time in seconds", file=sys.stderr)
        return 2
    problems: list[LogProblem] = []
    # A caller may build the Namespace by hand, without the closed-loop options.
    what_if: list[str] = getattr(args, "what_if", None) or []
    fitted_out: Path | None = getattr(args, "fitted_out", None)
    if fitted_out is not None:
        problem = output_problem(
            fitted_out,
            what="a scenario deo replay --what-if fitted",
            replaceable=is_fitted_scenario,
            reading=path,
        )
        if not what_if:
            problem = "writes the scenario --what-if fits: give --what-if too"
        if problem is not None:
            print(f"deo replay: --fitted-out {fitted_out} {problem}", file=sys.stderr)
            return 2
    questions = [
        flag
        for flag, given in (
            ("--set", bool(args.set)),
            ("--what-if", bool(what_if)),
            ("--sqlite", args.sqlite is not None),
            ("--at", args.at is not None),
            ("--explain", args.explain is not None),
        )
        if given
    ]
    if len(questions) > 1:
        print(
            f"deo replay: {' and '.join(questions)} ask different questions; give one",
            file=sys.stderr,
        )
        return 2
    what_if_seeds: int | None = getattr(args, "what_if_seeds", None)
    if what_if_seeds is not None and not what_if:
        print(
            f"deo replay: --what-if-seeds {what_if_seeds} sets how many seeds each --what-if "
            f"configuration runs under: give --what-if too",
            file=sys.stderr,
        )
        return 2
    if what_if:
        from adapters.postmortem import whatif  # the simulator, only when asked for

        try:
            return whatif.run_what_if(
                path,
                what_if,
                seeds=3 if what_if_seeds is None else what_if_seeds,
                fitted_out=fitted_out,
                out=out,
            )
        except (whatif.WhatIfError, whatif.FitError) as exc:
            print(f"deo replay: {exc}", file=sys.stderr)
            return 2
    if args.set:
        try:
            transform = apply_settings([parse_setting(s) for s in args.set])
        except ValueError as exc:
            print(f"deo replay: {exc}", file=sys.stderr)
            return 2
        return _what_if(path, args.set, transform, problems, out)
    if args.sqlite is not None:
        problem = output_problem(
            args.sqlite,
            what="a deo replay --sqlite export",
            replaceable=is_sqlite_database,
            reading=path,
        )
        if problem is not None:
            print(f"deo replay: --sqlite {args.sqlite} {problem}", file=sys.stderr)
            return 2
    steps = replay(path, problems=problems)
    if args.sqlite is not None:
        diverged: list[Replayed] = []
        try:
            counts = export_sqlite(_watch(steps, diverged), args.sqlite)
        except (sqlite3.Error, OSError) as exc:
            print(f"deo replay: --sqlite {args.sqlite}: cannot write it: {exc}", file=sys.stderr)
            return 2
        print(
            f"wrote {args.sqlite}: {counts['events']} events, {counts['commands']} commands, "
            f"{counts['workers']} workers",
            file=out,
        )
        return _finish(path, problems, diverged[:1], out)
    if args.at is not None:
        return _at(path, steps, args.at, problems, out)
    if args.explain is not None:
        if args.explain < 1:
            print(
                f"deo replay: --explain {args.explain}: commands are numbered from 1",
                file=sys.stderr,
            )
            return 2
        return _explain(path, steps, args.explain, problems, out)
    return _timeline(path, steps, problems, out, quiet=args.quiet)


def _watch(steps: Iterator[Replayed], diverged: list[Replayed]) -> Iterator[Replayed]:
    for step in steps:
        if not step.matches and not diverged:
            diverged.append(step)
        yield step


def _finish(path: Path, problems: list[LogProblem], diverged: list[Replayed], out: TextIO) -> int:
    _print_problems(path, problems, out)
    if diverged:
        _show_divergence(diverged[0], out)
        return 1
    return 2 if problems else 0


def _print_problems(path: Path, problems: list[LogProblem], out: TextIO) -> None:
    # By line: a refused event is only known to be a problem after the line that follows it.
    for problem in sorted(problems, key=lambda problem: problem.line):
        print(f"{path}: {problem}", file=out)


def _show_divergence(step: Replayed, out: TextIO) -> None:
    print(
        f"DIVERGED at line {step.line} (seq {step.seq}, {at(step.event.t)}): "
        f"{orjson.dumps(encode(step.event)).decode()}",
        file=out,
    )
    recorded = step.recorded if step.recorded_error is None else f"rejected: {step.recorded_error}"
    produced: Any = encode(step.produced)
    if step.produced_error is not None:
        produced = f"rejected: {step.produced_error}"
    print(f"  recorded: {orjson.dumps(recorded).decode()}", file=out)
    print(f"  replayed: {orjson.dumps(produced).decode()}", file=out)


def _timeline(
    path: Path, steps: Iterator[Replayed], problems: list[LogProblem], out: TextIO, *, quiet: bool
) -> int:
    events = commands = 0
    counts: dict[str, int] = {}
    series: dict[str, list[tuple[float, int]]] = {}
    tallies = {"exits": 0, "spawn failures": 0, "cordons": 0, "alerts": 0}
    diverged: Replayed | None = None
    for step in steps:
        events += 1
        t = step.after.now
        if not quiet:
            line = event_line(step.event)
            if line is not None:
                print(f"{at(t):>23}  {line}", file=out)
            for command in step.produced:
                commands += 1
                print(f"{at(t):>23}  #{commands} {command_line(command)}", file=out)
        else:
            commands += len(step.produced)
        name = type(step.event).__name__
        if name == "WorkerExited":
            tallies["exits"] += 1
        elif name == "SpawnFailed":
            tallies["spawn failures"] += 1
        for command in step.produced:
            kind = type(command).__name__
            if kind == "CordonGpu":
                tallies["cordons"] += 1
            elif kind == "RaiseAlert":
                tallies["alerts"] += 1
        now = _counted(step)
        for pool in set(now) | set(counts):
            if now.get(pool, 0) != counts.get(pool, 0) or pool not in series:
                series.setdefault(pool, []).append((t, now.get(pool, 0)))
        counts = now
        if step.cut:
            print(
                f"{path}: line {step.line}: the log ends before the commands this event "
                f"produces (deo stopped before writing them); `deo run` writes them when it "
                f"starts on this log again",
                file=out,
            )
        if not step.matches:
            diverged = step
            break
    _print_problems(path, problems, out)
    if diverged is not None:
        _show_divergence(diverged, out)
        return 1
    print("workers per pool over time (t:count):", file=out)
    for pool, points in sorted(series.items()):
        print(f"  {pool:<12} {_sampled_series(points)}", file=out)
    print(", ".join(f"{v} {k}" for k, v in tallies.items()), file=out)
    status = "verified" if not problems else "replayed with problems"
    print(f"{status}: {events} events, {commands} commands reproduced exactly ({path})", file=out)
    return 2 if problems else 0


def _counted(step: Replayed) -> dict[str, int]:
    counts: dict[str, int] = {}
    for worker in step.after.workers.values():
        if worker.state in COUNTED:
            counts[worker.pool] = counts.get(worker.pool, 0) + 1
    return counts


def _sampled_series(points: list[tuple[float, int]], limit: int = 24) -> str:
    if len(points) > limit:
        stride = len(points) / limit
        points = [points[int(i * stride)] for i in range(limit - 1)] + [points[-1]]
        return " ".join(f"{at(t)}:{n}" for t, n in points) + f"  ({limit} of many changes)"
    return " ".join(f"{at(t)}:{n}" for t, n in points)


def _at(
    path: Path, steps: Iterator[Replayed], at: float, problems: list[LogProblem], out: TextIO
) -> int:
    state = None
    for step in steps:
        if step.event.t > at:
            break
        if not step.matches:
            # The state past a divergence is not the one the run had: show where it parted.
            return _finish(path, problems, [step], out)
        state = step.after
    if state is None:
        print(f"deo replay: --at {at:g}: the log has no event at or before it", file=sys.stderr)
        return 2
    for line in state_lines(state):
        print(line, file=out)
    return _finish(path, problems, [], out)


def _explain(
    path: Path, steps: Iterator[Replayed], wanted: int, problems: list[LogProblem], out: TextIO
) -> int:
    number = 0
    recent: dict[str | None, deque[tuple[int, Event]]] = {}
    for step in steps:
        if not step.matches:
            return _finish(path, problems, [step], out)
        subject = event_subject(step.event)
        if number + len(step.produced) >= wanted:
            command = step.produced[wanted - number - 1]
            print(f"command #{wanted} at {at(step.after.now)}: {command_line(command)}", file=out)
            event_json = orjson.dumps(encode(step.event)).decode()
            print(f"caused by line {step.line} (seq {step.seq}): {event_json}", file=out)
            pool = getattr(command, "pool", None) or subject
            if pool is not None and pool in step.before.pools:
                print(f"before it: {pool_summary(step.before, pool)}", file=out)
                print(f"after it:  {pool_summary(step.after, pool)}", file=out)
            history = list(recent.get(pool, ()))
            if history:
                print(f"earlier inputs for {pool or 'deo as a whole'}:", file=out)
                for line, event in history:
                    print(f"  line {line}: {orjson.dumps(encode(event)).decode()}", file=out)
            return _finish(path, problems, [], out)
        number += len(step.produced)
        if type(step.event).__name__ != "Tick":
            recent.setdefault(subject, deque(maxlen=6)).append((step.line, step.event))
    _print_problems(path, problems, out)
    print(
        f"deo replay: --explain {wanted}: the log has {number} commands; there is no #{wanted}",
        file=sys.stderr,
    )
    return 2


def _what_if(
    path: Path,
    settings: list[str],
    transform: ConfigChange,
    problems: list[LogProblem],
    out: TextIO,
) -> int:
    print(
        f"replaying {path} with {', '.join(settings)} (open loop: the recorded inputs are fed as "
        f"they were; the world does not react to the changed decisions)",
        file=out,
    )
    differing = skipped = total = 0
    try:
        for step in replay(path, problems=problems, transform=transform):
            total += 1
            if step.produced_error is not None and step.recorded_error is None:
                if isinstance(step.event, Configured):
                    raise ValueError(f"refused at line {step.line}: {step.produced_error}")
                skipped += 1  # e.g. an exit of a worker this configuration never spawned
                continue
            now = [orjson.dumps(c).decode() for c in encode(step.produced)]
            then = [orjson.dumps(c).decode() for c in step.recorded]
            if now == then:
                continue
            differing += 1
            if differing <= MAX_DIFFERENCES:
                print(f"{at(step.after.now)} (line {step.line}):", file=out)
                for c in step.recorded:
                    print(f"  - recorded  {c.get('@')}: {c.get('reason')}", file=out)
                for c in step.produced:
                    print(f"  + now       {command_line(c)}", file=out)
    except (DeoError, ValueError) as exc:
        print(f"deo replay: the changed configuration is invalid: {exc}", file=sys.stderr)
        return 2
    unmatched = transform.unmatched_pools()
    if unmatched:
        print(
            f"deo replay: --set names {', '.join(unmatched)}, which no configuration in {path} has",
            file=sys.stderr,
        )
        return 2
    _print_problems(path, problems, out)
    more = f" (first {MAX_DIFFERENCES} shown)" if differing > MAX_DIFFERENCES else ""
    print(
        f"{differing} of {total} events would have led to different decisions{more}; "
        f"{skipped} recorded inputs did not apply (they concern workers this configuration "
        f"never started)",
        file=out,
    )
    return 2 if problems else 0
