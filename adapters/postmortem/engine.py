"""Replay a log: re-reduce its events, check every recorded command comes out again, explain.

``replay(path)`` streams the log once and yields a :class:`Replayed` per event: the event, the
state before and after, what the log recorded and what the reducer produced now. Verification,
the timeline, ``--at``, ``--explain``, the SQLite export and ``--set`` are consumers of that stream.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import orjson

from adapters.log import (
    EventRecord,
    LogProblem,
    LogReader,
    not_reduced,
    segment_start,
    segments,
)
from adapters.runtime.config_file import literal, typed
from core import Command, Configured, DeoError, Event, State, decode, encode, reduce
from core.arbiter import PLANNER_SETTINGS_UNRECORDED, ArbiterGpusDeclared, PlannerSettings
from core.codec import TYPE_KEY, types_with
from core.config import CordonRules, PoolSpec
from core.errors import ConfigError
from core.policies import BUILT_INS, PolicyCatalog

__all__ = [
    "ConfigChange",
    "Replayed",
    "apply_settings",
    "parse_setting",
    "recorded_events",
    "replay",
    "state_difference",
]


# A mutable slots class: one is built per event of logs with millions of them, and a frozen
# attrs class costs several times as much to construct. Treat it as read-only.


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
    #: The log's last event, whose commands it does not record although the reducer produces
    #: some: deo stopped (a crash, a kill) before writing them, and a restart writes them
    #: (:meth:`~adapters.log.EventLog.open`). Not a divergence.
    cut: bool = False

    @property
    def matches(self) -> bool:
        if self.cut:
            return True
        if (self.recorded_error is None) != (self.produced_error is None):
            return False
        if not self.produced:
            return not self.recorded
        return bool(encode(self.produced) == self.recorded)


def replay(
    path: Path,
    *,
    problems: list[LogProblem],
    transform: Callable[[Event], Event] | None = None,
    policies: PolicyCatalog = BUILT_INS,
) -> Iterator[Replayed]:
    """Re-reduce every event of ``path`` with ``policies`` (those of the run that wrote it);
    lines that cannot be replayed go to ``problems``.

    Those are the lines :class:`~adapters.log.LogReader` cannot read, and events the reducer
    refuses although the log records no refusal for them (unless ``transform`` changed them:
    then a refusal is the change's doing, and is yielded like any other step).

    A rotated log is read segment by segment, oldest first (:func:`~adapters.log.segments`);
    the problems of an earlier segment name it. When the first segment there is starts from a
    state (its earlier ones were dropped), replay starts from that state, with ``transform``'s
    changes to the configuration and the arbiter's planner it holds (declared again at its
    time, as ``deo run`` would on a reload; the commands that would follow are not listed, and
    a change the reducer refuses there raises :class:`~core.DeoError`);
    each later segment's state must be the one replayed up to it (unless ``transform`` changed
    what was replayed). The last event is marked :attr:`Replayed.cut` where the log ends
    before its commands.
    """
    last: Replayed | None = None
    for step in _replayed(path, problems, transform, policies):
        if last is not None:
            yield last
        last = step
    if last is not None:
        produced = bool(last.produced) and last.produced_error is None
        last.cut = produced and not last.recorded and last.recorded_error is None
        yield last


def _replayed(
    path: Path,
    problems: list[LogProblem],
    transform: Callable[[Event], Event] | None,
    policies: PolicyCatalog,
) -> Iterator[Replayed]:
    earlier = _earlier_segments(path)
    problems.extend(_foreign_segments(path))
    state = State()
    seq = 0
    changed = False  # whether ``transform`` changed anything replayed so far
    for index, file in enumerate([*earlier, path]):
        found: list[LogProblem] = problems if file == path else []
        begins = segment_start(file)
        if begins is not None:
            encoded, start_seq, _, _ = begins
            gap = index > 0 and start_seq > seq
            if gap:
                found.append(
                    LogProblem(
                        2,
                        f"records {seq + 1} to {start_seq} are not in the log (a segment before "
                        f"this one was removed, or its last lines cannot be read); replayed on "
                        f"from the state this one starts from",
                    )
                )
            if index == 0 or gap:
                # The segments before this one were dropped: start from the state it records.
                try:
                    start = decode(encoded, types_with(policies.records))
                except Exception as exc:  # then from nothing, with the reason
                    found.append(LogProblem(2, f"unreadable state record ({exc!r})"))
                else:
                    if isinstance(start, State):
                        state, seq = start, start_seq
                        if transform is not None:
                            restated = _restated(state, transform, policies)
                            changed = restated is not state
                            state = restated
            elif not changed:  # once a change applied, the replayed state differs by design
                difference = state_difference(encoded, encode(state))
                if difference is not None:
                    message = (
                        f"the state this segment starts from is not the one replayed ({difference})"
                    )
                    found.append(LogProblem(2, message))
        reader = _segment_reader(file, begins, seq, found)
        for record in reader.events():
            before = state
            event = transform(record.event) if transform is not None else record.event
            changed = changed or (event is not record.event and event != record.event)
            try:
                state, produced = reduce(before, event, policies)
                error = None
            except DeoError as exc:
                produced, error = [], str(exc)
                if record.error is None and not record.commands and transform is None:
                    found.append(not_reduced(record, exc))
                    continue
            except Exception as exc:  # a bug in the reducer: reported like a bad line, not raised
                found.append(not_reduced(record, exc))
                continue
            yield Replayed(
                line=record.line,
                seq=record.seq,
                event=event,
                before=before,
                after=state,
                recorded=record.commands,
                recorded_error=record.error,
                produced=produced,
                produced_error=error,
            )
        seq = reader.seq
        if found is not problems:
            problems.extend(LogProblem(p.line, f"{p.message} (in {file.name})") for p in found)


def _restated(state: State, transform: Callable[[Event], Event], policies: PolicyCatalog) -> State:
    """``state`` (a replay's start) with ``transform``'s changes: its configuration and its
    arbiter's planner declared again, changed, through the reducer, which raises
    :class:`~core.DeoError` where it refuses the change there; ``state`` itself where nothing
    changed."""
    declared: list[Event] = [Configured(t=state.now, config=state.config)]
    if state.arbiter.gpus:
        arbiter = state.arbiter
        declared.append(
            ArbiterGpusDeclared(t=state.now, gpus=arbiter.gpus, planner=arbiter.planner)
        )
    for event in declared:
        altered = transform(event)
        if altered != event:
            state, _ = reduce(state, altered, policies)
    return state


def recorded_events(path: Path, *, problems: list[LogProblem]) -> Iterator[EventRecord]:
    """Every event the log at ``path`` accepted, segments oldest first, with the commands it
    recorded for it, as written: nothing is re-reduced, so a log written by another version of
    deo, or under other policy settings, reads as it ran. Events it refused are left out; lines
    that cannot be read go to ``problems``."""
    seq = 0
    for file in [*_earlier_segments(path), path]:
        found: list[LogProblem] = problems if file == path else []
        reader = _segment_reader(file, segment_start(file), seq, found)
        for record in reader.events():
            if record.error is None:
                yield record
        seq = reader.seq
        if found is not problems:
            problems.extend(LogProblem(p.line, f"{p.message} (in {file.name})") for p in found)


def _segment_reader(
    file: Path, begins: tuple[Any, int, int, int] | None, seq: int, problems: list[LogProblem]
) -> LogReader:
    """A reader of one segment's records after the state it starts from (``begins``, from
    :func:`~adapters.log.segment_start`), if any."""
    if begins is None:
        return LogReader(file, seq=seq, problems=problems)
    _, _, offset, lines = begins
    return LogReader(file, offset=offset, first_line=lines + 1, seq=seq, problems=problems)


def _earlier_segments(path: Path) -> list[Path]:
    """The rotated segments of the log at ``path`` (same header), oldest first."""
    with path.open("rb") as f:
        header = f.readline()
    return [
        segment
        for segment in segments(path)
        # A rotation cut short by a crash leaves the segment a second name of the live log.
        if _first_line(segment) == header and not segment.samefile(path)
    ]


def _foreign_segments(path: Path) -> list[LogProblem]:
    """A problem for each file named as a segment of the log at ``path`` that is none: another
    log's, or damaged where its header is (it is left out of the replay)."""
    kept = set(_earlier_segments(path))
    return [
        LogProblem(1, f"not a segment of {path.name} (its header differs); left out (in {s.name})")
        for s in segments(path)
        if s not in kept and not s.samefile(path)
    ]


def state_difference(recorded: Any, replayed: Any, where: str = "state") -> str | None:
    """Where the ``recorded`` encoded state first differs from the ``replayed`` one (encoded too),
    or None when they agree.

    A field of a record (an object with its class under ``"@"``) that the recorded one lacks is
    one added to deo after the log was written: the replayed value is not compared (the codec
    gives the old record its default, which need not be what the replay computed, e.g. the
    drains a pool measured). Everything the record does hold must be equal: the same class, the
    same fields, the same keys in every mapping, lists of the same length, equal values.
    """
    if type(recorded) is dict and type(replayed) is dict:
        is_record = TYPE_KEY in recorded
        if recorded.get(TYPE_KEY) != replayed.get(TYPE_KEY):
            return (
                f"{where} is a {recorded.get(TYPE_KEY)} in the log, a {replayed.get(TYPE_KEY)} now"
            )
        for key, value in recorded.items():
            if key not in replayed:
                return f"{where}.{key} is in the log, not in the replayed state"
            found = state_difference(value, replayed[key], f"{where}.{key}")
            if found is not None:
                return found
        if not is_record:
            extra = sorted(str(key) for key in replayed.keys() - recorded.keys())
            if extra:
                return f"{where}.{extra[0]} is in the replayed state, not in the log"
        return None
    if type(recorded) is list and type(replayed) is list:
        if len(recorded) != len(replayed):
            return f"{where} has {len(recorded)} items in the log, {len(replayed)} replayed"
        for index, (old, new) in enumerate(zip(recorded, replayed, strict=True)):
            found = state_difference(old, new, f"{where}[{index}]")
            if found is not None:
                return found
        return None
    if recorded != replayed:
        return f"{where} is {_short(recorded)} in the log, {_short(replayed)} replayed"
    return None


def _short(value: Any) -> str:
    text = orjson.dumps(value).decode()
    return text if len(text) <= 60 else f"{text[:57]}..."


def _first_line(path: Path) -> bytes:
    with path.open("rb") as f:
        return f.readline()


# --- replaying under changed configuration -----------------------------------------------------


def parse_setting(text: str) -> tuple[list[str], Any]:
    """``"pools.envs.max_workers=4"`` -> (["pools", "envs", "max_workers"], 4).

    The value is read as ``deo simulate --set`` reads it: a TOML literal (numbers, booleans,
    quoted strings, lists, inline tables) where it parses, else the text itself.
    """
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise ValueError(f"--set {text!r}: expected key=value, e.g. pools.envs.max_workers=4")
    return key.split("."), literal(raw)


def apply_settings(settings: list[tuple[list[str], Any]]) -> ConfigChange:
    """A transform that changes every ``Configured`` event's configuration by ``settings``, and
    every ``ArbiterGpusDeclared`` event's planner settings.

    Keys: ``pools.NAME.FIELD`` (e.g. ``max_workers``, ``stabilization_s``), ``pools.NAME.policy``
    or ``pools.NAME.policy.name`` (a policy name), ``pools.NAME.policy.PARAM``, ``gpus``,
    ``cordon.FIELD``,
    ``arbiter.planner.FIELD`` (a field of :class:`~core.arbiter.PlannerSettings`: ``name``,
    ``hysteresis``, ``reserve_s``, ...; a log that recorded no planner settings gets the ones it
    replays with, changed). A pool named in a key but absent from a configuration is left alone
    there (:meth:`ConfigChange.unmatched_pools` names those no configuration had). Raises
    :class:`ValueError` for an unknown planner setting or a value it refuses.
    """
    config_settings = [(path, value) for path, value in settings if path[0] != "arbiter"]
    planner = _planner_changes([(path, value) for path, value in settings if path[0] == "arbiter"])
    return ConfigChange(config_settings, planner)


@attrs.define(slots=True)
class ConfigChange:
    """:func:`apply_settings`' transform: call it on each event replayed."""

    config_settings: list[tuple[list[str], Any]]
    planner: dict[str, Any]
    #: The settings (by index) naming a pool that some configuration replayed had.
    matched: set[int] = attrs.field(factory=set)

    def __call__(self, event: Event) -> Event:
        if isinstance(event, ArbiterGpusDeclared) and self.planner:
            recorded = event.planner or PLANNER_SETTINGS_UNRECORDED
            return attrs.evolve(event, planner=attrs.evolve(recorded, **self.planner))
        if not isinstance(event, Configured) or not self.config_settings:
            return event
        data = encode(event.config)
        for index, (path, value) in enumerate(self.config_settings):
            if _set(data, path, value):
                self.matched.add(index)
        config = decode(data)
        return attrs.evolve(event, config=config)

    def unmatched_pools(self) -> list[str]:
        """Pools the settings name that no configuration replayed so far had."""
        return sorted(
            {
                path[1]
                for index, (path, _) in enumerate(self.config_settings)
                if path[0] == "pools" and index not in self.matched
            }
        )


def _planner_changes(settings: list[tuple[list[str], Any]]) -> dict[str, Any]:
    """``arbiter.planner.FIELD=VALUE`` settings as PlannerSettings fields, each checked now."""
    fields = [f.name for f in attrs.fields(PlannerSettings)]
    changes: dict[str, Any] = {}
    for path, value in settings:
        key = ".".join(path)
        if len(path) != 3 or path[1] != "planner":
            raise ValueError(f"--set {key}: unknown key (arbiter.planner.FIELD)")
        if path[2] not in fields:
            raise ValueError(
                f"--set {key}: the arbiter's planner has no setting {path[2]!r} (its settings: "
                f"{', '.join(fields)})"
            )
        changes[path[2]] = value
    for base in (PlannerSettings(), PLANNER_SETTINGS_UNRECORDED):
        try:
            attrs.evolve(base, **changes)
        except DeoError as exc:
            raise ValueError(f"--set arbiter.planner: {exc}") from None
    return changes


#: The annotations of a pool's and the cordon rules' fields, for checking a setting's type.
POOL_FIELD_HINTS = typing.get_type_hints(PoolSpec)
CORDON_FIELD_HINTS = typing.get_type_hints(CordonRules)
_SCALARS = (bool, int, float, str)


def _scalar(key: str, value: Any, hint: Any) -> Any:
    """``value`` checked against a scalar field's annotation (a number where a whole number
    belongs is refused, not replayed as one); other fields' values go to the codec as given."""
    options = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    if not all(option in _SCALARS or option is type(None) for option in options):
        return value
    try:
        return typed(f"--set {key}", value, hint)
    except ConfigError as exc:
        raise ValueError(str(exc)) from None


def _set(data: dict[str, Any], path: list[str], value: Any) -> bool:
    """Apply one setting to an encoded configuration; whether it named a pool it has."""
    head, *rest = path
    key = ".".join(path)
    if head == "pools":
        if len(rest) < 2:
            raise ValueError(f"--set {key}: expected pools.NAME.FIELD")
        name, *field = rest
        # A pool name may hold dots itself ("team.envs"): the longest one the key starts with.
        dotted = ".".join(rest)
        for pool in sorted(data["pools"], key=lambda pool: -len(pool["name"])):
            if dotted.startswith(pool["name"] + ".") and pool["name"].count(".") > 0:
                name, field = pool["name"], dotted[len(pool["name"]) + 1 :].split(".")
                break
        for pool in data["pools"]:
            if pool["name"] != name:
                continue
            if field in (["policy"], ["policy", "name"]):
                if not isinstance(value, str):
                    raise ValueError(
                        f"--set {key}: a policy's name (set its parameters one by one: "
                        f"pools.{name}.policy.PARAM=VALUE)"
                    )
                # Another policy starts from its own defaults: the old one's parameters may
                # not be its own.
                same = pool["policy"]["name"] == value
                params = pool["policy"]["params"] if same else {}
                pool["policy"] = {"@": "PolicySpec", "name": value, "params": params}
            elif field[0] == "policy" and len(field) == 2:
                pool["policy"]["params"][field[1]] = value
            elif len(field) == 1 and field[0] in pool:
                pool[field[0]] = _scalar(key, value, POOL_FIELD_HINTS[field[0]])
            else:
                raise ValueError(f"--set {key}: pools have no field {'.'.join(field)}")
            return True
        return False
    if head == "gpus" and not rest:
        gpus = value if isinstance(value, list) else str(value).split(",")
        if not gpus or not all(isinstance(g, str | int) and str(g).strip() for g in gpus):
            raise ValueError(f'--set {key}: a list of GPU ids, e.g. gpus=0,1 or gpus=["0"]')
        if gpus == ["auto"]:
            # Discovery asks NVML at start-up; a replay has only the GPUs the log recorded.
            raise ValueError(f"--set {key}=auto: a replay cannot discover GPUs; list their ids")
        data["gpus"] = [str(g).strip() for g in gpus]
        return False
    if head == "cordon" and len(rest) == 1 and rest[0] in data["cordon"]:
        data["cordon"][rest[0]] = _scalar(key, value, CORDON_FIELD_HINTS[rest[0]])
        return False
    raise ValueError(
        f"--set {'.'.join(path)}: unknown key (pools.NAME.FIELD, gpus, cordon.FIELD, "
        "arbiter.planner.FIELD)"
    )
