"""``deo replay LOG --set arbiter.planner.FIELD=VALUE``: a recorded arbiter run replayed open
loop under other planner settings (a real log file, the real command)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from adapters.log import EventLog
from core import Config, Configured, Reducer
from core.arbiter import (
    ArbiterGpusDeclared,
    ClusterSpec,
    GpusRequested,
    PipelineRegistered,
    PlannerSettings,
    ProgressReported,
    RolloutOpened,
)

REPO = Path(__file__).resolve().parents[3]


def deo_replay(*args: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "adapters.cli", "replay", *map(str, args)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture
def arbiter_log(tmp_path: Path) -> Path:
    """q holds GPU 0; p generates on 1 and 2; r asks for 0 and 1 and must wait for q. deo's
    planner leaves p's rank on 1 awake meanwhile; rlix's puts it to sleep for nobody."""
    path = tmp_path / "arbiter.jsonl"
    log, _ = EventLog.open(path, fsync=False)
    reducer = Reducer(check_invariants=True)
    gpus = ("0", "1", "2")
    events = [
        Configured(t=0.0, config=Config(gpus=gpus)),
        ArbiterGpusDeclared(t=0.0, gpus=gpus, planner=PlannerSettings()),
        PipelineRegistered(
            t=1.0,
            pipeline="q",
            clusters=[ClusterSpec(name="train", kind="ACTOR_TRAINING", device_mapping=["0"])],
        ),
        GpusRequested(t=2.0, pipeline="q", cluster="train", priority=1),
        PipelineRegistered(
            t=3.0,
            pipeline="p",
            clusters=[ClusterSpec(name="gen", kind="GENERATION", device_mapping=["1", "2"])],
        ),
        ProgressReported(
            t=3.5, pipeline="p", stream="s", target_trajectories=64, completed_trajectories=0
        ),
        RolloutOpened(t=4.0, pipeline="p"),
        PipelineRegistered(
            t=5.0,
            pipeline="r",
            clusters=[ClusterSpec(name="train", kind="ACTOR_TRAINING", device_mapping=["0", "1"])],
        ),
        GpusRequested(t=6.0, pipeline="r", cluster="train", priority=1),
    ]
    for event in events:
        log.record(reducer, event)
    log.close()
    assert reducer.state.arbiter.pipelines["p"].clusters["gen"].active_ranks == {0, 1}
    return path


def test_planner_settings_are_tried_on_a_recorded_run(arbiter_log: Path) -> None:
    assert deo_replay("-q", arbiter_log).returncode == 0  # the log verifies as recorded
    proc = deo_replay(arbiter_log, "--set", "arbiter.planner.name=rlix")
    assert proc.returncode == 0, proc.stderr
    assert "arbiter.planner.name=rlix" in proc.stdout.splitlines()[0]
    assert "2 of 9 events would have led to different decisions" in proc.stdout
    # rlix puts p's rank on GPU 1 to sleep although r still waits for q's GPU 0.
    assert "+ now       ShrinkGeneration: r/train (ACTOR_TRAINING) needs" in proc.stdout

    same = deo_replay(arbiter_log, "--set", "arbiter.planner.hysteresis=0.1")
    assert same.returncode == 0, same.stderr
    assert "0 of 9 events would have led to different decisions" in same.stdout


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ("arbiter.planner.hysterisis=0.2", "the arbiter's planner has no setting 'hysterisis'"),
        ("arbiter.planner.hysteresis=-1", "hysteresis must be >= 0"),
        ("arbiter.planner.name=fastest", "name must be 'deo' or 'rlix'"),
        ("arbiter.gpus=3", "unknown key (arbiter.planner.FIELD)"),
    ],
)
def test_an_unknown_or_bad_planner_setting_is_refused(
    arbiter_log: Path, setting: str, message: str
) -> None:
    proc = deo_replay(arbiter_log, "--set", setting)
    assert proc.returncode == 2
    assert message in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "would have led" not in proc.stdout
