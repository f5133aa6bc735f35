"""A stand-in RL trainer for ``deo demo``: registers with an atroposlib API server, pulls batches.

``python -m adapters.demo.trainer --api URL --batch-size-seqs 32 --phases 0:1.0,20:0.4,40:2.5
--duration-s 60`` registers (``POST /register``), then loops: ``GET /batch``; with a batch it
"trains" for the step time of the current phase (seconds since start : seconds per step), without
one it waits and counts the wait. It prints one JSON line per step and a final one with
``"done": true``, and exits 0 after ``--duration-s`` or on SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from collections.abc import Callable, Sequence
from types import FrameType

import httpx

__all__ = ["main", "parse_phases"]

_POLL_S = 0.05


def parse_phases(text: str) -> tuple[tuple[float, float], ...]:
    """``"0:1.0,20:0.4"`` -> ((0.0, 1.0), (20.0, 0.4)); ValueError naming the bad part."""
    phases = []
    for part in text.split(","):
        start, _, step = part.partition(":")
        try:
            phase = (float(start), float(step))
        except ValueError:
            raise ValueError(f"--phases: {part!r} is not START_S:STEP_S") from None
        if phase[0] < 0 or not phase[1] > 0:
            raise ValueError(f"--phases: {part!r}: start must be >= 0 and step time > 0")
        phases.append(phase)
    if not phases or phases[0][0] != 0:
        raise ValueError("--phases: the first phase must start at 0")
    return tuple(sorted(phases))


def _step_s(phases: Sequence[tuple[float, float]], elapsed_s: float) -> float:
    return [step for start, step in phases if elapsed_s >= start][-1]


def _sleep_unless(seconds: float, stopping: Callable[[], bool]) -> None:
    # In short naps: a SIGTERM handler runs between them, not in the middle of a long sleep.
    end = time.monotonic() + seconds
    while not stopping() and (left := end - time.monotonic()) > 0:
        time.sleep(min(left, _POLL_S))


def _register(client: httpx.Client, batch_size_seqs: int, deadline: float) -> None:
    body = {
        "wandb_group": "deo-demo",
        "wandb_project": "deo-demo",
        "batch_size": batch_size_seqs,
        "max_token_len": 64,
        "checkpoint_dir": "",
        "save_checkpoint_interval": 0,
        "starting_step": 0,
        "num_steps": 1_000_000,
    }
    while True:
        try:
            client.post("/register", json=body).raise_for_status()
            return
        except httpx.HTTPError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="demo_trainer", description=__doc__)
    parser.add_argument("--api", required=True, help="the atroposlib API server's URL")
    parser.add_argument("--batch-size-seqs", type=int, default=32)
    parser.add_argument("--phases", default="0:1.0", help="START_S:STEP_S,...")
    parser.add_argument("--duration-s", type=float, default=60.0)
    args = parser.parse_args(argv)
    try:
        phases = parse_phases(args.phases)
    except ValueError as exc:
        parser.error(str(exc))

    stopping = False

    def stop(signum: int, frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True

    # Ctrl-C reaches the whole demo: end the run as a stop does, with the summary line.
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, stop)
    start = time.monotonic()
    steps = 0
    waited_s = 0.0  # waiting for a batch after the first one arrived
    first_batch_s: float | None = None
    with httpx.Client(base_url=args.api, timeout=10.0) as client:
        _register(client, args.batch_size_seqs, deadline=start + 30.0)
        while not stopping and (elapsed := time.monotonic() - start) < args.duration_s:
            asked = time.monotonic()
            try:
                batch = client.get("/batch").raise_for_status().json().get("batch")
            except httpx.HTTPError as exc:
                print(json.dumps({"t": elapsed, "error": str(exc)}), flush=True)
                batch = None
            if batch is None:
                time.sleep(_POLL_S)
                if first_batch_s is not None:
                    waited_s += time.monotonic() - asked
                continue
            if first_batch_s is None:
                first_batch_s = elapsed
            steps += 1
            step_s = _step_s(phases, elapsed)
            seqs = sum(len(group["tokens"]) for group in batch)
            line = {"t": round(elapsed, 3), "step": steps, "seqs": seqs, "step_s": step_s}
            print(json.dumps({**line, "waited_s": round(waited_s, 3)}), flush=True)
            _sleep_unless(step_s, lambda: stopping)  # the training step
    total = {
        "done": True,
        "steps": steps,
        "waited_s": round(waited_s, 3),
        "first_batch_s": first_batch_s,
        "elapsed_s": round(time.monotonic() - start, 3),
    }
    print(json.dumps(total), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
