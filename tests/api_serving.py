"""Serving deo's API in a test: a clock the test moves, an executor that records the commands,
and the server on a free loopback port."""

from __future__ import annotations

import functools
from typing import Any

import anyio
from anyio.abc import TaskGroup
from starlette.applications import Starlette

from adapters.api.app import serve
from core import Command


class ManualClock:
    """The runner's clock, moved by the test so event times are known."""

    def __init__(self) -> None:
        self.t_s = 0.0

    def __call__(self) -> float:
        return self.t_s


class RecordingExecutor:
    """Executes nothing: keeps every command the runner hands it, in order."""

    def __init__(self) -> None:
        self.commands: list[Command] = []

    async def execute(self, command: Command) -> None:
        self.commands.append(command)


async def serve_on_free_port(tg: TaskGroup, app: Starlette, **serve_options: Any) -> int:
    """Serve ``app`` in ``tg`` on a free loopback port (``serve``'s default host); the port,
    once it listens."""
    ports: list[int] = []
    listening = anyio.Event()

    def started(port: int) -> None:
        ports.append(port)
        listening.set()

    tg.start_soon(functools.partial(serve, app, port=0, started=started, **serve_options))
    with anyio.fail_after(10):
        await listening.wait()
    return ports[0]
