"""Events, commands and state to and from JSON-ready primitives (and back, unchanged).

An attrs object becomes a dict with its class name under ``"@"`` and the fields its constructor
takes (derived fields are left out); tuples and lists become lists, frozensets sorted lists,
mappings dicts, enums their values. Decoding looks the class up in a closed registry (never an
arbitrary import) and rebuilds it through its constructor, so every decoded object is validated
exactly like a new one. Field converters turn lists back into tuples and frozensets, which is why
``decode(encode(x)) == x`` for everything registered here.

A class that gained a field after its records first went into logs names it in a class-level
``UNRECORDED_FIELDS`` mapping, with the value that reproduces what an older record lacking it
meant; decoding fills it in, so older logs replay as they ran rather than under the new default.

:data:`REGISTRY` holds the core's own classes and never changes; classes defined elsewhere (a
benchmark's policy memories) are decoded with ``decode(value, types=types_with(classes))``.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import Any

import attrs

from core import commands, config, events, policies, state
from core.arbiter import commands as arbiter_commands
from core.arbiter import events as arbiter_events
from core.arbiter import model as arbiter_model
from core.errors import InvalidEvent

__all__ = ["REGISTRY", "decode", "encode", "types_with"]

TYPE_KEY = "@"


def _registry() -> dict[str, type]:
    found: dict[str, type] = {}
    modules = (events, commands, config, state, policies)
    for module in (*modules, arbiter_events, arbiter_commands, arbiter_model):
        for name in getattr(module, "__all__", ()):
            obj = getattr(module, name)
            if isinstance(obj, type) and attrs.has(obj):
                found[obj.__name__] = obj
    return found


def _encoded_fields(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in attrs.fields(cls) if f.init)


#: The core's classes by name: what ``decode`` rebuilds unless told of more.
REGISTRY: Mapping[str, type] = MappingProxyType(_registry())
_FIELDS: Mapping[type, tuple[str, ...]] = MappingProxyType(
    {cls: _encoded_fields(cls) for cls in REGISTRY.values()}
)


def _unrecorded(cls: type) -> Mapping[str, Any]:
    found: Mapping[str, Any] = getattr(cls, "UNRECORDED_FIELDS", {})
    return found


#: The registry's classes that fill fields older records lack (looked up once: replay decodes
#: millions of records).
_UNRECORDED: Mapping[type, Mapping[str, Any]] = MappingProxyType(
    {cls: _unrecorded(cls) for cls in REGISTRY.values() if _unrecorded(cls)}
)


def types_with(classes: Iterable[type], types: Mapping[str, type] = REGISTRY) -> Mapping[str, type]:
    """``types`` (the core's) and ``classes`` (attrs classes defined elsewhere), for ``decode``.

    :class:`ValueError` if a class is not an attrs class, or another class already has its name.
    """
    found = dict(types)
    for cls in classes:
        if not attrs.has(cls):
            raise ValueError(f"codec: {cls!r} is not an attrs class")
        existing = found.setdefault(cls.__name__, cls)
        if existing is not cls:
            raise ValueError(f"codec: {cls.__name__!r} is already {existing!r}; cannot add {cls!r}")
    return MappingProxyType(found)


def encode(value: Any) -> Any:
    """``value`` as JSON-ready primitives (dicts, lists, str, int, float, bool, None).

    Any attrs object encodes; one defined outside the core decodes only with its class named in
    ``decode``'s ``types``.
    """
    cls = type(value)
    names = _FIELDS.get(cls)
    if names is None:
        if value is None or cls in (str, int, float, bool):
            return value
        if cls is tuple or cls is list:
            return [encode(v) for v in value]
        if cls is frozenset or cls is set:
            return sorted(encode(v) for v in value)
        if cls is dict or cls is MappingProxyType:
            return {k: encode(v) for k, v in value.items()}
        if isinstance(value, enum.Enum):
            return value.value
        if not attrs.has(cls):
            raise TypeError(f"cannot encode {cls.__name__}: {value!r}")
        names = _encoded_fields(cls)  # a class defined outside the core
    out: dict[str, Any] = {TYPE_KEY: cls.__name__}
    for name in names:
        out[name] = encode(getattr(value, name))
    return out


def decode(value: Any, types: Mapping[str, type] = REGISTRY) -> Any:
    """The object ``encode`` made ``value`` from; :class:`InvalidEvent` if it names a type not in
    ``types`` (see :func:`types_with`) or its fields do not fit."""
    kind = type(value)
    if kind is list:
        return [decode(v, types) if type(v) in _NESTED else v for v in value]
    if kind is not dict:
        return value
    name = value.get(TYPE_KEY)
    # Most values are primitives: recurse only into containers (replay decodes millions).
    fields = {k: decode(v, types) if type(v) in _NESTED else v for k, v in value.items()}
    if name is None:
        return fields
    cls = types.get(name)
    if cls is None:
        raise InvalidEvent(f"unknown record type {name!r}")
    del fields[TYPE_KEY]
    unrecorded = _UNRECORDED.get(cls) if cls in _FIELDS else _unrecorded(cls)
    if unrecorded:
        for field, value in unrecorded.items():
            fields.setdefault(field, value)
    try:
        return cls(**fields)
    except TypeError as exc:
        raise InvalidEvent(f"{name}: {exc}") from None


_NESTED = (dict, list)
