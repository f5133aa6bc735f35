"""``deo run`` with ``gpus = "auto"``: the GPUs come from the ``[nvml]`` source, within deo's
CUDA_VISIBLE_DEVICES, and the log records what was found."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from test_nvml_run import TOKEN, Deo, environ
from waiting import wait_for

AUTO = 'gpus = "auto"'


def test_auto_takes_the_gpus_deo_may_use_and_workers_get_their_devices(tmp_path: Path) -> None:
    # The file lists GPUs 0, 1 and 2; deo itself may use devices 2 and 0 only.
    deo = Deo(tmp_path, visible="2,0")
    deo.config.write_text(deo.config.read_text().replace('gpus = ["0", "1", "2"]', AUTO))
    try:
        deo.start()
        first, second = _two_active(deo)
        [configured] = [
            r["event"]
            for r in deo.records()
            if r["kind"] == "event" and r["event"]["@"] == "Configured"
        ]
        assert configured["config"]["gpus"] == ["0", "1"]
        assert configured["config"]["gpu_devices"] == {"0": "2", "1": "0"}
        given = sorted(environ(w["pid"])["CUDA_VISIBLE_DEVICES"] for w in (first, second))
        assert given == ["0", "2"]
        deo.verified()
    finally:
        deo.cleanup()


def _two_active(deo: Deo) -> list[dict[str, Any]]:
    workers: list[dict[str, Any]] = wait_for(
        "two active workers",
        lambda: len(deo.workers("active")) == 2 and deo.workers("active"),
    )
    return workers


def test_auto_finding_no_gpu_stops_deo_before_it_starts(tmp_path: Path) -> None:
    deo = Deo(tmp_path)
    deo.config.write_text(deo.config.read_text().replace('gpus = ["0", "1", "2"]', AUTO))
    deo.readings_file.write_text(json.dumps({}))
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    proc = subprocess.run(
        [sys.executable, "-m", "adapters.cli", "run", "--config", str(deo.config)],
        cwd=tmp_path,
        env={**env, "DEO_TOKEN": TOKEN},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f'deo.gpus = "auto" found no GPU: the file {deo.readings_file} lists none' in (
        proc.stderr
    )
    assert not deo.log.exists()
