"""Engine pools over the Ray executor: stand-in engines (``python -m deo_worker.engine_standin``)
run in their actors on the nodes that hold their GPUs, bound on ``{host}`` (the node's address:
127.0.0.1 for the shared nodes, 127.0.0.2 for a node of one test's own), and deo's router, engine
control, metrics and readiness check reach them there.

The cluster is the session's (tests/conftest.py), shared with test_ray.py; every engine binds
127.0.0.1 on a port block claimed for this process (``bench.ports``), so two suites can run on
one machine at once.
"""

from __future__ import annotations

import contextlib
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from engine_standins import rss_bytes
from test_ray import NODE_ARGS, RayCluster, cluster, node_resources, ray, ray_deo
from test_run import Deo, alive, pool, verified
from waiting import wait_for

from adapters.runtime.ray_executor import (
    ACTOR_PREFIX,
    NODE_RESOURCE_PREFIX,
    RayExecutor,
    actor_name,
    default_namespace,
)
from adapters.runtime.ray_host import WorkerHost
from bench.ports import reserve_port, reserve_port_range
from core.config import ENGINE_HOST
from core.events import WorkerAdopted
from core.state import State, Worker

__all__ = ["cluster", "ray_deo"]  # the fixtures, used by name

#: Another address of this machine's loopback (all of 127.0.0.0/8 is), for a node of its own.
OTHER_LOOPBACK = "127.0.0.2"
#: What a sleeping stand-in frees (its RSS falls by most of it).
MEMORY_MIB = 64
#: A request that takes about 2 s at the stand-in's 100 tokens/s: the others find it in flight.
BODY = {"model": "standin-model", "prompt": "x", "max_tokens": 200, "stream": True}


def standin(engine: str = "vllm") -> list[str]:
    """A stand-in engine's argv, binding the address deo gives it on its node."""
    return [
        sys.executable,
        "-m",
        "deo_worker.engine_standin",
        "--engine",
        engine,
        "--host",
        "{host}",
        "--port",
        "{port}",
        "--memory-mib",
        str(MEMORY_MIB),
    ]


def engine_pool(router_port: int, count: int, **fields: Any) -> str:
    first = reserve_port_range(8).first
    settings: dict[str, Any] = {
        "kind": "engine",
        "engine": "vllm",
        "ports": [first, first + 7],
        "router_port": router_port,
        "min_workers": 0,
        "max_workers": 3,
        "max_asleep": 1,
        "gpus_per_worker": 1,
        "drain_timeout_s": 1.0,
        "control_timeout_s": 20.0,
        "stop_timeout_s": 2.0,
        "stabilization_s": 0,
    }
    settings.update(fields)
    return pool("gen", standin(), policy=f'name = "static"\ncount = {count}', **settings)


def environ_of(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


def argv_of(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")[:-1]


def engines(d: Deo) -> dict[str, dict[str, Any]]:
    """Every live engine by worker id (its state, pid, port, GPUs)."""
    return {w["id"]: w for w in d.workers()}


def states(d: Deo) -> dict[str, str]:
    return {worker_id: w["state"] for worker_id, w in engines(d).items()}


def served_by(router: str, times: int) -> set[str]:
    """The engines that answered ``times`` completions sent through the router at once."""
    with httpx.Client(timeout=60) as http, contextlib.ExitStack() as streams:
        # All sent before any is read, so that each finds the others in flight (fewest in flight
        # wins: they spread over the active engines).
        answers = [
            streams.enter_context(http.stream("POST", f"{router}/v1/completions", json=BODY))
            for _ in range(times)
        ]
        served = set()
        for answer in answers:
            assert answer.status_code == 200, answer.read()
            served.add(answer.headers["x-deo-engine"])
            assert b"[DONE]" in answer.read()
    return served


def router_up(router: str) -> None:
    wait_for(
        "the router",
        lambda: httpx.get(f"{router}/health", timeout=10).status_code == 200,
        retry_on=(httpx.HTTPError,),
    )


def test_engines_run_on_their_gpus_nodes_are_routed_sleep_wake_and_are_adopted_after_kill_9(
    ray_deo: Callable[[str, list[str]], Deo], cluster: RayCluster
) -> None:
    router_port = reserve_port()
    router = f"http://127.0.0.1:{router_port}"
    d = ray_deo(engine_pool(router_port, count=2), ["a:0", "b:0", "a:1", "b:1"])
    d.start()
    namespace = default_namespace(d.log)
    nodes = cluster.node_ids()
    running = wait_for("two active engines", lambda: len(d.workers("active")) == 2 and engines(d))
    for worker_id, worker in running.items():
        [gpu] = worker["gpus"]
        node, index = gpu.split(":")
        env = environ_of(worker["pid"])
        # On the node of its GPU, shown that GPU, bound on the node's address.
        assert env["DEO_RAY_NODE_ID"] == nodes[node], (worker_id, gpu)
        assert env["CUDA_VISIBLE_DEVICES"] == index
        assert env["VLLM_SERVER_DEV_MODE"] == "1"
        argv = argv_of(worker["pid"])
        assert argv[argv.index("--host") + 1] == "127.0.0.1", argv
    assert {w["gpus"][0].split(":")[0] for w in running.values()} == {"a", "b"}

    # The router answers through both engines (deo reaches each at its node's address).
    router_up(router)
    assert served_by(router, 4) == set(running)

    # Down to 1: the newest engine sleeps on its node, its memory freed, its process kept.
    sleeper = max(running)
    awake_rss = rss_bytes(running[sleeper]["pid"])
    assert d.post("/v1/pools/gen/pin", {"count": 1}).status_code == 200
    wait_for("one asleep", lambda: states(d) == {min(running): "active", sleeper: "sleeping"})
    asleep_rss = rss_bytes(running[sleeper]["pid"])
    assert awake_rss - asleep_rss > MEMORY_MIB * 2**20 // 2, (awake_rss, asleep_rss)
    assert served_by(router, 3) == {min(running)}  # never routed to a sleeping engine

    # deo dies without a word; a restart adopts the active engine and the sleeping one.
    spawned = len(d.commands("SpawnWorker"))
    d.kill9()
    d.start()
    router_up(router)
    wait_for("two adoptions", lambda: len(d.events("WorkerAdopted")) == 2)
    wait_for("the sleeper asked", lambda: len(d.events("EngineAsleep")) == 2)
    after = engines(d)
    assert {w: (after[w]["state"], after[w]["pid"]) for w in after} == {
        min(running): ("active", running[min(running)]["pid"]),
        sleeper: ("sleeping", running[sleeper]["pid"]),
    }
    assert len(d.commands("SpawnWorker")) == spawned  # no duplicate
    assert cluster.actors(namespace) == sorted(ACTOR_PREFIX + w for w in running)  # no orphan
    assert not d.events("WorkerLost")

    # Up to 2: the sleeper wakes (same process), takes its memory back and is routed again.
    assert d.post("/v1/pools/gen/pin", {"count": 2}).status_code == 200
    wait_for("both active", lambda: set(states(d).values()) == {"active"} and len(states(d)) == 2)
    assert rss_bytes(running[sleeper]["pid"]) - asleep_rss > MEMORY_MIB * 2**20 // 2
    assert len(d.commands("SpawnWorker")) == spawned
    assert served_by(router, 4) == set(running)
    verified(d)


def test_a_lost_node_loses_its_engine_and_the_pool_replaces_it_elsewhere(
    ray_deo: Callable[[str, list[str]], Deo], cluster: RayCluster
) -> None:
    router_port = reserve_port()
    router = f"http://127.0.0.1:{router_port}"
    d = ray_deo(engine_pool(router_port, count=1), ["d:0", "a:0"])
    # A node of this test's own (the others stay for the other tests), known to Ray by another
    # loopback address: deo must reach its engine there, not on 127.0.0.1.
    cluster.nodes["d"] = cluster.cluster.add_node(
        **{**NODE_ARGS, "node_ip_address": OTHER_LOOPBACK},
        num_gpus=2,
        resources=node_resources("d", 2),
    )
    try:
        cluster.cluster.wait_for_nodes()
        d.start()
        [lost] = wait_for("an engine on d", lambda: d.workers("active"))
        assert lost["gpus"] == ["d:0"]
        argv = argv_of(lost["pid"])
        assert argv[argv.index("--host") + 1] == OTHER_LOOPBACK
        # Its /metrics read there: a sample taken a reading's interval (2 s) after it was ready,
        # and none failed.
        [ready] = d.events("WorkerReady")
        wait_for(
            "a load sample read from it",
            lambda: [e for e in d.events("LoadSampled") if e["t"] > ready["t"] + 2.5],
        )
        assert not d.events("SourceDown")
        router_up(router)
        assert served_by(router, 1) == {lost["id"]}

        cluster.cluster.remove_node(cluster.nodes.pop("d"))
        wait_for("d's GPU lost", lambda: d.events("GpuLost"))
        wait_for("its engine gone", lambda: not alive(lost["pid"]))
        [replacement] = wait_for(
            "a replacement on a",
            lambda: [w for w in d.workers("active") if w["gpus"] == ["a:0"]],
        )
        assert replacement["id"] != lost["id"]
        assert served_by(router, 2) == {replacement["id"]}
    finally:
        if "d" in cluster.nodes:
            cluster.cluster.remove_node(cluster.nodes.pop("d"))
    verified(d)


@pytest.fixture
def host_actor(cluster: RayCluster) -> Any:
    actor = ray.remote(WorkerHost).options(num_cpus=0).remote()
    yield actor
    ray.kill(actor, no_restart=True)


def test_the_engines_actor_tells_its_port_from_another_programs(
    host_actor: Any, tmp_path: Path
) -> None:
    port = reserve_port()
    argv = standin()
    argv[argv.index("{port}")] = str(port)
    argv[argv.index("{host}")] = ENGINE_HOST  # as deo renders it, for the actor to fill
    log = str(tmp_path / "engine.log")
    info = ray.get(host_actor.start.remote(argv, {}, log, True), timeout=60)
    assert info["error"] is None and info["host"] == "127.0.0.1", info
    wait_for(
        "the engine's health",
        lambda: httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).status_code == 200,
        retry_on=(httpx.HTTPError,),
    )
    assert ray.get(host_actor.port_held.remote(port), timeout=60) is True
    # A server of another program (this test's) on a port: not the engine's.
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        assert ray.get(host_actor.port_held.remote(other.getsockname()[1]), timeout=60) is False
    assert alive(info["pid"])


def test_a_worker_that_is_no_engine_is_given_no_host(host_actor: Any, tmp_path: Path) -> None:
    # Only an engine is reached at its node's address: nothing else asks for it.
    argv = [sys.executable, "-c", "import time; time.sleep(600)"]
    info = ray.get(host_actor.start.remote(argv, {}, str(tmp_path / "w.log"), False), timeout=60)
    assert info["error"] is None and info["host"] is None, info
    assert ray.get(host_actor.info.remote(), timeout=60)["host"] is None


def test_an_engine_adopted_from_an_actor_that_reports_no_host_is_reached_at_its_node(
    cluster: RayCluster, tmp_path: Path
) -> None:
    # The actor of a deo that did not report hosts: its ``info`` has no ``host``.
    class HostReportingNoAddress(WorkerHost):
        async def info(self) -> dict[str, Any]:
            answer = await super().info()
            answer.pop("host")
            return answer

    namespace = ray.get_runtime_context().namespace
    actor = (
        ray.remote(HostReportingNoAddress)
        .options(
            name=actor_name("gen-0"),
            namespace=namespace,
            num_cpus=0,
            resources={NODE_RESOURCE_PREFIX + "b": 0.01},
        )
        .remote()
    )
    try:
        idle = [sys.executable, "-c", "import time; time.sleep(600)"]
        info = ray.get(actor.start.remote(idle, {}, str(tmp_path / "e.log"), True), timeout=60)
        assert info["error"] is None and "host" not in info, info
        engine = Worker(
            worker_id="gen-0",
            pool="gen",
            index=0,
            state="active",
            gpus=[],
            requested_t=0.0,
            pid=info["pid"],
            start_time=info["start_time"],
            port=reserve_port(),
        )
        executor = RayExecutor(
            lambda event: None,
            clock=lambda: 1.0,
            state=State,
            log_dir=tmp_path,
            address=cluster.address,
            namespace=namespace,
        )
        events = anyio.run(executor.reconcile, State(workers={"gen-0": engine}))
        assert [type(e) for e in events] == [WorkerAdopted]
        nodes = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
        assert executor.engine_host("gen-0") == nodes[cluster.node_ids()["b"]] == "127.0.0.1"
    finally:
        ray.kill(actor, no_restart=True)


class _Healthy(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def foreign_server() -> Iterator[int]:
    """A server of this test's own answering 200 to everything on a reserved loopback port."""
    server = ThreadingHTTPServer(("127.0.0.1", reserve_port()), _Healthy)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield int(server.server_address[1])
    finally:
        server.shutdown()
        server.server_close()


def test_a_server_of_another_program_on_an_engines_port_is_never_taken_for_it_over_ray(
    ray_deo: Callable[[str, list[str]], Deo], foreign_server: int
) -> None:
    # An engine that never listens (it only sleeps), on the one port, where the foreign server
    # answers /health: deo must ask the engine's actor whose socket that is, and hear "not its".
    idle = [sys.executable, "-c", "import sys, time; time.sleep(600)", "{host}", "{port}"]
    pools = pool(
        "gen",
        idle,
        kind="engine",
        engine="vllm",
        ports=[foreign_server, foreign_server],
        max_workers=1,
        policy='name = "static"\ncount = 1',
    )
    d = ray_deo(pools, [])
    d.start()
    [engine] = wait_for("the engine started", lambda: d.events("WorkerStarted"))
    wait_for(
        "the foreign server found out (or taken for the engine)",
        lambda: "held by another process" in d.output() or d.events("WorkerReady"),
    )
    assert not d.events("WorkerReady")
    assert argv_of(engine["pid"])[-2:] == ["127.0.0.1", str(foreign_server)]
    assert [w["state"] for w in d.workers()] == ["starting"]
    verified(d)
