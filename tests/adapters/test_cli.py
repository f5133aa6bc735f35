"""The `deo` command line: demo, --version and usage, run as a real executable."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest
from conftest import deo_command

from adapters.log import VERSION
from adapters.outputs import is_demo_log

DEMO_LOG = Path(__file__).parent / "postmortem" / "data" / "demo_60s.jsonl"


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


def processes_mentioning(text: str) -> list[int]:
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                cmdline = Path(entry.path, "cmdline").read_bytes().replace(b"\0", b" ")
            except OSError:
                continue
            if text.encode() in cmdline:
                found.append(int(entry.name))
    return found


@pytest.fixture(scope="module")
def demo_run(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[Path, subprocess.CompletedProcess[str]]:
    # A short run (the README's `deo demo` takes a minute; CI runs that one), into a directory
    # that does not exist yet.
    cwd = tmp_path_factory.mktemp("cli")
    return cwd, deo("demo", "--log", "tmp/x.jsonl", "--duration-s", "30", cwd=cwd)


def test_demo_runs_scales_and_reports(
    demo_run: tuple[Path, subprocess.CompletedProcess[str]],
) -> None:
    _, proc = demo_run
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert out.startswith("deo demo: atroposlib API server on http://127.0.0.1:")
    progress = re.findall(r"^\s+(\d+)s\s+trainer step\s+(\d+)", out, re.M)
    assert len(progress) >= 6
    times = [int(t) for t, _ in progress]
    assert times == sorted(times)
    steps = [int(s) for _, s in progress]
    assert steps[-1] > steps[0], "the trainer never took a step"
    found = re.search(r"^  env workers: (\d+) to (\d+) active", out, re.M)
    assert found is not None and int(found.group(2)) > 1, "deo never scaled the env pool up"
    decisions = re.search(
        r"^  decisions: (\d+) scaling decisions by the buffer policy:$", out, re.M
    )
    assert decisions is not None and int(decisions.group(1)) >= 1
    # Every decision is shown, with its time, direction and reason.
    shown = re.findall(r"^ +\d+\.\ds  (?:up|down) \d+ -> \d+ workers: \S", out, re.M)
    assert len(shown) == int(decisions.group(1))
    assert re.search(
        r"^  against a static pool of 8 workers \(this pool's maximum\): it would have waited "
        r"about \d+\.\ds \(\d+%, simulated\*\) and used \d+ worker-seconds; deo used \d+: ",
        out,
        re.M,
    )
    assert re.search(
        r"^    \* deo's simulator on this trainer, .* \(measured here: \d+\.\ds\)$", out, re.M
    )
    assert "unknown pool" not in proc.stdout + proc.stderr
    assert re.search(r"^  trainer: \d+ steps; waited \d+\.\ds", out, re.M)
    assert re.search(r"^deo demo: log tmp/x\.jsonl \(\d+ events\) replays exactly$", out, re.M)
    assert out.rstrip("\n").splitlines()[-1] == (
        "deo demo: replay it with `deo replay tmp/x.jsonl`"
    )


def test_demo_leaves_a_log_that_replays_and_no_process_behind(
    demo_run: tuple[Path, subprocess.CompletedProcess[str]],
) -> None:
    cwd, proc = demo_run
    found = re.search(r"\((\d+) events\) replays exactly", proc.stdout)
    assert found is not None
    recs = [json.loads(line) for line in (cwd / "tmp" / "x.jsonl").read_bytes().splitlines()]
    assert recs[0]["kind"] == "header"
    assert recs[0]["deo"] == VERSION
    assert sum(r["kind"] == "event" for r in recs) == int(found.group(1))
    kinds = {r["event"]["@"] for r in recs if r["kind"] == "event"}
    assert {"QueueSampled", "WorkerStarted", "WorkerExited"} <= kinds
    replayed = deo("replay", "-q", "tmp/x.jsonl", cwd=cwd)
    assert replayed.returncode == 0, replayed.stdout + replayed.stderr
    assert f"verified: {found.group(1)} events" in replayed.stdout
    # every env worker drained and disconnected on the signal
    logs = list((cwd / "tmp" / "x-workers").glob("envs-*.log"))
    assert logs
    assert all("drained" in path.read_text() for path in logs)
    # the API server, the trainer and every worker are gone
    api = re.search(r"API server on (http://\S+),", proc.stdout)
    assert api is not None
    assert processes_mentioning(api.group(1)) == []


def test_the_demo_log_answers_a_closed_loop_what_if(
    demo_run: tuple[Path, subprocess.CompletedProcess[str]],
) -> None:
    cwd, _ = demo_run
    proc = deo(
        "replay",
        "tmp/x.jsonl",
        "--what-if",
        "policy=static",
        "--what-if-seeds",
        "1",
        "--fitted-out",
        "tmp/fitted.toml",
        cwd=cwd,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    # Fitted from what a real run's log shows: batches of 32, groups of 8, no in-flight samples.
    assert "trainer: batches of 32 sequences" in out
    assert "groups of 8 sequences" in out
    assert "(assumed: the log has no in-flight samples)" in out
    assert re.search(r"^fit error \(.*\):\n  starvation [-+]\d+\.\d\d points", out, re.M), out
    assert "static (count=8)" in out
    assert (cwd / "tmp" / "fitted.toml").is_file()


def test_ctrl_c_ends_the_demo_with_its_workers_drained(tmp_path: Path) -> None:
    # Ctrl-C in a terminal signals the whole foreground process group: the demo, its trainer,
    # its API server and its env workers, once.
    command, env = deo_command()
    log = tmp_path / "c.jsonl"
    demo = subprocess.Popen(
        [*command, "demo", "--log", log, "--duration-s", "120"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        assert demo.stdout is not None
        lines = []
        for line in demo.stdout:  # until the pool is up and the trainer has taken a step
            lines.append(line)
            if re.search(r"trainer step +[1-9]\d* .*envs: [1-9]\d* active", line):
                break
        os.killpg(demo.pid, signal.SIGINT)
        rest, _ = demo.communicate(timeout=120)
    finally:
        if demo.poll() is None:
            os.killpg(demo.pid, signal.SIGKILL)
            demo.wait(timeout=30)
    out = "".join(lines) + rest
    assert demo.returncode == 0, out
    assert "deo: stopped; 0 worker(s) left running" in out
    assert "Traceback" not in out
    assert "replays exactly" in out
    # No env worker of this demo (each is given its API server's URL) outlives it.
    api = re.match(r"deo demo: atroposlib API server on (\S+),", out)
    assert api is not None, out
    assert processes_mentioning(f"--api {api.group(1)} ") == []


def test_demo_refuses_a_too_short_run(tmp_path: Path) -> None:
    proc = deo("demo", "--duration-s", "3", cwd=tmp_path)
    assert proc.returncode == 2
    assert "--duration-s: at least 10 seconds" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("duration", ["inf", "nan", "1e9"])
def test_demo_refuses_an_endless_run(tmp_path: Path, duration: str) -> None:
    proc = deo("demo", "--duration-s", duration, cwd=tmp_path)
    assert proc.returncode == 2
    assert "--duration-s: " in proc.stderr and "Traceback" not in proc.stderr


def test_demo_writes_over_its_own_log_and_nothing_else(tmp_path: Path) -> None:
    notes = tmp_path / "notes.jsonl"
    notes.write_text("my notes\n")
    proc = deo("demo", "--log", notes, cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"--log {notes} is a file, not a demo run's log; it is left as it is" in proc.stdout
    assert notes.read_text() == "my notes\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.jsonl"]
    assert is_demo_log(DEMO_LOG)  # an earlier demo's log is one it writes over


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
    assert "'simulate', 'bench'" in proc.stderr  # the choices name the plugins too


def test_help_lists_the_subcommands(tmp_path: Path) -> None:
    proc = deo("--help", cwd=tmp_path)
    assert proc.returncode == 0
    assert "demo" in proc.stdout
    assert "replay" in proc.stdout


@pytest.fixture
def broken_plugin(tmp_path: Path) -> dict[str, str]:
    """An installed ``deo.commands`` plugin whose module does not import: the environment that
    makes it visible to ``deo``."""
    site = tmp_path / "site"
    info = site / "deo_broken_plugin-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: deo-broken-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[deo.commands]\nbroken = no_such_module_for_deo\n")
    _, env = deo_command()
    return {**env, "PYTHONPATH": os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH")]))}


def deo_with(env: dict[str, str], *args: Any, cwd: Path) -> subprocess.CompletedProcess[str]:
    command, _ = deo_command()
    return subprocess.run(
        [*command, *map(str, args)], cwd=cwd, capture_output=True, text=True, timeout=120, env=env
    )


def test_a_broken_plugin_does_not_break_the_built_in_commands(
    broken_plugin: dict[str, str], tmp_path: Path
) -> None:
    proc = deo_with(broken_plugin, "run", "--config", "missing.toml", cwd=tmp_path)
    assert proc.returncode == 2
    assert "deo run: missing.toml: No such file or directory" in proc.stderr
    assert "Traceback" not in proc.stderr and "broken" not in proc.stderr
    replay = deo_with(broken_plugin, "replay", "missing.jsonl", cwd=tmp_path)
    assert "Traceback" not in replay.stderr and "broken" not in replay.stderr


def test_a_broken_plugin_asked_for_is_a_clear_error(
    broken_plugin: dict[str, str], tmp_path: Path
) -> None:
    proc = deo_with(broken_plugin, "broken", cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.startswith(
        "deo: the command 'broken' (no_such_module_for_deo) failed to load: ModuleNotFoundError"
    )
    assert "Traceback" not in proc.stderr


def test_usage_lists_the_plugins_that_load_and_warns_of_the_others(
    broken_plugin: dict[str, str], tmp_path: Path
) -> None:
    proc = deo_with(broken_plugin, "--help", cwd=tmp_path)
    assert proc.returncode == 0
    assert "bench" in proc.stdout  # deo's own benchmark, a plugin that loads
    assert "deo: warning: the command 'broken'" in proc.stderr


def test_help_lists_the_operators_verbs(tmp_path: Path) -> None:
    proc = deo("--help", cwd=tmp_path)
    for verb in ("status", "stop", "pause", "resume", "pin", "unpin", "drain", "cordon"):
        assert re.search(rf"^    {verb}\s", proc.stdout, re.M), verb


@pytest.mark.parametrize("verb", [["stop"], ["pause"], ["status"]])
def test_an_operator_token_no_http_client_can_send_is_refused_unquoted(
    tmp_path: Path, verb: list[str]
) -> None:
    command, env = deo_command()
    done = subprocess.run(
        [*command, *verb, "--url", "http://127.0.0.1:9", "--token-env", "DEO_TEST_TOKEN"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={**env, "DEO_TEST_TOKEN": "hunter2\n"},
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "operator token ($DEO_TEST_TOKEN or LOG.token) ends or starts with whitespace" in (
        done.stderr
    )
    assert "hunter2" not in done.stdout + done.stderr and "Traceback" not in done.stderr
