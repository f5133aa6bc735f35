"""The ``[arbiter]`` table of deo's configuration file."""

from __future__ import annotations

from pathlib import Path

import pytest

from adapters.runtime.config_file import ArbiterSettings, load
from core import ConfigError


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
