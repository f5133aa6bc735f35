"""The compact live view ``deo run`` draws on a terminal: pools, workers, GPUs, last decisions."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import anyio

from adapters.describe import at, command_line, pool_summary
from adapters.runtime.runner import Decision, Runner
from core import State

__all__ = ["live_view", "render"]

CLEAR = "\x1b[H\x1b[J"


def render(state: State, decisions: Iterable[Decision], *, width: int = 120, last: int = 8) -> str:
    """The view as text, each line cut to ``width``."""
    lines = [f"deo  {at(state.now)}" + ("  (autoscaling paused)" if state.paused_all else "")]
    lines += [pool_summary(state, name) for name in sorted(state.pools)] or ["no pools declared"]
    gpus = [
        f"{g.gpu_id}:{'cordoned(' + ','.join(sorted(g.causes)) + ')' if g.causes else 'ok'}"
        for g in state.gpus.values()
    ]
    if gpus:
        lines.append("GPUs " + "  ".join(gpus))
    for alert, subject in sorted(state.alerts):
        lines.append(f"ALERT {alert} {subject}")
    recent = list(decisions)[-last:]
    if recent:
        lines.append("last decisions:")
        lines += [f"  {at(d.t)}  {command_line(d.command)}" for d in recent]
    return "\n".join(line[:width] for line in lines) + "\n"


async def live_view(
    runner: Runner, write: Callable[[str], None], *, interval_s: float = 1.0
) -> None:
    """Redraw the view every ``interval_s`` until cancelled."""
    while True:
        write(CLEAR + render(runner.state, runner.decisions))
        await anyio.sleep(interval_s)
