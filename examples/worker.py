"""A minimal deo worker: does "work" in a loop, heartbeats, drains on SIGUSR1.

deo starts it with DEO_WORKER_ID, DEO_POOL, CUDA_VISIBLE_DEVICES and DEO_HEARTBEAT_FILE in its
environment. On the drain signal it finishes the item in hand and exits 0.
"""

import os
import signal
import sys
import time
from pathlib import Path

draining = False


def drain(signum: int, frame: object) -> None:
    global draining
    draining = True


signal.signal(signal.SIGUSR1, drain)
heartbeat = os.environ.get("DEO_HEARTBEAT_FILE")
worker_id = os.environ.get("DEO_WORKER_ID", "?")
item_s = float(sys.argv[1]) if len(sys.argv) > 1 else 1.0
print(f"{worker_id}: started, GPUs {os.environ.get('CUDA_VISIBLE_DEVICES')!r}", flush=True)
while not draining:
    if heartbeat:
        Path(heartbeat).touch()
    time.sleep(item_s)  # one item of work
print(f"{worker_id}: drained", flush=True)
