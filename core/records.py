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

_Copier = Callable[[Any, dict[str, Any]], Any]
_COPIERS: dict[tuple[type, tuple[str, ...]], _Copier] = {}


def _copier(cls: type, changed: tuple[str, ...]) -> _Copier:
    names = [f.name for f in attrs.fields(cls)]
    unknown = set(changed) - set(names)
    if unknown:
        raise TypeError(f"{cls.__name__} has no field {sorted(unknown)}")
    lines = [
        "def copy(record, changes):",
        "    new = _new(_cls)",
        "    put = _bind(new)",
        *(
            f"    put({name!r}, changes[{name!r}])"
            if name in changed
            else f"    put({name!r}, record.{name})"
            for name in names
        ),
        "    return new",
    ]
    namespace: dict[str, Any] = {
        "_new": object.__new__,
        "_bind": object.__setattr__.__get__,
        "_cls": cls,
    }
    exec("\n".join(lines), namespace)  # generated from the class's own field names only
    copy: _Copier = namespace["copy"]
    return copy


def replace(record: R, **changes: Any) -> R:
    """A copy of the frozen slots ``record`` with ``changes`` applied (not re-validated)."""
    key = (type(record), tuple(changes))
    copy = _COPIERS.get(key)
    if copy is None:
        copy = _COPIERS[key] = _copier(*key)
    result: R = copy(record, changes)
    return result
