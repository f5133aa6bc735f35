"""The end of ``deo demo``: what the run measured, and what a static pool would have done.

What was measured comes from the run itself: the trainer's own count of the seconds it waited
for a batch, and deo's event log (every worker's span from its spawn to its exit, every scaling
decision with its time and reason, every worker's start-up).

A static pool of the same maximum was not run, so its trainer wait is not measured: it is
simulated (:mod:`adapters.sim`) on this demo's own trainer (the same batch size and step-time
phases), env workers (group size, groups in flight, the lognormal latency the stand-in env
draws, atroposlib's off-policy limit) and the start-up measured in this run, over several seeds.
The same simulation with the demo's own policy is printed beside the measured figure, so the
reader sees how far the simulator is from this machine. A static pool's worker-seconds need no
simulation: it holds its maximum for the whole run.
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Callable, Iterable

import attrs

from adapters.sim.driver import simulate
from adapters.sim.scenario import EnvPool, Phase, Scenario, TrainerSpec
from core import (
    PolicySpec,
    PoolSpec,
    ScalePool,
    SpawnWorker,
    WorkerExited,
    WorkerHeartbeat,
    WorkerReady,
    WorkersSeen,
)
from core.vocabulary import DecisionSource

__all__ = ["Decision", "RunFacts", "StaticEstimate", "facts_of", "render", "simulate_static"]

#: Seeds the simulated comparison averages over.
SEEDS = (1, 2, 3, 4, 5)


@attrs.frozen(slots=True, kw_only=True)
class Decision:
    """One scaling decision of the policy, ``t_s`` seconds into the run."""

    t_s: float
    previous: int
    target: int
    reason: str


@attrs.frozen(slots=True, kw_only=True)
class RunFacts:
    """What deo's event log says about the run."""

    #: From the first event to the last.
    span_s: float
    decisions: tuple[Decision, ...]
    #: Worker-seconds (each worker from its spawn to its exit, or the end of the log).
    worker_s: float
    #: Seconds from a worker's spawn to its first sign of life (its program is up and talking
    #: to deo), per worker that got that far.
    startups_s: tuple[float, ...]


def facts_of(steps: Iterable[tuple[float, object, list[object]]]) -> RunFacts:
    """The facts of a run from its replayed steps: (event time, event, commands produced)."""
    first_t: float | None = None
    last_t = 0.0
    decisions: list[Decision] = []
    spawned: dict[str, float] = {}
    exited: dict[str, float] = {}
    startups: list[float] = []
    heard: set[str] = set()
    for t, event, commands in steps:
        if first_t is None:
            first_t = t
        last_t = t
        # A worker's first sign of life: its readiness report, or the first record of it seen
        # (sightings are recorded at the tick after them, so this errs a tick late).
        alive: frozenset[str] = frozenset()
        if isinstance(event, WorkerHeartbeat | WorkerReady):
            alive = frozenset({event.worker_id})
        elif isinstance(event, WorkersSeen):
            alive = event.worker_ids
        for worker_id in sorted(alive & spawned.keys() - heard):
            heard.add(worker_id)
            startups.append(t - spawned[worker_id])
        if isinstance(event, WorkerExited):
            exited.setdefault(event.worker_id, t)
        for command in commands:
            if isinstance(command, SpawnWorker):
                spawned[command.worker_id] = t
            elif isinstance(command, ScalePool) and command.source == DecisionSource.POLICY:
                decisions.append(
                    Decision(
                        t_s=t - first_t,
                        previous=command.previous,
                        target=command.target,
                        reason=command.reason,
                    )
                )
    worker_s = sum(exited.get(w, last_t) - t for w, t in spawned.items())
    return RunFacts(
        span_s=last_t - (first_t or 0.0),
        decisions=tuple(decisions),
        worker_s=worker_s,
        startups_s=tuple(startups),
    )


@attrs.frozen(slots=True, kw_only=True)
class StaticEstimate:
    """Simulated trainer waits (seconds after its first batch, mean over :data:`SEEDS`)."""

    static_wait_s: float
    policy_wait_s: float
    static_workers: int
    startup_s: float


def _wait_after_first_batch(starved: tuple[tuple[float, float], ...]) -> float:
    return sum(end - start for start, end in starved if start > 0.0)


def simulate_static(
    *,
    duration_s: float,
    batch_size_seqs: int,
    step_s: tuple[float, ...],
    group_size: int,
    groups_in_flight: int,
    latency_s: float,
    latency_sigma: float,
    max_batches_offpolicy: int,
    startup_s: float,
    pool: PoolSpec,
) -> StaticEstimate:
    """The demo simulated with a static pool at ``pool.max_workers`` and with ``pool``'s policy."""
    third = duration_s / len(step_s)
    trainer = TrainerSpec(
        batch_size_seqs=batch_size_seqs,
        step_s=step_s[0],
        phases=tuple(Phase(at_s=i * third, step_s=s) for i, s in enumerate(step_s) if i),
        fetch_all=True,  # the demo trainer pulls from atroposlib's /batch
    )
    env = EnvPool(
        name=pool.name,
        group_size=group_size,
        groups_in_flight=groups_in_flight,
        latency_mean_s=latency_s,
        latency_sigma=max(latency_sigma, 1e-6),
        startup_s=startup_s,
        min_workers=pool.min_workers,
        max_workers=pool.max_workers,
        max_starting=pool.max_starting,
        max_batches_offpolicy=max_batches_offpolicy,
        policy=pool.policy,
        stabilization_s=pool.stabilization_s,
        drain_timeout_s=pool.drain_timeout_s,
        metrics_stale_s=pool.metrics_stale_s,
    )
    static = PolicySpec(name="static", params={"count": pool.max_workers})
    waits: dict[str, list[float]] = {"static": [], "policy": []}
    for seed in SEEDS:
        scenario = Scenario(
            name="demo",
            duration_s=duration_s,
            seed=seed,
            sample_interval_s=0.5,
            trainer=trainer,
            pools=(env,),
        )
        for key, policy in (("static", static), ("policy", None)):
            record = simulate(scenario, policy).record
            assert record is not None
            waits[key].append(_wait_after_first_batch(record.starved))
    return StaticEstimate(
        static_wait_s=statistics.fmean(waits["static"]),
        policy_wait_s=statistics.fmean(waits["policy"]),
        static_workers=pool.max_workers,
        startup_s=startup_s,
    )


def render(
    *,
    steps: int,
    waited_s: float,
    busy_span_s: float,
    first_batch_s: float | None,
    facts: RunFacts,
    estimate: StaticEstimate | None,
    policy: str,
    out: Callable[[str], None],
) -> None:
    """Print the summary: trainer wait against a static pool, worker-seconds, every decision."""

    def share(seconds: float) -> str:
        return f"{100 * seconds / busy_span_s:.0f}%" if busy_span_s > 0 else "-"

    out(
        f"  trainer: {steps} steps; waited {waited_s:.1f}s for data after its first batch "
        f"({share(waited_s)} of the time)"
        + (f"; first batch after {first_batch_s:.1f}s" if first_batch_s is not None else "")
    )
    if estimate is not None:
        static_s = estimate.static_workers * facts.span_s
        saved = static_s - facts.worker_s
        more_wait = waited_s - estimate.static_wait_s
        out(
            f"  against a static pool of {estimate.static_workers} workers (this pool's maximum): "
            f"it would have waited about {estimate.static_wait_s:.1f}s "
            f"({share(estimate.static_wait_s)}, simulated*) and used {static_s:.0f} "
            f"worker-seconds; deo used {facts.worker_s:.0f}: "
            + (
                f"{saved:.0f} saved ({100 * saved / static_s:.0f}%)"
                if saved >= 0 and static_s > 0
                else f"{-saved:.0f} more"
            )
            + (
                f", for {more_wait:.1f}s more waiting"
                if more_wait > 0.05
                else f", for {-more_wait:.1f}s less waiting"
                if more_wait < -0.05
                else ", for the same waiting"
            )
        )
        out(
            f"    * deo's simulator on this trainer, these env groups and the start-up measured "
            f"here ({estimate.startup_s:.1f}s), mean of {len(SEEDS)} seeds; simulated the same "
            f"way, {policy} waits {estimate.policy_wait_s:.1f}s (measured here: {waited_s:.1f}s)"
        )
    elif policy == "static":
        out(f"  worker-seconds: {facts.worker_s:.0f} (a static pool: its own comparison)")
    else:
        out(f"  worker-seconds: {facts.worker_s:.0f} (no start-up measured: no static comparison)")
    out(f"  decisions: {len(facts.decisions)} scaling decisions by the {policy} policy:")
    for d in facts.decisions:
        verb = "up" if d.target > d.previous else "down"
        out(f"    {d.t_s:5.1f}s  {verb} {d.previous} -> {d.target} workers: {_bounded(d)}")


def _bounded(decision: Decision) -> str:
    """The reason, saying so where the pool's bounds held the count short of what it names."""
    wanted = re.search(r"-> (\d+) workers$", decision.reason)
    if wanted is None or int(wanted.group(1)) == decision.target:
        return decision.reason
    bound = "maximum" if int(wanted.group(1)) > decision.target else "minimum"
    return f"{decision.reason} ({decision.target}: the pool's {bound})"
