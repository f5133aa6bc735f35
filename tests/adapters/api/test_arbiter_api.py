"""The GPU arbiter on deo's API: a real uvicorn server around a real Runner, Reducer and EventLog;
the training loop's client (deo_worker.arbiter_client) against it; the log replayed."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import attrs
import httpx
import orjson
import pytest
from api_serving import ManualClock, RecordingExecutor, serve_on_free_port
from prometheus_client.parser import text_string_to_metric_families

from adapters.api import arbiter as arbiter_api
from adapters.api.app import build_app
from adapters.api.client import arbiter_lines
from adapters.log import EventLog, LogProblem
from adapters.postmortem.engine import replay
from adapters.runtime.arbiter import ArbiterBoard
from adapters.runtime.engines import FanOut
from adapters.runtime.runner import Runner
from core import (
    Config,
    Configured,
    EngineAsleep,
    EngineLoadSampled,
    GpuLost,
    PolicySpec,
    PoolSpec,
    Reducer,
    SpawnWorker,
    Tick,
    WorkerExited,
    WorkerReady,
    WorkerStarted,
)
from core.arbiter import ArbiterGpusDeclared
from core.arbiter import reducer as arbiter_reducer
from core.arbiter.plan import Plan, RankOp
from core.arbiter.planner import GapRatioPlanner
from deo_worker.arbiter_client import ArbiterClient, ArbiterError, ArbiterTimeout, Cluster

TOKEN = "operator-secret"
OPERATOR = {"Authorization": f"Bearer {TOKEN}"}
GPUS = ["0", "1", "2", "3"]


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
    url: str

    async def post(self, path: str, body: Any = None, **kwargs: Any) -> httpx.Response:
        return await self.client.post(path, json=body, headers=OPERATOR, **kwargs)

    async def status(self) -> dict[str, Any]:
        answer: dict[str, Any] = (await self.client.get("/global-status")).json()
        return answer


@asynccontextmanager
async def running(
    tmp_path: Path, pools: tuple[PoolSpec, ...] = (), *, declare: bool = True
) -> AsyncIterator[Harness]:
    log_path = tmp_path / "deo.jsonl"
    log, _ = EventLog.open(log_path, fsync=False)
    clock = ManualClock()
    executor = RecordingExecutor()
    board = ArbiterBoard(configured=True)
    reducer = Reducer(check_invariants=True)
    runner = Runner(
        log,
        reducer,
        FanOut(executor, board),
        clock=clock,
        tick_interval_s=3600.0,
        on_handled=board.handled,
    )
    app = build_app(runner, token=TOKEN, worker_secret="worker-secret", arbiter=board)
    async with anyio.create_task_group() as tg:
        tg.start_soon(runner.run)
        await runner.submit(Configured(t=0.0, config=Config(gpus=GPUS, pools=pools)))
        if declare:
            await runner.submit(ArbiterGpusDeclared(t=0.0, gpus=GPUS))
        url = f"http://127.0.0.1:{await serve_on_free_port(tg, app)}"
        async with httpx.AsyncClient(base_url=url, timeout=60.0) as client:
            yield Harness(client, runner, clock, executor, log_path, url)
        tg.cancel_scope.cancel()
    log.close()


def pipeline_body(name: str, train: list[str], gen: list[str]) -> dict[str, Any]:
    return {
        "pipeline": name,
        "clusters": [
            {"name": "train", "kind": "ACTOR_TRAINING", "device_mapping": train},
            {"name": "gen", "kind": "GENERATION", "device_mapping": gen, "tp_size": 1},
        ],
    }


def replayed_cleanly(path: Path) -> list[Any]:
    problems: list[LogProblem] = []
    steps = list(replay(path, problems=problems))
    assert problems == []
    assert all(step.matches for step in steps), [s.seq for s in steps if not s.matches]
    return steps


@pytest.mark.anyio
async def test_training_preempts_generation_and_the_log_replays(tmp_path: Path) -> None:
    async with running(tmp_path) as h:
        assert (
            await h.post("/v1/arbiter/pipelines", pipeline_body("p1", ["0", "1"], GPUS))
        ).is_success
        h.clock.t_s = 1.0
        await h.post("/v1/arbiter/pipelines/p1/rollout/open")
        gen = await h.post(
            "/v1/arbiter/pipelines/p1/clusters/gen/request", {"priority": "GENERATION"}
        )
        assert gen.status_code == 200, gen.text
        assert gen.json()["gpus"] == GPUS  # alone, it wakes every rank
        h.clock.t_s = 2.0
        await h.post(
            "/v1/arbiter/pipelines/p1/progress",
            {"stream": "rollout", "target_trajectories": 64, "completed_trajectories": 16},
        )

        status = (await h.status())["arbiter"]
        row = status["pipelines"]["p1"]["clusters"]["gen"]
        assert row["active_gpus"] == GPUS and row["share"]["remaining_trajectories"] == 48
        assert row["share"]["target_gpus"] == 4

        h.clock.t_s = 3.0
        train = await h.post(
            "/v1/arbiter/pipelines/p1/release-and-request",
            {"release_cluster": "gen", "cluster": "train", "priority": "ACTOR_TRAINING"},
        )
        assert train.status_code == 200, train.text
        assert train.json()["gpus"] == ["0", "1"]
        kinds = [type(c).__name__ for c in h.executor.commands]
        assert "ShrinkGeneration" in kinds and kinds.index("ShrinkGeneration") < len(kinds) - 1
        rows = (await h.status())["arbiter"]["pipelines"]["p1"]["clusters"]
        assert rows["train"]["held"] == ["0", "1"] and rows["gen"]["active_gpus"] == []

        metrics = (await h.client.get("/metrics")).text
        samples = {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(metrics)
            for s in family.samples
        }
        held = (
            "deo_arbiter_cluster_gpus",
            (("cluster", "train"), ("kind", "ACTOR_TRAINING"), ("pipeline", "p1")),
        )
        assert samples[held] == 2
        assert samples[("deo_arbiter_gpus", (("use", "idle"),))] == 2

        assert (await h.post("/v1/arbiter/pipelines/p1/clusters/train/release")).is_success
    steps = replayed_cleanly(h.log_path)
    produced = [type(c).__name__ for step in steps for c in step.produced]
    assert produced.count("GrantGpus") == 2 and "ExpandGeneration" in produced


@pytest.mark.anyio
async def test_a_long_poll_times_out_and_the_request_keeps_its_place(tmp_path: Path) -> None:
    async with running(tmp_path) as h:
        for name in ("a", "b", "c"):
            body = {
                "pipeline": name,
                "clusters": [{"name": "train", "kind": "ACTOR_TRAINING", "device_mapping": GPUS}],
            }
            assert (await h.post("/v1/arbiter/pipelines", body)).is_success
        first = await h.post(
            "/v1/arbiter/pipelines/a/clusters/train/request", {"priority": "ACTOR_TRAINING"}
        )
        assert first.status_code == 200
        h.clock.t_s = 1.0
        waiting = await h.post(
            "/v1/arbiter/pipelines/b/clusters/train/request",
            {"priority": "ACTOR_TRAINING", "timeout_s": 0.2},
        )
        assert waiting.status_code == 408
        assert "still waiting" in waiting.json()["error"]
        h.clock.t_s = 2.0
        behind = await h.post(
            "/v1/arbiter/pipelines/c/clusters/train/request",
            {"priority": "ACTOR_TRAINING", "timeout_s": 0.1},
        )
        assert behind.status_code == 408
        rows = (await h.status())["arbiter"]["pipelines"]
        assert rows["b"]["clusters"]["train"]["waiting"]["priority"] == "ACTOR_TRAINING"
        lines = arbiter_lines((await h.status())["arbiter"])  # deo status
        assert lines[0] == "arbiter: 4 GPUs, 0 idle"
        [b_row] = [line for line in lines if line.startswith("b ")]
        assert "ACTOR_TRAINING" in b_row and "waiting" not in b_row
        assert b_row.endswith("ACTOR_TRAINING for 1s")  # queued at t=1, the state's clock at 2

        async with anyio.create_task_group() as tg:
            answers: dict[str, httpx.Response] = {}

            async def poll(name: str) -> None:
                answers[name] = await h.post(
                    f"/v1/arbiter/pipelines/{name}/clusters/train/request",
                    {"priority": "ACTOR_TRAINING", "timeout_s": 60},
                )

            tg.start_soon(poll, "b")
            tg.start_soon(poll, "c")
            await anyio.sleep(0)
            await h.post("/v1/arbiter/pipelines/a/clusters/train/release")
            with anyio.fail_after(30):
                while "b" not in answers:
                    await anyio.sleep(0.05)
            assert answers["b"].status_code == 200  # b asked first: its place was kept
            assert "c" not in answers
            await h.post("/v1/arbiter/pipelines/b/clusters/train/release")
        assert answers["c"].status_code == 200
        # Asking again once granted answers with what the cluster holds, and queues nothing.
        again = await h.post(
            "/v1/arbiter/pipelines/c/clusters/train/request", {"priority": "ACTOR_TRAINING"}
        )
        assert again.status_code == 200 and again.json()["gpus"] == GPUS
    replayed_cleanly(h.log_path)


@pytest.mark.anyio
async def test_bad_input_is_refused_and_nothing_is_half_applied(tmp_path: Path) -> None:
    async with running(tmp_path) as h:
        url = "/v1/arbiter/pipelines"
        no_token = await h.client.post(url, json=pipeline_body("p", ["0"], ["1"]))
        assert no_token.status_code == 401
        malformed = await h.client.post(url, content=b"{not json", headers=OPERATOR)
        assert malformed.status_code == 400 and "not valid JSON" in malformed.json()["error"]
        outside = await h.post(url, pipeline_body("p", ["0"], ["1", "9"]))
        assert outside.status_code == 404 and "'9'" in outside.json()["error"]
        kind = await h.post(
            url,
            {
                "pipeline": "p",
                "clusters": [{"name": "x", "kind": "TRAINING", "device_mapping": ["0"]}],
            },
        )
        assert kind.status_code == 422 and "ACTOR_TRAINING" in kind.json()["error"]
        twice = await h.post(
            url,
            {
                "pipeline": "p",
                "clusters": [
                    {"name": "g1", "kind": "GENERATION", "device_mapping": ["0"]},
                    {"name": "g2", "kind": "GENERATION", "device_mapping": ["1"]},
                ],
            },
        )
        assert twice.status_code == 409
        assert (await h.status())["arbiter"]["pipelines"] == {}  # none of p was registered

        unknown = await h.post(
            "/v1/arbiter/pipelines/nope/clusters/train/request", {"priority": "ACTOR_TRAINING"}
        )
        assert unknown.status_code == 404 and "'nope'" in unknown.json()["error"]
        assert (await h.post(url, pipeline_body("p", ["0"], ["1", "2"]))).is_success
        bad_priority = await h.post(
            "/v1/arbiter/pipelines/p/clusters/train/request", {"priority": "URGENT"}
        )
        assert bad_priority.status_code == 422 and "GENERATION" in bad_priority.json()["error"]
        mismatch = await h.post(
            "/v1/arbiter/pipelines/p/clusters/train/request", {"priority": "GENERATION"}
        )
        assert mismatch.status_code == 409
        timeout = await h.post(
            "/v1/arbiter/pipelines/p/clusters/train/request",
            {"priority": "ACTOR_TRAINING", "timeout_s": -1},
        )
        assert timeout.status_code == 422 and "timeout_s" in timeout.json()["error"]
        progress = await h.post(
            "/v1/arbiter/pipelines/p/progress", {"stream": "s", "target_trajectories": "many"}
        )
        assert progress.status_code == 422
        # Requests refused before they became events left no trace in the log.
        records = [orjson.loads(line) for line in h.log_path.read_bytes().splitlines()[1:]]
        events = [r["event"]["@"] for r in records if r["kind"] == "event"]
        assert events.count("GpusRequested") == 2  # the unknown pipeline's and the mismatch
        assert "ProgressReported" not in events


@pytest.mark.anyio
async def test_a_request_whose_gpus_are_lost_fails_clearly(tmp_path: Path) -> None:
    async with running(tmp_path) as h:
        for name in ("a", "b"):
            body = {
                "pipeline": name,
                "clusters": [{"name": "train", "kind": "ACTOR_TRAINING", "device_mapping": ["0"]}],
            }
            await h.post("/v1/arbiter/pipelines", body)
        await h.post("/v1/arbiter/pipelines/a/clusters/train/request", {"priority": 1})
        async with anyio.create_task_group() as tg:
            answer: list[httpx.Response] = []

            async def poll() -> None:
                answer.append(
                    await h.post(
                        "/v1/arbiter/pipelines/b/clusters/train/request",
                        {"priority": 1, "timeout_s": 60},
                    )
                )

            tg.start_soon(poll)
            with anyio.fail_after(30):
                while (
                    "waiting"
                    not in (await h.status())["arbiter"]["pipelines"]["b"]["clusters"]["train"]
                ):
                    await anyio.sleep(0.05)
            await h.runner.submit(GpuLost(t=1.0, gpu_id="0", error="fell off the bus"))
        assert answer[0].status_code == 409
        assert "lost" in answer[0].json()["error"]


@pytest.mark.anyio
async def test_the_client_waits_through_long_polls(tmp_path: Path) -> None:
    async with running(tmp_path) as h:

        def trainer(name: str, train: list[str]) -> ArbiterClient:
            client = ArbiterClient(h.url, TOKEN, pipeline=name, poll_s=0.3)
            client.register(
                [Cluster("train", "ACTOR_TRAINING", train), Cluster("gen", "GENERATION", GPUS)]
            )
            return client

        a = await anyio.to_thread.run_sync(trainer, "a", ["0", "1"])
        b = await anyio.to_thread.run_sync(trainer, "b", ["0", "1"])
        grant = await anyio.to_thread.run_sync(lambda: a.request("train", "ACTOR_TRAINING"))
        assert grant.gpus == ("0", "1")
        with pytest.raises(ArbiterTimeout):
            await anyio.to_thread.run_sync(
                lambda: b.request("train", "ACTOR_TRAINING", deadline_s=0.5)
            )
        async with anyio.create_task_group() as tg:
            got: list[Any] = []

            def wait_for_b() -> None:
                got.append(b.request("train", "ACTOR_TRAINING", deadline_s=60))

            tg.start_soon(anyio.to_thread.run_sync, wait_for_b)
            await anyio.to_thread.run_sync(lambda: a.release("train"))
        assert got[0].gpus == ("0", "1")  # several 408s later, through the same queued request
        with pytest.raises(ArbiterError) as refused:
            await anyio.to_thread.run_sync(lambda: a.request("gen", "ACTOR_TRAINING"))
        assert refused.value.status == 409
        gen = await anyio.to_thread.run_sync(lambda: a.request("gen", "GENERATION"))
        assert set(gen.gpus) == {"2", "3"}  # b trains on 0 and 1
        a.close()
        b.close()


@attrs.frozen(slots=True)
class _WakingPlanner(GapRatioPlanner):
    """Wakes every rank of every generation cluster (only those with a request, if
    ``requested_only``), whatever holds its GPUs: a plan that breaks invariant 10."""

    requested_only: bool = attrs.field(kw_only=True)

    def plan(self, state: Any) -> Plan:
        plan = super().plan(state)
        wakes = [
            RankOp(pipeline=p, cluster=c.spec.name, ranks=tuple(range(c.spec.ranks)), reason="x")
            for p, c in state.clusters()
            if c.spec.is_generation and (c.request is not None or not self.requested_only)
        ]
        return attrs.evolve(plan, expands=tuple(wakes)) if wakes else plan


@pytest.mark.anyio
async def test_a_refused_plan_executes_nothing_and_raises_the_alert(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with running(tmp_path) as h:
        await h.post("/v1/arbiter/pipelines", pipeline_body("p", ["0", "1"], GPUS))
        await h.post("/v1/arbiter/pipelines/p/clusters/train/request", {"priority": 1})
        monkeypatch.setattr(
            arbiter_reducer, "planner_for", lambda settings: _WakingPlanner(requested_only=True)
        )
        before = list(h.executor.commands)
        answer = await h.post(
            "/v1/arbiter/pipelines/p/clusters/gen/request",
            {"priority": "GENERATION", "timeout_s": 0.2},
        )
        assert answer.status_code == 409  # the plan did not run: nothing woke
        assert "plan after GpusRequested refused" in answer.json()["error"]
        new = h.executor.commands[len(before) :]
        assert [type(c).__name__ for c in new] == ["RaiseAlert"]
        assert "owned twice" in new[0].reason or "GPU" in new[0].reason
        status = await h.status()
        assert {"alert": "plan_refused", "subject": "arbiter"} in status["alerts"]
        assert status["arbiter"]["pipelines"]["p"]["clusters"]["gen"]["active_gpus"] == []
        metrics = (await h.client.get("/metrics")).text
        assert 'deo_alerts_active{alert="plan_refused",subject="arbiter"} 1.0' in metrics

        monkeypatch.undo()
        again = await h.post(
            "/v1/arbiter/pipelines/p/clusters/gen/request", {"priority": "GENERATION"}
        )
        assert again.status_code == 200 and again.json()["gpus"] == ["2", "3"]
        status = await h.status()
        assert {"alert": "plan_refused", "subject": "arbiter"} not in status["alerts"]
    records = [orjson.loads(line) for line in h.log_path.read_bytes().splitlines()[1:]]
    logged = [c for r in records if r["kind"] == "commands" for c in r["commands"]]
    assert any(c["@"] == "RaiseAlert" and c["alert"] == "plan_refused" for c in logged)


ENGINES = PoolSpec(
    name="gen",
    kind="engine",
    engine="vllm",
    argv=["serve", "--port", "{port}"],
    ports=(18000, 18003),
    gpus_per_worker=1,
    max_workers=4,
    max_asleep=4,
    policy=PolicySpec(name="static", params={"count": 0}),
)


@pytest.mark.anyio
async def test_answers_wait_for_the_engines_to_confirm(tmp_path: Path) -> None:
    async with running(tmp_path, pools=(ENGINES,)) as h:
        body = pipeline_body("p", ["0", "1"], GPUS)
        body["clusters"][1]["engine_pool"] = "gen"
        assert (await h.post("/v1/arbiter/pipelines", body)).is_success
        waiting = await h.post(
            "/v1/arbiter/pipelines/p/clusters/gen/request",
            {"priority": "GENERATION", "timeout_s": 0.3},
        )
        assert waiting.status_code == 408  # ranks awake in the plan, no engine up yet
        for index in range(4):
            worker_id = f"gen-{index}"
            await h.runner.submit(
                WorkerStarted(t=1.0, worker_id=worker_id, pid=1000 + index, start_time=1)
            )
            await h.runner.submit(WorkerReady(t=1.0, worker_id=worker_id))
        answered = await h.post(
            "/v1/arbiter/pipelines/p/clusters/gen/request", {"priority": "GENERATION"}
        )
        assert answered.status_code == 200 and answered.json()["gpus"] == GPUS
        row = (await h.status())["arbiter"]["pipelines"]["p"]["clusters"]["gen"]
        assert row["engines"]["0"] == {"worker": "gen-0", "state": "active"}
        lines = arbiter_lines((await h.status())["arbiter"])
        assert "engines (gen): rank 0 gen-0 active, rank 1 gen-1 active" in lines[-1]

        early = await h.post(
            "/v1/arbiter/pipelines/p/release-and-request",
            {
                "release_cluster": "gen",
                "cluster": "train",
                "priority": "ACTOR_TRAINING",
                "timeout_s": 0.3,
            },
        )
        assert early.status_code == 408  # granted in the plan; the engines still hold memory
        for index in range(4):
            worker_id = f"gen-{index}"
            await h.runner.submit(
                EngineLoadSampled(t=2.0, pool="gen", worker_id=worker_id, in_flight_requests=0)
            )
        still = await h.post(
            "/v1/arbiter/pipelines/p/clusters/train/request",
            {"priority": "ACTOR_TRAINING", "timeout_s": 0.3},
        )
        assert still.status_code == 408  # sleep calls sent, not confirmed
        for index in (0, 1):
            await h.runner.submit(EngineAsleep(t=3.0, worker_id=f"gen-{index}"))
        granted = await h.post(
            "/v1/arbiter/pipelines/p/clusters/train/request", {"priority": "ACTOR_TRAINING"}
        )
        assert granted.status_code == 200 and granted.json()["gpus"] == ["0", "1"]


@pytest.mark.anyio
async def test_writes_before_the_gpus_are_declared_are_answered_503(tmp_path: Path) -> None:
    async with running(tmp_path, declare=False) as h:
        early = await h.post("/v1/arbiter/pipelines", pipeline_body("p", ["0"], GPUS))
        assert early.status_code == 503 and "starting" in early.json()["error"]
        await h.runner.submit(ArbiterGpusDeclared(t=0.0, gpus=GPUS))
        assert (await h.post("/v1/arbiter/pipelines", pipeline_body("p", ["0"], GPUS))).is_success


@pytest.mark.anyio
async def test_a_release_whose_plan_is_refused_is_answered_409_and_keeps_the_gpus(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with running(tmp_path) as h:
        url = "/v1/arbiter/pipelines"
        await h.post(url, pipeline_body("p", ["0", "1"], GPUS))
        train = {"name": "train", "kind": "ACTOR_TRAINING", "device_mapping": ["2", "3"]}
        await h.post(url, {"pipeline": "q", "clusters": [train]})
        for pipeline in ("p", "q"):
            held = await h.post(f"{url}/{pipeline}/clusters/train/request", {"priority": 1})
            assert held.status_code == 200
        monkeypatch.setattr(
            arbiter_reducer, "planner_for", lambda settings: _WakingPlanner(requested_only=False)
        )
        release = await h.post(f"{url}/q/clusters/train/release")
        assert release.status_code == 409, release.text
        assert "q/train: nothing was done" in release.json()["error"]
        client = ArbiterClient(h.url, TOKEN, pipeline="q")
        with pytest.raises(ArbiterError) as refused:
            await anyio.to_thread.run_sync(lambda: client.release("train"))
        assert refused.value.status == 409
        client.close()
        status = await h.status()
        assert status["arbiter"]["pipelines"]["q"]["clusters"]["train"]["held"] == ["2", "3"]


async def engines_up(h: Harness, *worker_ids: str) -> None:
    for worker_id in worker_ids:
        index = int(worker_id.rsplit("-", 1)[1])
        await h.runner.submit(
            WorkerStarted(t=h.clock(), worker_id=worker_id, pid=1000 + index, start_time=1)
        )
        await h.runner.submit(WorkerReady(t=h.clock(), worker_id=worker_id))


@pytest.mark.anyio
async def test_gpus_of_an_unregistered_pipeline_are_answered_once_its_engines_are_gone(
    tmp_path: Path,
) -> None:
    async with running(tmp_path, pools=(ENGINES,)) as h:
        url = "/v1/arbiter/pipelines"
        gen = {"name": "gen", "kind": "GENERATION", "device_mapping": ["0", "1"]}
        await h.post(url, {"pipeline": "p", "clusters": [{**gen, "engine_pool": "gen"}]})
        await h.post(f"{url}/p/clusters/gen/request", {"priority": 6, "timeout_s": 0})
        await engines_up(h, "gen-0", "gen-1")
        assert (await h.post(f"{url}/p/unregister")).status_code == 200
        train = {"name": "train", "kind": "ACTOR_TRAINING", "device_mapping": ["0", "1"]}
        await h.post(url, {"pipeline": "q", "clusters": [train]})
        early = await h.post(f"{url}/q/clusters/train/request", {"priority": 1, "timeout_s": 0.3})
        assert early.status_code == 408  # gen-0 and gen-1 are stopping, still on 0 and 1
        for worker_id in ("gen-0", "gen-1"):
            await h.runner.submit(WorkerExited(t=h.clock(), worker_id=worker_id, exit_code=0))
        granted = await h.post(f"{url}/q/clusters/train/request", {"priority": 1})
        assert granted.status_code == 200 and granted.json()["gpus"] == ["0", "1"]


@pytest.mark.anyio
async def test_a_generation_grant_waits_for_another_pipelines_engine_to_sleep(
    tmp_path: Path,
) -> None:
    async with running(tmp_path, pools=(ENGINES,)) as h:
        url = "/v1/arbiter/pipelines"
        gen = {"name": "gen", "kind": "GENERATION", "device_mapping": ["0", "1"]}
        await h.post(url, {"pipeline": "a", "clusters": [{**gen, "engine_pool": "gen"}]})
        await h.post(url, {"pipeline": "b", "clusters": [gen]})
        progress = {"stream": "s", "target_trajectories": 100, "completed_trajectories": 0}
        await h.post(f"{url}/a/rollout/open")
        await h.post(f"{url}/a/progress", progress)
        await h.post(f"{url}/a/clusters/gen/request", {"priority": 6, "timeout_s": 0})
        await engines_up(h, "gen-0", "gen-1")
        await h.post(f"{url}/b/progress", progress)
        answers: list[httpx.Response] = []

        async def ask_for_generation() -> None:
            await h.post(f"{url}/b/rollout/open")
            answers.append(await h.post(f"{url}/b/clusters/gen/request", {"priority": 6}))

        async with anyio.create_task_group() as tg:
            tg.start_soon(ask_for_generation)
            with anyio.fail_after(30):
                while not (moved := await active_gpus(h, "b")):
                    await anyio.sleep(0.05)
            # The planner gave b a GPU of a's: the engine there goes to sleep first.
            (engine,) = [f"gen-{gpu}" for gpu in moved]
            await h.runner.submit(
                EngineLoadSampled(t=h.clock(), pool="gen", worker_id=engine, in_flight_requests=0)
            )
            assert await active_gpus(h, "b") == moved
            assert answers == []  # the sleep call is sent, not confirmed
            await h.runner.submit(EngineAsleep(t=h.clock(), worker_id=engine))
        assert answers[0].status_code == 200 and answers[0].json()["gpus"] == moved


async def active_gpus(h: Harness, pipeline: str) -> list[str]:
    gpus: list[str] = (await h.status())["arbiter"]["pipelines"][pipeline]["clusters"]["gen"][
        "active_gpus"
    ]
    return gpus


@pytest.mark.anyio
async def test_generation_preempted_before_its_engines_woke_keeps_waiting(
    tmp_path: Path,
) -> None:
    async with running(tmp_path, pools=(ENGINES,)) as h:
        url = "/v1/arbiter/pipelines"
        gen = {"name": "gen", "kind": "GENERATION", "device_mapping": GPUS, "engine_pool": "gen"}
        await h.post(url, {"pipeline": "p", "clusters": [gen]})
        train = {"name": "train", "kind": "ACTOR_TRAINING", "device_mapping": GPUS}
        await h.post(url, {"pipeline": "q", "clusters": [train]})
        await h.post(f"{url}/p/rollout/open")
        answers: dict[str, httpx.Response] = {}

        async def ask_for_generation() -> None:
            answers["gen"] = await h.post(
                f"{url}/p/clusters/gen/request", {"priority": 6, "timeout_s": 2}
            )

        async with anyio.create_task_group() as tg:
            tg.start_soon(ask_for_generation)
            with anyio.fail_after(30):
                while not (await h.status())["arbiter"]["pipelines"]["p"]["clusters"]["gen"][
                    "active_ranks"
                ]:
                    await anyio.sleep(0.05)
            answers["train"] = await h.post(
                f"{url}/q/clusters/train/request", {"priority": 1, "timeout_s": 0}
            )
        assert answers["gen"].status_code == 408, answers["gen"].text  # not 409: still wanted
        assert "still waiting" in answers["gen"].json()["error"]
        closed = await h.post(f"{url}/p/rollout/close")
        assert closed.status_code == 200


@pytest.mark.anyio
async def test_a_crash_looping_engine_is_named_in_the_408(tmp_path: Path) -> None:
    async with running(tmp_path, pools=(ENGINES,)) as h:
        url = "/v1/arbiter/pipelines"
        gen = {"name": "gen", "kind": "GENERATION", "device_mapping": ["0"], "engine_pool": "gen"}
        await h.post(url, {"pipeline": "p", "clusters": [gen]})
        await h.post(f"{url}/p/clusters/gen/request", {"priority": 6, "timeout_s": 0})
        engine = "gen-0"
        for failures in range(3):
            await h.runner.submit(
                WorkerStarted(t=h.clock(), worker_id=engine, pid=2000 + failures, start_time=1)
            )
            await h.runner.submit(WorkerExited(t=h.clock(), worker_id=engine, exit_code=1))
            h.clock.t_s += 600.0  # past any backoff: the next tick starts its replacement
            commands = await h.runner.submit(Tick(t=h.clock(), interval_s=600.0))
            (spawn,) = [c for c in commands if isinstance(c, SpawnWorker)]
            engine = spawn.worker_id
        waiting = await h.post(f"{url}/p/clusters/gen/request", {"priority": 6, "timeout_s": 0})
        assert waiting.status_code == 408
        assert "engine pool 'gen' is in a crash loop (3 failures" in waiting.json()["error"]


@pytest.mark.anyio
async def test_names_that_no_path_could_address_and_bad_kinds_are_refused_by_field(
    tmp_path: Path,
) -> None:
    async with running(tmp_path) as h:
        url = "/v1/arbiter/pipelines"
        for pipeline in ("p/x", "p" * 65, "a b"):
            answer = await h.post(url, {"pipeline": pipeline, "clusters": []})
            assert answer.status_code == 422, pipeline
            assert "PipelineRegistered.pipeline must be 1-64 of" in answer.json()["error"]
        cluster = {"name": "g/1", "kind": "GENERATION", "device_mapping": ["0"]}
        bad_name = await h.post(url, {"pipeline": "p", "clusters": [cluster]})
        assert bad_name.status_code == 422
        assert bad_name.json()["error"].startswith("clusters[0]: ClusterSpec.name must be")
        bad_kind = await h.post(
            url, {"pipeline": "p", "clusters": [{**cluster, "name": "g", "kind": "NOPE"}]}
        )
        assert bad_kind.status_code == 422
        assert bad_kind.json()["error"].startswith("clusters[0]: field 'kind' must be one of")
        assert (await h.status())["arbiter"]["pipelines"] == {}


class _HalfPlanner(GapRatioPlanner):
    """Targets half of what deo's planner would: status must show its targets, not deo's."""

    def shares(self, state: Any) -> Any:
        return {
            key: attrs.evolve(share, target_gpus=share.target_gpus // 2)
            for key, share in super().shares(state).items()
        }


@pytest.mark.anyio
async def test_status_shows_the_targets_of_the_planner_that_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with running(tmp_path) as h:
        await h.post("/v1/arbiter/pipelines", pipeline_body("p", ["0", "1"], GPUS))
        await h.post("/v1/arbiter/pipelines/p/rollout/open")
        row = (await h.status())["arbiter"]["pipelines"]["p"]["clusters"]["gen"]
        assert row["share"]["target_gpus"] == 4
        monkeypatch.setattr(arbiter_reducer, "planner_for", lambda settings: _HalfPlanner())
        row = (await h.status())["arbiter"]["pipelines"]["p"]["clusters"]["gen"]
        assert row["share"]["target_gpus"] == 2


async def _read_message(stream: Any, buffer: bytearray) -> bytes | None:
    """One HTTP/1.1 message (head and a Content-Length body) from ``stream``; None at EOF."""
    while b"\r\n\r\n" not in buffer:
        try:
            chunk = await stream.receive()
        except (anyio.EndOfStream, anyio.BrokenResourceError):
            return None
        buffer.extend(chunk)
    head_end = buffer.index(b"\r\n\r\n") + 4
    length = 0
    for line in bytes(buffer[:head_end]).split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value.strip())
    while len(buffer) < head_end + length:
        buffer.extend(await stream.receive())
    message = bytes(buffer[: head_end + length])
    del buffer[: head_end + length]
    return message


@asynccontextmanager
async def answer_lost_once(upstream_port: int, path: bytes) -> AsyncIterator[str]:
    """A TCP proxy in front of deo's API: the first request for ``path`` reaches deo, which
    carries it out, and its answer is lost (the connection closes, as when deo is killed
    after logging); everything else passes through."""
    dropped: list[bytes] = []

    async def relay(client: Any) -> None:
        buffer = bytearray()
        async with client:
            while (request := await _read_message(client, buffer)) is not None:
                async with await anyio.connect_tcp("127.0.0.1", upstream_port) as upstream:
                    await upstream.send(request)
                    answer = await _read_message(upstream, bytearray())
                if not dropped and request.split(b" ", 2)[1] == path:
                    dropped.append(request)
                    return  # deo answered; the caller never hears it
                assert answer is not None
                await client.send(answer)

    listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, relay)
        port = listener.extra(anyio.abc.SocketAttribute.local_port)
        yield f"http://127.0.0.1:{port}"
        assert dropped, "the proxy dropped no answer"
        tg.cancel_scope.cancel()


@pytest.mark.anyio
async def test_register_and_unregister_whose_answers_were_lost_succeed(tmp_path: Path) -> None:
    async with running(tmp_path) as h:
        deo_port = int(h.url.rsplit(":", 1)[1])
        clusters = [Cluster("train", "ACTOR_TRAINING", ["0"]), Cluster("gen", "GENERATION", GPUS)]
        async with answer_lost_once(deo_port, b"/v1/arbiter/pipelines") as url:
            client = ArbiterClient(url, TOKEN, pipeline="p", call_timeout_s=5.0)
            await anyio.to_thread.run_sync(lambda: client.register(clusters))
            client.close()
        assert set((await h.status())["arbiter"]["pipelines"]["p"]["clusters"]) == {"train", "gen"}
        # Another pipeline's clusters under the same name are still refused.
        async with answer_lost_once(deo_port, b"/v1/arbiter/pipelines") as url:
            client = ArbiterClient(url, TOKEN, pipeline="p", call_timeout_s=5.0)
            with pytest.raises(ArbiterError) as refused:
                await anyio.to_thread.run_sync(lambda: client.register(clusters[:1]))
            assert refused.value.status == 409
            client.close()
        async with answer_lost_once(deo_port, b"/v1/arbiter/pipelines/p/unregister") as url:
            client = ArbiterClient(url, TOKEN, pipeline="p", call_timeout_s=5.0)
            await anyio.to_thread.run_sync(client.unregister)
            client.close()
        assert (await h.status())["arbiter"]["pipelines"] == {}


@pytest.mark.anyio
async def test_an_engines_confirmation_wakes_the_waiting_long_poll(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(arbiter_api, "RECHECK_S", 3600.0)  # only the board can wake the poll
    async with running(tmp_path, pools=(ENGINES,)) as h:
        url = "/v1/arbiter/pipelines"
        gen = {"name": "gen", "kind": "GENERATION", "device_mapping": ["0"], "engine_pool": "gen"}
        await h.post(url, {"pipeline": "p", "clusters": [gen]})
        answers: list[httpx.Response] = []

        async def ask_for_generation() -> None:
            answers.append(await h.post(f"{url}/p/clusters/gen/request", {"priority": 6}))

        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                tg.start_soon(ask_for_generation)
                while "gen-0" not in h.runner.state.workers:
                    await anyio.sleep(0.05)
                await engines_up(h, "gen-0")  # WorkerReady: no arbiter command comes of it
        assert answers[0].status_code == 200 and answers[0].json()["gpus"] == ["0"]


@pytest.mark.anyio
async def test_a_generation_request_released_before_its_answer_is_refused(
    tmp_path: Path,
) -> None:
    async with running(tmp_path) as h:
        url = "/v1/arbiter/pipelines"
        train = {"name": "train", "kind": "ACTOR_TRAINING", "device_mapping": GPUS}
        await h.post(url, {"pipeline": "q", "clusters": [train]})
        assert (await h.post(f"{url}/q/clusters/train/request", {"priority": 1})).is_success
        await h.post(url, pipeline_body("p", ["0"], GPUS))
        answers: list[httpx.Response] = []

        async def ask_for_generation() -> None:
            answers.append(
                await h.post(f"{url}/p/clusters/gen/request", {"priority": 6, "timeout_s": 60})
            )

        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                tg.start_soon(ask_for_generation)
                while (
                    "waiting"
                    not in (await h.status())["arbiter"]["pipelines"]["p"]["clusters"]["gen"]
                ):
                    await anyio.sleep(0.05)
                assert (await h.post(f"{url}/p/clusters/gen/release")).is_success
        assert answers[0].status_code == 409
        assert "withdrawn (released)" in answers[0].json()["error"]


@pytest.mark.anyio
async def test_a_request_waiting_on_a_cordoned_gpu_says_so(tmp_path: Path) -> None:
    async with running(tmp_path) as h:
        url = "/v1/arbiter/pipelines"
        assert (await h.post("/v1/gpus/1/cordon")).status_code == 200
        train = {"name": "train", "kind": "ACTOR_TRAINING", "device_mapping": ["0", "1"]}
        await h.post(url, {"pipeline": "q", "clusters": [train]})
        waiting = await h.post(f"{url}/q/clusters/train/request", {"priority": 1, "timeout_s": 0})
        assert waiting.status_code == 408
        assert "GPUs ['1'] of its mapping are cordoned" in waiting.json()["error"]


@pytest.mark.anyio
async def test_a_grant_preempted_before_it_was_read_is_asked_anew_under_its_id(
    tmp_path: Path,
) -> None:
    async with running(tmp_path) as h:
        url = "/v1/arbiter/pipelines"
        await h.post(url, pipeline_body("p", ["0"], GPUS))
        train = {"name": "train", "kind": "ACTOR_TRAINING", "device_mapping": GPUS}
        await h.post(url, {"pipeline": "q", "clusters": [train]})
        ask = {"priority": 6, "request_id": "r1", "timeout_s": 0}
        granted = await h.post(f"{url}/p/clusters/gen/request", ask)
        assert granted.status_code == 200, granted.text
        # Training takes every rank back before the caller (say, its answer lost) reads it.
        assert (await h.post(f"{url}/q/clusters/train/request", {"priority": 1})).is_success
        again = await h.post(f"{url}/p/clusters/gen/request", ask)
        assert again.status_code == 408, again.text
        gen = (await h.status())["arbiter"]["pipelines"]["p"]["clusters"]["gen"]
        assert "waiting" in gen, gen  # queued anew, not left waiting on nothing
        assert (await h.post(f"{url}/q/clusters/train/release")).is_success
        answered = await h.post(f"{url}/p/clusters/gen/request", {**ask, "timeout_s": 30})
        assert answered.status_code == 200, answered.text
        replayed_cleanly(h.log_path)


@pytest.mark.anyio
async def test_the_client_asks_again_in_its_queued_requests_place(tmp_path: Path) -> None:
    async with running(tmp_path) as h:

        def trainer(name: str) -> ArbiterClient:
            client = ArbiterClient(h.url, TOKEN, pipeline=name, poll_s=0.3)
            client.register([Cluster("train", "ACTOR_TRAINING", ["0", "1"])])
            return client

        a = await anyio.to_thread.run_sync(trainer, "a")
        b = await anyio.to_thread.run_sync(trainer, "b")
        await anyio.to_thread.run_sync(lambda: a.request("train", "ACTOR_TRAINING"))
        with pytest.raises(ArbiterTimeout):
            await anyio.to_thread.run_sync(
                lambda: b.request("train", "ACTOR_TRAINING", deadline_s=0.5)
            )
        # Withdrawn while b's loop was between calls (an operator, or b's own earlier process):
        # asking again is about that request, not a new one.
        assert (await h.post("/v1/arbiter/pipelines/b/clusters/train/release")).is_success
        with pytest.raises(ArbiterError) as withdrawn:
            await anyio.to_thread.run_sync(
                lambda: b.request("train", "ACTOR_TRAINING", deadline_s=5)
            )
        assert withdrawn.value.status == 409 and "withdrawn" in str(withdrawn.value)
        # Answered, the id is spent: the next call is a new request, granted once a lets go.
        async with anyio.create_task_group() as tg:
            got: list[Any] = []

            def wait_for_b() -> None:
                got.append(b.request("train", "ACTOR_TRAINING", deadline_s=60))

            tg.start_soon(anyio.to_thread.run_sync, wait_for_b)
            with anyio.fail_after(30):
                while (
                    "waiting"
                    not in (await h.status())["arbiter"]["pipelines"]["b"]["clusters"]["train"]
                ):
                    await anyio.sleep(0.05)
            await anyio.to_thread.run_sync(lambda: a.release("train"))
        assert got[0].gpus == ("0", "1")
        a.close()
        b.close()
