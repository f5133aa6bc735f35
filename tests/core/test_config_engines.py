"""core.config: engine pools (kind, engine, ports, {port}, capacity, max_asleep, router port)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from core.codec import decode, encode
from core.config import Config, PolicySpec, PoolSpec, fill_engine_host
from core.errors import ConfigError

ENGINE_ARGV = ("vllm", "serve", "m", "--port", "{port}")


def engine(name: str = "gen", **kwargs: Any) -> PoolSpec:
    kwargs.setdefault("argv", ENGINE_ARGV)
    kwargs.setdefault("kind", "engine")
    kwargs.setdefault("engine", "vllm")
    kwargs.setdefault("ports", (18000, 18007))
    kwargs.setdefault("max_workers", 4)
    return PoolSpec(name=name, **kwargs)


INVALID: list[tuple[str, Callable[[], object], str]] = [
    ("kind", lambda: engine(kind="gpu"), "pools.gen.kind: unknown pool kind 'gpu'"),
    ("engine", lambda: engine(engine="trt"), "pools.gen.engine: 'trt' is not an engine"),
    ("no-engine", lambda: engine(engine=None), "pools.gen.engine: None is not an engine"),
    ("no-port", lambda: engine(argv=("vllm", "serve")), "pools.gen.argv: an engine pool's argv"),
    ("no-ports", lambda: engine(ports=None), "pools.gen.ports: required"),
    ("ports-shape", lambda: engine(ports=(18000,)), "pools.gen.ports: expected [first, last]"),
    ("ports-order", lambda: engine(ports=(18005, 18000)), "pools.gen.ports: [18005, 18000]"),
    ("ports-high", lambda: engine(ports=(65535, 65536)), "pools.gen.ports: [65535, 65536]"),
    (
        "ports-few",
        lambda: engine(ports=(18000, 18002), max_workers=4),
        "pools.gen.ports: [18000, 18002] holds 3 port(s), fewer than max_workers (4)",
    ),
    (
        "router-in-range",
        lambda: engine(router_port=18003),
        "pools.gen.router_port (18003) is inside",
    ),
    ("capacity", lambda: engine(capacity_per_engine=0), "pools.gen.capacity_per_engine"),
    ("max_asleep", lambda: engine(max_asleep=-1), "pools.gen.max_asleep must be >= 0"),
    ("sleep_level", lambda: engine(sleep_level=3), "pools.gen.sleep_level must be 1 or 2"),
    ("timeout", lambda: engine(control_timeout_s=0), "pools.gen.control_timeout_s must be > 0"),
    ("attempts", lambda: engine(control_attempts=0), "pools.gen.control_attempts must be >= 1"),
    (
        "port-in-worker-pool",
        lambda: PoolSpec(name="envs", argv=("env", "{port}")),
        "pools.envs.argv: {port} in '{port}' is only given to engine pools",
    ),
    (
        "ports-in-worker-pool",
        lambda: PoolSpec(name="envs", argv=("env",), ports=(1, 2)),
        "pools.envs.ports: only engine pools",
    ),
    (
        "overlapping-pools",
        lambda: Config(pools=[engine("a"), engine("b", ports=(18007, 18010))]),
        "pools.b: port 18007 is also pool a's",
    ),
    (
        "router-on-other-pool",
        lambda: Config(pools=[engine("a"), engine("b", ports=(19000, 19007), router_port=18001)]),
        "pools.b: port 18001 is also pool a's",
    ),
]


@pytest.mark.parametrize(
    ("build", "message"), [r[1:] for r in INVALID], ids=[r[0] for r in INVALID]
)
def test_a_bad_engine_setting_names_its_key(build: Callable[[], object], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        build()
    assert str(info.value).startswith(message), str(info.value)


def test_an_engine_pool_renders_its_port_and_round_trips_the_log() -> None:
    spec = engine(router_port=18100, max_asleep=2)
    assert spec.render_argv(worker_id="gen-0", index=0, gpus=(), port=18003)[-1] == "18003"
    assert spec.port_range() == range(18000, 18008)
    assert spec.awaits_ready and spec.is_engine
    config = Config(pools=[spec])
    assert decode(encode(config)) == config


def test_only_the_host_placeholder_is_filled_with_the_engines_address() -> None:
    # A literal {{host}} renders as the text "{host}": the engine gets that text, not an address.
    spec = engine(argv=("serve", "--host", "{host}", "--note", "{{host}}", "--port", "{port}"))
    rendered = spec.render_argv(worker_id="gen-0", index=0, gpus=(), port=18000)
    assert fill_engine_host(rendered, "10.0.0.5") == [
        "serve",
        "--host",
        "10.0.0.5",
        "--note",
        "{host}",
        "--port",
        "18000",
    ]


def test_the_threshold_policy_takes_the_engine_capacity_unless_given_its_own() -> None:
    spec = engine(policy=PolicySpec(name="threshold"), capacity_per_engine=16)
    assert spec.policy.params["capacity_per_worker"] == 16
    own = engine(policy=PolicySpec(name="threshold", params={"capacity_per_worker": 4}))
    assert own.policy.params["capacity_per_worker"] == 4


def test_an_engine_pools_threshold_policy_counts_starting_engines_unless_told_not_to() -> None:
    assert engine(policy=PolicySpec(name="threshold")).policy.params["count_starting"] is True
    verl = engine(policy=PolicySpec(name="threshold", params={"count_starting": False}))
    assert verl.policy.params["count_starting"] is False


def test_a_worker_pool_is_unchanged_by_the_engine_settings() -> None:
    spec = PoolSpec(name="envs", argv=("env",))
    assert spec.kind == "worker" and not spec.is_engine and not spec.awaits_ready
    assert spec.port_range() == range(0)


def test_a_routed_engine_pool_that_could_scale_to_no_engine_is_refused() -> None:
    with pytest.raises(ConfigError) as info:
        engine(router_port=18100, policy=PolicySpec(name="threshold"))
    assert str(info.value).startswith("pools.gen.min_workers: an engine pool with a router_port")
    # One engine always awake, a pinned count, or no router: accepted.
    engine(router_port=18100, policy=PolicySpec(name="threshold"), min_workers=1)
    engine(router_port=18100, policy=PolicySpec(name="static", params={"count": 0}))
    engine(policy=PolicySpec(name="threshold"))
