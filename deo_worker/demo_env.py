"""A stand-in Atropos env worker: speaks the real trajectory API the way ``BaseEnv`` does.

``python -m deo_worker.demo_env --api URL --group-size 8 --latency-s 1.5
--max-batches-offpolicy 3 --groups-in-flight 2 [--seed N]`` registers with an atroposlib API
server (``POST /register-env``, again every 0.5 s while it answers "wait for trainer to start"),
reads the trainer's ``batch_size`` (``GET /info``), then every 0.1 s reads its view of the queue
(``GET /status-env``) and keeps ``--groups-in-flight`` simulated generations running (it prints
``<worker id>: generating, N groups in flight`` when the first start), each sleeping a lognormal
latency of mean ``--latency-s`` and then posting one group of ``--group-size`` short random
sequences to ``POST /scored_data``.

Backpressure is atroposlib 0.4.0's own (``BaseEnv.env_manager`` / ``add_train_workers``): no more
groups in flight than the queue has room for below ``max_batches_offpolicy`` batches, surplus
generations cancelled when the room shrinks, and all of them cancelled while the queue is full.

It heartbeats as deo asks (:class:`deo_worker.Heartbeat`). On the drain signal (SIGUSR1) it
starts no new group, posts the ones in flight (unless the queue reaches the off-policy limit
first: BaseEnv's loop runs on through a drain, :mod:`deo_worker.atropos`, and cancels them
there), ``POST /disconnect-env``, prints
``<worker id>: drained, N groups posted`` and exits 0. SIGTERM ends it at once (the default
action). An unreachable API is retried with backoff, with one line per outage and no traceback;
an API that answers with errors (5xx three times, or any 4xx) ends it with one line and exit 1,
as ``BaseEnv``'s retries give up.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import sys
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio
import httpx

from deo_worker.atropos import disconnect_env
from deo_worker.drain import Drain
from deo_worker.heartbeat import WORKER_ID_ENV, Heartbeat
from deo_worker.ready import report_ready_async

__all__ = ["DemoEnvSettings", "main", "parse_args", "run"]

#: BaseEnv's main loop sleeps 0.1 s between looks at ``/status-env``.
POLL_S = 0.1
#: How long one look at the queue may take while draining: an outage (retried without end)
#: must not hold a drain whose groups are in.
DRAIN_LOOK_S = 5.0
#: BaseEnv waits 1 s between registration attempts; shorter here so demos start quickly.
REGISTER_RETRY_S = 0.5
HEARTBEAT_INTERVAL_S = 1.0
#: Backoff while the API is unreachable: doubles from the first to the last, with jitter.
BACKOFF_FIRST_S = 0.2
BACKOFF_MAX_S = 2.0
#: Answers with a server error are retried this many times in all (BaseEnv's tenacity rule).
SERVER_ERROR_ATTEMPTS = 3
REQUEST_TIMEOUT_S = 10.0

_T = TypeVar("_T")


@dataclass(frozen=True, slots=True, kw_only=True)
class DemoEnvSettings:
    """What ``python -m deo_worker.demo_env`` was asked to do (see :func:`parse_args`)."""

    api_url: str
    group_size: int = 8
    latency_s: float = 1.5
    latency_sigma: float = 0.5
    max_batches_offpolicy: int = 3
    groups_in_flight: int = 2
    seed: int | None = None
    name: str = "deo-demo"
    max_token_length: int = 2048
    weight: float = 1.0

    def __post_init__(self) -> None:
        for key in ("group_size", "max_batches_offpolicy", "groups_in_flight", "max_token_length"):
            if getattr(self, key) < 1:
                raise ValueError(
                    f"--{key.replace('_', '-')} must be >= 1, got {getattr(self, key)}"
                )
        for key in ("latency_s", "weight"):
            if not getattr(self, key) > 0:
                raise ValueError(f"--{key.replace('_', '-')} must be > 0, got {getattr(self, key)}")
        if self.latency_sigma < 0:
            raise ValueError(f"--latency-sigma must be >= 0, got {self.latency_sigma}")
        if not self.api_url.startswith(("http://", "https://")):
            raise ValueError(f"--api: expected an http(s):// URL, got {self.api_url!r}")


def parse_args(argv: Sequence[str] | None = None) -> DemoEnvSettings:
    """The settings from the command line; exits 2 with a message naming a bad flag."""
    parser = argparse.ArgumentParser(
        prog="python -m deo_worker.demo_env",
        description="A stand-in Atropos env worker against a real trajectory API server.",
    )
    defaults = DemoEnvSettings(api_url="http://x")
    parser.add_argument(
        "--api", required=True, help="the trajectory API, e.g. http://127.0.0.1:8000"
    )
    parser.add_argument("--group-size", type=int, default=defaults.group_size)
    parser.add_argument(
        "--latency-s", type=float, default=defaults.latency_s, help="mean seconds per group"
    )
    parser.add_argument(
        "--latency-sigma",
        type=float,
        default=defaults.latency_sigma,
        help="sigma of the lognormal latency (0: every group takes --latency-s)",
    )
    parser.add_argument("--max-batches-offpolicy", type=int, default=defaults.max_batches_offpolicy)
    parser.add_argument("--groups-in-flight", type=int, default=defaults.groups_in_flight)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--name", default=defaults.name, help="desired_name at /register-env")
    parser.add_argument("--max-token-length", type=int, default=defaults.max_token_length)
    parser.add_argument("--weight", type=float, default=defaults.weight)
    args = parser.parse_args(argv)
    try:
        return DemoEnvSettings(
            api_url=args.api.rstrip("/"),
            group_size=args.group_size,
            latency_s=args.latency_s,
            latency_sigma=args.latency_sigma,
            max_batches_offpolicy=args.max_batches_offpolicy,
            groups_in_flight=args.groups_in_flight,
            seed=args.seed,
            name=args.name,
            max_token_length=args.max_token_length,
            weight=args.weight,
        )
    except ValueError as exc:
        parser.error(str(exc))


class _Refused(Exception):
    """The API answered, but not with what we need: BaseEnv would give up here."""


class _Api:
    """The trajectory API, retried the way a long-running env needs (see the module docstring)."""

    def __init__(self, client: httpx.AsyncClient, say: Callable[[str], None]) -> None:
        self.client = client
        self.say = say
        self.down = False
        self.rng = random.Random()

    async def call(self, method: str, path: str, body: Any = None) -> Any:
        """The JSON answer to ``method path``; waits out outages; raises :class:`_Refused`."""
        for attempt in range(1, SERVER_ERROR_ATTEMPTS + 1):
            response = await self._reach(method, path, body)
            if response.status_code < 500 or attempt == SERVER_ERROR_ATTEMPTS:
                break
            await anyio.sleep(BACKOFF_FIRST_S * attempt)
        if not response.is_success:
            raise _Refused(f"{method} {path}: {response.status_code} {response.text[:200]}")
        try:
            return response.json()
        except ValueError:
            raise _Refused(f"{method} {path}: not JSON: {response.text[:200]!r}") from None

    async def _reach(self, method: str, path: str, body: Any) -> httpx.Response:
        delay_s = BACKOFF_FIRST_S
        while True:
            try:
                response = await self.client.request(method, path, json=body)
            except httpx.TransportError as exc:
                if not self.down:  # one line per outage, however long it lasts
                    self.down = True
                    self.say(
                        f"cannot reach {self.client.base_url} ({type(exc).__name__}: {exc}); "
                        f"retrying every {BACKOFF_FIRST_S:g}-{BACKOFF_MAX_S:g}s"
                    )
                await anyio.sleep(delay_s * self.rng.uniform(0.5, 1.0))
                delay_s = min(2 * delay_s, BACKOFF_MAX_S)
                continue
            self.down = False
            return response


async def _unless_drained(drain: Drain, step: Callable[[], Awaitable[_T]]) -> _T | None:
    """``await step()``, or None if the drain comes first (``step`` is then cancelled)."""
    result: _T | None = None
    async with anyio.create_task_group() as group:

        async def watch() -> None:
            await drain.wait()
            group.cancel_scope.cancel()

        group.start_soon(watch)
        result = await step()
        group.cancel_scope.cancel()
    return result


class _DemoEnv:
    def __init__(self, settings: DemoEnvSettings, api: _Api, drain: Drain) -> None:
        self.settings = settings
        self.api = api
        self.drain = drain
        self.rng = random.Random(settings.seed)
        self.env_id: int | None = None
        self.batch_size_seqs = -1
        self.max_token_len = -1
        self.generating: dict[int, anyio.CancelScope] = {}
        self.posting = 0
        self.started = 0
        self.posted = 0

    @property
    def in_flight(self) -> int:
        return len(self.generating) + self.posting

    async def register(self) -> int:
        body = {
            "max_token_length": self.settings.max_token_length,
            "desired_name": self.settings.name,
            "weight": self.settings.weight,
            "group_size": self.settings.group_size,
        }
        said_waiting = False
        while True:
            answer = await self.api.call("POST", "/register-env", body)
            if isinstance(answer, dict) and answer.get("status") == "success":
                env_id = answer.get("env_id")
                if not isinstance(env_id, int):
                    raise _Refused(f"POST /register-env: no integer env_id in {answer!r}")
                return env_id
            if not said_waiting:
                said_waiting = True
                self.api.say(f"waiting for the trainer to start ({answer!r})")
            await anyio.sleep(REGISTER_RETRY_S)

    async def read_info(self) -> None:
        answer = await self.api.call("GET", "/info")
        try:
            self.batch_size_seqs = int(answer["batch_size"])
            self.max_token_len = int(answer["max_token_len"])
        except (TypeError, KeyError, ValueError):
            raise _Refused(f"GET /info: no batch_size/max_token_len in {answer!r}") from None
        if self.batch_size_seqs != -1 and self.settings.group_size > self.batch_size_seqs:
            raise _Refused(
                f"--group-size {self.settings.group_size} is larger than the trainer's "
                f"batch_size {self.batch_size_seqs} (atroposlib refuses this too)"
            )

    async def queue_groups(self) -> int:
        answer = await self.api.call("GET", "/status-env", {"env_id": self.env_id})
        try:
            return int(answer["queue_size"])
        except (TypeError, KeyError, ValueError):
            raise _Refused(f"GET /status-env: no queue_size in {answer!r}") from None

    def full(self, queue_groups: int) -> bool:
        """Whether BaseEnv would cancel every group in generation: the queue at the off-policy
        limit (or no trainer registered)."""
        limit_seqs = self.settings.max_batches_offpolicy * self.batch_size_seqs
        return self.batch_size_seqs == -1 or queue_groups * self.settings.group_size >= limit_seqs

    def adjust(self, queue_groups: int, start: Callable[[], None]) -> None:
        """BaseEnv 0.4.0's rule (``env_manager``, ``add_train_workers``): cancel all when the
        queue is full; below the worker limit, trim to the room left and fill up to it."""
        if self.full(queue_groups):
            self.cancel(len(self.generating))
            return
        limit_seqs = self.settings.max_batches_offpolicy * self.batch_size_seqs
        if self.in_flight >= self.settings.groups_in_flight:
            return
        room_groups = limit_seqs // self.settings.group_size - queue_groups
        wanted = min(self.settings.groups_in_flight, room_groups)
        if self.in_flight > wanted:
            self.cancel(self.in_flight - wanted)
        while self.in_flight < wanted:
            start()

    def cancel(self, count: int) -> None:
        for scope in list(self.generating.values())[:count]:
            scope.cancel()

    def latency_s(self) -> float:
        sigma = self.settings.latency_sigma
        mu = math.log(self.settings.latency_s) - sigma * sigma / 2  # so that the mean is latency_s
        return self.rng.lognormvariate(mu, sigma)

    def group(self) -> dict[str, Any]:
        longest = 32 if self.max_token_len <= 0 else max(2, min(32, self.max_token_len - 1))
        tokens, masks, scores = [], [], []
        for _ in range(self.settings.group_size):
            length = self.rng.randint(min(8, longest), longest)
            prompt = length // 2
            sequence = [self.rng.randrange(1, 32_000) for _ in range(length)]
            tokens.append(sequence)
            masks.append([-100] * prompt + sequence[prompt:])  # the prompt is not trained on
            scores.append(round(self.rng.uniform(-1.0, 1.0), 3))
        return {"tokens": tokens, "masks": masks, "scores": scores, "env_id": self.env_id}

    async def generate(self, number: int, scope: anyio.CancelScope, latency_s: float) -> None:
        try:
            with scope:
                await anyio.sleep(latency_s)
        finally:
            del self.generating[number]
        if scope.cancelled_caught:
            return
        self.posting += 1
        try:
            # Once generated, a group is posted even while draining: it is what a drain waits for.
            with anyio.CancelScope(shield=True):
                await self.api.call("POST", "/scored_data", self.group())
                self.posted += 1
        except _Refused as exc:
            self.api.say(f"group dropped: {exc}")
        finally:
            self.posting -= 1

    async def produce(self) -> None:
        """Generate and post groups until the drain; then let the ones in flight finish."""
        async with anyio.create_task_group() as generations:

            def start() -> None:
                self.started += 1
                # Counted in flight from now, not from when the task first runs.
                scope = self.generating[self.started] = anyio.CancelScope()
                generations.start_soon(self.generate, self.started, scope, self.latency_s())

            announced = False
            while not self.drain.requested:
                posted_before = self.posted
                queue_groups = await _unless_drained(self.drain, self.queue_groups)
                if queue_groups is None:
                    break
                # A group posted while the answer was on its way may be missing from it and is no
                # longer in flight: count it as queued (at worst twice), never overshoot the limit.
                self.adjust(queue_groups + self.posted - posted_before, start)
                if self.started and not announced:  # once: the env is making groups
                    self.api.say(f"generating, {self.in_flight} groups in flight")
                    announced = True
                with anyio.move_on_after(POLL_S):
                    await self.drain.wait()
            self.api.say(f"draining, {self.in_flight} groups in flight")
            await self.cancel_at_the_limit()

    async def cancel_at_the_limit(self) -> None:
        """While generations are left, cancel them all should the queue reach the off-policy
        limit: BaseEnv's loop runs on through a drain (it only starts nothing new)."""
        while self.generating:
            with anyio.move_on_after(DRAIN_LOOK_S):
                try:
                    full = self.full(await self.queue_groups())
                except _Refused:
                    return  # the API forgot the env: the groups finish and are posted or dropped
                if full:
                    self.cancel(len(self.generating))
                    return
            await anyio.sleep(POLL_S)

    async def disconnect(self) -> None:
        assert self.env_id is not None
        if not await disconnect_env(str(self.api.client.base_url), self.env_id, attempts=2):
            self.api.say(f"POST /disconnect-env for env {self.env_id} failed (logged above)")


def _first(group: BaseExceptionGroup[_Refused]) -> _Refused:
    first = group.exceptions[0]
    return _first(first) if isinstance(first, BaseExceptionGroup) else first


async def run(settings: DemoEnvSettings, drain: Drain, worker_id: str) -> int:
    """The demo env until the drain; the process's exit status (0 drained, 1 refused)."""

    def say(line: str) -> None:
        print(f"{worker_id}: {line}", flush=True)

    say(
        f"started (api {settings.api_url}, group size {settings.group_size}, latency "
        f"{settings.latency_s:g}s, {settings.groups_in_flight} groups in flight, "
        f"max_batches_offpolicy {settings.max_batches_offpolicy})"
    )
    timeout = httpx.Timeout(REQUEST_TIMEOUT_S)
    async with (
        httpx.AsyncClient(base_url=settings.api_url, timeout=timeout) as client,
        anyio.create_task_group() as background,
    ):
        background.start_soon(Heartbeat.from_environ().run, HEARTBEAT_INTERVAL_S)
        env = _DemoEnv(settings, _Api(client, say), drain)
        refused: _Refused | None = None
        try:
            env.env_id = await _unless_drained(drain, env.register)
            if env.env_id is not None:
                say(f"registered as env {env.env_id}")
                # Registered with the trajectory API: ready, for a pool that waits for it.
                background.start_soon(report_ready_async)
                await _unless_drained(drain, env.read_info)
                await env.produce()
        except* _Refused as group:  # raised inside task groups, so it comes in a group
            refused = _first(group)
        if refused is not None:
            say(f"giving up: {refused}")
            if env.env_id is not None:
                await env.disconnect()
            background.cancel_scope.cancel()
            return 1
        if env.env_id is not None:
            await env.disconnect()
        say(f"drained, {env.posted} groups posted")
        background.cancel_scope.cancel()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m deo_worker.demo_env``: parse flags, serve until drained, return the status."""
    drain = Drain()  # first: a drain that comes while we start is not lost
    settings = parse_args(argv)
    worker_id = os.environ.get(WORKER_ID_ENV) or f"demo-env-{os.getpid()}"
    try:
        return anyio.run(run, settings, drain, worker_id)
    except KeyboardInterrupt:
        return 130
    finally:
        drain.close()


if __name__ == "__main__":
    sys.exit(main())
