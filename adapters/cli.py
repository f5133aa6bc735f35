"""The ``deo`` command line."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import orjson

from adapters.api import client as remote
from adapters.log import VERSION
from adapters.postmortem import replay as postmortem
from core import DeoError

__all__ = ["main"]


#: deo's own commands; any other command word is looked up among the plugins.
BUILT_IN = frozenset({"demo", "run", "status", "stop", "replay", "simulate", *remote.ACTIONS})


def build_parser(plugins: dict[str, Any] | None = None) -> argparse.ArgumentParser:
    """The parser of deo's own commands and of the ``plugins`` given (name -> module)."""
    parser = argparse.ArgumentParser(
        prog="deo", description="The elastic control plane for RL rollout workers."
    )
    parser.add_argument("--version", action="version", version=f"deo {VERSION}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    demo = commands.add_parser(
        "demo",
        help="run a real Atropos loop on this machine, scaled by deo (about a minute)",
        description="Start atroposlib's API server, a small trainer whose step time changes, and "
        "deo scaling env workers; print progress and a summary; verify the log.",
    )
    demo.add_argument(
        "--log", type=Path, default=Path("deo-demo.jsonl"), help="where to write the event log"
    )
    demo.add_argument(
        "--duration-s", type=float, default=60.0, help="how long the trainer runs (default 60)"
    )

    run = commands.add_parser(
        "run",
        help="manage workers on this machine",
        description=(
            "Run deo: manage the workers of the configured pools, serve the status/control API, "
            "log every input and decision. SIGINT/SIGTERM stop deo and leave workers running."
        ),
    )
    run.add_argument("--config", type=Path, required=True, help="the TOML configuration file")

    status = commands.add_parser(
        "status",
        help="show pools, workers and GPUs of a running deo",
        description="Show a running deo's pools (with the age of each pressure sample), "
        "workers, GPUs and alerts.",
    )
    remote.add_target_arguments(status)
    status.add_argument("--json", action="store_true", help="print the raw JSON")
    stop = commands.add_parser(
        "stop",
        help="stop a running deo (workers keep running unless --drain)",
        description="Stop a running deo. Its workers keep running (a restart adopts them) "
        "unless --drain, which drains every worker first.",
    )
    stop.add_argument("--drain", action="store_true", help="drain every worker first")
    remote.add_target_arguments(stop)
    for name, action in remote.ACTIONS.items():
        remote.add_action_arguments(
            commands.add_parser(name, help=action.help, description=action.help),
            action,
        )

    replay = commands.add_parser(
        "replay",
        help="verify a log and print its timeline",
        description="Re-reduce a deo event log, check every recorded command comes out again, "
        "and print a timeline. Exit 0: verified; 1: diverged; 2: unreadable lines.",
    )
    postmortem.add_arguments(replay)

    from adapters.sim import cli as sim_cli

    sim_cli.add_arguments(
        commands.add_parser(
            "simulate",
            help="run one scenario in the simulator and print its metrics",
            description=sim_cli.__doc__,
        )
    )
    for name, plugin in (plugins or {}).items():
        if name not in commands.choices:  # a plugin never shadows a command of deo's own
            plugin.add_arguments(
                commands.add_parser(name, help=plugin.HELP, description=plugin.__doc__)
            )
    return parser


def _plugins(wanted: str | None) -> dict[str, Any]:
    """Commands other packages add (``deo bench``), from the ``deo.commands`` entry points.

    Each names a module with ``HELP``, ``add_arguments(parser)`` and ``main(args) -> int``; the
    modules of deo never import them; the command line loads them as plugins, and only when the
    command asked for is none of deo's own (or none is given: the usage lists them), so a plugin
    that fails to load breaks nothing but itself. ``wanted``: the plugin asked for, whose failure
    is an error; None loads every plugin, each failure a warning.
    """
    loaded: dict[str, Any] = {}
    found = entry_points(group="deo.commands")
    if wanted not in {ep.name for ep in found}:
        wanted = None  # no such command: the usage that says so lists every one that loads
    for ep in sorted(found, key=lambda ep: ep.name):
        if wanted is not None and ep.name != wanted:
            continue
        try:
            loaded[ep.name] = ep.load()
        except Exception as exc:  # a plugin's own bug: report it, never crash on it
            message = f"the command {ep.name!r} ({ep.value}) failed to load: {exc!r}"
            if wanted is not None:
                raise _PluginError(message) from exc
            print(f"deo: warning: {message}", file=sys.stderr)
    return loaded


class _PluginError(DeoError):
    """The plugin command asked for cannot be loaded."""


def _command_of(argv: Sequence[str]) -> str | None:
    """The command word of ``argv``: its first argument that is not an option."""
    return next((arg for arg in argv if not arg.startswith("-")), None)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command ``argv`` (default: this process's arguments) names; its exit status."""
    try:
        return _main(argv)
    except BrokenPipeError:
        # The reader of the output went away (`deo replay LOG | head`): stop quietly, and keep
        # the interpreter's last flush from writing to the closed pipe.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
    except KeyboardInterrupt:
        # Ctrl-C before a command installs its own handling (while deo run is still importing,
        # say): nothing was started, so nothing is left to report.
        print("deo: interrupted", file=sys.stderr)
        return 130


def _main(argv: Sequence[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = _command_of(argv)
    try:
        plugins = {} if command in BUILT_IN else _plugins(command)
    except _PluginError as exc:
        print(f"deo: {exc}", file=sys.stderr)
        return 2
    args = build_parser(plugins).parse_args(argv)
    if args.command == "demo":
        from adapters.demo.loop import DemoSettings, run_demo

        try:
            settings = DemoSettings(duration_s=args.duration_s)
        except ValueError as exc:
            print(f"deo demo: {exc}", file=sys.stderr)
            return 2
        return run_demo(args.log, settings)
    if args.command == "run":
        return _run(args.config)
    if args.command in ("status", "stop"):
        return remote.status(args) if args.command == "status" else remote.stop(args)
    if args.command in remote.ACTIONS:
        return remote.act(args.command, args)
    if args.command == "simulate":
        from adapters.sim import cli as sim_cli

        return sim_cli.main(args)
    if args.command == "replay":
        try:
            return postmortem.run(args)
        except BrokenPipeError:  # `deo replay log | head`
            return 0
    status: int = plugins[args.command].main(args)
    return status


class _JsonLines(logging.Formatter):
    """One JSON object per log record, for log collectors."""

    def format(self, record: logging.LogRecord) -> str:
        line = {
            "time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        return orjson.dumps(line).decode()


def _run(path: Path) -> int:
    import functools

    import anyio

    from adapters.run import run
    from adapters.runtime.config_file import load
    from core import ConfigError

    try:
        settings = load(path)
    except ConfigError as exc:
        print(f"deo run: {path}: {exc}", file=sys.stderr)
        return 2
    live = sys.stdout.isatty()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_JsonLines())
    # On a terminal the live view shows the decisions; elsewhere they are JSON log lines.
    logging.basicConfig(level=logging.WARNING if live else logging.INFO, handlers=[handler])
    # One line per poll of every source would bury deo's own lines.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    return anyio.run(functools.partial(run, settings, live=live))


if __name__ == "__main__":
    sys.exit(main())
