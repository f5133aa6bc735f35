"""adapters/api/app.py: a real uvicorn server around a real Runner, Reducer and EventLog."""

from __future__ import annotations

import contextlib
import logging
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import attrs
import httpx
import pytest
from api_serving import ManualClock, RecordingExecutor, serve_on_free_port
from prometheus_client.parser import text_string_to_metric_families

from adapters.api.app import MAX_WORKER_ID_CHARS, build_app, serve, worker_token
from adapters.api.client import pool_lines
from adapters.log import EventLog
from adapters.runtime.runner import Runner
from core import (
    Config,
    Configured,
    PolicySpec,
    PoolSpec,
    Reducer,
    SourceDown,
    Tick,
    WorkersSeen,
    WorkerStarted,
)
from deo_worker.ready import report_ready_async

TOKEN = "operator-secret"
WORKER_SECRET = "worker-secret"
MAX_BODY_BYTES = 1024
OPERATOR = {"Authorization": f"Bearer {TOKEN}"}
#: Worker envs-0's own token.
WORKER = {"Authorization": f"Bearer {worker_token(WORKER_SECRET, 'envs-0')}"}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@attrs.define
class Harness:
    client: httpx.AsyncClient
    runner: Runner
    clock: ManualClock
    executor: RecordingExecutor
    log_path: Path
    port: int

    def log_bytes(self) -> bytes:
        self.runner.log.flush()
        return self.log_path.read_bytes()


POOLS = [
    PoolSpec(
        name="envs",
        argv=["python", "env.py", "{index}"],
        min_workers=0,
        max_workers=4,
        gpus_per_worker=1,
        policy=PolicySpec(name="static", params={"count": 2}),
    ),
    PoolSpec(
        name="infer",
        argv=["python", "serve.py"],
        min_workers=1,
        max_workers=8,
        policy=PolicySpec(name="hpa", params={"target_per_worker": 4.0}),
    ),
    PoolSpec(
        name="rollouts",
        argv=["python", "rollout.py"],
        min_workers=1,
        max_workers=8,
        policy=PolicySpec(name="buffer"),
    ),
]


@asynccontextmanager
async def running(tmp_path: Path, **app_options: Any) -> AsyncIterator[Harness]:
    """Runner, configured with three pools and two GPUs, and the API on a free loopback port.

    Workers' reports are logged however close together, unless ``app_options`` say otherwise."""
    log_path = tmp_path / "deo.jsonl"
    log, _ = EventLog.open(log_path, fsync=False)
    clock = ManualClock()
    executor = RecordingExecutor()
    # No ticks during a test: every record in the log comes from something the test did.
    runner = Runner(log, Reducer(), executor, clock=clock, tick_interval_s=3600.0)
    options: dict[str, Any] = {"max_body_bytes": MAX_BODY_BYTES, "min_worker_interval_s": 0.0}
    app = build_app(runner, token=TOKEN, worker_secret=WORKER_SECRET, **{**options, **app_options})
    async with anyio.create_task_group() as tg:
        tg.start_soon(runner.run)
        await runner.submit(Configured(t=0.0, config=Config(pools=POOLS, gpus=["0", "1"])))
        # The default host: the loopback test below checks what that binds to.
        port = await serve_on_free_port(tg, app)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            yield Harness(client, runner, clock, executor, log_path, port)
        tg.cancel_scope.cancel()
    log.close()


async def start_worker(h: Harness, worker_id: str, pid: int) -> None:
    h.clock.t_s += 1.0
    await h.runner.submit(WorkerStarted(t=h.clock(), worker_id=worker_id, pid=pid, start_time=1))


# --- reads ---------------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_global_status_reports_pools_workers_gpus_and_alerts(tmp_path: Path) -> None:
    async with running(tmp_path) as h:
        await start_worker(h, "envs-0", 4242)
        for t in (1.5, 2.0):  # two failed reads in a row: the source is down
            await h.runner.submit(SourceDown(t=t, pool="rollouts", error="connection refused"))

        response = await h.client.get("/global-status")  # no token: reads are open

        assert response.status_code == 200
        status = response.json()
        envs = status["pools"]["envs"]
        assert (envs["target"], envs["desired"], envs["pinned"], envs["paused"]) == (
            2,
            2,
            None,
            False,
        )
        assert (envs["min_workers"], envs["max_workers"]) == (0, 4)
        assert envs["workers_by_state"]["active"] == 1
        assert envs["workers_by_state"]["requested"] == 1
        assert envs["worker_ids_by_state"]["active"] == ["envs-0"]
        assert envs["worker_ids_by_state"]["requested"] == ["envs-1"]
        assert envs["queue"] is None and envs["load"] is None
        assert (envs["failures"], envs["source_error"]) == (0, None)
        # The drain deadline a drain would get now, and why (the pool measures "auto" ones).
        deadline = envs["drain_deadline"]
        assert deadline["seconds"] > 0 and deadline["why"] and deadline["measured_drains"] == 0
        assert "drain deadline" in envs["summary"]
        types = [d["type"] for d in envs["decisions"]]
        assert types.count("ScalePool") == 1 and types.count("SpawnWorker") == 2
        assert all(d["reason"] and d["t"] == 0.0 for d in envs["decisions"])
        assert status["pools"]["rollouts"]["source_error"] == "connection refused"
        assert [g["id"] for g in status["gpus"]] == ["0", "1"]
        assert all(g["causes"] == [] and g["cordoned"] is False for g in status["gpus"])
        assert {"alert": "source_down", "subject": "rollouts"} in status["alerts"]
        assert any(d["type"] == "RaiseAlert" for d in status["pools"]["rollouts"]["decisions"])
        assert status["now"] == 2.0
        assert status["paused_all"] is False
        assert status["events_handled"] == h.runner.events_handled == 4


@pytest.mark.anyio
async def test_workers_lists_live_workers(tmp_path: Path) -> None:
    async with running(tmp_path) as h:
        await start_worker(h, "envs-0", 4242)

        response = await h.client.get("/v1/workers")

        assert response.status_code == 200
        workers = {w["id"]: w for w in response.json()["workers"]}
        assert set(workers) == {"envs-0", "envs-1", "infer-0", "rollouts-0"}
        started = workers["envs-0"]
        assert (started["pool"], started["state"], started["pid"]) == ("envs", "active", 4242)
        assert (started["started_t"], started["last_seen"]) == (1.0, 1.0)
        assert len(started["gpus"]) == 1
        waiting = workers["envs-1"]
        assert (waiting["state"], waiting["pid"], waiting["last_seen"]) == ("requested", None, None)
        assert waiting["gpus"] != started["gpus"]


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return found


@pytest.mark.anyio
async def test_metrics_are_prometheus_text_computed_from_state(tmp_path: Path) -> None:
    async with running(tmp_path) as h:
        await start_worker(h, "envs-0", 4242)
        for t in (1.5, 2.0):
            await h.runner.submit(SourceDown(t=t, pool="infer", error="timeout"))
        pushed = await h.client.post(
            "/v1/pools/rollouts/pressure",
            json={"queued_sequences": 96, "batch_size_seqs": 64, "trainer_step": 3},
            headers=OPERATOR,
        )
        assert pushed.status_code == 200
        cordoned = await h.client.post("/v1/gpus/1/cordon", headers=OPERATOR)
        assert cordoned.status_code == 200

        response = await h.client.get("/metrics")

        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/plain")
        found = samples(response.text)
        assert found[("deo_pool_workers", (("pool", "envs"), ("state", "active")))] == 1
        assert found[("deo_pool_workers", (("pool", "envs"), ("state", "requested")))] == 1
        assert found[("deo_pool_workers", (("pool", "envs"), ("state", "draining")))] == 0
        assert found[("deo_pool_target", (("pool", "envs"),))] == 2
        assert found[("deo_pool_target", (("pool", "infer"),))] == 1
        assert found[("deo_pool_queued_batches", (("pool", "rollouts"),))] == 1.5
        assert ("deo_pool_queued_batches", (("pool", "envs"),)) not in found
        assert found[("deo_gpu_cordoned", (("gpu", "0"),))] == 0
        assert found[("deo_gpu_cordoned", (("gpu", "1"),))] == 1
        assert found[("deo_alerts_active", (("alert", "source_down"), ("subject", "infer")))] == 1
        assert found[("deo_events_handled_total", ())] == h.runner.events_handled


# --- operator actions ----------------------------------------------------------------------------


def paused_all(runner: Runner) -> bool:
    return runner.state.paused_all


@pytest.mark.anyio
async def test_pause_and_resume_all_pools_and_one_pool(tmp_path: Path) -> None:
    async with running(tmp_path) as h:
        response = await h.client.post("/v1/pause", headers=OPERATOR)
        assert response.status_code == 200, response.text
        assert response.json() == {"commands": []}
        assert paused_all(h.runner) is True
        assert (await h.client.get("/global-status")).json()["paused_all"] is True

        response = await h.client.post("/v1/resume", headers=OPERATOR)
        assert response.status_code == 200
        assert paused_all(h.runner) is False

        response = await h.client.post("/v1/pause", json={"pool": "infer"}, headers=OPERATOR)
        assert response.status_code == 200
        assert h.runner.state.pools["infer"].paused is True
        assert h.runner.state.pools["envs"].paused is False
        status = (await h.client.get("/global-status")).json()
        assert status["pools"]["infer"]["paused"] is True

        response = await h.client.post("/v1/resume", json={"pool": "infer"}, headers=OPERATOR)
        assert response.status_code == 200
        assert h.runner.state.pools["infer"].paused is False


@pytest.mark.anyio
async def test_pin_and_unpin_change_the_target(tmp_path: Path) -> None:
    async with running(tmp_path) as h:
        response = await h.client.post("/v1/pools/envs/pin", json={"count": 1}, headers=OPERATOR)

        assert response.status_code == 200, response.text
        commands = response.json()["commands"]
        assert commands[0]["type"] == "ScalePool"
        assert "pinned envs at 1" in commands[0]["reason"]
        assert {"type", "reason"} == set(commands[0])
        envs = (await h.client.get("/global-status")).json()["pools"]["envs"]
        assert (envs["target"], envs["pinned"]) == (1, 1)

        response = await h.client.post("/v1/pools/envs/pin", json={"count": None}, headers=OPERATOR)
        assert response.status_code == 200
        assert h.runner.state.pools["envs"].pinned is None


@pytest.mark.anyio
async def test_pin_outside_the_bounds_is_a_conflict(tmp_path: Path) -> None:
    async with running(tmp_path) as h:
        response = await h.client.post("/v1/pools/envs/pin", json={"count": 9}, headers=OPERATOR)

        assert response.status_code == 409
        assert "outside pool 'envs' bounds [0, 4]" in response.json()["error"]
        assert h.runner.state.pools["envs"].target == 2


@pytest.mark.anyio
async def test_drain_a_worker(tmp_path: Path) -> None:
    async with running(tmp_path) as h:
        await start_worker(h, "envs-0", 4242)

        response = await h.client.post("/v1/workers/envs-0/drain", headers=OPERATOR)

        assert response.status_code == 200, response.text
        types = [c["type"] for c in response.json()["commands"]]
        assert "DrainWorker" in types
        assert h.runner.state.workers["envs-0"].state.value == "draining"
        assert any(type(c).__name__ == "DrainWorker" for c in h.executor.commands)


@pytest.mark.anyio
async def test_cordon_and_uncordon_a_gpu(tmp_path: Path) -> None:
    async with running(tmp_path) as h:
        response = await h.client.post("/v1/gpus/1/cordon", headers=OPERATOR)

        assert response.status_code == 200, response.text
        assert [c["type"] for c in response.json()["commands"]] == ["CordonGpu"]
        gpus = {g["id"]: g for g in (await h.client.get("/global-status")).json()["gpus"]}
        assert "operator" in gpus["1"]["causes"] and gpus["1"]["cordoned"] is True
        assert gpus["0"]["causes"] == []

        response = await h.client.post("/v1/gpus/1/uncordon", headers=OPERATOR)
        assert response.status_code == 200
        assert h.runner.state.gpus["1"].causes == frozenset()


@pytest.mark.anyio
async def test_load_pressure_push_drives_the_hpa_policy(tmp_path: Path) -> None:
    async with running(tmp_path) as h:
        h.clock.t_s = 5.0
        response = await h.client.post(
            "/v1/pools/infer/pressure", json={"in_flight_requests": 20}, headers=OPERATOR
        )

        assert response.status_code == 200, response.text
        assert "ScalePool" in [c["type"] for c in response.json()["commands"]]
        infer = (await h.client.get("/global-status")).json()["pools"]["infer"]
        assert infer["load"] == {"t": 5.0, "in_flight_requests": 20}
        assert infer["target"] == 5  # ceil(1 worker x 20 in flight / 4 per worker)
        scale = [d for d in infer["decisions"] if d["type"] == "ScalePool" and d["t"] == 5.0]
        assert len(scale) == 1


@pytest.mark.anyio
async def test_global_status_shows_a_removal_the_stabilization_window_holds(
    tmp_path: Path,
) -> None:
    hpa = {"target_per_worker": 4.0, "scale_down_stabilization_s": 0.0}
    judges = PoolSpec(
        name="judges",
        argv=["python", "judge.py"],
        min_workers=1,
        max_workers=8,
        stabilization_s=120.0,
        policy=PolicySpec(name="hpa", params=hpa),
    )
    async with running(tmp_path) as h:
        await h.runner.submit(
            Configured(t=1.0, config=Config(pools=[*POOLS, judges], gpus=["0", "1"]))
        )
        for t, in_flight in ((5.0, 20), (10.0, 0)):
            h.clock.t_s = t
            response = await h.client.post(
                "/v1/pools/judges/pressure",
                json={"in_flight_requests": in_flight},
                headers=OPERATOR,
            )
            assert response.status_code == 200, response.text

        status = (await h.client.get("/global-status")).json()
        shown = status["pools"]["judges"]

        assert shown["target"] == 5  # the scale-up at 5 s; the removal to 1 waits
        held = shown["held"]
        assert (held["target"], held["since_t"], held["until_t"]) == (1, 10.0, 125.0)
        assert "in flight" in held["reason"]  # the policy's own words
        assert "stabilization window holds a removal to 1 until 125.0s" in shown["summary"]
        # deo status prints it under the pool.
        lines = pool_lines("judges", shown, status["now"])
        assert any(
            line.strip().startswith("stabilization window holds a removal to 1 until t=125.0: ")
            for line in lines
        ), lines
        infer = (await h.client.get("/global-status")).json()["pools"]["infer"]
        assert infer["held"] is None
        # Once the window has ended the next sample applies the removal: nothing is shown held.
        await h.runner.submit(Tick(t=130.0))
        after = (await h.client.get("/global-status")).json()["pools"]["judges"]
        assert after["held"] is None and "stabilization window" not in after["summary"]


@pytest.mark.anyio
async def test_queue_pressure_push_reaches_the_buffer_policy(tmp_path: Path) -> None:
    async with running(tmp_path) as h:
        await start_worker(h, "rollouts-0", 5151)
        h.clock.t_s = 5.0
        response = await h.client.post(
            "/v1/pools/rollouts/pressure",
            json={"queued_sequences": 0, "batch_size_seqs": 64, "trainer_step": 0},
            headers=OPERATOR,
        )

        assert response.status_code == 200, response.text
        rollouts = (await h.client.get("/global-status")).json()["pools"]["rollouts"]
        assert rollouts["queue"] == {
            "t": 5.0,
            "queued_sequences": 0,
            "batch_size_seqs": 64,
            "trainer_step": 0,
            "queued_batches": 0.0,
        }
        assert rollouts["last_sample_t"] == 5.0
        # An empty queue, rates not measured yet: the buffer policy starts every worker it may.
        assert rollouts["target"] == rollouts["max_workers"] == 8
        assert "ScalePool" in [c["type"] for c in response.json()["commands"]]
        assert any(d["type"] == "ScalePool" and d["t"] == 5.0 for d in rollouts["decisions"])


# --- heartbeats and auth -------------------------------------------------------------------------


@pytest.mark.anyio
async def test_heartbeat_with_the_worker_token(tmp_path: Path) -> None:
    async with running(tmp_path) as h:
        await start_worker(h, "envs-0", 4242)
        h.clock.t_s = 7.5

        response = await h.client.post("/v1/workers/envs-0/heartbeat", headers=WORKER)

        assert response.status_code == 200, response.text
        assert response.json() == {"commands": []}
        # Its first sighting is recorded at the next tick (how long it took to come up)...
        interval_s = h.runner.tick_interval_s
        assert h.runner.liveness.records(h.runner.state, 7.5, interval_s) == [
            # Seen at 7.5 s, rounded up to the runner's hour-long tick: never past the record.
            WorkersSeen(t=7.5, worker_ids={"envs-0"}, seen_t=7.5)
        ]
        # ...later ones once the core needs them (a pool judging no heartbeat: once its record
        # is 30 s old).
        response = await h.client.post("/v1/workers/envs-0/heartbeat", headers=WORKER)
        assert response.status_code == 200, response.text
        assert h.runner.liveness.records(h.runner.state, 8.0, interval_s) == []
        assert h.runner.liveness.records(h.runner.state, 31.5, interval_s) == [
            WorkersSeen(t=31.5, worker_ids={"envs-0"}, seen_t=31.5)
        ]
        # The operator token is accepted as well.
        response = await h.client.post("/v1/workers/envs-0/heartbeat", headers=OPERATOR)
        assert response.status_code == 200


@pytest.mark.anyio
async def test_heartbeat_auth_and_unknown_workers(tmp_path: Path) -> None:
    async with running(tmp_path) as h:
        await start_worker(h, "envs-0", 4242)

        missing = await h.client.post("/v1/workers/envs-0/heartbeat")
        assert missing.status_code == 401
        assert "Authorization" in missing.json()["error"]
        assert missing.headers["www-authenticate"] == "Bearer"
        wrong = await h.client.post(
            "/v1/workers/envs-0/heartbeat", headers={"Authorization": "Bearer nope"}
        )
        assert wrong.status_code == 403
        assert "token" in wrong.json()["error"]

        # Worker envs-0's token speaks for envs-0 alone.
        for other in ("envs-1", "ghost"):
            response = await h.client.post(f"/v1/workers/{other}/heartbeat", headers=WORKER)
            assert response.status_code == 403, other
        before = h.log_bytes()
        for unknown in ("ghost", "envs-99"):
            response = await h.client.post(f"/v1/workers/{unknown}/heartbeat", headers=OPERATOR)
            assert response.status_code == 404
            assert f"unknown worker {unknown!r}" in response.json()["error"]
        # Refused before the log, and counted.
        assert h.log_bytes() == before
        assert refused_counts(await h.client.get("/metrics")) == {"token": 4, "unknown_worker": 2}


@pytest.mark.anyio
async def test_the_worker_token_cannot_act_as_operator(tmp_path: Path) -> None:
    async with running(tmp_path) as h:
        response = await h.client.post("/v1/pools/envs/pin", json={"count": 1}, headers=WORKER)

        assert response.status_code == 403
        assert h.runner.state.pools["envs"].target == 2


def test_tokens_must_be_set_and_distinct(tmp_path: Path) -> None:
    log, _ = EventLog.open(tmp_path / "deo.jsonl", fsync=False)
    with log:
        runner = Runner(log, Reducer(), RecordingExecutor(), clock=lambda: 0.0)
        with pytest.raises(ValueError, match="non-empty"):
            build_app(runner, token="", worker_secret="w")
        with pytest.raises(ValueError, match="differ"):
            build_app(runner, token="same", worker_secret="same")


def refused_counts(metrics: httpx.Response) -> dict[str, float]:
    """deo_api_requests_refused_total by reason, from a /metrics answer."""
    [family] = [
        f
        for f in text_string_to_metric_families(metrics.text)
        if f.name == "deo_api_requests_refused"
    ]
    return {s.labels["reason"]: s.value for s in family.samples if s.name.endswith("_total")}


@pytest.mark.anyio
async def test_worker_reports_for_long_or_unknown_ids_never_reach_the_log(tmp_path: Path) -> None:
    async with running(tmp_path) as h:
        await start_worker(h, "envs-0", 4242)
        before = h.log_bytes()
        long_id = "w" * 10_000
        for _ in range(50):
            for worker_id, headers in ((long_id, WORKER), ("envs-7", OPERATOR)):
                response = await h.client.post(
                    f"/v1/workers/{worker_id}/heartbeat", headers=headers
                )
                assert response.status_code == 404, response.text
        too_long = await h.client.post(f"/v1/workers/{long_id}/ready", headers=OPERATOR)
        assert f"at most {MAX_WORKER_ID_CHARS}" in too_long.json()["error"]
        assert len(too_long.content) < 500  # the id is not echoed back whole

        assert h.log_bytes() == before
        counts = refused_counts(await h.client.get("/metrics"))
        assert counts == {"worker_id": 51, "unknown_worker": 50}


@pytest.mark.anyio
async def test_heartbeats_are_sightings_never_logged_one_by_one(tmp_path: Path) -> None:
    async with running(tmp_path) as h:
        await start_worker(h, "envs-0", 4242)
        before = h.log_bytes()
        answers = [
            await h.client.post("/v1/workers/envs-0/heartbeat", headers=WORKER) for _ in range(40)
        ]

        assert [a.json() for a in answers] == [{"commands": []}] * 40
        assert h.runner.liveness.pending == {"envs-0"}  # for the next tick to record, once
        assert b"WorkerHeartbeat" not in h.log_bytes()[len(before) :]


def require_ready(h: Harness) -> Configured:
    """The harness's configuration again, with pool envs requiring readiness."""
    pools = [attrs.evolve(p, require_ready=True) if p.name == "envs" else p for p in POOLS]
    return Configured(t=0.5, config=attrs.evolve(h.runner.state.config, pools=pools))


@pytest.mark.anyio
async def test_repeated_ready_reports_are_logged_at_most_once_per_interval(
    tmp_path: Path,
) -> None:
    async with running(tmp_path, min_worker_interval_s=3600.0) as h:
        await h.runner.submit(require_ready(h))
        await start_worker(h, "envs-0", 4242)
        before = h.log_bytes()

        # All at once, while the worker is starting: the first is logged; the others arrive
        # while it is on its way (coalesced) or after it (the worker is active): sightings.
        answers: list[httpx.Response] = []

        async def report() -> None:
            answers.append(await h.client.post("/v1/workers/envs-0/ready", headers=WORKER))

        async with anyio.create_task_group() as tg:
            for _ in range(40):
                tg.start_soon(report)

        assert [a.status_code for a in answers] == [200] * 40
        assert h.runner.state.workers["envs-0"].state.value == "active"
        assert h.log_bytes()[len(before) :].count(b"WorkerReady") == 1
        coalesced = sum(a.json().get("coalesced", False) for a in answers)
        metrics = (await h.client.get("/metrics")).text
        assert f"deo_api_ready_reports_coalesced_total {coalesced:.1f}" in metrics
        assert h.runner.liveness.pending == {"envs-0"}  # every other report was a sighting


@pytest.mark.anyio
async def test_a_worker_reports_ready_and_becomes_active(tmp_path: Path) -> None:
    async with running(tmp_path, min_worker_interval_s=3600.0) as h:
        await h.runner.submit(require_ready(h))
        await start_worker(h, "envs-0", 4242)
        assert h.runner.state.workers["envs-0"].state.value == "starting"
        # A heartbeat first: readiness is still taken right after it.
        assert (await h.client.post("/v1/workers/envs-0/heartbeat", headers=WORKER)).is_success

        response = await h.client.post("/v1/workers/envs-0/ready", headers=WORKER)

        assert response.status_code == 200, response.text
        assert h.runner.state.workers["envs-0"].state.value == "active"
        assert h.log_bytes().count(b"WorkerReady") == 1
        # A tick late enough to record the heartbeat's sighting, which leaves none pending.
        late_t = h.clock() + 3600.0
        assert h.runner.liveness.records(h.runner.state, late_t, h.runner.tick_interval_s) != []
        assert h.runner.liveness.pending == frozenset()
        # Reported again by an active worker: a sighting for the next tick, never logged.
        again = await h.client.post("/v1/workers/envs-0/ready", headers=WORKER)
        assert again.json() == {"commands": []}
        assert h.log_bytes().count(b"WorkerReady") == 1
        assert h.runner.liveness.pending == {"envs-0"}
        wrong = await h.client.post("/v1/workers/envs-1/ready", headers=WORKER)
        assert wrong.status_code == 403


@pytest.mark.anyio
async def test_a_ready_report_before_the_start_is_handled_is_asked_again(tmp_path: Path) -> None:
    async with running(tmp_path) as h:
        await h.runner.submit(require_ready(h))
        assert h.runner.state.workers["envs-1"].state.value == "requested"
        before = h.log_bytes()
        envs_1 = {"Authorization": f"Bearer {worker_token(WORKER_SECRET, 'envs-1')}"}
        for attempt in range(3):  # every time, not only within an interval
            early = await h.client.post("/v1/workers/envs-1/ready", headers=envs_1)
            assert early.status_code == 429, (attempt, early.text)
            assert early.headers["retry-after"] == "1", attempt
            assert "envs-1" in early.json()["error"] and "not started" in early.json()["error"]
        assert h.log_bytes() == before  # nothing submitted, so nothing refused by the core
        assert refused_counts(await h.client.get("/metrics")) == {"state": 3}

        # The worker's own client retries a 429 until deo has handled its start.
        environ = {
            "DEO_API_URL": f"http://127.0.0.1:{h.port}",
            "DEO_WORKER_ID": "envs-1",
            "DEO_WORKER_TOKEN": worker_token(WORKER_SECRET, "envs-1"),
        }
        taken: list[bool] = []

        async def report() -> None:
            taken.append(await report_ready_async(environ, timeout_s=60.0))

        async with anyio.create_task_group() as tg:
            tg.start_soon(report)
            with anyio.fail_after(30):
                while refused_counts(await h.client.get("/metrics")) == {"state": 3}:
                    await anyio.sleep(0.05)  # until it was answered 429 at least once more
            await start_worker(h, "envs-1", 4343)
        assert taken == [True]
        assert h.runner.state.workers["envs-1"].state.value == "active"
        assert h.log_bytes()[len(before) :].count(b"WorkerReady") == 1
        assert b'"kind":"rejected"' not in h.log_bytes()[len(before) :]


@pytest.mark.anyio
async def test_reads_can_require_the_operator_token(tmp_path: Path) -> None:
    async with running(tmp_path, reads_need_token=True) as h:
        for url in ("/global-status", "/metrics", "/v1/workers"):
            assert (await h.client.get(url)).status_code == 401, url
            assert (await h.client.get(url, headers=WORKER)).status_code == 403, url
            assert (await h.client.get(url, headers=OPERATOR)).status_code == 200, url


# --- bad requests --------------------------------------------------------------------------------


async def chunked(total_bytes: int) -> AsyncIterator[bytes]:
    for _ in range(total_bytes // 256):
        yield b" " * 256


BAD_REQUESTS: list[tuple[str, str, dict[str, Any], int, str]] = [
    ("malformed JSON", "/v1/pools/envs/pin", {"content": b'{"count": 1'}, 400, "not valid JSON"),
    (
        "oversized by Content-Length",
        "/v1/pools/envs/pin",
        {"content": b'{"count": 1}'.ljust(MAX_BODY_BYTES + 1)},
        413,
        f"{MAX_BODY_BYTES}-byte limit",
    ),
    ("missing field", "/v1/pools/envs/pin", {"json": {}}, 422, "missing field 'count'"),
    ("wrong type", "/v1/pools/envs/pin", {"json": {"count": "1"}}, 422, "field 'count'"),
    ("bool count", "/v1/pools/envs/pin", {"json": {"count": True}}, 422, "field 'count'"),
    ("negative count", "/v1/pools/envs/pin", {"json": {"count": -1}}, 422, "count must be"),
    ("not an object", "/v1/pools/envs/pin", {"json": [1]}, 422, "JSON object"),
    ("unexpected field", "/v1/pools/envs/pin", {"json": {"cnt": 1}}, 422, "'cnt'"),
    (
        "negative load",
        "/v1/pools/infer/pressure",
        {"json": {"in_flight_requests": -1}},
        422,
        "in_flight_requests must be",
    ),
    (
        "zero batch",
        "/v1/pools/rollouts/pressure",
        {"json": {"queued_sequences": 0, "batch_size_seqs": 0, "trainer_step": 0}},
        422,
        "batch_size_seqs must be >= 1",
    ),
    (
        "incomplete queue sample",
        "/v1/pools/rollouts/pressure",
        {"json": {"queued_sequences": 5}},
        422,
        "missing field 'batch_size_seqs'",
    ),
    (
        "both pressure shapes",
        "/v1/pools/rollouts/pressure",
        {
            "json": {
                "queued_sequences": 0,
                "batch_size_seqs": 64,
                "trainer_step": 0,
                "in_flight_requests": 1,
            }
        },
        422,
        "not both",
    ),
    ("empty pressure", "/v1/pools/infer/pressure", {"json": {}}, 422, "in_flight_requests"),
    ("pool not a string", "/v1/pause", {"json": {"pool": 3}}, 422, "field 'pool'"),
    ("body on drain", "/v1/workers/envs-0/drain", {"json": {"now": True}}, 422, "'now'"),
    ("no token", "/v1/pools/envs/pin", {"json": {"count": 1}, "headers": {}}, 401, "Bearer"),
    (
        "wrong token",
        "/v1/pools/envs/pin",
        {"json": {"count": 1}, "headers": {"Authorization": "Bearer x"}},
        403,
        "token",
    ),
    (
        "not a bearer token",
        "/v1/gpus/0/cordon",
        {"headers": {"Authorization": f"Basic {TOKEN}"}},
        401,
        "Bearer",
    ),
]


@pytest.mark.anyio
async def test_bad_requests_are_refused_and_never_logged(tmp_path: Path) -> None:
    async with running(tmp_path) as h:
        await start_worker(h, "envs-0", 4242)
        state = h.runner.state
        before = h.log_bytes()

        for what, url, kwargs, status, message in BAD_REQUESTS:
            kwargs = {"headers": OPERATOR, **kwargs}
            response = await h.client.post(url, **kwargs)
            assert response.status_code == status, (what, response.text)
            assert message in response.json()["error"], (what, response.json())
            assert h.log_bytes() == before, what

        # A chunked body declares no length: its size is counted as it arrives.
        response = await h.client.post(
            "/v1/pools/envs/pin", content=chunked(4 * MAX_BODY_BYTES), headers=OPERATOR
        )
        assert response.status_code == 413
        assert response.request.headers["transfer-encoding"] == "chunked"
        assert "content-length" not in response.request.headers
        assert h.log_bytes() == before
        assert h.runner.state is state  # nothing reached the reducer either


@pytest.mark.anyio
async def test_unknown_subjects_are_404_and_logged_as_rejected(tmp_path: Path) -> None:
    async with running(tmp_path) as h:
        cases: list[tuple[str, dict[str, Any], str]] = [
            ("/v1/pools/nope/pin", {"json": {"count": 1}}, "unknown pool 'nope'"),
            ("/v1/pools/nope/pressure", {"json": {"in_flight_requests": 1}}, "unknown pool"),
            ("/v1/pause", {"json": {"pool": "nope"}}, "unknown pool 'nope'"),
            ("/v1/workers/ghost/drain", {}, "unknown worker 'ghost'"),
            ("/v1/gpus/7/cordon", {}, "unknown GPU '7'"),
        ]
        for url, kwargs, message in cases:
            before = h.log_bytes()
            response = await h.client.post(url, headers=OPERATOR, **kwargs)
            assert response.status_code == 404, (url, response.text)
            assert message in response.json()["error"]
            # A refusal by the reducer is a real input: the runner logs it as rejected.
            assert b'"kind":"rejected"' in h.log_bytes()[len(before) :]


# Every write endpoint, and what each kind of refusal answers: 404 for a subject the core does not
# know, 409 for one whose state refuses the request (logged as rejected, like the 404), 400/422
# for a body that never becomes an event (never logged).
# A worker's report for a worker deo does not have is refused before the log (see
# test_worker_reports_never_log_refusals).
REFUSALS: list[tuple[str, str, dict[str, Any], int, str]] = [
    ("heartbeat", "/v1/workers/ghost/heartbeat", {}, 404, "unknown worker 'ghost'"),
    ("ready", "/v1/workers/ghost/ready", {}, 404, "unknown worker 'ghost'"),
    ("ready", "/v1/workers/envs-0/ready", {"json": {"x": 1}}, 422, "unexpected field"),
    ("heartbeat", "/v1/workers/envs-0/heartbeat", {"json": {"x": 1}}, 422, "unexpected field"),
    ("heartbeat", "/v1/workers/envs-0/heartbeat", {"content": b"{"}, 400, "not valid JSON"),
    ("pause", "/v1/pause", {"json": {"pool": "nope"}}, 404, "unknown pool 'nope'"),
    ("pause", "/v1/pause", {"json": {"pool": 3}}, 422, "field 'pool'"),
    ("pause", "/v1/pause", {"content": b"[1,"}, 400, "not valid JSON"),
    ("resume", "/v1/resume", {"json": {"pool": "nope"}}, 404, "unknown pool 'nope'"),
    ("resume", "/v1/resume", {"json": {"pool": ["envs"]}}, 422, "field 'pool'"),
    ("resume", "/v1/resume", {"content": b"nope"}, 400, "not valid JSON"),
    ("pin", "/v1/pools/nope/pin", {"json": {"count": 1}}, 404, "unknown pool 'nope'"),
    ("pin", "/v1/pools/envs/pin", {"json": {"count": 5}}, 409, "outside pool 'envs' bounds"),
    ("pin", "/v1/pools/infer/pin", {"json": {"count": 0}}, 409, "outside pool 'infer' bounds"),
    ("pin", "/v1/pools/envs/pin", {"json": {"count": 1.0}}, 422, "field 'count'"),
    ("pin", "/v1/pools/envs/pin", {"content": b'{"count": 1' + b"0" * 25 + b"}"}, 422, "too large"),
    ("pin", "/v1/pools/envs/pin", {"content": b"{count: 1}"}, 400, "not valid JSON"),
    ("pressure", "/v1/pools/nope/pressure", {"json": {"in_flight_requests": 1}}, 404, "'nope'"),
    ("pressure", "/v1/pools/infer/pressure", {"json": {"load": 1}}, 422, "'load'"),
    ("pressure", "/v1/pools/infer/pressure", {"content": b"{"}, 400, "not valid JSON"),
    ("drain", "/v1/workers/ghost/drain", {}, 404, "unknown worker 'ghost'"),
    ("drain", "/v1/workers/envs-99/drain", {}, 404, "unknown worker 'envs-99'"),
    ("drain", "/v1/workers/envs-0/drain", {"json": {"now": True}}, 422, "'now'"),
    ("drain", "/v1/workers/envs-0/drain", {"content": b"{"}, 400, "not valid JSON"),
    ("drain", f"/v1/workers/{'w' * 300}/drain", {}, 404, "of 300 characters (ids have at most"),
    (
        "pin",
        f"/v1/pools/{'p' * 300}/pin",
        {"json": {"count": 1}},
        404,
        "characters (ids have at most",
    ),
    ("cordon", "/v1/gpus/7/cordon", {}, 404, "unknown GPU '7' (GPUs: 0, 1)"),
    ("cordon", "/v1/gpus/0/cordon", {"json": {"why": "x"}}, 422, "'why'"),
    ("cordon", "/v1/gpus/0/cordon", {"content": b"{"}, 400, "not valid JSON"),
    ("uncordon", "/v1/gpus/7/uncordon", {}, 404, "unknown GPU '7'"),
    ("uncordon", "/v1/gpus/0/uncordon", {"json": {"why": "x"}}, 422, "'why'"),
    ("uncordon", "/v1/gpus/0/uncordon", {"content": b"{"}, 400, "not valid JSON"),
]


@pytest.mark.anyio
async def test_each_write_answers_its_refusal_with_the_status_of_the_error_class(
    tmp_path: Path,
) -> None:
    async with running(tmp_path) as h:
        await start_worker(h, "envs-0", 4242)
        for index, (endpoint, url, kwargs, status, message) in enumerate(REFUSALS):
            state = h.runner.state
            before = h.log_bytes()
            response = await h.client.post(url, headers=OPERATOR, **kwargs)
            where = (index, endpoint, url, response.text)
            assert response.status_code == status, where
            assert response.headers["content-type"] == "application/json", where
            assert message in response.json()["error"], where
            written = h.log_bytes()[len(before) :]
            too_long = "characters (ids have at most" in message
            if status in (404, 409) and endpoint not in ("heartbeat", "ready") and not too_long:
                # The core refused a real input: logged with its refusal, the state unchanged.
                assert b'"kind":"rejected"' in written, where
                assert message.encode() in written, where
            else:
                # Nothing for bad requests, nor for heartbeats: a sighting is no record of its
                # own, and an unknown worker's is answered without one; nor for an id longer
                # than any deo makes.
                assert written == b"", where
            assert h.runner.state.pools == state.pools, where
            assert h.runner.state.workers == state.workers, where
            assert h.runner.state.gpus == state.gpus, where
        seen = {endpoint for endpoint, *_ in REFUSALS}
        assert seen == {
            "heartbeat",
            "ready",
            "pause",
            "resume",
            "pin",
            "pressure",
            "drain",
            "cordon",
            "uncordon",
        }


@pytest.mark.anyio
async def test_a_write_while_deo_stops_is_a_503_and_logs_nothing(tmp_path: Path) -> None:
    log_path = tmp_path / "deo.jsonl"
    log, _ = EventLog.open(log_path, fsync=False)
    runner = Runner(log, Reducer(), RecordingExecutor(), clock=ManualClock(), tick_interval_s=3600)
    app = build_app(runner, token=TOKEN, worker_secret=WORKER_SECRET)
    async with anyio.create_task_group() as tg:
        async with anyio.create_task_group() as loop:
            loop.start_soon(runner.run)
            await runner.submit(Configured(t=0.0, config=Config(pools=POOLS, gpus=["0"])))
            loop.cancel_scope.cancel()  # the runner stops; the server below still answers
        port = await serve_on_free_port(tg, app)
        log.flush()
        before = log_path.read_bytes()
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            response = await client.post("/v1/pools/envs/pin", json={"count": 1}, headers=OPERATOR)
        assert response.status_code == 503
        assert response.json() == {"error": "deo is stopping"}
        log.flush()
        assert log_path.read_bytes() == before
        tg.cancel_scope.cancel()
    log.close()


@pytest.mark.anyio
async def test_unknown_routes_and_methods_answer_json(tmp_path: Path) -> None:
    async with running(tmp_path) as h:
        missing = await h.client.get("/v1/nothing")
        assert missing.status_code == 404
        assert "/v1/nothing" in missing.json()["error"]
        wrong_method = await h.client.get("/v1/pause")
        assert wrong_method.status_code == 405
        assert "error" in wrong_method.json()


# --- serving -------------------------------------------------------------------------------------


def listening_addresses(port: int) -> list[str]:
    """Local addresses of the TCP sockets listening on ``port`` (Linux /proc/net/tcp{,6})."""
    found = []
    for table in (Path("/proc/net/tcp"), Path("/proc/net/tcp6")):
        if not table.exists():
            continue
        for line in table.read_text().splitlines()[1:]:
            fields = line.split()
            address, port_hex = fields[1].split(":")
            if int(port_hex, 16) == port and fields[3] == "0A":  # 0A: LISTEN
                found.append(address)
    return found


@pytest.mark.anyio
async def test_serves_on_loopback_by_default_and_stops_when_cancelled(tmp_path: Path) -> None:
    if not Path("/proc/net/tcp").exists():
        pytest.skip("reads the bound address from Linux's /proc/net/tcp")
    async with running(tmp_path) as h:
        # 127.0.0.1, little-endian hex, and nothing else listening on the port.
        assert listening_addresses(h.port) == ["0100007F"]
        port = h.port
    # The task group was cancelled: the server shut down and the port is free again.
    assert listening_addresses(port) == []
    with pytest.raises(OSError):
        await anyio.connect_tcp("127.0.0.1", port)


@asynccontextmanager
async def guarded(tmp_path: Path, **serve_options: Any) -> AsyncIterator[int]:
    """The API served with ``serve_options`` (a cap, a deadline) on a free port."""
    log, _ = EventLog.open(tmp_path / "deo.jsonl", fsync=False)
    runner = Runner(log, Reducer(), RecordingExecutor(), clock=ManualClock(), tick_interval_s=3600)
    app = build_app(runner, token=TOKEN, worker_secret=WORKER_SECRET)
    with log:
        async with anyio.create_task_group() as tg:
            tg.start_soon(runner.run)
            await runner.submit(Configured(t=0.0, config=Config(pools=POOLS, gpus=["0"])))
            yield await serve_on_free_port(tg, app, **serve_options)
            tg.cancel_scope.cancel()


async def closed_by_server(stream: anyio.abc.SocketStream) -> bool:
    """Wait (at most 30 s) for the server to close ``stream``; True if it did."""
    with anyio.move_on_after(30):
        try:
            while await stream.receive():
                pass
        except (anyio.EndOfStream, anyio.BrokenResourceError, ConnectionError):
            pass
        return True
    return False


def metric(text: str, name: str, **labels: str) -> float:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    raise AssertionError(f"no sample {name} {labels} in:\n{text}")


@pytest.mark.anyio
async def test_a_request_that_does_not_arrive_in_time_is_closed(tmp_path: Path) -> None:
    async with guarded(tmp_path, request_timeout_s=0.5) as port:
        slow = await anyio.connect_tcp("127.0.0.1", port)
        async with slow:
            await slow.send(b"POST /v1/pause HTTP/1.1\r\nHost: x\r\n")  # and no more
            assert await closed_by_server(slow)
        # A client that sends its request at once is answered, however many were cut.
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            metrics = (await client.get("/metrics")).text
        assert metric(metrics, "deo_api_connections_closed_total", reason="timed_out") == 1


@pytest.mark.anyio
async def test_a_body_that_does_not_arrive_in_time_is_cut_off_quietly(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async with guarded(tmp_path, request_timeout_s=0.5) as port:
        slow = await anyio.connect_tcp("127.0.0.1", port)
        head = f"POST /v1/pause HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
        with caplog.at_level(logging.WARNING):
            async with slow:
                await slow.send(f"{head}Content-Length: 100\r\n\r\n{{".encode())
                assert await closed_by_server(slow)
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
                status = (await client.get("/global-status")).json()
        assert status["paused_all"] is False  # half a request does nothing
        assert [r for r in caplog.records if r.levelno >= logging.ERROR] == []


@pytest.mark.anyio
async def test_at_the_cap_the_oldest_slow_connection_makes_room(tmp_path: Path) -> None:
    async with guarded(tmp_path, max_connections=8, request_timeout_s=600) as port:
        slow = [await anyio.connect_tcp("127.0.0.1", port) for _ in range(8)]
        for stream in slow:
            await stream.send(b"GET /global-status HTTP/1.1\r\n")
        async with contextlib.AsyncExitStack() as clients:
            # Each new client (keeping its connection) takes the place of the oldest slow one.
            for _ in range(4):
                client = await clients.enter_async_context(
                    httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}")
                )
                response = await client.get("/metrics")
                assert response.status_code == 200
            metrics = response.text
        assert metric(metrics, "deo_api_connection_cap") == 8
        assert metric(metrics, "deo_api_connections_closed_total", reason="evicted") == 4
        assert [await closed_by_server(s) for s in slow[:4]] == [True] * 4
        for stream in slow:
            await stream.aclose()


@pytest.mark.anyio
async def test_a_port_in_use_raises_oserror(tmp_path: Path) -> None:
    log, _ = EventLog.open(tmp_path / "deo.jsonl", fsync=False)
    runner = Runner(log, Reducer(), RecordingExecutor(), clock=lambda: 0.0)
    app = build_app(runner, token=TOKEN, worker_secret=WORKER_SECRET)
    # uvicorn would log this and call sys.exit; serve() binds itself and raises instead.
    with log, socket.create_server(("127.0.0.1", 0)) as taken, pytest.raises(OSError):
        await serve(app, port=taken.getsockname()[1])


# The server of the test below: every descriptor taken by something else in the process until
# the guard has failed to accept three times, then given back.
OUT_OF_DESCRIPTORS = """
import logging, os, resource, sys
import anyio
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from adapters.api.app import serve
from adapters.api.guard import GuardCounters

resource.setrlimit(resource.RLIMIT_NOFILE, (512, 512))
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
app = Starlette(routes=[Route("/", lambda request: PlainTextResponse("hello"))])
app.state.guard_counters = counters = GuardCounters()

async def main() -> None:
    async with anyio.create_task_group() as tg:
        listening = anyio.Event()
        def started(port: int) -> None:
            print(port, flush=True)
            listening.set()
        tg.start_soon(lambda: serve(app, port=0, max_connections=8, started=started))
        await listening.wait()
        hogs = []
        while True:
            try:
                hogs.append(os.open("/dev/null", os.O_RDONLY))
            except OSError:
                break
        print("exhausted", flush=True)
        while counters.accept_errors < 3:
            await anyio.sleep(0.05)
        for fd in hogs:
            os.close(fd)
        print("released", flush=True)
        await anyio.sleep(600)

anyio.run(main)
"""


def test_accepts_failing_for_want_of_descriptors_are_logged_once(tmp_path: Path) -> None:
    root = Path(__file__).resolve().parents[3]
    server = subprocess.Popen(
        [sys.executable, "-c", OUT_OF_DESCRIPTORS],
        cwd=root,
        stdout=subprocess.PIPE,
        stderr=(tmp_path / "server.err").open("wb"),
        text=True,
    )
    try:
        assert server.stdout is not None
        port = int(server.stdout.readline())
        assert server.stdout.readline().strip() == "exhausted"
        waiting = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(3)]
        assert server.stdout.readline().strip() == "released"
        response = httpx.get(f"http://127.0.0.1:{port}/", timeout=30)
        assert response.text == "hello"
        for s in waiting:
            s.close()
        errors = (tmp_path / "server.err").read_text()
        assert errors.count("cannot accept connections") == 1, errors
        assert errors.count("accepting connections again") == 1, errors
    finally:
        server.kill()
        server.wait()
