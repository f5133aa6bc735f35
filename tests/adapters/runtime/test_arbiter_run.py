"""The GPU arbiter served by ``deo run``, a real process (GPU health from the NVML file backend):
two pipelines' training loops use deo_worker.arbiter_client; deo is killed with SIGKILL while a
request waits and restarted; the log replays."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from arbiter_deo import GPUS, ArbiterDeo
from waiting import wait_for

from deo_worker.arbiter_client import ArbiterClient, Cluster, Grant

TOKEN = "test-operator-token"


class Deo(ArbiterDeo):
    """``deo run`` with four GPUs, all shared by the arbiter unless ``arbiter_gpus`` says
    otherwise."""

    def __init__(self, tmp_path: Path, arbiter_gpus: list[str] = GPUS) -> None:
        super().__init__(tmp_path, TOKEN, arbiter_gpus)


@pytest.fixture
def deo(tmp_path: Path) -> Iterator[Deo]:
    """A deo for the test, killed at its end if the test left it running (a failure)."""
    running = Deo(tmp_path)
    yield running
    if running.process is not None and running.process.poll() is None:
        running.kill()


def owners(status: dict[str, Any]) -> dict[str, list[str]]:
    """GPU -> the clusters that hold it or run generation on it."""
    found: dict[str, list[str]] = {}
    for pipeline, row in status["pipelines"].items():
        for name, cluster in row["clusters"].items():
            for gpu in cluster.get("active_gpus", []) + cluster["held"]:
                found.setdefault(gpu, []).append(f"{pipeline}/{name}")
    return found


def test_training_preempts_generation_and_a_waiting_request_survives_a_kill(deo: Deo) -> None:
    deo.start()
    trainers = {
        name: ArbiterClient(deo.url, TOKEN, pipeline=name, poll_s=2.0) for name in ("p1", "p2")
    }
    for client in trainers.values():
        client.register(
            [Cluster("train", "ACTOR_TRAINING", ["0", "1"]), Cluster("gen", "GENERATION", GPUS)]
        )
        client.open_rollout()
        client.progress("rollout", 64, 0)
    p1, p2 = trainers["p1"], trainers["p2"]
    gen1 = p1.request("gen", "GENERATION", deadline_s=60)
    gen2 = p2.request("gen", "GENERATION", deadline_s=60)
    assert gen1.gpus and gen2.gpus and not set(gen1.gpus) & set(gen2.gpus)
    assert len(gen1.gpus) + len(gen2.gpus) == 4  # the gap ratio shares every GPU

    # p1 trains on 0 and 1: whatever generation ran there is put to sleep first.
    train1 = p1.release_and_request("gen", "train", "ACTOR_TRAINING", deadline_s=60)
    assert train1.gpus == ("0", "1")
    status = deo.status()
    assert all(len(holders) == 1 for holders in owners(status).values()), owners(status)
    assert status["pipelines"]["p2"]["clusters"]["gen"]["active_gpus"] == ["2", "3"]

    # p2 wants the same GPUs: it waits; deo is killed while it waits, then restarted.
    answer: list[Grant | BaseException] = []

    def wait_p2() -> None:
        try:
            answer.append(p2.release_and_request("gen", "train", "ACTOR_TRAINING", deadline_s=120))
        except BaseException as exc:  # reported below
            answer.append(exc)

    waiter = threading.Thread(target=wait_p2)
    waiter.start()
    wait_for(
        "p2's request queued",
        lambda: "waiting" in deo.status()["pipelines"]["p2"]["clusters"]["train"],
    )
    deo.kill()
    deo.start()
    status = deo.status()
    assert "waiting" in status["pipelines"]["p2"]["clusters"]["train"]  # from the log
    assert status["pipelines"]["p1"]["clusters"]["train"]["held"] == ["0", "1"]
    assert answer == []
    p1.release("train")
    waiter.join(timeout=60)
    assert answer and isinstance(answer[0], Grant), answer
    assert answer[0].gpus == ("0", "1")
    status = deo.status()
    assert all(len(holders) == 1 for holders in owners(status).values()), owners(status)
    # Generation comes back after the release: p1's rollout reopens and gets GPUs again.
    p1.open_rollout()
    again = p1.request("gen", "GENERATION", deadline_s=60)
    assert again.gpus and not set(again.gpus) & {"0", "1"}
    for client in trainers.values():
        client.close()
    assert deo.stop() == 0
    deo.replays()


def test_a_restart_with_other_arbiter_gpus_is_refused_and_another_order_is_not(
    deo: Deo,
) -> None:
    deo.start()
    assert deo.status()["gpus"] == GPUS
    assert deo.stop() == 0
    deo.write_config(list(reversed(GPUS)))  # the same GPUs in another order: the log's stay
    deo.start()
    assert deo.status()["gpus"] == GPUS
    assert deo.stop() == 0
    deo.write_config(["0", "1"])
    deo.start(refused=True)
    assert deo.process is not None
    assert deo.process.wait(timeout=60) == 2
    assert "arbiter.gpus was refused" in deo.output.read_text()


def declarations(log: Path) -> list[dict[str, Any]]:
    """The ArbiterGpusDeclared events of ``log``, as recorded."""
    records = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    return [
        r["event"]
        for r in records
        if r.get("kind") == "event" and r["event"].get("@") == "ArbiterGpusDeclared"
    ]


def test_the_planner_settings_are_recorded_and_a_change_is_declared_again(deo: Deo) -> None:
    deo.start()
    assert deo.stop() == 0
    (first,) = declarations(deo.log)
    assert first["planner"]["reserve_s"] == 3600.0 and first["planner"]["name"] == "deo"
    deo.start()  # the same settings: nothing declared again
    assert deo.stop() == 0
    assert len(declarations(deo.log)) == 1
    deo.config.write_text(deo.config.read_text() + "[arbiter.planner]\nreserve_s = 120\n")
    deo.start()
    assert deo.stop() == 0
    assert [d["planner"]["reserve_s"] for d in declarations(deo.log)] == [3600.0, 120.0]
    deo.replays()
