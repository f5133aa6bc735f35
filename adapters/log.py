"""The append-only event log: JSONL written with orjson, one record per line.

Layout::

    {"kind": "header", "schema": 1, "deo": "0.1.0", "created": "2026-11-22T10:00:00Z"}
    {"seq": 1, "kind": "event", "event": {"@": "Configured", "t": 0.0, ...}}
    {"seq": 2, "kind": "commands", "cause": 1, "commands": [{"@": "SpawnWorker", ...}]}
    {"seq": 3, "kind": "event", "event": {"@": "Tick", "t": 1.0}}
    {"seq": 4, "kind": "rejected", "cause": 3, "error": "..."}

Each input event is written before it is reduced and the commands it produced after it (an event
that produced none has no commands record). ``flush()`` writes the buffered records and fsyncs
them (``fsync=False`` leaves durability to the OS). A snapshot of the state sits beside the log
(``LOG.snapshot``, replaced atomically) so a restart re-reduces only the records after it.

A torn or corrupt last line (a crash mid-write) is reported with its line number, moved to
``LOG.torn-LINE`` and cut from the log before anything new is appended; a bad line elsewhere is
reported and skipped, never silently dropped.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import fcntl
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, BinaryIO

import attrs
import orjson

from core import Command, DeoError, Event, Reducer, State, decode, encode
from core.codec import types_with
from core.policies import BUILT_INS, PolicyCatalog

__all__ = [
    "SCHEMA_VERSION",
    "EventLog",
    "LogInUse",
    "LogProblem",
    "Recovery",
    "read_lines",
    "snapshot_path",
]

SCHEMA_VERSION = 1
VERSION = "0.1.0"


class LogInUse(DeoError):
    """Another process holds the log open for writing."""


@attrs.frozen(slots=True)
class LogProblem:
    """A line that could not be read, with where it is and what is wrong."""

    line: int
    message: str

    def __str__(self) -> str:
        return f"line {self.line}: {self.message}"


@attrs.define(slots=True)  # not frozen: one is built per line read, and frozen costs ~4x
class Line:
    """One decoded line: its number (1-based), byte offset, and JSON object."""

    number: int
    offset: int
    record: dict[str, Any]


def snapshot_path(path: Path) -> Path:
    return path.with_name(path.name + ".snapshot")


def read_lines(path: Path, *, offset: int = 0, first_line: int = 1) -> Iterator[Line | LogProblem]:
    """Every line from ``offset`` on, decoded, or a :class:`LogProblem` saying why not."""
    number = first_line - 1
    with path.open("rb") as f:
        f.seek(offset)
        position = offset
        for raw in f:
            number += 1
            start, position = position, position + len(raw)
            if not raw.endswith(b"\n"):
                yield LogProblem(number, f"torn record ({len(raw)} bytes, no line end)")
                continue
            try:
                record = orjson.loads(raw)
            except orjson.JSONDecodeError as exc:
                yield LogProblem(number, f"malformed JSON ({exc})")
                continue
            if not isinstance(record, dict):
                yield LogProblem(number, f"expected a JSON object, got {type(record).__name__}")
                continue
            yield Line(number, start, record)


def check_header(line: Line | LogProblem) -> LogProblem | None:
    """None when ``line`` is a header this deo reads, else the problem."""
    if isinstance(line, LogProblem):
        return line
    record = line.record
    if record.get("kind") != "header":
        return LogProblem(line.number, "not a deo log: the first line is not a header")
    if record.get("schema") != SCHEMA_VERSION:
        return LogProblem(
            line.number,
            f"schema version {record.get('schema')!r}; this deo reads version {SCHEMA_VERSION}",
        )
    return None


@attrs.frozen(slots=True)
class Recovery:
    """What opening an existing log found."""

    state: State
    #: Records re-reduced after the snapshot (0 for a new log).
    replayed: int
    #: Lines that could not be read, including a torn last line that was set aside.
    problems: tuple[LogProblem, ...]
    #: Where a torn last line was moved, if there was one.
    set_aside: Path | None = None


class EventLog:
    """The single writer of one log file. Use :meth:`open`; it recovers what is already there."""

    def __init__(
        self,
        path: Path,
        file: BinaryIO,
        *,
        seq: int,
        lines: int,
        fsync: bool,
        snapshot_every: int,
    ) -> None:
        self.path = path
        self.fsync = fsync
        self.snapshot_every = snapshot_every
        self._file = file
        self._buffer: list[bytes] = []
        self._seq = seq
        self._lines = lines
        self._since_snapshot = 0

    @classmethod
    def open(
        cls,
        path: str | os.PathLike[str],
        *,
        fsync: bool = True,
        snapshot_every: int = 10_000,
        policies: PolicyCatalog = BUILT_INS,
    ) -> tuple[EventLog, Recovery]:
        """Open ``path`` for appending, creating it with a header if needed, and rebuild the state
        it records (from the snapshot, then the records after it) with the reducer's
        ``policies`` (whose records its snapshot may hold)."""
        path = Path(path)
        file = path.open("ab")
        try:
            # One writer per log, locked before recovery touches it: a second deo on the same
            # log would interleave records (the lock goes with the file when the process dies).
            fcntl.flock(file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            file.close()
            raise LogInUse(f"{path} is in use by another deo (one writer per log)") from None
        recovery = Recovery(state=State(), replayed=0, problems=())
        seq = lines = 0
        if path.stat().st_size > 0:
            try:
                state, seq, lines, replayed, problems, set_aside = _recover(path, policies)
            except BaseException:
                file.close()
                raise
            recovery = Recovery(state, replayed, problems, set_aside)
        if path.stat().st_size == 0:
            # A new log (or one whose only line, a torn header, was set aside).
            snapshot_path(path).unlink(missing_ok=True)  # it would belong to another log
            header = {
                "kind": "header",
                "schema": SCHEMA_VERSION,
                "deo": VERSION,
                "created": dt.datetime.now(dt.UTC).isoformat(timespec="microseconds"),
            }
            with path.open("wb") as f:
                f.write(orjson.dumps(header) + b"\n")
                f.flush()
                os.fsync(f.fileno())
            seq, lines = 0, 1
        log = cls(path, file, seq=seq, lines=lines, fsync=fsync, snapshot_every=snapshot_every)
        return log, recovery

    @property
    def seq(self) -> int:
        """The sequence number of the last record appended."""
        return self._seq

    def _append(self, record: dict[str, Any]) -> int:
        record["seq"] = self._seq + 1
        line = orjson.dumps(record) + b"\n"  # may raise: then nothing is buffered, no seq used
        self._seq += 1
        self._buffer.append(line)
        return self._seq

    def append_event(self, event: Event) -> int:
        """Buffer an input event; returns its sequence number."""
        return self._append({"kind": "event", "event": encode(event)})

    def append_commands(self, cause: int, commands: Sequence[Command]) -> None:
        """Buffer the commands event ``cause`` produced (nothing is written for none)."""
        if commands:
            self._append({"kind": "commands", "cause": cause, "commands": encode(commands)})

    def append_rejected(self, cause: int, error: str) -> None:
        """Buffer the reducer's refusal of event ``cause``."""
        self._append({"kind": "rejected", "cause": cause, "error": error})

    def flush(self) -> None:
        """Write buffered records and, unless ``fsync=False``, make them durable."""
        if not self._buffer:
            return
        self._file.write(b"".join(self._buffer))
        self._lines += len(self._buffer)
        self._since_snapshot += len(self._buffer)
        self._buffer.clear()
        self._file.flush()
        if self.fsync:
            os.fsync(self._file.fileno())

    def record(self, reducer: Reducer, event: Event) -> list[Command]:
        """Log ``event``, reduce it, log what came out; re-raises the reducer's refusal."""
        cause = self.append_event(event)
        try:
            commands = reducer.step(event)
        except DeoError as exc:
            self.append_rejected(cause, str(exc))
            raise
        self.append_commands(cause, commands)
        return commands

    def maybe_snapshot(self, state: State) -> bool:
        """Snapshot ``state`` if ``snapshot_every`` records were written since the last one."""
        if self._since_snapshot < self.snapshot_every:
            return False
        self.snapshot(state)
        return True

    def snapshot(self, state: State) -> None:
        """Write ``state`` as of everything flushed so far, atomically, beside the log."""
        self.flush()
        payload = {
            "schema": SCHEMA_VERSION,
            "header": _first_line(self.path),
            "seq": self._seq,
            "offset": self._file.tell(),
            "lines": self._lines,
            "state": encode(state),
        }
        target = snapshot_path(self.path)
        tmp = target.with_name(target.name + ".tmp")
        with tmp.open("wb") as f:
            f.write(orjson.dumps(payload))
            f.flush()
            if self.fsync:
                os.fsync(f.fileno())
        os.replace(tmp, target)
        self._since_snapshot = 0

    def close(self) -> None:
        self.flush()
        self._file.close()

    def __enter__(self) -> EventLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _load_snapshot(path: Path, types: Mapping[str, type]) -> tuple[State, int, int, int] | None:
    """(state, seq, offset, lines) from the snapshot beside ``path``, if one fits the log."""
    target = snapshot_path(path)
    try:
        payload = orjson.loads(target.read_bytes())
        if not isinstance(payload, dict) or payload.get("schema") != SCHEMA_VERSION:
            return None
        if payload.get("header") != _first_line(path) or payload["offset"] > path.stat().st_size:
            return None  # a snapshot of another log, or of a longer one
        state = decode(payload["state"], types)
        if not isinstance(state, State):
            return None
        return state, int(payload["seq"]), int(payload["offset"]), int(payload["lines"])
    except (OSError, ValueError, KeyError, TypeError, DeoError):
        return None  # no usable snapshot: rebuild from the start of the log


def _recover(
    path: Path, policies: PolicyCatalog
) -> tuple[State, int, int, int, tuple[LogProblem, ...], Path | None]:
    snapshot = _load_snapshot(path, types_with(policies.records))
    problems: list[LogProblem] = []
    if snapshot is None:
        state, seq, offset, lines = State(), 0, 0, 0
    else:
        state, seq, offset, lines = snapshot
    reducer = Reducer(state, policies=policies)
    replayed = 0
    torn: LogProblem | None = None
    for item in read_lines(path, offset=offset, first_line=lines + 1):
        if isinstance(item, LogProblem):
            problems.append(item)
            torn = item
            continue
        torn = None
        lines = item.number
        record = item.record
        if item.number == 1:
            problem = check_header(item)
            if problem is not None:
                raise DeoError(f"{path}: {problem}")
            continue
        number = record.get("seq")
        if not isinstance(number, int):
            problems.append(LogProblem(item.number, "record without an integer seq; skipped"))
            continue
        seq = max(seq, number)
        if record.get("kind") != "event":
            continue
        try:
            event = decode(record["event"])
            if not isinstance(event, Event):
                raise DeoError(f"{type(event).__name__} is not an event")
        except (DeoError, KeyError, TypeError) as exc:
            problems.append(LogProblem(item.number, f"unreadable event ({exc}); skipped"))
            continue
        with contextlib.suppress(DeoError):  # refused at run time too: a "rejected" record follows
            reducer.step(event)
        replayed += 1
    set_aside = None
    if torn is not None:
        # The last line is torn or corrupt: move its bytes aside and cut it from the log.
        start = _line_start(path, torn.line, offset, lines_before=snapshot[3] if snapshot else 0)
        set_aside = path.with_name(f"{path.name}.torn-{torn.line}")
        with path.open("rb+") as f:
            f.seek(start)
            set_aside.write_bytes(f.read())
            f.truncate(start)
            f.flush()
            os.fsync(f.fileno())
        problems[-1] = LogProblem(torn.line, f"{torn.message}; set aside in {set_aside.name}")
        lines = torn.line - 1
    return reducer.state, seq, lines, replayed, tuple(problems), set_aside


def _first_line(path: Path) -> str:
    """The header line, which names the log (its creation time) for its snapshots."""
    with path.open("rb") as f:
        return f.readline().decode("utf-8", "replace")


def _line_start(path: Path, line: int, offset: int, *, lines_before: int) -> int:
    """Byte offset where 1-based ``line`` starts, counting from ``offset`` (line lines_before+1)."""
    with path.open("rb") as f:
        f.seek(offset)
        position = offset
        for number, raw in enumerate(f, start=lines_before + 1):
            if number == line:
                return position
            position += len(raw)
    return position
