"""A real run: two pipelines' generation clusters, each run by an engine pool of stand-in
engines, on the same two GPUs (the NVML file backend; no GPUs needed). p generates first; then q
asks. q's grant comes back only once p's engine on each GPU q was given confirmed its sleep
(deo's state, the stand-in's /is_sleeping and its memory agree); q's release wakes p's engines
again. Watched all along and in the log: never two engines holding one GPU's memory."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from pathlib import Path
from typing import Any

import httpx
from arbiter_deo import ArbiterDeo, standin_engine_pool
from engine_standins import rss_bytes
from waiting import wait_for

from adapters.log import LogReader
from core.invariants import state_violations
from core.reducer import reduce
from core.state import State
from deo_worker.arbiter_client import ArbiterClient, Cluster

TOKEN = "arbiter-tenancy-token"
SHARED = ["0", "1"]
MEMORY_MIB = 64
#: How late each stand-in answers a sleep or wake call (a real engine takes a while too).
CONTROL_DELAY_S = 0.3


def engine_pool_toml(name: str) -> str:
    standin = ["--memory-mib", str(MEMORY_MIB), "--startup-s", "0.5"]
    standin += ["--control-delay-s", str(CONTROL_DELAY_S)]
    return standin_engine_pool(
        name,
        engines=2,
        standin_args=standin,
        drain_timeout_s=2.0,
        control_timeout_s=10 * CONTROL_DELAY_S,
        control_attempts=2,
        stop_timeout_s=2.0,
    )


class Deo(ArbiterDeo):
    """``deo run`` with engine pools ``gen`` (pipeline p's) and ``gen2`` (q's)."""

    def __init__(self, tmp_path: Path) -> None:
        pools = engine_pool_toml("gen") + engine_pool_toml("gen2")
        super().__init__(tmp_path, TOKEN, extra_config=pools)

    def workers(self) -> list[dict[str, Any]]:
        body = httpx.get(f"{self.url}/v1/workers", timeout=10).json()
        workers: list[dict[str, Any]] = body["workers"]
        return workers

    def engine(self, pool: str, gpu: str) -> dict[str, Any] | None:
        """``pool``'s live engine on ``gpu``, if any."""
        found = [w for w in self.workers() if w["pool"] == pool and gpu in w["gpus"]]
        assert len(found) <= 1, found
        return found[0] if found else None

    def pid(self, pool: str, gpu: str) -> int:
        """The pid of ``pool``'s engine on ``gpu`` (there must be one)."""
        engine = self.engine(pool, gpu)
        assert engine is not None and engine["pid"] is not None, (pool, gpu, engine)
        pid: int = engine["pid"]
        return pid


class Watcher(threading.Thread):
    """Reads deo's workers over and over; keeps every moment a GPU had two workers that hold
    its memory (any state but asleep)."""

    def __init__(self, deo: Deo) -> None:
        super().__init__(daemon=True)
        self.deo = deo
        self.done = threading.Event()
        self.crowded: list[dict[str, list[str]]] = []
        self.shared_seen = 0  # readings with an engine asleep beside another on a GPU

    def run(self) -> None:
        while not self.done.is_set():
            try:
                workers = self.deo.workers()
            except httpx.HTTPError:
                continue
            holding: dict[str, list[str]] = {}
            on_gpu: dict[str, list[str]] = {}
            for worker in workers:
                for gpu in worker["gpus"]:
                    on_gpu.setdefault(gpu, []).append(worker["id"])
                    if worker["state"] != "sleeping":
                        holding.setdefault(gpu, []).append(f"{worker['id']}:{worker['state']}")
            crowded = {gpu: ids for gpu, ids in holding.items() if len(ids) > 1}
            if crowded:
                self.crowded.append(crowded)
            self.shared_seen += any(len(ids) > 1 for ids in on_gpu.values())
            self.done.wait(0.05)


def memory_holders_in_log(log: Path) -> list[str]:
    """Every invariant-1 violation of any state deo recorded (each event folded in turn)."""
    state = State()
    found: list[str] = []
    for record in LogReader(log).events():
        if record.error is not None:
            continue
        state, _ = reduce(state, record.event)
        found += [
            f"{type(record.event).__name__}: {v}" for v in state_violations(state) if v[:2] == "1:"
        ]
    return found


def test_two_pipelines_engines_time_share_gpus_one_holding_each_at_a_time(
    tmp_path: Path,
) -> None:
    deo = Deo(tmp_path)
    deo.start()
    watcher = Watcher(deo)
    pids: list[int] = []
    try:
        p = ArbiterClient(deo.url, TOKEN, pipeline="p", poll_s=2.0)
        q = ArbiterClient(deo.url, TOKEN, pipeline="q", poll_s=2.0)
        p.register([Cluster("gen", "GENERATION", SHARED, engine_pool="gen")])
        q.register([Cluster("gen", "GENERATION", SHARED, engine_pool="gen2")])
        watcher.start()
        p.open_rollout()
        p.progress("rollout", 256, 0)
        assert p.request("gen", "GENERATION", deadline_s=60).gpus
        wait_for(
            "p's engines awake on both GPUs",
            lambda: all((deo.engine("gen", g) or {}).get("state") == "active" for g in SHARED),
        )
        pids += [deo.pid("gen", g) for g in SHARED]

        # q asks with more to do: the arbiter gives it GPUs p's engines hold.
        q.open_rollout()
        q.progress("rollout", 4096, 0)
        grant = q.request("gen", "GENERATION", deadline_s=90)
        assert grant.gpus and set(grant.gpus) <= set(SHARED), grant
        for gpu in grant.gpus:
            mine = deo.engine("gen2", gpu)
            theirs = deo.engine("gen", gpu)
            assert mine is not None and theirs is not None, (mine, theirs)
            pids.append(mine["pid"])
            # p's engine there is asleep by deo, by its own word and by its memory.
            assert theirs["state"] == "sleeping", theirs
            is_sleeping = httpx.get(f"http://127.0.0.1:{theirs['port']}/is_sleeping", timeout=10)
            assert is_sleeping.json()["is_sleeping"] is True
            assert rss_bytes(theirs["pid"]) < MEMORY_MIB * 2**20
            # p's engine stays on the GPU: asleep beside q's, the same process.
            assert theirs["pid"] in pids
        wait_for(
            "q's engine awake on each GPU it was given",
            lambda: all((deo.engine("gen2", g) or {}).get("state") == "active" for g in grant.gpus),
        )
        assert any(rss_bytes(deo.pid("gen2", g)) >= MEMORY_MIB * 2**20 for g in grant.gpus)

        # q is done: its engines sleep and p's wake again, on the same processes.
        q.close_rollout()
        q.release("gen")
        wait_for(
            "p's engines awake again on both GPUs",
            lambda: all((deo.engine("gen", g) or {}).get("state") == "active" for g in SHARED),
        )
        assert sorted(deo.pid("gen", g) for g in SHARED) == sorted(pids[:2])
        watcher.done.set()
        watcher.join(timeout=30)
        assert watcher.crowded == []
        assert watcher.shared_seen > 0  # an engine was seen asleep beside another

        p.close()
        q.close()
        deo.stop_draining()
        assert memory_holders_in_log(deo.log) == []
        deo.replays()
    finally:
        watcher.done.set()
        if deo.process is not None and deo.process.poll() is None:
            deo.kill()
        for pid in pids:  # the engines this test had deo start, if any outlived it
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
