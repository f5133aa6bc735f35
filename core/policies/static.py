"""``static``: a fixed number of workers; replacement of dead workers still happens."""

from __future__ import annotations

from typing import Any, ClassVar

import attrs

from core.errors import ConfigError
from core.policies.base import Decision, PolicyContext

__all__ = ["StaticPolicy"]


@attrs.frozen(slots=True, kw_only=True)
class StaticPolicy:
    """Always ``count`` workers (clamped to the pool's bounds by the reducer)."""

    reacts_to: ClassVar[None] = None
    count: int = 1

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.count, int) or self.count < 0:
            raise ConfigError(f"policy.count must be an integer >= 0, got {self.count!r}")

    def initial_target(self, min_workers: int, max_workers: int) -> int:
        return self.count

    def decide(self, context: PolicyContext, memory: Any) -> Decision:
        return Decision(target=self.count, reason=f"static policy: {self.count} workers")
