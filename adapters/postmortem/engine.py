"""Replay a log: re-reduce its events, check every recorded command comes out again, explain.

``replay(path)`` streams the log once and yields a :class:`Replayed` per event: the event, the
state before and after, what the log recorded and what the reducer produced now. Verification,
the timeline, ``--at``, ``--explain``, the SQLite export and ``--set`` are consumers of that stream.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import orjson

from adapters.log import Line, LogProblem, check_header, read_lines
from core import Command, Configured, DeoError, Event, State, decode, encode, reduce
from core.policies import BUILT_INS, PolicyCatalog

__all__ = ["Replayed", "apply_settings", "parse_setting", "replay"]


# Mutable slots classes: they are built once per record of logs with millions of them, and a
# frozen attrs class costs several times as much to construct. Treat them as read-only.


@attrs.define(slots=True)
class Replayed:
    """One event of the log, re-reduced (read-only)."""

    line: int
    seq: int
    event: Event
    before: State
    after: State
    #: Commands as the log recorded them (encoded), and the refusal it recorded, if any.
    recorded: list[Any]
    recorded_error: str | None
    #: Commands the reducer produces now, and its refusal now, if any.
    produced: list[Command]
    produced_error: str | None

    @property
    def matches(self) -> bool:
        if (self.recorded_error is None) != (self.produced_error is None):
            return False
        if not self.produced:
            return not self.recorded
        return bool(encode(self.produced) == self.recorded)


@attrs.define(slots=True)
class _Pending:
    line: int
    seq: int
    event: Event
    recorded: list[Any] = attrs.field(factory=list)
    error: str | None = None


def replay(
    path: Path,
    *,
    problems: list[LogProblem],
    transform: Callable[[Event], Event] | None = None,
    policies: PolicyCatalog = BUILT_INS,
) -> Iterator[Replayed]:
    """Re-reduce every event of ``path`` with ``policies`` (those of the run that wrote it);
    unreadable lines are appended to ``problems``."""
    state = State()
    pending: _Pending | None = None

    def finish(item: _Pending) -> Replayed:
        nonlocal state
        before = state
        event = transform(item.event) if transform is not None else item.event
        try:
            state, produced = reduce(before, event, policies)
            error = None
        except DeoError as exc:
            produced, error = [], str(exc)
        return Replayed(
            line=item.line,
            seq=item.seq,
            event=event,
            before=before,
            after=state,
            recorded=item.recorded,
            recorded_error=item.error,
            produced=produced,
            produced_error=error,
        )

    for item in read_lines(path):
        if isinstance(item, LogProblem):
            problems.append(item)
            continue
        if item.number == 1:
            problem = check_header(item)
            if problem is not None:
                problems.append(problem)
            if item.record.get("kind") == "header":
                continue
        parsed = _parse(item, problems)
        if parsed is None:
            continue
        kind, value = parsed
        if kind == "event":
            if pending is not None:
                yield finish(pending)
            pending = value
        elif pending is None or value[0] != pending.seq:
            problems.append(
                LogProblem(item.number, f"{kind} record for an event not just before it")
            )
        elif kind == "commands":
            pending.recorded = value[1]
        else:
            pending.error = value[1]
    if pending is not None:
        yield finish(pending)


def _parse(item: Line, problems: list[LogProblem]) -> tuple[str, Any] | None:
    record = item.record
    kind = record.get("kind")
    seq = record.get("seq")
    if not isinstance(seq, int):
        problems.append(LogProblem(item.number, "record without an integer seq"))
        return None
    try:
        if kind == "event":
            event = decode(record["event"])
            if not isinstance(event, Event):
                raise DeoError(f"{type(event).__name__} is not an event")
            return "event", _Pending(line=item.number, seq=seq, event=event)
        if kind == "commands":
            commands = record["commands"]
            if not isinstance(commands, list):
                raise DeoError("commands is not a list")
            return "commands", (record["cause"], commands)
        if kind == "rejected":
            return "rejected", (record["cause"], str(record["error"]))
    except KeyError as exc:
        problems.append(LogProblem(item.number, f"{kind} record without {exc}"))
        return None
    except DeoError as exc:
        problems.append(LogProblem(item.number, str(exc)))
        return None
    problems.append(LogProblem(item.number, f"unknown record kind {kind!r}"))
    return None


# --- replaying under changed configuration -----------------------------------------------------


def parse_setting(text: str) -> tuple[list[str], Any]:
    """``"pools.envs.max_workers=4"`` -> (["pools", "envs", "max_workers"], 4).

    The value is read as JSON when it parses (numbers, booleans, lists), else as a string.
    """
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise ValueError(f"--set {text!r}: expected key=value, e.g. pools.envs.max_workers=4")
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError:
        value = raw
    return key.split("."), value


def apply_settings(settings: list[tuple[list[str], Any]]) -> Callable[[Event], Event]:
    """A transform that changes every ``Configured`` event's configuration by ``settings``.

    Keys: ``pools.NAME.FIELD`` (e.g. ``max_workers``, ``stabilization_s``), ``pools.NAME.policy``
    (a policy name), ``pools.NAME.policy.PARAM``, ``gpus``, ``cordon.FIELD``. A pool named in a
    key but absent from a configuration is left alone there.
    """

    def transform(event: Event) -> Event:
        if not isinstance(event, Configured):
            return event
        data = encode(event.config)
        for path, value in settings:
            _set(data, path, value)
        config = decode(data)
        return attrs.evolve(event, config=config)

    return transform


def _set(data: dict[str, Any], path: list[str], value: Any) -> None:
    head, *rest = path
    if head == "pools":
        if len(rest) < 2:
            raise ValueError(f"--set {'.'.join(path)}: expected pools.NAME.FIELD")
        name, *field = rest
        for pool in data["pools"]:
            if pool["name"] == name:
                if field == ["policy"]:
                    pool["policy"] = {"@": "PolicySpec", "name": value, "params": {}}
                elif field[0] == "policy" and len(field) == 2:
                    pool["policy"]["params"][field[1]] = value
                elif len(field) == 1 and field[0] in pool:
                    pool[field[0]] = value
                else:
                    raise ValueError(
                        f"--set {'.'.join(path)}: pools have no field {'.'.join(field)}"
                    )
        return
    if head == "gpus" and not rest:
        data["gpus"] = value if isinstance(value, list) else str(value).split(",")
        return
    if head == "cordon" and len(rest) == 1 and rest[0] in data["cordon"]:
        data["cordon"][rest[0]] = value
        return
    raise ValueError(f"--set {'.'.join(path)}: unknown key (pools.NAME.FIELD, gpus, cordon.FIELD)")
