"""A minimal deo worker: does "work" in a loop, heartbeats, drains on SIGUSR1.

``python examples/worker.py SECONDS_PER_ITEM``. deo starts it with DEO_WORKER_ID, DEO_POOL,
CUDA_VISIBLE_DEVICES and DEO_HEARTBEAT_FILE in its environment. On the drain signal it finishes
the item in hand and exits 0. Run by hand, it works the same without heartbeats.
"""

import os
import sys
import time

from deo_worker import Drain, Heartbeat


def main() -> None:
    with Drain() as drain:  # first: until a handler is installed, SIGUSR1 kills the process
        item_s = float(sys.argv[1]) if len(sys.argv) > 1 else 1.0
        heartbeat = Heartbeat.from_environ()
        worker_id = os.environ.get("DEO_WORKER_ID", "?")
        print(f"{worker_id}: started, GPUs {os.environ.get('CUDA_VISIBLE_DEVICES')!r}", flush=True)
        while not drain.requested:
            heartbeat.beat()
            time.sleep(item_s)  # one item of work
        print(f"{worker_id}: drained", flush=True)


if __name__ == "__main__":
    main()
