"""Typed attrs converters, and the field checks every event and command runs on construction.

The converters turn decoded lists back into the tuples and frozensets they were. The checks are
derived once per class from its field annotations (:func:`field_checks`): each field's value must
be of its annotated type, and in range where the annotation says so (:data:`Seconds`,
:data:`Name`). Events and commands keep a checker generated from them on their class
(:func:`field_checker`) and run it in ``__attrs_post_init__``, so a record built by hand and one
decoded from the log are checked alike.
"""

from __future__ import annotations

import enum
import math
import re
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from typing import Annotated, Any, ClassVar, cast

import attrs

from core.errors import InvalidEvent

__all__ = [
    "MAX_COUNT",
    "CheckedRecord",
    "FieldCheck",
    "Name",
    "UrlName",
    "Seconds",
    "field_checker",
    "field_checks",
    "int_tuple",
    "member_of",
    "str_set",
    "str_tuple",
]

#: Counts must fit the log's JSON integers (64-bit signed).
MAX_COUNT = 2**63 - 1


def str_tuple(value: Iterable[str]) -> tuple[str, ...]:
    if isinstance(value, list | tuple):
        return tuple(value)
    # Anything else (a bare string, a number) is kept as it is for the field check to name;
    # ``tuple`` would split a string into characters.
    return cast(tuple[str, ...], value)


def int_tuple(value: Iterable[int]) -> tuple[int, ...]:
    return tuple(value) if isinstance(value, list | tuple) else cast(tuple[int, ...], value)


def str_set(value: Iterable[str]) -> frozenset[str]:
    if isinstance(value, list | tuple | set | frozenset):
        try:
            return frozenset(value)
        except TypeError:  # unhashable members: kept as they are for the field check to name
            pass
    return cast(frozenset[str], value)


E = typing.TypeVar("E", bound=enum.Enum)


def member_of(vocabulary: type[E]) -> Callable[[Any], E]:
    """A converter to ``vocabulary``'s member spelt by a value; any other value is kept as it is,
    for the field check to name (``RaiseAlert.alert must be one of ..., got 'x'``)."""
    members = vocabulary._value2member_map_

    def convert(value: Any) -> E:
        try:
            return cast(E, members.get(value, value))
        except TypeError:  # unhashable
            return cast(E, value)

    return convert


class _Range(enum.Enum):
    """What an annotation adds to its type's check (used as ``Annotated`` metadata)."""

    NON_NEGATIVE = "non-negative"
    NON_EMPTY = "non-empty"
    URL_SAFE = "url-safe"


#: A time in seconds: a finite number >= 0 (``t``, deadlines).
Seconds = Annotated[float, _Range.NON_NEGATIVE]
#: The name of a pool, worker or GPU: a non-empty string.
Name = Annotated[str, _Range.NON_EMPTY]
#: A name that is a segment of an API path (an arbiter pipeline's or cluster's): 1-64 of
#: ``A-Z a-z 0-9 . _ -``.
UrlName = Annotated[str, _Range.URL_SAFE]
_URL_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")


class FieldCheck(typing.NamedTuple):
    """One field's check: ``accepts(value)`` is False when the value does not fit."""

    name: str
    accepts: Callable[[Any], bool]
    #: What the field must be, for the error message ("an integer in [0, 2**63)").
    expected: str
    #: A Python expression over ``v``, true for the common values that fit (exact types), so
    #: the usual case costs no call; when it is false, ``accepts`` decides.
    fast: str = "False"


def field_checks(cls: type) -> tuple[FieldCheck, ...]:
    """The checks of every attrs field of ``cls``, from its resolved annotations.

    :class:`TypeError` for an annotation no check is known for, so no field goes unchecked.
    """
    hints = typing.get_type_hints(cls, include_extras=True)
    checks = []
    for field in attrs.fields(cls):
        try:
            accepts, expected, fast = _check_for(hints[field.name])
        except TypeError as exc:
            raise TypeError(f"{cls.__name__}.{field.name}: {exc}") from None
        checks.append(FieldCheck(field.name, accepts, expected, fast))
    return tuple(checks)


def field_checker(cls: type, error: type[Exception]) -> Callable[[Any], None]:
    """A function that checks every field of an instance of ``cls`` (:func:`field_checks`) and
    raises ``error`` naming the class, the field and the value of the first one that fails.

    Generated once per class, as attrs generates ``__init__``: every construction runs it.
    """
    checks = field_checks(cls)
    namespace: dict[str, Any] = {
        "_fail": _fail,
        "_checks": checks,
        "_error": error,
        "_inf": math.inf,
    }
    lines = ["def check_fields(record):"]
    for i, check in enumerate(checks):
        namespace[f"_accepts_{i}"] = check.accepts
        lines += [
            f"    v = record.{check.name}",
            f"    if not ({check.fast}) and not _accepts_{i}(v):",
            f"        _fail(record, _checks[{i}], v, _error)",
        ]
    lines.append("    return None")
    exec("\n".join(lines), namespace)  # built from the class's own field names only
    checker: Callable[[Any], None] = namespace["check_fields"]
    return checker


@attrs.frozen(slots=True, kw_only=True)
class CheckedRecord:
    """Base of events and commands: the one hook that checks every field on construction.

    Each subclass gets a checker generated from its annotations when the class is made
    (:func:`field_checker`); construction runs it, then :meth:`_check` for what the
    annotations cannot say. A failure raises :class:`~core.errors.InvalidEvent` naming the
    class, the field and the value.
    """

    #: Checks every field of an instance; made from the class's annotations with the class.
    _check_fields: ClassVar[Callable[[Any], None]]

    @classmethod
    def __attrs_init_subclass__(cls) -> None:
        cls._check_fields = field_checker(cls, InvalidEvent)

    def __attrs_post_init__(self) -> None:
        self._check_fields()
        self._check()

    def _check(self) -> None:
        """Checks across fields, after each field's own; raise :class:`InvalidEvent`."""


def _fail(record: object, check: FieldCheck, value: Any, error: type[Exception]) -> None:
    raise error(f"{type(record).__name__}.{check.name} must be {check.expected}, got {value!r}")


def _is_int(value: Any) -> bool:
    # int subclasses (IntEnum: signal.SIGKILL) are integers; bool is not a count.
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_COUNT


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _is_seconds(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and 0 <= value < math.inf


def _is_str(value: Any) -> bool:
    return isinstance(value, str)


def _is_name(value: Any) -> bool:
    return isinstance(value, str) and value != ""


def _is_url_name(value: Any) -> bool:
    return isinstance(value, str) and _URL_NAME.fullmatch(value) is not None


def _is_bool(value: Any) -> bool:
    return type(value) is bool


def _is_str_set(value: Any) -> bool:
    # str subclasses too: a set of cordon causes holds CordonCause members.
    return type(value) is frozenset and all(isinstance(x, str) for x in value)


def _is_str_tuple(value: Any) -> bool:
    return type(value) is tuple and all(type(x) is str for x in value)


def _is_int_tuple(value: Any) -> bool:
    return type(value) is tuple and all(_is_int(x) for x in value)


def _is_str_dict(value: Any) -> bool:
    return type(value) is dict and all(type(k) is str and type(x) is str for k, x in value.items())


_Check = tuple[Callable[[Any], bool], str, str]

_SIMPLE: Mapping[Any, _Check] = types.MappingProxyType(
    {
        int: (_is_int, "an integer in [0, 2**63)", f"type(v) is int and 0 <= v <= {MAX_COUNT}"),
        float: (_is_number, "a finite number", "type(v) is float and -_inf < v < _inf"),
        str: (_is_str, "a string", "type(v) is str"),
        bool: (_is_bool, "true or false", "False"),
        (float, _Range.NON_NEGATIVE): (
            _is_seconds,
            "a finite number of seconds >= 0",
            "type(v) is float and 0.0 <= v < _inf",
        ),
        (str, _Range.NON_EMPTY): (_is_name, "a non-empty string", "type(v) is str and v != ''"),
        (str, _Range.URL_SAFE): (_is_url_name, "1-64 of A-Z a-z 0-9 . _ -", "False"),
        frozenset[str]: (_is_str_set, "a set of strings", "type(v) is frozenset and not v"),
        tuple[str, ...]: (_is_str_tuple, "a list of strings", "False"),
        tuple[int, ...]: (_is_int_tuple, "a list of integers in [0, 2**63)", "False"),
        dict[str, str]: (_is_str_dict, "an object of strings", "False"),
    }
)


def _check_for(hint: Any) -> _Check:
    if typing.get_origin(hint) is Annotated:
        found = _SIMPLE.get((typing.get_args(hint)[0], *hint.__metadata__))
    else:
        found = _SIMPLE.get(hint)
    if found is not None:
        return found
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(inner) == 1:  # X | None
            accepts, expected, fast = _check_for(inner[0])
            return (
                (lambda v: v is None or accepts(v)),
                f"null or {expected}",
                f"v is None or ({fast})",
            )
    elif isinstance(hint, type) and issubclass(hint, enum.Enum):
        words = ", ".join(str(member.value) for member in hint)
        return (lambda v: isinstance(v, hint)), f"one of {words}", "False"
    elif typing.get_origin(hint) is tuple and len(typing.get_args(hint)) == 2:
        item, ellipsis = typing.get_args(hint)
        if ellipsis is Ellipsis and isinstance(item, type):
            # Nested records in a list (the clusters a pipeline registers with).
            return (
                (lambda v: type(v) is tuple and all(isinstance(x, item) for x in v)),
                f"a list of {item.__name__}",
                "False",
            )
    elif isinstance(hint, type) and typing.get_origin(hint) is None:
        # Nested records (Config in Configured) and enums are instances of their class.
        return (lambda v: isinstance(v, hint)), f"a {hint.__name__}", "False"
    raise TypeError(f"no check for {hint!r}")


CheckedRecord._check_fields = field_checker(CheckedRecord, InvalidEvent)
