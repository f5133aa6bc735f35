"""The GPU arbiter's side of ``deo run``: what its commands do once logged.

The arbiter's decisions live in the core (``State.arbiter``): a grant is the cluster holding its
GPUs (or having ranks awake), so a caller waiting for one reads the state rather than a message
that a restart would lose. :class:`ArbiterBoard` is the executor of the arbiter's commands: it
wakes every waiting caller when one of them is carried out, or when the runner handled an
engine's confirmation, a worker's exit or a release (:meth:`ArbiterBoard.handled`). Why a request
failed or was withdrawn is in the state too (``Cluster.request_ended``), not here.
"""

from __future__ import annotations

import anyio

from core import (
    Command,
    EngineAsleep,
    EngineAwake,
    EngineSleepFailed,
    EngineWakeFailed,
    Event,
    WorkerExited,
    WorkerReady,
)
from core.arbiter import (
    ExpandGeneration,
    GpusReleased,
    GpusReleasedAndRequested,
    GrantGpus,
    PipelineUnregistered,
    RequestFailed,
    ShrinkGeneration,
)

__all__ = ["ArbiterBoard"]

_ARBITER_COMMANDS = (GrantGpus, RequestFailed, ShrinkGeneration, ExpandGeneration)
#: Events after which a waiting request may be answered with no arbiter command.
_WAKING = (
    EngineAsleep,
    EngineAwake,
    EngineSleepFailed,
    EngineWakeFailed,
    WorkerReady,
    WorkerExited,
    GpusReleased,
    GpusReleasedAndRequested,
    PipelineUnregistered,
)


class ArbiterBoard:
    """Wakes callers waiting on the arbiter; an executor for the runner's :class:`FanOut`."""

    def __init__(self, *, configured: bool = False) -> None:
        #: ``[arbiter]`` is configured: until its GPUs are declared, deo is still starting.
        self.configured = configured
        self._changed = anyio.Event()

    def handled(self, event: Event) -> None:
        """The runner handled ``event``: wake the waiting callers if it may answer one without
        an arbiter command (an engine confirmed a sleep or a wake, came up, or exited; a release
        withdrew a request; a pipeline left)."""
        if isinstance(event, _WAKING):
            self.notify()

    async def execute(self, command: Command) -> None:
        if isinstance(command, _ARBITER_COMMANDS):
            self.notify()

    def notify(self) -> None:
        """Wake every caller in :meth:`wait` (they look at the state again)."""
        self._changed.set()
        self._changed = anyio.Event()

    async def wait(self, timeout_s: float) -> None:
        """Return at the next change, or after ``timeout_s``."""
        changed = self._changed
        with anyio.move_on_after(max(timeout_s, 0.0)):
            await changed.wait()
