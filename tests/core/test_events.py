"""Events and commands check every field on construction, from their annotations."""

from __future__ import annotations

import math
import re
import signal
import typing
from typing import Any

import attrs
import pytest

from core import Config, InvalidEvent, Reducer, codec
from core import commands as c
from core import events as e
from core.convert import Name, Seconds
from core.vocabulary import AlertName, DecisionSource

EVENTS = [getattr(e, name) for name in e.__all__]
COMMANDS = [getattr(c, name) for name in c.__all__]

#: A value that fits, by field name (every field of every event and command is here).
GOOD: dict[str, Any] = {
    "t": 1.5,
    "deadline_t": 30.0,
    "config": Config(),
    "pool": "envs",
    "worker_id": "envs-0",
    "gpu_id": "0",
    "count": 2,
    "queued_sequences": 64,
    "batch_size_seqs": 32,
    "trainer_step": 3,
    "in_flight_requests": 7,
    "error": "connection refused",
    "pid": 4242,
    "start_time": 123456,
    "exit_code": 1,
    "signal": 9,
    "reason": "because",
    "memory_used_bytes": 1,
    "memory_total_bytes": 2,
    "temperature_c": -5.0,
    "throttle_reasons": frozenset({"thermal"}),
    "new_errors": 0,
    "argv": ("python", "env.py"),
    "gpus": ("0",),
    "env": {"DEO_POOL": "envs"},
    "previous": 1,
    "target": 2,
    "source": "policy",
    "causes": frozenset({"errors"}),
    "alert": "crash_loop",
    "subject": "envs",
    "interval_s": 0.5,
    "worker_ids": frozenset({"envs-0", "envs-1"}),
    "seen_t": 1.0,
    "detail": "pid 4243 (child of pid 4242)",
    "port": 18000,
    "waiting_requests": 2,
    "hold_s": 600.0,
    "engine": "vllm",
    "level": 1,
    "timeout_s": 30.0,
    "attempt": 1,
    "address": "10.0.0.1:6379",
}
# The last field in a signal's place differs by class: DrainWorker's is the signal's name.
GOOD_BY_CLASS: dict[tuple[type, str], Any] = {(c.DrainWorker, "signal"): "SIGUSR1"}

#: Values that do not fit, by annotation, each with what the message says is expected.
BAD: dict[Any, tuple[list[Any], str]] = {
    Seconds: (
        [-1, -0.5, math.nan, math.inf, True, "1", None, [1.0]],
        "a finite number of seconds >= 0",
    ),
    float: ([math.nan, math.inf, -math.inf, True, "1.0", None], "a finite number"),
    int: ([-1, 2**63, 1.0, True, "1", None, [1]], "an integer in [0, 2**63)"),
    Name: (["", 5, None, b"envs", ["envs"]], "a non-empty string"),
    str: ([5, None, b"x", ["x"], {"x": 1}], "a string"),
    Name | None: (["", 5, 0.0, ["envs"]], "null or a non-empty string"),
    Seconds | None: (
        [-1, math.nan, math.inf, True, "1"],
        "null or a finite number of seconds >= 0",
    ),
    int | None: ([-1, 2**63, 1.5, False, "1"], "null or an integer in [0, 2**63)"),
    frozenset[str]: (
        ["abc", 5, None, [["unhashable"]], frozenset({1}), frozenset({"a", None})],
        "a set of strings",
    ),
    tuple[str, ...]: (["python env.py", 5, None, ("a", 1), (None,)], "a list of strings"),
    dict[str, str]: ([{"A": 1}, {1: "a"}, [("A", "a")], "A=a", None], "an object of strings"),
    Config: ([{}, None, "config"], "a Config"),
    AlertName: (
        [5, None, "no_such_alert", ["crash_loop"]],
        "one of " + ", ".join(a.value for a in AlertName),
    ),
    DecisionSource: (
        [5, None, "autoscaler", ["policy"]],
        "one of " + ", ".join(s.value for s in DecisionSource),
    ),
}


def good_fields(cls: type) -> dict[str, Any]:
    return {f.name: GOOD_BY_CLASS.get((cls, f.name), GOOD[f.name]) for f in attrs.fields(cls)}


def bad_cases() -> list[Any]:
    cases = []
    for cls in EVENTS + COMMANDS:
        hints = typing.get_type_hints(cls, include_extras=True)
        for field in attrs.fields(cls):
            values, expected = BAD[hints[field.name]]
            for value in values:
                cases.append(
                    pytest.param(
                        cls, field.name, value, expected, id=f"{cls.__name__}.{field.name}"
                    )
                )
    return cases


@pytest.mark.parametrize("cls", EVENTS + COMMANDS, ids=lambda k: k.__name__)
def test_good_values_are_accepted_and_kept(cls: type) -> None:
    fields = good_fields(cls)
    record = cls(**fields)
    for name, value in fields.items():
        assert getattr(record, name) == value, name


@pytest.mark.parametrize(("cls", "name", "value", "expected"), bad_cases())
def test_every_field_refuses_a_value_that_does_not_fit(
    cls: type, name: str, value: Any, expected: str
) -> None:
    fields = good_fields(cls)
    fields[name] = value
    # Commands are checked by the same hook and raise the same error.
    with pytest.raises(InvalidEvent) as raised:
        cls(**fields)
    assert str(raised.value) == f"{cls.__name__}.{name} must be {expected}, got {value!r}"


@pytest.mark.parametrize(
    ("value", "kept"),
    [
        (0, 0),  # an int is a number of seconds
        (2**62, 2**62),
        (0.0, 0.0),
        (1e12, 1e12),
    ],
)
def test_times_take_ints_and_floats(value: float, kept: float) -> None:
    assert e.Tick(t=value).t == kept


def test_int_subclasses_are_integers_but_bools_are_not() -> None:
    exited = e.WorkerExited(t=0, worker_id="envs-0", signal=signal.SIGKILL)
    assert exited.signal == 9
    assert codec.decode(codec.encode(exited)) == exited
    with pytest.raises(InvalidEvent, match=r"WorkerExited\.exit_code must be null or an integer"):
        e.WorkerExited(t=0, worker_id="envs-0", exit_code=False)


def test_optional_fields_take_none() -> None:
    assert e.AutoscalingPaused(t=0).pool is None
    assert e.PoolPinned(t=0, pool="envs", count=None).count is None
    exited = e.WorkerExited(t=0, worker_id="envs-0", exit_code=None, signal=15)
    assert (exited.exit_code, exited.signal) == (None, 15)
    assert c.KillWorker(worker_id="envs-0", pid=None, reason="x").pid is None


def test_lists_become_tuples_and_sets() -> None:
    sample = e.GpuSampled(
        t=0,
        gpu_id="0",
        memory_used_bytes=0,
        memory_total_bytes=0,
        temperature_c=30,
        throttle_reasons=["power", "thermal", "power"],
    )
    assert sample.throttle_reasons == frozenset({"power", "thermal"})
    spawn = c.SpawnWorker(
        worker_id="envs-0", pool="envs", argv=["a", "b"], gpus=[], env={}, reason="x"
    )
    assert (spawn.argv, spawn.gpus) == (("a", "b"), ())


def test_checks_across_fields_follow_the_field_checks() -> None:
    with pytest.raises(InvalidEvent, match=r"memory_used_bytes \(3\) exceeds memory_total_bytes"):
        e.GpuSampled(t=0, gpu_id="0", memory_used_bytes=3, memory_total_bytes=2, temperature_c=1)
    with pytest.raises(InvalidEvent, match=r"QueueSampled\.batch_size_seqs must be >= 1, got 0"):
        e.QueueSampled(t=0, pool="envs", queued_sequences=0, batch_size_seqs=0, trainer_step=0)
    # A field's own check comes first: a string count is named as such, not compared.
    with pytest.raises(InvalidEvent, match=r"GpuSampled\.memory_used_bytes must be an integer"):
        e.GpuSampled(t=0, gpu_id="0", memory_used_bytes="3", memory_total_bytes=2, temperature_c=1)


def test_a_malformed_event_never_reaches_the_reducer() -> None:
    reducer = Reducer()
    before = reducer.state
    with pytest.raises(InvalidEvent, match=r"WorkerReady\.worker_id must be a non-empty string"):
        reducer.step(e.WorkerReady(t=0, worker_id=5))  # type: ignore[arg-type]
    assert reducer.state is before


def test_decoding_checks_the_fields_like_construction() -> None:
    message = "WorkerReady.worker_id must be a non-empty string, got 5"
    with pytest.raises(InvalidEvent, match=re.escape(message)):
        codec.decode({"@": "WorkerReady", "t": 2.0, "worker_id": 5})
    scale = {"@": "ScalePool", "pool": "p", "previous": 1, "target": -1, "source": "x"}
    with pytest.raises(InvalidEvent, match=r"ScalePool\.target must be an integer"):
        codec.decode({**scale, "reason": "r"})


@pytest.mark.parametrize("cls", [e.Event, c.Command, *EVENTS, *COMMANDS], ids=lambda k: k.__name__)
def test_each_class_holds_its_own_checker(cls: type) -> None:
    assert "_check_fields" in vars(cls), "the checker is made with the class, not inherited"
    fields = good_fields(cls)
    cls(**fields)
    # the checker covers the class's own fields, not only the base's
    last = attrs.fields(cls)[-1].name
    fields[last] = object()
    with pytest.raises(InvalidEvent, match=rf"{cls.__name__}\.{last} must be"):
        cls(**fields)


def test_a_field_with_no_known_check_is_refused_when_the_class_is_made() -> None:
    with pytest.raises(TypeError, match=r"Odd\.sizes: no check for list\[int\]"):

        @attrs.frozen(slots=True, kw_only=True)
        class Odd(e.Event):
            sizes: list[int]
