"""Commands: everything the core asks of the world, each with a ``reason`` a person can read.

Executors (adapters) carry commands out and report results back as events. Some commands are
decisions with nothing to execute (``ScalePool``, alerts, cordon notices): they are recorded so a
postmortem reads every decision and why, and so replay can check that it would decide the same.
"""

from __future__ import annotations

import attrs

from core.convert import CheckedRecord, Name, Seconds, member_of, str_tuple
from core.vocabulary import AlertName, DecisionSource, known_cordon_causes

__all__ = [
    "CancelSleep",
    "Command",
    "CordonGpu",
    "DrainEngine",
    "DrainWorker",
    "KillWorker",
    "RaiseAlert",
    "ResolveAlert",
    "ScalePool",
    "SleepEngine",
    "SpawnWorker",
    "TerminateWorker",
    "UncordonGpu",
    "VerifyAsleep",
    "WakeEngine",
]

# Known words become members; anything else is kept for the field check to name.
_to_decision_source = member_of(DecisionSource)
_to_alert_name = member_of(AlertName)


def _decision_source(value: object) -> DecisionSource:
    return _to_decision_source(value)


def _alert_name(value: object) -> AlertName:
    return _to_alert_name(value)


@attrs.frozen(slots=True, kw_only=True)
class Command(CheckedRecord):
    """Base class of every output; ``reason`` says why, for a person.

    Construction checks every field against its annotation, as :class:`~core.events.Event` does,
    and raises :class:`~core.errors.InvalidEvent` naming the class, the field and the value.
    """

    reason: str


@attrs.frozen(slots=True, kw_only=True)
class SpawnWorker(Command):
    """Start one worker process from ``argv`` (never a shell) with ``env`` added to its environment.

    ``env`` already holds CUDA_VISIBLE_DEVICES (the GPUs assigned, "" for CPU workers),
    DEO_WORKER_ID and DEO_POOL. ``port`` is an engine's port (already in its argv), else None.
    """

    worker_id: Name
    pool: Name
    argv: tuple[str, ...] = attrs.field(converter=str_tuple)
    gpus: tuple[str, ...] = attrs.field(converter=str_tuple)
    env: dict[str, str] = attrs.field(hash=False)
    port: int | None = None


@attrs.frozen(slots=True, kw_only=True)
class DrainWorker(Command):
    """Send the pool's drain signal: finish in-flight work, then exit. Escalation follows at
    ``deadline_t`` if it has not exited. ``pid`` is None when the worker has not started yet:
    the drain is repeated once it does."""

    worker_id: Name
    pid: int | None
    signal: str
    deadline_t: Seconds


@attrs.frozen(slots=True, kw_only=True)
class TerminateWorker(Command):
    """SIGTERM to the worker; SIGKILL to its process group follows at ``deadline_t``."""

    worker_id: Name
    pid: int | None
    deadline_t: Seconds


@attrs.frozen(slots=True, kw_only=True)
class KillWorker(Command):
    """SIGKILL to the worker's whole process group (children included)."""

    worker_id: Name
    pid: int | None


@attrs.frozen(slots=True, kw_only=True)
class ScalePool(Command):
    """A pool's target count changed; ``source`` says who set it."""

    pool: Name
    previous: int
    target: int
    source: DecisionSource = attrs.field(converter=_decision_source)


@attrs.frozen(slots=True, kw_only=True)
class CordonGpu(Command):
    """A GPU takes no new workers; ``causes`` lists every active cordon cause."""

    gpu_id: Name
    causes: frozenset[str] = attrs.field(converter=known_cordon_causes)


@attrs.frozen(slots=True, kw_only=True)
class UncordonGpu(Command):
    """A GPU takes new workers again."""

    gpu_id: Name


@attrs.frozen(slots=True, kw_only=True)
class RaiseAlert(Command):
    """Something needs a person: ``alert`` names the kind, ``subject`` the pool, worker or GPU."""

    alert: AlertName = attrs.field(converter=_alert_name)
    subject: str


@attrs.frozen(slots=True, kw_only=True)
class ResolveAlert(Command):
    """A raised alert's condition has cleared."""

    alert: AlertName = attrs.field(converter=_alert_name)
    subject: str


@attrs.frozen(slots=True, kw_only=True)
class DrainEngine(Command):
    """An engine takes no new requests (its router reads the state) and stops once its in-flight
    requests reach 0, or at ``deadline_t``; no signal is sent (engines exit on SIGTERM)."""

    worker_id: Name
    deadline_t: Seconds


@attrs.frozen(slots=True, kw_only=True)
class CancelSleep(Command):
    """An engine going to sleep, its sleep call not sent yet, is needed again: it is back in
    routing at once (a decision; nothing to execute)."""

    worker_id: Name


@attrs.frozen(slots=True, kw_only=True)
class SleepEngine(Command):
    """Release an engine's GPU memory, keeping its process: SGLang ``/flush_cache`` then
    ``/release_memory_occupation``; vLLM ``/reset_prefix_cache`` then ``/sleep?level=N``,
    confirmed by ``/is_sleeping``. Answered by ``EngineAsleep`` or ``EngineSleepFailed``; each
    call gives up after ``timeout_s``. ``attempt`` counts from 1."""

    worker_id: Name
    engine: Name
    port: int
    level: int
    timeout_s: Seconds
    attempt: int


@attrs.frozen(slots=True, kw_only=True)
class WakeEngine(Command):
    """Take an engine's GPU memory back: SGLang ``/resume_memory_occupation``; vLLM ``/wake_up``,
    confirmed by ``/is_sleeping``. Answered by ``EngineAwake`` or ``EngineWakeFailed``."""

    worker_id: Name
    engine: Name
    port: int
    timeout_s: Seconds
    attempt: int


@attrs.frozen(slots=True, kw_only=True)
class VerifyAsleep(Command):
    """Ask an adopted engine the log says sleeps whether it does (vLLM ``/is_sleeping``):
    ``EngineAsleep`` if so, ``EngineAwake`` if not; SGLang has no such route (nothing is sent)."""

    worker_id: Name
    engine: Name
    port: int
    timeout_s: Seconds
