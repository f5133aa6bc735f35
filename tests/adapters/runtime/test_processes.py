"""adapters/runtime/processes.py: the local process executor, real processes and signals."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import anyio
import pytest
from anyio.streams.memory import MemoryObjectReceiveStream
from spawned import alive
from waiting import wait_for

from adapters.runtime import processes as processes_module
from adapters.runtime.processes import LocalProcesses, process_start_time
from core import (
    Config,
    Configured,
    DrainWorker,
    Event,
    KillWorker,
    LeftoverProcesses,
    LeftoverProcessesStopped,
    Reducer,
    SpawnFailed,
    SpawnWorker,
    TerminateWorker,
    WorkerExited,
    WorkerStarted,
)
from core.vocabulary import AlertName

POLL_S = 0.05


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


# --- helpers ---------------------------------------------------------------------------------

Track = Callable[[int], None]


@pytest.fixture
def track() -> Iterator[Track]:
    """Register a pid to be SIGKILLed (with its group, if it leads one) when the test ends."""
    tracked: list[tuple[int, int | None]] = []

    def add(pid: int) -> None:
        tracked.append((pid, process_start_time(pid)))

    yield add
    for pid, start_time in tracked:
        # Checked like the executor does, so a recycled pid is never hit.
        if start_time is None or process_start_time(pid) != start_time:
            continue
        with contextlib.suppress(ProcessLookupError):
            if os.getpgid(pid) == pid:
                os.killpg(pid, signal.SIGKILL)
            else:
                os.kill(pid, signal.SIGKILL)
        # Reap our own children (the executor's included) so no zombie outlives the test.
        deadline = time.monotonic() + 2.0
        with contextlib.suppress(ChildProcessError):
            while os.waitpid(pid, os.WNOHANG) == (0, 0) and time.monotonic() < deadline:
                time.sleep(0.01)


async def wait_dead(pid: int, timeout_s: float = 30.0) -> None:
    with anyio.fail_after(timeout_s):
        while alive(pid):
            await anyio.sleep(0.02)


async def next_event(events: MemoryObjectReceiveStream[Event], timeout_s: float = 30.0) -> Event:
    with anyio.fail_after(timeout_s):
        return await events.receive()


async def no_event(events: MemoryObjectReceiveStream[Event], wait_s: float = 0.3) -> None:
    await anyio.sleep(wait_s)
    with pytest.raises(anyio.WouldBlock):
        events.receive_nowait()


async def log_line(path: Path, prefix: str, timeout_s: float = 30.0) -> str:
    """Wait for a line starting with ``prefix`` in a worker's log and return the rest of it."""
    with anyio.fail_after(timeout_s):
        while True:
            if path.exists():
                for line in path.read_text().splitlines():
                    if line.startswith(prefix):
                        return line[len(prefix) :]
            await anyio.sleep(0.02)


def python(script: str) -> list[str]:
    return [sys.executable, "-c", script]


def spawn(worker_id: str, argv: list[str]) -> SpawnWorker:
    return SpawnWorker(
        worker_id=worker_id,
        pool="envs",
        argv=argv,
        gpus=(),
        env={"CUDA_VISIBLE_DEVICES": "", "DEO_WORKER_ID": worker_id, "DEO_POOL": "envs"},
        reason="test",
    )


def drain(worker_id: str, pid: int | None) -> DrainWorker:
    return DrainWorker(
        worker_id=worker_id, pid=pid, signal="SIGUSR1", deadline_t=1e9, reason="test"
    )


Running = tuple[LocalProcesses, MemoryObjectReceiveStream[Event]]


@contextlib.asynccontextmanager
async def running(log_dir: Path) -> AsyncIterator[Running]:
    """An executor with run() going, and the stream its events arrive on."""
    send, receive = anyio.create_memory_object_stream[Event](100)
    executor = LocalProcesses(
        send.send_nowait, clock=time.monotonic, log_dir=log_dir, poll_interval_s=POLL_S
    )
    async with send, receive, anyio.create_task_group() as tg:
        tg.start_soon(executor.run)
        yield executor, receive
        tg.cancel_scope.cancel()


async def started(events: MemoryObjectReceiveStream[Event], track: Track) -> WorkerStarted:
    event = await next_event(events)
    assert isinstance(event, WorkerStarted), event
    track(event.pid)
    return event


SLEEPER = "import time; print('ready', flush=True); time.sleep(60)"

DRAINABLE = """
import signal, sys, time
signal.signal(signal.SIGUSR1, lambda *_: sys.exit(0))
print('ready', flush=True)
time.sleep(60)
"""

# Ignores drain and terminate; so does its child, which inherits the ignored dispositions.
STUBBORN = """
import signal, subprocess, sys, time
signal.signal(signal.SIGUSR1, signal.SIG_IGN)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])
print('child', child.pid, flush=True)
time.sleep(60)
"""


# --- scenarios -------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_spawn_reports_identity_env_and_exit_code(
    tmp_path: Path, track: Track, monkeypatch: pytest.MonkeyPatch
) -> None:
    go = tmp_path / "go"
    script = f"""
import os, sys, time
print('env', os.environ['DEO_WORKER_ID'], os.environ['DEO_POOL'],
      repr(os.environ['CUDA_VISIBLE_DEVICES']), os.environ['FROM_PARENT'], flush=True)
print('stdin', repr(sys.stdin.read()), flush=True)
print('stderr too', file=sys.stderr, flush=True)
while not os.path.exists({str(go)!r}):
    time.sleep(0.01)
sys.exit(3)
"""
    monkeypatch.setenv("FROM_PARENT", "inherited")
    async with running(tmp_path / "logs") as (executor, events):
        await executor.execute(spawn("envs-0", python(script)))
        event = await started(events, track)
        assert event.worker_id == "envs-0"
        assert event.start_time == process_start_time(event.pid)
        assert os.getpgid(event.pid) == event.pid  # its own process group
        log = tmp_path / "logs" / "envs-0.log"
        assert await log_line(log, "env ") == "envs-0 envs '' inherited"
        assert await log_line(log, "stdin ") == "''"  # /dev/null
        await log_line(log, "stderr too")
        go.touch()
        exited = await next_event(events)
        assert exited == WorkerExited(t=exited.t, worker_id="envs-0", exit_code=3)
        assert exited.t >= event.t
        assert not alive(event.pid)  # reaped, not left a zombie


@pytest.mark.anyio
async def test_external_sigkill_is_reported_once(tmp_path: Path, track: Track) -> None:
    async with running(tmp_path) as (executor, events):
        await executor.execute(spawn("envs-0", python(SLEEPER)))
        event = await started(events, track)
        os.kill(event.pid, signal.SIGKILL)
        exited = await next_event(events)
        assert exited == WorkerExited(t=exited.t, worker_id="envs-0", signal=signal.SIGKILL)
        # Late commands for an exited worker are ignored, and nothing else is reported.
        await executor.execute(KillWorker(worker_id="envs-0", pid=event.pid, reason="late"))
        await no_event(events)


@pytest.mark.anyio
async def test_drain_signal_lets_the_worker_exit_cleanly(tmp_path: Path, track: Track) -> None:
    async with running(tmp_path) as (executor, events):
        await executor.execute(spawn("envs-0", python(DRAINABLE)))
        event = await started(events, track)
        await log_line(tmp_path / "envs-0.log", "ready")
        await executor.execute(drain("envs-0", event.pid))
        exited = await next_event(events)
        assert exited == WorkerExited(t=exited.t, worker_id="envs-0", exit_code=0)


@pytest.mark.anyio
async def test_kill_takes_the_whole_group(tmp_path: Path, track: Track) -> None:
    async with running(tmp_path) as (executor, events):
        await executor.execute(spawn("envs-0", python(STUBBORN)))
        event = await started(events, track)
        child = int(await log_line(tmp_path / "envs-0.log", "child "))
        track(child)
        await executor.execute(drain("envs-0", event.pid))
        await no_event(events)
        terminate = TerminateWorker(worker_id="envs-0", pid=event.pid, deadline_t=1e9, reason="t")
        await executor.execute(terminate)
        await no_event(events)
        assert alive(event.pid) and alive(child)
        await executor.execute(KillWorker(worker_id="envs-0", pid=event.pid, reason="test"))
        exited = await next_event(events)
        assert exited == WorkerExited(t=exited.t, worker_id="envs-0", signal=signal.SIGKILL)
        await wait_dead(child)


@pytest.mark.anyio
async def test_spawn_failures_are_events_not_exceptions(tmp_path: Path) -> None:
    not_executable = tmp_path / "script.sh"
    not_executable.write_text("#!/bin/sh\n")
    async with running(tmp_path / "logs") as (executor, events):
        await executor.execute(spawn("envs-0", ["/nonexistent/binary", "--flag"]))
        failed = await next_event(events)
        assert isinstance(failed, SpawnFailed) and failed.worker_id == "envs-0"
        assert "'/nonexistent/binary'" in failed.error
        assert "No such file or directory" in failed.error

        await executor.execute(spawn("envs-1", [str(not_executable)]))
        failed = await next_event(events)
        assert isinstance(failed, SpawnFailed) and failed.worker_id == "envs-1"
        assert str(not_executable) in failed.error and "Permission denied" in failed.error

        # Commands for a worker that never started are ignored.
        await executor.execute(KillWorker(worker_id="envs-0", pid=None, reason="test"))
        await no_event(events, 0.1)


@pytest.mark.anyio
async def test_adopt_watches_a_stranger_until_it_is_gone(tmp_path: Path, track: Track) -> None:
    # Started here, so it is not the executor's child: the executor can only poll /proc.
    proc = subprocess.Popen(python(SLEEPER), stdout=subprocess.DEVNULL, start_new_session=True)
    track(proc.pid)
    start_time = process_start_time(proc.pid)
    assert start_time is not None
    async with running(tmp_path) as (executor, events):
        assert await executor.adopt("envs-7", proc.pid, start_time)
        await no_event(events, 2 * POLL_S)
        proc.kill()
        await anyio.to_thread.run_sync(proc.wait)  # reap it: a zombie must also count as gone
        exited = await next_event(events)
        assert exited == WorkerExited(t=exited.t, worker_id="envs-7")
        assert exited.exit_code is None and exited.signal is None


@pytest.mark.anyio
async def test_adopt_sees_a_zombie_as_gone(tmp_path: Path, track: Track) -> None:
    proc = subprocess.Popen(python(SLEEPER), stdout=subprocess.DEVNULL, start_new_session=True)
    track(proc.pid)
    start_time = process_start_time(proc.pid)
    assert start_time is not None
    try:
        async with running(tmp_path) as (executor, events):
            assert await executor.adopt("envs-7", proc.pid, start_time)
            proc.kill()  # not reaped until the finally: a zombie the whole time
            exited = await next_event(events)
            assert exited == WorkerExited(t=exited.t, worker_id="envs-7")
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.anyio
async def test_adopt_with_a_wrong_start_time_touches_nothing(tmp_path: Path, track: Track) -> None:
    proc = subprocess.Popen(python(SLEEPER), stdout=subprocess.DEVNULL, start_new_session=True)
    track(proc.pid)
    start_time = process_start_time(proc.pid)
    assert start_time is not None
    try:
        async with running(tmp_path) as (executor, events):
            assert not await executor.adopt("envs-7", proc.pid, start_time + 1)
            assert not await executor.adopt("envs-8", 2**22 + 12345, start_time)  # no such pid
            await executor.execute(KillWorker(worker_id="envs-7", pid=proc.pid, reason="test"))
            await no_event(events)
            assert alive(proc.pid)
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.anyio
async def test_cancelling_run_leaves_workers_running(tmp_path: Path, track: Track) -> None:
    send, events = anyio.create_memory_object_stream[Event](100)
    executor = LocalProcesses(
        send.send_nowait, clock=time.monotonic, log_dir=tmp_path, poll_interval_s=POLL_S
    )
    async with send, events:
        async with anyio.create_task_group() as tg:
            tg.start_soon(executor.run)
            await executor.execute(spawn("envs-0", python(SLEEPER)))
            event = await started(events, track)
            tg.cancel_scope.cancel()
        await anyio.sleep(0.2)
        assert alive(event.pid)
        # The exit that happens while nobody watches is reported once run() is back.
        os.kill(event.pid, signal.SIGKILL)
        await no_event(events, 0.1)
        async with anyio.create_task_group() as tg:
            tg.start_soon(executor.run)
            exited = await next_event(events)
            assert exited == WorkerExited(t=exited.t, worker_id="envs-0", signal=signal.SIGKILL)
            tg.cancel_scope.cancel()


@pytest.mark.anyio
async def test_commands_before_the_spawn_are_applied_once_it_starts(
    tmp_path: Path, track: Track
) -> None:
    async with running(tmp_path) as (executor, events):
        # The core sends pid=None when it decided to drain a worker it has not seen start.
        await executor.execute(drain("envs-0", None))
        await executor.execute(spawn("envs-0", python(DRAINABLE)))
        await started(events, track)
        exited = await next_event(events)
        # The drain may land before the worker installed its handler; SIGUSR1's default action
        # then ends it. Either way it was delivered: otherwise the worker sleeps for a minute.
        assert isinstance(exited, WorkerExited) and exited.worker_id == "envs-0"
        assert (exited.exit_code, exited.signal) in {(0, None), (None, signal.SIGUSR1)}

        await executor.execute(KillWorker(worker_id="envs-1", pid=None, reason="test"))
        await executor.execute(spawn("envs-1", python(SLEEPER)))
        await started(events, track)
        exited = await next_event(events)
        assert exited == WorkerExited(t=exited.t, worker_id="envs-1", signal=signal.SIGKILL)


@pytest.mark.anyio
async def test_a_recycled_pid_is_never_signalled(
    tmp_path: Path, track: Track, monkeypatch: pytest.MonkeyPatch
) -> None:
    proc = subprocess.Popen(python(SLEEPER), stdout=subprocess.DEVNULL, start_new_session=True)
    track(proc.pid)
    start_time = process_start_time(proc.pid)
    assert start_time is not None
    try:
        async with running(tmp_path) as (executor, events):
            assert await executor.adopt("envs-7", proc.pid, start_time)
            # As if the worker had died and a stranger had been given its pid since.
            real = process_start_time
            monkeypatch.setattr(
                "adapters.runtime.processes.process_start_time",
                lambda pid: start_time + 1 if pid == proc.pid else real(pid),
            )
            await executor.execute(KillWorker(worker_id="envs-7", pid=proc.pid, reason="test"))
            await anyio.sleep(0.1)
            assert alive(proc.pid)
            monkeypatch.undo()
            await executor.execute(KillWorker(worker_id="envs-7", pid=proc.pid, reason="test"))
            exited = await next_event(events)
            assert exited == WorkerExited(t=exited.t, worker_id="envs-7")
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.anyio
async def test_a_worker_gets_the_inherited_environment_and_the_commands_env_untouched(
    tmp_path: Path, track: Track
) -> None:
    events: list[Event] = []
    inherited = {"PATH": os.environ["PATH"], "KEPT": "k", "CUDA_VISIBLE_DEVICES": "0,1,2,3"}
    executor = LocalProcesses(
        events.append, clock=time.monotonic, log_dir=tmp_path, environ=inherited
    )
    command = spawn("envs-0", python(SLEEPER))
    command = SpawnWorker(
        worker_id=command.worker_id,
        pool=command.pool,
        argv=command.argv,
        gpus=("1",),
        env={**command.env, "CUDA_VISIBLE_DEVICES": "3"},
        reason=command.reason,
    )
    await executor.execute(command)
    [event] = events
    assert isinstance(event, WorkerStarted)
    track(event.pid)
    # Until the child has exec'd, /proc shows the environment of the fork (or none): wait for it.
    environ = Path(f"/proc/{event.pid}/environ")
    deadline = time.monotonic() + 30
    while b"DEO_WORKER_ID=" not in environ.read_bytes() and time.monotonic() < deadline:
        await anyio.sleep(0.02)
    raw = environ.read_bytes().split(b"\0")
    env = dict(item.decode().split("=", 1) for item in raw if b"=" in item)
    # The command's env as the core wrote it wins over what is inherited; the executor adds
    # only the heartbeat file beside the worker's log.
    assert env == {
        **inherited,
        **command.env,
        "DEO_HEARTBEAT_FILE": str(tmp_path / "envs-0.heartbeat"),
    }
    assert env["CUDA_VISIBLE_DEVICES"] == "3"


# Starts a child in a session of its own that ignores SIGTERM, then exits by itself.
LEAVES_A_CHILD = """
import signal, subprocess, sys
DEAF = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"
child = subprocess.Popen([sys.executable, '-c', DEAF], start_new_session=True)
print('child', child.pid, flush=True)
"""

KEEPS_A_CHILD = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])
print('child', child.pid, flush=True)
time.sleep(60)
"""


@pytest.mark.anyio
async def test_what_an_ended_worker_leaves_behind_is_stopped_and_reported(
    tmp_path: Path, track: Track
) -> None:
    run_marks = {"DEO_RUN_ID": uuid.uuid4().hex}
    send, events = anyio.create_memory_object_stream[Event](100)
    executor = LocalProcesses(
        send.send_nowait,
        clock=time.monotonic,
        log_dir=tmp_path,
        poll_interval_s=POLL_S,
        environ={**os.environ, **run_marks},
        run_marks=run_marks,
        stop_timeout_s=lambda pool: 0.5 if pool == "envs" else 60.0,
    )
    async with send, events, anyio.create_task_group() as tg:
        tg.start_soon(executor.run)
        await executor.execute(spawn("envs-0", python(KEEPS_A_CHILD)))
        await started(events, track)
        kept = int(await log_line(tmp_path / "envs-0.log", "child "))
        track(kept)
        await executor.execute(spawn("envs-1", python(LEAVES_A_CHILD)))
        await started(events, track)
        left = int(await log_line(tmp_path / "envs-1.log", "child "))
        track(left)
        exited = await next_event(events)
        assert exited == WorkerExited(t=exited.t, worker_id="envs-1", exit_code=0)
        report = await next_event(events)
        assert isinstance(report, LeftoverProcesses), report
        assert (report.worker_id, report.count) == ("envs-1", 1)
        assert f"pid {left} (" in report.detail and "own session" in report.detail
        await wait_dead(left)  # SIGTERM ignored: SIGKILL after the pool's 0.5 s
        stopped = await next_event(events)
        assert stopped == LeftoverProcessesStopped(t=stopped.t, worker_id="envs-1")
        assert alive(kept)  # a live worker's child is its own business
        tg.cancel_scope.cancel()


@pytest.mark.anyio
async def test_children_of_the_host_program_are_neither_stopped_nor_reaped(
    tmp_path: Path, track: Track, monkeypatch: pytest.MonkeyPatch
) -> None:
    looks = [0]  # how often the reaper has listed this process's children

    def children() -> list[int]:
        looks[0] += 1
        return list_children()

    list_children = processes_module._children
    monkeypatch.setattr(processes_module, "_children", children)
    # A program running deo in-process may have children of its own, in its own session.
    own = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    done = subprocess.Popen([sys.executable, "-c", "raise SystemExit(5)"])
    track(own.pid)
    run_marks = {"DEO_RUN_ID": uuid.uuid4().hex}
    send, events = anyio.create_memory_object_stream[Event](100)
    executor = LocalProcesses(
        send.send_nowait,
        clock=time.monotonic,
        log_dir=tmp_path,
        poll_interval_s=POLL_S,
        environ={**os.environ, **run_marks},
        run_marks=run_marks,
        stop_timeout_s=lambda pool: 0.5,
        reap_orphans=True,
    )
    async with send, events, anyio.create_task_group() as tg:
        tg.start_soon(executor.run)
        await executor.execute(spawn("envs-0", python(LEAVES_A_CHILD)))
        await started(events, track)
        track(int(await log_line(tmp_path / "envs-0.log", "child ")))
        exited = await next_event(events)
        assert isinstance(exited, WorkerExited), exited
        report = await next_event(events)
        assert isinstance(report, LeftoverProcesses), report
        looked = looks[0]
        with anyio.fail_after(30):
            while looks[0] < looked + 10:  # the reaper has looked at our children 10 more times
                await anyio.sleep(POLL_S)
        assert own.poll() is None  # not stopped
        assert done.wait(timeout=30) == 5  # its exit status is still ours to collect
        tg.cancel_scope.cancel()


def test_leftover_alerts_are_resolved_once_nothing_of_their_worker_is_left(
    tmp_path: Path, track: Track
) -> None:
    run_marks = {"DEO_RUN_ID": uuid.uuid4().hex}
    # A process of this run that envs-3 left behind, still running; envs-4 left nothing.
    left = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"],
        env={**os.environ, **run_marks, "DEO_WORKER_ID": "envs-3"},
    )
    track(left.pid)
    # Until it has executed, the child still has this process's environment, without the marks.
    marked = b"DEO_WORKER_ID=envs-3"
    wait_for(
        "the left-over process to start",
        lambda: marked in Path(f"/proc/{left.pid}/environ").read_bytes().split(b"\0"),
        interval_s=0.01,
    )
    reducer = Reducer()
    reducer.step(Configured(t=0.0, config=Config()))
    for worker_id in ("envs-3", "envs-4"):
        reducer.step(LeftoverProcesses(t=1.0, worker_id=worker_id, count=1, detail="pid 1"))
    executor = LocalProcesses(
        lambda event: None,
        clock=lambda: 2.0,
        log_dir=tmp_path,
        environ={**os.environ, **run_marks},
        run_marks=run_marks,
    )

    gone = executor.leftovers_gone(reducer.state)

    assert gone == [LeftoverProcessesStopped(t=2.0, worker_id="envs-4")]
    for event in gone:
        reducer.step(event)
    assert reducer.state.alerts == {(AlertName.LEFTOVER_PROCESSES, "envs-3")}
    # Without marks to tell this run's processes apart, nothing is resolved.
    unmarked = LocalProcesses(lambda event: None, clock=lambda: 2.0, log_dir=tmp_path)
    assert unmarked.leftovers_gone(reducer.state) == []
    left.kill()
    left.wait(timeout=30)
    assert executor.leftovers_gone(reducer.state) == [
        LeftoverProcessesStopped(t=2.0, worker_id="envs-3")
    ]
