"""Scaling policies behind one interface (see :mod:`core.policies.base`).

A :class:`PolicyCatalog` turns a :class:`~core.config.PolicySpec` into a policy object, naming the
bad key when a parameter is unknown or out of range. :data:`BUILT_INS` holds the policies of the
core; policies defined elsewhere (the benchmark's baselines) join a catalog of their own, which
the caller hands to its :class:`~core.reducer.Reducer`. Nothing here is registered globally.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from types import MappingProxyType

import attrs

from core.config import PolicySpec
from core.errors import ConfigError
from core.policies.base import POLICY_ALERTS, Decision, Policy, PolicyContext
from core.policies.buffer import BufferMemory, BufferPolicy
from core.policies.hpa import HpaMemory, HpaPolicy
from core.policies.static import StaticPolicy
from core.policies.threshold import ThresholdMemory, ThresholdPolicy

__all__ = [
    "BUILT_INS",
    "POLICY_ALERTS",
    "POLICIES",
    "BufferMemory",
    "BufferPolicy",
    "Decision",
    "HpaMemory",
    "HpaPolicy",
    "Policy",
    "PolicyCatalog",
    "PolicyContext",
    "StaticPolicy",
    "ThresholdMemory",
    "ThresholdPolicy",
    "build",
]

#: The core's policies by name.
POLICIES: Mapping[str, type] = MappingProxyType(
    {
        "buffer": BufferPolicy,
        "hpa": HpaPolicy,
        "static": StaticPolicy,
        "threshold": ThresholdPolicy,
    }
)


def _read_only(value: Mapping[str, type]) -> Mapping[str, type]:
    # A copy, even of a read-only view: the dict behind a caller's view could still change.
    return MappingProxyType(dict(value))


def _classes(value: Iterable[type]) -> tuple[type, ...]:
    return tuple(value)


@attrs.frozen(slots=True, kw_only=True)
class PolicyCatalog:
    """The policies a reducer can build by name, and the record types they add to the codec.

    ``records``: attrs classes defined outside the core that a state of a pool run by these
    policies holds (their memories); ``codec.decode`` needs them to read such a state back.
    """

    policies: Mapping[str, type] = attrs.field(default=POLICIES, converter=_read_only)
    records: tuple[type, ...] = attrs.field(default=(), converter=_classes)

    def extended(self, policies: Mapping[str, type], records: Iterable[type] = ()) -> PolicyCatalog:
        """This catalog and ``policies`` (and their ``records``); :class:`ConfigError` if a name
        already names another class."""
        for name, cls in policies.items():
            existing = self.policies.get(name)
            if existing is not None and existing is not cls:
                raise ConfigError(
                    f"policy {name!r} is already {existing.__qualname__}; "
                    f"cannot add {cls.__qualname__} under that name"
                )
        added = tuple(cls for cls in records if cls not in self.records)
        return PolicyCatalog(policies={**self.policies, **policies}, records=self.records + added)

    def build(self, spec: PolicySpec) -> Policy:
        """The policy ``spec`` names, with its parameters; :class:`ConfigError` if either is
        wrong."""
        cls = self.policies.get(spec.name)
        if cls is None:
            known = ", ".join(sorted(self.policies))
            raise ConfigError(f"policy.name: unknown policy {spec.name!r}; known: {known}")
        fields = {f.name: f for f in attrs.fields(cls)}
        params = {}
        for key, value in spec.params.items():
            field = fields.get(key)
            if field is None:
                known = ", ".join(sorted(fields)) or "none"
                raise ConfigError(
                    f"policy.{key}: {spec.name!r} has no such parameter; known: {known}"
                )
            expected = type(field.default)
            if expected is float and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
            if type(value) is not expected:
                raise ConfigError(
                    f"policy.{key}: expected {expected.__name__}, got {type(value).__name__} "
                    f"{value!r}"
                )
            params[key] = value
        policy: Policy = cls(**params)
        return policy


#: The core's own policies.
BUILT_INS = PolicyCatalog()


def build(spec: PolicySpec) -> Policy:
    """The built-in policy ``spec`` names (see :meth:`PolicyCatalog.build`)."""
    return BUILT_INS.build(spec)
