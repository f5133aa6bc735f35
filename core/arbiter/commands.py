"""The arbiter's commands: what it asks pipelines and engines to do, each with a ``reason``.

Invariant-violating plans are never emitted: the core raises an alert
(:class:`core.commands.RaiseAlert` with ``plan_refused``) instead.
"""

from __future__ import annotations

import attrs

from core.arbiter.model import Priority, as_priority
from core.commands import Command
from core.convert import Name, int_tuple, str_tuple

__all__ = ["ExpandGeneration", "GrantGpus", "RequestFailed", "ShrinkGeneration"]


@attrs.frozen(slots=True, kw_only=True)
class GrantGpus(Command):
    """A waiting request is answered: a non-generation cluster now holds ``gpus`` (its whole
    mapping); a generation cluster has ``gpus`` awake (at least one rank)."""

    pipeline: Name
    cluster: Name
    priority: Priority = attrs.field(converter=as_priority)
    gpus: tuple[str, ...] = attrs.field(converter=str_tuple)


@attrs.frozen(slots=True, kw_only=True)
class ShrinkGeneration(Command):
    """Put generation ``ranks`` of a cluster to sleep (release their memory, keep placement)."""

    pipeline: Name
    cluster: Name
    ranks: tuple[int, ...] = attrs.field(converter=int_tuple)
    gpus: tuple[str, ...] = attrs.field(converter=str_tuple)


@attrs.frozen(slots=True, kw_only=True)
class ExpandGeneration(Command):
    """Wake generation ``ranks`` of a cluster on their bundles ``gpus``."""

    pipeline: Name
    cluster: Name
    ranks: tuple[int, ...] = attrs.field(converter=int_tuple)
    gpus: tuple[str, ...] = attrs.field(converter=str_tuple)


@attrs.frozen(slots=True, kw_only=True)
class RequestFailed(Command):
    """A waiting request can never be answered (its GPUs are lost): the caller gets an error
    instead of waiting forever."""

    pipeline: Name
    cluster: Name
