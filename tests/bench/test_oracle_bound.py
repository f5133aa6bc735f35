"""The lower bound holds on every shipped scenario: no static pool, no baseline and not deo's own
policy beats it on both worker-hours and starvation, on the same realized world.

Each scenario is shortened to 20 minutes (the bound is computed for the shortened run) so the
whole check stays quick on a loaded machine. Besides the shipped scenarios, the steady one with
the heaviest tails a user meets (Pareto shape 1.1 and 1.2), where the mean says little about
the latencies a run actually draws, and a large pool with long start-ups that comes up a wave of
``max_starting`` at a time.
"""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest

from adapters.sim.driver import simulate
from adapters.sim.oracle import oracle
from adapters.sim.scenario import Scenario, load_scenario
from bench.baselines import CATALOG
from bench.harness import lineup
from core import PolicySpec

SCENARIO_DIR = Path(__file__).parents[2] / "bench" / "scenarios"
HEAVY = {"pools.envs.latency_dist": '"pareto"'}
#: A pool that comes up a wave of max_starting workers per start-up: 1024-sequence batches every
#: 5 s need about 77 of 128 workers that take 4 minutes to start.
PACED = {
    "pools.envs.max_workers": "128",
    "pools.envs.startup_s": "240",
    "trainer.batch_size_seqs": "1024",
    "trainer.step_s": "5",
}
CASES = [(path.stem, path, {}) for path in sorted(SCENARIO_DIR.glob("*.toml"))] + [
    (
        "steady-pareto1.1",
        SCENARIO_DIR / "steady.toml",
        {**HEAVY, "pools.envs.latency_alpha": "1.1", "seed": "7"},
    ),
    (
        "steady-pareto1.2",
        SCENARIO_DIR / "steady.toml",
        {**HEAVY, "pools.envs.latency_alpha": "1.2", "seed": "3"},
    ),
    ("steady-paced", SCENARIO_DIR / "steady.toml", PACED),
    ("steady-paced-by-8", SCENARIO_DIR / "steady.toml", {**PACED, "pools.envs.max_starting": "8"}),
]
DURATION_S = 1200.0
#: Float noise, not results.
TIE = 1e-9


def shortened(path: Path, overrides: dict[str, str]) -> Scenario:
    scenario = load_scenario(path, overrides)
    return attrs.evolve(scenario, duration_s=min(scenario.duration_s, DURATION_S))


@pytest.mark.parametrize(
    ("path", "overrides"), [case[1:] for case in CASES], ids=[case[0] for case in CASES]
)
def test_nothing_beats_the_lower_bound(path: Path, overrides: dict[str, str]) -> None:
    scenario = shortened(path, overrides)
    bound = oracle(scenario).bound
    largest = max(pool.max_workers for pool in scenario.pools)
    runs: dict[str, tuple[PolicySpec, dict[str, object]]] = dict(lineup(scenario)[0])
    for count in sorted({1, largest // 4, largest // 2, 3 * largest // 4, largest} - {0}):
        runs[f"static {count}"] = (PolicySpec(name="static", params={"count": count}), {})
    for name, (spec, overrides) in runs.items():
        m = simulate(scenario, spec, pool_overrides=overrides, policies=CATALOG).metrics
        assert m.starvation_share >= bound.starvation_share - TIE, (name, m)
        assert m.steps <= bound.steps, (name, m.steps, bound.steps)
        # The bound for the steps this run took: the generation they need.
        assert m.worker_hours >= m.bound_worker_hours - TIE, (name, m)
        assert not (
            m.starvation_share < bound.starvation_share - TIE
            and m.worker_hours < bound.worker_hours - TIE
        ), (name, m)
