"""Generation time-shared between two pipelines whose clusters are run by deo engine pools on the
same GPUs, under a real ``deo run``.

    python -m bench.arbiter_tenancy_run [--gpus 2] [--memory-mib 256] [--rounds 5] [--drain-s 0.5]

Starts ``deo run`` in a temporary directory with an ``[arbiter]`` over ``--gpus`` GPUs (GPU
health from the NVML file backend: no GPU needed) and two engine pools of stand-in engines
(``deo_worker.engine_standin``, real processes holding ``--memory-mib`` of touched memory that a
sleep frees), ``a`` and ``b``, each running the generation cluster of the pipeline of that name
on every GPU. Pipeline ``a`` generates; each round, through ``deo_worker.arbiter_client``:

- *hand over*: ``b`` opens its rollout with far more to do and asks; the time until its grant
  comes back (``a``'s engines on the GPUs ``b`` is given left routing, slept and confirmed it;
  ``b``'s engines there started, in the first round, or woke, and one confirmed it is awake);
- *hand back*: ``b`` closes its rollout and releases; the time until every engine of ``a`` is
  awake again in deo's state (``/v1/workers``).

Prints each round and the medians, and the most workers seen holding one GPU's memory (deo's
state read every 50 ms; anything above 1 breaks deo's invariant 1).
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
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from bench.polling import wait_until
from bench.ports import reserve_port, reserve_port_range
from deo_worker.arbiter_client import ArbiterClient, Cluster

TOKEN = "arbiter-tenancy-bench-token"
HEALTHY = {
    "memory_used_bytes": 2**30,
    "memory_total_bytes": 80 * 2**30,
    "temperature_c": 45,
    "throttle_reasons": [],
    "errors_total": 0,
}


def _pool(name: str, args: argparse.Namespace) -> str:
    first = reserve_port_range(args.gpus).first
    argv = [sys.executable, "-m", "deo_worker.engine_standin", "--port", "{port}"]
    argv += ["--engine", "vllm", "--memory-mib", str(args.memory_mib)]
    return f"""[pools.{name}]
kind = "engine"
engine = "vllm"
argv = {json.dumps(argv)}
gpus_per_worker = 1
max_workers = {args.gpus}
max_asleep = {args.gpus}
ports = [{first}, {first + args.gpus - 1}]
drain_timeout_s = {args.drain_s}
control_timeout_s = 30
[pools.{name}.policy]
name = "static"
count = 0
"""


def _config(workdir: Path, args: argparse.Namespace, port: int, gpus: list[str]) -> Path:
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
"""
        + _pool("a", args)
        + _pool("b", args)
    )
    return path


class Watch(threading.Thread):
    """Reads deo's workers every 50 ms; keeps the most seen holding one GPU's memory."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.done = threading.Event()
        self.most_holding = 0

    def run(self) -> None:
        while not self.done.wait(0.05):
            with contextlib.suppress(httpx.HTTPError):
                body = httpx.get(f"{self.url}/v1/workers", timeout=10).json()
                holding: dict[str, int] = {}
                for worker in body["workers"]:
                    if worker["state"] != "sleeping":
                        for gpu in worker["gpus"]:
                            holding[gpu] = holding.get(gpu, 0) + 1
                self.most_holding = max(self.most_holding, *holding.values(), 0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--memory-mib", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--drain-s", type=float, default=0.5)
    args = parser.parse_args(argv)
    gpus = [str(i) for i in range(args.gpus)]
    shown = " ".join(sys.argv[1:] if argv is None else argv)
    print(f"command: python -m bench.arbiter_tenancy_run {shown}")
    with tempfile.TemporaryDirectory(prefix="deo-tenancy-bench-") as tmp:
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
        pids: set[int] = set()
        watch = Watch(url)
        try:
            wait_until(
                "deo's arbiter",
                lambda: "arbiter" in httpx.get(f"{url}/global-status", timeout=5).json(),
            )
            a = ArbiterClient(url, TOKEN, pipeline="a")
            b = ArbiterClient(url, TOKEN, pipeline="b")
            a.register([Cluster("gen", "GENERATION", gpus, engine_pool="a")])
            b.register([Cluster("gen", "GENERATION", gpus, engine_pool="b")])

            def engines(pool: str) -> dict[str, dict[str, Any]]:
                body = httpx.get(f"{url}/v1/workers", timeout=10).json()
                found = {w["gpus"][0]: w for w in body["workers"] if w["pool"] == pool}
                pids.update(w["pid"] for w in found.values() if w["pid"])
                return found

            def a_awake() -> bool:
                found = engines("a")
                return len(found) == len(gpus) and all(
                    w["state"] == "active" for w in found.values()
                )

            watch.start()
            a.open_rollout()
            a.progress("rollout", 1_000, 0)
            a.request("gen", "GENERATION", deadline_s=300)
            wait_until("a's engines awake", a_awake)
            over_s: list[float] = []
            back_s: list[float] = []
            for round_ in range(args.rounds):
                b.open_rollout()
                b.progress("rollout", 100_000, 0)
                started = time.monotonic()
                grant = b.request("gen", "GENERATION", deadline_s=300)
                over_s.append(time.monotonic() - started)
                engines("b")
                started = time.monotonic()
                b.close_rollout()
                b.release("gen")
                wait_until("a's engines awake again", a_awake)
                back_s.append(time.monotonic() - started)
                print(
                    f"round {round_ + 1}: hand over {len(grant.gpus)} GPU(s) to b "
                    f"{over_s[-1]:.2f}s, hand back {back_s[-1]:.2f}s"
                )
            watch.done.set()
            watch.join(timeout=10)
            print(
                f"median over {args.rounds} rounds: hand over {statistics.median(over_s):.2f}s "
                f"(first, with b's cold starts: {over_s[0]:.2f}s), hand back "
                f"{statistics.median(back_s):.2f}s ({args.gpus} GPUs, {args.memory_mib} MiB "
                f"engines, drain_timeout_s {args.drain_s:g}, tick 0.1 s); most workers seen "
                f"holding one GPU's memory: {watch.most_holding}"
            )
            a.close()
            b.close()
            httpx.post(
                f"{url}/v1/stop",
                json={"drain": True},
                headers={"Authorization": f"Bearer {TOKEN}"},
                timeout=10,
            )
            proc.wait(timeout=120)
        finally:
            watch.done.set()
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                proc.wait(timeout=20)
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
    return 0


if __name__ == "__main__":
    sys.exit(main())
