"""bench/regimes.py: regimes drawn at random, deo's figures on them, and the report."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import regimes


def test_a_regime_is_the_same_for_the_same_index_and_seed_and_within_its_ranges() -> None:
    first = [regimes.draw(i, 3) for i in range(40)]
    assert first == [regimes.draw(i, 3) for i in range(40)]
    assert first != [regimes.draw(i, 4) for i in range(40)]
    for regime in first:
        o = regime.overrides
        assert 0.4 <= float(o["trainer.step_s"]) <= 54.0
        assert 0.8 <= float(o["pools.envs.latency_mean_s"]) <= 108.0
        assert int(o["pools.envs.max_workers"]) in (8, 16, 32, 64, 128)
        assert regime.need > 0
    # Every kind of regime turns up in a series of 40: tails, growth, speed changes, pauses.
    for key in ("pools.envs.latency_alpha", "pools.envs.latency_growth", "trainer.phases"):
        assert any(key in r.overrides for r in first), key
    assert any(r.feasible for r in first) and any(not r.feasible for r in first)


def test_the_need_is_demand_over_production_per_worker_at_its_largest() -> None:
    regime = next(
        r for r in (regimes.draw(i, 1) for i in range(200)) if "trainer.phases" in r.overrides
    )
    o = regime.overrides
    steps = [float(o["trainer.step_s"])]
    steps.append(float(o["trainer.phases"].split("step_s = ")[1].split()[0]))
    growth = max(float(o.get("pools.envs.latency_growth", "1")), 1.0)
    per_worker = int(o["pools.envs.groups_in_flight"]) * 8 / float(o["pools.envs.latency_mean_s"])
    need = int(o["trainer.batch_size_seqs"]) / min(steps) / (per_worker / growth)
    assert regime.need == pytest.approx(need, rel=0.01)


def test_the_report_goes_between_its_markers_and_a_crash_is_named(tmp_path: Path) -> None:
    out = tmp_path / "benchmarks.md"
    out.write_text(
        f"# before\n\n{regimes.START_MARK}\nold\n{regimes.END_MARK}\n\n# after\n", encoding="utf-8"
    )
    assert regimes.main(["--count", "2", "--seed", "5", "--jobs", "1", "--out", str(out)]) == 0
    text = out.read_text(encoding="utf-8")
    assert text.startswith("# before") and text.rstrip().endswith("# after")
    assert "\nold\n" not in text
    assert "Regimes: 2, each 30 simulated minutes" in text
    assert "0 crashed or broke an invariant" in text
    # A regime the simulator refuses is reported with what was wrong, and the exit status says so.
    bad = regimes.Regime(
        index=7, overrides={**regimes.draw(7, 5).overrides, "pools.envs.startup_s": "-1"},
        need=1.0, max_workers=8,
    )  # fmt: skip
    outcome = regimes.run(bad)
    assert outcome.error is not None and "startup_s" in outcome.error
    report = regimes.render([outcome], "python bench/regimes.py")
    assert "1 crashed or broke an invariant" in report and "#7" in report


def test_bad_arguments_exit_2(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as exit_info:
        regimes.main(["--count", "0", "--out", str(tmp_path / "b.md")])
    assert exit_info.value.code == 2
    broken = tmp_path / "broken.md"
    broken.write_text(f"{regimes.END_MARK}\n{regimes.START_MARK}\n", encoding="utf-8")
    assert regimes.main(["--count", "1", "--out", str(broken)]) == 2


def test_worker_hours_after_the_cold_start_are_counted_apart() -> None:
    fed = [r for r in (regimes.draw(i, 1) for i in range(20)) if r.feasible][:2]
    outcomes = [
        regimes.Outcome(regime=fed[0], hours_x=3.0, settled_hours_x=1.1),
        regimes.Outcome(regime=fed[1], hours_x=1.1, settled_hours_x=2.0),
    ]
    report = regimes.render(outcomes, "python bench/regimes.py")
    assert "| worker-hours <= 1.15 x the oracle's | 1/2 |" in report
    assert "| worker-hours after 15 minutes <= 1.15 x the oracle's | 1/2 |" in report
    assert f"#{fed[0].index}: 0.00% avoidable, 3.00 x (1.10 x after 15 minutes)" in report


def test_the_fixed_counts_tried_span_the_need_up_to_the_maximum() -> None:
    regime = regimes.Regime(index=0, overrides={}, need=10.0, max_workers=16)
    assert regimes.fixed_counts(regime) == [5, 8, 10, 12, 15, 16]
    tiny = regimes.Regime(index=0, overrides={}, need=0.3, max_workers=8)
    assert regimes.fixed_counts(tiny) == [1, 8]


def test_a_miss_is_read_against_the_best_fixed_count_on_the_same_world() -> None:
    regime = regimes.draw(90, 5)  # minute-long Pareto groups: waits after every visit to the limit
    count, avoidable = regimes.best_fixed(regime)
    assert count in regimes.fixed_counts(regime)
    static = f'{{ name = "static", count = {count} }}'
    scenario = regimes.load_scenario(
        regimes.BASE, {**regime.overrides, "pools.envs.policy": static}
    )
    assert regimes.simulate(scenario).metrics.avoidable_starvation_share == avoidable
    outcome = regimes.run(regime)
    assert (outcome.fixed_count, outcome.fixed_avoidable) == (count, avoidable)
    assert outcome.avoidable > regimes.AVOIDABLE_STARVATION
    assert outcome.beyond_fixed == pytest.approx(max(outcome.avoidable - avoidable, 0.0))
    # A regime deo feeds is not tried against fixed counts.
    fed = regimes.Outcome(regime=regime, avoidable=0.004)
    assert fed.beyond_fixed == 0.004
    report = regimes.render([outcome, fed], "python bench/regimes.py")
    assert "| avoidable starvation <= 1% beyond the best fixed count's | " in report
    assert f"with the best fixed count, {count})" in report
