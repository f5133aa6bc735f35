"""Typed attrs converters, and the field checks every event and command runs on construction.

The converters turn decoded lists back into the tuples and frozensets they were. The checks are
derived once per class from its field annotations (:func:`field_checks`): each field's value must
be of its annotated type, and in range where the annotation says so (:data:`Seconds`,
:data:`Name`). Events and commands keep the tuple on their class and run it in
``__attrs_post_init__``, so a record built by hand and one decoded from the log are checked alike.
"""

from __future__ import annotations

import enum
import math
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from typing import Annotated, Any, cast

import attrs

__all__ = [
    "MAX_COUNT",
    "FieldCheck",
    "Name",
    "Seconds",
    "check_fields",
    "field_checks",
    "str_set",
    "str_tuple",
]

#: Counts must fit the log's JSON integers (64-bit signed).
MAX_COUNT = 2**63 - 1


def str_tuple(value: Iterable[str]) -> tuple[str, ...]:
    if isinstance(value, (list, tuple)):
        return tuple(value)
    # Anything else (a bare string, a number) is kept as it is, for the field check to name.
    return cast(tuple[str, ...], value)


def str_set(value: Iterable[str]) -> frozenset[str]:
    if isinstance(value, (list, tuple, set, frozenset)):
        try:
            return frozenset(value)
        except TypeError:  # unhashable members: the field check names them
            pass
    return cast(frozenset[str], value)


class _Range(enum.Enum):
    """What an annotation adds to its type's check (used as ``Annotated`` metadata)."""

    NON_NEGATIVE = "non-negative"
    NON_EMPTY = "non-empty"


#: A time in seconds: a finite number >= 0 (``t``, deadlines).
Seconds = Annotated[float, _Range.NON_NEGATIVE]
#: The name of a pool, worker or GPU: a non-empty string.
Name = Annotated[str, _Range.NON_EMPTY]


class FieldCheck(typing.NamedTuple):
    """One field's check: ``accepts(value)`` is False when the value does not fit."""

    name: str
    accepts: Callable[[Any], bool]
    #: What the field must be, for the error message ("an integer in [0, 2**63)").
    expected: str


def check_fields(record: object, checks: tuple[FieldCheck, ...], error: type[Exception]) -> None:
    """Raise ``error`` naming the class, the field and the value of the first field that fails."""
    for name, accepts, expected in checks:
        value = getattr(record, name)
        if not accepts(value):
            raise error(f"{type(record).__name__}.{name} must be {expected}, got {value!r}")


def field_checks(cls: type) -> tuple[FieldCheck, ...]:
    """The checks of every attrs field of ``cls``, from its resolved annotations.

    :class:`TypeError` for an annotation no check is known for, so no field goes unchecked.
    """
    hints = typing.get_type_hints(cls, include_extras=True)
    checks = []
    for field in attrs.fields(cls):
        try:
            accepts, expected = _check_for(hints[field.name])
        except TypeError as exc:
            raise TypeError(f"{cls.__name__}.{field.name}: {exc}") from None
        checks.append(FieldCheck(field.name, accepts, expected))
    return tuple(checks)


def _is_int(value: Any) -> bool:
    return type(value) is int and 0 <= value <= MAX_COUNT


def _is_number(value: Any) -> bool:
    kind = type(value)
    return (kind is float or kind is int) and math.isfinite(value)


def _is_seconds(value: Any) -> bool:
    kind = type(value)
    return (kind is float or kind is int) and 0 <= value < math.inf


def _is_str(value: Any) -> bool:
    return type(value) is str or isinstance(value, str)


def _is_name(value: Any) -> bool:
    return (type(value) is str or isinstance(value, str)) and value != ""


def _is_bool(value: Any) -> bool:
    return type(value) is bool


_SIMPLE: Mapping[Any, tuple[Callable[[Any], bool], str]] = types.MappingProxyType(
    {
        int: (_is_int, "an integer in [0, 2**63)"),
        float: (_is_number, "a finite number"),
        str: (_is_str, "a string"),
        bool: (_is_bool, "true or false"),
        (float, _Range.NON_NEGATIVE): (_is_seconds, "a finite number of seconds >= 0"),
        (str, _Range.NON_EMPTY): (_is_name, "a non-empty string"),
    }
)


def _check_for(hint: Any) -> tuple[Callable[[Any], bool], str]:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Annotated:
        found = _SIMPLE.get((args[0], *hint.__metadata__))
        if found is None:
            raise TypeError(f"no check for {hint!r}")
        return found
    found = _SIMPLE.get(hint)
    if found is not None:
        return found
    if origin in (typing.Union, types.UnionType) and type(None) in args:
        inner = [a for a in args if a is not type(None)]
        if len(inner) != 1:
            raise TypeError(f"no check for {hint!r}")
        accepts, expected = _check_for(inner[0])
        return (lambda v: v is None or accepts(v)), f"null or {expected}"
    if origin is frozenset and args == (str,):
        return (
            lambda v: type(v) is frozenset and all(type(x) is str for x in v)
        ), "a set of strings"
    if origin is tuple and args == (str, ...):
        return (lambda v: type(v) is tuple and all(type(x) is str for x in v)), "a list of strings"
    if origin is dict and args == (str, str):
        return (
            lambda v: (
                type(v) is dict and all(type(k) is str and type(x) is str for k, x in v.items())
            )
        ), "an object of strings"
    if isinstance(hint, type) and origin is None:
        # Nested records (Config in Configured) and enums are instances of their class.
        return (lambda v: isinstance(v, hint)), f"a {hint.__name__}"
    raise TypeError(f"no check for {hint!r}")
