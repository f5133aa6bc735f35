"""Scenario files: defaults, overrides, and every mistake reported by its key."""

from __future__ import annotations

from pathlib import Path

import pytest

from adapters.sim.scenario import (
    EnvPool,
    Fault,
    Scenario,
    ScenarioError,
    load_scenario,
    parse_override,
)
from core import PolicySpec

REPO = Path(__file__).resolve().parents[3]
SHIPPED = sorted((REPO / "bench" / "scenarios").glob("*.toml"))
REQUIRED = {
    "steady",
    "trainer_speed_steps",
    "response_length_growth",
    "bursty_heavy_tail",
    "eval_checkpoint_pauses",
    "inference_saturation",
    "gpu_throttle_and_loss",
    "crash_loop",
    "metrics_outage",
}

MINIMAL = """
name = "tiny"
[trainer]
batch_size_seqs = 64
[pools.envs]
latency_mean_s = 8.0
"""


def write(tmp_path: Path, text: str, name: str = "scenario.toml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def test_a_few_lines_give_a_complete_scenario(tmp_path: Path) -> None:
    scenario = load_scenario(write(tmp_path, MINIMAL))
    assert scenario.name == "tiny"
    assert scenario.duration_s == 3600.0
    assert scenario.trainer.batch_size_seqs == 64
    (pool,) = scenario.pools
    assert pool == EnvPool(name="envs", latency_mean_s=8.0)
    assert pool.policy == PolicySpec(name="buffer")
    # GPUs default to every pool at its maximum: 32 workers x 1 GPU.
    assert scenario.gpu_ids == tuple(str(i) for i in range(32))


def test_name_defaults_to_the_file_name(tmp_path: Path) -> None:
    scenario = load_scenario(write(tmp_path, "[pools.envs]\n", name="my_run.toml"))
    assert scenario.name == "my_run"


def test_the_core_configuration_fills_in_world_facts(tmp_path: Path) -> None:
    text = MINIMAL + "max_batches_offpolicy = 2\ngroups_in_flight = 6\n"
    scenario = load_scenario(write(tmp_path, text))
    (spec,) = scenario.config().pools
    assert spec.policy == PolicySpec(name="buffer", params={"max_batches_offpolicy": 2.0})
    # A policy replacing the scenario's gets the facts it takes; given values are kept.
    threshold = PolicySpec(name="threshold", params={"scale_up_threshold": 0.9})
    (spec,) = scenario.config(threshold, {"stabilization_s": 0.0}).pools
    assert spec.policy.params == {"scale_up_threshold": 0.9, "capacity_per_worker": 6.0}
    assert spec.stabilization_s == 0.0
    (spec,) = scenario.config(PolicySpec(name="static", params={"count": 3})).pools
    assert spec.policy.params == {"count": 3}
    assert spec.max_starting == 32  # the core's default, unless the pool says otherwise
    (spec,) = load_scenario(write(tmp_path, MINIMAL + "max_starting = 8\n")).config().pools
    assert spec.max_starting == 8


def test_step_time_follows_phases_and_pauses_cover_their_window(tmp_path: Path) -> None:
    text = MINIMAL.replace(
        "batch_size_seqs = 64",
        "batch_size_seqs = 64\nstep_s = 4\nphases = [{at_s = 100, step_s = 2}, "
        "{at_s = 200, step_s = 8}]\npauses = [{at_s = 50, duration_s = 10}]",
    )
    trainer = load_scenario(write(tmp_path, text)).trainer
    assert [trainer.step_s_at(t) for t in (0, 99.9, 100, 199, 200, 5000)] == [4, 4, 2, 2, 8, 8]
    assert [trainer.paused_at(t) for t in (49.9, 50, 59.9, 60)] == [False, True, True, False]


def test_overrides_are_toml_literals_or_plain_text(tmp_path: Path) -> None:
    path = write(tmp_path, MINIMAL + "[[faults]]\nkind = 'gpu_loss'\nat_s = 10\ngpu = 1\n")
    scenario = load_scenario(
        path,
        {
            "trainer.step_s": "2",
            "duration_s": "600",
            "pools.envs.policy.name": "hpa",  # plain text
            "pools.envs.policy.target_per_worker": "3.5",
            "inference.max_concurrent_groups": "40",  # a table the file does not have
            "faults.0.at_s": "20",
        },
    )
    assert scenario.trainer.step_s == 2.0
    assert scenario.duration_s == 600.0
    assert scenario.pools[0].policy == PolicySpec(name="hpa", params={"target_per_worker": 3.5})
    assert scenario.inference is not None and scenario.inference.max_concurrent_groups == 40
    assert scenario.faults[0].at_s == 20.0
    assert parse_override('"x y"') == "x y"
    assert parse_override("[1, 2]") == [1, 2]
    assert parse_override("true") is True


@pytest.mark.parametrize(
    ("key", "message"),
    [
        ("pools.other.max_workers", "--set pools.other.max_workers: no pool 'other' (pools: envs)"),
        ("faults.3.at_s", "--set faults.3.at_s: faults.3: no such entry (0 in the list)"),
        ("duration_s.x", "--set duration_s.x: duration_s is not a table"),
        ("seed.x", "--set seed.x: seed is not a table"),
        ("faults.x", "--set faults.x: faults is a list; give an index"),
        ("trainer..step_s", "--set trainer..step_s: not a dotted key"),
    ],
)
def test_bad_overrides_name_the_key(tmp_path: Path, key: str, message: str) -> None:
    text = MINIMAL.replace('name = "tiny"', 'name = "tiny"\nseed = 3\nfaults = []')
    with pytest.raises(ScenarioError) as caught:
        load_scenario(write(tmp_path, text), {key: "1"})
    assert str(caught.value).startswith(message)


FAULT = "\n[[faults]]\n"


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("duration_s", "1e300", "duration_s: at most 2.6784e+06 s (31 days), got 1e+300"),
        ("trainer.step_s", "1e-9", "trainer.step_s: 1e-09 s steps over 3600 s make up to"),
        ("trainer.batch_size_seqs", "1000000000", "trainer.batch_size_seqs: must be from 1 to"),
        ("pools.envs.max_workers", "100000", "pools.envs.max_workers: at most 10,000"),
    ],
)
def test_a_simulation_too_large_to_run_is_refused(
    tmp_path: Path, key: str, value: str, message: str
) -> None:
    # A typo that would run for hours or exhaust memory is refused, not run.
    with pytest.raises(ScenarioError) as caught:
        load_scenario(write(tmp_path, MINIMAL), {key: value})
    assert str(caught.value).startswith(message), caught.value


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ('duration_s = "long"', "duration_s: expected a number, got 'long'"),
        ("duration_s = 0", "duration_s: must be > 0, got 0.0"),
        ("seed = 1.5", "seed: expected an integer, got 1.5"),
        ("seeds = 1", "seeds: unknown key (did you mean seed?)"),
        ("[inference]\nmax_concurrent_groups = 0", "inference.max_concurrent_groups: must be >= 1"),
        ("[inference]\nmax_groups = 10", "inference.max_groups: unknown key"),
        ("gpus = -1", "gpus: must be >= 0, got -1"),
        ("gpus = 0", "pools.envs.gpus_per_worker: 1 exceeds the scenario's 0 GPUs"),
    ],
)
def test_top_level_mistakes_name_the_key(tmp_path: Path, extra: str, message: str) -> None:
    head, _, rest = MINIMAL.partition("[trainer]")
    text = head + extra + "\n[trainer]" + rest if not extra.startswith("[") else MINIMAL + extra
    with pytest.raises(ScenarioError) as caught:
        load_scenario(write(tmp_path, text))
    assert str(caught.value).startswith(message), caught.value


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ('step_s = "fast"', "trainer.step_s: expected a number, got 'fast'"),
        ("step_s = -1", "trainer.step_s: must be > 0"),
        ("batch_size = 64", "trainer.batch_size: unknown key (did you mean batch_size_seqs?)"),
        ("phases = [{at_s = 10}]", "trainer.phases[0].step_s: missing"),
        ("phases = [{at_s = 10, step_s = 0}]", "trainer.phases[0].step_s: must be > 0"),
        ("phases = [{at_s = 10, step_s = 1, x = 1}]", "trainer.phases[0].x: unknown key"),
        (
            "phases = [{at_s = 20, step_s = 1}, {at_s = 10, step_s = 2}]",
            "trainer.phases[1].at_s: phases must be in increasing order",
        ),
        ("pauses = [{at_s = 10, duration_s = -5}]", "trainer.pauses[0].duration_s: must be > 0"),
        ("pauses = 3", "trainer.pauses: expected a list, got 3"),
        ("pauses = [3]", "trainer.pauses[0]: expected a table, got 3"),
    ],
)
def test_trainer_mistakes_name_the_key(tmp_path: Path, extra: str, message: str) -> None:
    text = MINIMAL.replace("batch_size_seqs = 64", f"batch_size_seqs = 64\n{extra}")
    with pytest.raises(ScenarioError) as caught:
        load_scenario(write(tmp_path, text))
    assert str(caught.value).startswith(message), caught.value


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ("max_worker = 4", "pools.envs.max_worker: unknown key (did you mean max_workers?)"),
        ("group_size = 0", "pools.envs.group_size: must be >= 1, got 0"),
        ("max_starting = 0", "pools.envs.max_starting: must be >= 1, got 0"),
        ("latency_sigma = 'high'", "pools.envs.latency_sigma: expected a number, got 'high'"),
        ("latency_dist = 'weibull'", "pools.envs.latency_dist: 'weibull' is not one of"),
        ("latency_alpha = 1.0", "pools.envs.latency_alpha: must be > 1"),
        ("require_ready = 1", "pools.envs.require_ready: expected true or false, got 1"),
        ("min_workers = 5\nmax_workers = 2", "pools.envs.max_workers (2) must be >= min_workers"),
        ("policy = { name = 'nope' }", "pools.envs.policy.name: unknown policy 'nope'"),
        ("policy = { target_batches = -1 }", "pools.envs.policy.target_batches must be >= 0"),
        ("policy = { target = 2 }", "pools.envs.policy.target: 'buffer' has no such parameter"),
        ("policy = 'buffer'", "pools.envs.policy: expected a table, got 'buffer'"),
        ("crash_loop = { early_exit_s = 0 }", "pools.envs.crash_loop.early_exit_s must be > 0"),
        ("crash_loop = { early = 1 }", "pools.envs.crash_loop.early: unknown key"),
        ("drain_timeout_s = 0", "pools.envs.drain_timeout_s must be > 0"),
    ],
)
def test_pool_mistakes_name_the_key(tmp_path: Path, extra: str, message: str) -> None:
    with pytest.raises(ScenarioError) as caught:
        load_scenario(write(tmp_path, MINIMAL + extra + "\n"))
    assert str(caught.value).startswith(message), caught.value


@pytest.mark.parametrize(
    ("fault", "message"),
    [
        ("at_s = 10", "faults[0].kind: missing"),
        ("kind = 'meteor'\nat_s = 10", "faults[0].kind: 'meteor' is not one of"),
        ("kind = 'gpu_loss'\ngpu = 1", "faults[0].at_s: missing (a gpu_loss fault needs it)"),
        ("kind = 'gpu_loss'\nat_s = 10", "faults[0].gpu: missing (a gpu_loss fault needs it)"),
        ("kind = 'gpu_loss'\nat_s = 10\ngpu = 99", "faults[0].gpu: GPU 99 is not one of the"),
        (
            "kind = 'gpu_loss'\nat_s = 10\ngpu = 1\nfactor = 2.0",
            "faults[0].factor: unknown key",
        ),
        (
            "kind = 'gpu_throttle'\nat_s = 10\ngpu = 1\nfactor = 0.5",
            "faults[0].factor: must be >= 1",
        ),
        ("kind = 'crash_loop'\nat_s = 10", "faults[0].duration_s: missing"),
        (
            "kind = 'source_down'\nat_s = 10\nduration_s = 5\npool = 'other'",
            "faults[0].pool: no pool 'other' (pools: envs)",
        ),
        ("kind = 'worker_crash'\nat_s = 10\ncount = 0", "faults[0].count: must be >= 1"),
    ],
)
def test_fault_mistakes_name_the_key(tmp_path: Path, fault: str, message: str) -> None:
    with pytest.raises(ScenarioError) as caught:
        load_scenario(write(tmp_path, MINIMAL + FAULT + fault + "\n"))
    assert str(caught.value).startswith(message), caught.value


def test_a_table_without_a_required_key_names_the_key(tmp_path: Path) -> None:
    with pytest.raises(ScenarioError) as caught:
        load_scenario(write(tmp_path, MINIMAL + "\n[inference]\n"))
    assert str(caught.value) == "inference.max_concurrent_groups: missing"


def test_unreadable_files_are_reported(tmp_path: Path) -> None:
    with pytest.raises(ScenarioError, match="no such file"):
        load_scenario(tmp_path / "missing.toml")
    with pytest.raises(ScenarioError, match="not valid TOML"):
        load_scenario(write(tmp_path, "name = \n"))
    with pytest.raises(ScenarioError, match="is a directory"):
        load_scenario(tmp_path)
    bad = tmp_path / "latin1.toml"
    bad.write_bytes(b"name = '\xe9'\n")
    with pytest.raises(ScenarioError, match="not UTF-8"):
        load_scenario(bad)


def test_faults_know_their_window() -> None:
    fault = Fault(kind="source_down", at_s=10.0, duration_s=5.0)
    assert [fault.covers(t) for t in (9.9, 10.0, 14.9, 15.0)] == [False, True, True, False]
    forever = Fault(kind="gpu_throttle", at_s=10.0, gpu=0)
    assert forever.covers(1e9)


def test_latency_distribution_mean_and_growth() -> None:
    pool = EnvPool(name="envs", latency_mean_s=10.0, latency_growth=3.0)
    assert pool.latency_mean_at(0, 100) == 10.0
    assert pool.latency_mean_at(50, 100) == 20.0
    assert pool.latency_mean_at(100, 100) == 30.0
    # The lognormal's median is mean x exp(-sigma^2 / 2).
    median = 10.0 * 2.718281828459045 ** (-(0.8**2) / 2)
    assert pool.latency_cdf(median, 10.0) == pytest.approx(0.5)
    pareto = EnvPool(name="envs", latency_dist="pareto", latency_alpha=2.0)
    # Pareto with alpha 2, mean 10: scale 5; P(X <= 10) = 1 - (5/10)^2.
    assert pareto.latency_cdf(4.9, 10.0) == 0.0
    assert pareto.latency_cdf(10.0, 10.0) == pytest.approx(0.75)


def test_the_library_has_every_required_scenario() -> None:
    assert {path.stem for path in SHIPPED} >= REQUIRED


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_every_shipped_scenario_loads(path: Path) -> None:
    scenario = load_scenario(path)
    assert scenario.name == path.stem
    assert scenario.description
    # Hours, as real runs are; at most 4 and 128 workers, which keeps the benchmark in minutes.
    assert 3600 <= scenario.duration_s <= 4 * 3600
    assert all(pool.max_workers <= 128 for pool in scenario.pools)
    assert isinstance(scenario, Scenario)
