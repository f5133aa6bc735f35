"""The runner loop: every event logged before it is reduced, answers to submitters, survival."""

from __future__ import annotations

import traceback
from pathlib import Path

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
)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class Recorder:
    def __init__(self) -> None:
        self.commands: list[Command] = []

    async def execute(self, command: Command) -> None:
        self.commands.append(command)


def make(tmp_path: Path) -> tuple[Runner, Recorder]:
    log, _ = EventLog.open(tmp_path / "run.jsonl", fsync=False)
    executor = Recorder()
    clock = iter(range(1, 10_000)).__next__
    return Runner(
        log, Reducer(), executor, clock=lambda: float(clock()), tick_interval_s=60
    ), executor


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
async def test_sources_may_emit_after_the_loop_stopped(tmp_path: Path) -> None:
    runner, _ = make(tmp_path)
    async with anyio.create_task_group() as tg:
        tg.start_soon(runner.run)
        await anyio.wait_all_tasks_blocked()
        tg.cancel_scope.cancel()
    runner.emit(Configured(t=0.0, config=Config()))  # dropped, not raised


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
