"""A fast ``attrs.evolve`` for the reducer's own frozen records.

``attrs.evolve`` re-runs ``__init__`` (converters, validators) on every copy, which dominated the
cost of a step. The reducer only ever replaces fields with values it computed itself, already of
the right type, so it copies the slots directly. A class opts in with :func:`replaceable`, which
generates its copier once, when the class is defined (the way attrs generates ``__init__``), and
keeps it on the class: nothing is cached at run time. Records from outside (events,
configuration) are still built through their constructors and validated.
"""

from __future__ import annotations

from collections.abc import Callable
from types import MemberDescriptorType
from typing import Any, TypeVar

import attrs

__all__ = ["replace", "replaceable"]

R = TypeVar("R", bound=attrs.AttrsInstance)
C = TypeVar("C", bound=type)

_Copier = Callable[..., Any]
#: The class attribute that holds a replaceable class's copier.
_COPIER = "_replace_copier"


class _Unchanged:
    """The default of every parameter of a copier: the field keeps its value."""

    __slots__ = ()


def _copier(cls: type) -> _Copier:
    # copy(record, *, a=_unchanged, b=_unchanged, ...): Python itself refuses a name that is not a
    # field, each field costs one identity test, and each slot is written through its own member
    # descriptor (faster than object.__setattr__, which looks the descriptor up every time).
    names = [f.name for f in attrs.fields(cls)]
    namespace: dict[str, Any] = {
        "_new": object.__new__,
        "_cls": cls,
        "_unchanged": _Unchanged(),
        "_wrong_class": _wrong_class,
    }
    for name in names:
        slot = getattr(cls, name)
        if not isinstance(slot, MemberDescriptorType):
            raise TypeError(f"@replaceable: {cls.__name__}.{name} is not a slot")
        namespace[f"_set_{name}"] = slot.__set__
    lines = [
        f"def copy(_copy_of, *, {', '.join(f'{name}=_unchanged' for name in names)}):",
        "    if _copy_of.__class__ is not _cls:",
        "        _wrong_class(_copy_of, _cls)",
        "    _copy = _new(_cls)",
        *(
            f"    _set_{name}(_copy, _copy_of.{name} if {name} is _unchanged else {name})"
            for name in names
        ),
        "    return _copy",
    ]
    exec("\n".join(lines), namespace)  # generated from the class's own field names only
    copy: _Copier = namespace["copy"]
    copy.__qualname__ = f"replace[{cls.__name__}]"
    return copy


def _wrong_class(record: object, cls: type) -> None:
    raise TypeError(
        f"replace(): {type(record).__name__} is a subclass of {cls.__name__} and has no copier "
        f"of its own; decorate it with @replaceable"
    )


def replaceable(cls: C) -> C:
    """Class decorator (outside ``@attrs.frozen(slots=True)``): lets :func:`replace` copy ``cls``.

    The copier is generated here, once per class.
    """
    with_fields: bool = attrs.has(cls)  # a plain bool: attrs.has would narrow ``cls``
    if not with_fields or "__slots__" not in vars(cls):
        raise TypeError(f"@replaceable: {cls.__name__} is not an attrs class with slots")
    setattr(cls, _COPIER, _copier(cls))
    return cls


def replace(record: R, **changes: Any) -> R:
    """A copy of the frozen slots ``record`` with ``changes`` applied (not re-validated).

    :class:`TypeError` if its class is not :func:`replaceable` or has no such field.
    """
    try:
        copy: _Copier = getattr(type(record), _COPIER)
    except AttributeError:
        raise TypeError(
            f"replace(): {type(record).__name__} is not @replaceable; use attrs.evolve"
        ) from None
    result: R = copy(record, **changes)
    return result
