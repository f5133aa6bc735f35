"""The GPU arbiter over the Ray executor: ``deo run`` with ``[executor] kind = "ray"`` serves an
``[arbiter]`` over node-qualified GPUs (``a:0``, ``a:1``, ``b:0``, ``b:1``, the shared test
cluster's nodes, tests/conftest.py). Pipeline p1's generation cluster (tensor parallel 2: rank 0
on node a's two GPUs, rank 1 on node b's) is run by an engine pool of stand-in engines, each in
its actor on the node of its bundle; p2's training loop (deo_worker.arbiter_client) asks for node
b's GPUs. Its grant comes back only once the engine there has confirmed its sleep (its memory
freed, its process kept); the release wakes it again; ``deo replay`` verifies the log. A
generation cluster whose rank bundles span nodes is refused at registration.

Engines bind 127.0.0.1 on a port block claimed for this process (``bench.ports``) and deo's API
is on a port the kernel picks, so two suites can run on one machine at once.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from test_ray import RayCluster, cluster, ray_deo
from test_ray_engines import MEMORY_MIB, argv_of, environ_of, rss_bytes, standin
from test_run import TOKEN, Deo, pool, verified
from waiting import wait_for

from bench.ports import reserve_port_range
from deo_worker.arbiter_client import ArbiterClient, ArbiterError, Cluster

__all__ = ["cluster", "ray_deo"]  # the fixtures, used by name

GPUS = ["a:0", "a:1", "b:0", "b:1"]
#: How late each stand-in answers a sleep or wake call: a grant answered before the engine
#: confirmed its sleep would find it still falling asleep.
CONTROL_DELAY_S = 2.0


def config(gpus: list[str]) -> str:
    """An engine pool of stand-ins, two GPUs each, that only the arbiter sizes, and the
    ``[arbiter]`` over ``gpus``."""
    first = reserve_port_range(8).first
    argv = [*standin(), "--control-delay-s", str(CONTROL_DELAY_S)]
    engines = pool(
        "gen",
        argv,
        kind="engine",
        engine="vllm",
        ports=[first, first + 7],
        gpus_per_worker=2,
        min_workers=0,
        max_workers=2,
        max_asleep=2,
        drain_timeout_s=1.0,
        control_timeout_s=8 * CONTROL_DELAY_S,
        stop_timeout_s=2.0,
        policy='name = "static"\ncount = 0',
    )
    return engines + f"[arbiter]\ngpus = {json.dumps(gpus)}\n"


def by_node(d: Deo) -> dict[str, dict[str, Any]]:
    """Node name -> the engine whose bundle is there (one each, on one node, or the test fails)."""
    found: dict[str, dict[str, Any]] = {}
    for worker in d.workers():
        nodes = {gpu.split(":")[0] for gpu in worker["gpus"]}
        assert len(nodes) == 1, worker
        [node] = nodes
        assert node not in found, (found[node], worker)
        found[node] = worker
    return found


def arbiter_view(d: Deo) -> dict[str, Any]:
    view: dict[str, Any] = httpx.get(f"{d.url}/v1/arbiter", timeout=30).json()
    return view


def serves_arbiter(d: Deo) -> bool:
    return "arbiter" in d.status()  # the API answers before deo has declared the arbiter's GPUs


def test_training_preempts_engines_on_its_node_and_generation_comes_back_over_ray(
    ray_deo: Callable[[str, list[str]], Deo], cluster: RayCluster
) -> None:
    d = ray_deo(config(GPUS), GPUS)
    d.start()
    wait_for("the arbiter", lambda: serves_arbiter(d), retry_on=(httpx.HTTPError,))
    nodes = cluster.node_ids()
    with (
        ArbiterClient(d.url, TOKEN, pipeline="p1", poll_s=2.0) as p1,
        ArbiterClient(d.url, TOKEN, pipeline="p2", poll_s=2.0) as p2,
    ):
        # A rank's bundle on two nodes could never be one engine: refused, nothing registered.
        across = ["a:1", "b:0", "a:0", "b:1"]
        with pytest.raises(ArbiterError, match=r"span nodes") as refused:
            p1.register([Cluster("gen", "GENERATION", across, tp_size=2, engine_pool="gen")])
        assert refused.value.status == 409, refused.value
        p1.register([Cluster("gen", "GENERATION", GPUS, tp_size=2, engine_pool="gen")])
        p2.register([Cluster("train", "ACTOR_TRAINING", ["b:0", "b:1"])])
        p1.open_rollout()
        p1.progress("rollout", 256, 0)
        gen = p1.request("gen", "GENERATION", deadline_s=120)
        # Answered once an engine is confirmed awake.
        assert gen.gpus
        assert any(w["state"] == "active" for w in d.workers())
        engines = wait_for(
            "an engine awake on each node",
            lambda: (
                (found := by_node(d)).keys() == {"a", "b"}
                and all(w["state"] == "active" for w in found.values())
                and found
            ),
        )
        for node, engine in engines.items():
            # In its actor on the node of its bundle, shown both GPUs, bound on the node's
            # address, its memory taken.
            assert engine["gpus"] == [f"{node}:0", f"{node}:1"]
            env = environ_of(engine["pid"])
            assert env["DEO_RAY_NODE_ID"] == nodes[node], (node, engine)
            assert env["CUDA_VISIBLE_DEVICES"] == "0,1"
            argv = argv_of(engine["pid"])
            assert argv[argv.index("--host") + 1] == "127.0.0.1", argv
            assert rss_bytes(engine["pid"]) >= MEMORY_MIB * 2**20
        assert sorted(arbiter_view(d)["pipelines"]["p1"]["clusters"]["gen"]["active_gpus"]) == GPUS

        # p2 trains on node b: its grant waits for b's engine to confirm its sleep (answered
        # CONTROL_DELAY_S late); a's engine keeps generating.
        train = p2.request("train", "ACTOR_TRAINING", deadline_s=120)
        assert train.gpus == ("b:0", "b:1")
        after = by_node(d)
        assert {n: (w["id"], w["pid"]) for n, w in after.items()} == {
            n: (w["id"], w["pid"]) for n, w in engines.items()
        }  # the same engines, the same processes: asleep, not stopped
        assert {n: w["state"] for n, w in after.items()} == {"a": "active", "b": "sleeping"}
        assert rss_bytes(after["b"]["pid"]) < MEMORY_MIB * 2**20
        assert rss_bytes(after["a"]["pid"]) >= MEMORY_MIB * 2**20
        view = arbiter_view(d)["pipelines"]
        assert view["p1"]["clusters"]["gen"]["active_gpus"] == ["a:0", "a:1"]
        assert view["p2"]["clusters"]["train"]["held"] == ["b:0", "b:1"]
        [asleep] = d.events("EngineAsleep")
        assert asleep["worker_id"] == engines["b"]["id"]

        # Released: p1's rollout is still open, so b's engine wakes again, memory taken back.
        p2.release("train")
        wait_for("b's engine awake again", lambda: by_node(d)["b"]["state"] == "active")
        woken = by_node(d)
        assert {n: w["pid"] for n, w in woken.items()} == {n: w["pid"] for n, w in engines.items()}
        assert rss_bytes(woken["b"]["pid"]) >= MEMORY_MIB * 2**20
        assert not d.commands("SpawnWorker")[2:]  # one spawn per rank, no more
        assert not d.events("WorkerExited")
        gpus = arbiter_view(d)["pipelines"]["p1"]["clusters"]["gen"]["active_gpus"]
        assert sorted(gpus) == GPUS
    verified(d)
