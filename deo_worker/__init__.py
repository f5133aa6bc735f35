"""Worker-side helpers: drain on deo's signal and send heartbeats, for any worker process.

- :class:`Drain` — the drain signal as a flag and an awaitable (``deo_worker.drain``);
- :class:`Heartbeat` — signs of life by file or API, a no-op outside deo (``deo_worker.heartbeat``);
- :func:`report_ready` and :func:`report_ready_async` — tell deo the worker is ready, for pools
  with ``require_ready = true`` (``deo_worker.ready``);
- :func:`serve_until_drained` and :func:`drainable` — an atroposlib ``BaseEnv`` that drains
  (``deo_worker.atropos``);
- ``python -m deo_worker.demo_env`` — a stand-in Atropos env worker (``deo_worker.demo_env``);
- ``python -m deo_worker.engine_standin`` — a stand-in vLLM or SGLang server for tests and
  benchmarks without a GPU (``deo_worker.engine_standin``).

See docs/workers.md.
"""

from deo_worker.atropos import (
    DEFAULT_DRAIN_TIMEOUT_S,
    disconnect_env,
    drainable,
    serve_until_drained,
)
from deo_worker.drain import DEFAULT_DRAIN_SIGNALS, Drain
from deo_worker.heartbeat import Heartbeat
from deo_worker.ready import report_ready, report_ready_async

__all__ = [
    "DEFAULT_DRAIN_SIGNALS",
    "DEFAULT_DRAIN_TIMEOUT_S",
    "Drain",
    "Heartbeat",
    "disconnect_env",
    "drainable",
    "report_ready",
    "report_ready_async",
    "serve_until_drained",
]
