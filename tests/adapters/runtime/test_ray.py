"""``deo run`` with the Ray executor against a real Ray cluster of several nodes on this machine.

One cluster serves every Ray test of the run (``ray_cluster`` in tests/conftest.py: Ray's
start-up is slow; it is shut down after the last of them): a head without GPUs and nodes ``a``
and ``b`` declaring two GPUs each (``num_gpus`` they need not have: Ray only counts them). Each
test runs its own ``deo run`` on its own log, so in its own Ray namespace. The cluster
listens on 127.0.0.1 only (Ray has no authentication) and on ports the kernel picks, so two
suites can run on one machine at once.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

#: For the cluster's processes, this test process and each deo (set before Ray is imported: it
#: reads them then): loopback addresses stay loopback (Ray otherwise swaps 127.0.0.1 for the
#: host's address), and a head outage of a few seconds ends no Raylet or driver.
RAY_ENVIRON = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_gcs_rpc_server_reconnect_timeout_s": "300",
}
for _key, _value in RAY_ENVIRON.items():
    os.environ.setdefault(_key, _value)

ray = pytest.importorskip("ray")

from ray.cluster_utils import Cluster  # noqa: E402
from test_run import STUBBORN, Deo, alive, pool, script, verified  # noqa: E402
from waiting import wait_for  # noqa: E402

from adapters.runtime.ray_executor import (  # noqa: E402
    ACTOR_PREFIX,
    GPU_RESOURCE_PREFIX,
    NODE_RESOURCE_PREFIX,
    default_namespace,
)
from adapters.runtime.ray_host import WorkerHost  # noqa: E402

#: Ray's own footprint, kept small for a loaded 2-core machine.
NODE_ARGS: dict[str, Any] = {
    "num_cpus": 1,
    "object_store_memory": 80 * 2**20,
    # Loopback only: nothing beyond this machine can reach the test cluster.
    "node_ip_address": "127.0.0.1",
    # Workers' ports from the kernel, not Ray's fixed range another suite's cluster shares.
    "min_worker_port": 0,
    "max_worker_port": 0,
    # The head's agent would take Ray's fixed port, which another suite's head wants too.
    "dashboard_agent_listen_port": 0,
}


def node_resources(name: str, gpus: int) -> dict[str, float]:
    """The custom resources of deo node ``name`` with ``gpus`` GPUs."""
    resources = {NODE_RESOURCE_PREFIX + name: 1.0}
    resources.update({f"{GPU_RESOURCE_PREFIX}{name}:{index}": 1.0 for index in range(gpus)})
    return resources


#: Records what the worker got (its GPUs, its node) in DIR/WORKER_ID.json, then works until
#: drained (SIGUSR1: exit 0).
RECORDER = """
import json, os, sys, time
from deo_worker import Drain
with Drain() as drain:
    names = ("CUDA_VISIBLE_DEVICES", "DEO_RAY_NODE_ID", "DEO_WORKER_ID")
    seen = {k: os.environ.get(k) for k in names}
    seen["pid"] = os.getpid()
    path = os.path.join(sys.argv[1], os.environ["DEO_WORKER_ID"] + ".json")
    with open(path + ".tmp", "w") as f:
        json.dump(seen, f)
    os.replace(path + ".tmp", path)
    while not drain.requested:
        time.sleep(0.1)
"""


class RayCluster:
    """The module's cluster: its address and the Ray node id behind each deo node name."""

    def __init__(self) -> None:
        self.cluster = Cluster(
            initialize_head=True,
            head_node_args={
                **NODE_ARGS,
                "include_dashboard": False,
                "resources": {NODE_RESOURCE_PREFIX + "head": 1},
            },
        )
        self.nodes: dict[str, Any] = {}
        for name in ("a", "b"):
            self.add_node(name)
        self.cluster.wait_for_nodes()
        ray.init(address=self.cluster.address, log_to_driver=False)

    def add_node(self, name: str) -> None:
        """Start deo node ``name`` with two GPUs (declared, not real)."""
        self.nodes[name] = self.cluster.add_node(
            **NODE_ARGS, num_gpus=2, resources=node_resources(name, 2)
        )

    def gcs_pid(self) -> int:
        """The pid of the head's GCS server (the part that answers for the head)."""
        return int(self.cluster.head_node.all_processes["gcs_server"][0].process.pid)

    @property
    def address(self) -> str:
        return str(self.cluster.address)

    def node_ids(self) -> dict[str, str]:
        """deo node name -> Ray node id, for the live nodes."""
        found = {}
        for node in ray.nodes():
            for resource in node["Resources"]:
                if node["Alive"] and resource.startswith(NODE_RESOURCE_PREFIX):
                    found[resource[len(NODE_RESOURCE_PREFIX) :]] = node["NodeID"]
        return found

    def actors(self, namespace: str) -> list[str]:
        """The worker actors alive in ``namespace``."""
        return sorted(
            a["name"]
            for a in ray.util.list_named_actors(all_namespaces=True)
            if a["namespace"] == namespace and a["name"].startswith(ACTOR_PREFIX)
        )

    def remove_all(self, namespace: str) -> None:
        for name in self.actors(namespace):
            with contextlib.suppress(ValueError):  # gone meanwhile
                ray.kill(ray.get_actor(name, namespace=namespace), no_restart=True)

    def shutdown(self) -> None:
        ray.shutdown()
        self.cluster.shutdown()


@pytest.fixture
def cluster(ray_cluster: RayCluster) -> RayCluster:
    """The run's cluster (tests/conftest.py), shared with the other Ray test modules."""
    return ray_cluster


@pytest.fixture
def ray_deo(tmp_path: Path, cluster: RayCluster) -> Iterator[Callable[[str, list[str]], Deo]]:
    made: list[Deo] = []

    def make(pools: str, gpus: list[str]) -> Deo:
        d = Deo(tmp_path, pools)
        text = d.config.read_text().replace("[deo]\n", f"[deo]\ngpus = {json.dumps(gpus)}\n", 1)
        executor = f'[executor]\nkind = "ray"\naddress = "{cluster.address}"\n'
        d.config.write_text(text + '[nvml]\nbackend = "off"\n' + executor)
        made.append(d)
        return d

    yield make
    for d in made:
        d.cleanup()
        cluster.remove_all(default_namespace(d.log))


def recorded(directory: Path) -> dict[str, dict[str, Any]]:
    """What each worker recorded about itself, by worker id."""
    found = {}
    for path in directory.glob("*.json"):
        try:
            found[path.stem] = json.loads(path.read_text())
        except ValueError:
            continue  # being written
    return found


def gpus_of(d: Deo) -> dict[str, list[str]]:
    """Each active worker's GPU ids, by worker id, from deo's status."""
    return {w["id"]: w["gpus"] for w in d.workers("active")}


def recorder_pool(
    tmp_path: Path, name: str, *, max_workers: int, gpus_per_worker: int, count: int
) -> tuple[str, Path]:
    """A static pool of workers that record their environment (``recorded``), and where."""
    seen_dir = tmp_path / "seen"
    seen_dir.mkdir()
    worker = script(tmp_path, "recorder.py", RECORDER)
    config = pool(
        name,
        [sys.executable, worker, str(seen_dir)],
        min_workers=0,
        max_workers=max_workers,
        gpus_per_worker=gpus_per_worker,
        policy=f'name = "static"\ncount = {count}',
    )
    return config, seen_dir


def test_workers_run_on_the_nodes_of_their_gpus_drain_and_are_adopted_after_kill_9(
    ray_deo: Callable[[str, list[str]], Deo], cluster: RayCluster, tmp_path: Path
) -> None:
    config, seen_dir = recorder_pool(tmp_path, "gen", max_workers=4, gpus_per_worker=1, count=3)
    d = ray_deo(config, ["a:0", "b:0", "a:1", "b:1"])
    d.start()
    namespace = default_namespace(d.log)
    nodes = cluster.node_ids()
    wait_for("three workers", lambda: len(d.workers("active")) == 3)
    gpus = gpus_of(d)
    seen = wait_for("three records", lambda: (r := recorded(seen_dir)) and len(r) == 3 and r)
    for worker_id, [gpu] in gpus.items():
        node, index = gpu.split(":")
        # The core's choice of node and GPU is where the worker runs and what CUDA shows it.
        assert seen[worker_id]["DEO_RAY_NODE_ID"] == nodes[node], (worker_id, gpu)
        assert seen[worker_id]["CUDA_VISIBLE_DEVICES"] == index, (worker_id, gpu)
    assert {g[0].split(":")[0] for g in gpus.values()} == {"a", "b"}
    assert cluster.actors(namespace) == sorted(ACTOR_PREFIX + w for w in gpus)

    # Scaling down drains: SIGUSR1, exit code 0 reported, the actor removed.
    assert d.post("/v1/pools/gen/pin", {"count": 2}).status_code == 200
    wait_for("a drained exit", lambda: d.events("WorkerExited"))
    [exited] = d.events("WorkerExited")
    assert exited["exit_code"] == 0 and exited["signal"] is None, exited
    assert not alive(seen[exited["worker_id"]]["pid"])
    wait_for("two actors", lambda: len(cluster.actors(namespace)) == 2)
    kept = {w["id"]: w["pid"] for w in d.workers("active")}
    assert len(kept) == 2

    # deo dies without a word; its workers do not. The next deo adopts them by their names.
    spawned = len(d.commands("SpawnWorker"))  # a spawn that timed out under load is replaced
    d.kill9()
    assert all(alive(pid) for pid in kept.values())
    # An actor of this namespace the log does not name (a worker it lost) is an orphan to remove.
    ghost = (
        ray.remote(WorkerHost)
        .options(name=ACTOR_PREFIX + "ghost", namespace=namespace, lifetime="detached", num_cpus=0)
        .remote()
    )
    sleeper = [sys.executable, "-c", "import time; time.sleep(600)"]
    ghost_pid = ray.get(ghost.start.remote(sleeper, {}, str(tmp_path / "ghost.log")))["pid"]
    assert alive(ghost_pid)
    d.start()
    wait_for("two adoptions", lambda: len(d.events("WorkerAdopted")) == 2)
    assert {w["id"]: w["pid"] for w in d.workers("active")} == kept
    wait_for("the orphan removed", lambda: not alive(ghost_pid))
    assert cluster.actors(namespace) == sorted(ACTOR_PREFIX + w for w in kept)
    assert [e["worker_id"] for e in d.events("LeftoverProcesses")] == ["ghost"]
    assert len(d.commands("SpawnWorker")) == spawned  # no duplicate was started
    assert not d.events("WorkerLost")

    # Removing the actor (as Ray does when its node dies) ends its worker: reported, replaced.
    victim = next(iter(kept))
    ray.kill(ray.get_actor(ACTOR_PREFIX + victim, namespace=namespace), no_restart=True)
    wait_for("the worker to die with its actor", lambda: not alive(kept[victim]))
    wait_for("its exit", lambda: any(e["worker_id"] == victim for e in d.events("WorkerExited")))
    wait_for("a replacement", lambda: len(d.workers("active")) == 2 and victim not in gpus_of(d))
    d.stop()
    verified(d)


def test_a_lost_node_loses_its_gpus_and_workers_and_replacements_go_elsewhere(
    ray_deo: Callable[[str, list[str]], Deo], cluster: RayCluster, tmp_path: Path
) -> None:
    config, seen_dir = recorder_pool(tmp_path, "gen", max_workers=2, gpus_per_worker=1, count=2)
    d = ray_deo(config, ["a:0", "c:0", "a:1", "c:1"])
    # A node of this test's own: the nodes the other tests use stay.
    cluster.add_node("c")
    try:
        cluster.cluster.wait_for_nodes()
        lose_node_c(d, cluster, seen_dir)
    finally:
        if "c" in cluster.nodes:
            cluster.cluster.remove_node(cluster.nodes.pop("c"))
    d.stop()
    verified(d)


def lose_node_c(d: Deo, cluster: RayCluster, seen_dir: Path) -> None:
    d.start()
    wait_for("two workers", lambda: len(d.workers("active")) == 2)
    on_c = [w for w, [gpu] in gpus_of(d).items() if gpu.startswith("c:")]
    assert len(on_c) == 1, gpus_of(d)
    pid_on_c = wait_for("its record", lambda: recorded(seen_dir).get(on_c[0]))["pid"]

    cluster.cluster.remove_node(cluster.nodes.pop("c"))
    wait_for("c's GPUs lost", lambda: len(d.events("GpuLost")) == 2)
    assert {e["gpu_id"] for e in d.events("GpuLost")} == {"c:0", "c:1"}
    wait_for("its worker gone", lambda: not alive(pid_on_c))
    wait_for(
        "a replacement on a",
        lambda: (
            len(gpus_of(d)) == 2
            and on_c[0] not in gpus_of(d)
            and all(g.startswith("a:") for [g] in gpus_of(d).values())
        ),
    )
    status = d.status()
    assert {"alert": "gpu_lost", "subject": "c:0"} in status["alerts"], status["alerts"]


def test_a_worker_ignoring_the_drain_is_terminated_then_killed_over_ray(
    ray_deo: Callable[[str, list[str]], Deo], tmp_path: Path
) -> None:
    stubborn = script(tmp_path, "stubborn.py", STUBBORN)
    d = ray_deo(
        pool(
            "envs",
            [sys.executable, stubborn],
            min_workers=0,
            max_workers=1,
            drain_timeout_s=1.0,
            stop_timeout_s=1.0,
        ),
        [],
    )
    d.start()
    [worker] = wait_for("the worker", lambda: d.workers("active"))
    child = d.logged_child(worker)
    assert d.post("/v1/pools/envs/pin", {"count": 0}).status_code == 200
    wait_for("the worker gone", lambda: not alive(worker["pid"]))
    wait_for("its child gone with its group", lambda: not alive(child))
    [exited] = wait_for("its exit", lambda: d.events("WorkerExited"))
    assert exited["signal"] == 9, exited  # SIGUSR1 and SIGTERM ignored: SIGKILL ended it
    [(drain_t, _)] = d.commands("DrainWorker")
    [(terminate_t, _)] = d.commands("TerminateWorker")
    [(kill_t, _)] = d.commands("KillWorker")
    assert terminate_t - drain_t >= 1.0 and kill_t - terminate_t >= 1.0
    d.stop()
    verified(d)


def test_a_crash_loop_over_ray_backs_off_and_alerts(
    ray_deo: Callable[[str, list[str]], Deo], cluster: RayCluster, tmp_path: Path
) -> None:
    crasher = script(tmp_path, "crash.py", "import sys; sys.exit(3)")
    d = ray_deo(
        pool("envs", [sys.executable, crasher], min_workers=1, max_workers=1)
        + "[pools.envs.crash_loop]\nbackoff_base_s = 0.2\nbackoff_cap_s = 0.5\nalert_after = 2\n",
        [],
    )
    d.start()
    wait_for(
        "the crash_loop alert",
        lambda: {"alert": "crash_loop", "subject": "envs"} in d.status()["alerts"],
    )
    d.stop()
    exits = d.events("WorkerExited")
    assert len(exits) >= 2 and all(e["exit_code"] == 3 for e in exits), exits
    assert len(d.commands("SpawnWorker")) <= len(exits) + 1  # no spawn storm
    # Every ended worker's actor was removed; none is left behind.
    wait_for("no actor left", lambda: not cluster.actors(default_namespace(d.log)))
    verified(d)


def test_a_worker_on_a_node_without_room_fails_to_spawn_with_the_reason(
    ray_deo: Callable[[str, list[str]], Deo], tmp_path: Path
) -> None:
    d = ray_deo(
        pool(
            "gen",
            [sys.executable, "-c", "import time; time.sleep(60)"],
            min_workers=0,
            max_workers=1,
            gpus_per_worker=1,
            policy='name = "static"\ncount = 1',
        ),
        ["nowhere:0"],
    )
    d.config.write_text(d.config.read_text() + "spawn_timeout_s = 2.0\n")
    d.start()
    failed = wait_for("a failed spawn", lambda: d.events("SpawnFailed"))
    assert "Ray placed no actor within 2s" in failed[0]["error"], failed
    assert "nowhere:0" in failed[0]["error"]
    d.stop()


def test_node_losses_and_an_unreachable_head_become_events(tmp_path: Path) -> None:
    """What the executor makes of the cluster's node table and of a head that does not answer
    (no cluster needed: the answers are given to it as Ray would give them)."""
    from adapters.runtime.ray_executor import RayExecutor
    from core import Config, Configured, PolicySpec, PoolSpec, Reducer

    pool_spec = PoolSpec(
        name="gen", argv=("x",), max_workers=2, gpus_per_worker=1, policy=PolicySpec(name="static")
    )
    reducer = Reducer()
    reducer.step(Configured(t=0.0, config=Config(pools=(pool_spec,), gpus=["a:0", "b:0", "b:1"])))
    events: list[Any] = []
    executor = RayExecutor(
        events.append,
        clock=lambda: 5.0,
        state=lambda: reducer.state,
        log_dir=tmp_path,
        address="127.0.0.1:1",
        namespace="n",
    )

    def node(name: str, alive_: bool) -> dict[str, Any]:
        return {"Alive": alive_, "Resources": {NODE_RESOURCE_PREFIX + name: 1.0, "GPU": 2.0}}

    executor._check_nodes([node("a", True), node("b", True)])
    assert events == []
    executor._check_nodes([node("a", True), node("b", False)])
    assert [(type(e).__name__, e.gpu_id) for e in events] == [
        ("GpuLost", "b:0"),
        ("GpuLost", "b:1"),
    ]
    assert "Ray node b left the cluster" in events[0].error
    events.clear()
    executor._check_nodes([node("a", True), node("b", False)])  # reported once
    assert events == []

    executor._head_unreachable("no answer in 30s")
    executor._head_unreachable("no answer in 30s")  # one outage, said once
    [down] = events
    assert (type(down).__name__, down.address) == ("ClusterUnreachable", "127.0.0.1:1")
    assert down.error == "Ray head unreachable: no answer in 30s"
    reducer.step(down)
    assert ("cluster_unreachable", "127.0.0.1:1") in reducer.state.alerts
    assert reducer.state.pools["gen"].source_error is None  # no pool is left marked down
    events.clear()
    executor._head_answers()
    [up] = events
    assert (type(up).__name__, up.address) == ("ClusterReachable", "127.0.0.1:1")
    reducer.step(up)
    assert not reducer.state.alerts

    # An outage recorded before a restart ends at the first answer of the next deo.
    reducer.step(down)
    restarted: list[Any] = []
    RayExecutor(
        restarted.append,
        clock=lambda: 6.0,
        state=lambda: reducer.state,
        log_dir=tmp_path,
        address="127.0.0.1:1",
        namespace="n",
    )._head_answers()
    assert [type(e).__name__ for e in restarted] == ["ClusterReachable"]


def test_ended_workers_are_remembered_within_a_bound(tmp_path: Path) -> None:
    from adapters.runtime import ray_executor
    from core import State

    events: list[Any] = []
    executor = ray_executor.RayExecutor(
        events.append,
        clock=lambda: 1.0,
        state=State,
        log_dir=tmp_path,
        address="127.0.0.1:1",
        namespace="n",
    )
    kept = ray_executor._FINISHED_KEPT
    for index in range(kept + 10):
        executor._fail(f"w{index}", "refused")
    assert len(executor._finished) == kept
    assert "w0" not in executor._finished and f"w{kept + 9}" in executor._finished
    assert len(events) == kept + 10


def test_ray_gpus_other_than_the_cores_are_refused() -> None:
    from adapters.runtime.ray_executor import _gpu_mismatch

    assert _gpu_mismatch(["a:1", "a:0"], ["0", "1"]) is None
    why = _gpu_mismatch(["a:1"], ["0"])
    assert why is not None and "Ray reserved GPU(s) 0 of its node for it, not deo's a:1" in why


def test_gpus_not_named_by_node_are_refused_before_anything_starts(tmp_path: Path) -> None:
    d = Deo(tmp_path, pool("gen", [sys.executable, "-c", "pass"], gpus_per_worker=1))
    text = d.config.read_text().replace("[deo]\n", '[deo]\ngpus = ["0"]\n', 1)
    d.config.write_text(text + '[executor]\nkind = "ray"\naddress = "127.0.0.1:1"\n')
    done = d.run_to_end()
    assert done.returncode == 2, done.stdout
    assert "deo.gpus: GPU id '0' is not node-qualified (NODE:INDEX)" in done.stdout, done.stdout


def test_gpu_health_is_read_on_each_node_by_its_agent(
    ray_deo: Callable[[str, list[str]], Deo], tmp_path: Path
) -> None:
    gib = 2**30
    healthy = {"memory_used_bytes": 0, "memory_total_bytes": 80 * gib, "temperature_c": 40}
    # Node a's file: the agent on node a reads gpus-a.json (``{node}`` in the configured path).
    readings = {"0": {**healthy, "temperature_c": 51}, "1": {**healthy, "lost": "fell off the bus"}}
    (tmp_path / "gpus-a.json").write_text(json.dumps(readings))
    d = ray_deo(
        pool(
            "gen",
            [sys.executable, "-c", "pass"],
            min_workers=0,
            max_workers=1,
            gpus_per_worker=1,
            policy='name = "static"\ncount = 0',
        ),
        ["a:0", "a:1"],
    )
    text = d.config.read_text().replace(
        '[nvml]\nbackend = "off"\n',
        '[nvml]\nbackend = "file"\nfile = "gpus-{node}.json"\ninterval_s = 0.5\n',
    )
    d.config.write_text(text)
    d.start()
    sampled = wait_for("a reading of a:0", lambda: d.events("GpuSampled"))
    assert {e["gpu_id"] for e in sampled} == {"a:0"}
    assert sampled[0]["temperature_c"] == 51
    [lost] = wait_for("a:1 lost", lambda: d.events("GpuLost"))
    assert lost["gpu_id"] == "a:1" and "fell off the bus" in lost["error"]
    assert "GPU health of 2 GPU(s) on 1 Ray node(s)" in d.output()
    d.stop()
    verified(d)


def test_a_multi_gpu_worker_gets_its_gpus_on_one_node_and_never_across_nodes(
    ray_deo: Callable[[str, list[str]], Deo], cluster: RayCluster, tmp_path: Path
) -> None:
    config, seen_dir = recorder_pool(tmp_path, "pair", max_workers=2, gpus_per_worker=2, count=2)
    d = ray_deo(config, ["a:0", "a:1", "x:0", "y:0"])
    d.start()
    # x:0 and y:0 are free but on two nodes: the second worker is not placed, and says why.
    [(_, alert)] = wait_for(
        "the second worker held back",
        lambda: [a for a in d.commands("RaiseAlert") if a[1]["alert"] == "no_free_gpus"],
    )
    assert (
        alert["alert"] == "no_free_gpus" and "2 free healthy GPU(s) on one node" in alert["reason"]
    )
    [(worker_id, got)] = wait_for("the pair's record", lambda: list(recorded(seen_dir).items()))
    assert got["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert got["DEO_RAY_NODE_ID"] == cluster.node_ids()["a"]
    assert gpus_of(d)[worker_id] == ["a:0", "a:1"]
    assert not d.events("SpawnFailed") and len(d.commands("SpawnWorker")) == 1
    d.stop()
    verified(d)


def test_a_worker_whose_gpu_ray_counts_elsewhere_is_refused(
    ray_deo: Callable[[str, list[str]], Deo], tmp_path: Path
) -> None:
    """deo puts the worker on a:1 while a:0 is free: Ray, which hands out the lowest free GPU,
    would book GPU 0 for it and leave GPU 1 free for anything else."""
    d = ray_deo(
        pool(
            "gen",
            [sys.executable, "-c", "import time; time.sleep(600)"],
            min_workers=0,
            max_workers=1,
            gpus_per_worker=1,
            policy='name = "static"\ncount = 1',
        ),
        ["a:1", "a:0"],
    )
    d.start()
    failed = wait_for("the spawn refused", lambda: d.events("SpawnFailed"))[0]
    assert "Ray reserved GPU(s) 0 of its node for it, not deo's a:1" in failed["error"], failed
    assert not d.events("WorkerStarted")
    d.stop()
    verified(d)


def test_a_head_outage_raises_one_alert_blocks_nothing_and_ends_with_it(
    ray_deo: Callable[[str, list[str]], Deo], cluster: RayCluster
) -> None:
    d = ray_deo(
        pool(
            "envs",
            [sys.executable, "-c", "import time; time.sleep(600)"],
            min_workers=0,
            max_workers=1,
            policy='name = "static"\ncount = 0',
        ),
        [],
    )
    d.config.write_text(d.config.read_text() + "call_timeout_s = 1.0\n")
    d.start()
    # Started: its actors reconciled and its configuration taken (both ask the head).
    wait_for("deo running", lambda: d.events("Configured") and d.events("Tick"))
    alert = {"alert": "cluster_unreachable", "subject": cluster.address}
    gcs = cluster.gcs_pid()
    os.kill(gcs, signal.SIGSTOP)  # the head stops answering, its state intact
    safety = threading.Timer(50.0, os.kill, (gcs, signal.SIGCONT))
    safety.start()
    try:
        wait_for("the outage noticed", lambda: d.events("ClusterUnreachable"))
        # Naming a worker's actor is a call to the head that waits for it: deo's loop must not.
        assert d.post("/v1/pools/envs/pin", {"count": 1}).status_code == 200
        wait_for("the spawn", lambda: d.commands("SpawnWorker"))
        status = d.status()
        assert alert in status["alerts"], status["alerts"]
        assert len(d.events("ClusterUnreachable")) == 1
    finally:
        os.kill(gcs, signal.SIGCONT)
        safety.cancel()
    wait_for("the cluster back", lambda: d.events("ClusterReachable"))
    wait_for("the worker started once the head answers", lambda: d.workers("active"))
    assert alert not in d.status()["alerts"]
    assert not d.events("SpawnFailed") and not d.events("WorkerLost")
    d.stop()
    verified(d)
    wait_for("every node alive", lambda: {"a", "b"} <= set(cluster.node_ids()))
