"""adapters/log.py: the append-only JSONL event log, its recovery and its snapshots."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import random
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import hypothesis.strategies as st
import orjson
import pytest
from conftest import write_simulated_log
from hypothesis import HealthCheck, given, settings

from adapters.log import (
    SCHEMA_VERSION,
    EventLog,
    LogDamaged,
    LogProblem,
    LogReader,
    NotALog,
    segment_start,
    segments,
    snapshot_path,
)
from adapters.postmortem import replay as replay_command
from adapters.postmortem.engine import apply_settings, parse_setting, replay, state_difference
from adapters.run import run_id_of
from core import (
    Config,
    Configured,
    DeoError,
    Event,
    InvalidEvent,
    PolicySpec,
    PoolSpec,
    QueueSampled,
    Reducer,
    SpawnWorker,
    State,
    Tick,
    WorkerHeartbeat,
    WorkerStarted,
    decode,
    encode,
    reduce,
)
from core.arbiter import ArbiterGpusDeclared

# --- helpers ---------------------------------------------------------------------------------


def static_pool(count: int = 2) -> PoolSpec:
    return PoolSpec(
        name="envs",
        argv=["python", "env.py"],
        min_workers=1,
        max_workers=4,
        policy=PolicySpec(name="static", params={"count": count}),
    )


def configured(t: float = 0.0, count: int = 2) -> Configured:
    return Configured(t=t, config=Config(pools=[static_pool(count)]))


def records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_bytes().splitlines()]


def events_of(path: Path) -> list[Event]:
    """The input events a log recorded, in order."""
    reader = LogReader(path)
    out = [record.event for record in reader.events()]
    assert reader.problems == []
    return out


def replays_cleanly(path: Path) -> int:
    """Assert ``path`` replays with no problem and no divergence; returns its event count."""
    problems: list[LogProblem] = []
    steps = list(replay(path, problems=problems))
    assert problems == []
    assert steps, "no events replayed"
    assert all(step.matches for step in steps)
    return len(steps)


def write_log(path: Path, events: list[Event], **options: Any) -> Reducer:
    """Record ``events`` into a new log at ``path`` (flushing after each); returns the reducer."""
    log, recovery = EventLog.open(path, **options)
    assert recovery.replayed == 0
    reducer = Reducer()
    for event in events:
        log.record(reducer, event)
        log.flush()
        log.maybe_snapshot(reducer.state)
    log.close()
    return reducer


@pytest.fixture(scope="module")
def demo_master(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("demo") / "demo.jsonl"
    write_simulated_log(path)
    return path


@pytest.fixture
def demo_log(demo_master: Path, tmp_path: Path) -> Path:
    """A fresh copy of a real demo log (about 1000 lines) in this test's directory."""
    path = tmp_path / "demo.jsonl"
    shutil.copyfile(demo_master, path)
    return path


@pytest.fixture(scope="module")
def demo_events(demo_master: Path) -> list[Event]:
    return events_of(demo_master)


def reference_state(path: Path) -> State:
    """The state after re-reducing every event of ``path`` from scratch."""
    reducer = Reducer()
    for event in events_of(path):
        with contextlib.suppress(DeoError):
            reducer.step(event)
    return reducer.state


# --- writing ---------------------------------------------------------------------------------


def test_new_log_starts_with_header(tmp_path: Path) -> None:
    path = tmp_path / "new.jsonl"
    log, recovery = EventLog.open(path)
    log.close()
    lines = path.read_bytes().splitlines()
    assert len(lines) == 1
    header = json.loads(lines[0])
    assert header["kind"] == "header"
    assert header["schema"] == SCHEMA_VERSION == 1
    assert header["deo"]
    assert header["created"]
    assert recovery.replayed == 0
    assert recovery.problems == ()
    assert recovery.state == State()
    assert log.seq == 0


def test_records_have_increasing_seq_and_commands_follow_their_event(tmp_path: Path) -> None:
    path = tmp_path / "log.jsonl"
    with EventLog.open(path)[0] as log:
        reducer = Reducer()
        first = log.record(reducer, configured())
        assert [type(c).__name__ for c in first] == ["ScalePool", "SpawnWorker", "SpawnWorker"]
        log.record(reducer, Tick(t=1.0))
        log.record(reducer, WorkerStarted(t=2.0, worker_id="envs-0", pid=100, start_time=5))
    recs = records(path)
    assert recs[0]["kind"] == "header"
    body = recs[1:]
    seqs = [r["seq"] for r in body]
    assert seqs == list(range(1, len(body) + 1))
    assert log.seq == seqs[-1]

    # Configured -> one commands record with cause = its seq, right after it.
    assert body[0]["kind"] == "event"
    assert body[0]["event"]["@"] == "Configured"
    assert body[1]["kind"] == "commands"
    assert body[1]["cause"] == body[0]["seq"]
    assert [c["@"] for c in body[1]["commands"]] == ["ScalePool", "SpawnWorker", "SpawnWorker"]
    # Tick and WorkerStarted produce no commands here: no commands record at all.
    assert [r["kind"] for r in body[2:]] == ["event", "event"]
    assert [r["event"]["@"] for r in body[2:]] == ["Tick", "WorkerStarted"]


def test_every_commands_record_follows_its_event_in_a_real_log(demo_log: Path) -> None:
    recs = records(demo_log)[1:]
    assert [r["seq"] for r in recs] == list(range(1, len(recs) + 1))
    previous: dict[str, Any] | None = None
    for record in recs:
        if record["kind"] == "commands":
            assert previous is not None and previous["kind"] == "event"
            assert record["cause"] == previous["seq"]
            assert record["commands"], "an empty commands record was written"
        previous = record


def test_rejected_event_is_recorded_and_reraised(tmp_path: Path) -> None:
    path = tmp_path / "log.jsonl"
    log, _ = EventLog.open(path)
    reducer = Reducer()
    log.record(reducer, configured())
    before = reducer.state
    bad = QueueSampled(t=1.0, pool="nope", queued_sequences=1, batch_size_seqs=2, trainer_step=0)
    with pytest.raises(InvalidEvent, match="unknown pool 'nope'"):
        log.record(reducer, bad)
    assert reducer.state is before
    # the log goes on after a refusal
    log.record(reducer, Tick(t=2.0))
    log.close()
    recs = records(path)[1:]
    event, rejected, tick = recs[-3:]
    assert event["kind"] == "event" and event["event"]["pool"] == "nope"
    assert rejected["kind"] == "rejected"
    assert rejected["cause"] == event["seq"]
    assert "unknown pool 'nope'" in rejected["error"]
    assert tick["event"]["@"] == "Tick"
    assert tick["seq"] == rejected["seq"] + 1
    assert not any(r["kind"] == "commands" and r["cause"] == event["seq"] for r in recs)
    # The recorded refusal is reproduced by a replay.
    assert replays_cleanly(path) == 3


@pytest.mark.parametrize("fsync", [True, False])
def test_flush_writes_buffered_records(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fsync: bool
) -> None:
    path = tmp_path / "log.jsonl"
    log, _ = EventLog.open(path, fsync=fsync)
    header_size = path.stat().st_size
    calls: list[int] = []
    real_fsync = os.fsync

    def counting_fsync(fd: int) -> None:
        calls.append(fd)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", counting_fsync)
    reducer = Reducer()
    log.record(reducer, configured())
    log.record(reducer, Tick(t=1.0))
    assert path.stat().st_size == header_size, "records reached the file before flush()"
    log.flush()
    assert path.stat().st_size > header_size
    assert [r["kind"] for r in records(path)] == ["header", "event", "commands", "event"]
    assert len(calls) == (1 if fsync else 0)
    # nothing buffered: flush writes nothing more
    size = path.stat().st_size
    log.flush()
    assert path.stat().st_size == size
    log.close()


# --- recovery --------------------------------------------------------------------------------


def test_reopen_rebuilds_the_state_of_the_writer(tmp_path: Path) -> None:
    path = tmp_path / "log.jsonl"
    events: list[Event] = [
        configured(),
        WorkerStarted(t=1.0, worker_id="envs-0", pid=100, start_time=5),
        Tick(t=2.0),
        configured(t=3.0, count=3),
    ]
    reducer = write_log(path, events)
    log, recovery = EventLog.open(path)
    log.close()
    assert recovery.problems == ()
    assert recovery.set_aside is None
    assert recovery.replayed == len(events)
    assert recovery.state == reducer.state
    assert len(recovery.state.workers) == 3
    assert log.seq == records(path)[-1]["seq"]


def test_reopen_of_a_real_log_rebuilds_its_state(demo_log: Path) -> None:
    log, recovery = EventLog.open(demo_log)
    log.close()
    assert recovery.problems == ()
    assert recovery.replayed == len(events_of(demo_log))
    assert recovery.state == reference_state(demo_log)
    assert recovery.state.workers, "the demo ends with live workers"


def test_reopen_continues_the_sequence(demo_log: Path) -> None:
    last_seq = records(demo_log)[-1]["seq"]
    log, recovery = EventLog.open(demo_log)
    reducer = Reducer(recovery.state)
    log.record(reducer, Tick(t=recovery.state.now + 1))
    log.close()
    assert records(demo_log)[-1]["seq"] == last_seq + 1
    replays_cleanly(demo_log)


def test_torn_last_line_is_set_aside_and_cut(demo_log: Path) -> None:
    intact = demo_log.read_bytes()
    line_count = len(intact.splitlines())
    torn = b'{"kind":"event","event":{"@":"Tick","t":9'
    with demo_log.open("ab") as f:
        f.write(torn)

    log, recovery = EventLog.open(demo_log)
    torn_line = line_count + 1
    assert len(recovery.problems) == 1
    problem = recovery.problems[0]
    assert problem.line == torn_line
    assert "torn" in problem.message
    assert f"line {torn_line}" in str(problem)
    aside = demo_log.with_name(f"{demo_log.name}.torn-{torn_line}")
    assert recovery.set_aside == aside
    assert aside.read_bytes() == torn
    assert demo_log.read_bytes() == intact
    assert recovery.state == reference_state(demo_log)

    # Appending after the recovery gives a log that replays cleanly.
    reducer = Reducer(recovery.state)
    log.record(reducer, Tick(t=recovery.state.now + 1.0))
    log.record(reducer, Tick(t=recovery.state.now + 2.0))
    log.close()
    assert demo_log.read_bytes().startswith(intact)
    assert replays_cleanly(demo_log) == len(events_of(demo_log))
    log, again = EventLog.open(demo_log)
    log.close()
    assert again.problems == ()
    assert again.state == reducer.state


def test_torn_line_in_a_small_log(tmp_path: Path) -> None:
    path = tmp_path / "log.jsonl"
    reducer = write_log(path, [configured(), Tick(t=1.0)])
    intact = path.read_bytes()
    with path.open("ab") as f:
        f.write(b'{"seq": 5, "ki')
    log, recovery = EventLog.open(path)
    assert [p.line for p in recovery.problems] == [5]
    assert (tmp_path / "log.jsonl.torn-5").read_bytes() == b'{"seq": 5, "ki'
    assert path.read_bytes() == intact
    assert recovery.state == reducer.state
    log.record(Reducer(recovery.state), Tick(t=2.0))
    log.close()
    recs = records(path)
    assert [r.get("seq") for r in recs] == [None, 1, 2, 3, 4]
    assert replays_cleanly(path) == 3


def test_corrupt_last_line_with_newline_is_set_aside(demo_log: Path) -> None:
    intact = demo_log.read_bytes()
    line_count = len(intact.splitlines())
    garbage = b'{"kind": "event", oops}\n'
    with demo_log.open("ab") as f:
        f.write(garbage)
    log, recovery = EventLog.open(demo_log)
    log.close()
    assert [p.line for p in recovery.problems] == [line_count + 1]
    assert "malformed JSON" in recovery.problems[0].message
    assert recovery.set_aside == demo_log.with_name(f"{demo_log.name}.torn-{line_count + 1}")
    assert recovery.set_aside.read_bytes() == garbage
    assert demo_log.read_bytes() == intact
    replays_cleanly(demo_log)


def test_corrupt_line_in_the_middle_is_reported_and_kept(demo_log: Path) -> None:
    lines = demo_log.read_bytes().splitlines(keepends=True)
    # Replace a Tick that produced nothing (the next line is another event) with garbage.
    index = next(
        i
        for i in range(len(lines) // 2, len(lines) - 1)
        if json.loads(lines[i])["kind"] == "event"
        and json.loads(lines[i])["event"]["@"] == "Tick"
        and json.loads(lines[i + 1])["kind"] == "event"
    )
    lines[index] = b"{not json at all\n"
    damaged = b"".join(lines)
    demo_log.write_bytes(damaged)
    total_events = sum(1 for line in lines if b'"kind":"event"' in line)

    log, recovery = EventLog.open(demo_log)
    log.close()
    assert [p.line for p in recovery.problems] == [index + 1]
    assert "malformed JSON" in recovery.problems[0].message
    assert recovery.set_aside is None
    assert demo_log.read_bytes() == damaged, "a line in the middle was removed"
    assert not list(demo_log.parent.glob("*.torn-*"))
    assert recovery.replayed == total_events
    expected = Reducer()
    for event in events_of_lines(lines):
        expected.step(event)
    assert recovery.state == expected.state


def events_of_lines(lines: list[bytes]) -> list[Event]:
    out = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("kind") == "event":
            out.append(decode(record["event"]))
    return out


def test_unsupported_schema_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "log.jsonl"
    write_log(path, [configured()])
    lines = path.read_bytes().splitlines(keepends=True)
    lines[0] = lines[0].replace(b'"schema":1', b'"schema":99')
    path.write_bytes(b"".join(lines))
    with pytest.raises(DeoError, match="schema version 99"):
        EventLog.open(path)


# --- snapshots -------------------------------------------------------------------------------


def test_maybe_snapshot_waits_for_snapshot_every_records(tmp_path: Path) -> None:
    path = tmp_path / "log.jsonl"
    log, _ = EventLog.open(path, snapshot_every=4)
    reducer = Reducer()
    log.record(reducer, configured())  # 2 records
    log.flush()
    assert log.maybe_snapshot(reducer.state) is False
    assert not snapshot_path(path).exists()
    log.record(reducer, Tick(t=1.0))
    log.record(reducer, Tick(t=2.0))  # 4 records, but only 2 written so far
    assert log.maybe_snapshot(reducer.state) is False
    log.flush()
    assert log.maybe_snapshot(reducer.state) is True
    target = snapshot_path(path)
    assert target == tmp_path / "log.jsonl.snapshot"
    payload = json.loads(target.read_bytes())
    assert payload["schema"] == SCHEMA_VERSION
    assert payload["seq"] == 4 == log.seq
    assert payload["offset"] == path.stat().st_size
    assert payload["lines"] == 5
    assert decode(payload["state"]) == reducer.state
    assert not list(tmp_path.glob("*.tmp"))
    # the counter restarts after a snapshot
    log.record(reducer, Tick(t=3.0))
    log.flush()
    assert log.maybe_snapshot(reducer.state) is False
    log.close()


def test_snapshot_bounds_the_replay_on_reopen(tmp_path: Path, demo_events: list[Event]) -> None:
    path = tmp_path / "log.jsonl"
    every = 100
    reducer = write_log(path, demo_events, fsync=False, snapshot_every=every)
    assert snapshot_path(path).exists()
    payload = json.loads(snapshot_path(path).read_bytes())
    total_lines = len(path.read_bytes().splitlines())
    after_snapshot = total_lines - payload["lines"]
    assert 0 < after_snapshot < every + 5

    log, recovery = EventLog.open(path)
    log.close()
    assert recovery.problems == ()
    assert recovery.state == reducer.state
    assert 0 < recovery.replayed <= after_snapshot
    assert recovery.replayed < len(demo_events) // 5

    # Without the snapshot every event is re-reduced, to the same state.
    snapshot_path(path).unlink()
    log, full = EventLog.open(path)
    log.close()
    assert full.replayed == len(demo_events)
    assert full.state == reducer.state


def test_snapshot_then_torn_line(tmp_path: Path, demo_events: list[Event]) -> None:
    path = tmp_path / "log.jsonl"
    reducer = write_log(path, demo_events, fsync=False, snapshot_every=100)
    intact = path.read_bytes()
    line_count = len(intact.splitlines())
    with path.open("ab") as f:
        f.write(b'{"kind":"ev')
    log, recovery = EventLog.open(path)
    assert [p.line for p in recovery.problems] == [line_count + 1]
    assert recovery.set_aside == tmp_path / f"log.jsonl.torn-{line_count + 1}"
    assert path.read_bytes() == intact
    assert recovery.state == reducer.state
    log.record(Reducer(recovery.state), Tick(t=recovery.state.now + 1))
    log.close()
    assert replays_cleanly(path) == len(demo_events) + 1


@pytest.mark.parametrize(
    "spoil",
    [
        pytest.param(lambda p: {**p, "offset": p["offset"] * 10 + 1}, id="offset-beyond-end"),
        pytest.param(lambda p: {**p, "schema": 99}, id="other-schema"),
        pytest.param(lambda p: {**p, "state": {"@": "Nope"}}, id="undecodable-state"),
        pytest.param(lambda p: {k: v for k, v in p.items() if k != "lines"}, id="missing-key"),
    ],
)
def test_snapshot_that_does_not_fit_is_ignored(
    tmp_path: Path, demo_events: list[Event], spoil: Any
) -> None:
    path = tmp_path / "log.jsonl"
    reducer = write_log(path, demo_events, fsync=False, snapshot_every=100)
    target = snapshot_path(path)
    target.write_text(json.dumps(spoil(json.loads(target.read_bytes()))))
    log, recovery = EventLog.open(path)
    log.close()
    assert recovery.problems == ()
    assert recovery.replayed == len(demo_events)
    assert recovery.state == reducer.state


@pytest.mark.parametrize("garbage", [b"", b"{not json", b'{"schema": 1, "offset": 1'])
def test_garbage_snapshot_is_ignored(
    tmp_path: Path, demo_events: list[Event], garbage: bytes
) -> None:
    path = tmp_path / "log.jsonl"
    reducer = write_log(path, demo_events, fsync=False, snapshot_every=100)
    snapshot_path(path).write_bytes(garbage)
    log, recovery = EventLog.open(path)
    log.close()
    assert recovery.problems == ()
    assert recovery.replayed == len(demo_events)
    assert recovery.state == reducer.state


@pytest.mark.parametrize("garbage", [b"[1, 2]", b"null", b"42"])
def test_non_object_snapshot_is_ignored(
    tmp_path: Path, demo_events: list[Event], garbage: bytes
) -> None:
    path = tmp_path / "log.jsonl"
    reducer = write_log(path, demo_events[:50], fsync=False, snapshot_every=10)
    snapshot_path(path).write_bytes(garbage)
    log, recovery = EventLog.open(path)
    log.close()
    assert recovery.replayed == 50
    assert recovery.state == reducer.state


def test_stale_snapshot_of_an_earlier_log_is_not_applied(tmp_path: Path) -> None:
    path = tmp_path / "log.jsonl"
    write_log(path, [Tick(t=float(i)) for i in range(1, 10)], snapshot_every=5)  # no worker
    assert snapshot_path(path).exists()
    path.unlink()  # start over at the same path; the snapshot beside it is left behind
    reducer = write_log(path, [Tick(t=float(i)) for i in range(40)])
    log, recovery = EventLog.open(path)
    log.close()
    assert recovery.problems == ()
    assert recovery.state == reducer.state
    assert recovery.state.pools == {}


def test_a_new_log_beside_a_snapshot_of_workers_that_still_run_is_refused(
    tmp_path: Path,
) -> None:
    path = tmp_path / "log.jsonl"
    started = [
        WorkerStarted(t=1.0, worker_id=f"envs-{i}", pid=100 + i, start_time=5) for i in (0, 1)
    ]
    ticks = [Tick(t=float(i)) for i in range(2, 12)]
    write_log(path, [configured(), *started, *ticks], snapshot_every=5)
    snapshot = snapshot_path(path).read_bytes()
    path.unlink()  # lost while its workers run
    running = {(101, 5)}
    with pytest.raises(LogDamaged, match=r"names 1 worker\(s\) of an earlier log at this path "):
        EventLog.open(path, alive=lambda pid, start_time: (pid, start_time) in running)
    assert snapshot_path(path).read_bytes() == snapshot
    # Once they have all exited, the snapshot is a leftover: a new log starts.
    running.clear()
    log, recovery = EventLog.open(path, alive=lambda pid, start_time: False)
    log.close()
    assert recovery.state.workers == {} and not snapshot_path(path).exists()


def test_torn_header_recovers_to_a_readable_log(tmp_path: Path) -> None:
    path = tmp_path / "log.jsonl"
    path.write_bytes(b'{"kind":"hea')
    log, recovery = EventLog.open(path)
    assert [p.line for p in recovery.problems] == [1]
    assert (tmp_path / "log.jsonl.torn-1").read_bytes() == b'{"kind":"hea'
    reducer = Reducer()
    log.record(reducer, configured())
    log.close()
    assert records(path)[0]["kind"] == "header"
    log, again = EventLog.open(path)
    log.close()
    assert again.state == reducer.state


def test_line_numbers_stay_right_across_recovery_and_snapshot(
    tmp_path: Path, demo_events: list[Event]
) -> None:
    path = tmp_path / "log.jsonl"
    write_log(path, demo_events[:200], fsync=False, snapshot_every=50)
    with path.open("ab") as f:
        f.write(b'{"kind":"ev')
    log, recovery = EventLog.open(path, fsync=False, snapshot_every=50)
    assert len(recovery.problems) == 1
    reducer = Reducer(recovery.state)
    for event in demo_events[200:400]:
        log.record(reducer, event)
        log.flush()
        log.maybe_snapshot(reducer.state)
    log.snapshot(reducer.state)
    log.close()
    line_count = len(path.read_bytes().splitlines())
    assert json.loads(snapshot_path(path).read_bytes())["lines"] == line_count
    # a second crash after the new snapshot: the torn line is numbered from the start of the file
    with path.open("ab") as f:
        f.write(b'{"kind":"co')
    log, recovery = EventLog.open(path)
    log.close()
    assert [p.line for p in recovery.problems] == [line_count + 1]
    assert recovery.set_aside == tmp_path / f"log.jsonl.torn-{line_count + 1}"
    assert recovery.state == reducer.state
    assert replays_cleanly(path) == 400


def test_one_writer_per_log(tmp_path: Path) -> None:
    from adapters.log import LogInUse

    path = tmp_path / "one.jsonl"
    log, _ = EventLog.open(path)
    with pytest.raises(LogInUse, match="in use by another deo"):
        EventLog.open(path)
    log.close()
    again, _ = EventLog.open(path)  # free once the first writer is gone
    again.close()


def test_records_that_cannot_be_replayed_are_reported_not_dropped(tmp_path: Path) -> None:
    path = tmp_path / "odd.jsonl"
    log, _ = EventLog.open(path)
    log.close()
    with path.open("ab") as f:
        f.write(b'{"kind":"event","seq":"x","event":{"@":"Tick","t":1.0}}\n')
        f.write(b'{"kind":"event","seq":2,"event":{"@":"NoSuchEvent","t":1.0}}\n')
        f.write(b'{"kind":"event","seq":3,"event":{"@":"Tick","t":2.0}}\n')
    log, recovery = EventLog.open(path)
    log.close()
    assert [(p.line, "seq" in p.message) for p in recovery.problems] == [(2, True), (3, False)]
    assert "NoSuchEvent" in recovery.problems[1].message
    assert recovery.state.now == 2.0


@pytest.mark.parametrize(
    "line",
    [
        b'{"@":"WorkerReady","t":2.0,"worker_id":5}\n',
        b'{"seq":99999,"kind":"event","event":{"@":"WorkerReady","t":2.0,"worker_id":5}}\n',
        b'{"seq":99999,"kind":"event","event":{"@":"WorkerReady","t":2.0,"worker_id":"ghost"}}\n',
    ],
    ids=["bare-event", "wrong-type", "unknown-worker"],
)
def test_a_line_that_cannot_be_decoded_or_reduced_is_reported_by_run_and_replay(
    demo_log: Path, line: bytes
) -> None:
    intact = reference_state(demo_log)
    with demo_log.open("ab") as f:
        f.write(line)
    number = len(demo_log.read_bytes().splitlines())
    problems: list[LogProblem] = []
    steps = list(replay(demo_log, problems=problems))
    assert [p.line for p in problems] == [number]
    assert steps[-1].after == intact and all(step.matches for step in steps)
    log, recovery = EventLog.open(demo_log)
    log.close()
    assert [p.line for p in recovery.problems] == [number]
    assert recovery.state == intact
    assert recovery.set_aside is None  # a whole line, not a torn one: it stays where it is


# --- arbitrary lines: recovery and replay report them and never raise ---------------------------

#: Causes no record of the fixture log has: a commands or rejected record naming one is an orphan.
NO_SUCH_CAUSE = st.integers(10**12, 2**62)


JSON_INTEGERS = st.integers(-(2**63), 2**64 - 1)  # what orjson writes


def line_of(record: Any) -> bytes:
    return orjson.dumps(record) + b"\n"


#: Lines that are not a record at all: bytes, JSON of another shape, records of no known kind,
#: records without a usable seq, or whose event or fields do not fit. Seqs do not matter here
#: (any seq, even a fresh one), since none of these is ever read as a record.
unreadable_lines = st.one_of(
    st.binary(max_size=60).map(lambda raw: raw.replace(b"\n", b"") + b"\n"),
    st.one_of(JSON_INTEGERS, st.text(max_size=8), st.lists(JSON_INTEGERS, max_size=3)).map(line_of),
    st.fixed_dictionaries(
        {"kind": st.text(max_size=8).filter(lambda k: k not in ("event", "commands", "rejected"))},
        optional={"seq": st.integers(1, 10**6)},
    ).map(line_of),
    st.fixed_dictionaries(
        {
            "kind": st.sampled_from(["event", "commands", "rejected"]),
            "seq": st.none() | st.text(max_size=3) | st.integers(-(2**63), 0) | st.floats(1, 9),
            "cause": st.integers(1, 10),
            "event": st.just({"@": "Tick", "t": 1.0}),
            "commands": st.just([]),
            "error": st.just("no"),
        }
    ).map(line_of),
    # events whose fields do not fit (each value is wrong for every field type)
    st.tuples(
        st.sampled_from(["Tick", "WorkerReady", "QueueSampled", "GpuSampled", "WorkerExited"]),
        st.sampled_from(["t", "worker_id", "pool", "gpu_id", "queued_sequences", "exit_code"]),
        st.sampled_from([[1], [None], {"k": 1}, [["x"]], -1.5, "", None]),
        st.integers(1, 10**6),
    ).map(lambda a: line_of({"seq": a[3], "kind": "event", "event": bad_event(a[0], a[1], a[2])})),
    st.sampled_from(["NoSuchEvent", "State", "Config", "ScalePool"]).map(
        lambda name: line_of({"seq": 5, "kind": "event", "event": {"@": name, "t": 1.0}})
    ),
    # commands and rejected records that lack their cause or fields
    st.sampled_from(
        [
            {"seq": 7, "kind": "commands", "commands": []},
            {"seq": 7, "kind": "commands", "cause": 3, "commands": {"@": "ScalePool"}},
            {"seq": 7, "kind": "rejected", "cause": "3", "error": "x"},
            {"seq": 7, "kind": "rejected", "cause": 3},
            {"kind": "header", "schema": 1},
        ]
    ).map(line_of),
)

GOOD_FIELDS = {
    "Tick": {"t": 1.0},
    "WorkerReady": {"t": 1.0, "worker_id": "envs-0"},
    "QueueSampled": {
        "t": 1.0,
        "pool": "envs",
        "queued_sequences": 1,
        "batch_size_seqs": 8,
        "trainer_step": 1,
    },
    "GpuSampled": {
        "t": 1.0,
        "gpu_id": "0",
        "memory_used_bytes": 1,
        "memory_total_bytes": 2,
        "temperature_c": 40.0,
    },
    "WorkerExited": {"t": 1.0, "worker_id": "envs-0", "exit_code": 1},
}


def bad_event(name: str, field: str, value: Any) -> dict[str, Any]:
    """The encoded event ``name`` with ``field`` set to a value that fits no field (""/None only
    where it is not optional: a missing field, when ``name`` has no ``field``, is wrong too)."""
    fields = dict(GOOD_FIELDS[name])
    if field not in fields or (value in ("", None, -1.5) and field in ("exit_code",)):
        fields.pop("t")  # a required field missing
    elif value == -1.5 and field in ("worker_id", "pool", "gpu_id"):
        fields[field] = ""
    else:
        fields[field] = value
    return {"@": name, **fields}


#: Refused by the fixture log's state whatever its time: it knows no such worker, pool or GPU.
refused_events = st.tuples(
    st.floats(0, 2000),
    st.sampled_from(
        [
            {"@": "WorkerReady", "worker_id": "ghost-1"},
            {"@": "DrainRequested", "worker_id": "ghost-2"},
            {"@": "WorkerHeartbeat", "worker_id": "ghost-3"},
            {"@": "LoadSampled", "pool": "ghost", "in_flight_requests": 3},
            {"@": "PoolPinned", "pool": "ghost", "count": 1},
            {"@": "GpuCordonRequested", "gpu_id": "ghost"},
        ]
    ),
).map(lambda a: {"t": a[0], **a[1]})


def damage(data: st.DataObject, lines: list[bytes]) -> tuple[list[bytes], set[int], bool]:
    """``lines`` with bad lines put among them and after them: (the lines, the 1-based numbers
    of the bad ones, whether the last line is unreadable and so set aside by recovery)."""
    draw = data.draw
    inserts: list[tuple[int, bytes]] = []
    for _ in range(draw(st.integers(0, 5))):
        inserts.append((draw(st.integers(1, len(lines))), draw(unreadable_lines)))
    for _ in range(draw(st.integers(0, 3))):
        # a record again, later (a repeated seq), or with its seq missing
        original = draw(st.integers(1, len(lines) - 1))
        record = json.loads(lines[original])
        if draw(st.booleans()):
            del record["seq"]
            at = draw(st.integers(1, len(lines)))
        else:
            at = draw(st.integers(original + 1, len(lines)))
        inserts.append((at, line_of(record)))
    out: list[tuple[bytes, bool]] = [(line, False) for line in lines]
    for at, line in sorted(inserts, key=lambda insert: insert[0], reverse=True):
        out.insert(at, (line, True))
    # After the log: events it never reduced, records out of order, orphans.
    seq = max(json.loads(line).get("seq", 0) for line in lines)
    for _ in range(draw(st.integers(0, 5))):
        choice = draw(st.sampled_from(["refused", "stale", "orphan", "unreadable"]))
        if choice == "unreadable":
            out.append((draw(unreadable_lines), True))
            continue
        if choice == "stale":
            number = draw(st.integers(1, seq))
        else:
            seq += 1
            number = seq
        if choice == "orphan":
            kind = draw(st.sampled_from(["commands", "rejected"]))
            record: dict[str, Any] = {"seq": number, "kind": kind, "cause": draw(NO_SUCH_CAUSE)}
            record.update({"commands": []} if kind == "commands" else {"error": "refused"})
        else:
            record = {"seq": number, "kind": "event", "event": draw(refused_events)}
        out.append((line_of(record), True))
    if draw(st.booleans()):
        torn = draw(st.binary(min_size=1, max_size=40)).replace(b"\n", b"") or b"{"
        out.append((torn, True))
    last = out[-1][0]
    unreadable = not last.endswith(b"\n")
    if not unreadable:
        try:
            unreadable = not isinstance(orjson.loads(last), dict)
        except orjson.JSONDecodeError:
            unreadable = True
    bad = {number for number, (_, is_bad) in enumerate(out, start=1) if is_bad}
    return [line for line, _ in out], bad, unreadable


class Intact:
    """The fixture log's lines and the state they rebuild (a short repr, for hypothesis)."""

    def __init__(self, lines: list[bytes], state: State) -> None:
        self.lines = lines
        self.state = state

    def __repr__(self) -> str:
        return f"Intact(<{len(self.lines)} lines>)"


@pytest.fixture(scope="module")
def intact(demo_master: Path) -> Intact:
    return Intact(demo_master.read_bytes().splitlines(keepends=True), reference_state(demo_master))


@settings(
    max_examples=50,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
def test_recovery_and_replay_report_every_bad_line_and_never_raise(
    tmp_path_factory: pytest.TempPathFactory, intact: Intact, data: st.DataObject
) -> None:
    lines, bad, unreadable_last = damage(data, intact.lines)
    path = tmp_path_factory.mktemp("damaged") / "run.jsonl"
    path.write_bytes(b"".join(lines))
    events = sum(b'"kind":"event"' in line for line in intact.lines)

    # replay: every readable event replayed and verified, every bad line named
    problems: list[LogProblem] = []
    steps = list(replay(path, problems=problems))
    assert sorted(p.line for p in problems) == sorted(bad), problems
    assert len(steps) == events
    assert all(step.matches for step in steps)
    assert steps[-1].after == intact.state
    # `deo replay` says the same, and exits 2 when there is a bad line
    out = io.StringIO()
    args = replay_args(path)
    assert replay_command.run(args, out) == (2 if bad else 0)
    for number in bad:
        assert f"{path}: line {number}: " in out.getvalue()

    # recovery: the same lines reported, the readable log's state rebuilt; or, when an
    # unreadable line comes before the configuration, nothing started and the log untouched
    damaged = b"".join(lines)
    try:
        log, recovery = EventLog.open(path, fsync=False)
    except LogDamaged as exc:
        number = int(re.search(r"line (\d+) cannot be read", str(exc)).group(1))  # type: ignore[union-attr]
        configured = next(n for n, line in enumerate(lines, 1) if b'"@":"Configured"' in line)
        assert number in bad
        assert number < configured or b"Configured" in lines[number - 1]
        assert path.read_bytes() == damaged
        return
    try:
        assert sorted(p.line for p in recovery.problems) == sorted(bad)
        assert recovery.state == intact.state
        assert (recovery.set_aside is not None) == unreadable_last
        # and deo carries on: a new record comes after every seq the log holds
        reducer = Reducer(recovery.state)
        log.record(reducer, Tick(t=recovery.state.now + 1))
    finally:
        log.close()
    log, again = EventLog.open(path, fsync=False)
    log.close()
    assert again.state == reducer.state
    assert sorted(p.line for p in again.problems) == sorted(
        bad - {len(lines)} if unreadable_last else bad
    )


# --- what recovery refuses, checks and repairs -------------------------------------------------


@pytest.mark.parametrize(
    "content",
    [
        b"shopping list\nmilk\neggs\n",
        b"a single line without an end",
        b'{"kind": "note", "text": "json lines of my own"}\n{"x": 1}\n',
        b"first\n\nthird line\n",
        b"{\n",
        b'{"kind": "header", "schema": 1}',  # a whole line of JSON, not a torn header
    ],
    ids=["text", "one-line", "other-jsonl", "blank-line", "brace", "header-without-end"],
)
def test_a_file_that_is_not_a_deo_log_is_refused_and_left_untouched(
    tmp_path: Path, content: bytes
) -> None:
    path = tmp_path / "notes.txt"
    path.write_bytes(content)
    with pytest.raises(NotALog, match=r"notes\.txt is not a deo log"):
        EventLog.open(path)
    assert path.read_bytes() == content
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


def test_an_edited_snapshot_is_ignored_with_a_message_and_the_state_rebuilt(
    tmp_path: Path, demo_events: list[Event]
) -> None:
    path = tmp_path / "log.jsonl"
    reducer = write_log(path, demo_events, fsync=False, snapshot_every=100)
    target = snapshot_path(path)
    payload = json.loads(target.read_bytes())
    removed = sorted(payload["state"]["workers"])[0]
    del payload["state"]["workers"][removed]  # header, offset and digests kept
    target.write_text(json.dumps(payload))
    log, recovery = EventLog.open(path)
    log.close()
    assert recovery.state == reducer.state
    assert removed in recovery.state.workers
    assert recovery.replayed == len(demo_events)
    assert any("edited or damaged" in note for note in recovery.notes), recovery.notes


def test_a_snapshot_of_a_log_whose_covered_part_changed_is_ignored(
    tmp_path: Path, demo_events: list[Event]
) -> None:
    path = tmp_path / "log.jsonl"
    reducer = write_log(path, demo_events, fsync=False, snapshot_every=100)
    raw = path.read_bytes()
    # The same length, one recorded value changed inside the part the snapshot covers.
    at = raw.index(b'"t":1')
    path.write_bytes(raw[:at] + b'"t":2' + raw[at + 5 :])
    log, recovery = EventLog.open(path)
    log.close()
    assert recovery.replayed > len(demo_events) // 2  # from the start, not from the snapshot
    assert any("are not those it was taken after" in note for note in recovery.notes)
    del reducer


@pytest.mark.parametrize("devices", ["0", 7, {"x": 1}])
def test_a_snapshot_with_a_malformed_configuration_is_ignored(
    tmp_path: Path, demo_events: list[Event], devices: Any
) -> None:
    path = tmp_path / "log.jsonl"
    reducer = write_log(path, demo_events, fsync=False, snapshot_every=100)
    target = snapshot_path(path)
    payload = json.loads(target.read_bytes())
    payload["state"]["config"]["gpu_devices"] = devices
    target.write_text(json.dumps(payload))
    log, recovery = EventLog.open(path)
    log.close()
    assert recovery.state == reducer.state
    assert [note for note in recovery.notes if "ignored" in note]


def test_the_snapshot_offset_is_where_the_next_record_starts(tmp_path: Path) -> None:
    path = tmp_path / "log.jsonl"
    log, _ = EventLog.open(path)
    reducer = Reducer()
    log.snapshot(reducer.state)  # before anything was appended to a new log
    header_bytes = len(path.read_bytes())
    assert json.loads(snapshot_path(path).read_bytes())["offset"] == header_bytes
    log.record(reducer, configured())
    log.close()
    with path.open("ab") as f:
        f.write(b'{"kind":"ev')  # torn: cut by recovery, which must not count it
    log, _ = EventLog.open(path)
    log.snapshot(reducer.state)
    log.close()
    assert json.loads(snapshot_path(path).read_bytes())["offset"] == path.stat().st_size
    log, recovery = EventLog.open(path)
    log.close()
    assert recovery.notes == () and recovery.replayed == 0
    assert recovery.state == reducer.state


def test_an_event_the_log_records_as_refused_changes_no_state_on_recovery(tmp_path: Path) -> None:
    path = tmp_path / "log.jsonl"
    before = write_log(path, [configured(count=1)]).state
    pin = encode(configured(t=1.0, count=3))  # accepted now, it would start two workers
    with path.open("ab") as f:  # refused when it happened (say, by an older reducer)
        f.write(orjson.dumps({"kind": "event", "seq": 3, "event": pin}) + b"\n")
        f.write(orjson.dumps({"kind": "rejected", "seq": 4, "cause": 3, "error": "no"}) + b"\n")
    written = path.read_bytes()
    log, recovery = EventLog.open(path)
    log.close()
    assert recovery.state == before
    assert path.read_bytes() == written  # and no commands are made up for it
    assert [p.line for p in recovery.problems] == [4]
    assert "records its refusal" in recovery.problems[0].message


def test_a_cut_between_an_event_and_its_commands_is_written_again_and_verifies(
    demo_log: Path,
) -> None:
    raw = demo_log.read_bytes()
    starts: list[tuple[int, int]] = []  # (start, end) of each commands record
    position = 0
    for line in raw.splitlines(keepends=True):
        if b'"kind":"commands"' in line:
            starts.append((position, position + len(line)))
        position += len(line)
    rng = random.Random(5)
    for start, end in rng.sample(starts, 6):
        cut = rng.choice([start, rng.randrange(start, end)])  # at the line or inside it
        demo_log.write_bytes(raw[:cut])
        snapshot_path(demo_log).unlink(missing_ok=True)
        log, recovery = EventLog.open(demo_log)
        log.close()
        assert any("written again" in note for note in recovery.notes)
        assert replays_cleanly(demo_log) > 0
        # and the repaired log opens without repairing again
        log, again = EventLog.open(demo_log)
        log.close()
        assert again.notes == () and again.state == recovery.state


def test_an_unreadable_configuration_stops_recovery_and_leaves_the_log(demo_log: Path) -> None:
    lines = demo_log.read_bytes().splitlines(keepends=True)
    assert b'"@":"Configured"' in lines[1]
    for garbage in (b"#" * (len(lines[1]) - 1) + b"\n", lines[1][:40] + b"\n", b"\0" * 30 + b"\n"):
        damaged = b"".join([lines[0], garbage, *lines[2:]])
        demo_log.write_bytes(damaged)
        with pytest.raises(LogDamaged, match=r"line 2 cannot be read .* may have held the config"):
            EventLog.open(demo_log)
        assert demo_log.read_bytes() == damaged
        assert not list(demo_log.parent.glob("*.torn-*"))


def test_an_unreadable_line_after_the_configuration_is_reported_and_skipped(
    demo_log: Path,
) -> None:
    lines = demo_log.read_bytes().splitlines(keepends=True)
    at = next(i for i, line in enumerate(lines) if b'"@":"Tick"' in line and i > 10)
    lines[at] = b"#" * 20 + b"\n"
    demo_log.write_bytes(b"".join(lines))
    log, recovery = EventLog.open(demo_log)
    log.close()
    assert [p.line for p in recovery.problems] == [at + 1]


def test_files_deo_writes_beside_the_log_are_private(tmp_path: Path) -> None:
    path = tmp_path / "log.jsonl"
    old = os.umask(0o022)
    try:
        write_log(path, [configured(), Tick(t=1.0)], snapshot_every=1)
        with path.open("ab") as f:
            f.write(b'{"kind":"ev')
        log, recovery = EventLog.open(path)
        log.close()
    finally:
        os.umask(old)
    assert recovery.set_aside is not None
    for written in (path, snapshot_path(path), recovery.set_aside):
        assert written.stat().st_mode & 0o777 == 0o600, written


# --- segments ----------------------------------------------------------------------------------


def test_a_rotated_log_replays_whole_and_recovers(tmp_path: Path, demo_events: list[Event]) -> None:
    path = tmp_path / "run.jsonl"
    reducer = write_log(path, demo_events, fsync=False, snapshot_every=50, segment_bytes=20_000)
    earlier = segments(path)
    assert len(earlier) >= 3
    header = path.read_bytes().splitlines()[0]
    assert all(segment.read_bytes().splitlines()[0] == header for segment in earlier)
    assert run_id_of(path) == run_id_of(earlier[0])  # the workers' run id survives rotation
    assert path.stat().st_size < 20_000 + 20_000
    assert replays_cleanly(path) == len(demo_events)
    for snapshot in (True, False):
        if not snapshot:
            snapshot_path(path).unlink()  # the segment's own state record serves instead
        log, recovery = EventLog.open(path)
        log.close()
        assert recovery.state == reducer.state and recovery.problems == ()
        assert recovery.replayed < len(demo_events) // 2


def test_old_segments_beyond_the_kept_number_are_dropped_and_replay_starts_after_them(
    tmp_path: Path, demo_events: list[Event]
) -> None:
    path = tmp_path / "run.jsonl"
    reducer = write_log(
        path, demo_events, fsync=False, snapshot_every=50, segment_bytes=20_000, keep_segments=2
    )
    earlier = segments(path)
    assert len(earlier) == 2 and not earlier[0].name.endswith(".000001")
    problems: list[LogProblem] = []
    steps = list(replay(path, problems=problems))
    assert problems == [] and all(step.matches for step in steps)
    assert 0 < len(steps) < len(demo_events)
    assert steps[-1].after == reducer.state
    out = io.StringIO()
    args = replay_args(path)
    assert replay_command.run(args, out) == 0, out.getvalue()


def test_a_segment_whose_state_is_not_the_replayed_one_is_reported(
    tmp_path: Path, demo_events: list[Event]
) -> None:
    path = tmp_path / "run.jsonl"
    write_log(path, demo_events, fsync=False, snapshot_every=50, segment_bytes=20_000)
    second = segments(path)[1]
    lines = second.read_bytes().splitlines(keepends=True)
    record = json.loads(lines[1])
    record["state"]["now"] = -1.0
    second.write_bytes(lines[0] + orjson.dumps(record) + b"\n" + b"".join(lines[2:]))
    problems: list[LogProblem] = []
    list(replay(path, problems=problems))
    assert [(p.line, second.name in p.message) for p in problems] == [(2, True)]
    # A --set that changes nothing (no such pool) still reports it.
    problems = []
    no_op = apply_settings([parse_setting("pools.nosuch.max_workers=2")])
    list(replay(path, problems=problems, transform=no_op))
    assert [(p.line, second.name in p.message) for p in problems] == [(2, True)]


OLD_ROTATED_LOG = Path(__file__).resolve().parent / "data" / "rotated_log_7d51f41"


def old_rotated_log(tmp_path: Path) -> Path:
    """A copy of the rotated log an older deo wrote (its segments' states lack later fields)."""
    for file in OLD_ROTATED_LOG.glob("run.jsonl*"):
        shutil.copyfile(file, tmp_path / file.name)
    return tmp_path / "run.jsonl"


def replay_args(path: Path) -> argparse.Namespace:
    return argparse.Namespace(
        log=path,
        set=[],
        what_if=[],
        what_if_seeds=None,
        fitted_out=None,
        sqlite=None,
        at=None,
        explain=None,
        quiet=True,
    )


def test_a_rotated_log_an_older_deo_wrote_replays_verified(tmp_path: Path) -> None:
    path = old_rotated_log(tmp_path)
    earlier = segments(path)
    assert len(earlier) == 3
    states = [segment_start(file) for file in [*earlier[1:], path]]
    # Written before pools measured their drains: the fields added since are not there.
    for begins in states:
        assert begins is not None
        assert "drains" not in begins[0]["pools"]["envs"]
    problems: list[LogProblem] = []
    steps = list(replay(path, problems=problems))
    assert problems == []
    assert all(step.matches for step in steps)
    assert len(steps) == 490
    # ... although the replay did measure the pool's two drains (the state now has them).
    assert len(steps[-1].after.pools["envs"].drains) == 2
    out = io.StringIO()
    assert replay_command.run(replay_args(path), out) == 0, out.getvalue()
    assert "verified: 490 events" in out.getvalue()


@pytest.mark.parametrize(
    ("damage", "said"),
    [
        (
            lambda state: state["pools"]["envs"].update(desired=5),
            "state.pools.envs.desired is 5 in the log, 6 replayed",
        ),
        (
            lambda state: state["workers"]["envs-1"].update(state="draining"),
            'state.workers.envs-1.state is "draining" in the log, "active" replayed',
        ),
        (
            lambda state: state["workers"].pop("envs-1"),
            "state.workers.envs-1 is in the replayed state, not in the log",
        ),
        (
            lambda state: state["pools"]["envs"].update(retired_field=1),
            "state.pools.envs.retired_field is in the log, not in the replayed state",
        ),
        (
            lambda state: state["pools"]["envs"]["spec"].update({"@": "EnginePoolSpec"}),
            "state.pools.envs.spec is a EnginePoolSpec in the log, a PoolSpec now",
        ),
        (
            lambda state: state["gpus"].update(g9={"@": "Gpu", "gpu_id": "g9"}),
            "state.gpus.g9 is in the log, not in the replayed state",
        ),
    ],
    ids=["value", "nested-value", "missing-worker", "unknown-field", "other-class", "extra-key"],
)
def test_an_older_segment_whose_state_differs_where_it_has_a_value_is_reported(
    tmp_path: Path, damage: Callable[[dict[str, Any]], object], said: str
) -> None:
    path = old_rotated_log(tmp_path)
    second = segments(path)[1]
    lines = second.read_bytes().splitlines(keepends=True)
    record = json.loads(lines[1])
    damage(record["state"])
    second.write_bytes(lines[0] + orjson.dumps(record) + b"\n" + b"".join(lines[2:]))
    problems: list[LogProblem] = []
    list(replay(path, problems=problems))
    assert [p.line for p in problems] == [2]
    assert said in problems[0].message and second.name in problems[0].message
    out = io.StringIO()
    assert replay_command.run(replay_args(path), out) == 2


def test_a_list_in_a_segment_state_must_have_the_replayed_length() -> None:
    recorded = {"@": "PoolState", "retries": [[1.0, 1]]}
    assert (
        state_difference(recorded, {"@": "PoolState", "retries": [[1.0, 1]], "drains": []}) is None
    )
    assert state_difference(recorded, {"@": "PoolState", "retries": []}) == (
        "state.retries has 1 items in the log, 0 replayed"
    )
    assert state_difference(recorded, {"@": "PoolState", "retries": [[1.0, 2]]}) == (
        "state.retries[0][1] is 1 in the log, 2 replayed"
    )


def test_a_rotation_cut_short_by_a_crash_is_undone_on_open(
    tmp_path: Path, demo_events: list[Event]
) -> None:
    path = tmp_path / "run.jsonl"
    reducer = write_log(path, demo_events, fsync=False, snapshot_every=50, segment_bytes=20_000)
    earlier = segments(path)
    # Crashed after naming the finished segment, before starting the new one.
    interrupted = path.with_name(f"{path.name}.{len(earlier) + 1:06d}")
    os.link(path, interrupted)
    path.with_name(path.name + ".next").write_bytes(b"partial")
    log, recovery = EventLog.open(path)
    log.close()
    assert not interrupted.exists() and segments(path) == earlier
    assert recovery.state == reducer.state
    assert replays_cleanly(path) == len(demo_events)


@pytest.mark.parametrize(
    "damage",
    [
        lambda record: record["state"].update({"@": "NoSuchState"}),
        lambda record: record.update({"state": {"@": "Tick", "t": 1.0}}),
        lambda record: record.update({"state": [1, 2]}),
        lambda record: record.pop("seq"),
    ],
    ids=["unknown-type", "not-a-state", "not-a-record", "no-seq"],
)
@pytest.mark.parametrize("events_after", [True, False], ids=["events-after", "just-rotated"])
def test_a_segment_whose_state_record_cannot_be_used_stops_recovery(
    tmp_path: Path,
    demo_events: list[Event],
    damage: Callable[[dict[str, Any]], object],
    events_after: bool,
) -> None:
    path = tmp_path / "run.jsonl"
    write_log(path, demo_events, fsync=False, snapshot_every=50, segment_bytes=20_000)
    snapshot_path(path).unlink()
    lines = path.read_bytes().splitlines(keepends=True)
    assert len(lines) > 2 and json.loads(lines[1])["kind"] == "state"
    record = json.loads(lines[1])
    damage(record)
    rest = b"".join(lines[2:]) if events_after else b""
    damaged = lines[0] + orjson.dumps(record) + b"\n" + rest
    path.write_bytes(damaged)
    with pytest.raises(LogDamaged, match=r"line 2, the state this segment .* cannot be used"):
        EventLog.open(path)
    assert path.read_bytes() == damaged
    assert not list(tmp_path.glob("*.torn-*"))


def test_a_segment_whose_only_line_after_the_header_is_garbage_stops_recovery(
    tmp_path: Path, demo_events: list[Event]
) -> None:
    path = tmp_path / "run.jsonl"
    write_log(path, demo_events, fsync=False, snapshot_every=50, segment_bytes=20_000)
    snapshot_path(path).unlink()
    damaged = path.read_bytes().splitlines(keepends=True)[0] + b"#" * 20 + b"\n"
    path.write_bytes(damaged)
    with pytest.raises(LogDamaged, match=r"line 2, the state this segment .* cannot be used"):
        EventLog.open(path)
    assert path.read_bytes() == damaged


def test_segments_of_another_log_beside_a_first_segment_do_not_stop_recovery(
    tmp_path: Path, demo_events: list[Event]
) -> None:
    path = tmp_path / "run.jsonl"
    write_log(path, demo_events, fsync=False, snapshot_every=50, segment_bytes=20_000)
    path.unlink()  # moved aside without its segments; a new log starts under the same name
    snapshot_path(path).unlink()
    reducer = write_log(path, [configured(), Tick(t=1.0)])
    snapshot_path(path).unlink(missing_ok=True)
    log, recovery = EventLog.open(path)
    log.close()
    assert recovery.state == reducer.state


def test_settings_apply_to_the_state_a_replay_starts_from(
    tmp_path: Path, demo_events: list[Event]
) -> None:
    # A long run keeps only its last segments: replay starts from the state the oldest kept one
    # records, and a changed setting must apply there, not only from the next Configured event.
    path = tmp_path / "run.jsonl"
    write_log(
        path, demo_events, fsync=False, snapshot_every=50, segment_bytes=20_000, keep_segments=2
    )
    first = demo_events[0]
    assert isinstance(first, Configured)
    [pool] = first.config.pools
    change = apply_settings([parse_setting(f"pools.{pool.name}.max_workers=2")])
    problems: list[LogProblem] = []
    steps = list(replay(path, problems=problems, transform=change))
    assert problems == []
    assert not any(isinstance(step.event, Configured) for step in steps)
    assert steps[0].before.config.pools[0].max_workers == 2
    assert steps[0].before.pools[pool.name].spec.max_workers == 2
    # Without the change, the state is the one recorded.
    assert next(iter(replay(path, problems=[]))).before.config.pools[0].max_workers == 24
    # deo replay --set: the later segments' states differ from the replayed ones by design
    # (not reported as damage), and the decisions a pool of 2 makes differ from the log's.
    out = io.StringIO()
    args = replay_args(path)
    args.set = [f"pools.{pool.name}.max_workers=2"]
    assert replay_command.run(args, out) == 0, out.getvalue()
    assert "not the one replayed" not in out.getvalue()
    differing = re.search(
        r"(\d+) of \d+ events would have led to different decisions", out.getvalue()
    )
    assert differing is not None and int(differing[1]) > 0, out.getvalue()


def test_a_change_replayed_over_a_whole_rotated_log_is_not_taken_for_damage(
    tmp_path: Path, demo_events: list[Event]
) -> None:
    # Every segment kept: replay starts from the first, and under a change the states the later
    # segments record differ from the replayed ones by design.
    path = tmp_path / "run.jsonl"
    write_log(path, demo_events, fsync=False, snapshot_every=50, segment_bytes=60_000)
    assert len(segments(path)) >= 2
    problems: list[LogProblem] = []
    change = apply_settings([parse_setting("pools.envs.max_workers=2")])
    steps = list(replay(path, problems=problems, transform=change))
    assert problems == []
    assert steps[-1].after.config.pools[0].max_workers == 2
    assert any(not step.matches for step in steps)


def test_a_change_refused_at_the_state_a_replay_starts_from_says_why(tmp_path: Path) -> None:
    path = tmp_path / "run.jsonl"
    pool = attrs.evolve(static_pool(1), min_workers=0, gpus_per_worker=1)
    events: list[Event] = [Configured(t=0.0, config=Config(gpus=["0"], pools=[pool]))]
    _, commands = reduce(State(), events[0])
    [worker_id] = [c.worker_id for c in commands if isinstance(c, SpawnWorker)]
    events.append(WorkerStarted(t=1.0, worker_id=worker_id, pid=100, start_time=1))
    for k in range(1500):
        events += [WorkerHeartbeat(t=2.0 + k, worker_id=worker_id), Tick(t=2.5 + k)]
    write_log(path, events, fsync=False, snapshot_every=50, segment_bytes=20_000, keep_segments=1)
    assert len(segments(path)) == 1
    start = next(iter(replay(path, problems=[]))).before
    assert [w.gpus for w in start.workers.values()] == [("0",)]
    # The worker spawned on GPU 0 still holds it where replay starts: the GPU cannot go.
    with pytest.raises(DeoError, match="GPU '0' is held by worker"):
        list(replay(path, problems=[], transform=apply_settings([(["gpus"], ["1"])])))


def test_the_arbiter_planner_setting_applies_to_the_state_a_replay_starts_from(
    tmp_path: Path,
) -> None:
    path = tmp_path / "run.jsonl"
    events: list[Event] = [configured(), ArbiterGpusDeclared(t=0.5, gpus=("0", "1"))]
    events += [Tick(t=1.0 + k) for k in range(3000)]
    write_log(path, events, fsync=False, snapshot_every=50, segment_bytes=20_000, keep_segments=1)
    assert len(segments(path)) == 1  # the declaration is in a dropped segment
    change = apply_settings([parse_setting("arbiter.planner.name=rlix")])
    steps = list(replay(path, problems=[], transform=change))
    assert not any(isinstance(step.event, ArbiterGpusDeclared) for step in steps)
    planner = steps[0].before.arbiter.planner
    assert planner is not None and planner.name == "rlix"
    recorded = next(iter(replay(path, problems=[]))).before.arbiter.planner
    assert recorded is None or recorded.name == "deo"


def test_a_missing_or_foreign_segment_is_named_and_the_rest_replays(tmp_path: Path) -> None:
    path = old_rotated_log(tmp_path)
    first, second, third = segments(path)
    second.unlink()  # a segment lost in the middle
    problems: list[LogProblem] = []
    steps = list(replay(path, problems=problems))
    assert [p.message for p in problems] == [
        f"records 152 to 301 are not in the log (a segment before this one was removed, or its "
        f"last lines cannot be read); replayed on from the state this one starts from "
        f"(in {third.name})"
    ]
    assert steps and all(step.matches for step in steps)  # no divergence: it goes on from there
    second.write_text("garbage\n")  # and a file in its place that is no segment of this log
    problems = []
    list(replay(path, problems=problems))
    assert problems[0].message == (
        f"not a segment of {path.name} (its header differs); left out (in {second.name})"
    )
    assert first.exists()


def test_a_folder_where_the_snapshot_goes_is_refused_and_left_alone(tmp_path: Path) -> None:
    path = tmp_path / "log.jsonl"
    write_log(path, [configured()])
    before = path.read_bytes()
    snapshot_path(path).mkdir()
    with pytest.raises(LogDamaged, match=r"log\.jsonl\.snapshot is not a file: .* move it aside"):
        EventLog.open(path)
    assert path.read_bytes() == before and snapshot_path(path).is_dir()


def test_a_segment_that_is_the_live_log_under_a_second_name_is_read_once(tmp_path: Path) -> None:
    path = old_rotated_log(tmp_path)
    # A rotation cut short by a crash: the next segment's name links to the live log.
    os.link(path, path.with_name(path.name + ".000004"))
    problems: list[LogProblem] = []
    steps = list(replay(path, problems=problems))
    assert problems == [] and len(steps) == 490 and all(step.matches for step in steps)


def test_a_setting_reaches_a_pool_whose_name_holds_dots() -> None:
    pools = [
        attrs.evolve(static_pool(), name="team"),
        attrs.evolve(static_pool(), name="team.envs"),
    ]
    event = Configured(t=0.0, config=Config(pools=pools))
    change = apply_settings(
        [parse_setting("pools.team.envs.max_workers=3"), parse_setting("pools.team.max_workers=2")]
    )
    changed = change(event)
    assert isinstance(changed, Configured)
    assert {p.name: p.max_workers for p in changed.config.pools} == {"team": 2, "team.envs": 3}
    assert change.unmatched_pools() == []
    other = apply_settings([parse_setting("pools.nosuch.max_workers=2")])
    other(event)
    assert other.unmatched_pools() == ["nosuch"]
