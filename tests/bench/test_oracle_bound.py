"""The lower bound holds on every shipped scenario: no static pool, no baseline and not deo's own
policy beats it on both worker-hours and starvation, on the same realized world.

Each scenario is shortened to 20 minutes (the bound is computed for the shortened run) so the
whole check stays quick on a loaded machine.
"""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest

from adapters.sim.driver import simulate
from adapters.sim.oracle import oracle, worker_hours_bound
from adapters.sim.scenario import Scenario, load_scenario
from bench.baselines import CATALOG
from bench.harness import lineup
from core import PolicySpec

SCENARIOS = sorted((Path(__file__).parents[2] / "bench" / "scenarios").glob("*.toml"))
DURATION_S = 1200.0
#: Float noise, not results.
TIE = 1e-9


def shortened(path: Path) -> Scenario:
    scenario = load_scenario(path)
    return attrs.evolve(scenario, duration_s=min(scenario.duration_s, DURATION_S))


@pytest.mark.parametrize("path", SCENARIOS, ids=[p.stem for p in SCENARIOS])
def test_nothing_beats_the_lower_bound(path: Path) -> None:
    scenario = shortened(path)
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
        assert m.worker_hours >= worker_hours_bound(scenario, m.steps) - TIE, (name, m)
        assert not (
            m.starvation_share < bound.starvation_share - TIE
            and m.worker_hours < bound.worker_hours - TIE
        ), (name, m)
