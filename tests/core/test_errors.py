"""core.errors: one family across deo; each refusal's class and HTTP status from the reducer."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from collections.abc import Callable

import pytest

import adapters
import bench
import core
from core import (
    Config,
    ConfigError,
    Configured,
    DeoError,
    DrainRequested,
    Event,
    GpuCordonRequested,
    GpuUncordonRequested,
    IllegalTransition,
    InvalidEvent,
    InvariantViolation,
    LoadSampled,
    PolicySpec,
    PoolPinned,
    PoolSpec,
    Reducer,
    Refused,
    SpawnFailed,
    UnknownSubject,
    WorkerAdopted,
    WorkerHeartbeat,
    WorkerReady,
    WorkerStarted,
)


def _modules() -> list[str]:
    names: list[str] = []
    for package in (core, adapters, bench):
        names.append(package.__name__)
        for info in pkgutil.walk_packages(package.__path__, prefix=package.__name__ + "."):
            names.append(info.name)
    return names


def test_every_error_class_deo_defines_is_a_deo_error() -> None:
    defined: list[type[BaseException]] = []
    for name in _modules():
        module = importlib.import_module(name)
        for _, obj in inspect.getmembers(module, inspect.isclass):
            if obj.__module__ == name and issubclass(obj, BaseException):
                defined.append(obj)
    assert len(defined) >= 10, defined  # the walk found the adapters' errors too
    strays = [
        f"{cls.__module__}.{cls.__qualname__}" for cls in defined if not issubclass(cls, DeoError)
    ]
    assert strays == []


@pytest.mark.parametrize(
    ("cls", "status"),
    [
        (DeoError, 500),
        (InvariantViolation, 500),
        (InvalidEvent, 422),
        (ConfigError, 422),
        (UnknownSubject, 404),
        (Refused, 409),
        (IllegalTransition, 409),
    ],
)
def test_each_class_carries_its_http_status(cls: type[DeoError], status: int) -> None:
    assert cls.http_status == status
    assert cls("why").http_status == status


def test_refusals_are_invalid_events_so_every_catcher_of_those_still_catches_them() -> None:
    for cls in (UnknownSubject, Refused, IllegalTransition, ConfigError):
        assert issubclass(cls, InvalidEvent)
    assert issubclass(IllegalTransition, Refused)
    assert not issubclass(UnknownSubject, Refused)


# --- what the reducer raises ---------------------------------------------------------------------


def configured() -> Reducer:
    """One pool of two workers on GPUs 0 and 1 (not started), GPU 2 free."""
    reducer = Reducer()
    spec = PoolSpec(
        name="envs",
        argv=["w"],
        max_workers=4,
        gpus_per_worker=1,
        policy=PolicySpec(name="static", params={"count": 2}),
    )
    reducer.step(Configured(t=0.0, config=Config(pools=[spec], gpus=["0", "1", "2"])))
    return reducer


def started() -> Reducer:
    """As :func:`configured`, with envs-0 started as pid 100."""
    reducer = configured()
    reducer.step(WorkerStarted(t=1.0, worker_id="envs-0", pid=100, start_time=1))
    return reducer


CASES: list[tuple[str, Callable[[], Reducer], Event, type[DeoError], str]] = [
    # unknown subjects
    ("pin", configured, PoolPinned(t=2, pool="nope", count=1), UnknownSubject, "pool 'nope'"),
    ("load", configured, LoadSampled(t=2, pool="x", in_flight_requests=1), UnknownSubject, "'x'"),
    ("drain", configured, DrainRequested(t=2, worker_id="ghost"), UnknownSubject, "'ghost'"),
    ("beat", configured, WorkerHeartbeat(t=2, worker_id="envs-9"), UnknownSubject, "'envs-9'"),
    ("cordon", configured, GpuCordonRequested(t=2, gpu_id="7"), UnknownSubject, "GPU '7'"),
    ("uncordon", configured, GpuUncordonRequested(t=2, gpu_id="7"), UnknownSubject, "GPU '7'"),
    # known subjects refusing
    ("pin bounds", configured, PoolPinned(t=2, pool="envs", count=9), Refused, "outside pool"),
    (
        "started twice",
        started,
        WorkerStarted(t=2, worker_id="envs-0", pid=101, start_time=2),
        Refused,
        "already started as pid 100",
    ),
    (
        "spawn failed while running",
        started,
        SpawnFailed(t=2, worker_id="envs-0", error="x"),
        Refused,
        "running as pid 100",
    ),
    ("adopt unstarted", configured, WorkerAdopted(t=2, worker_id="envs-1"), Refused, "never"),
    ("ready early", configured, WorkerReady(t=2, worker_id="envs-1"), IllegalTransition, "ready"),
]


@pytest.mark.parametrize(
    ("make", "event", "cls", "message"),
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_the_reducer_refuses_with_the_class_that_says_why_and_changes_nothing(
    make: Callable[[], Reducer], event: Event, cls: type[DeoError], message: str
) -> None:
    reducer = make()
    before = reducer.state
    with pytest.raises(cls, match=message) as caught:
        reducer.step(event)
    assert type(caught.value) is cls  # not just a subclass: the class is the answer
    assert reducer.state is before


def test_a_configuration_refused_for_the_state_names_the_holder() -> None:
    reducer = configured()
    before = reducer.state
    with pytest.raises(ConfigError, match="GPU '0' is held by worker envs-0"):
        reducer.step(Configured(t=2.0, config=Config(gpus=["1", "2"])))
    assert reducer.state is before
