"""core.vocabulary: the log's words as enums, decoding exactly as the strings deo always wrote."""

from __future__ import annotations

import orjson
import pytest

from core import Gpu, InvalidEvent, RaiseAlert, ScalePool, State, Worker, codec
from core.lifecycle import WorkerState
from core.vocabulary import (
    PLANNED_STOPS,
    STICKY_CAUSES,
    AlertName,
    CordonCause,
    DecisionSource,
    StopCause,
)


def through_the_log(value: object) -> object:
    return codec.decode(orjson.loads(orjson.dumps(codec.encode(value))))


@pytest.mark.parametrize(
    ("record", "field", "member"),
    [
        # Lines as deo wrote them before the enums: same JSON, now decoded to members.
        (
            {"@": "RaiseAlert", "reason": "r", "alert": "crash_loop", "subject": "envs"},
            "alert",
            AlertName.CRASH_LOOP,
        ),
        (
            {"@": "ResolveAlert", "reason": "r", "alert": "below_min", "subject": "envs"},
            "alert",
            AlertName.BELOW_MIN,
        ),
        (
            {"@": "ScalePool", "reason": "r", "pool": "envs", "previous": 1, "target": 2,
             "source": "operator"},
            "source",
            DecisionSource.OPERATOR,
        ),
    ],
)  # fmt: skip
def test_old_records_decode_to_members(record: dict[str, object], field: str, member: str) -> None:
    decoded = codec.decode(record)
    assert getattr(decoded, field) is member
    assert codec.encode(decoded) == record  # and encode back to the very same JSON


def test_a_member_is_its_string() -> None:
    assert AlertName.UNKILLABLE_WORKER == "unkillable_worker"
    assert f"{StopCause.SCALE_DOWN}" == "scale_down"
    assert orjson.dumps({"a": AlertName.GPU_LOST}) == b'{"a":"gpu_lost"}'
    assert hash(CordonCause.THERMAL) == hash("thermal")


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: RaiseAlert(reason="r", alert="crashloop", subject="envs"),
         "RaiseAlert.alert must be one of crash_loop, .*, got 'crashloop'"),
        (lambda: ScalePool(reason="r", pool="p", previous=0, target=1, source="autoscaler"),
         "ScalePool.source must be one of policy, .*, got 'autoscaler'"),
        (lambda: Worker(worker_id="p-0", pool="p", index=0, state="active", gpus=(),
                        requested_t=0.0, stop_cause="tired"), "stop cause 'tired'"),
        (lambda: Worker(worker_id="p-0", pool="p", index=0, state="resting", gpus=(),
                        requested_t=0.0), "worker state 'resting'"),
        (lambda: Gpu(gpu_id="0", causes=[""]), "not a set of causes"),
    ],
)  # fmt: skip
def test_an_unknown_word_is_refused_naming_it_and_the_known_ones(
    build: object, message: str
) -> None:
    with pytest.raises(InvalidEvent, match=message) as info:
        build()  # type: ignore[operator]
    assert any(hint in str(info.value) for hint in ("known:", "one of", "not a set of causes"))


def test_cordon_causes_keep_throttle_reasons_deo_does_not_know() -> None:
    gpu = Gpu(gpu_id="0", causes=["thermal", "errors", "board_limit"])
    assert gpu.causes == {"thermal", "errors", "board_limit"}
    known = {cause for cause in gpu.causes if isinstance(cause, CordonCause)}
    assert known == {CordonCause.THERMAL, CordonCause.ERRORS}
    assert through_the_log(gpu) == gpu
    # Only deo's own sticky causes survive the clean-sample expiry.
    assert gpu.causes & STICKY_CAUSES == {CordonCause.ERRORS}


def test_planned_stops_are_deos_own_decisions() -> None:
    assert {StopCause.START_TIMEOUT, StopCause.HUNG, StopCause.DRAIN_DEADLINE}.isdisjoint(
        PLANNED_STOPS
    )
    assert set(StopCause) > PLANNED_STOPS


def test_state_alerts_decode_to_members() -> None:
    state = codec.decode({"@": "State", "alerts": [["no_free_gpus", "envs"]]})
    assert isinstance(state, State)
    [(alert, subject)] = state.alerts
    assert alert is AlertName.NO_FREE_GPUS and subject == "envs"


def old_worker(state: str, killed: bool) -> dict[str, object]:
    """A worker as snapshots stored it before KILLED was a state."""
    return {
        "@": "Worker",
        "worker_id": "envs-0",
        "pool": "envs",
        "index": 0,
        "state": state,
        "gpus": ["0"],
        "requested_t": 0.0,
        "started_t": 1.0,
        "pid": 100,
        "start_time": 1,
        "deadline_t": 33.0 if state == "stopping" else None,
        "killed": killed,
        "stop_cause": "operator" if state == "stopping" else None,
    }


@pytest.mark.parametrize(
    ("state", "killed", "now"),
    [
        ("stopping", True, WorkerState.KILLED),  # SIGKILL already sent
        ("stopping", False, WorkerState.STOPPING),  # SIGTERM only
        ("active", False, WorkerState.ACTIVE),
    ],
)
def test_an_old_snapshot_worker_loads_in_the_state_it_is_now(
    state: str, killed: bool, now: WorkerState
) -> None:
    worker = codec.decode(old_worker(state, killed))
    assert isinstance(worker, Worker)
    assert worker.state is now
    assert not hasattr(worker, "killed")
    assert "killed" not in codec.encode(worker)  # written back without the old flag
