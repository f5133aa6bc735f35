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

Recovery here and replay (:mod:`adapters.postmortem.engine`) read a log the same way: each line
through :func:`parse_record`, in order through :class:`LogReader`. A torn or corrupt last line (a
crash mid-write) is reported with its line number, moved to ``LOG.torn-LINE`` and cut from the
log before anything new is appended; a bad line elsewhere, and an event the reducer refuses
although the log records no refusal for it, is reported with its line number and skipped, never
silently dropped, and never stops the reading.
"""

from __future__ import annotations

import datetime as dt
import fcntl
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any, BinaryIO

import attrs
import orjson

from core import Command, DeoError, Event, Reducer, State, decode, encode
from core.codec import types_with
from core.policies import BUILT_INS, PolicyCatalog

__all__ = [
    "SCHEMA_VERSION",
    "CommandsRecord",
    "EventLog",
    "EventRecord",
    "Header",
    "LogInUse",
    "LogProblem",
    "LogReader",
    "Record",
    "Recovery",
    "RejectedRecord",
    "Unreadable",
    "not_reduced",
    "parse_record",
    "snapshot_path",
]

SCHEMA_VERSION = 1
VERSION = "0.1.0"
#: Sequence numbers are positive and fit the log's JSON integers (64-bit signed).
MAX_SEQ = 2**63 - 1


class LogInUse(DeoError):
    """Another process holds the log open for writing."""


@attrs.frozen(slots=True)
class LogProblem:
    """A line that could not be read, with where it is and what is wrong."""

    line: int
    message: str

    def __str__(self) -> str:
        return f"line {self.line}: {self.message}"


@attrs.frozen(slots=True)
class Unreadable(LogProblem):
    """A line that is not a JSON object at all: torn or corrupt bytes. A crash mid-write leaves
    one as the last line."""


# The records of a log, as :func:`parse_record` reads them. Mutable slots classes: one is built
# per line of logs with millions of them, and a frozen attrs class costs several times as much.
# Treat them as read-only.


@attrs.define(slots=True)
class Header:
    """The first line: which deo wrote the log, and when it was created."""

    line: int
    #: The header as written: ``kind``, ``schema``, ``deo`` (its version), ``created``.
    fields: dict[str, Any]


@attrs.define(slots=True)
class EventRecord:
    """An input event, and what the log recorded that it led to (filled in by the record that
    follows it, see :meth:`LogReader.events`)."""

    line: int
    seq: int
    event: Event
    #: The commands it produced, as written (encoded); empty when none were recorded.
    commands: list[Any] = attrs.field(factory=list)
    #: The reducer's refusal, if the log recorded one.
    error: str | None = None


@attrs.define(slots=True)
class CommandsRecord:
    """The commands event ``cause`` produced, as written (encoded)."""

    line: int
    seq: int
    cause: int
    commands: list[Any]


@attrs.define(slots=True)
class RejectedRecord:
    """The reducer's refusal of event ``cause``."""

    line: int
    seq: int
    cause: int
    error: str


Record = Header | EventRecord | CommandsRecord | RejectedRecord


def snapshot_path(path: Path) -> Path:
    return path.with_name(path.name + ".snapshot")


#: The fields each kind of record has besides ``kind`` and ``seq``.
_REQUIRED: Mapping[object, tuple[str, ...]] = MappingProxyType(
    {"event": ("event",), "commands": ("cause", "commands"), "rejected": ("cause", "error")}
)


def parse_record(raw: bytes, line: int, *, decode: Callable[[Any], Any]) -> Record | LogProblem:
    """One line of a log (``raw``, with its line end) as a typed record, or the problem with it.

    ``line`` is its 1-based number; ``decode`` turns an encoded event into the event
    (:func:`core.decode`). Nothing here raises on bad input: every way a line can be wrong is a
    :class:`LogProblem` (an :class:`Unreadable` one when the line is not a JSON object at all).
    """
    if not raw.endswith(b"\n"):
        return Unreadable(line, f"torn record ({len(raw)} bytes, no line end)")
    try:
        record = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        return Unreadable(line, f"malformed JSON ({exc})")
    if type(record) is not dict:
        return Unreadable(line, f"expected a JSON object, got {type(record).__name__}")
    kind = record.get("kind")
    if kind == "header":
        return _header(record, line)
    if kind not in _REQUIRED:
        return LogProblem(line, f"unknown record kind {kind!r}")
    seq = record.get("seq")
    if type(seq) is not int or not 0 < seq <= MAX_SEQ:
        return LogProblem(line, f"{kind} record without an integer seq (got {seq!r})")
    for name in _REQUIRED[kind]:
        if name not in record:
            return LogProblem(line, f"{kind} record without '{name}'")
    if kind == "event":
        try:
            event = decode(record["event"])
        except DeoError as exc:  # the event's own check names the class, the field and the value
            return LogProblem(line, str(exc))
        except Exception as exc:  # anything else a line can make decoding raise is a bad line too
            return LogProblem(line, f"unreadable event ({exc!r})")
        if not isinstance(event, Event):
            return LogProblem(line, f"{type(event).__name__} is not an event")
        return EventRecord(line, seq, event)
    cause = record["cause"]
    if type(cause) is not int:
        return LogProblem(line, f"{kind} record whose cause is not a seq: {cause!r}")
    if kind == "commands":
        commands = record["commands"]
        if type(commands) is not list:
            return LogProblem(line, f"commands record whose commands are not a list: {commands!r}")
        return CommandsRecord(line, seq, cause, commands)
    error = record["error"]
    if type(error) is not str:
        return LogProblem(line, f"rejected record whose error is not a string: {error!r}")
    return RejectedRecord(line, seq, cause, error)


def _header(record: dict[str, Any], line: int) -> Header | LogProblem:
    if line != 1:
        return LogProblem(line, "a header after the first line")
    if record.get("schema") != SCHEMA_VERSION:
        return LogProblem(
            line,
            f"schema version {record.get('schema')!r}; this deo reads version {SCHEMA_VERSION}",
        )
    return Header(line, record)


def not_reduced(record: EventRecord, error: Exception) -> LogProblem:
    """The problem with an event the reducer refuses (or fails on) although the log records no
    refusal for it: such an event was never reduced this way, and is skipped."""
    if isinstance(error, DeoError):
        message = f"refused ({error}), but the log records no refusal; skipped"
        return LogProblem(record.line, message)
    return LogProblem(record.line, f"the reducer failed ({error!r}); skipped")


class LogReader:
    """Reads one log once, from byte ``offset`` (line ``first_line``, after seq ``seq``): its
    records in order, or its events, each with what the log recorded of its outcome.

    Every line that cannot be used is appended to :attr:`problems` with its number and why, and
    skipped: unreadable bytes, a record of unknown kind or with bad fields, a record whose seq
    does not come after the one before it, a commands or rejected record that does not follow
    its event. Nothing in the log's content makes it raise.
    """

    def __init__(
        self,
        path: Path,
        *,
        offset: int = 0,
        first_line: int = 1,
        seq: int = 0,
        decode: Callable[[Any], Any] = decode,
        problems: list[LogProblem] | None = None,
    ) -> None:
        self.path = path
        self.offset = offset
        self.first_line = first_line
        self.decode = decode
        #: Where the lines that cannot be used are reported (``problems`` when given).
        self.problems: list[LogProblem] = [] if problems is None else problems
        #: The header, or the problem with the first line (None when reading starts after it).
        self.header: Header | LogProblem | None = None
        #: The number of the last line read.
        self.lines = first_line - 1
        #: The seq of the last record read; a record must come after it to be read.
        self.seq = seq
        #: The last line read, when it is unreadable (torn by a crash mid-write); else None.
        self.torn: Unreadable | None = None

    def records(self) -> Iterator[Record]:
        """Every readable record, in order; the others go to :attr:`problems`."""
        problems = self.problems
        decode = self.decode
        number = self.first_line - 1
        with self.path.open("rb") as f:
            f.seek(self.offset)
            for raw in f:
                number += 1
                record = parse_record(raw, number, decode=decode)
                self.lines = number
                self.torn = record if isinstance(record, Unreadable) else None
                if number == 1:
                    record = self._first(record)
                if isinstance(record, LogProblem):
                    problems.append(record)
                elif isinstance(record, Header):
                    continue
                elif record.seq <= self.seq:
                    problems.append(
                        LogProblem(
                            number, f"seq {record.seq} does not come after seq {self.seq}; skipped"
                        )
                    )
                else:
                    self.seq = record.seq
                    yield record

    def _first(self, record: Record | LogProblem) -> Record | LogProblem:
        if isinstance(record, Header | LogProblem):
            self.header = record
            return record
        self.header = LogProblem(1, "not a deo log: the first line is not a header")
        # Read on all the same: replay shows what it can of a log it cannot vouch for.
        self.problems.append(self.header)
        return record

    def events(self) -> Iterator[EventRecord]:
        """Every readable event, with the commands or refusal recorded just after it."""
        pending: EventRecord | None = None
        answered = False
        for record in self.records():
            if isinstance(record, EventRecord):
                if pending is not None:
                    yield pending
                pending, answered = record, False
                continue
            assert not isinstance(record, Header)  # records() keeps headers to itself
            if pending is None or answered or record.cause != pending.seq:
                kind = "commands" if isinstance(record, CommandsRecord) else "rejected"
                self.problems.append(
                    LogProblem(record.line, f"{kind} record for an event not just before it")
                )
            elif isinstance(record, CommandsRecord):
                pending.commands, answered = record.commands, True
            else:
                pending.error, answered = record.error, True
        if pending is not None:
            yield pending


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
    if snapshot is None:
        reader = LogReader(path)
        state = State()
    else:
        state, seq, offset, lines = snapshot
        reader = LogReader(path, offset=offset, first_line=lines + 1, seq=seq)
    reducer = Reducer(state, policies=policies)
    replayed = 0
    problems = reader.problems
    for record in reader.events():
        event = record.event
        try:
            reducer.step(event)
        except DeoError as exc:
            if record.error is None:  # else refused at run time too, as the log records
                problems.append(not_reduced(record, exc))
                continue
        except Exception as exc:  # a bug in the reducer must not keep deo from starting
            problems.append(not_reduced(record, exc))
            continue
        replayed += 1
    torn, lines = reader.torn, reader.lines
    if isinstance(reader.header, LogProblem) and reader.header is not torn:
        raise DeoError(f"{path}: {reader.header}")
    set_aside = None
    if torn is not None:
        # The last line is torn or corrupt: move its bytes aside and cut it from the log.
        start = _line_start(path, torn.line, reader.offset, lines_before=reader.first_line - 1)
        set_aside = path.with_name(f"{path.name}.torn-{torn.line}")
        with path.open("rb+") as f:
            f.seek(start)
            set_aside.write_bytes(f.read())
            f.truncate(start)
            f.flush()
            os.fsync(f.fileno())
        problems[problems.index(torn)] = LogProblem(
            torn.line, f"{torn.message}; set aside in {set_aside.name}"
        )
        lines = torn.line - 1
    ordered = tuple(sorted(problems, key=lambda problem: problem.line))
    return reducer.state, reader.seq, lines, replayed, ordered, set_aside


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
