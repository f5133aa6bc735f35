"""The TOML configuration: read into the core's Config, every problem named by its key."""

from __future__ import annotations

import math
from pathlib import Path

import attrs
import pytest

from adapters.runtime.config_file import check_loggable, load
from core import Config, ConfigError, PoolSpec

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "local.toml"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "deo.toml"
    path.write_text(text)
    return path


GOOD = """
[deo]
log = "run.jsonl"
gpus = ["0", 1]
[pools.envs]
argv = ["python3", "env.py", "{index}"]
min_workers = 1
max_workers = 4
gpus_per_worker = 1
heartbeat_grace_s = 10
env = { MODE = "train" }
[pools.envs.policy]
name = "buffer"
target_batches = 2
[pools.envs.crash_loop]
backoff_cap_s = 60
[pools.envs.source]
url = "http://127.0.0.1:9000/status"
queued_sequences = "queue.seqs"
batch_size_seqs = "batch"
trainer_step = "step"
"""


def test_the_example_config_loads() -> None:
    settings = load(EXAMPLE)
    assert [p.name for p in settings.config.pools] == ["envs", "judges"]
    assert settings.api.host == "127.0.0.1"
    assert settings.config.pools[0].env["PYTHONUNBUFFERED"] == "1"  # the env key, shown


def test_a_full_config_becomes_the_cores_config(tmp_path: Path) -> None:
    settings = load(write(tmp_path, GOOD))
    [pool] = settings.config.pools
    assert pool.argv == ("python3", "env.py", "{index}")
    assert pool.policy.params == {"target_batches": 2}
    assert pool.heartbeat_grace_s == 10.0 and pool.crash_loop.backoff_cap_s == 60.0
    assert settings.config.gpus == ("0", "1")
    assert settings.log == tmp_path / "run.jsonl"
    [source] = settings.sources
    assert (source.pool, source.queued_sequences) == ("envs", "queue.seqs")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            ("max_workers = 4", "max_worker = 4"),
            r"pools\.envs\.max_worker: unknown key \(did you mean max_workers\?\)",
        ),
        (
            ("max_workers = 4", 'max_workers = "4"'),
            r"pools\.envs\.max_workers: expected an integer, got '4'",
        ),
        (
            ("min_workers = 1", "min_workers = 9"),
            r"pools\.envs\.max_workers \(4\) must be >= min_workers \(9\)",
        ),
        (('name = "buffer"', 'name = "magic"'), r"policy\.name: unknown policy 'magic'"),
        (
            ("target_batches = 2", "target_batch = 2"),
            r"policy\.target_batch: 'buffer' has no such parameter",
        ),
        (("backoff_cap_s = 60", "backoff_cap_s = -1"), r"crash_loop\.backoff_cap_s"),
        (('trainer_step = "step"', ""), r"pools\.envs\.source: give either"),
        (('url = "http://127.0.0.1:9000/status"', 'url = "ftp://x"'), r"pools\.envs\.source\.url"),
        (
            ('argv = ["python3", "env.py", "{index}"]', 'argv = "python3 env.py"'),
            r"pools\.envs\.argv",
        ),
        (("[deo]", "[deo]\nfsync = 1"), r"deo\.fsync: expected true or false"),
        (("[deo]", "[deo]\nlogg = 1"), r"deo\.logg: unknown key \(did you mean log\?\)"),
        (("[deo]", "[dep]"), r"dep: unknown key"),
        (("max_workers = 4", "max_workers = 4 ="), r"not valid TOML"),
        (("[deo]", "[deo]\ntick_interval_s = 0"), r"deo\.tick_interval_s must be > 0"),
        (
            ("[deo]", "[deo]\ntick_interval_s = 1e-9"),
            r"deo\.tick_interval_s must be >= 0\.01 \(each tick is a log record\), got 1e-09",
        ),
        (("[deo]", "[deo]\nsnapshot_every = 0"), r"deo\.snapshot_every must be >= 1"),
        (('log = "run.jsonl"', 'log = ""'), r"deo\.log: empty; give a path"),
        (("[deo]", '[deo]\nworker_logs = " "'), r"deo\.worker_logs: empty; give a path"),
        (("[deo]", "[api]\nport = 70000\n[deo]"), r"api\.port: 70000 is not in 0-65535"),
        (("[deo]", '[api]\nhost = ""\n[deo]'), r"api\.host: empty"),
        (
            ('trainer_step = "step"', 'trainer_step = "step"\npool = "x"'),
            r"source\.pool: unknown key",
        ),
        (("127.0.0.1:9000", "127.0.0.1:99999"), r"source\.url: port 99999"),
        (('argv = ["python3", "env.py", "{index}"]\n', ""), r"^pools\.envs\.argv: required$"),
        (
            (
                'queued_sequences = "queue.seqs"\nbatch_size_seqs = "batch"\ntrainer_step = "step"',
                'in_flight_requests = "load"',
            ),
            r"source: its policy 'buffer' reads a trainer queue; this source gives "
            r"in_flight_requests \(the policies that read it: 'hpa', 'threshold'\)",
        ),
    ],
)
def test_problems_are_named_by_key(tmp_path: Path, change: tuple[str, str], message: str) -> None:
    old, new = change
    assert old in GOOD
    with pytest.raises(ConfigError, match=message):
        load(write(tmp_path, GOOD.replace(old, new, 1)))


def test_a_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="No such file"):
        load(tmp_path / "nope.toml")


def test_a_file_that_is_not_utf8_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "deo.toml"
    path.write_bytes(b'[deo]\nlog = "\xff"\n')
    with pytest.raises(ConfigError, match="not UTF-8"):
        load(path)


@pytest.mark.parametrize(
    ("api", "message"),
    [
        ("max_connections = 0", "api.max_connections must be >= 1, got 0"),
        ("request_timeout_s = 0", "api.request_timeout_s must be > 0, got 0.0"),
        ('open_reads = "yes"', "api.open_reads: expected true or false"),
    ],
)
def test_bad_api_settings_are_named(tmp_path: Path, api: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load(write(tmp_path, f"[api]\n{api}\n"))


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.0.0.2", True),
        ("::1", True),
        ("localhost", True),
        ("0.0.0.0", False),
        ("::", False),
        ("10.1.2.3", False),
        ("deo.example", False),  # a name may resolve anywhere
    ],
)
def test_which_hosts_are_loopback(tmp_path: Path, host: str, loopback: bool) -> None:
    settings = load(write(tmp_path, f'[api]\nhost = "{host}"\n'))
    assert settings.api.loopback is loopback


@pytest.mark.parametrize(
    ("change", "key"),
    [
        (
            ("heartbeat_grace_s = 10", "heartbeat_grace_s = 10\ndrain_timeout_s = inf"),
            "drain_timeout_s",
        ),
        (
            ("heartbeat_grace_s = 10", "heartbeat_grace_s = 10\nstabilization_s = inf"),
            "stabilization_s",
        ),
        (
            ("heartbeat_grace_s = 10", "heartbeat_grace_s = 10\nstart_timeout_s = -inf"),
            "start_timeout_s",
        ),
        (("heartbeat_grace_s = 10", "heartbeat_grace_s = nan"), "heartbeat_grace_s"),
        (("target_batches = 2", "target_batches = inf"), "policy.target_batches"),
        (("backoff_cap_s = 60", "backoff_cap_s = inf"), "crash_loop.backoff_cap_s"),
        (("[deo]", "[deo]\ntick_interval_s = inf"), "deo.tick_interval_s"),
        (("[deo]", "[nvml]\ninterval_s = nan\n[deo]"), "nvml.interval_s"),
        (("[deo]", "[cordon]\nmax_temperature_c = inf\n[deo]"), "cordon.max_temperature_c"),
    ],
)
def test_infinite_and_nan_numbers_are_refused_by_key(
    tmp_path: Path, change: tuple[str, str], key: str
) -> None:
    old, new = change
    assert old in GOOD
    with pytest.raises(ConfigError, match=r"is not a finite number") as info:
        load(write(tmp_path, GOOD.replace(old, new, 1)))
    where = str(info.value).split(":")[0]
    assert where.endswith(key), info.value


def test_a_loaded_configuration_reads_back_from_the_log_unchanged(tmp_path: Path) -> None:
    check_loggable(load(write(tmp_path, GOOD)).config)  # raises if not
    check_loggable(load(EXAMPLE).config)


def test_a_configuration_the_log_cannot_hold_is_refused_by_key() -> None:
    # The constructors refuse infinity; a value set behind their back still never reaches the
    # log: the check encodes, writes and reads the Configured event as the log would.
    spec = PoolSpec(name="envs", argv=["true"])
    object.__setattr__(spec, "drain_timeout_s", math.inf)
    config = attrs.evolve(Config(), pools=[spec])
    with pytest.raises(ConfigError, match=r"^pools\.envs\.drain_timeout_s: inf would read back"):
        check_loggable(config)


@pytest.mark.parametrize(
    ("line", "expected"),
    [("", "auto"), ('drain_timeout_s = "auto"', "auto"), ("drain_timeout_s = 45", 45.0)],
)
def test_the_drain_timeout_is_measured_unless_seconds_are_given(
    tmp_path: Path, line: str, expected: object
) -> None:
    text = GOOD.replace("heartbeat_grace_s = 10", f"heartbeat_grace_s = 10\n{line}", 1)
    settings = load(write(tmp_path, text))
    [pool] = settings.config.pools
    assert pool.drain_timeout_s == expected
    check_loggable(settings.config)


@pytest.mark.parametrize("value", ['"soon"', "true", "[60]"])
def test_a_drain_timeout_neither_seconds_nor_auto_is_refused_by_key(
    tmp_path: Path, value: str
) -> None:
    text = GOOD.replace(
        "heartbeat_grace_s = 10", f"heartbeat_grace_s = 10\ndrain_timeout_s = {value}"
    )
    with pytest.raises(ConfigError, match=r"^pools\.envs\.drain_timeout_s: "):
        load(write(tmp_path, text))
