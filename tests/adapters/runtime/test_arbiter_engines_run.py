"""A real run: ``deo run`` (GPU health from the NVML file backend, no GPUs needed) serves the GPU
arbiter; pipeline p1's generation runs on an engine pool of stand-in engines, one per GPU; p2's
training loop asks for two of those GPUs through deo_worker.arbiter_client. Its grant comes back
only once the engines there confirmed their sleep (their memory freed); generation wakes again
after the release; deo killed with SIGKILL mid-preemption and restarted loses no engine, starts
none twice and gives no GPU to two owners."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from pathlib import Path
from typing import Any

import httpx
from arbiter_deo import GPUS, ArbiterDeo, standin_engine_pool
from engine_standins import rss_bytes
from waiting import wait_for

from deo_worker.arbiter_client import ArbiterClient, Cluster, Grant

TOKEN = "arbiter-engines-token"
MEMORY_MIB = 64
#: How late each stand-in answers a sleep or wake call: how long an engine is falling_asleep.
CONTROL_DELAY_S = 5.0


class Deo(ArbiterDeo):
    """``deo run`` whose engine pool ``gen`` starts a stand-in engine per GPU, each answering
    sleep and wake calls CONTROL_DELAY_S late."""

    def __init__(self, tmp_path: Path) -> None:
        # Every sleep and wake call answers CONTROL_DELAY_S late, so an engine stays
        # falling_asleep long enough for the test to see it and kill deo there.
        standin = ["--memory-mib", str(MEMORY_MIB), "--startup-s", "0.5"]
        standin += ["--control-delay-s", str(CONTROL_DELAY_S)]
        pools = standin_engine_pool(
            "gen",
            engines=4,
            standin_args=standin,
            drain_timeout_s=2.0,
            control_timeout_s=4 * CONTROL_DELAY_S,
            control_attempts=2,
            stop_timeout_s=2.0,
        )
        super().__init__(tmp_path, TOKEN, extra_config=pools)

    def workers(self) -> dict[str, dict[str, Any]]:
        body = httpx.get(f"{self.url}/v1/workers", timeout=10).json()
        return {w["id"]: w for w in body["workers"]}

    def on_gpu(self) -> dict[str, dict[str, Any]]:
        """GPU -> the engine on it (one each, or the test fails)."""
        found: dict[str, dict[str, Any]] = {}
        for worker in self.workers().values():
            for gpu in worker["gpus"]:
                assert gpu not in found, f"GPU {gpu}: {found[gpu]['id']} and {worker['id']}"
                found[gpu] = worker
        return found

    def arbiter(self) -> dict[str, Any]:
        status: dict[str, Any] = httpx.get(f"{self.url}/v1/arbiter", timeout=10).json()
        return status


def test_training_preempts_engines_and_a_kill_mid_preemption_loses_nothing(
    tmp_path: Path,
) -> None:
    deo = Deo(tmp_path)
    deo.start()
    pids: list[int] = []
    try:
        p1 = ArbiterClient(deo.url, TOKEN, pipeline="p1", poll_s=2.0)
        p2 = ArbiterClient(deo.url, TOKEN, pipeline="p2", poll_s=2.0)
        p1.register(
            [
                Cluster("train", "ACTOR_TRAINING", ["0", "1"]),
                Cluster("gen", "GENERATION", GPUS, engine_pool="gen"),
            ]
        )
        p2.register([Cluster("train", "ACTOR_TRAINING", ["2", "3"])])
        p1.open_rollout()
        p1.progress("rollout", 256, 0)
        gen = p1.request("gen", "GENERATION", deadline_s=60)
        assert gen.gpus  # answered once an engine is confirmed awake
        assert any(w["state"] == "active" for w in deo.workers().values())
        engines = wait_for(
            "four engines awake",
            lambda: (
                len(deo.on_gpu()) == 4
                and all(w["state"] == "active" for w in deo.on_gpu().values())
                and deo.on_gpu()
            ),
        )
        pids = [w["pid"] for w in engines.values()]
        ids = {gpu: w["id"] for gpu, w in engines.items()}
        assert all(rss_bytes(pid) >= MEMORY_MIB * 2**20 for pid in pids)

        # p2 trains on GPUs 2 and 3: deo is killed while their engines go to sleep.
        answer: list[Grant | BaseException] = []

        def train() -> None:
            try:
                answer.append(p2.request("train", "ACTOR_TRAINING", deadline_s=120))
            except BaseException as exc:  # reported below
                answer.append(exc)

        waiter = threading.Thread(target=train)
        waiter.start()
        # The sleep call is in flight for CONTROL_DELAY_S: falling_asleep holds that long.
        wait_for(
            "an engine on 2 or 3 falling asleep",
            lambda: "falling_asleep" in {deo.on_gpu()[g]["state"] for g in ("2", "3")},
        )
        deo.kill()
        deo.start()
        waiter.join(timeout=120)
        assert answer and isinstance(answer[0], Grant), answer
        assert answer[0].gpus == ("2", "3")
        # The grant came back only after the engines there confirmed their sleep.
        after = deo.on_gpu()
        assert {g: after[g]["state"] for g in ("2", "3")} == {"2": "sleeping", "3": "sleeping"}
        assert all(rss_bytes(after[g]["pid"]) < MEMORY_MIB * 2**20 for g in ("2", "3"))
        # Nothing lost or started twice: the same engines, the same processes, one per GPU.
        assert {g: w["id"] for g, w in after.items()} == ids
        assert sorted(w["pid"] for w in after.values()) == sorted(pids)
        gen_row = deo.arbiter()["pipelines"]["p1"]["clusters"]["gen"]
        assert gen_row["active_gpus"] == ["0", "1"]
        assert deo.arbiter()["pipelines"]["p2"]["clusters"]["train"]["held"] == ["2", "3"]

        # Released: p1's rollout is still open, so its engines there wake again.
        p2.release("train")
        wait_for(
            "the engines on 2 and 3 awake again",
            lambda: all(deo.on_gpu()[g]["state"] == "active" for g in ("2", "3")),
        )
        assert {g: w["id"] for g, w in deo.on_gpu().items()} == ids
        p1.close()
        p2.close()
        deo.stop_draining()
        deo.replays()
    finally:
        if deo.process is not None and deo.process.poll() is None:
            deo.kill()
        for pid in pids:  # the engines this test had deo start, if any outlived it
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
