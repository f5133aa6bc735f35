"""The words deo writes into its log and compares across modules: alert names, stop causes,
cordon causes and the sources of scaling decisions.

Each vocabulary is an :class:`enum.StrEnum`: a member equals, hashes and formats like its string,
so the log keeps exactly the strings it always held and records written before these enums
existed decode to the same members. The state's fields convert strings to members on
construction (``as_alert_name``, ``as_stop_cause``, ``as_cordon_causes``) and refuse a word deo
does not know with :class:`~core.errors.InvalidEvent` naming it and the words it could be;
commands convert with :func:`core.convert.member_of` and let their field check name the value.

Cordon causes are the one open vocabulary. deo's own causes are :class:`CordonCause` members, but
a GPU is also cordoned for the throttle reasons its sampler reports (NVML's names, chosen by the
configuration's ``[cordon] throttle_reasons``), and a driver may report names deo has never seen.
A set of cordon causes is therefore a ``frozenset[str]``: :func:`as_cordon_causes` turns the
known words into members and keeps the others as the strings they came as. (NVML's thermal throttle
and deo's own temperature limit share the word "thermal": both mean the GPU is too hot.)
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, TypeVar, cast

from core.errors import InvalidEvent

__all__ = [
    "PLANNED_STOPS",
    "STICKY_CAUSES",
    "AlertName",
    "CordonCause",
    "DecisionSource",
    "StopCause",
    "as_alert_name",
    "as_cordon_causes",
    "as_stop_cause",
    "known_cordon_causes",
]


class AlertName(enum.StrEnum):
    """What a raised alert is about (its subject is a pool, worker or GPU)."""

    CRASH_LOOP = "crash_loop"  # pool: workers keep exiting early; spawns back off
    NO_FREE_GPUS = "no_free_gpus"  # pool: short of its target for lack of free healthy GPUs
    BELOW_MIN = "below_min"  # pool: fewer counted workers than its minimum
    PRESSURE_STALE = "pressure_stale"  # pool: no pressure sample for too long
    SOURCE_DOWN = "source_down"  # pool: its pressure source fails
    CLUSTER_UNREACHABLE = "cluster_unreachable"  # cluster address: the executor's cluster is down
    QUEUE_BACKLOG = "queue_backlog"  # pool: more queued than the trainer can use fresh
    OFFPOLICY_STALLS = "offpolicy_stalls"  # pool: the trainer waits each time the envs stop
    GPU_ERRORS = "gpu_errors"  # GPU: new XID/ECC errors
    GPU_LOST = "gpu_lost"  # GPU: gone from the driver
    UNKILLABLE_WORKER = "unkillable_worker"  # worker: still there after SIGKILL
    LEFTOVER_PROCESSES = "leftover_processes"  # worker: processes it left behind, being stopped
    NO_FREE_PORTS = "no_free_ports"  # pool: short of its target: every engine port is held
    ENGINE_CONTROL = "engine_control"  # worker: an engine's sleep or wake failed for good
    PLAN_REFUSED = "plan_refused"  # arbiter: a GPU plan broke a plan invariant and was not run
    HOLDER_OVERSTAYING = "holder_overstaying"  # arbiter cluster: holds GPUs a request waits for
    HOLD_ON_CORDONED = "hold_on_cordoned"  # arbiter cluster: its training hold has cordoned GPUs
    INVARIANT_VIOLATED = "invariant_violated"  # deo: its state or a step broke an invariant


class StopCause(enum.StrEnum):
    """Why deo began stopping a worker (kept on the worker until it exits)."""

    SCALE_DOWN = "scale_down"  # above its pool's target
    OPERATOR = "operator"  # an operator asked for the drain
    POOL_REMOVED = "pool_removed"  # its pool left the configuration
    GPU_LOST = "gpu_lost"  # it sits on a lost GPU
    GPU_ERRORS = "gpu_errors"  # its GPU reports errors: moved elsewhere
    DRAIN_DEADLINE = "drain_deadline"  # missed its drain deadline (it keeps its drain's cause)
    START_TIMEOUT = "start_timeout"  # not started, or not ready, within the start timeout
    HUNG = "hung"  # no sign of life within its heartbeat grace
    SLEEP_FAILED = "sleep_failed"  # an engine's sleep failed (or never answered): stopped
    WAKE_FAILED = "wake_failed"  # an engine's wake failed (or never answered): replaced
    MAX_ASLEEP = "max_asleep"  # more engines asleep than the pool's max_asleep: oldest stopped


class CordonCause(enum.StrEnum):
    """deo's own reasons to place no new worker on a GPU (throttle reasons come as strings)."""

    OPERATOR = "operator"  # an operator's cordon
    ERRORS = "errors"  # XID/ECC errors
    LOST = "lost"  # gone from the driver
    UNKILLABLE_WORKER = "unkillable_worker"  # a worker on it survived SIGKILL
    THERMAL = "thermal"  # at or above the temperature limit, or thermally throttled
    MEMORY = "memory"  # memory used by processes that are not deo's


class DecisionSource(enum.StrEnum):
    """Who set a pool's target (``ScalePool.source``)."""

    POLICY = "policy"  # the pool's autoscaling policy, on a fresh pressure sample
    CONFIG = "config"  # the configuration (a pool declared or changed)
    OPERATOR = "operator"  # an operator's pin


#: Stop causes that are deo's own decision: such exits are never counted as crashes.
PLANNED_STOPS = frozenset(
    {
        StopCause.SCALE_DOWN,
        StopCause.OPERATOR,
        StopCause.POOL_REMOVED,
        StopCause.GPU_LOST,
        StopCause.GPU_ERRORS,
        StopCause.SLEEP_FAILED,
        StopCause.MAX_ASLEEP,
    }
)
#: Stop causes of a worker that did not come up or went silent: deo counts such a stop against
#: the worker's slot when it makes it (a crash, if the worker was young), not again at the exit.
COUNTED_AT_STOP = frozenset({StopCause.START_TIMEOUT, StopCause.HUNG})
#: Cordon causes that need an operator to lift them; every other cause clears by itself after
#: clean samples.
STICKY_CAUSES = frozenset(
    {CordonCause.OPERATOR, CordonCause.ERRORS, CordonCause.LOST, CordonCause.UNKILLABLE_WORKER}
)

W = TypeVar("W", bound=enum.StrEnum)


def _by_value(vocabulary: type[W], what: str) -> Callable[[str], W]:
    members: dict[str, W] = {member.value: member for member in vocabulary}
    known = ", ".join(members)

    def member(value: str) -> W:
        try:
            return members[value]
        except (KeyError, TypeError):
            raise InvalidEvent(f"unknown {what} {value!r} (known: {known})") from None

    return member


_alert_name = _by_value(AlertName, "alert name")
_stop_cause = _by_value(StopCause, "stop cause")


def as_alert_name(value: str) -> AlertName:
    """The :class:`AlertName` spelt ``value``; :class:`InvalidEvent` for a name deo never raises."""
    return _alert_name(value)


def as_stop_cause(value: str | None) -> StopCause | None:
    """The :class:`StopCause` spelt ``value``; None for a worker deo is not stopping."""
    return None if value is None else _stop_cause(value)


_CORDON_CAUSES: Mapping[str, CordonCause] = MappingProxyType({c.value: c for c in CordonCause})


def known_cordon_causes(value: Any) -> frozenset[str]:
    """A set of cordon causes with deo's own words as :class:`CordonCause` members and throttle
    reasons it does not know as the strings they came as. What is not a set of strings (a bare
    string, whose characters are no causes) is kept as it is for the caller's check to name."""
    if not isinstance(value, list | tuple | set | frozenset):
        return cast(frozenset[str], value)
    if not all(isinstance(cause, str) for cause in value):
        return cast(frozenset[str], value)  # the check names the value as the caller gave it
    return frozenset(_CORDON_CAUSES.get(cause, cause) for cause in value)


def as_cordon_causes(value: Any) -> frozenset[str]:
    """:func:`known_cordon_causes`, refusing anything but non-empty strings."""
    causes = known_cordon_causes(value)
    if not isinstance(causes, frozenset) or not all(isinstance(c, str) and c for c in causes):
        raise InvalidEvent(f"cordon causes: {value!r} is not a set of causes (non-empty strings)")
    return causes
