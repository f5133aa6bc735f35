"""Typed attrs converters, so decoded lists come back as the tuples and frozensets they were."""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["str_set", "str_tuple"]


def str_tuple(value: Iterable[str]) -> tuple[str, ...]:
    return tuple(value)


def str_set(value: Iterable[str]) -> frozenset[str]:
    return frozenset(value)
