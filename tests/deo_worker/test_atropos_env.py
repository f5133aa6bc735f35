"""Atropos env workers against a real atroposlib API server, with real processes and signals.

``python -m deo_worker.demo_env`` runs as a real process. ``serve_until_drained`` runs here, in
this process's main thread, around :class:`ContractEnv`: atroposlib.envs.base cannot be imported
without its training dependencies, so ContractEnv reproduces the part of BaseEnv 0.4.0's
``env_manager`` that the drain relies on (``config.max_num_workers`` re-read every loop, the
``workers`` set, ``env_id``, ``config.rollout_server_url``) against the real API server.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import AtroposApi, free_port
from waiting import DEADLINE_S, wait_for

from deo_worker import Drain, Heartbeat, drainable, serve_until_drained
from deo_worker.demo_env import parse_args

ROOT = Path(__file__).resolve().parents[2]
GROUP = 4
BATCH = 16


def queue_groups(api: AtroposApi) -> int:
    size: int = httpx.get(api.url + "/status").json()["queue_size"]
    return size


def register_env(api: AtroposApi, name: str = "other") -> int:
    body = {"max_token_length": 2048, "desired_name": name, "weight": 1.0, "group_size": GROUP}
    answer = httpx.post(api.url + "/register-env", json=body).raise_for_status().json()
    env_id: int = answer["env_id"]
    return env_id


def weight_of(api: AtroposApi, env_id: int) -> float:
    """The env's share of the connected envs' weight: how /status-env shows a disconnect."""
    answer = httpx.request("GET", api.url + "/status-env", json={"env_id": env_id})
    weight: float = answer.raise_for_status().json()["env_weight"]
    return weight


class DemoEnvProcess:
    """``python -m deo_worker.demo_env`` as deo starts it, its output read line by line."""

    def __init__(self, tmp_path: Path, api_url: str, *flags: str, worker_id: str = "envs-0"):
        self.heartbeat_file = tmp_path / f"{worker_id}.heartbeat"
        env = {**os.environ, "DEO_WORKER_ID": worker_id}
        env["DEO_HEARTBEAT_FILE"] = str(self.heartbeat_file)
        argv = [sys.executable, "-m", "deo_worker.demo_env", "--api", api_url, *flags]
        self.proc = subprocess.Popen(
            argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    def wait_for_line(self, pattern: str, timeout_s: float = DEADLINE_S) -> re.Match[str]:
        def found() -> re.Match[str] | None:
            assert self.proc.poll() is None or self._reader.is_alive(), self.output
            return next((m for line in self.lines if (m := re.search(pattern, line))), None)

        try:
            match: re.Match[str] = wait_for(f"a line matching {pattern!r}", found, timeout_s)
        except AssertionError:
            raise AssertionError(f"no line matching {pattern!r} in:\n{self.output}") from None
        return match

    def exit_code(self, timeout_s: float) -> int:
        code = self.proc.wait(timeout_s)
        self._reader.join(5)
        return code

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


@pytest.fixture
def demo_env(tmp_path: Path) -> Iterator[Callable[..., DemoEnvProcess]]:
    started: list[DemoEnvProcess] = []

    def start(api_url: str, *flags: str, worker_id: str = "envs-0") -> DemoEnvProcess:
        started.append(DemoEnvProcess(tmp_path, api_url, *flags, worker_id=worker_id))
        return started[-1]

    yield start
    for process in started:
        process.stop()


def flags(
    *, latency_s: float, in_flight: int, max_batches: int = 3, sigma: float = 0.5
) -> list[str]:
    return [
        *("--group-size", str(GROUP), "--latency-s", str(latency_s)),
        *("--latency-sigma", str(sigma), "--groups-in-flight", str(in_flight)),
        *("--max-batches-offpolicy", str(max_batches), "--seed", "7"),
    ]


# --- python -m deo_worker.demo_env ---------------------------------------------------------------


def test_groups_reach_the_queue_and_make_batches(
    atropos_api: AtroposApi, demo_env: Callable[..., DemoEnvProcess]
) -> None:
    atropos_api.register_trainer(batch_size_seqs=BATCH)
    env = demo_env(atropos_api.url, *flags(latency_s=0.1, in_flight=2))
    env.wait_for_line(r"^envs-0: registered as env 0$")
    wait_for("a batch worth of groups", lambda: queue_groups(atropos_api) >= BATCH // GROUP)
    batch = httpx.get(atropos_api.url + "/batch").json()["batch"]
    assert sum(len(group["tokens"]) for group in batch) == BATCH
    for group in batch:
        assert group["env_id"] == 0 and len(group["tokens"]) == GROUP
        assert [len(m) for m in group["masks"]] == [len(t) for t in group["tokens"]]
        assert all(len(t) < 64 for t in group["tokens"])  # the trainer's max_token_len
        assert len(group["scores"]) == GROUP
    assert env.heartbeat_file.exists()
    assert httpx.get(atropos_api.url + "/status").json()["current_step"] == 1


def test_it_stops_at_max_batches_offpolicy_and_resumes_when_the_trainer_pulls(
    atropos_api: AtroposApi, demo_env: Callable[..., DemoEnvProcess]
) -> None:
    atropos_api.register_trainer(batch_size_seqs=BATCH)
    limit_groups = 2 * BATCH // GROUP  # 2 batches of 16 sequences, in groups of 4
    env = demo_env(atropos_api.url, *flags(latency_s=0.05, in_flight=4, max_batches=2))
    wait_for("the queue to fill", lambda: queue_groups(atropos_api) >= limit_groups)
    seen = []
    deadline = time.monotonic() + 1.5  # ~30 generation times: ample to overshoot if it would
    while time.monotonic() < deadline:
        seen.append(queue_groups(atropos_api))
        time.sleep(0.05)
    assert max(seen) == limit_groups, seen
    # The trainer pulls: atroposlib moves every full batch out of the queue at once. The env
    # refills it within ~0.1 s, too soon to see the queue short reliably on a busy machine; the
    # count of groups it posted shows the refill instead.
    assert len(httpx.get(atropos_api.url + "/batch").json()["batch"]) == BATCH // GROUP
    wait_for("the queue to refill", lambda: queue_groups(atropos_api) == limit_groups)
    time.sleep(0.5)
    assert queue_groups(atropos_api) == limit_groups
    env.proc.send_signal(signal.SIGUSR1)
    assert env.exit_code(timeout_s=30) == 0, env.output
    posted = re.fullmatch(r"envs-0: drained, (\d+) groups posted", env.lines[-1])
    assert posted is not None, env.output
    assert int(posted[1]) >= limit_groups + BATCH // GROUP  # the pulled groups were replaced


def test_sigusr1_mid_generation_posts_what_is_in_flight_disconnects_and_exits_0(
    atropos_api: AtroposApi, demo_env: Callable[..., DemoEnvProcess]
) -> None:
    atropos_api.register_trainer(batch_size_seqs=BATCH)
    other = register_env(atropos_api)
    env = demo_env(atropos_api.url, *flags(latency_s=6.0, in_flight=2, sigma=0.0))
    env.wait_for_line(r"registered as env 1$")
    assert weight_of(atropos_api, other) == pytest.approx(0.5)  # two connected envs
    # Every group takes 6 s: two land at ~6 s, two more are generating from the env's next poll
    # until ~12 s; the drain must come in between, which leaves a busy machine seconds to spare.
    wait_for("the first two groups", lambda: queue_groups(atropos_api) == 2)
    time.sleep(1.0)  # past the env's next poll (every 0.1 s), when the next two start
    env.proc.send_signal(signal.SIGUSR1)
    draining = env.wait_for_line(r"^envs-0: draining, (\d+) groups in flight$")
    assert int(draining[1]) == 2
    assert env.exit_code(timeout_s=10) == 0, env.output
    assert env.lines[-1] == "envs-0: drained, 4 groups posted", env.output
    assert queue_groups(atropos_api) == 4  # the two in flight arrived
    assert weight_of(atropos_api, other) == pytest.approx(1.0)  # the demo env disconnected


def test_a_drain_cancels_the_groups_in_flight_once_the_queue_reaches_the_limit(
    atropos_api: AtroposApi, demo_env: Callable[..., DemoEnvProcess]
) -> None:
    # BaseEnv's loop runs on through a drain: groups still generating when the queue reaches
    # the off-policy limit (2 batches of 16 = 8 groups of 4) are cancelled there, not posted on
    # top of it, and the drain ends then, not when their 30 s are up.
    atropos_api.register_trainer(batch_size_seqs=BATCH)
    other = register_env(atropos_api)
    env = demo_env(atropos_api.url, *flags(latency_s=30.0, in_flight=2, max_batches=2, sigma=0.0))
    env.wait_for_line(r"^envs-0: generating, 2 groups in flight$")
    env.proc.send_signal(signal.SIGUSR1)
    draining = env.wait_for_line(r"^envs-0: draining, (\d+) groups in flight$")
    assert int(draining[1]) == 2
    group = {"tokens": [[1, 2, 3]] * GROUP, "masks": [[-100, 2, 3]] * GROUP,
             "scores": [0.5] * GROUP, "env_id": other}  # fmt: skip
    for _ in range(2 * BATCH // GROUP):
        httpx.post(atropos_api.url + "/scored_data", json=group).raise_for_status()
    assert env.exit_code(timeout_s=20) == 0, env.output  # well before the 30 s generations
    assert env.lines[-1] == "envs-0: drained, 0 groups posted", env.output
    assert queue_groups(atropos_api) == 2 * BATCH // GROUP


def test_sigterm_ends_it_at_once(
    atropos_api: AtroposApi, demo_env: Callable[..., DemoEnvProcess]
) -> None:
    atropos_api.register_trainer(batch_size_seqs=BATCH)
    env = demo_env(atropos_api.url, *flags(latency_s=30.0, in_flight=2, sigma=0.0))
    env.wait_for_line(r"registered as env 0$")
    time.sleep(0.3)  # generating
    env.proc.send_signal(signal.SIGTERM)
    assert env.exit_code(timeout_s=15) == -signal.SIGTERM  # not after the 30 s generation
    assert "drained" not in env.output and queue_groups(atropos_api) == 0


def test_an_api_down_at_start_is_retried_then_it_registers(
    tmp_path: Path, demo_env: Callable[..., DemoEnvProcess]
) -> None:
    api = AtroposApi(tmp_path / "late-api.log", port=free_port())
    env = demo_env(api.url, *flags(latency_s=0.1, in_flight=2))
    env.wait_for_line(rf"^envs-0: cannot reach {re.escape(api.url)} \(ConnectError")
    time.sleep(1.0)  # several retries
    api.start()
    try:
        env.wait_for_line(r"waiting for the trainer to start")
        api.register_trainer(batch_size_seqs=BATCH)
        env.wait_for_line(r"registered as env 0$")
        wait_for("groups in the queue", lambda: queue_groups(api) >= 1)
        env.proc.send_signal(signal.SIGUSR1)
        assert env.exit_code(timeout_s=10) == 0, env.output
    finally:
        api.stop()
    assert sum("cannot reach" in line for line in env.lines) == 1, env.output  # one per outage
    assert "Traceback" not in env.output


def test_a_restarted_api_that_forgot_the_env_ends_it_with_exit_1(
    tmp_path: Path, demo_env: Callable[..., DemoEnvProcess]
) -> None:
    first = AtroposApi(tmp_path / "first-api.log").start()
    try:
        first.register_trainer(batch_size_seqs=BATCH)
        env = demo_env(first.url, *flags(latency_s=0.1, in_flight=2))
        env.wait_for_line(r"registered as env 0$")
    finally:
        first.stop()
    env.wait_for_line(r"cannot reach")
    second = AtroposApi(tmp_path / "second-api.log", port=first.port).start()
    try:
        assert env.exit_code(timeout_s=15) == 1, env.output
    finally:
        second.stop()
    assert "giving up: GET /status-env: 500" in env.output
    assert "Traceback" not in env.output


def test_a_drain_before_the_trainer_starts_exits_0_without_registering(
    atropos_api: AtroposApi, demo_env: Callable[..., DemoEnvProcess]
) -> None:
    env = demo_env(atropos_api.url, *flags(latency_s=0.1, in_flight=2))
    env.wait_for_line(r"waiting for the trainer to start")
    env.proc.send_signal(signal.SIGUSR1)
    assert env.exit_code(timeout_s=10) == 0, env.output
    assert env.lines[-1] == "envs-0: drained, 0 groups posted"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--group-size", "0"], "--group-size must be >= 1, got 0"),
        (["--latency-s", "-1"], "--latency-s must be > 0"),
        (["--groups-in-flight", "two"], "--groups-in-flight: invalid int value"),
        (["--max-batches-offpolicy", "0"], "--max-batches-offpolicy must be >= 1"),
    ],
)
def test_bad_flags_are_named(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        parse_args(["--api", "http://127.0.0.1:1", *argv])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_the_flags_deo_demo_uses() -> None:
    settings = parse_args(
        [
            *("--api", "http://h:8000/", "--group-size", "8", "--latency-s", "1.5"),
            *("--max-batches-offpolicy", "3", "--groups-in-flight", "2", "--seed", "5"),
        ]
    )
    assert settings.api_url == "http://h:8000"
    assert (settings.group_size, settings.latency_s, settings.seed) == (8, 1.5, 5)
    assert (settings.max_batches_offpolicy, settings.groups_in_flight) == (3, 2)


# --- serve_until_drained around BaseEnv 0.4.0's contract ---------------------------------------


@dataclass
class ContractConfig:
    """The BaseEnvConfig fields the rollout loop reads."""

    rollout_server_url: str
    group_size: int = GROUP
    max_num_workers: int = -1
    max_num_workers_per_node: int = 2
    batch_size: int = -1
    max_batches_offpolicy: int = 3
    total_steps: int = 1000


@dataclass
class ContractEnv:
    """BaseEnv 0.4.0's ``env_manager`` contract (atroposlib/envs/base.py, lines 1014-1262).

    Kept: registration (retried while the trainer has not started), ``get_status`` re-reading
    ``config.max_num_workers`` into ``max_num_workers`` every loop, the ``workers`` set of rollout
    tasks that remove themselves when done (not when cancelled), the set *replaced* when the queue
    is full, the cap at the queue's room, the end at ``total_steps``, a 0.1 s loop.
    """

    config: ContractConfig
    latency_s: float
    env_id: int | None = None  # set by registration
    workers: set[asyncio.Task[None]] = field(default_factory=set)
    max_num_workers: int = 2
    status_dict: dict[str, Any] = field(default_factory=dict)
    started: int = 0
    posted: int = 0
    cancelled: int = 0

    async def register_env(self) -> None:
        body = {"max_token_length": 2048, "desired_name": "contract", "weight": 1.0}
        async with httpx.AsyncClient(base_url=self.config.rollout_server_url) as client:
            while True:
                answer = await client.post("/register-env", json={**body, "group_size": GROUP})
                data = answer.json()
                if data["status"] == "success":
                    self.env_id = data["env_id"]
                    return
                await asyncio.sleep(0.1)

    async def get_status(self, client: httpx.AsyncClient) -> None:
        answer = await client.request("GET", "/status-env", json={"env_id": self.env_id})
        self.status_dict = answer.raise_for_status().json()
        max_num_workers = self.config.max_num_workers
        if max_num_workers == -1:
            max_num_workers = self.config.max_num_workers_per_node * 1
        self.max_num_workers = max_num_workers

    async def handle_env(self) -> None:
        try:
            await asyncio.sleep(self.latency_s)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        group = {
            "tokens": [[1, 2, 3]] * GROUP,
            "masks": [[-100, 2, 3]] * GROUP,
            "scores": [0.0, 1.0, 0.5, 0.25],
            "env_id": self.env_id,
        }
        async with httpx.AsyncClient(base_url=self.config.rollout_server_url) as client:
            (await client.post("/scored_data", json=group)).raise_for_status()
        self.posted += 1

    def add_train_workers(self) -> None:
        room = (
            self.config.max_batches_offpolicy * self.config.batch_size // self.config.group_size
            - self.status_dict["queue_size"]
        )
        while len(self.workers) < min(self.max_num_workers, room):
            worker = asyncio.create_task(self.handle_env())
            self.started += 1
            self.workers.add(worker)
            worker.add_done_callback(
                lambda fut: self.workers.discard(fut) if not fut.cancelled() else None
            )

    async def env_manager(self) -> None:
        await self.register_env()
        async with httpx.AsyncClient(base_url=self.config.rollout_server_url) as client:
            info = (await client.get("/info")).json()
            self.config.batch_size = info["batch_size"]
            while True:
                await self.get_status(client)
                queued_steps = self.status_dict["queue_size"] * GROUP // self.config.batch_size
                if self.status_dict["current_step"] + queued_steps > self.config.total_steps:
                    for worker in self.workers:
                        worker.cancel()
                    break
                full_seqs = self.config.max_batches_offpolicy * self.config.batch_size
                if self.status_dict["queue_size"] * GROUP >= full_seqs:
                    for worker in self.workers:
                        worker.cancel()
                    self.workers = set()
                elif len(self.workers) >= self.max_num_workers:
                    pass
                else:
                    self.add_train_workers()
                await asyncio.sleep(0.1)


def contract_env(api: AtroposApi, latency_s: float) -> ContractEnv:
    return ContractEnv(ContractConfig(rollout_server_url=api.url), latency_s=latency_s)


def test_serve_until_drained_finishes_rollouts_in_flight_then_disconnects(
    atropos_api: AtroposApi, tmp_path: Path
) -> None:
    atropos_api.register_trainer(batch_size_seqs=BATCH)
    other = register_env(atropos_api)
    env = contract_env(atropos_api, latency_s=0.6)
    heartbeat_file = tmp_path / "hb"

    async def scenario() -> tuple[int, int]:
        with Drain() as drain:
            serving = asyncio.ensure_future(
                serve_until_drained(env, drain=drain, heartbeat=Heartbeat(file=heartbeat_file))
            )
            while env.started < 4:  # the first two rollouts landed, two more are running
                await asyncio.sleep(0.02)
            assert weight_of(atropos_api, other) == pytest.approx(0.5)
            started_at_drain = env.started
            os.kill(os.getpid(), signal.SIGUSR1)
            abandoned = await asyncio.wait_for(serving, timeout=10)
            return started_at_drain, abandoned

    started_at_drain, abandoned = asyncio.run(scenario())
    assert abandoned == 0 and env.cancelled == 0
    assert started_at_drain == env.started == env.posted == 4  # nothing new, all in flight posted
    assert (env.config.max_num_workers, env.max_num_workers) == (0, 0)
    assert queue_groups(atropos_api) == 4
    assert weight_of(atropos_api, other) == pytest.approx(1.0)  # env 1 disconnected
    assert heartbeat_file.exists()


def test_serve_until_drained_cancels_stragglers_at_its_deadline(atropos_api: AtroposApi) -> None:
    atropos_api.register_trainer(batch_size_seqs=BATCH)
    env = contract_env(atropos_api, latency_s=60.0)

    async def scenario() -> int:
        with Drain() as drain:
            serving = asyncio.ensure_future(
                serve_until_drained(env, drain=drain, drain_timeout_s=0.3)
            )
            while env.started < 2:
                await asyncio.sleep(0.02)
            drain.request()
            return await asyncio.wait_for(serving, timeout=10)

    assert asyncio.run(scenario()) == 2
    assert env.cancelled == 2 and env.posted == 0


def test_serve_until_drained_returns_when_the_loop_ends_by_itself(atropos_api: AtroposApi) -> None:
    atropos_api.register_trainer(batch_size_seqs=BATCH)
    other = register_env(atropos_api)
    env = contract_env(atropos_api, latency_s=0.05)
    env.config.total_steps = 0  # one queued batch is past the end

    async def scenario() -> int:
        with Drain() as drain:
            return await asyncio.wait_for(serve_until_drained(env, drain=drain), timeout=10)

    assert asyncio.run(scenario()) == 0
    # The loop ends once the server holds a batch; count there: a group the server has taken may
    # still be on its way back to the env (then cancelled) when the loop sees the queue full.
    queued_groups = httpx.get(atropos_api.url + "/status").json()["queue_size"]
    assert queued_groups * GROUP >= BATCH
    assert weight_of(atropos_api, other) == pytest.approx(1.0)  # it disconnected on its way out


def test_a_crash_of_the_rollout_loop_propagates(atropos_api: AtroposApi) -> None:
    env = contract_env(atropos_api, latency_s=0.05)

    async def crash() -> None:
        raise RuntimeError("rollout loop broke")

    async def scenario() -> None:
        with Drain() as drain:
            await serve_until_drained(env, drain=drain, rollout_manager=crash)

    with pytest.raises(RuntimeError, match="rollout loop broke"):
        asyncio.run(scenario())


def test_drainable_keeps_the_class_and_drains_before_serving() -> None:
    before = signal.getsignal(signal.SIGUSR1)
    try:
        drainable_env = drainable(ContractEnv)
        assert issubclass(drainable_env, ContractEnv)
        assert drainable_env.__name__ == "ContractEnv"
        config = ContractConfig(rollout_server_url=f"http://127.0.0.1:{free_port()}")
        env = drainable_env(config, latency_s=0.1)
        os.kill(os.getpid(), signal.SIGUSR1)  # while "loading tokenizers": not lost
        asyncio.run(asyncio.wait_for(env.env_manager(), timeout=5))
        assert env.started == 0 and env.env_id is None  # never registered
    finally:
        signal.signal(signal.SIGUSR1, before)
