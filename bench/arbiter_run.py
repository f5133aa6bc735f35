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
import statistics
import sys
import time
from typing import Any

import httpx

from bench.arbiter_deo import TOKEN, arbiter_deo, engine_pool
from bench.polling import rss_bytes, wait_until
from deo_worker.arbiter_client import ArbiterClient, Cluster


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
    pools = engine_pool(
        "gen",
        engines=args.engines,
        ports=2 * args.engines,
        memory_mib=args.memory_mib,
        drain_s=args.drain_s,
    )
    with arbiter_deo("deo-arbiter-bench-", gpus, pools) as deo:
        url = deo.url
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
            awake = len(found) == len(gpus) and all(w["state"] == "active" for w in found.values())
            return found if awake else None

        engines = wait_until("every engine awake", all_awake)
        deo.pids.update(w["pid"] for w in engines.values())
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
