"""How fast a real ``deo run`` log grows while its workers heartbeat, in bytes per worker-day.

``python -m bench.log_growth [--workers 12] [--beat-s 0.3] [--window-s 30]`` starts ``deo run``
in a temporary directory with a pool of workers that heartbeat every ``--beat-s`` over the API
and through their heartbeat file (heartbeat grace 5 s, ticks every second), waits until all are
active, measures what the log gains over ``--window-s`` seconds, and prints bytes per worker-day
with the records by type. Then it drains the workers and stops deo.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import httpx

TOKEN = "log-growth-operator-token"
DAY_S = 86_400.0
T = TypeVar("T")

BEATING = """
import os, time
from deo_worker import Drain, Heartbeat
api = Heartbeat(
    api_url=os.environ["DEO_API_URL"],
    worker_id=os.environ["DEO_WORKER_ID"],
    token=os.environ["DEO_WORKER_TOKEN"],
)
file = Heartbeat.from_environ()
with Drain() as drain:
    while not drain.requested:
        api.beat()
        file.beat()
        time.sleep(float(os.environ["BEAT_S"]))
"""


def _config(workers: int, beat_s: float, worker: Path) -> str:
    return f"""[deo]
log = "run.jsonl"
tick_interval_s = 1.0
[api]
port = 0
[pools.envs]
argv = ["{sys.executable}", "{worker}"]
env = {{ BEAT_S = "{beat_s}" }}
min_workers = {workers}
max_workers = {workers}
heartbeat_grace_s = 5.0
[pools.envs.policy]
name = "static"
count = {workers}
"""


def _wait(what: str, check: Callable[[], T], timeout_s: float = 120.0) -> T:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.2)
    raise SystemExit(f"log_growth: timed out waiting for {what}")


def measure(workers: int, beat_s: float, window_s: float) -> dict[str, object]:
    """Run deo, measure the log's growth over ``window_s`` once every worker is active."""
    with tempfile.TemporaryDirectory(prefix="deo-log-growth-") as tmp:
        directory = Path(tmp)
        worker = directory / "beating.py"
        worker.write_text(BEATING)
        config = directory / "deo.toml"
        config.write_text(_config(workers, beat_s, worker))
        out = directory / "deo.out"
        process = subprocess.Popen(
            [sys.executable, "-m", "adapters.cli", "run", "--config", str(config)],
            cwd=directory,
            env={**os.environ, "DEO_TOKEN": TOKEN},
            stdout=out.open("wb"),
            stderr=subprocess.STDOUT,
        )
        url = ""
        try:
            found = _wait("the API", lambda: re.search(r"API on (http://\S+)", out.read_text()))
            assert found is not None
            url = found.group(1)

            def active() -> bool:
                body = httpx.get(f"{url}/v1/workers", timeout=30).json()
                count = sum(w["state"] == "active" for w in body["workers"])
                return bool(count == workers)

            _wait("every worker active", active)
            time.sleep(3.0)  # settle: the first sightings of each worker are recorded
            log = directory / "run.jsonl"
            start_bytes = log.stat().st_size
            time.sleep(window_s)
            raw = log.read_bytes()
            window = raw[start_bytes : raw.rfind(b"\n") + 1]
        finally:
            headers = {"Authorization": f"Bearer {TOKEN}"}
            try:
                httpx.post(f"{url}/v1/stop", json={"drain": True}, headers=headers, timeout=30)
                process.wait(timeout=120)
            except (httpx.HTTPError, subprocess.TimeoutExpired):
                process.send_signal(signal.SIGTERM)
                process.wait(timeout=60)
    kinds: Counter[str] = Counter()
    kind_bytes: Counter[str] = Counter()
    for line in window.splitlines():
        record = json.loads(line)
        kind = record["event"]["@"] if record["kind"] == "event" else record["kind"]
        kinds[kind] += 1
        kind_bytes[kind] += len(line) + 1
    per_worker_day = len(window) / window_s / workers * DAY_S
    return {
        "workers": workers,
        "beat_s": beat_s,
        "window_s": window_s,
        "bytes": len(window),
        "bytes_per_s": len(window) / window_s,
        "bytes_per_worker_day": per_worker_day,
        "records": dict(kinds.most_common()),
        "bytes_by_record": dict(kind_bytes.most_common()),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=12)
    parser.add_argument("--beat-s", type=float, default=0.3)
    parser.add_argument("--window-s", type=float, default=30.0)
    args = parser.parse_args(argv)
    result = measure(args.workers, args.beat_s, args.window_s)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
