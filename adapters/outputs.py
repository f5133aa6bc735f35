"""Files deo writes on request (a simulated run's log, a SQLite export, a fitted scenario): what
each may replace. A path that holds anything else, a deo log of a real run above all, is
refused and left as it is."""

from __future__ import annotations

import contextlib
import sqlite3
import tomllib
from collections.abc import Callable
from pathlib import Path

import orjson

from adapters.log import SIMULATED, log_header
from core.errors import DeoError

__all__ = [
    "DEMO_ENV_MODULE",
    "EXPORT_TABLES",
    "FITTED_BY",
    "OutputRefused",
    "is_demo_log",
    "is_fitted_scenario",
    "is_simulated_log",
    "is_sqlite_database",
    "output_problem",
]

_SQLITE_MAGIC = b"SQLite format 3\x00"
#: The module ``deo demo``'s env workers run (``python -m deo_worker.demo_env``).
DEMO_ENV_MODULE = "deo_worker.demo_env"
_MAX_CONFIGURED_BYTES = 1 << 20
#: The tables ``deo replay --sqlite`` writes (:mod:`adapters.postmortem.sqlite`).
EXPORT_TABLES = frozenset({"events", "commands", "workers"})
#: How the description of a scenario ``deo replay --what-if`` fitted ends.
FITTED_BY = "by deo replay --what-if"


class OutputRefused(DeoError):
    """An output path deo will not write: a folder, in no folder, or a file it would destroy."""


def output_problem(
    path: Path, *, what: str, replaceable: Callable[[Path], bool], reading: Path | None = None
) -> str | None:
    """Why ``path`` must not be written as ``what`` (None: it may): it is a folder, its folder
    does not exist, it is the file being read (``reading``), or it holds something
    ``replaceable`` does not accept (an empty file or none at all may be written)."""
    if path.is_dir():
        return "is a folder: give a file name"
    if not path.parent.is_dir():
        return f"no such folder ({path.parent})"
    try:
        if path.exists() and not path.is_file():
            # A device or a pipe reads as empty, and writing one means deleting it first.
            return "is not a regular file (a device, a pipe, a socket): give a file name"
        if not path.exists() or path.stat().st_size == 0:
            return None
        if reading is not None and reading.exists() and path.samefile(reading):
            return "is the log being read"
        if replaceable(path):
            return None
        held = "a deo event log" if log_header(path) is not None else "a file"
    except OSError as exc:
        return f"cannot be read: {exc.strerror or exc}"
    return f"is {held}, not {what}; it is left as it is"


def is_simulated_log(path: Path) -> bool:
    """Whether ``path`` is the log of a simulated run (``deo simulate`` writes over those)."""
    header = log_header(path)
    return header is not None and header.get("world") == SIMULATED


def is_demo_log(path: Path) -> bool:
    """Whether ``path`` is the log of a ``deo demo`` run: a deo log whose configuration runs
    only the demo's env workers (``deo demo`` writes over those, nothing else)."""
    if log_header(path) is None:
        return False
    with path.open("rb") as f:
        f.readline()
        configured = f.readline(_MAX_CONFIGURED_BYTES)
    try:
        record = orjson.loads(configured)
        pools = record["event"]["config"]["pools"]
        return bool(pools) and all(DEMO_ENV_MODULE in pool["argv"] for pool in pools)
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return False


def is_sqlite_database(path: Path) -> bool:
    """Whether ``path`` is a ``deo replay --sqlite`` export: a SQLite database that holds
    nothing but the tables the export writes (any other database is someone's data)."""
    with path.open("rb") as f:
        if f.read(len(_SQLITE_MAGIC)) != _SQLITE_MAGIC:
            return False
    try:
        read_only = f"{path.absolute().as_uri()}?mode=ro"
        with contextlib.closing(sqlite3.connect(read_only, uri=True)) as db:
            rows = db.execute("SELECT name FROM sqlite_master WHERE type = 'table'").fetchall()
    except sqlite3.Error:
        return False
    tables = {name for (name,) in rows}
    return bool(tables) and tables <= EXPORT_TABLES


def is_fitted_scenario(path: Path) -> bool:
    """Whether ``path`` holds a scenario ``deo replay --what-if`` fitted (its description says
    so; a scenario written by hand, or anything else, is not one)."""
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError):
        return False
    description = data.get("description")
    return isinstance(description, str) and description.endswith(FITTED_BY)
