"""The engine-pool simulation: every request accounted for, the same arrivals for both
controllers, deo's drains ending at 0 in flight."""

from __future__ import annotations

import argparse

import pytest

from adapters.sim.engines import EngineScenario, simulate_engines
from bench import cli as bench_cli

SHORT = EngineScenario(
    duration_s=900.0,
    rates=((0, 0.0), (200, 6.0), (500, 0.5)),
    cold_start_s=120.0,
)


def test_each_request_is_finished_aborted_or_still_waiting() -> None:
    verl, deo = simulate_engines(SHORT)
    assert verl.arrived == deo.arrived > 1000  # the same seeded arrivals
    for result in (verl, deo):
        assert result.finished + result.aborted + result.waiting_at_end == result.arrived, result
    # The load falls at 500 s: both scale down; deo's drains wait for 0 in flight.
    assert deo.aborted == 0
    assert deo.cold_starts >= 2 and verl.cold_starts >= 2


def test_the_same_seed_gives_the_same_result() -> None:
    assert simulate_engines(SHORT) == simulate_engines(SHORT)


def test_deo_bench_engines_prints_a_line_per_controller(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    bench_cli.add_arguments(parser)
    assert bench_cli.main(parser.parse_args(["engines", "--duration-s", "400", "--seed", "3"])) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("engine scenario: EngineScenario(duration_s=400.0, seed=3")
    assert [line.split(",")[0].strip() for line in lines[1:]] == [
        "controller verl",
        "controller deo",
    ]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["engines", "--duration-s", "nan"], "deo bench engines: --duration-s: from 1 to 604800"),
        (["engines", "--duration-s", "-5"], "deo bench engines: --duration-s: from 1"),
        (["engines", "--wake-s", "-1"], "deo bench engines: --wake-s: from 0.01 to 3600"),
        (["engines", "--cold-start-s", "inf"], "deo bench engines: --cold-start-s: from 1"),
        # An option of the scenario benchmark given before a subcommand would not reach it.
        (["--seeds", "5", "engines"], "deo bench engines: --seeds: an option of the scenario"),
        (["--out", "x.md", "--plots", "p", "soak"], "deo bench soak: --out, --plots: options"),
    ],
)
def test_deo_bench_refuses_what_its_subcommand_would_not_use(
    capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    parser = argparse.ArgumentParser()
    bench_cli.add_arguments(parser)
    assert bench_cli.main(parser.parse_args(args)) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith(message), captured.err
    assert captured.out == ""
