"""Worlds drawn at random, far outside the shipped scenarios: every policy, every fault kind, the
core's invariants checked after every step, and the event log replaying exactly.

The ranges are wider than users' (a step of 0.1 s or a minute, groups of 0.2 s or two minutes,
an off-policy limit of one batch, a pool of one worker): what holds there holds in between.
Pools stay small and runs short so that each world takes a second or two.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from adapters.postmortem.engine import replay
from adapters.sim.driver import simulate
from adapters.sim.scenario import parse_scenario
from bench.baselines import CATALOG

POLICIES = ("buffer", "hpa", "static", "threshold", "deo-proposal", "deo-corrected", "ray-serve")
FAULT_KINDS = ("gpu_throttle", "gpu_loss", "worker_crash", "crash_loop", "source_down")
WORLD_SETTINGS = settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


@st.composite
def worlds(draw: st.DrawFn) -> dict[str, Any]:
    """A scenario table, as a TOML file would give it."""
    duration_s = draw(st.sampled_from([120.0, 300.0, 600.0]))
    most = draw(st.integers(1, 12))
    gpus_per_worker = draw(st.sampled_from([0, 1, 2]))
    pool: dict[str, Any] = {
        "group_size": draw(st.sampled_from([1, 4, 8, 16])),
        "groups_in_flight": draw(st.integers(1, 8)),
        "latency_mean_s": draw(st.floats(0.2, 120.0)),
        "latency_growth": draw(st.sampled_from([1.0, 0.3, 4.0])),
        "startup_s": draw(st.floats(0.5, 240.0)),
        "startup_sigma": draw(st.sampled_from([0.0, 0.3, 1.0])),
        "require_ready": draw(st.booleans()),
        "gpus_per_worker": gpus_per_worker,
        "min_workers": draw(st.integers(0, min(2, most))),
        "max_workers": most,
        "max_starting": draw(st.integers(1, 12)),
        "max_batches_offpolicy": draw(st.sampled_from([1, 2, 3, 8])),
        "stabilization_s": draw(st.sampled_from([0.0, 10.0, 120.0])),
        "policy": {"name": draw(st.sampled_from(POLICIES))},
    }
    if draw(st.booleans()):
        pool["latency_dist"] = "pareto"
        pool["latency_alpha"] = draw(st.sampled_from([1.05, 1.1, 1.6, 3.0]))
    else:
        pool["latency_sigma"] = draw(st.sampled_from([0.05, 0.8, 1.5]))
    at_s = st.floats(0.0, duration_s)
    trainer: dict[str, Any] = {
        "batch_size_seqs": draw(st.sampled_from([1, 8, 64, 512])),
        "step_s": draw(st.floats(0.1, 60.0)),
        "step_sigma": draw(st.sampled_from([0.0, 0.2, 1.0])),
        "fetch_all": draw(st.booleans()),
        "phases": [
            {"at_s": start, "step_s": draw(st.floats(0.05, 60.0))}
            for start in sorted(draw(st.lists(at_s, max_size=3, unique=True)))
        ],
        "pauses": draw(
            st.lists(
                st.fixed_dictionaries(
                    {
                        "at_s": st.floats(0.0, duration_s * 0.5),
                        "duration_s": st.sampled_from([5.0, 60.0, 600.0]),
                        "kind": st.sampled_from(["eval", "checkpoint", "restart"]),
                    }
                ),
                max_size=1,
            )
        ),
    }
    faults = []
    for kind in draw(st.lists(st.sampled_from(FAULT_KINDS), max_size=3)):
        fault: dict[str, Any] = {"kind": kind, "at_s": draw(at_s)}
        if kind in ("gpu_throttle", "gpu_loss"):
            if not gpus_per_worker:
                continue  # CPU-only workers: no GPU to fail
            fault["gpu"] = draw(st.integers(0, most * gpus_per_worker - 1))
        elif kind == "worker_crash":
            fault["count"] = draw(st.sampled_from([1, 3, 100]))
        else:
            fault["duration_s"] = draw(st.sampled_from([10.0, 120.0, 900.0]))
        faults.append(fault)
    world: dict[str, Any] = {
        "name": "random",
        "duration_s": duration_s,
        "seed": draw(st.integers(0, 2**31)),
        "sample_interval_s": draw(st.sampled_from([0.5, 2.0, 10.0])),
        "trainer": trainer,
        "pools": {"envs": pool},
        "faults": faults,
    }
    if draw(st.booleans()):
        world["inference"] = {"max_concurrent_groups": draw(st.integers(1, 40))}
    return world


@WORLD_SETTINGS
@given(world=worlds())
def test_every_policy_keeps_the_invariants_in_any_world(world: dict[str, Any]) -> None:
    scenario = parse_scenario(world, CATALOG)
    result = simulate(scenario, check_invariants=True, policies=CATALOG)
    metrics = result.metrics
    most = world["pools"]["envs"]["max_workers"]
    for share in (
        metrics.starvation_share,
        metrics.avoidable_starvation_share,
        metrics.unavoidable_starvation_share,
        metrics.bound_starvation_share,
    ):
        assert 0.0 <= share <= 1.0
    # The clairvoyant bound: no run holds fewer GPU-hours than it while starving less.
    assert metrics.bound_worker_hours <= metrics.worker_hours + 1e-9 or (
        metrics.bound_starvation_share <= metrics.starvation_share + 1e-9
    )
    # GPU-hours held: never more than the pool's maximum for the whole run (a worker that holds
    # two GPUs counts two), never negative.
    cost = max(world["pools"]["envs"]["gpus_per_worker"], 1)
    assert 0.0 <= metrics.worker_hours <= most * cost * world["duration_s"] / 3600 + 1e-9
    assert metrics.peak_workers <= most
    assert all(
        point.workers <= most and point.active_workers <= point.workers for point in result.series
    )
    if metrics.steps:
        assert metrics.mean_lag_steps >= 0.0 and metrics.p95_lag_steps >= 0.0
    else:
        assert math.isnan(metrics.mean_lag_steps)  # nothing trained: no lag to speak of


@settings(WORLD_SETTINGS, max_examples=15)
@given(world=worlds())
def test_the_log_of_any_world_replays_exactly(world: dict[str, Any], tmp_path: Path) -> None:
    log = tmp_path / "run.jsonl"
    simulate(parse_scenario(world, CATALOG), log_path=log, policies=CATALOG)
    problems: list[Any] = []
    steps = list(replay(log, problems=problems, policies=CATALOG))
    assert not problems
    assert steps and all(step.matches for step in steps)


def test_a_trainer_that_waits_throughout_starves_a_share_of_exactly_one() -> None:
    # One worker whose single 60-s group never lands before an evaluation that outlasts the
    # run: the trainer waits all of the non-paused time, which, as the run less the pause, reads
    # a rounding error less than the waits.
    world: dict[str, Any] = {
        "name": "never-fed",
        "duration_s": 300.0,
        "seed": 0,
        "sample_interval_s": 0.5,
        "trainer": {
            "batch_size_seqs": 512,
            "step_s": 7.0231977841831625,
            "phases": [{"at_s": 0.0, "step_s": 0.05}],
            "pauses": [{"at_s": 113.94186932983969, "kind": "eval", "duration_s": 600.0}],
        },
        "pools": {
            "envs": {
                "group_size": 1,
                "groups_in_flight": 1,
                "latency_mean_s": 59.664465793860174,
                "latency_sigma": 0.05,
                "startup_s": 7.0231977841831625,
                "gpus_per_worker": 0,
                "min_workers": 0,
                "max_workers": 1,
                "max_batches_offpolicy": 1,
            }
        },
    }
    result = simulate(parse_scenario(world, CATALOG))
    assert result.record is not None
    running_s = 113.94186932983969
    assert sum(stop - start for start, stop in result.record.starved) == running_s
    assert result.metrics.starvation_share == 1.0
