"""core.config: every bad value raises ConfigError naming its key; argv rendering; crash backoff."""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from core.codec import decode, encode
from core.commands import SpawnWorker
from core.config import (
    ARGV_PLACEHOLDERS,
    Config,
    CordonRules,
    CrashLoopRules,
    PolicySpec,
    PoolSpec,
)
from core.errors import ConfigError, InvalidEvent
from core.events import Configured
from core.reducer import Reducer

ARGV = ("python", "env.py")
STATIC_ONE = PolicySpec(name="static", params={"count": 1})


def pool(name: str = "envs", **kwargs: Any) -> PoolSpec:
    kwargs.setdefault("argv", ARGV)
    return PoolSpec(name=name, **kwargs)


# --- validation: each row builds something invalid and names the key the message must carry ----

INVALID: list[tuple[str, Callable[[], object], str]] = [
    # pool names: lower-case letters, digits, '_' and '.', starting with a letter or digit
    ("name-upper", lambda: pool("Envs"), "pools.'Envs'"),
    ("name-space", lambda: pool("my envs"), "pools.'my envs'"),
    ("name-dash", lambda: pool("my-envs"), "pools.'my-envs'"),
    ("name-leading-underscore", lambda: pool("_envs"), "pools.'_envs'"),
    ("name-leading-dot", lambda: pool(".envs"), "pools.'.envs'"),
    ("name-empty", lambda: pool(""), "pools.''"),
    # argv
    ("argv-empty-list", lambda: pool(argv=[]), "pools.envs.argv"),
    ("argv-empty-tuple", lambda: pool(argv=()), "pools.envs.argv"),
    ("argv-non-string", lambda: pool(argv=["python", 3]), "pools.envs.argv"),
    ("argv-empty-program", lambda: pool(argv=["", "env.py"]), "the program to run, is empty"),
    ("name-too-long", lambda: pool(name="e" * 101), "101 characters; a pool name has at most"),
    ("argv-unknown-placeholder", lambda: pool(argv=["env", "{slot}"]), "pools.envs.argv"),
    ("argv-unknown-in-middle", lambda: pool(argv=["--id=w{idx}x"]), "{idx}"),
    ("argv-positional-empty", lambda: pool(argv=["env", "{}"]), "pools.envs.argv"),
    ("argv-positional-index", lambda: pool(argv=["env", "{0}"]), "pools.envs.argv"),
    ("argv-attribute", lambda: pool(argv=["env", "{pool.name}"]), "pools.envs.argv"),
    ("argv-item", lambda: pool(argv=["env", "{gpus[0]}"]), "pools.envs.argv"),
    ("argv-bad-format", lambda: pool(argv=["env", "{index:q}"]), "Unknown format code 'q'"),
    ("argv-bad-conversion", lambda: pool(argv=["env", "{gpus!z}"]), "cannot be filled in"),
    ("argv-text-as-number", lambda: pool(argv=["env", "{worker_id:d}"]), "pools.envs.argv"),
    # counts
    ("min-negative", lambda: pool(min_workers=-1), "pools.envs.min_workers"),
    ("min-above-max", lambda: pool(min_workers=3, max_workers=2), "pools.envs.max_workers"),
    ("max-negative", lambda: pool(min_workers=0, max_workers=-1), "pools.envs.max_workers"),
    ("gpus-per-worker-negative", lambda: pool(gpus_per_worker=-1), "pools.envs.gpus_per_worker"),
    # env
    (
        "env-reserved-cuda",
        lambda: pool(env={"CUDA_VISIBLE_DEVICES": "0"}),
        "pools.envs.env.CUDA_VISIBLE_DEVICES",
    ),
    (
        "env-reserved-worker-id",
        lambda: pool(env={"DEO_WORKER_ID": "x"}),
        "pools.envs.env.DEO_WORKER_ID",
    ),
    ("env-reserved-pool", lambda: pool(env={"DEO_POOL": "x"}), "pools.envs.env.DEO_POOL"),
    # every DEO_ name is deo's: a worker's run id, token, API and heartbeat file among them
    *(
        (f"env-reserved-{key.lower()}", functools.partial(pool, env={key: "x"}), f"env.{key}")
        for key in (
            "DEO_RUN_ID",
            "DEO_HEARTBEAT_FILE",
            "DEO_API_URL",
            "DEO_WORKER_TOKEN",
            "DEO_TOKEN",
            "DEO_ANYTHING_NEW",
        )
    ),
    ("env-bad-name", lambda: pool(env={"1ABC": "x"}), "pools.envs.env.1ABC"),
    ("env-bad-name-dash", lambda: pool(env={"MY-VAR": "x"}), "pools.envs.env.MY-VAR"),
    ("env-non-string-value", lambda: pool(env={"SEED": 3}), "pools.envs.env.SEED"),
    # drain signal
    ("drain-sigkill", lambda: pool(drain_signal="SIGKILL"), "pools.envs.drain_signal"),
    ("drain-lowercase", lambda: pool(drain_signal="sigusr1"), "pools.envs.drain_signal"),
    ("drain-number", lambda: pool(drain_signal="10"), "pools.envs.drain_signal"),
    # timeouts must be > 0 (NaN is not > 0 either)
    *[
        (f"{key}-{value}", (lambda k=key, v=value: pool(**{k: v})), f"pools.envs.{key}")
        for key in (
            "start_timeout_s",
            "drain_timeout_s",
            "stop_timeout_s",
            "metrics_stale_s",
            "heartbeat_grace_s",
        )
        for value in (0, 0.0, -1.0, math.nan)
    ],
    ("stabilization-negative", lambda: pool(stabilization_s=-1.0), "pools.envs.stabilization_s"),
    ("stabilization-nan", lambda: pool(stabilization_s=math.nan), "pools.envs.stabilization_s"),
    # infinity has no spelling in the JSON log: every number must be finite
    *[
        (f"{key}-{value}", (lambda k=key, v=value: pool(**{k: v})), f"pools.envs.{key}")
        for key in (
            "start_timeout_s",
            "drain_timeout_s",
            "stop_timeout_s",
            "metrics_stale_s",
            "heartbeat_grace_s",
            "stabilization_s",
            "queue_alert_batches",
        )
        for value in (math.inf, -math.inf)
    ],
    ("crash-cap-inf", lambda: CrashLoopRules(backoff_cap_s=math.inf), "crash_loop.backoff_cap_s"),
    ("crash-cap-nan", lambda: CrashLoopRules(backoff_cap_s=math.nan), "crash_loop.backoff_cap_s"),
    (
        "crash-base-inf",
        lambda: CrashLoopRules(backoff_base_s=math.inf),
        "crash_loop.backoff_base_s",
    ),
    (
        "cordon-temp-inf",
        lambda: CordonRules(max_temperature_c=math.inf),
        "cordon.max_temperature_c",
    ),
    (
        "cordon-temp-nan",
        lambda: CordonRules(max_temperature_c=math.nan),
        "cordon.max_temperature_c",
    ),
    (
        "cordon-uncordon-inf",
        lambda: CordonRules(uncordon_after_s=math.inf),
        "cordon.uncordon_after_s",
    ),
    ("policy-param-inf", lambda: PolicySpec(params={"refill_s": math.inf}), "policy.refill_s"),
    ("policy-param-nan", lambda: PolicySpec(params={"refill_s": math.nan}), "policy.refill_s"),
    # the whole configuration
    ("duplicate-pool", lambda: Config(pools=[pool(), pool(max_workers=3)]), "pools.envs"),
    ("duplicate-gpu", lambda: Config(gpus=["0", "1", "0"]), "gpus"),
    ("duplicate-gpu-uuid", lambda: Config(gpus=["GPU-a", "GPU-a"]), "gpus"),
    ("empty-gpu-id", lambda: Config(gpus=["0", ""]), "gpus"),
    ("gpu-id-with-comma", lambda: Config(gpus=["0,1"]), "gpus"),
    ("gpu-id-not-a-string", lambda: Config(gpus=[0]), "gpus"),
    (
        "gpus-per-worker-exceeds-declared",
        lambda: Config(pools=[pool(gpus_per_worker=3)], gpus=["0", "1"]),
        "pools.envs.gpus_per_worker",
    ),
    (
        "gpus-per-worker-without-gpus",
        lambda: Config(pools=[pool(gpus_per_worker=1)]),
        "pools.envs.gpus_per_worker",
    ),
    # cordon rules: max_memory_fraction in (0, 1]
    (
        "cordon-fraction-zero",
        lambda: CordonRules(max_memory_fraction=0.0),
        "cordon.max_memory_fraction",
    ),
    (
        "cordon-fraction-negative",
        lambda: CordonRules(max_memory_fraction=-0.5),
        "cordon.max_memory_fraction",
    ),
    (
        "cordon-fraction-above-one",
        lambda: CordonRules(max_memory_fraction=1.01),
        "cordon.max_memory_fraction",
    ),
    (
        "cordon-fraction-nan",
        lambda: CordonRules(max_memory_fraction=math.nan),
        "cordon.max_memory_fraction",
    ),
    (
        "cordon-uncordon-negative",
        lambda: CordonRules(uncordon_after_s=-1.0),
        "cordon.uncordon_after_s",
    ),
    # crash-loop rules
    (
        "crash-cap-below-base",
        lambda: CrashLoopRules(backoff_base_s=10.0, backoff_cap_s=5.0),
        "crash_loop.backoff_cap_s",
    ),
    ("crash-base-zero", lambda: CrashLoopRules(backoff_base_s=0.0), "crash_loop.backoff_base_s"),
    ("crash-early-exit-zero", lambda: CrashLoopRules(early_exit_s=0.0), "crash_loop.early_exit_s"),
    ("crash-alert-after-zero", lambda: CrashLoopRules(alert_after=0), "crash_loop.alert_after"),
    # policy parameters: names are identifiers, values scalars
    ("policy-param-name", lambda: PolicySpec(params={"Refill": 1.0}), "policy.Refill"),
    ("policy-param-dash", lambda: PolicySpec(params={"refill-s": 1.0}), "policy.refill-s"),
    ("policy-param-list", lambda: PolicySpec(params={"refill_s": [1.0]}), "policy.refill_s"),
    ("policy-param-none", lambda: PolicySpec(params={"refill_s": None}), "policy.refill_s"),
]


@pytest.mark.parametrize(
    ("build", "key"), [(b, k) for _, b, k in INVALID], ids=[i for i, _, _ in INVALID]
)
def test_invalid_value_raises_config_error_naming_its_key(
    build: Callable[[], object], key: str
) -> None:
    with pytest.raises(ConfigError) as info:
        build()
    assert key in str(info.value)


def test_config_error_is_an_invalid_event() -> None:
    # The reducer refuses a bad Configured event like any other invalid input.
    with pytest.raises(InvalidEvent):
        pool(min_workers=2, max_workers=1)


def test_unknown_placeholder_message_lists_the_known_ones() -> None:
    with pytest.raises(ConfigError) as info:
        pool(argv=["env", "{slot}"])
    message = str(info.value)
    for name in ARGV_PLACEHOLDERS:
        assert name in message
    assert "{{" in message  # how to write a literal brace


def test_duplicate_pool_message_says_declared_twice() -> None:
    with pytest.raises(ConfigError, match=r"pools\.envs: declared twice"):
        Config(pools=[pool(), pool()])


def test_duplicate_gpu_message_names_the_gpu() -> None:
    with pytest.raises(ConfigError, match=r"gpus: '7' listed twice"):
        Config(gpus=["7", "3", "7"])


def test_gpus_per_worker_message_gives_both_counts() -> None:
    with pytest.raises(ConfigError) as info:
        Config(pools=[pool(gpus_per_worker=3)], gpus=["0", "1"])
    assert "(3)" in str(info.value)
    assert "2 GPUs" in str(info.value)


@pytest.mark.parametrize("arg", ["{", "--x={index", "}", "--x=index}"])
def test_unbalanced_brace_raises_config_error(arg: str) -> None:
    with pytest.raises(ConfigError, match=r"pools\.envs\.argv"):
        pool(argv=["env", arg])


def test_argv_given_as_one_string_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"pools\.envs\.argv"):
        pool(argv="python env.py")


# --- values on the edge of validity are accepted ------------------------------------------------


@pytest.mark.parametrize(
    "build",
    [
        pytest.param(lambda: pool("a"), id="one-letter-name"),
        pytest.param(lambda: pool("0pool.v2_x"), id="digits-dots-underscores"),
        pytest.param(lambda: pool(min_workers=3, max_workers=3), id="min-equals-max"),
        pytest.param(lambda: pool(min_workers=0, max_workers=0), id="zero-zero"),
        pytest.param(lambda: pool(argv=["x", "{{literal}}", "{{"]), id="escaped-braces"),
        pytest.param(
            lambda: pool(argv=[f"{{{name}}}" for name in sorted(ARGV_PLACEHOLDERS)]),
            id="every-placeholder",
        ),
        pytest.param(lambda: pool(argv=["x", "{index:03d}", "{worker_id!r}"]), id="format-spec"),
        pytest.param(lambda: pool(env={"MY_VAR": "", "_x1": "y"}), id="env-identifiers"),
        pytest.param(lambda: pool(drain_signal="SIGTERM"), id="drain-sigterm"),
        pytest.param(lambda: pool(heartbeat_grace_s=None), id="no-heartbeat"),
        pytest.param(lambda: pool(stabilization_s=0.0), id="no-stabilization"),
        pytest.param(lambda: pool(start_timeout_s=1e-6), id="tiny-timeout"),
        pytest.param(
            lambda: Config(pools=[pool(gpus_per_worker=2)], gpus=["0", "GPU-1"]),
            id="gpus-per-worker-equals-declared",
        ),
        pytest.param(lambda: Config(pools=[pool("a"), pool("b")]), id="two-pools"),
        pytest.param(lambda: CordonRules(max_memory_fraction=1.0), id="fraction-one"),
        pytest.param(lambda: CordonRules(uncordon_after_s=0.0), id="uncordon-zero"),
        pytest.param(lambda: CrashLoopRules(backoff_base_s=5.0, backoff_cap_s=5.0), id="cap-eq"),
        pytest.param(lambda: PolicySpec(params={"a": 1, "b": 1.5, "c": "x", "d": True}), id="ps"),
    ],
)
def test_values_on_the_edge_are_accepted(build: Callable[[], object]) -> None:
    assert build() is not None


def test_config_pool_lookup() -> None:
    a, b = pool("a"), pool("b", max_workers=4)
    config = Config(pools=[a, b], gpus=["0"])
    assert config.pool("b") is b
    assert config.pool("a") is a
    assert config.pool("c") is None
    assert config.pools == (a, b)
    assert config.gpus == ("0",)


# --- GPU devices --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("gpus", "devices", "message"),
    [
        (["0", "1"], {"2": "5"}, "gpu_devices: '2' is not one of the gpus declared"),
        (["0"], {"0": ""}, "gpu_devices.0: '' is not a device id"),
        (["0"], {"0": "3,4"}, "gpu_devices.0: '3,4' is not a device id"),
        (["0"], {"0": 3}, "gpu_devices.0: 3 is not a device id"),
        (["0", "1"], {"0": "1"}, "gpu_devices: '0' and '1' are the same device '1'"),
        (["0", "1"], {"0": "7", "1": "7"}, "gpu_devices: '0' and '1' are the same device '7'"),
    ],
)
def test_bad_gpu_devices_name_the_gpu(
    gpus: list[str], devices: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        Config(gpus=gpus, gpu_devices=devices)


def test_a_gpu_is_its_own_device_unless_mapped_and_identity_entries_are_not_kept() -> None:
    config = Config(gpus=["0", "1", "GPU-a"], gpu_devices={"0": "3", "1": "1"})
    assert [config.device_of(g) for g in config.gpus] == ["3", "1", "GPU-a"]
    assert config.gpu_devices == {"0": "3"}
    # One way to say "its own device": a resolved identity mapping equals no mapping at all.
    assert Config(gpus=["0"], gpu_devices={"0": "0"}) == Config(gpus=["0"])


def test_workers_are_given_the_device_ids_and_keep_the_configured_ones() -> None:
    spec = pool(gpus_per_worker=2, max_workers=1, policy=STATIC_ONE)
    config = Config(pools=[spec], gpus=["0", "1"], gpu_devices={"0": "3", "1": "1"})
    reducer = Reducer()
    [spawn] = [c for c in reducer.step(Configured(t=0.0, config=config)) if type(c) is SpawnWorker]
    assert spawn.env["CUDA_VISIBLE_DEVICES"] == "3,1"
    assert spawn.gpus == ("0", "1") == reducer.state.workers["envs-0"].gpus


def test_a_configured_record_from_before_gpu_devices_decodes_to_identity() -> None:
    record = encode(Configured(t=1.0, config=Config(gpus=["0", "1"])))
    del record["config"]["gpu_devices"]  # as deo wrote it before the field existed
    event = decode(record)
    assert event.config.gpu_devices == {}
    assert event.config.device_of("1") == "1"
    mapped = Configured(t=1.0, config=Config(gpus=["0", "1"], gpu_devices={"0": "3", "1": "1"}))
    assert decode(encode(mapped)) == mapped


# --- argv rendering -----------------------------------------------------------------------------


def test_render_argv_fills_every_placeholder() -> None:
    spec = pool(
        "envs",
        argv=[
            "python",
            "env.py",
            "--id={worker_id}",
            "--pool",
            "{pool}",
            "--slot",
            "{index}",
            "--gpus={gpus}",
        ],
    )
    rendered = spec.render_argv(worker_id="envs-3", index=3, gpus=("0", "GPU-abc"))
    assert rendered == (
        "python",
        "env.py",
        "--id=envs-3",
        "--pool",
        "envs",
        "--slot",
        "3",
        "--gpus=0,GPU-abc",
    )


@pytest.mark.parametrize(
    ("arg", "expected"),
    [
        ("{{worker_id}}", "{worker_id}"),  # '{{' escapes: the placeholder stays literal
        ("{{", "{"),
        ("}}", "}"),
        ("{{{index}}}", "{7}"),  # escaped braces around a real placeholder
        ('{{"json": {index}}}', '{"json": 7}'),
        ("{index:03d}", "007"),  # format specs apply
        ("{worker_id}/{worker_id}", "w-7/w-7"),  # a placeholder may repeat
        ("plain", "plain"),
        ("", ""),
    ],
)
def test_render_argv_escapes_and_formats(arg: str, expected: str) -> None:
    spec = pool(argv=["x", arg])
    assert spec.render_argv(worker_id="w-7", index=7, gpus=("1",)) == ("x", expected)


@pytest.mark.parametrize(
    ("gpus", "expected"),
    [((), ""), (("3",), "3"), (("0", "1", "2"), "0,1,2")],
)
def test_render_argv_joins_gpus_with_commas(gpus: tuple[str, ...], expected: str) -> None:
    spec = pool(argv=["x", "{gpus}"])
    assert spec.render_argv(worker_id="w", index=0, gpus=gpus) == ("x", expected)


def test_render_argv_does_not_change_the_spec() -> None:
    spec = pool(argv=["x", "{index}"])
    spec.render_argv(worker_id="w", index=1, gpus=())
    assert spec.argv == ("x", "{index}")


# --- crash-loop backoff -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("base", "cap", "failures", "expected"),
    [
        (1.0, 300.0, -3, 0.0),  # no failures: no delay
        (1.0, 300.0, 0, 0.0),
        (1.0, 300.0, 1, 1.0),  # base x 2**0
        (1.0, 300.0, 2, 2.0),  # base x 2**1
        (1.0, 300.0, 3, 4.0),  # base x 2**2
        (1.0, 300.0, 4, 8.0),
        (1.0, 300.0, 9, 256.0),  # 2**8 = 256 < 300
        (1.0, 300.0, 10, 300.0),  # 2**9 = 512 > 300: capped
        (1.0, 300.0, 11, 300.0),
        (2.5, 20.0, 1, 2.5),
        (2.5, 20.0, 2, 5.0),
        (2.5, 20.0, 3, 10.0),
        (2.5, 20.0, 4, 20.0),  # 2.5 x 8 = 20 = cap exactly
        (2.5, 20.0, 5, 20.0),  # 2.5 x 16 = 40: capped
        (5.0, 5.0, 1, 5.0),  # cap == base: constant
        (5.0, 5.0, 7, 5.0),
        (1.0, 300.0, 61, 300.0),  # the exponent bound (60) is reached
        (1.0, 300.0, 10_000, 300.0),  # 2**9999 would overflow a float: stays the cap
        (1.0, 300.0, 10**18, 300.0),
        (1e300, 1e300, 10_000, 1e300),  # 1e300 x 2**60 overflows to inf: still the cap
    ],
)
def test_backoff_table(base: float, cap: float, failures: int, expected: float) -> None:
    delay = CrashLoopRules(backoff_base_s=base, backoff_cap_s=cap).backoff_s(failures)
    assert delay == expected
    assert isinstance(delay, float)
    assert math.isfinite(delay)


@given(
    base=st.floats(min_value=1e-3, max_value=1e3),
    extra=st.floats(min_value=0.0, max_value=1e6),
    failures=st.integers(min_value=0, max_value=10**9),
)
def test_backoff_is_bounded_and_monotonic(base: float, extra: float, failures: int) -> None:
    rules = CrashLoopRules(backoff_base_s=base, backoff_cap_s=base + extra)
    delay, after = rules.backoff_s(failures), rules.backoff_s(failures + 1)
    assert math.isfinite(delay)
    assert 0.0 <= delay <= rules.backoff_cap_s
    assert after >= delay
    if failures >= 1:
        assert delay >= rules.backoff_base_s


def test_a_pool_env_may_use_names_that_only_resemble_deo_s() -> None:
    assert pool(env={"DEOX": "1", "MY_DEO_RUN_ID": "2", "deo_run_id": "3"}).env["DEOX"] == "1"


def test_a_reserved_deo_name_is_refused_with_its_key_and_why() -> None:
    with pytest.raises(ConfigError, match=r"pools\.envs\.env\.DEO_API_URL: variables named DEO_\*"):
        pool(env={"PYTHONUNBUFFERED": "1", "DEO_API_URL": "http://elsewhere:1"})
