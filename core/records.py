"""A fast ``attrs.evolve`` for the reducer's own frozen records.

``attrs.evolve`` re-runs ``__init__`` (converters, validators) on every copy, which dominated the
cost of a step. The reducer only ever replaces fields with values it computed itself, already of
the right type, so it copies the slots directly, with a copier generated once per class (the way
attrs generates ``__init__``). Records from outside (events, configuration) are still built
through their constructors and validated.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import attrs

__all__ = ["replace"]

R = TypeVar("R", bound=attrs.AttrsInstance)

_COPIERS: dict[type, tuple[frozenset[str], Callable[[Any, dict[str, Any]], Any]]] = {}


def _copier(cls: type) -> tuple[frozenset[str], Callable[[Any, dict[str, Any]], Any]]:
    names = [f.name for f in attrs.fields(cls)]
    lines = [
        "def copy(record, changes):",
        "    new = _new(_cls)",
        "    put = _bind(new)",
        "    get = changes.get",
        *(f"    put({name!r}, get({name!r}, record.{name}))" for name in names),
        "    return new",
    ]
    namespace: dict[str, Any] = {
        "_new": object.__new__,
        "_bind": object.__setattr__.__get__,
        "_cls": cls,
    }
    exec("\n".join(lines), namespace)  # generated from the class's own field names only
    return frozenset(names), namespace["copy"]


def replace(record: R, **changes: Any) -> R:
    """A copy of the frozen slots ``record`` with ``changes`` applied (not re-validated)."""
    cls = type(record)
    entry = _COPIERS.get(cls)
    if entry is None:
        entry = _COPIERS[cls] = _copier(cls)
    names, copy = entry
    if not changes.keys() <= names:
        raise TypeError(f"{cls.__name__} has no field {sorted(changes.keys() - names)}")
    result: R = copy(record, changes)
    return result
