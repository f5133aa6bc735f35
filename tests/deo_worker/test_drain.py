"""deo_worker/drain.py: real signals to this process and to a real worker process."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import anyio
import pytest
from waiting import wait_for

from deo_worker import Drain

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE_WORKER = ROOT / "examples" / "worker.py"


def signal_soon(sig: signal.Signals, delay_s: float = 0.1) -> threading.Timer:
    """Send ``sig`` to this process from another thread, while the main thread waits."""
    timer = threading.Timer(delay_s, os.kill, (os.getpid(), sig))
    timer.start()
    return timer


def test_the_signal_sets_the_flag_and_closing_restores_the_old_handler() -> None:
    before = signal.getsignal(signal.SIGUSR1)
    with Drain() as drain:
        assert signal.getsignal(signal.SIGUSR1) != before
        assert (drain.requested, drain.requested_by) == (False, None)
        os.kill(os.getpid(), signal.SIGUSR1)
        assert (drain.requested, drain.requested_by) == (True, signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGUSR1)  # a second one changes nothing
        assert (drain.requested, drain.requested_by) == (True, signal.SIGUSR1)
    assert signal.getsignal(signal.SIGUSR1) == before


@pytest.mark.parametrize(
    "name", ["SIGUSR2", "usr2", "SIGusr2", signal.SIGUSR2, int(signal.SIGUSR2)]
)
def test_signals_by_name_or_number(name: signal.Signals | int | str) -> None:
    with Drain(signals=[name]) as drain:
        assert drain.signals == (signal.SIGUSR2,)
        os.kill(os.getpid(), signal.SIGUSR2)
        assert drain.requested_by is signal.SIGUSR2


def test_several_signals_any_of_them_drains() -> None:
    with Drain(signals=("SIGUSR1", "SIGHUP")) as drain:
        os.kill(os.getpid(), signal.SIGHUP)
        assert drain.requested and drain.requested_by is signal.SIGHUP


@pytest.mark.parametrize(
    ("signals", "message"),
    [(["SIGNOPE"], "'SIGNOPE' is not a signal"), ([999], "999 is not a signal"), ([], "at least")],
)
def test_bad_signals_are_named(signals: list[str | int], message: str) -> None:
    before = signal.getsignal(signal.SIGUSR1)
    with pytest.raises(ValueError, match=message):
        Drain(signals=signals)
    assert signal.getsignal(signal.SIGUSR1) == before


def test_only_the_main_thread_can_install_handlers() -> None:
    errors: list[BaseException] = []

    def create() -> None:
        try:
            Drain()
        except RuntimeError as exc:
            errors.append(exc)

    thread = threading.Thread(target=create)
    thread.start()
    thread.join()
    assert len(errors) == 1 and "main thread" in str(errors[0])


def test_wait_under_asyncio_wakes_on_the_signal() -> None:
    async def scenario(drain: Drain) -> float:
        started = time.monotonic()
        timer = signal_soon(signal.SIGUSR1, delay_s=0.2)
        # The loop sleeps in select() with nothing else to do: the signal must wake it.
        await asyncio.wait_for(drain.wait(), timeout=10)
        timer.join()
        return time.monotonic() - started

    with Drain() as drain:
        waited_s = asyncio.run(scenario(drain))
    assert drain.requested and waited_s >= 0.15


def test_wait_under_anyio_wakes_on_the_signal_for_every_waiter() -> None:
    woken: list[int] = []

    async def scenario(drain: Drain) -> None:
        async def waiter(number: int) -> None:
            await drain.wait()
            woken.append(number)

        with anyio.fail_after(10):
            async with anyio.create_task_group() as group:
                for number in range(3):
                    group.start_soon(waiter, number)
                await anyio.sleep(0.05)
                assert woken == []  # nobody wakes before the signal
                signal_soon(signal.SIGUSR1).join()

    with Drain() as drain:
        anyio.run(scenario, drain)
    assert sorted(woken) == [0, 1, 2]


def test_wait_returns_at_once_when_already_requested_and_request_works_from_a_thread() -> None:
    async def scenario(drain: Drain) -> None:
        with anyio.fail_after(10):
            await drain.wait()

    with Drain() as drain:
        thread = threading.Thread(target=drain.request)
        thread.start()
        thread.join()
        assert drain.requested and drain.requested_by is None
        anyio.run(scenario, drain)


def test_a_cancelled_wait_leaves_nothing_behind() -> None:
    async def scenario(drain: Drain) -> None:
        with anyio.move_on_after(0.05):
            await drain.wait()
        assert not drain.requested

    with Drain() as drain:
        anyio.run(scenario, drain)
        assert drain._waiters == []
        drain.request()  # no waiter left whose loop is gone: nothing to fail on
        assert drain.requested


def test_the_example_worker_finishes_its_item_and_exits_0_on_sigusr1(tmp_path: Path) -> None:
    heartbeat = tmp_path / "w.heartbeat"
    env = {**os.environ, "DEO_WORKER_ID": "envs-7", "DEO_HEARTBEAT_FILE": str(heartbeat)}
    proc = subprocess.Popen(
        [sys.executable, str(EXAMPLE_WORKER), "0.5"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()  # printed once the handler is installed
        assert first.startswith("envs-7: started"), first
        wait_for("the heartbeat file", heartbeat.exists, interval_s=0.02)
        proc.send_signal(signal.SIGUSR1)
        out, _ = proc.communicate(timeout=10)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 0, out
    assert out.strip() == "envs-7: drained"
