"""``deo run`` against a real atroposlib API server, a trainer pulling batches, real env workers.

The trainer is ``adapters.demo.trainer`` (registers, pulls ``GET /batch``, "trains" for a step
time that changes by phase); env workers are ``deo_worker.demo_env`` processes posting scored
groups and draining on SIGUSR1. Every scenario ends with tools/replay verifying deo's log.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import AtroposApi
from spawned import stop_process
from test_run import Deo, deo, pool, verified
from waiting import wait_for

__all__ = ["deo"]  # the fixture, imported for these tests

GROUP = 4
BATCH = 16


def commands_of(instance: Deo, kind: str) -> list[dict[str, Any]]:
    return [command for _, command in instance.commands(kind)]


def ticked_past(instance: Deo, t_s: float) -> bool:
    """Whether deo has judged the run up to ``t_s`` (wall clock): a tick at or after it."""
    return any(e["t"] >= t_s for e in instance.events("Tick"))


@pytest.fixture
def trainer(tmp_path: Path) -> Iterator[Callable[[str, str], subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []

    def start(api_url: str, phases: str) -> subprocess.Popen[bytes]:
        argv = [sys.executable, "-m", "adapters.demo.trainer", "--api", api_url]
        argv += ["--batch-size-seqs", str(BATCH), "--phases", phases, "--duration-s", "120"]
        out = (tmp_path / f"trainer-{len(started)}.out").open("wb")
        started.append(subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT))
        return started[-1]

    yield start
    for proc in started:
        stop_process(proc)


def envs_pool(api: AtroposApi, *, latency_s: float, max_workers: int = 5, **fields: Any) -> str:
    argv = [sys.executable, "-m", "deo_worker.demo_env", "--api", api.url]
    argv += ["--group-size", str(GROUP), "--latency-s", str(latency_s)]
    argv += ["--groups-in-flight", "1", "--seed", "{index}"]
    buffer = "\n".join(
        [
            'name = "buffer"',
            "target_batches = 1.5",
            "refill_s = 3.0",
            "rate_window_s = 3.0",
            "integral_s = 60.0",
            "max_down_fraction = 0.5",
            "down_cooldown_s = 1.0",
        ]
    )
    source = f'[pools.envs.source]\nkind = "atropos"\nurl = "{api.url}"\n'
    source += f"group_size = {GROUP}\ninterval_s = 0.3\n"
    text = pool(
        "envs",
        argv,
        min_workers=1,
        max_workers=max_workers,
        stabilization_s=2.0,
        drain_timeout_s=10.0,
        metrics_stale_s=30.0,
        policy=buffer,
        **fields,
    )
    return text + source


def active(instance: Deo) -> int:
    return len(instance.workers("active"))


def test_starving_trainer_scales_up_then_slow_trainer_scales_down_and_envs_disconnect(
    deo: Callable[[str], Deo],
    atropos_api: AtroposApi,
    trainer: Callable[[str, str], subprocess.Popen[bytes]],
) -> None:
    # One env worker makes ~4 seq / 1 s; a trainer taking 16 every 0.2 s wants ~80 seq/s.
    d = deo(envs_pool(atropos_api, latency_s=1.0))
    d.start()
    trainer(atropos_api.url, "0:0.2,20:10")
    wait_for("scale-up beyond 3 workers", lambda: active(d) >= 3, timeout_s=25)
    grown = commands_of(d, "ScalePool")
    assert any(c["target"] > c["previous"] and c["source"] == "policy" for c in grown)
    # From 20 s the trainer takes a batch every 10 s: the queue fills, and once two slow steps
    # tell a slower trainer from a pause, deo scales down.
    wait_for("the queue to fill", lambda: queued_batches(d) >= 1.5, timeout_s=40)
    wait_for("scale-down to the minimum", lambda: len(d.workers()) == 1, timeout_s=60)
    drained = {c["worker_id"] for c in commands_of(d, "DrainWorker")}
    assert drained
    exits = {e["worker_id"]: e for e in d.events("WorkerExited")}
    for worker_id in drained:
        wait_for(f"{worker_id} to exit", lambda w=worker_id: w in exits_of(d), timeout_s=15)
    exits = exits_of(d)
    assert all(exits[w]["exit_code"] == 0 for w in drained), exits
    logs = [(d.dir / "deo-workers" / f"{w}.log").read_text() for w in drained]
    assert all("disconnected" in text or "drained" in text for text in logs), logs
    verified(d)


def exits_of(instance: Deo) -> dict[str, dict[str, Any]]:
    return {e["worker_id"]: e for e in instance.events("WorkerExited")}


def queued_batches(instance: Deo) -> float:
    queue = instance.status()["pools"]["envs"]["queue"]
    return 0.0 if queue is None else float(queue["queued_batches"])


def test_unregistered_trainer_holds_with_a_clear_status(
    deo: Callable[[str], Deo], atropos_api: AtroposApi
) -> None:
    d = deo(envs_pool(atropos_api, latency_s=1.0))
    d.start()
    wait_for(
        "the source to report no trainer",
        lambda: "no trainer registered" in (d.status()["pools"]["envs"]["source_error"] or ""),
    )
    wait_for(
        "the source_down alert (a second failed read)",
        lambda: {"alert": "source_down", "subject": "envs"} in d.status()["alerts"],
    )
    assert len(d.workers()) == 1  # held at the minimum: nothing to scale on
    assert not [c for c in commands_of(d, "ScalePool") if c["source"] == "policy"]
    show = subprocess.run(
        [sys.executable, "-m", "adapters.cli", "status", "--url", d.url],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert "no trainer registered" in show.stdout, show.stdout
    verified(d)


def reregistered(api: AtroposApi) -> bool:
    """Reset the API server's data and register the trainer; true once /info shows the batch."""
    httpx.get(api.url + "/reset_data", timeout=30)  # a 500 when nothing was posted yet: fine
    api.register_trainer(BATCH)
    info = httpx.get(api.url + "/info", timeout=30).json()
    return bool(info["batch_size"] == BATCH)


def test_api_server_down_holds_the_count_and_recovers(
    deo: Callable[[str], Deo],
    atropos_api: AtroposApi,
    trainer: Callable[[str, str], subprocess.Popen[bytes]],
) -> None:
    d = deo(envs_pool(atropos_api, latency_s=1.0))
    d.start()
    trainer(atropos_api.url, "0:0.2")
    wait_for("scale-up", lambda: active(d) >= 3, timeout_s=25)
    atropos_api.stop()
    wait_for(
        "the outage to be seen",
        lambda: {"alert": "source_down", "subject": "envs"} in d.status()["alerts"],
    )
    target = d.status()["pools"]["envs"]["target"]
    # Longer than the stabilization window and the policy's down cooldown.
    seen_t = time.time()
    wait_for("four seconds of ticks", lambda: ticked_past(d, seen_t + 4))
    assert d.status()["pools"]["envs"]["target"] == target
    assert len(d.workers()) >= 3
    downs = [c for c in commands_of(d, "DrainWorker")]
    assert not downs  # no scale-down while blind
    atropos_api.start()  # the same port; its state starts empty
    # Envs still posting groups from before the outage can reach the new server before the
    # trainer does; atroposlib then ignores the trainer's /register (the queue exists already)
    # and reports batch_size -1 until /reset_data. deo holds meanwhile; the trainer resets and
    # registers again, as often as an env's group lands between the two.
    wait_for("the trainer's registration to take", lambda: reregistered(atropos_api))
    wait_for(
        "samples again",
        lambda: {"alert": "source_down", "subject": "envs"} not in d.status()["alerts"],
    )
    assert d.status()["pools"]["envs"]["source_error"] is None
    resolved = commands_of(d, "ResolveAlert")
    assert any(c["alert"] == "source_down" for c in resolved)
    verified(d)
