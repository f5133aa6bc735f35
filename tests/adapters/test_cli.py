"""The `deo` command line: demo, --version and usage, run as a real executable."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from adapters.log import VERSION

REPO = Path(__file__).resolve().parents[2]


def deo_command() -> tuple[list[str], dict[str, str]]:
    """The installed `deo` console script, or the same entry point through this Python."""
    env = dict(os.environ)
    script = Path(sys.executable).with_name("deo")
    if script.exists():
        return [str(script)], env
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    code = "import sys; from adapters.cli import main; sys.exit(main())"
    return [sys.executable, "-c", code], env


def deo(*args: Any, cwd: Path) -> subprocess.CompletedProcess[str]:
    command, env = deo_command()
    return subprocess.run(
        [*command, *map(str, args)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


def run_demo_in(
    tmp_path: Path, *extra: Any, log: str = "tmp/x.jsonl"
) -> subprocess.CompletedProcess[str]:
    (tmp_path / log).parent.mkdir(parents=True, exist_ok=True)
    return deo("demo", "--log", log, *extra, cwd=tmp_path)


@pytest.fixture(scope="module")
def demo_run(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[Path, subprocess.CompletedProcess[str]]:
    cwd = tmp_path_factory.mktemp("cli")
    return cwd, run_demo_in(cwd)


def test_demo_runs_and_reports(demo_run: tuple[Path, subprocess.CompletedProcess[str]]) -> None:
    cwd, proc = demo_run
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert out.startswith("deo demo: ")
    progress = re.findall(r"^\s+t=\s*(\d+)s\s+workers\s+(\d+)\s+queue", out, re.M)
    assert len(progress) >= 10
    times = [int(t) for t, _ in progress]
    assert times == sorted(times)
    assert any(int(n) > 1 for _, n in progress), "deo never scaled the pool up"
    assert re.search(r"^summary: trainer waited \d+\.\d%", out, re.M)
    assert re.search(r"^log: tmp/x\.jsonl \(\d+ events\) replays exactly$", out, re.M)
    assert out.rstrip("\n").splitlines()[-1] == "replay it: deo replay tmp/x.jsonl"
    assert "decisions:" in out
    assert (cwd / "tmp" / "x.jsonl").is_file()


def test_demo_log_has_the_events_it_reports(
    demo_run: tuple[Path, subprocess.CompletedProcess[str]],
) -> None:
    cwd, proc = demo_run
    found = re.search(r"\((\d+) events\) replays exactly", proc.stdout)
    assert found is not None
    recs = [json.loads(line) for line in (cwd / "tmp" / "x.jsonl").read_bytes().splitlines()]
    assert recs[0]["kind"] == "header"
    assert recs[0]["deo"] == VERSION
    assert sum(r["kind"] == "event" for r in recs) == int(found.group(1))
    # and `deo replay` on it (the command the demo suggests) verifies it
    replayed = deo("replay", "-q", "tmp/x.jsonl", cwd=cwd)
    assert replayed.returncode == 0, replayed.stdout + replayed.stderr
    assert f"verified: {found.group(1)} events" in replayed.stdout


def test_same_seed_gives_the_same_log(tmp_path: Path) -> None:
    first = run_demo_in(tmp_path, "--seed", "3", log="a/x.jsonl")
    second = run_demo_in(tmp_path, "--seed", "3", log="b/x.jsonl")
    assert first.returncode == second.returncode == 0
    a = (tmp_path / "a" / "x.jsonl").read_bytes().splitlines()
    b = (tmp_path / "b" / "x.jsonl").read_bytes().splitlines()
    assert len(a) > 100
    assert a[1:] == b[1:]
    header_a, header_b = json.loads(a[0]), json.loads(b[0])
    assert header_a.pop("created")
    assert header_b.pop("created")
    assert header_a == header_b
    # the console output is the same too, apart from the path
    assert first.stdout.replace("a/x.jsonl", "b/x.jsonl") == second.stdout


def test_another_seed_gives_another_log(tmp_path: Path) -> None:
    assert run_demo_in(tmp_path, "--seed", "3", log="a/x.jsonl").returncode == 0
    assert run_demo_in(tmp_path, "--seed", "4", log="b/x.jsonl").returncode == 0
    a = (tmp_path / "a" / "x.jsonl").read_bytes().splitlines()
    b = (tmp_path / "b" / "x.jsonl").read_bytes().splitlines()
    assert a[1:] != b[1:]


def test_demo_overwrites_an_existing_log(tmp_path: Path) -> None:
    assert run_demo_in(tmp_path).returncode == 0
    log = tmp_path / "tmp" / "x.jsonl"
    first = log.read_bytes().splitlines()[1:]
    snapshot = log.with_name("x.jsonl.snapshot")
    snapshot.write_bytes(b"{}")
    proc = run_demo_in(tmp_path)
    assert proc.returncode == 0
    assert log.read_bytes().splitlines()[1:] == first  # replaced, not appended to
    assert not snapshot.exists()


def test_demo_into_a_missing_directory(tmp_path: Path) -> None:
    proc = deo("demo", "--log", "missing/x.jsonl", cwd=tmp_path)
    assert "Traceback" not in proc.stderr
    if proc.returncode == 0:
        assert (tmp_path / "missing" / "x.jsonl").is_file()
    else:
        assert "missing/x.jsonl" in proc.stderr


def test_version(tmp_path: Path) -> None:
    proc = deo("--version", cwd=tmp_path)
    assert proc.returncode == 0
    assert proc.stdout.strip() == f"deo {VERSION}"
    assert re.fullmatch(r"\d+\.\d+\.\d+", VERSION)


def test_no_subcommand_prints_usage(tmp_path: Path) -> None:
    proc = deo(cwd=tmp_path)
    assert proc.returncode != 0
    assert proc.stderr.startswith("usage: deo")
    assert "COMMAND" in proc.stderr
    assert proc.stdout == ""


def test_unknown_subcommand_is_refused(tmp_path: Path) -> None:
    proc = deo("frobnicate", cwd=tmp_path)
    assert proc.returncode == 2
    assert "usage: deo" in proc.stderr
    assert "frobnicate" in proc.stderr


def test_help_lists_the_subcommands(tmp_path: Path) -> None:
    proc = deo("--help", cwd=tmp_path)
    assert proc.returncode == 0
    assert "demo" in proc.stdout
    assert "replay" in proc.stdout
