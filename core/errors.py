"""deo's one error family.

Every error deo raises on purpose is a :class:`DeoError`. An input the core refuses raises a
subclass whose message names the subject (pool, worker or GPU), its state where it has one, and
what was wrong. The reducer never half-applies an event: when it raises, the state it was given is
the state it keeps.

A refusal keeps its class from the reducer to whoever submitted the event, and each class carries
the HTTP status an API answers it with (``http_status``, as h11's errors carry a status hint):

- :class:`InvalidEvent` (422): the event itself is malformed;
- :class:`UnknownSubject` (404): it names a pool, worker or GPU the state does not know;
- :class:`Refused` (409): its subject is known but cannot take it now, e.g. a pin outside the
  pool's bounds, or an :class:`IllegalTransition` of a worker's lifecycle;
- anything else (500) is deo's failure, not the caller's.
"""

from __future__ import annotations

__all__ = [
    "ConfigError",
    "DeoError",
    "IllegalTransition",
    "InvalidEvent",
    "InvariantViolation",
    "Refused",
    "UnknownSubject",
]


class DeoError(Exception):
    """Base class of every error deo raises."""

    #: The HTTP status that answers a request refused with this error.
    http_status: int = 500


class InvalidEvent(DeoError):
    """An event is malformed, or the state refuses it (see the subclasses)."""

    http_status = 422


class ConfigError(InvalidEvent):
    """A configuration value is out of range or inconsistent; the message names the key."""


class UnknownSubject(InvalidEvent):
    """An event names a pool, worker or GPU the state does not know."""

    http_status = 404


class Refused(InvalidEvent):
    """An event's subject is known, but its current state does not allow what the event asks."""

    http_status = 409


class IllegalTransition(Refused):
    """A worker was asked to make a lifecycle transition its current state does not allow."""


class InvariantViolation(DeoError):
    """The reducer produced a state or command that breaks one of deo's invariants (a bug)."""
