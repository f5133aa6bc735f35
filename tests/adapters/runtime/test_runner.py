"""The runner loop: every event logged before it is reduced, answers to submitters, survival."""

from __future__ import annotations

import threading
import traceback
from pathlib import Path
from typing import Any

import anyio
import orjson
import pytest

from adapters.log import EventLog
from adapters.runtime.runner import Runner, Stopping
from core import (
    Command,
    Config,
    Configured,
    PolicySpec,
    PoolPinned,
    PoolSpec,
    Reducer,
    Refused,
    UnknownSubject,
    WorkerStarted,
    encode,
)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class Recorder:
    def __init__(self) -> None:
        self.commands: list[Command] = []

    async def execute(self, command: Command) -> None:
        self.commands.append(command)


class LogReader(Recorder):
    """Records each command with what the log file held when the command was handed over."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = path
        self.file_when_executed: list[list[dict[str, Any]]] = []

    async def execute(self, command: Command) -> None:
        await super().execute(command)
        self.file_when_executed.append(records(self.path))


def make(
    tmp_path: Path, executor: Recorder | None = None, *, tick_interval_s: float = 60
) -> tuple[Runner, Recorder]:
    log, _ = EventLog.open(tmp_path / "run.jsonl", fsync=False)
    executor = executor or Recorder()
    clock = iter(range(1, 10_000)).__next__
    return Runner(
        log, Reducer(), executor, clock=lambda: float(clock()), tick_interval_s=tick_interval_s
    ), executor


def records(path: Path) -> list[dict[str, Any]]:
    """The records in the log file, header first."""
    return [orjson.loads(line) for line in path.read_bytes().splitlines()]


async def wait_until_executed(executor: Recorder, count: int) -> None:
    with anyio.fail_after(10):
        while len(executor.commands) < count:
            await anyio.sleep(0.01)


SPEC = PoolSpec(
    name="envs", argv=["w"], max_workers=4, policy=PolicySpec(name="static", params={"count": 2})
)


@pytest.mark.anyio
async def test_submitted_events_are_logged_reduced_and_executed(tmp_path: Path) -> None:
    runner, executor = make(tmp_path)
    async with anyio.create_task_group() as tg:
        tg.start_soon(runner.run)
        commands = await runner.submit(Configured(t=0.0, config=Config(pools=[SPEC])))
        assert [type(c).__name__ for c in commands] == ["ScalePool", "SpawnWorker", "SpawnWorker"]
        with pytest.raises(Refused, match="outside pool 'envs' bounds"):
            await runner.submit(PoolPinned(t=1.0, pool="envs", count=9))
        with anyio.fail_after(5):
            while len(executor.commands) < 3:
                await anyio.sleep(0.01)
        tg.cancel_scope.cancel()
    records = [orjson.loads(line) for line in (tmp_path / "run.jsonl").read_bytes().splitlines()]
    assert [r["kind"] for r in records] == ["header", "event", "commands", "event", "rejected"]
    assert executor.commands == commands


@pytest.mark.anyio
async def test_a_submitter_that_gives_up_does_not_kill_the_loop(tmp_path: Path) -> None:
    runner, _ = make(tmp_path)
    async with anyio.create_task_group() as tg:
        async with anyio.create_task_group() as impatient:
            impatient.start_soon(runner.submit, Configured(t=0.0, config=Config(pools=[SPEC])))
            await anyio.wait_all_tasks_blocked()  # queued, waiting for an answer
            impatient.cancel_scope.cancel()  # ... and gone before the runner answers
        tg.start_soon(runner.run)
        commands = await runner.submit(PoolPinned(t=1.0, pool="envs", count=3))
        assert [type(c).__name__ for c in commands] == ["ScalePool", "SpawnWorker"]
        tg.cancel_scope.cancel()


@pytest.mark.anyio
async def test_commands_are_carried_out_only_once_they_and_their_event_are_in_the_file(
    tmp_path: Path,
) -> None:
    runner, executor = make(tmp_path, LogReader(tmp_path / "run.jsonl"))
    assert isinstance(executor, LogReader)
    async with anyio.create_task_group() as tg:
        tg.start_soon(runner.run)
        configured = Configured(t=0.0, config=Config(pools=[SPEC]))
        await runner.submit(configured)
        await wait_until_executed(executor, 2)  # ScalePool, SpawnWorker (the first of two)
        tg.cancel_scope.cancel()
    for i, (command, written) in enumerate(
        zip(executor.commands, executor.file_when_executed, strict=True)
    ):
        [event] = [r for r in written if r["kind"] == "event"]
        assert event["event"] == encode(configured), i
        [logged] = [r for r in written if r["kind"] == "commands"]
        assert logged["cause"] == event["seq"] and encode(command) in logged["commands"], i


@pytest.mark.anyio
async def test_commands_reach_the_executor_in_the_order_they_were_decided(
    tmp_path: Path,
) -> None:
    runner, executor = make(tmp_path)
    runner.emit(Configured(t=0.0, config=Config(pools=[SPEC])))
    runner.emit(PoolPinned(t=1.0, pool="envs", count=3))
    runner.emit(WorkerStarted(t=2.0, worker_id="envs-0", pid=4242, start_time=1))
    runner.emit(PoolPinned(t=3.0, pool="envs", count=1))

    def logged() -> list[dict[str, Any]]:
        return [r for r in records(tmp_path / "run.jsonl") if r["kind"] in ("event", "commands")]

    async with anyio.create_task_group() as tg:
        tg.start_soon(runner.run)
        with anyio.fail_after(10):
            while sum(r["kind"] == "event" for r in logged()) < 4 or sum(
                len(r.get("commands", ())) for r in logged()
            ) > len(executor.commands):
                await anyio.sleep(0.01)
        tg.cancel_scope.cancel()
    decided = [r for r in logged() if r["kind"] == "commands"]
    assert len(decided) == 3  # configured, pinned to 3, pinned to 1: each decided something
    assert [encode(c) for c in executor.commands] == [c for r in decided for c in r["commands"]]


@pytest.mark.anyio
async def test_a_refused_event_is_reported_to_its_submitter_and_changes_nothing(
    tmp_path: Path,
) -> None:
    runner, executor = make(tmp_path)
    async with anyio.create_task_group() as tg:
        tg.start_soon(runner.run)
        await runner.submit(Configured(t=0.0, config=Config(pools=[SPEC])))
        await wait_until_executed(executor, 3)
        before = runner.state
        with pytest.raises(Refused, match="outside pool 'envs' bounds"):
            await runner.submit(PoolPinned(t=1.0, pool="envs", count=9))
        await anyio.wait_all_tasks_blocked()
        tg.cancel_scope.cancel()
    assert runner.state is before
    assert len(executor.commands) == 3  # the configuration's only
    *_, event, refusal = records(tmp_path / "run.jsonl")
    assert event["event"]["@"] == "PoolPinned"
    assert refusal["kind"] == "rejected" and refusal["cause"] == event["seq"]
    assert "outside pool 'envs' bounds" in refusal["error"]


@pytest.mark.anyio
async def test_ticks_carry_the_runners_clock_not_the_wall_clock(tmp_path: Path) -> None:
    runner, _ = make(tmp_path, tick_interval_s=0.01)  # its clock reads 1.0, 2.0, 3.0, ...
    async with anyio.create_task_group() as tg:
        tg.start_soon(runner.run)
        with anyio.fail_after(10):
            while runner.state.now < 3.0:
                await anyio.sleep(0.01)
        tg.cancel_scope.cancel()
    ticks = [
        r["event"]["t"]
        for r in records(tmp_path / "run.jsonl")
        if r["kind"] == "event" and r["event"]["@"] == "Tick"
    ]
    assert ticks == [float(n) for n in range(1, len(ticks) + 1)], ticks


@pytest.mark.anyio
async def test_an_event_from_a_source_after_the_stop_is_dropped(tmp_path: Path) -> None:
    runner, _ = make(tmp_path)
    async with anyio.create_task_group() as tg:
        tg.start_soon(runner.run)
        await anyio.wait_all_tasks_blocked()
        tg.cancel_scope.cancel()
    before = runner.state
    runner.emit(Configured(t=0.0, config=Config(pools=[SPEC])))  # not raised: ...
    runner.log.close()
    assert runner.state is before  # ... neither reduced
    assert [r["kind"] for r in records(tmp_path / "run.jsonl")] == ["header"]  # nor logged


@pytest.mark.anyio
async def test_what_is_queued_at_the_stop_is_still_logged(tmp_path: Path) -> None:
    runner, executor = make(tmp_path)
    runner.emit(Configured(t=0.0, config=Config(pools=[SPEC])))
    runner.emit(PoolPinned(t=1.0, pool="envs", count=3))
    async with anyio.create_task_group() as tg:
        tg.start_soon(runner.run)
        tg.cancel_scope.cancel()  # before the loop has handled anything
    runner.log.close()
    records = [orjson.loads(line) for line in (tmp_path / "run.jsonl").read_bytes().splitlines()]
    events = [r["event"]["@"] for r in records if r["kind"] == "event"]
    assert events == ["Configured", "PoolPinned"]
    assert executor.commands == []  # logged, not carried out: a restart reconciles them
    assert runner.state.pools["envs"].target == 3


@pytest.mark.anyio
async def test_a_submitter_waiting_at_the_stop_is_told_deo_is_stopping(tmp_path: Path) -> None:
    runner, _ = make(tmp_path)
    answers: list[str] = []

    async def submit() -> None:
        try:
            await runner.submit(Configured(t=0.0, config=Config(pools=[SPEC])))
        except Stopping as exc:
            answers.append(str(exc))

    async with anyio.create_task_group() as outer:
        outer.start_soon(submit)
        await anyio.wait_all_tasks_blocked()
        async with anyio.create_task_group() as tg:
            tg.start_soon(runner.run)
            tg.cancel_scope.cancel()
    assert answers == ["deo is stopping"]


@pytest.mark.anyio
async def test_a_submitter_gets_the_error_the_core_raised_not_a_copy_of_its_message(
    tmp_path: Path,
) -> None:
    runner, _ = make(tmp_path)
    async with anyio.create_task_group() as tg:
        tg.start_soon(runner.run)
        await runner.submit(Configured(t=0.0, config=Config(pools=[SPEC])))
        with pytest.raises(UnknownSubject, match="unknown pool 'nope'") as unknown:
            await runner.submit(PoolPinned(t=1.0, pool="nope", count=1))
        with pytest.raises(Refused, match="outside pool 'envs' bounds") as refused:
            await runner.submit(PoolPinned(t=2.0, pool="envs", count=9))
        tg.cancel_scope.cancel()
    assert (type(unknown.value), unknown.value.http_status) == (UnknownSubject, 404)
    assert (type(refused.value), refused.value.http_status) == (Refused, 409)
    # Raised by the reducer: its traceback reaches into the handler that refused the event.
    frames = [frame.name for frame in traceback.extract_tb(refused.value.__traceback__)]
    assert "_pinned" in frames, frames
    with pytest.raises(Stopping, match="deo is stopping"):
        await runner.submit(PoolPinned(t=3.0, pool="envs", count=1))


@pytest.mark.anyio
async def test_readers_never_see_a_state_the_log_does_not_hold_yet(tmp_path: Path) -> None:
    """A status page read while a batch is being made durable shows the state before it: after a
    kill -9 at that moment the restart recovers exactly what was shown."""
    runner, _ = make(tmp_path)
    persist = runner._persist
    flushing, release = anyio.Event(), threading.Event()
    token = anyio.lowlevel.current_token()

    def slow_persist(state: Any) -> None:
        anyio.from_thread.run_sync(flushing.set, token=token)
        release.wait(60)
        persist(state)

    runner._persist = slow_persist  # type: ignore[method-assign]
    async with anyio.create_task_group() as tg:
        tg.start_soon(runner.run)
        runner.emit(Configured(t=0.0, config=Config(pools=[SPEC])))
        with anyio.fail_after(60):
            await flushing.wait()
        # Reduced, not yet durable: a reader does not see it.
        assert runner.reducer.state.pools
        assert not runner.state.pools
        release.set()
        with anyio.fail_after(60):
            while not runner.state.pools:
                await anyio.sleep(0.01)
        tg.cancel_scope.cancel()
    runner.log.close()
    assert [r["event"]["@"] for r in records(tmp_path / "run.jsonl") if r["kind"] == "event"] == [
        "Configured"
    ]
