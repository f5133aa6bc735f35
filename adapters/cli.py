"""The ``deo`` command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from adapters import postmortem
from adapters.log import VERSION

__all__ = ["main"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="deo", description="The elastic control plane for RL rollout workers."
    )
    parser.add_argument("--version", action="version", version=f"deo {VERSION}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    demo = commands.add_parser("demo", help="run a short simulated training loop scaled by deo")
    demo.add_argument(
        "--log", type=Path, default=Path("deo-demo.jsonl"), help="where to write the event log"
    )
    demo.add_argument("--seed", type=int, default=7, help="random seed of the simulated world")

    replay = commands.add_parser(
        "replay",
        help="verify a log and print its timeline",
        description="Re-reduce a deo event log, check every recorded command comes out again, "
        "and print a timeline. Exit 0: verified; 1: diverged; 2: unreadable lines.",
    )
    postmortem.add_arguments(replay)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "demo":
        from adapters.demo import DemoSettings, run_demo

        return run_demo(args.log, DemoSettings(seed=args.seed))
    if args.command == "replay":
        try:
            return postmortem.run(args)
        except BrokenPipeError:  # `deo replay log | head`
            return 0
    raise AssertionError(args.command)


if __name__ == "__main__":
    sys.exit(main())
