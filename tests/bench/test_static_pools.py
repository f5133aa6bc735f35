"""bench/static_pools.py: the smallest static pool meeting the starvation target, and its report."""

from __future__ import annotations

import shutil
from pathlib import Path

import attrs
import pytest

from adapters.sim.scenario import load_scenario
from bench import static_pools
from bench.harness import AVOIDABLE_STARVATION, DEFAULT_SCENARIOS

#: Ten simulated minutes of ``steady``: about 19.2 workers keep its trainer fed.
SHORT = {"duration_s": "600"}


def test_the_count_found_is_the_smallest_that_meets_the_starvation_target() -> None:
    scenario = load_scenario(DEFAULT_SCENARIOS / "steady.toml", SHORT)
    found = static_pools.smallest_fed(scenario)
    assert found.count is not None
    assert 19 <= found.count <= 24, found
    assert found.metrics.avoidable_starvation_share <= AVOIDABLE_STARVATION
    fewer = static_pools._static(scenario, found.count - 1)
    assert fewer.avoidable_starvation_share > AVOIDABLE_STARVATION


def test_a_pool_whose_maximum_starves_reports_no_count() -> None:
    scenario = load_scenario(DEFAULT_SCENARIOS / "steady.toml", SHORT)
    small = attrs.evolve(scenario, pools=(attrs.evolve(scenario.pools[0], max_workers=8),))
    found = static_pools.smallest_fed(small)
    assert found.count is None
    assert found.metrics.avoidable_starvation_share > AVOIDABLE_STARVATION
    report = static_pools.render({"steady": [found]}, 1, "python bench/static_pools.py")
    assert "| steady | - |" in report and "not the starvation target" in report


def test_the_report_goes_between_its_markers_and_the_rest_stays(tmp_path: Path) -> None:
    scenarios = tmp_path / "scenarios"
    scenarios.mkdir()
    text = (DEFAULT_SCENARIOS / "steady.toml").read_text()
    (scenarios / "steady.toml").write_text(text.replace("duration_s = 3600", "duration_s = 600"))
    out = tmp_path / "benchmarks.md"
    out.write_text(
        f"# before\n\n{static_pools.START_MARK}\nstale report\n{static_pools.END_MARK}\n\n# after\n"
    )
    argv = ["--scenarios", str(scenarios), "--seeds", "1", "--jobs", "1", "--out", str(out)]
    assert static_pools.main(argv) == 0
    written = out.read_text()
    assert written.startswith("# before\n\n") and written.endswith("# after\n")
    assert "stale report" not in written
    row = next(line for line in written.splitlines() if line.startswith("| steady |"))
    count = int(row.split("|")[2])
    assert 19 <= count <= 24, row


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--only", "nosuch"], "--only nosuch: no such scenario"),
        (["--seeds", "0"], "must be at least 1"),
    ],
)
def test_bad_input_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    out = tmp_path / "benchmarks.md"
    if argv[0] == "--seeds":
        with pytest.raises(SystemExit) as exit_info:
            static_pools.main([*argv, "--out", str(out)])
        assert exit_info.value.code == 2
    else:
        assert static_pools.main([*argv, "--out", str(out)]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_broken_markers_stop_it_before_anything_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "benchmarks.md"
    out.write_text(f"{static_pools.END_MARK}\n{static_pools.START_MARK}\n")
    scenarios = tmp_path / "scenarios"
    shutil.copytree(DEFAULT_SCENARIOS, scenarios)
    assert static_pools.main(["--scenarios", str(scenarios), "--out", str(out)]) == 2
    assert "must both be present, in that order" in capsys.readouterr().err
    assert out.read_text() == f"{static_pools.END_MARK}\n{static_pools.START_MARK}\n"
