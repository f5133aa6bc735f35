"""``deo simulate`` as a real process: the table, --set, --policy, --plot, --log, and errors."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[3]
STEADY = REPO / "bench" / "scenarios" / "steady.toml"


def run_deo(*args: Any) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    code = "import sys; from adapters.cli import main; sys.exit(main())"
    return subprocess.run(
        [sys.executable, "-c", code, *map(str, args)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_simulate_prints_metrics_draws_and_logs_a_replayable_run(tmp_path: Path) -> None:
    plot, log = tmp_path / "run.png", tmp_path / "run.jsonl"
    done = run_deo("simulate", STEADY, "--set", "duration_s=900", "--plot", plot, "--log", log)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "scenario steady, policy buffer, 900s simulated" in out
    for row in ("trainer starvation", "GPU-hours", "ratio to oracle", "mean lag", "flaps"):
        assert row in out
    assert plot.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    assert plot.stat().st_size > 10_000
    verified = subprocess.run(
        [sys.executable, str(REPO / "tools" / "replay"), str(log), "-q"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert "reproduced exactly" in verified.stdout


def test_policy_and_settings_change_the_run() -> None:
    done = run_deo(
        "simulate",
        STEADY,
        "--policy",
        "static",
        "--set",
        "duration_s=300",
        "--set",
        "pools.envs.policy.count=2",
    )
    # --policy replaces the scenario's policy first; --set then sets its parameters.
    assert done.returncode == 0, done.stderr
    assert "policy static" in done.stdout
    peak = next(line for line in done.stdout.splitlines() if line.startswith("peak workers"))
    assert peak.split()[-1] == "2"


def test_errors_exit_2_with_the_reason(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    bad = tmp_path / "bad.toml"
    bad.write_text("[pools.envs]\nmax_worker = 3\n")
    cases = [
        (("simulate", tmp_path / "missing.toml"), "missing.toml: no such file"),
        (("simulate", bad), "pools.envs.max_worker: unknown key (did you mean max_workers?)"),
        (("simulate", STEADY, "--set", "trainer.step_s"), "--set 'trainer.step_s': expected"),
        (("simulate", STEADY, "--set", "trainer.step_s=0"), "trainer.step_s: must be > 0"),
        (("simulate", STEADY, "--policy", "nope"), "unknown policy 'nope'"),
        (
            ("simulate", STEADY, "--set", "duration_s=10", "--log", tmp_path / "file" / "x.jsonl"),
            "deo simulate: --log",
        ),
        (("simulate", STEADY, "--plot", tmp_path / "run.txt"), "must end in .png, .svg, .pdf"),
        (("simulate", STEADY, "--plot", tmp_path), "--plot"),
        (("simulate", STEADY, "--log", bad), "is a file, not a simulated run's log"),
    ]
    for args, message in cases:
        done = run_deo(*args)
        assert done.returncode == 2, (args, done.stdout, done.stderr)
        assert message in done.stderr, (args, done.stderr)
        assert "Traceback" not in done.stderr


def test_an_empty_policy_name_is_refused(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "adapters.cli", "simulate", str(STEADY), "--policy", ""],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == "deo simulate: --policy: empty; give a policy's name (e.g. buffer)\n"


def test_plot_and_log_on_one_file_are_refused(tmp_path: Path) -> None:
    both = ["--plot", "x.png", "--log", "./x.png"]
    done = subprocess.run(
        [sys.executable, "-m", "adapters.cli", "simulate", str(STEADY), *both],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and done.stdout == ""
    assert "--plot and --log both name" in done.stderr
    assert list(tmp_path.iterdir()) == []
