"""Engine pools in deo.toml: the examples load, and a bad engine setting names its key."""

from __future__ import annotations

from pathlib import Path

import pytest

from adapters.runtime.config_file import load
from core import ConfigError

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"


@pytest.mark.parametrize("name", ["engines.toml", "engines-standin.toml"])
def test_the_engine_examples_load(name: str) -> None:
    settings = load(EXAMPLES / name)
    [pool] = settings.config.pools
    assert pool.is_engine and pool.engine == "vllm" and pool.router_port == 18100
    assert pool.ports == (18000, 18007)
    assert pool.policy.params["capacity_per_worker"] == pool.capacity_per_engine


POOL = """
[deo]
log = "x.jsonl"
[pools.gen]
kind = "engine"
engine = "vllm"
argv = ["serve", "--port", "{port}"]
ports = [18000, 18003]
"""


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ('kind = "gpu"\n', "pools.gen.kind"),
        ('ports = "18000-18003"\n', "pools.gen.ports: expected a list"),
        ("max_asleep = 1.5\n", "pools.gen.max_asleep: expected an integer"),
        ("router_port = 18001\n", "pools.gen.router_port (18001) is inside"),
        ("max_asleeep = 1\n", "pools.gen.max_asleeep: unknown key (did you mean max_asleep?)"),
    ],
)
def test_a_bad_engine_key_in_the_file_is_named(tmp_path: Path, extra: str, message: str) -> None:
    text = POOL
    key = extra.split(" ", 1)[0]
    text = "\n".join(line for line in text.splitlines() if not line.startswith(key + " "))
    (tmp_path / "deo.toml").write_text(text + "\n" + extra)
    with pytest.raises(ConfigError) as info:
        load(tmp_path / "deo.toml")
    assert message in str(info.value), str(info.value)
