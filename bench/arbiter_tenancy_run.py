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
import statistics
import sys
import threading
import time
from typing import Any

import httpx

from bench.arbiter_deo import TOKEN, arbiter_deo, engine_pool
from bench.polling import wait_until
from deo_worker.arbiter_client import ArbiterClient, Cluster


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
    pools = "".join(
        engine_pool(
            name,
            engines=args.gpus,
            ports=args.gpus,
            memory_mib=args.memory_mib,
            drain_s=args.drain_s,
        )
        for name in ("a", "b")
    )
    with arbiter_deo("deo-tenancy-bench-", gpus, pools) as deo:
        url, pids = deo.url, deo.pids
        watch = Watch(url)
        try:
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
        finally:
            watch.done.set()
    return 0


if __name__ == "__main__":
    sys.exit(main())
