"""Preemption of generation by training through deo's GPU arbiter, under a real ``deo run``.

    python -m bench.arbiter_run [--engines 4] [--memory-mib 256] [--rounds 5] [--drain-s 0.5]

Starts ``deo run`` in a temporary directory with an ``[arbiter]`` over ``--engines`` GPUs (GPU
health from the NVML file backend: no GPU needed) and an engine pool of stand-in engines
(``deo_worker.engine_standin``, real processes holding ``--memory-mib`` of touched memory that a
sleep frees). Pipeline ``gen`` runs its generation on all of them; pipeline ``train`` trains on
the first half. Each round, through ``deo_worker.arbiter_client``:

- *preempt*: ``train`` asks for its GPUs; the time until its grant comes back (the engines there
  left routing, got the sleep call after ``--drain-s`` at most with nothing in flight, and
  confirmed their sleep);
- *wake*: ``train`` releases; the time until every engine is awake again in deo's state
  (``/v1/workers``; the generation pipeline's rollout stays open).

Prints each round, the medians, and the memory each sleep freed (RSS before and after).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench.polling import rss_bytes, wait_until
from bench.ports import reserve_port, reserve_port_range
from deo_worker.arbiter_client import ArbiterClient, Cluster

TOKEN = "arbiter-bench-token"
HEALTHY = {
    "memory_used_bytes": 2**30,
    "memory_total_bytes": 80 * 2**30,
    "temperature_c": 45,
    "throttle_reasons": [],
    "errors_total": 0,
}


def _config(workdir: Path, args: argparse.Namespace, port: int, gpus: list[str]) -> Path:
    first = reserve_port_range(2 * args.engines).first
    argv = [sys.executable, "-m", "deo_worker.engine_standin", "--port", "{port}"]
    argv += ["--engine", "vllm", "--memory-mib", str(args.memory_mib)]
    (workdir / "gpus.json").write_text(json.dumps({g: HEALTHY for g in gpus}))
    path = workdir / "deo.toml"
    path.write_text(
        f"""
[deo]
log = "run.jsonl"
fsync = false
tick_interval_s = 0.1
gpus = {json.dumps(gpus)}
[api]
port = {port}
[nvml]
backend = "file"
file = "gpus.json"
[arbiter]
gpus = {json.dumps(gpus)}
[pools.gen]
kind = "engine"
engine = "vllm"
argv = {json.dumps(argv)}
gpus_per_worker = 1
max_workers = {args.engines}
max_asleep = {args.engines}
ports = [{first}, {first + 2 * args.engines - 1}]
drain_timeout_s = {args.drain_s}
control_timeout_s = 30
[pools.gen.policy]
name = "static"
count = 0
"""
    )
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", type=int, default=4)
    parser.add_argument("--memory-mib", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--drain-s", type=float, default=0.5)
    args = parser.parse_args(argv)
    gpus = [str(i) for i in range(args.engines)]
    half = gpus[: max(1, args.engines // 2)]
    print(
        f"command: python -m bench.arbiter_run {' '.join(sys.argv[1:] if argv is None else argv)}"
    )
    with tempfile.TemporaryDirectory(prefix="deo-arbiter-bench-") as tmp:
        workdir = Path(tmp)
        port = reserve_port()
        url = f"http://127.0.0.1:{port}"
        config = _config(workdir, args, port, gpus)
        env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
        proc = subprocess.Popen(
            [sys.executable, "-m", "adapters.cli", "run", "--config", str(config)],
            cwd=workdir,
            env={**env, "DEO_TOKEN": TOKEN},
            stdout=(workdir / "deo.out").open("wb"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        pids: list[int] = []
        try:
            wait_until(
                "deo's arbiter",
                lambda: "arbiter" in httpx.get(f"{url}/global-status", timeout=5).json(),
            )
            gen = ArbiterClient(url, TOKEN, pipeline="gen")
            train = ArbiterClient(url, TOKEN, pipeline="train")
            gen.register([Cluster("gen", "GENERATION", gpus, engine_pool="gen")])
            train.register([Cluster("train", "ACTOR_TRAINING", half)])
            gen.open_rollout()
            gen.progress("rollout", 10_000, 0)
            started = time.monotonic()
            gen.request("gen", "GENERATION", deadline_s=300)
            first_s = time.monotonic() - started

            def workers() -> dict[str, dict[str, Any]]:
                body = httpx.get(f"{url}/v1/workers", timeout=10).json()
                return {w["gpus"][0]: w for w in body["workers"]}

            def all_awake() -> dict[str, dict[str, Any]] | None:
                found = workers()
                awake = len(found) == len(gpus) and all(
                    w["state"] == "active" for w in found.values()
                )
                return found if awake else None

            engines = wait_until("every engine awake", all_awake)
            pids = [w["pid"] for w in engines.values()]
            print(f"first generation grant (cold start of {args.engines} engines): {first_s:.2f}s")
            preempt_s: list[float] = []
            wake_s: list[float] = []
            freed: list[int] = []
            for round_ in range(args.rounds):
                before = {g: rss_bytes(engines[g]["pid"]) for g in half}
                started = time.monotonic()
                train.request("train", "ACTOR_TRAINING", deadline_s=300)
                preempt_s.append(time.monotonic() - started)
                after = {g: rss_bytes(engines[g]["pid"]) for g in half}
                freed.append(min(before[g] - after[g] for g in half))
                started = time.monotonic()
                train.release("train")
                wait_until("every engine awake again", all_awake)
                wake_s.append(time.monotonic() - started)
                print(
                    f"round {round_ + 1}: preempt {preempt_s[-1]:.2f}s (each sleep freed "
                    f">= {freed[-1] / 2**20:.0f} MiB), wake {wake_s[-1]:.2f}s"
                )
            print(
                f"median over {args.rounds} rounds: preempt {statistics.median(preempt_s):.2f}s,"
                f" wake {statistics.median(wake_s):.2f}s ({len(half)} of {args.engines} engines,"
                f" drain_timeout_s {args.drain_s:g}, tick 0.1 s)"
            )
            gen.close()
            train.close()
            httpx.post(
                f"{url}/v1/stop",
                json={"drain": True},
                headers={"Authorization": f"Bearer {TOKEN}"},
                timeout=10,
            )
            proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                proc.wait(timeout=20)
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
    return 0


if __name__ == "__main__":
    sys.exit(main())
