"""The ``[arbiter]`` table of deo's configuration file."""

from __future__ import annotations

from pathlib import Path

import pytest

from adapters.runtime.config_file import ArbiterSettings, load
from core import ConfigError
from core.arbiter import PlannerSettings


def write(tmp_path: Path, arbiter: str) -> Path:
    path = tmp_path / "deo.toml"
    path.write_text(f'[deo]\ngpus = ["0", "1", "2"]\n{arbiter}')
    return path


def test_absent_means_no_arbiter(tmp_path: Path) -> None:
    assert load(write(tmp_path, "")).arbiter is None


def test_the_gpus_it_shares(tmp_path: Path) -> None:
    settings = load(write(tmp_path, '[arbiter]\ngpus = ["0", "2"]\n'))
    assert settings.arbiter == ArbiterSettings(gpus=("0", "2"))


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ('[arbiter]\ngpus = ["0", "7"]\n', "arbiter.gpus: ['7'] not among deo.gpus"),
        ("[arbiter]\ngpus = []\n", "arbiter.gpus: empty"),
        ('[arbiter]\ngpus = ["1", "1"]\n', "arbiter.gpus: '1' listed twice"),
        ("[arbiter]\ngpus = 3\n", "arbiter.gpus: expected a list"),
        ('[arbiter]\ngpu = ["0"]\n', "arbiter.gpu: unknown key (did you mean gpus?)"),
        ("[arbiter]\n", "arbiter.gpus: required"),
    ],
)
def test_bad_tables_are_refused_naming_the_key(tmp_path: Path, table: str, message: str) -> None:
    with pytest.raises(ConfigError) as refused:
        load(write(tmp_path, table))
    assert message in str(refused.value)


def test_the_example_loads() -> None:
    example = Path(__file__).resolve().parents[3] / "examples" / "arbiter.toml"
    settings = load(example)
    assert settings.arbiter == ArbiterSettings(gpus=("0", "1", "2", "3"))
    assert settings.config.pool("gen") is not None


def test_the_planner_table_sets_the_recorded_planner_settings(tmp_path: Path) -> None:
    table = (
        '[arbiter]\ngpus = ["0", "1"]\n[arbiter.planner]\n'
        'reserve_s = "never"\nreserve_factor = 4\nmove_cost_s = 45\nhysteresis = 0.2\n'
    )
    arbiter = load(write(tmp_path, table)).arbiter
    assert arbiter is not None
    assert arbiter.planner == PlannerSettings(
        reserve_s=None, reserve_factor=4.0, move_cost_s=45.0, hysteresis=0.2
    )
    # Without the table: deo's defaults, recorded as they are now.
    assert ArbiterSettings(gpus=("0",)).planner == PlannerSettings()


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ("hysteresis = -1\n", "arbiter.planner: PlannerSettings.hysteresis must be >= 0"),
        ("reserve_s = 0\n", "arbiter.planner: PlannerSettings.reserve_s must be > 0 or null"),
        ('move_cost_s = "never"\n', "arbiter.planner.move_cost_s: expected"),
        ("reserve = 5\n", "arbiter.planner.reserve: unknown key"),
        ('name = "other"\n', "PlannerSettings.name must be 'deo' or 'rlix'"),
    ],
)
def test_bad_planner_settings_are_refused_naming_the_key(
    tmp_path: Path, table: str, message: str
) -> None:
    with pytest.raises(ConfigError) as refused:
        load(write(tmp_path, f'[arbiter]\ngpus = ["0"]\n[arbiter.planner]\n{table}'))
    assert message in str(refused.value)
