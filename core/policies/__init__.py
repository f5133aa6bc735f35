"""Scaling policies behind one interface (see :mod:`core.policies.base`).

``build(spec)`` turns a :class:`~core.config.PolicySpec` into a policy object, naming the bad key
when a parameter is unknown or out of range.
"""

from __future__ import annotations

import functools

import attrs

from core.config import PolicySpec
from core.errors import ConfigError
from core.policies.base import Decision, Policy, PolicyContext
from core.policies.buffer import BufferMemory, BufferPolicy
from core.policies.hpa import HpaMemory, HpaPolicy
from core.policies.static import StaticPolicy
from core.policies.threshold import ThresholdMemory, ThresholdPolicy

__all__ = [
    "POLICIES",
    "BufferMemory",
    "BufferPolicy",
    "Decision",
    "HpaMemory",
    "HpaPolicy",
    "Policy",
    "PolicyContext",
    "StaticPolicy",
    "ThresholdMemory",
    "ThresholdPolicy",
    "build",
    "register",
]

POLICIES: dict[str, type] = {
    "buffer": BufferPolicy,
    "hpa": HpaPolicy,
    "static": StaticPolicy,
    "threshold": ThresholdPolicy,
}


def register(name: str, cls: type) -> None:
    """Make a policy defined outside the core (a benchmark's baseline) buildable by ``name``.

    Idempotent; :class:`ConfigError` if ``name`` already names another class.
    """
    existing = POLICIES.get(name)
    if existing is not None and existing is not cls:
        raise ConfigError(
            f"policy {name!r} is already registered as {existing.__qualname__}; "
            f"cannot register {cls.__qualname__}"
        )
    POLICIES[name] = cls


#: Policies already built, by the identity of their spec (which the entry keeps alive, so the id
#: cannot be reused): the reducer asks for the same spec object on every sample.
_BY_SPEC: dict[int, tuple[PolicySpec, Policy]] = {}


def build(spec: PolicySpec) -> Policy:
    """The policy ``spec`` names, with its parameters; :class:`ConfigError` if either is wrong."""
    entry = _BY_SPEC.get(id(spec))
    if entry is not None and entry[0] is spec:
        return entry[1]
    # Keyed by parameter types too: 2 == 2.0 == True, yet only one of them may be valid.
    key = (spec.name, tuple(sorted((k, type(v).__name__, v) for k, v in spec.params.items())))
    policy = _build(key, spec)
    if len(_BY_SPEC) > 1024:
        _BY_SPEC.clear()
    _BY_SPEC[id(spec)] = (spec, policy)
    return policy


@functools.lru_cache(maxsize=256)
def _build(key: object, spec: PolicySpec) -> Policy:
    cls = POLICIES.get(spec.name)
    if cls is None:
        raise ConfigError(
            f"policy.name: unknown policy {spec.name!r}; known: {', '.join(sorted(POLICIES))}"
        )
    fields = {f.name: f for f in attrs.fields(cls)}
    params = {}
    for key, value in spec.params.items():
        field = fields.get(key)
        if field is None:
            known = ", ".join(sorted(fields)) or "none"
            raise ConfigError(f"policy.{key}: {spec.name!r} has no such parameter; known: {known}")
        expected = type(field.default)
        if expected is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if type(value) is not expected:
            raise ConfigError(
                f"policy.{key}: expected {expected.__name__}, got {type(value).__name__} {value!r}"
            )
        params[key] = value
    policy: Policy = cls(**params)
    return policy
