"""Scale-up by waking a sleeping engine against a cold start, under a real ``deo run``.

    python -m bench.engine_wake [--startup-s 5] [--memory-mib 512] [--rounds 3] [--engine vllm]

Starts ``deo run`` in a temporary directory over an engine pool of stand-in engines
(``deo_worker.engine_standin``, real processes holding ``--memory-mib`` of touched memory that a
sleep frees; ``--startup-s`` stands in for loading a model). Each round pins the pool at 1 (the
second engine goes to sleep: its drain, the sleep call, its confirmation), then at 2 (it wakes),
then, with nobody asleep (``max_asleep = 0`` for that part), at 2 again after a stop (a cold
start). Each time is from the operator's pin to the engine being active in deo's state, read
from ``/v1/workers``, so it includes deo's tick (0.1 s here) and the API round trips. Prints each
round and the medians, and the memory a sleep freed (the engine's RSS before and after).
"""

from __future__ import annotations

import argparse
import functools
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
from bench.ports import reserve_port_range

TOKEN = "engine-wake-operator-token"
OPERATOR = {"Authorization": f"Bearer {TOKEN}"}


class _Deo:
    def __init__(self, workdir: Path, args: argparse.Namespace, max_asleep: int) -> None:
        first = reserve_port_range(8).first
        argv = [sys.executable, "-m", "deo_worker.engine_standin", "--port", "{port}"]
        argv += ["--engine", args.engine, "--memory-mib", str(args.memory_mib)]
        argv += ["--startup-s", str(args.startup_s)]
        (workdir / "deo.toml").write_text(
            '[deo]\nlog = "run.jsonl"\ntick_interval_s = 0.1\n[api]\nport = 0\n[pools.gen]\n'
            f'kind = "engine"\nengine = "{args.engine}"\nargv = {json.dumps(argv)}\n'
            f"ports = [{first}, {first + 7}]\nmax_workers = 2\nmax_asleep = {max_asleep}\n"
            "drain_timeout_s = 0.5\nstop_timeout_s = 5\nstabilization_s = 0\n"
            f"start_timeout_s = {args.startup_s + 120}\n"
            '[pools.gen.policy]\nname = "static"\ncount = 2\n'
        )
        out = (workdir / "deo.out").open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "adapters.cli", "run", "--config", str(workdir / "deo.toml")],
            cwd=workdir,
            env={**os.environ, "DEO_TOKEN": TOKEN},
            stdout=out,
            stderr=subprocess.STDOUT,
        )

        def api() -> str | None:
            for line in (workdir / "deo.out").read_text().splitlines():
                if "API on " in line:
                    return line.split("API on ", 1)[1].split()[0]
            return None

        self.url = wait_until("deo's API", api, 60)

    def workers(self) -> dict[str, dict[str, Any]]:
        body = httpx.get(f"{self.url}/v1/workers", timeout=30).json()
        return {w["id"]: w for w in body["workers"]}

    def pin(self, count: int) -> None:
        answer = httpx.post(
            f"{self.url}/v1/pools/gen/pin", json={"count": count}, headers=OPERATOR, timeout=30
        )
        answer.raise_for_status()

    def active(self, count: int) -> dict[str, dict[str, Any]]:
        def ready() -> dict[str, dict[str, Any]] | None:
            workers = self.workers()
            up = {w: v for w, v in workers.items() if v["state"] == "active"}
            return up if len(up) == count and len(workers) == count else None

        return wait_until(f"{count} active engine(s)", ready)

    def stop(self) -> None:
        httpx.post(f"{self.url}/v1/stop", json={"drain": True}, headers=OPERATOR, timeout=30)
        try:
            self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()


def _sleeping(deo: _Deo, worker_id: str) -> bool:
    return bool(deo.workers()[worker_id]["state"] == "sleeping")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--startup-s", type=float, default=5.0)
    parser.add_argument("--memory-mib", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--engine", choices=("vllm", "sglang"), default="vllm")
    args = parser.parse_args(argv)
    wake_s: list[float] = []
    cold_s: list[float] = []
    freed: list[int] = []
    with tempfile.TemporaryDirectory(prefix="deo-engine-wake-") as tmp:
        deo = _Deo(Path(tmp) / ".", args, max_asleep=1)
        try:
            deo.active(2)
            for _ in range(args.rounds):
                workers = deo.workers()
                newest = max(workers, key=lambda w: int(w.rsplit("-", 1)[1]))
                pid = workers[newest]["pid"]
                before = rss_bytes(pid)
                deo.pin(1)
                wait_until("a sleeper", functools.partial(_sleeping, deo, newest))
                freed.append(before - rss_bytes(pid))
                started = time.monotonic()
                deo.pin(2)
                woken = deo.active(2)
                wake_s.append(time.monotonic() - started)
                assert woken[newest]["pid"] == pid, "woken, not started"
                print(f"wake: {wake_s[-1]:.2f}s  (sleep freed {freed[-1] / 2**20:.0f} MiB)")
        finally:
            deo.stop()
        cold_dir = Path(tmp) / "cold"
        cold_dir.mkdir()
        deo = _Deo(cold_dir, args, max_asleep=0)
        try:
            deo.active(2)
            for _ in range(args.rounds):
                deo.pin(1)
                wait_until("one engine", lambda: len(deo.workers()) == 1 or None)
                started = time.monotonic()
                deo.pin(2)
                deo.active(2)
                cold_s.append(time.monotonic() - started)
                print(f"cold start: {cold_s[-1]:.2f}s")
        finally:
            deo.stop()
    print(
        f"\nengine {args.engine}, stand-in --startup-s {args.startup_s:g} --memory-mib "
        f"{args.memory_mib}, {args.rounds} rounds:\n"
        f"  scale-up by waking:   median {statistics.median(wake_s):.2f}s "
        f"(min {min(wake_s):.2f}, max {max(wake_s):.2f})\n"
        f"  scale-up cold start:  median {statistics.median(cold_s):.2f}s "
        f"(min {min(cold_s):.2f}, max {max(cold_s):.2f})\n"
        f"  memory a sleep freed: median {statistics.median(freed) / 2**20:.0f} MiB"
    )
    print(
        "command: python -m bench.engine_wake " + " ".join(sys.argv[1:] if argv is None else argv)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
