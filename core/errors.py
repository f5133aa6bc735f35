"""The core's one error family.

Every input the core refuses raises a subclass of :class:`DeoError` whose message names the
subject (pool, worker or GPU), its state where it has one, and what was wrong. The reducer never
half-applies an event: when it raises, the state it was given is the state it keeps.
"""

from __future__ import annotations

__all__ = ["ConfigError", "DeoError", "IllegalTransition", "InvalidEvent", "InvariantViolation"]


class DeoError(Exception):
    """Base class of every error deo's core raises."""


class InvalidEvent(DeoError):
    """An event is malformed, or refers to something the state does not know."""


class ConfigError(InvalidEvent):
    """A configuration value is out of range or inconsistent; the message names the key."""


class IllegalTransition(InvalidEvent):
    """A worker was asked to make a lifecycle transition its current state does not allow."""


class InvariantViolation(DeoError):
    """The reducer produced a state or command that breaks one of deo's invariants (a bug)."""
