"""bench.harness and ``deo bench``: the report, its markers, the plots and bad input.

``deo bench`` runs as a real executable on two tiny scenarios (five simulated minutes each), into a
copy of a benchmarks.md whose other sections must survive untouched.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import attrs
import pytest
from conftest import deo_command

from adapters.sim.scenario import Fault, Pause, Phase, Scenario, TrainerSpec, load_scenario
from bench.harness import (
    DEO,
    END_MARK,
    START_MARK,
    BenchError,
    Metrics,
    OracleRun,
    PolicyRun,
    ScenarioReport,
    Series,
    check_every_seed,
    check_targets,
    find_scenarios,
    is_jitter_only,
    lineup,
    render_section,
    replace_section,
    write_atomically,
)
from core import PolicySpec

POLICIES = ("deo", "deo-proposal", "deo-corrected", "ray-serve", "verl", "k8s-hpa", "static")
REFERENCES = ("oracle (reactive)", "lower bound (clairvoyant)")

STEADY = """\
description = "Steady demand, random latencies only."
duration_s = 300
[trainer]
batch_size_seqs = 32
step_s = 4.0
[pools.envs]
group_size = 4
groups_in_flight = 2
latency_mean_s = 6.0
startup_s = 10.0
max_workers = 8
gpus_per_worker = 0
"""

SPEEDUP = """\
description = "The trainer doubles its speed halfway."
duration_s = 300
[trainer]
batch_size_seqs = 32
step_s = 6.0
phases = [{at_s = 150, step_s = 3.0}]
[pools.envs]
group_size = 4
groups_in_flight = 2
latency_mean_s = 6.0
startup_s = 10.0
max_workers = 10
gpus_per_worker = 0
"""

BEFORE = """\
# deo benchmarks

Intro text that must survive.

<!-- bench_core:start -->
## Core
| a | b |
<!-- bench_core:end -->
"""
AFTER = "\n## Notes kept after the section\n\ntrailing text\n"


def deo_bench(*args: Any, cwd: Path) -> subprocess.CompletedProcess[str]:
    command, env = deo_command()
    return subprocess.run(
        [*command, "bench", *map(str, args)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


def write_scenarios(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "steady.toml").write_text(STEADY)
    (directory / "speedup.toml").write_text(SPEEDUP)
    return directory


@pytest.fixture(scope="module")
def bench_run(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """One `deo bench` over both scenarios, into a doc that has no deo_bench section yet."""
    root = tmp_path_factory.mktemp("bench")
    write_scenarios(root / "scenarios")
    (root / "docs").mkdir()
    (root / "docs" / "benchmarks.md").write_text(BEFORE + AFTER)
    done = deo_bench(
        "--scenarios", "scenarios", "--out", "docs/benchmarks.md", "--plots", "docs/bench", cwd=root
    )
    return root, done


# --- the real command -----------------------------------------------------------------------------


def test_bench_succeeds_and_prints_a_line_per_scenario_and_policy(
    bench_run: tuple[Path, subprocess.CompletedProcess[str]],
) -> None:
    _, done = bench_run
    assert done.returncode == 0, done.stderr
    for scenario in ("steady", "speedup"):
        for policy in (*POLICIES, "oracle"):
            pattern = rf"^{scenario}  {re.escape(policy)} +\d+\.\ds  starvation \d+\.\d\d%"
            lines = [line for line in done.stdout.splitlines() if re.match(pattern, line)]
            # Three seeds by default: the scenario's own (1) and the next two.
            assert [line.rsplit("[", 1)[-1] for line in lines] == [
                "seed 1]",
                "seed 2]",
                "seed 3]",
            ], (scenario, policy, done.stdout)
    assert "[1/2] speedup (speedup.toml)" in done.stdout  # files run in name order
    assert "[2/2] steady (steady.toml)" in done.stdout


def test_bench_appends_its_section_and_keeps_the_rest(
    bench_run: tuple[Path, subprocess.CompletedProcess[str]],
) -> None:
    root, _ = bench_run
    text = (root / "docs" / "benchmarks.md").read_text()
    # Markers were absent: the section is appended after everything that was there.
    assert text.startswith(BEFORE + AFTER.rstrip("\n") + "\n\n" + START_MARK)
    assert text.endswith(END_MARK + "\n")
    section = text[text.index(START_MARK) :]
    assert (
        "- Command: `deo bench --scenarios scenarios --out docs/benchmarks.md --plots " in section
    )
    for scenario in ("speedup", "steady"):
        block = section[section.index(f"### {scenario}") :]
        block = block[: block.index("![")]
        for policy in POLICIES + REFERENCES:
            name = f"**{policy}**" if policy == DEO else policy
            # Mean over the seeds, and the worst seed's in brackets.
            row = rf"^\| {re.escape(name)} \| \d+\.\d\d% \(\d+\.\d\d%\) \| "
            assert re.search(row, block, re.M), (
                scenario,
                policy,
            )
        assert "| deo target | value | result |" in block
    # Only the scenario without phases is jitter-only, so only it has the flaps target.
    assert "### steady (jitter-only)" in section
    assert "### speedup\n" in section
    assert section.count("| <= 2 reversals per hour (jitter-only) |") == 1
    assert "![speedup: workers and trainer waiting](bench/speedup.png)" in section


def test_bench_draws_one_png_per_scenario(
    bench_run: tuple[Path, subprocess.CompletedProcess[str]],
) -> None:
    root, _ = bench_run
    pngs = sorted(p.name for p in (root / "docs" / "bench").iterdir())
    assert pngs == ["speedup.png", "steady.png"]
    for name in pngs:
        data = (root / "docs" / "bench" / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000, name


def test_bench_replaces_its_section_in_place_and_runs_only_what_is_asked(
    tmp_path: Path, bench_run: tuple[Path, subprocess.CompletedProcess[str]]
) -> None:
    root, _ = bench_run
    write_scenarios(tmp_path / "scenarios")
    first = (root / "docs" / "benchmarks.md").read_text()
    middle = "\n## A section written later, after ours\n"
    doc = tmp_path / "bm.md"
    doc.write_text(first + middle)
    done = deo_bench(
        "--scenarios",
        "scenarios",
        "--only",
        "steady",
        "--out",
        "bm.md",
        "--plots",
        "p",
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    text = doc.read_text()
    before, rest = text.split(START_MARK)
    section, after = rest.split(END_MARK)
    assert before == first[: first.index(START_MARK)]
    assert after == "\n" + middle
    assert "### steady" in section and "### speedup" not in section
    assert "--only steady" in section
    assert [p.name for p in (tmp_path / "p").iterdir()] == ["steady.png"]
    assert "speedup" not in done.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--scenarios", "missing"], "--scenarios missing: no such directory"),
        (["--scenarios", "empty"], "no scenario files (*.toml)"),
        (["--scenarios", "scenarios", "--only", "nope"], "--only nope: no such scenario"),
        (["--scenarios", "bad"], "broken.toml"),
        (["--scenarios", "scenarios", "--out", "broken.md"], "markers"),
    ],
)
def test_bad_input_exits_2_with_a_clear_message_and_writes_nothing(
    tmp_path: Path, args: list[str], message: str
) -> None:
    write_scenarios(tmp_path / "scenarios")
    (tmp_path / "empty").mkdir()
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "broken.toml").write_text("[trainer]\nstep_s = -1\n")
    (tmp_path / "broken.md").write_text(f"text\n{START_MARK}\nno end marker\n")
    (tmp_path / "out.md").write_text("untouched\n")
    extra = [] if "--out" in args else ["--out", "out.md"]
    done = deo_bench(*args, *extra, "--plots", "plots", cwd=tmp_path)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert done.stderr.startswith("deo bench: error: "), done.stderr
    assert message in done.stderr
    assert (tmp_path / "out.md").read_text() == "untouched\n"
    assert (tmp_path / "broken.md").read_text() == f"text\n{START_MARK}\nno end marker\n"
    assert not (tmp_path / "plots").exists()
    assert done.stdout == ""  # nothing ran


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--out", "scenarios/steady.toml"], "--out scenarios/steady.toml: a .toml file"),
        (["--out", "scenarios"], "--out scenarios: a folder"),
        (["--plots", "out.md"], "--plots out.md: a file, not a folder"),
        (["--out", "out.md/x.md"], "--out out.md/x.md: cannot make its folder"),
    ],
)
def test_outputs_that_cannot_be_written_are_refused_before_anything_runs(
    tmp_path: Path, args: list[str], message: str
) -> None:
    write_scenarios(tmp_path / "scenarios")
    (tmp_path / "out.md").write_text("untouched\n")
    given = {"--out": "out.md", "--plots": "plots"} | dict(zip(args[::2], args[1::2], strict=True))
    done = deo_bench(
        "--scenarios", "scenarios", *(word for item in given.items() for word in item), cwd=tmp_path
    )
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert done.stderr.startswith(f"deo bench: error: {message}"), done.stderr
    assert done.stdout == ""  # nothing ran
    assert (tmp_path / "out.md").read_text() == "untouched\n"
    assert (tmp_path / "scenarios" / "steady.toml").read_text() == STEADY


def test_a_bad_scenario_names_its_key(tmp_path: Path) -> None:
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "broken.toml").write_text("[trainer]\nstep_s = -1\n")
    done = deo_bench("--scenarios", "bad", "--out", "o.md", "--plots", "p", cwd=tmp_path)
    assert done.returncode == 2
    assert "broken.toml" in done.stderr and "trainer.step_s" in done.stderr, done.stderr


# --- pieces ---------------------------------------------------------------------------------------


def test_replace_section_cases() -> None:
    section = f"{START_MARK}\nnew\n{END_MARK}\n"
    # absent: appended after one blank line; an empty document becomes the section
    assert replace_section("a\n", section) == "a\n\n" + section
    assert replace_section("", section) == section
    # present: replaced, the rest byte for byte
    old = f"a\n\n{START_MARK}\nold\n{END_MARK}\nb\n"
    assert replace_section(old, section) == f"a\n\n{START_MARK}\nnew\n{END_MARK}\nb\n"
    for broken in (
        f"{START_MARK}\n",
        f"{END_MARK}\n",
        f"{END_MARK}\n{START_MARK}\n",
        f"{START_MARK}\n{END_MARK}\n{START_MARK}\n{END_MARK}\n",
    ):
        with pytest.raises(BenchError, match="markers"):
            replace_section(broken, section, where="x.md")


def test_find_scenarios(tmp_path: Path) -> None:
    write_scenarios(tmp_path)
    (tmp_path / "notes.txt").write_text("not a scenario")
    assert [p.name for p in find_scenarios(tmp_path)] == ["speedup.toml", "steady.toml"]
    assert [p.name for p in find_scenarios(tmp_path, ["steady", "steady"])] == ["steady.toml"]
    with pytest.raises(BenchError, match=r"--only a b: .*\(scenarios: speedup, steady\)"):
        find_scenarios(tmp_path, ["a", "steady", "b"])
    with pytest.raises(BenchError, match="not a directory"):
        find_scenarios(tmp_path / "steady.toml")


def test_jitter_only_means_nothing_but_latencies_varies(tmp_path: Path) -> None:
    base = Scenario(name="s")
    assert is_jitter_only(base)
    assert not is_jitter_only(
        Scenario(name="s", trainer=TrainerSpec(phases=[Phase(at_s=10, step_s=2)]))
    )
    assert not is_jitter_only(
        Scenario(name="s", trainer=TrainerSpec(pauses=[Pause(at_s=10, duration_s=5)]))
    )
    assert not is_jitter_only(Scenario(name="s", faults=[Fault(kind="worker_crash", at_s=5)]))
    drifting = load_scenario_text(tmp_path, "[pools.envs]\nlatency_growth = 2.0\n")
    assert not is_jitter_only(drifting)


def load_scenario_text(directory: Path, text: str) -> Scenario:
    path = directory / "s.toml"
    path.write_text(text)
    return load_scenario(path)


def test_lineup_is_deo_then_every_baseline_from_the_first_pool(tmp_path: Path) -> None:
    scenario = load_scenario_text(
        tmp_path,
        "[pools.a]\ngroup_size = 16\ngroups_in_flight = 5\nmax_workers = 6\n"
        "[pools.b]\nmax_workers = 9\n",
    )
    specs, source = lineup(scenario)
    assert list(specs) == [
        DEO,
        "deo-proposal",
        "deo-corrected",
        "ray-serve",
        "verl",
        "k8s-hpa",
        "static",
    ]
    assert specs[DEO] == (PolicySpec(name="buffer"), {})
    assert specs["deo-proposal"][0].params == {"group_size": 16}
    assert specs["verl"][0].params["capacity_per_worker"] == 5.0
    assert specs["static"][0].params == {"count": 9}  # the largest maximum; clamped per pool
    assert "pool `a`" in source and "`b`" in source


def metrics(**overrides: Any) -> Metrics:
    values: dict[str, Any] = {
        "starvation_share": 0.05,
        "avoidable_starvation_share": 0.005,
        "worker_hours": 10.0,
        "mean_lag_steps": 1.0,
        "p95_lag_steps": 2.0,
        "scale_actions": 3,
        "flaps": 0,
    }
    values.update(overrides)
    return Metrics(**values)


def make_report(deo: Metrics, *baselines: Metrics, jitter_only: bool = True) -> ScenarioReport:
    series = Series(t_s=(0.0,), workers=(1,), waited_s=(0.0,))

    def run(name: str, m: Metrics) -> PolicyRun:
        return PolicyRun(
            name=name,
            spec=PolicySpec(),
            pool_overrides={},
            metrics=m,
            series=series,
            elapsed_s=0.1,
        )

    return ScenarioReport(
        name="s",
        description="",
        path=Path("s.toml"),
        jitter_only=jitter_only,
        baseline_source="pool `envs`",
        oracle=OracleRun(
            worker_hours=9.0, unavoidable_starvation_share=0.045, series=series, elapsed_s=0.0
        ),
        runs=(run(DEO, deo), *(run(f"b{i}", m) for i, m in enumerate(baselines))),
    )


def test_check_targets_all_met() -> None:
    report = make_report(
        metrics(),
        metrics(starvation_share=0.5, worker_hours=1.0),  # better on starvation
        metrics(starvation_share=0.01, worker_hours=30.0),  # better on worker-hours
    )
    checks = check_targets(report)
    assert [c.ok for c in checks] == [True] * 5, checks
    assert len(checks) == 5  # starvation, worker-hours, lag, flaps (jitter-only), baselines


@pytest.mark.parametrize(
    ("deo", "baseline", "jitter_only", "missed"),
    [
        # 1.1% avoidable > 1%
        (metrics(avoidable_starvation_share=0.011), metrics(worker_hours=99.0), True, 0),
        # 10.36 > 1.15 x 9.0 = 10.35
        (metrics(worker_hours=10.36), metrics(worker_hours=99.0), True, 1),
        (metrics(mean_lag_steps=1.51), metrics(worker_hours=99.0), True, 2),
        (metrics(flaps=3, reversals_per_hour=3.0), metrics(worker_hours=99.0), True, 3),
        # equal on both: better on neither
        (metrics(), metrics(), True, 4),
        # dominated
        (metrics(), metrics(starvation_share=0.04, worker_hours=9.5), False, 3),
    ],
)
def test_check_targets_each_miss(
    deo: Metrics, baseline: Metrics, jitter_only: bool, missed: int
) -> None:
    checks = check_targets(make_report(deo, baseline, jitter_only=jitter_only))
    assert [i for i, c in enumerate(checks) if not c.ok] == [missed], checks


def test_flaps_are_a_target_only_on_jitter_only_scenarios() -> None:
    checks = check_targets(
        make_report(
            metrics(flaps=4, reversals_per_hour=4.0), metrics(worker_hours=99.0), jitter_only=False
        )
    )
    assert all(c.ok for c in checks)
    assert not any("reversals" in c.target for c in checks)


def test_render_section_links_plots_relative_to_the_document(tmp_path: Path) -> None:
    report = make_report(metrics(), metrics(worker_hours=99.0))
    text = render_section(
        [report],
        command="deo bench",
        out_dir=tmp_path / "docs",
        plots={"s": tmp_path / "docs" / "bench" / "s.png"},
    )
    assert text.startswith(START_MARK + "\n") and text.endswith(END_MARK + "\n")
    assert "![s: workers and trainer waiting](bench/s.png)" in text
    assert "| oracle (reactive) | 4.50% | 9.00 | 1.00 | - | - | - | - | - |" in text
    assert "| **deo** | 5.00% | 10.00 | 1.11 | 1.00 | 2.00 | 3 | 0 (0.0) | 0 |" in text
    assert "deo met every target on 1 of them" in text


def seeded(*reports: ScenarioReport) -> ScenarioReport:
    """One report holding the others as its further seeds (seeds 1, 2, ...)."""
    numbered = [attrs.evolve(r, seed=i) for i, r in enumerate(reports, 1)]
    return attrs.evolve(numbered[0], seeds=tuple(numbered[1:]))


def test_a_target_is_met_only_if_met_on_every_seed() -> None:
    good = make_report(metrics(), metrics(worker_hours=99.0))
    lagging = make_report(metrics(mean_lag_steps=1.9), metrics(worker_hours=99.0))
    checks = check_every_seed(seeded(good, lagging, good))
    assert [c.ok for c in checks] == [True, True, False, True, True], checks
    assert checks[2].value == "missed on 1 of 3 seeds (2); seed 2: 1.90"
    assert checks[0].value.endswith("(seed 1); met on all 3 seeds")
    # One seed: the checks of that seed, as they are.
    assert check_every_seed(good) == check_targets(good)


def test_seeded_tables_give_the_mean_and_the_worst_seed(tmp_path: Path) -> None:
    report = seeded(
        make_report(metrics(starvation_share=0.02, worker_hours=9.0), metrics(worker_hours=99.0)),
        make_report(metrics(starvation_share=0.04, worker_hours=11.0), metrics(worker_hours=99.0)),
    )
    text = render_section([report], command="deo bench", out_dir=tmp_path, plots={})
    # Oracle: 9.00 worker-hours on both seeds; deo: ratios 1.00 and 1.22.
    assert "| oracle (reactive) | 4.50% (4.50%) | 9.00 (9.00) | 1.00 |" in text
    assert "| **deo** | 3.00% (4.00%) | 10.00 (11.00) | 1.11 (1.22) | 1.00 (1.00) |" in text
    assert "runs under 2 seeds" in text
    assert "deo met every target on 0 of them" in text  # 1.22 x oracle on seed 2


def test_the_overview_gives_each_scenario_its_worst_seed_and_the_targets_it_missed(
    tmp_path: Path,
) -> None:
    lagging = seeded(
        make_report(metrics(worker_hours=9.0), metrics(worker_hours=99.0)),
        make_report(
            metrics(avoidable_starvation_share=0.008, worker_hours=11.0, mean_lag_steps=1.9),
            metrics(worker_hours=99.0),
        ),
    )
    fine = attrs.evolve(
        make_report(metrics(), metrics(worker_hours=99.0), jitter_only=False), name="fine_one"
    )
    text = render_section([lagging, fine], command="deo bench", out_dir=tmp_path, plots={})
    # Worst of the seeds: 0.80% avoidable, 11 / 9 = 1.22 x, lag 1.90; both its misses named.
    assert (
        "| [s (jitter-only)](#s-jitter-only) | 0.80% | 1.22 | 1.90 | 0.0 | worker-hours, lag |"
    ) in text
    assert "| [fine_one](#fine_one) | 0.50% | 1.11 | 1.00 | 0.0 | none |" in text
    # The links point at the sections' headings.
    assert "### s (jitter-only)" in text and "### fine_one" in text
    assert text.index("| [s (jitter-only)]") < text.index("### s (jitter-only)")


def test_a_seed_whose_oracle_held_no_worker_reads_n_a(tmp_path: Path) -> None:
    idle = make_report(metrics(), metrics(worker_hours=99.0))
    idle = attrs.evolve(idle, oracle=attrs.evolve(idle.oracle, worker_hours=0.0))
    report = seeded(make_report(metrics(), metrics(worker_hours=99.0)), idle)
    text = render_section([report], command="deo bench", out_dir=tmp_path, plots={})
    assert "| **deo** | 5.00% (5.00%) | 10.00 (10.00) | n/a (n/a) |" in text
    rows = [line for line in text.splitlines() if line.startswith(("| **deo**", "| lower", "| b0"))]
    assert len(rows) == 3 and not any("inf" in row for row in rows), rows


def test_the_worker_hours_target_reads_plainly_when_the_oracle_held_no_worker() -> None:
    report = make_report(metrics(worker_hours=0.5), metrics(worker_hours=99.0))
    idle = attrs.evolve(report, oracle=attrs.evolve(report.oracle, worker_hours=0.0))
    hours = check_targets(idle)[1]
    assert hours.value == "0.50 (the oracle held no worker)"
    assert not hours.ok  # 0.5 worker-hours against the oracle's none
    assert check_targets(report)[1].value == "0.50 = 0.06 x 9.00"


def test_a_rewritten_report_keeps_its_mode_and_its_link(tmp_path: Path) -> None:
    doc = tmp_path / "benchmarks.md"
    doc.write_text("before\n")
    doc.chmod(0o664)
    link = tmp_path / "link.md"
    link.symlink_to(doc)
    write_atomically(link, "after\n")
    assert link.is_symlink() and doc.read_text() == "after\n"
    assert doc.stat().st_mode & 0o777 == 0o664
    fresh = tmp_path / "new.md"
    write_atomically(fresh, "x\n")
    assert fresh.stat().st_mode & 0o777 == 0o644
