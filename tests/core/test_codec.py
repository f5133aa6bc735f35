"""Invariant 8: every event and command survives the log encoding unchanged."""

from __future__ import annotations

import enum
import typing
from typing import Any

import attrs
import hypothesis.strategies as st
import orjson
import pytest
from hypothesis import assume, given

from core import (
    Command,
    Config,
    Configured,
    DeoError,
    Event,
    InvalidEvent,
    PolicySpec,
    PoolSpec,
    Reducer,
    codec,
)
from core import commands as c
from core import events as e
from core.arbiter import ClusterSpec, PlannerSettings, Priority
from core.arbiter import commands as arbiter_commands
from core.arbiter import events as arbiter_events

EVENTS = sorted(
    (k for k in codec.REGISTRY.values() if issubclass(k, e.Event) and k is not e.Event),
    key=lambda k: k.__name__,
)
COMMANDS = sorted(
    (k for k in codec.REGISTRY.values() if issubclass(k, c.Command) and k is not c.Command),
    key=lambda k: k.__name__,
)

text = st.text(min_size=1, max_size=12)
names = st.from_regex(r"[a-z][a-z0-9_]{0,8}", fullmatch=True)
configs = st.builds(
    Config,
    pools=st.lists(
        st.builds(
            PoolSpec,
            name=names,
            argv=st.lists(
                st.sampled_from(["python", "env.py", "{worker_id}", "--x={{y}}"]),
                min_size=1,
                max_size=4,
            ),
            max_workers=st.integers(1, 8),
            env=st.dictionaries(st.from_regex(r"[A-Z_]{1,6}", fullmatch=True), text, max_size=2),
            policy=st.sampled_from(
                [PolicySpec(), PolicySpec(name="hpa", params={"target_per_worker": 2.5})]
            ),
            heartbeat_grace_s=st.none() | st.floats(1, 100),
        ),
        max_size=3,
        unique_by=lambda p: p.name,
    ),
    gpus=st.lists(
        st.from_regex(r"(GPU-[0-9a-f]{8}|[0-9])", fullmatch=True), unique=True, max_size=4
    ),
)

cluster_specs = st.builds(
    ClusterSpec,
    name=names,
    kind=st.sampled_from(Priority),
    device_mapping=st.lists(st.sampled_from("0123"), min_size=1, max_size=4, unique=True).map(
        tuple
    ),
)

planner_settings = st.builds(
    PlannerSettings,
    name=st.sampled_from(["deo", "rlix"]),
    stale_after_s=st.none() | st.floats(1, 1e4),
    hysteresis=st.floats(0, 2),
    move_cost_s=st.floats(0, 600),
    reserve_s=st.none() | st.floats(1, 1e5),
    reserve_factor=st.none() | st.floats(1, 10),
    reserve_min_s=st.floats(0, 600),
    rate_over_awake_gpu_s=st.booleans(),
    step_weight=st.floats(0, 8),
)


def strategy_for(name: str, hint: Any) -> st.SearchStrategy[Any]:
    if name in ("t", "deadline_t"):
        return st.floats(0, 1e9, allow_nan=False)
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return st.sampled_from(hint)
    if name in ("worker_id", "gpu_id", "pool", "subject", "pipeline", "cluster", "release_cluster"):
        return names
    if hint is Config:
        return configs
    if hint is ClusterSpec:
        return cluster_specs
    if hint is PlannerSettings:
        return planner_settings
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, type(int | None)):
        inner = [a for a in args if a is not type(None)]
        return st.none() | strategy_for(name, inner[0])
    if hint is int:
        return st.integers(0, 2**53)
    if hint is float:
        return st.floats(0, 1e6, allow_nan=False)
    if hint is str:
        return st.text(max_size=40)
    if origin is tuple and args[0] is int:
        return st.lists(st.integers(0, 64), max_size=4).map(tuple)
    if origin is tuple:
        return st.lists(text, max_size=4).map(tuple)
    if origin is frozenset:
        return st.frozensets(st.sampled_from(["thermal", "power", "errors", "lost"]))
    if origin is dict:
        return st.dictionaries(names, text, max_size=3)
    raise AssertionError(f"no strategy for {name}: {hint}")


def instances(cls: type) -> st.SearchStrategy[Any]:
    hints = typing.get_type_hints(cls)
    fields = {f.name: strategy_for(f.name, hints[f.name]) for f in attrs.fields(cls)}

    def build(kwargs: dict[str, Any]) -> Any:
        try:
            return cls(**kwargs)
        except InvalidEvent:
            assume(False)

    return st.fixed_dictionaries(fields).map(build)


def through_the_log(value: Any) -> Any:
    return codec.decode(orjson.loads(orjson.dumps(codec.encode(value))))


def test_every_event_and_command_type_is_covered() -> None:
    assert {cls.__name__ for cls in EVENTS} == set(e.__all__) - {"Event"} | set(
        arbiter_events.__all__
    )
    assert {cls.__name__ for cls in COMMANDS} == set(c.__all__) - {"Command"} | set(
        arbiter_commands.__all__
    )


@pytest.mark.parametrize("cls", EVENTS, ids=lambda k: k.__name__)
@given(data=st.data())
def test_events_round_trip(cls: type, data: st.DataObject) -> None:
    event = data.draw(instances(cls))
    assert isinstance(event, Event)
    assert through_the_log(event) == event


@pytest.mark.parametrize("cls", COMMANDS, ids=lambda k: k.__name__)
@given(data=st.data())
def test_commands_round_trip(cls: type, data: st.DataObject) -> None:
    command = data.draw(instances(cls))
    assert isinstance(command, Command)
    assert through_the_log(command) == command


@pytest.mark.parametrize(
    ("record", "message"),
    [
        ({"@": "NoSuchEvent", "t": 1.0}, "unknown record type 'NoSuchEvent'"),
        ({"@": "Tick"}, "Tick"),
        ({"@": "Tick", "t": 1.0, "extra": 2}, "extra"),
        ({"@": "Tick", "t": -1.0}, "Tick.t must be a finite number"),
        ({"@": "os.system", "t": 1.0}, "unknown record type"),
        (
            {"@": "WorkerReady", "t": 2.0, "worker_id": 5},
            "WorkerReady.worker_id must be a non-empty",
        ),
        (
            {"@": "CordonGpu", "gpu_id": "0", "causes": "errors", "reason": "r"},
            r"CordonGpu\.causes must be a set of strings, got 'errors'",
        ),
    ],
)
def test_bad_records_raise_the_core_error(record: dict[str, Any], message: str) -> None:
    with pytest.raises(DeoError, match=message):
        codec.decode(record)


def test_outside_classes_decode_only_with_the_types_that_name_them() -> None:
    @attrs.frozen(slots=True, kw_only=True)
    class OutsideMemory:
        count: int = 0

    encoded = codec.encode(OutsideMemory(count=3))
    assert encoded == {"@": "OutsideMemory", "count": 3}
    with pytest.raises(InvalidEvent, match="unknown record type 'OutsideMemory'"):
        codec.decode(encoded)  # the core's registry is closed and never grows
    types = codec.types_with([OutsideMemory])
    assert codec.decode(encoded, types) == OutsideMemory(count=3)
    assert "OutsideMemory" not in codec.REGISTRY
    assert codec.types_with([OutsideMemory], types) == types  # naming it twice is harmless

    @attrs.frozen(slots=True, kw_only=True)
    class OutsideMemory2:
        count: int = 0

    OutsideMemory2.__name__ = "OutsideMemory"
    with pytest.raises(ValueError, match="'OutsideMemory' is already"):
        codec.types_with([OutsideMemory2], types)
    with pytest.raises(ValueError, match="'Tick' is already"):
        codec.types_with([attrs.make_class("Tick", ["t"])])
    with pytest.raises(ValueError, match="not an attrs class"):
        codec.types_with([int])
    with pytest.raises(TypeError):
        codec.REGISTRY["OutsideMemory"] = OutsideMemory  # type: ignore[index]


def test_a_state_encodes_its_read_only_collections_and_decodes_them_read_only() -> None:
    reducer = Reducer()
    static = PolicySpec(name="static", params={"count": 2})
    reducer.step(
        Configured(
            t=0.0,
            config=Config(pools=[PoolSpec(name="envs", argv=["x"], max_workers=4, policy=static)]),
        )
    )
    reducer.step(e.LoadSampled(t=1.0, pool="envs", in_flight_requests=3))
    state = reducer.state
    assert state.pools["envs"].built_policy is not None
    encoded = codec.encode(state)
    assert type(encoded["pools"]) is dict and type(encoded["workers"]) is dict
    # Derived fields (kept for speed, rebuilt on construction) are not written.
    assert "worker_counts" not in encoded and "built_policy" not in encoded["pools"]["envs"]
    decoded = through_the_log(state)
    assert decoded == state
    assert decoded.worker_counts == state.worker_counts == {"envs": (2, 0)}
    assert decoded.pools["envs"].built_policy is None  # built again by the first step needing it
    with pytest.raises(TypeError):
        decoded.workers["envs-9"] = decoded.workers["envs-0"]  # type: ignore[index]


def test_a_record_written_before_a_field_existed_decodes_as_it_ran() -> None:
    recorded = codec.encode(PlannerSettings())
    del recorded["step_weight"]
    assert PlannerSettings().step_weight == 2.0
    assert codec.decode(recorded) == PlannerSettings(step_weight=0.0)
    # A record that has the field keeps it.
    assert codec.decode(codec.encode(PlannerSettings(step_weight=3.0))).step_weight == 3.0
