"""bench/ray_scale.py runs small: a real process through the reducer and the log, its exits
scaled to the pool and each replaced."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_a_small_cluster_runs_through_with_exits_per_worker_hour() -> None:
    argv = ["--workers", "16", "--nodes", "2", "--window-s", "30"]
    # 120 exits per worker-hour on 16 workers: one every 1.875 s, 15 in the 30 s window.
    argv += ["--exits-per-worker-hour", "120"]
    done = subprocess.run(
        [sys.executable, "bench/ray_scale.py", *argv],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert out.startswith("$ .venv/bin/python bench/ray_scale.py --workers 16"), out
    assert "bring-up: 16 workers on 16 GPUs of 2 nodes" in out
    assert "WorkerExited 15," in out, out
    started = re.search(r"WorkerStarted (\d+)", out)
    assert started is not None and int(started.group(1)) >= 13, out  # each replaced 2 s later
    assert "alerts: none" in out
    assert "decisions within one tick:" in out
