"""Events, commands and state to and from JSON-ready primitives (and back, unchanged).

An attrs object becomes a dict with its class name under ``"@"`` and its fields; tuples and
lists become lists, frozensets sorted lists, enums their values. Decoding looks the class up in a
closed registry (never an arbitrary import) and rebuilds it through its constructor, so every
decoded object is validated exactly like a new one. Field converters turn lists back into tuples
and frozensets, which is why ``decode(encode(x)) == x`` for everything registered here.
"""

from __future__ import annotations

import enum
from typing import Any

import attrs

from core import commands, config, events, policies, state
from core.errors import InvalidEvent

__all__ = ["REGISTRY", "decode", "encode", "register"]

TYPE_KEY = "@"


def _registry() -> dict[str, type]:
    found: dict[str, type] = {}
    for module in (events, commands, config, state, policies):
        for name in getattr(module, "__all__", ()):
            obj = getattr(module, name)
            if isinstance(obj, type) and attrs.has(obj):
                found[obj.__name__] = obj
    return found


REGISTRY: dict[str, type] = _registry()
_FIELDS: dict[type, tuple[str, ...]] = {
    cls: tuple(f.name for f in attrs.fields(cls)) for cls in REGISTRY.values()
}


def register(cls: type) -> None:
    """Add an attrs class defined outside the core (a benchmark's policy memory) to the registry.

    Idempotent; :class:`ValueError` if another class already has its name.
    """
    existing = REGISTRY.get(cls.__name__)
    if existing is not None and existing is not cls:
        raise ValueError(f"codec: {cls.__name__!r} is already registered as {existing!r}")
    if not attrs.has(cls):
        raise ValueError(f"codec: {cls!r} is not an attrs class")
    REGISTRY[cls.__name__] = cls
    _FIELDS[cls] = tuple(f.name for f in attrs.fields(cls))


def encode(value: Any) -> Any:
    """``value`` as JSON-ready primitives (dicts, lists, str, int, float, bool, None)."""
    cls = type(value)
    names = _FIELDS.get(cls)
    if names is not None:
        out: dict[str, Any] = {TYPE_KEY: cls.__name__}
        for name in names:
            out[name] = encode(getattr(value, name))
        return out
    if value is None or cls in (str, int, float, bool):
        return value
    if cls is tuple or cls is list:
        return [encode(v) for v in value]
    if cls is frozenset or cls is set:
        return sorted(encode(v) for v in value)
    if cls is dict:
        return {k: encode(v) for k, v in value.items()}
    if isinstance(value, enum.Enum):
        return value.value
    raise TypeError(f"cannot encode {cls.__name__}: {value!r}")


def decode(value: Any) -> Any:
    """The object ``encode`` made ``value`` from; :class:`InvalidEvent` if it names no known type
    or its fields do not fit."""
    kind = type(value)
    if kind is list:
        return [decode(v) if type(v) in _NESTED else v for v in value]
    if kind is not dict:
        return value
    name = value.get(TYPE_KEY)
    # Most values are primitives: recurse only into containers (replay decodes millions).
    fields = {k: decode(v) if type(v) in _NESTED else v for k, v in value.items()}
    if name is None:
        return fields
    cls = REGISTRY.get(name)
    if cls is None:
        raise InvalidEvent(f"unknown record type {name!r}")
    del fields[TYPE_KEY]
    try:
        return cls(**fields)
    except TypeError as exc:
        raise InvalidEvent(f"{name}: {exc}") from None


_NESTED = (dict, list)
