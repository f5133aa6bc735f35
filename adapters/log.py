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
(``LOG.snapshot``, replaced atomically) so a restart re-reduces only the records after it; it
names the bytes of the log it covers by length and SHA-256 and is used only when they, and the
digest of its own state, still match. With ``segment_bytes``, a snapshot of a log that long also
moves the log to the next segment (``LOG.000001``, ...) and starts ``LOG`` again with the same
header and a state record, ``{"kind": "state", "seq": 812, "state": {...}}``: the state after
the last seq of the earlier segments, from which the new one goes on. Every file deo writes here
is created mode 0600 (the pools' environments are in it).

Opening refuses a file that is not a deo log (:class:`NotALog`), a log whose unreadable
lines may have held the configuration and a later segment whose state record cannot be used
without a snapshot to stand in for it (:class:`LogDamaged`), leaving either as it is; a log
that ends with an event whose commands record was cut gets that record written again.

Recovery here and replay (:mod:`adapters.postmortem.engine`) read a log the same way: each line
through :func:`parse_record`, in order through :class:`LogReader`. A torn or corrupt last line (a
crash mid-write) is reported with its line number, moved to ``LOG.torn-LINE`` and cut from the
log before anything new is appended; a bad line elsewhere, and an event the reducer refuses
although the log records no refusal for it, is reported with its line number and skipped, never
silently dropped, and never stops the reading.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import errno
import fcntl
import glob
import hashlib
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any

import attrs
import orjson

from core import Command, Config, DeoError, Event, Reducer, State, decode, encode
from core.codec import types_with
from core.policies import BUILT_INS, PolicyCatalog

__all__ = [
    "SCHEMA_VERSION",
    "CommandsRecord",
    "EventLog",
    "EventRecord",
    "Header",
    "LogDamaged",
    "LogInUse",
    "LogProblem",
    "LogWriteFailed",
    "LogReader",
    "Record",
    "Recovery",
    "RejectedRecord",
    "NotALog",
    "Unreadable",
    "fsync_directory",
    "log_header",
    "not_reduced",
    "parse_record",
    "segment_start",
    "segments",
    "snapshot_path",
]

SCHEMA_VERSION = 1
#: The header's ``world`` in the log of a simulated run (absent in a real run's).
SIMULATED = "simulated"
VERSION = "0.1.0"
#: Sequence numbers are positive and fit the log's JSON integers (64-bit signed).
MAX_SEQ = 2**63 - 1


class LogInUse(DeoError):
    """Another process holds the log open for writing."""


class NotALog(DeoError):
    """The file is not a deo log (its first line is not a deo header); it is left untouched."""


class LogDamaged(DeoError):
    """A line that cannot be read may have carried state deo must not start without (the
    configuration, or the state a later segment starts from); the log is left untouched."""


class LogWriteFailed(DeoError):
    """The log (or its snapshot) cannot be written: disk full, file too big, read-only.
    Nothing is carried out past the last record that was written."""


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
        keep_bad_lines: bool = False,
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
        #: With ``keep_bad_lines``: the bytes of each line skipped by :meth:`records`, by number.
        self.bad_lines: dict[int, bytes] = {}
        self._keep_bad_lines = keep_bad_lines

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
                    if self._keep_bad_lines:
                        self.bad_lines[number] = raw
                elif isinstance(record, Header):
                    continue
                elif record.seq <= self.seq:
                    if self._keep_bad_lines:
                        self.bad_lines[number] = raw
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
    #: What else recovery did, one sentence each: a snapshot it ignored (and why), the outcome
    #: of a last event it re-derived and wrote because the log was cut before it.
    notes: tuple[str, ...] = ()


#: The mode of every file deo writes beside the log: they hold the pools' environments.
FILE_MODE = 0o600
#: How a header line starts (orjson writes the keys in order); a torn header is a prefix of it.
_HEADER_START = b'{"kind":"header",'
#: The longest first line read when checking that a file is a deo log.
_MAX_HEADER_BYTES = 64 * 1024


class EventLog:
    """The single writer of one log file. Use :meth:`open`; it recovers what is already there.

    Writing fails with :class:`LogWriteFailed` (disk full, file too big, read-only file or
    directory); after that the log refuses every further write, so nothing is appended after
    a record that may be torn, and nothing more is carried out (the commands of a record are
    carried out only once it is written).
    """

    def __init__(
        self,
        path: Path,
        fd: int,
        *,
        seq: int,
        lines: int,
        size_bytes: int,
        fsync: bool,
        snapshot_every: int,
        segment_bytes: int = 0,
        keep_segments: int | None = None,
    ) -> None:
        self.path = path
        self.fsync = fsync
        self.snapshot_every = snapshot_every
        #: A snapshot taken when the log is this long starts a new segment (0: never).
        self.segment_bytes = segment_bytes
        #: How many earlier segments are kept (None: all of them).
        self.keep_segments = keep_segments
        self._fd = fd
        self._buffer: list[bytes] = []
        self._seq = seq
        self._lines = lines
        #: The log's length: where the next record starts.
        self._size_bytes = size_bytes
        #: SHA-256 of everything written so far, for the snapshot to name what it covers.
        self._digest = _digest_of(path, size_bytes)
        self._header = _first_line(path)
        self._since_snapshot = 0
        self._failed: LogWriteFailed | None = None

    @classmethod
    def open(
        cls,
        path: str | os.PathLike[str],
        *,
        fsync: bool = True,
        snapshot_every: int = 10_000,
        segment_bytes: int = 0,
        keep_segments: int | None = None,
        policies: PolicyCatalog = BUILT_INS,
        simulated: bool = False,
        alive: Callable[[int, int], bool] | None = None,
    ) -> tuple[EventLog, Recovery]:
        """Open ``path`` for appending, creating it (mode 0600) with a header if needed, and
        rebuild the state it records (from the snapshot, then the records after it) with the
        reducer's ``policies`` (whose records its snapshot may hold).

        With ``segment_bytes``, a snapshot taken once the log is that long moves the log to
        the next numbered segment (``LOG.000001``, ...) and starts ``LOG`` again with the same
        header and the state it continues from; ``keep_segments`` earlier segments are kept
        (all when None). See :func:`segments`.

        ``simulated`` marks a new log's header as a simulated run's (``deo simulate``); a log
        so marked is refused by any other opener, since its workers, GPUs and clock are the
        simulator's. ``alive(pid, start_time)`` tells whether a worker process still runs: a
        new log whose snapshot names one that does is refused (:class:`LogDamaged`), since the
        log that recorded it is gone.

        Raises :class:`NotALog` for a file that is not a deo log (or a simulated run's log
        opened without ``simulated``), :class:`LogDamaged` for a log
        whose unreadable lines may have held its configuration or a later segment whose state
        record cannot be used (both leave the file as it was), :class:`LogInUse` and
        :class:`LogWriteFailed`.
        """
        path = Path(path)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, FILE_MODE)
        except OSError as exc:
            raise LogWriteFailed(
                f"{path}: cannot open the log for writing: {_cause(exc)}"
            ) from None
        try:
            # One writer per log, locked before recovery touches it: a second deo on the same
            # log would interleave records (the lock goes with the file when the process dies).
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise LogInUse(f"{path} is in use by another deo (one writer per log)") from None
        try:
            log, recovery = cls._recover(
                path, fd, fsync, snapshot_every, policies, simulated, alive
            )
        except OSError as exc:
            os.close(fd)
            raise LogWriteFailed(f"{path}: cannot recover the log: {_cause(exc)}") from None
        except BaseException:
            os.close(fd)
            raise
        log.segment_bytes, log.keep_segments = segment_bytes, keep_segments
        return log, recovery

    @classmethod
    def _recover(
        cls,
        path: Path,
        fd: int,
        fsync: bool,
        snapshot_every: int,
        policies: PolicyCatalog,
        simulated: bool,
        alive: Callable[[int, int], bool] | None,
    ) -> tuple[EventLog, Recovery]:
        _check_is_log(path, simulated)
        snapshot = snapshot_path(path)
        if snapshot.exists() and not snapshot.is_file():
            raise LogDamaged(
                f"{snapshot} is not a file: deo keeps the log's snapshot at that path; move it "
                f"aside"
            )
        _finish_rotation(path)
        recovery = Recovery(state=State(), replayed=0, problems=())
        seq = lines = 0
        repair: list[dict[str, Any]] = []
        if path.stat().st_size > 0:
            recovery, seq, lines, repair = _recover(path, policies)
        if path.stat().st_size == 0:
            # A new log (or one whose only line, a torn header, was set aside).
            if alive is not None:
                _check_no_orphaned_workers(path, alive)
            snapshot_path(path).unlink(missing_ok=True)  # it would belong to another log
            header = {
                "kind": "header",
                "schema": SCHEMA_VERSION,
                "deo": VERSION,
                "created": dt.datetime.now(dt.UTC).isoformat(timespec="microseconds"),
            }
            if simulated:
                header["world"] = SIMULATED
            _write_all(fd, orjson.dumps(header) + b"\n")
            os.fsync(fd)
            seq, lines = 0, 1
        size_bytes = os.lseek(fd, 0, os.SEEK_END)
        log = cls(
            path,
            fd,
            seq=seq,
            lines=lines,
            size_bytes=size_bytes,
            fsync=fsync,
            snapshot_every=snapshot_every,
        )
        for record in repair:
            log._append(record)
        log.flush()
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
        """Write buffered records and, unless ``fsync=False``, make them durable.

        Raises :class:`LogWriteFailed` when they cannot be written, and from then on.
        """
        if self._failed is not None:
            raise self._failed
        if not self._buffer:
            return
        data = b"".join(self._buffer)
        self._check_still_there()
        try:
            _write_all(self._fd, data)
            if self.fsync:
                os.fsync(self._fd)
        except OSError as exc:
            self._failed = LogWriteFailed(f"{self.path}: cannot write the log: {_cause(exc)}")
            raise self._failed from None
        self._digest.update(data)
        self._size_bytes += len(data)
        self._lines += len(self._buffer)
        self._since_snapshot += len(self._buffer)
        self._buffer.clear()

    def _check_still_there(self) -> None:
        """Raise :class:`LogWriteFailed` once the file deo writes is no longer the log at its
        path: removed, moved or replaced (log rotation), or cut short. Records written on would
        be lost, and a deo started on the path would begin a new log beside running workers."""
        try:
            held = os.fstat(self._fd)
            if held.st_nlink == 0:
                what = "removed"
            elif held.st_size < self._size_bytes:
                what = f"cut short ({held.st_size} of the {self._size_bytes} bytes written)"
            else:
                named = os.stat(self.path)
                same = (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino)
                what = "" if same else "replaced by another file"
        except FileNotFoundError:
            what = "moved away"
        except OSError as exc:
            what = f"unreadable ({_cause(exc)})"
        if what:
            if what.startswith(("moved", "replaced")):
                advice = "put the log back where it was and start deo again to adopt its workers"
            else:  # its records are gone: a new log would not know the workers still running
                advice = (
                    f"restore it from a copy and start deo again to adopt its workers, or stop "
                    f"them and remove {snapshot_path(self.path).name} to start afresh"
                )
            self._failed = LogWriteFailed(
                f"{self.path}: the log was {what} while deo ran: nothing more is written or "
                f"carried out; {advice}"
            )
            raise self._failed

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
        """Write ``state`` as of everything flushed so far, atomically, beside the log.

        The snapshot names the log bytes it covers by their length and SHA-256, and carries the
        SHA-256 of its state with them: recovery uses it only when both still match.
        """
        self.flush()
        state_json = orjson.dumps(encode(state))
        if self.segment_bytes and self._size_bytes >= self.segment_bytes:
            self._rotate(state_json)
        log_sha256 = self._digest.hexdigest()
        payload = {
            "schema": SCHEMA_VERSION,
            "header": self._header,
            "seq": self._seq,
            "offset": self._size_bytes,
            "lines": self._lines,
            "log_sha256": log_sha256,
            "state_sha256": _state_digest(log_sha256, state_json),
            "state": orjson.Fragment(state_json),
        }
        target = snapshot_path(self.path)
        tmp = target.with_name(target.name + ".tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, FILE_MODE)
            try:
                _write_all(fd, orjson.dumps(payload))
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, target)
        except OSError as exc:
            with contextlib.suppress(OSError):
                tmp.unlink()
            self._failed = LogWriteFailed(f"{target}: cannot write the snapshot: {_cause(exc)}")
            raise self._failed from None
        self._since_snapshot = 0

    def _rotate(self, state_json: bytes) -> None:
        """Make the log the next numbered segment and start ``LOG`` again with the same header
        and a state record (the state the new segment continues from); drop old segments."""
        earlier = segments(self.path)
        number = _segment_number(earlier[-1], self.path) + 1 if earlier else 1
        finished = self.path.with_name(f"{self.path.name}.{number:06d}")
        start = self._header.encode() + _state_line(self._seq, state_json)
        following = self.path.with_name(self.path.name + ".next")
        fd = os.open(following, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, FILE_MODE)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            _write_all(fd, start)
            os.fsync(fd)
            # The finished segment keeps its bytes under its new name first; a crash before the
            # switch leaves both names on one file, which opening the log undoes.
            os.link(self.path, finished)
            os.replace(following, self.path)
            fsync_directory(self.path.parent)
        except OSError as exc:
            os.close(fd)
            with contextlib.suppress(OSError):
                following.unlink()
            self._failed = LogWriteFailed(f"{self.path}: cannot start a new segment: {_cause(exc)}")
            raise self._failed from None
        os.close(self._fd)
        self._fd = fd
        self._size_bytes = len(start)
        self._digest = hashlib.sha256(start)
        self._lines = 2
        if self.keep_segments is not None:
            kept = segments(self.path)
            for old in kept[: max(0, len(kept) - self.keep_segments)]:
                old.unlink(missing_ok=True)

    def close(self) -> None:
        """Flush (unless writing already failed) and close."""
        try:
            if self._failed is None:
                self.flush()
        finally:
            os.close(self._fd)

    def __enter__(self) -> EventLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def segments(path: Path) -> list[Path]:
    """The earlier segments of the log at ``path`` (``path.000001``, ...), oldest first."""
    found = []
    for candidate in path.parent.glob(f"{glob.escape(path.name)}.*"):
        suffix = candidate.name[len(path.name) + 1 :]
        if len(suffix) >= 6 and suffix.isdigit():
            found.append(candidate)
    return sorted(found, key=lambda segment: _segment_number(segment, path))


def _segment_number(segment: Path, path: Path) -> int:
    return int(segment.name[len(path.name) + 1 :])


def _state_line(seq: int, state_json: bytes) -> bytes:
    """The record a segment's second line holds: the state after seq ``seq``."""
    return orjson.dumps({"kind": "state", "seq": seq, "state": orjson.Fragment(state_json)}) + b"\n"


def segment_start(path: Path) -> tuple[Any, int, int, int] | None:
    """(encoded state, seq, offset, lines) of the state record a segment starts with (its second
    line), or None when it has none (the first segment, or an unreadable second line)."""
    with path.open("rb") as f:
        header = f.readline()
        line = f.readline()
    try:
        record = orjson.loads(line)
    except orjson.JSONDecodeError:
        return None
    if type(record) is not dict or record.get("kind") != "state" or not line.endswith(b"\n"):
        return None
    seq = record.get("seq")
    if type(seq) is not int or seq < 0 or "state" not in record:
        return None
    return record["state"], seq, len(header) + len(line), 2


def _finish_rotation(path: Path) -> None:
    """Undo a rotation a crash interrupted: the newest segment still being the log itself."""
    path.with_name(path.name + ".next").unlink(missing_ok=True)
    earlier = segments(path)
    if earlier and os.path.samefile(earlier[-1], path):
        earlier[-1].unlink()


def fsync_directory(directory: Path) -> None:
    """Make the entries of ``directory`` durable (a rename or a new file in it)."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _cause(exc: OSError) -> str:
    """What went wrong, as the OS says it: "No space left on device (ENOSPC)"."""
    name = errno.errorcode.get(exc.errno or 0)
    text = exc.strerror or str(exc)
    return f"{text} ({name})" if name else text


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _digest_of(path: Path, size_bytes: int) -> Any:
    """SHA-256 (a running hashlib object) of the first ``size_bytes`` bytes of ``path``."""
    digest = hashlib.sha256()
    left = size_bytes
    with path.open("rb") as f:
        while left > 0:
            chunk = f.read(min(left, 1 << 20))
            if not chunk:
                break
            digest.update(chunk)
            left -= len(chunk)
    return digest


def _state_digest(log_sha256: str, state_json: bytes) -> str:
    return hashlib.sha256(log_sha256.encode() + b"\n" + state_json).hexdigest()


def log_header(path: Path) -> dict[str, Any] | None:
    """The header ``path`` starts with, as written (None: its first line is not a deo log
    header; OSError where it cannot be read)."""
    with path.open("rb") as f:
        first = f.readline(_MAX_HEADER_BYTES)
    if not first.endswith(b"\n"):
        return None
    try:
        record = orjson.loads(first)
    except orjson.JSONDecodeError:
        return None
    return record if type(record) is dict and record.get("kind") == "header" else None


def _check_is_log(path: Path, simulated: bool) -> None:
    """Raise :class:`NotALog` unless ``path`` is empty, starts with a deo header of a run of
    the opener's kind (simulated or not), or holds only the start of one (torn by a crash while
    it was written)."""
    with path.open("rb") as f:
        first = f.readline(_MAX_HEADER_BYTES)
    if not first:
        return
    if not first.endswith(b"\n"):
        if len(first) < _MAX_HEADER_BYTES and (
            _HEADER_START.startswith(first) or first.startswith(_HEADER_START)
        ):
            return  # a torn header: recovery sets it aside
    else:
        record = log_header(path)
        if record is not None:
            header = _header(record, 1)
            if isinstance(header, LogProblem):
                raise DeoError(f"{path}: {header}; the log is left as it is")
            if (record.get("world") == SIMULATED) != simulated:
                whose = "a simulated run (deo simulate)" if not simulated else "a real run"
                raise NotALog(
                    f"{path} is the log of {whose}, whose workers, GPUs and clock are not "
                    f"this run's; it is left as it is: point deo.log in the configuration at a "
                    f"new file"
                )
            return
    raise NotALog(
        f"{path} is not a deo log (its first line is not a deo log header); it is left as it "
        f"is: point deo.log in the configuration at a new file or at a deo log"
    )


def _check_no_orphaned_workers(path: Path, alive: Callable[[int, int], bool]) -> None:
    """Raise :class:`LogDamaged` where the snapshot beside a new log at ``path`` names workers
    that still run (``alive(pid, start_time)``): the log they were recorded in was removed or
    moved, and a new one would start its workers beside them. A snapshot that cannot be read,
    or whose workers have all exited, is another log's leftover."""
    target = snapshot_path(path)
    try:
        workers = orjson.loads(target.read_bytes())["state"]["workers"]
        running = [
            worker_id
            for worker_id, worker in workers.items()
            if type(worker.get("pid")) is int
            and type(worker.get("start_time")) is int
            and alive(worker["pid"], worker["start_time"])
        ]
    except (OSError, orjson.JSONDecodeError, KeyError, TypeError, AttributeError):
        return
    if running:
        raise LogDamaged(
            f"{path} is new, but {target.name} beside it names {len(running)} worker(s) of an "
            f"earlier log at this path that still run ({', '.join(sorted(running)[:5])}): that "
            f"log was removed or moved. Put it back, or stop them and remove {target} to start "
            f"afresh"
        )


def _load_snapshot(
    path: Path, types: Mapping[str, type]
) -> tuple[tuple[State, int, int, int] | None, str | None]:
    """((state, seq, offset, lines), None) from the snapshot beside ``path`` when it fits the
    log, else (None, why it was not used) (None, None when there is none)."""
    target = snapshot_path(path)
    try:
        raw = target.read_bytes()
    except FileNotFoundError:
        return None, None
    try:
        return _checked_snapshot(path, raw, types), None
    except Exception as exc:  # any failure to read or check a snapshot means: no snapshot
        why = str(exc) if isinstance(exc, _Unusable | DeoError) else repr(exc)
        return None, f"{target.name} ignored ({why}); the state is rebuilt from the whole log"


class _Unusable(DeoError):
    """Why a snapshot cannot be used."""


def _checked_snapshot(
    path: Path, raw: bytes, types: Mapping[str, type]
) -> tuple[State, int, int, int]:
    payload = orjson.loads(raw)
    if not isinstance(payload, dict) or payload.get("schema") != SCHEMA_VERSION:
        raise _Unusable("not a snapshot of this schema")
    if payload.get("header") != _first_line(path):
        raise _Unusable("it belongs to another log")
    seq, offset, lines = payload.get("seq"), payload.get("offset"), payload.get("lines")
    if not all(type(n) is int and n >= 0 for n in (seq, offset, lines)):
        raise _Unusable("its seq, offset or lines are not counts")
    assert isinstance(seq, int) and isinstance(offset, int) and isinstance(lines, int)
    log_sha256 = payload.get("log_sha256")
    state_sha256 = payload.get("state_sha256")
    if not isinstance(log_sha256, str) or not isinstance(state_sha256, str):
        raise _Unusable("it carries no digests")
    if offset > path.stat().st_size:
        raise _Unusable(f"it covers {offset} bytes, the log has fewer")
    if _digest_of(path, offset).hexdigest() != log_sha256:
        raise _Unusable(f"the first {offset} bytes of the log are not those it was taken after")
    state_json = orjson.dumps(payload.get("state"))
    if _state_digest(log_sha256, state_json) != state_sha256:
        raise _Unusable("its state does not match its digest: edited or damaged")
    state = decode(payload["state"], types)
    if not isinstance(state, State):
        raise _Unusable(f"it holds a {type(state).__name__}, not a state")
    return state, seq, offset, lines


def _recover(
    path: Path, policies: PolicyCatalog
) -> tuple[Recovery, int, int, list[dict[str, Any]]]:
    """(what recovery found, last seq, lines, records to append) for a non-empty log; the log
    is changed (a torn tail cut and set aside) only once nothing can refuse it any more."""
    types = types_with(policies.records)
    snapshot, ignored = _load_snapshot(path, types)
    notes = [ignored] if ignored is not None else []
    if snapshot is None:
        snapshot = _segment_state(path, types)
    if snapshot is None:
        reader = LogReader(path, keep_bad_lines=True)
        state = State()
    else:
        state, seq, offset, lines = snapshot
        reader = LogReader(path, offset=offset, first_line=lines + 1, seq=seq, keep_bad_lines=True)
    reducer = Reducer(state, policies=policies)
    # The line from which the state holds a configuration (0: from the start).
    configured_from: int | None = 0 if state.config != Config() else None
    replayed = 0
    problems = reader.problems
    last: EventRecord | None = None
    last_outcome: list[Command] | DeoError | None = None
    for record in reader.events():
        event = record.event
        before = reducer.state
        last, last_outcome = record, None
        try:
            produced = reducer.step(event)
        except DeoError as exc:
            last_outcome = exc
            if record.error is None:  # else refused at run time too, as the log records
                problems.append(not_reduced(record, exc))
                continue
        except Exception as exc:  # a bug in the reducer must not keep deo from starting
            problems.append(not_reduced(record, exc))
            continue
        else:
            last_outcome = produced
            if record.error is not None:
                # Refused when it happened: nothing came of it then, so nothing does now.
                reducer.state = before
                problems.append(
                    LogProblem(
                        record.line,
                        f"the log records its refusal ({record.error}) but the reducer accepts "
                        f"it now; its state is not kept",
                    )
                )
                continue
        if configured_from is None and reducer.state.config != Config():
            configured_from = record.line
        replayed += 1
    torn, lines = reader.torn, reader.lines
    if isinstance(reader.header, LogProblem) and reader.header is not torn:
        raise DeoError(f"{path}: {reader.header}")
    for line, raw in reader.bad_lines.items():
        if line == lines:
            continue  # the last line: written last, so nothing was carried out after it
        if _may_hold_configuration(raw, line, configured_from):
            problem = next(p for p in problems if p.line == line)
            raise LogDamaged(
                f"{path}: line {line} cannot be read ({problem.message}) and may have held the "
                f"configuration; deo does not start on a state without it (it would start "
                f"workers again beside those still running). Restore that line (or the "
                f"snapshot) from a backup, or stop this log's workers and move the log aside "
                f"to start a new one; `deo replay {path}` lists every unreadable line"
            )
    set_aside = None
    if torn is not None:
        # The last line is torn or corrupt: move its bytes aside and cut it from the log.
        start = _line_start(path, torn.line, reader.offset, lines_before=reader.first_line - 1)
        set_aside = path.with_name(f"{path.name}.torn-{torn.line}")
        with path.open("rb+") as f:
            f.seek(start)
            fd = os.open(set_aside, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
            with os.fdopen(fd, "wb") as aside:
                aside.write(f.read())
            f.truncate(start)
            f.flush()
            os.fsync(f.fileno())
        problems[problems.index(torn)] = LogProblem(
            torn.line, f"{torn.message}; set aside in {set_aside.name}"
        )
        lines = torn.line - 1
    repair: list[dict[str, Any]] = []
    # The log ends with an event whose commands it does not record: it was cut before the
    # record of them. Write what that event produces (a refusal is left reported).
    cut = last is not None and last.error is None and not last.commands
    if cut and isinstance(last_outcome, list) and last_outcome:
        assert last is not None
        repair.append({"kind": "commands", "cause": last.seq, "commands": encode(last_outcome)})
        notes.append(
            f"line {last.line}: the commands it produced were not in the log; written again "
            f"(not carried out: start-up reconciles the workers)"
        )
    ordered = tuple(sorted(problems, key=lambda problem: problem.line))
    recovery = Recovery(reducer.state, replayed, ordered, set_aside, tuple(notes))
    return recovery, reader.seq, lines, repair


def _segment_state(path: Path, types: Mapping[str, type]) -> tuple[State, int, int, int] | None:
    """(state, seq, offset, lines) from the state record a later segment starts with, or None
    for a first segment. Raises :class:`LogDamaged` when ``path`` is a later segment (its second
    line is a state record, or segments of the same log lie beside it) whose state cannot be
    used: the events of that segment alone lack the configuration and the workers it started."""
    begins = segment_start(path)
    why = "it is not a state record with a seq"
    if begins is not None:
        encoded, seq, offset, lines = begins
        try:
            state = decode(encoded, types)
        except Exception as exc:  # any failure to decode it leaves the segment without a start
            why = f"its state cannot be decoded: {exc}"
        else:
            if isinstance(state, State):
                return state, seq, offset, lines
            why = f"it holds a {type(state).__name__}, not a state"
    elif not _names_a_state(path) and not _has_earlier_segments(path):
        return None  # the first segment: it starts from nothing
    raise LogDamaged(
        f"{path}: line 2, the state this segment of the log starts from, cannot be used "
        f"({why}); deo does not start without it (it would start workers again beside those "
        f"still running). Restore that line (or the snapshot) from a backup, or stop this log's "
        f"workers and move the log and its segments aside to start a new one"
    )


def _has_earlier_segments(path: Path) -> bool:
    """Whether segments of this same log (the same header) lie beside ``path``: then it is a
    later segment, whatever its second line has become."""
    header = _first_line(path)
    return any(_first_line(segment) == header for segment in segments(path))


def _names_a_state(path: Path) -> bool:
    """Whether the second line of ``path`` is a record of kind ``state``, however damaged."""
    with path.open("rb") as f:
        f.readline()
        line = f.readline()
    try:
        record = orjson.loads(line)
    except orjson.JSONDecodeError:
        return b'"kind":"state"' in line
    return type(record) is dict and record.get("kind") == "state"


def _may_hold_configuration(raw: bytes, line: int, configured_from: int | None) -> bool:
    """Whether a line that cannot be used may have been a ``Configured`` event: it names one,
    or it is unreadable where the state had no configuration yet (before the first one read)."""
    try:
        record = orjson.loads(raw)
    except orjson.JSONDecodeError:
        record = None
    if type(record) is dict:
        kind, event = record.get("kind"), record.get("event")
        if kind in ("commands", "rejected"):
            return False
        if kind == "event" and type(event) is dict and type(event.get("@")) is str:
            return bool(event["@"] == "Configured")
    return b"Configured" in raw or configured_from is None or line < configured_from


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
