"""The GPU arbiter's side of ``deo run``: what its commands do once logged.

The arbiter's decisions live in the core (``State.arbiter``): a grant is the cluster holding its
GPUs (or having ranks awake), so a caller waiting for one reads the state rather than a message
that a restart would lose. :class:`ArbiterBoard` is the executor of the arbiter's commands: it
wakes every waiting caller when one of them is carried out, or when the runner handled an
engine's confirmation or a worker's exit (:meth:`ArbiterBoard.handled`), and keeps why a request
failed (``RequestFailed``) or was withdrawn (a release) until the cluster asks again.
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
#: Events after which a grant may be answered with no arbiter command.
_CONFIRMATIONS = (
    EngineAsleep,
    EngineAwake,
    EngineSleepFailed,
    EngineWakeFailed,
    WorkerReady,
    WorkerExited,
)


class ArbiterBoard:
    """Wakes callers waiting on the arbiter; an executor for the runner's :class:`FanOut`."""

    def __init__(self, *, configured: bool = False) -> None:
        #: ``[arbiter]`` is configured: until its GPUs are declared, deo is still starting.
        self.configured = configured
        self._changed = anyio.Event()
        #: (pipeline, cluster) -> why its last request failed, until it asks again.
        self.failed: dict[tuple[str, str], str] = {}
        #: (pipeline, cluster) -> the event that withdrew what it asked for (a release, its
        #: pipeline leaving), until it asks again.
        self.withdrawn: dict[tuple[str, str], str] = {}

    def handled(self, event: Event) -> None:
        """The runner handled ``event``: wake the waiting callers if it may answer one without
        an arbiter command (an engine confirmed a sleep or a wake, came up, or exited)."""
        if isinstance(event, _CONFIRMATIONS):
            self.notify()
        elif isinstance(event, GpusReleased):
            self.withdrawn[(event.pipeline, event.cluster)] = "released"
        elif isinstance(event, GpusReleasedAndRequested):
            self.withdrawn[(event.pipeline, event.release_cluster)] = "released"
        elif isinstance(event, PipelineUnregistered):
            for key in [k for k in self.withdrawn if k[0] == event.pipeline]:
                del self.withdrawn[key]

    async def execute(self, command: Command) -> None:
        if isinstance(command, RequestFailed):
            self.failed[(command.pipeline, command.cluster)] = command.reason
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
