"""bench/atropos_loop.py: deo and a static pool in the demo's real Atropos loop, and the report."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import attrs
import pytest

from adapters.demo.loop import DemoOutcome, DemoSettings, _settings
from bench import atropos_loop

ROOT = Path(__file__).resolve().parents[2]


def outcome(**changes: Any) -> DemoOutcome:
    base = DemoOutcome(
        steps=100, waited_s=10.0, busy_s=100.0, worker_s=900.0, decisions=6, replays=True
    )
    return attrs.evolve(base, **changes)


def test_the_static_run_is_the_same_loop_with_a_pool_held_at_its_maximum(tmp_path: Path) -> None:
    static = atropos_loop.settings("static", 60.0)
    buffer = atropos_loop.settings("buffer", 60.0)
    assert static.step_s == buffer.step_s == (0.5, 3.0, 0.3)
    run = _settings(static, tmp_path / "x.jsonl", "http://127.0.0.1:1", 2)
    pool = run.config.pools[0]
    assert pool.policy.name == "static" and pool.policy.params == {"count": 12}
    assert pool.max_workers == 12 and run.sources == ()  # a static pool reads no queue
    deo = _settings(buffer, tmp_path / "x.jsonl", "http://127.0.0.1:1", 2)
    assert deo.config.pools[0].policy.name == "buffer" and len(deo.sources) == 1
    with pytest.raises(ValueError, match="policy: 'buffer' or 'static', got 'hpa'"):
        DemoSettings(policy="hpa")


def test_the_report_gives_each_policy_its_mean_and_range() -> None:
    text = atropos_loop.render(
        {
            "buffer": [outcome(waited_s=5.0), outcome(waited_s=15.0, worker_s=700.0)],
            "static": [outcome(waited_s=2.0, worker_s=2000.0, decisions=1)],
        },
        "python bench/atropos_loop.py",
        180.0,
    )
    assert text.startswith(atropos_loop.START_MARK) and text.endswith(atropos_loop.END_MARK + "\n")
    assert "| buffer | 2 | 10.0% (5.0%-15.0%) | 800 (700-900) | 6 | yes |" in text
    assert "| static | 1 | 2.0% (2.0%-2.0%) | 2000 (2000-2000) | 1 | yes |" in text


def test_bad_input_exits_2_and_writes_nothing(tmp_path: Path) -> None:
    out = tmp_path / "benchmarks.md"
    out.write_text("# kept\n", encoding="utf-8")
    assert atropos_loop.main(["--duration-s", "5", "--out", str(out)]) == 2
    with pytest.raises(SystemExit) as exited:
        atropos_loop.main(["--runs", "0", "--out", str(out)])
    assert exited.value.code == 2
    assert out.read_text(encoding="utf-8") == "# kept\n"


def test_a_short_run_of_each_writes_the_measured_table(tmp_path: Path) -> None:
    out = tmp_path / "benchmarks.md"
    out.write_text(
        f"# before\n\n{atropos_loop.START_MARK}\nold\n{atropos_loop.END_MARK}\n", encoding="utf-8"
    )
    argv = ["bench/atropos_loop.py", "--runs", "1", "--duration-s", "15", "--out", str(out)]
    proc = subprocess.run(
        [sys.executable, *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "[buffer 1/1] waited" in proc.stdout and "[static 1/1] waited" in proc.stdout
    text = out.read_text(encoding="utf-8")
    assert text.startswith("# before") and "\nold\n" not in text
    rows = {
        line.split("|")[1].strip(): [cell.strip() for cell in line.split("|")[2:-1]]
        for line in text.splitlines()
        if line.startswith(("| buffer |", "| static |"))
    }
    assert set(rows) == {"buffer", "static"}, text
    for policy, (runs, waited, worker_s, _, replays) in rows.items():
        assert runs == "1" and replays == "yes", (policy, rows)
        assert 0.0 <= float(waited.split("%")[0]) <= 100.0
        assert float(worker_s.split()[0]) > 0
    # The static pool starts at its count and is never scaled; the buffer policy decides.
    assert int(rows["static"][3]) == 0 and int(rows["buffer"][3]) >= 1, rows
