"""``deo simulate --plot``: one run drawn over time with matplotlib (Agg, no display needed).

Three panels sharing the time axis: workers (producing workers, those still starting up or
draining shaded above them, the policy's target dotted, the reactive oracle's workers in black),
the queue in batches (with the off-policy limit), and when the trainer waited (grey: where even
the reactive oracle's trainer waited). Trainer pauses are shaded orange in every panel; faults
are marked by red vertical lines (with their window shaded when they have one) and named.
"""

from __future__ import annotations

from pathlib import Path

from adapters.sim.metrics import SimResult
from adapters.sim.scenario import Scenario

__all__ = ["plot"]


def plot(result: SimResult, scenario: Scenario, path: Path) -> None:
    """Draw ``result`` into the image file ``path`` (PNG by its suffix)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    series = result.series
    minutes = [p.t / 60 for p in series]
    fig, (workers, queue, waiting) = plt.subplots(
        3, 1, sharex=True, figsize=(10, 7), gridspec_kw={"height_ratios": [3, 2, 1]}
    )
    m = result.metrics
    fig.suptitle(
        f"{result.scenario} — {result.policy}: starvation {m.starvation_share:.1%} "
        f"(avoidable {m.avoidable_starvation_share:.1%}), {m.worker_hours:.1f} GPU-h\n"
        f"({m.worker_hours_ratio:.2f}x oracle), lag {m.mean_lag_steps:.2f} steps, "
        f"{m.flaps} reversals ({m.reversals_per_hour:.1f}/h), "
        f"{m.groups_discarded} groups discarded",
        fontsize=10,
    )
    active = [p.active_workers for p in series]
    workers.fill_between(
        minutes,
        active,
        [max(p.workers, p.active_workers) for p in series],
        step="post",
        color="tab:orange",
        alpha=0.35,
        linewidth=0,
        label="starting up / draining",
    )
    workers.step(minutes, active, where="post", label="producing", color="tab:blue")
    workers.step(minutes, [p.target for p in series], where="post", label="target", linestyle=":")
    workers.step(
        [p.t / 60 for p in result.oracle.series],
        [p.workers for p in result.oracle.series],
        where="post",
        label="reactive oracle (workers held)",
        color="black",
        linewidth=0.8,
    )
    workers.set_ylabel("workers")
    workers.legend(loc="lower right", fontsize=8, ncols=2, framealpha=0.8)

    queue.plot(minutes, [p.queued_batches for p in series], linewidth=0.8, label="queued")
    limit = max(pool.max_batches_offpolicy for pool in scenario.pools)
    queue.axhline(limit, color="red", linewidth=0.8, linestyle="--", label="off-policy limit")
    queue.axhline(1, color="gray", linewidth=0.8, linestyle=":", label="one batch")
    queue.set_ylabel("queued batches")
    queue.legend(loc="upper left", fontsize=8, ncols=3)

    waiting.fill_between(
        minutes, [1 if p.trainer_waiting else 0 for p in series], step="post", label="waiting"
    )
    for start, end in result.oracle.unavoidable:
        waiting.axvspan(start / 60, end / 60, color="gray", alpha=0.3, linewidth=0)
    waiting.set_yticks([])
    waiting.set_ylabel("trainer\nwaits")
    waiting.set_xlabel(
        "minutes (orange: trainer paused; red: faults; grey: the reactive oracle's trainer waits)"
    )

    for pause in scenario.trainer.pauses:
        for axis in (workers, queue, waiting):
            axis.axvspan(pause.at_s / 60, pause.end_s / 60, color="orange", alpha=0.15)
    end_min = scenario.duration_s / 60
    for fault in scenario.faults:
        at = fault.at_s / 60
        for axis in (workers, queue, waiting):
            axis.axvline(at, color="red", linewidth=0.8, alpha=0.7)
            if fault.duration_s is not None:
                axis.axvspan(at, min(fault.end_s / 60, end_min), color="red", alpha=0.08)
        label = fault.kind if fault.gpu is None else f"{fault.kind} {fault.gpu}"
        workers.annotate(
            label,
            (at, 0.02),
            xycoords=("data", "axes fraction"),
            rotation=90,
            fontsize=7,
            color="red",
            va="bottom",
            ha="right",
        )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
