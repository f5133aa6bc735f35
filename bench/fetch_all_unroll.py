"""How long the what-if takes to read a fetch-all trainer's queue as one batch per step.

``python -m bench.fetch_all_unroll [--samples 5000 20000 302400]`` builds the queue samples of a
trainer that takes every full batch at once (atroposlib's ``/batch``), sampled every 2 s (302,400
samples: a week), fetching 1 to 4 batches every 3 to 20 s, fed or waiting for data at random
(seed 1), with one trainer restart in the middle; and prints, for each size, the seconds
``adapters.postmortem.fit._one_per_step`` takes on it.
"""

from __future__ import annotations

import argparse
import random
import sys
import time

from adapters.postmortem.fit import _one_per_step


def week_like(samples: int, seed: int = 1) -> list[tuple[float, int, int, int]]:
    """``samples`` queue samples, 2 s apart, of a fetch-all trainer (batches of 32)."""
    rng = random.Random(seed)
    queue = []
    taken, next_fetch_t = 0, rng.uniform(3.0, 20.0)
    for index in range(samples):
        t = 2.0 * index
        if index == samples // 2:
            taken = 0  # the trainer restarts: its counter starts again
        if t >= next_fetch_t:
            taken += rng.randint(1, 4)
            next_fetch_t = t + rng.uniform(3.0, 20.0)
        queue.append((t, rng.choice([0, 8, 32, 40, 64]), 32, taken))
    return queue


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.fetch_all_unroll")
    parser.add_argument("--samples", type=int, nargs="+", default=[5_000, 20_000, 302_400])
    args = parser.parse_args(argv)
    print(f"command: python -m bench.fetch_all_unroll --samples {' '.join(map(str, args.samples))}")
    for samples in args.samples:
        queue = week_like(samples)
        began = time.perf_counter()
        unrolled = _one_per_step(queue, end_s=queue[-1][0] + 2.0)
        took_s = time.perf_counter() - began
        assert len(unrolled) == len(queue)
        print(f"{samples:>8} samples ({samples * 2 / 86_400:.2f} days): {took_s:.3f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
