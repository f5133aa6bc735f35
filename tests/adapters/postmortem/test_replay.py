"""tools/replay and `deo replay`, run as real executables on real logs."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import write_simulated_log

from adapters.log import EventLog
from core import (
    Config,
    Configured,
    InvalidEvent,
    PolicySpec,
    PoolSpec,
    QueueSampled,
    Reducer,
    Tick,
    WorkersSeen,
    WorkerStarted,
)

REPO = Path(__file__).resolve().parents[3]
TOOL = REPO / "tools" / "replay"


def deo_command() -> tuple[list[str], dict[str, str]]:
    """The installed `deo` console script, or the same entry point through this Python."""
    env = dict(os.environ)
    script = Path(sys.executable).with_name("deo")
    if script.exists():
        return [str(script)], env
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    code = "import sys; from adapters.cli import main; sys.exit(main())"
    return [sys.executable, "-c", code], env


def run_tool(*args: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(TOOL), *map(str, args)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )


def run_deo(*args: Any) -> subprocess.CompletedProcess[str]:
    command, env = deo_command()
    return subprocess.run(
        [*command, *map(str, args)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


def records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_bytes().splitlines()]


SUMMARY = re.compile(r"(verified|replayed with problems): (\d+) events, (\d+) commands")


def summary(output: str) -> tuple[str, int, int]:
    found = SUMMARY.findall(output)
    assert len(found) == 1, output[-2000:]
    status, events, commands = found[0]
    return status, int(events), int(commands)


@pytest.fixture(scope="module")
def demo_master(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("demo") / "demo.jsonl"
    write_simulated_log(path)
    return path


@pytest.fixture(scope="module")
def counts(demo_master: Path) -> dict[str, int]:
    recs = records(demo_master)
    return {
        "events": sum(r["kind"] == "event" for r in recs),
        "commands": sum(len(r["commands"]) for r in recs if r["kind"] == "commands"),
        "spawns": sum(
            c["@"] == "SpawnWorker" for r in recs if r["kind"] == "commands" for c in r["commands"]
        ),
        "lines": len(recs),
    }


@pytest.fixture
def demo_log(demo_master: Path, tmp_path: Path) -> Path:
    path = tmp_path / "demo.jsonl"
    shutil.copyfile(demo_master, path)
    return path


def quiet_tick_index(lines: list[bytes]) -> int:
    """0-based index of a Tick in the middle of the log that produced no commands."""
    for i in range(len(lines) // 3, len(lines) - 1):
        record, following = json.loads(lines[i]), json.loads(lines[i + 1])
        if (
            record["kind"] == "event"
            and record["event"]["@"] == "Tick"
            and following["kind"] == "event"
        ):
            return i
    raise AssertionError("no quiet Tick in the log")


# --- verification and timeline -----------------------------------------------------------------


def test_demo_log_verifies(demo_log: Path, counts: dict[str, int]) -> None:
    proc = run_tool(demo_log)
    assert proc.returncode == 0, proc.stderr
    last = proc.stdout.rstrip("\n").splitlines()[-1]
    assert last == (
        f"verified: {counts['events']} events, {counts['commands']} commands reproduced exactly "
        f"({demo_log})"
    )
    assert summary(proc.stdout) == ("verified", counts["events"], counts["commands"])
    assert proc.stderr == ""


def test_timeline_numbers_commands(demo_log: Path, counts: dict[str, int]) -> None:
    proc = run_tool(demo_log)
    assert proc.returncode == 0
    assert re.search(r"^\s+0\.0s\s+#1 scale\s+envs 0 -> 1 \(config\)", proc.stdout, re.M)
    assert re.search(r"^\s+0\.0s\s+#2 spawn\s+envs-0", proc.stdout, re.M)
    numbers = [int(n) for n in re.findall(r"^\s+[\d.]+s\s+#(\d+) ", proc.stdout, re.M)]
    assert numbers == list(range(1, counts["commands"] + 1))
    assert "config     pools envs (buffer, 1-24 workers" in proc.stdout
    assert "workers per pool over time" in proc.stdout
    assert re.search(r"\d+ exits, \d+ spawn failures", proc.stdout)


def test_quiet_prints_no_timeline(demo_log: Path, counts: dict[str, int]) -> None:
    proc = run_tool(demo_log, "-q")
    assert proc.returncode == 0
    assert "#1 scale" not in proc.stdout
    assert summary(proc.stdout) == ("verified", counts["events"], counts["commands"])


def test_deo_replay_is_the_same_as_tools_replay(demo_log: Path) -> None:
    tool, deo = run_tool(demo_log), run_deo("replay", demo_log)
    assert deo.returncode == tool.returncode == 0
    assert deo.stdout == tool.stdout
    assert "verified:" in deo.stdout


def test_log_with_a_rejected_event_verifies(tmp_path: Path) -> None:
    path = tmp_path / "rejected.jsonl"
    spec = PoolSpec(
        name="envs",
        argv=["python", "env.py"],
        min_workers=1,
        max_workers=4,
        policy=PolicySpec(name="static", params={"count": 2}),
    )
    log, _ = EventLog.open(path)
    reducer = Reducer()
    log.record(reducer, Configured(t=0.0, config=Config(pools=[spec])))
    with pytest.raises(InvalidEvent):
        log.record(
            reducer,
            QueueSampled(t=1.0, pool="nope", queued_sequences=0, batch_size_seqs=8, trainer_step=0),
        )
    log.close()
    proc = run_tool(path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert summary(proc.stdout) == ("verified", 2, 3)


# --- divergence --------------------------------------------------------------------------------


def test_tampered_reason_diverges(demo_log: Path) -> None:
    lines = demo_log.read_bytes().splitlines(keepends=True)
    recs = [json.loads(line) for line in lines]
    # The first commands record after the first few lines, caused by a policy decision.
    index = next(i for i, r in enumerate(recs) if r["kind"] == "commands" and i > 5)
    record = recs[index]
    original = record["commands"][0]["reason"]
    record["commands"][0]["reason"] = "tampered by the test"
    lines[index] = json.dumps(record).encode() + b"\n"
    demo_log.write_bytes(b"".join(lines))
    event_line = next(i for i, r in enumerate(recs) if r.get("seq") == record["cause"]) + 1
    assert event_line == index  # the event is just before its commands record

    proc = run_tool(demo_log)
    assert proc.returncode == 1
    out = proc.stdout
    assert f"DIVERGED at line {event_line} (seq {record['cause']}," in out
    recorded = next(line for line in out.splitlines() if line.startswith("  recorded: "))
    replayed = next(line for line in out.splitlines() if line.startswith("  replayed: "))
    assert "tampered by the test" in recorded
    assert original not in recorded
    assert json.dumps(original)[1:-1] in replayed
    assert "tampered" not in replayed
    assert "verified:" not in out
    # the timeline stops at the divergence
    assert out.splitlines()[-3].startswith("DIVERGED")


def test_deleted_commands_record_diverges(demo_log: Path) -> None:
    lines = demo_log.read_bytes().splitlines(keepends=True)
    index = max(i for i, line in enumerate(lines) if b'"kind":"commands"' in line)
    cause = json.loads(lines[index])["cause"]
    del lines[index]
    demo_log.write_bytes(b"".join(lines))
    proc = run_tool(demo_log, "-q")
    assert proc.returncode == 1
    assert f"DIVERGED at line {index} (seq {cause}," in proc.stdout
    assert "  recorded: []" in proc.stdout


def test_sqlite_export_of_a_diverged_log_fails(demo_log: Path, tmp_path: Path) -> None:
    lines = demo_log.read_bytes().splitlines(keepends=True)
    index = max(i for i, line in enumerate(lines) if b'"kind":"commands"' in line)
    lines[index] = lines[index].replace(b'"reason":"', b'"reason":"X', 1)
    demo_log.write_bytes(b"".join(lines))
    proc = run_tool(demo_log, "--sqlite", tmp_path / "out.db")
    assert proc.returncode == 1
    assert f"DIVERGED at line {index}" in proc.stdout


# --- unreadable lines --------------------------------------------------------------------------


def damage(path: Path, how: str) -> int:
    """Damage ``path`` one way; returns the 1-based number of the bad line."""
    lines = path.read_bytes().splitlines(keepends=True)
    if how == "schema":
        lines[0] = lines[0].replace(b'"schema":1', b'"schema":99')
        assert b'"schema":99' in lines[0]
        path.write_bytes(b"".join(lines))
        return 1
    index = quiet_tick_index(lines)
    if how == "unknown-kind":
        lines.insert(index, b'{"kind":"bogus","seq":99999}\n')
    elif how == "unknown-type":
        record = json.loads(lines[index])
        record["event"]["@"] = "NoSuchEvent"
        lines[index] = json.dumps(record).encode() + b"\n"
    elif how == "malformed":
        lines[index] = b'{"kind":"event","event":\n'
    else:
        raise AssertionError(how)
    path.write_bytes(b"".join(lines))
    return index + 1


@pytest.mark.parametrize(
    ("how", "message", "events_lost"),
    [
        ("unknown-kind", "unknown record kind 'bogus'", 0),
        ("unknown-type", "unknown record type 'NoSuchEvent'", 1),
        ("malformed", "malformed JSON", 1),
        ("schema", "schema version 99; this deo reads version 1", 0),
    ],
)
def test_unreadable_line_exits_2_and_the_rest_replays(
    demo_log: Path, counts: dict[str, int], how: str, message: str, events_lost: int
) -> None:
    bad_line = damage(demo_log, how)
    proc = run_tool(demo_log)
    assert proc.returncode == 2, proc.stdout[-2000:]
    assert f"{demo_log}: line {bad_line}: {message}" in proc.stdout
    # everything after the bad line was still replayed and verified
    assert summary(proc.stdout) == (
        "replayed with problems",
        counts["events"] - events_lost,
        counts["commands"],
    )
    assert "DIVERGED" not in proc.stdout
    assert f"#{counts['commands']} " in proc.stdout


def test_torn_last_line_exits_2(demo_log: Path, counts: dict[str, int]) -> None:
    with demo_log.open("ab") as f:
        f.write(b'{"kind":"event","ev')
    proc = run_tool(demo_log, "-q")
    assert proc.returncode == 2
    assert f"line {counts['lines'] + 1}: torn record" in proc.stdout
    assert summary(proc.stdout)[1:] == (counts["events"], counts["commands"])


def test_missing_file_exits_2(tmp_path: Path) -> None:
    missing = tmp_path / "nope.jsonl"
    for proc in (run_tool(missing), run_deo("replay", missing)):
        assert proc.returncode == 2
        assert "no such log file" in proc.stderr
        assert str(missing) in proc.stderr
        assert "Traceback" not in proc.stderr


# --- --at and --explain ------------------------------------------------------------------------


def test_at_shows_the_state_at_a_time(demo_log: Path) -> None:
    proc = run_tool(demo_log, "--at", "100")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("state at ")
    t = float(lines[0].removeprefix("state at ").split("s")[0])
    assert 98 <= t <= 100
    assert any(line.startswith("  envs: target ") for line in lines)
    workers = [line for line in lines if line.startswith("  worker envs-")]
    assert workers
    assert all(": active" in w or ": requested" in w or ": draining" in w for w in workers)
    # a different time, a different state
    early = run_tool(demo_log, "--at", "0")
    assert early.returncode == 0
    assert early.stdout.splitlines()[0] == "state at 0.0s"
    assert "  worker envs-0: requested" in early.stdout
    assert early.stdout != proc.stdout


def test_explain_names_the_cause(demo_log: Path) -> None:
    recs = records(demo_log)
    line_of_seq = {r["seq"]: i + 1 for i, r in enumerate(recs) if "seq" in r}
    wanted = 5
    number = 0
    for r in recs:
        if r["kind"] == "commands":
            if number + len(r["commands"]) >= wanted:
                command = r["commands"][wanted - number - 1]
                cause_line = line_of_seq[r["cause"]]
                break
            number += len(r["commands"])
    proc = run_tool(demo_log, "--explain", wanted)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert out.startswith(f"command #{wanted} at ")
    assert command["reason"] in out.splitlines()[0]
    assert f"caused by line {cause_line} (seq {r['cause']})" in out
    assert "before it: envs: target" in out
    assert "after it:  envs: target" in out


def test_explain_the_last_command(demo_log: Path, counts: dict[str, int]) -> None:
    proc = run_tool(demo_log, "--explain", counts["commands"])
    assert proc.returncode == 0
    assert f"command #{counts['commands']} at " in proc.stdout
    assert "caused by line" in proc.stdout


def test_explain_past_the_end(demo_log: Path, counts: dict[str, int]) -> None:
    proc = run_tool(demo_log, "--explain", counts["commands"] + 1)
    assert proc.returncode == 2  # bad input: 1 is kept for a divergence
    assert proc.stderr == (
        f"deo replay: --explain {counts['commands'] + 1}: the log has {counts['commands']} "
        f"commands; there is no #{counts['commands'] + 1}\n"
    )


def test_a_time_before_the_log_is_bad_input(demo_log: Path) -> None:
    proc = run_tool(demo_log, "--at", "-5")
    assert proc.returncode == 2
    assert proc.stderr == "deo replay: --at -5: the log has no event at or before it\n"


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--at", "100", "--explain", "3"], "--at and --explain"),
        (["--sqlite", "x.db", "--at", "100"], "--sqlite and --at"),
        (["--set", "pools.envs.max_workers=2", "--sqlite", "x.db"], "--set and --sqlite"),
        (["--set", "pools.envs.max_workers=2", "--explain", "1"], "--set and --explain"),
    ],
)
def test_options_that_ask_different_questions_are_refused(
    demo_log: Path, tmp_path: Path, args: list[str], said: str
) -> None:
    proc = run_tool(demo_log, *args)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == f"deo replay: {said} ask different questions; give one\n"
    assert not (tmp_path / "x.db").exists()


def test_at_and_explain_on_a_diverged_log_show_the_divergence(
    demo_log: Path, counts: dict[str, int]
) -> None:
    lines = demo_log.read_bytes().splitlines(keepends=True)
    index = next(i for i, line in enumerate(lines) if b'"@":"ScalePool"' in line and i > 5)
    lines[index] = lines[index].replace(b'"target":', b'"target":9', 1)
    demo_log.write_bytes(b"".join(lines))
    for args in (["--at", "1e12"], ["--explain", str(counts["commands"])]):
        proc = run_tool(demo_log, *args)
        assert proc.returncode == 1, (args, proc.stdout[-2000:])
        assert f"DIVERGED at line {index}" in proc.stdout, args


@pytest.mark.parametrize("wanted", [0, -1])
def test_explain_below_one_is_refused(demo_log: Path, wanted: int) -> None:
    proc = run_tool(demo_log, "--explain", wanted)
    assert proc.returncode != 0
    assert f"command #{wanted} at" not in proc.stdout
    assert "Traceback" not in proc.stderr


# --- SQLite export -----------------------------------------------------------------------------


def test_sqlite_export(demo_log: Path, tmp_path: Path, counts: dict[str, int]) -> None:
    out = tmp_path / "out.db"
    proc = run_tool(demo_log, "--sqlite", out)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (
        f"wrote {out}: {counts['events']} events, {counts['commands']} commands, "
        f"{counts['spawns']} workers" in proc.stdout
    )
    with sqlite3.connect(out) as db:
        tables = {row[0] for row in db.execute("select name from sqlite_master where type='table'")}
        assert {"events", "commands", "workers"} <= tables
        assert db.execute("select count(*) from events").fetchone()[0] == counts["events"]
        assert db.execute("select count(*) from commands").fetchone()[0] == counts["commands"]
        assert db.execute("select count(*) from workers").fetchone()[0] == counts["spawns"]
        # commands are numbered like the timeline, 1..N
        numbers = [n for (n,) in db.execute("select n from commands order by n")]
        assert numbers == list(range(1, counts["commands"] + 1))
        # every command points at an exported event
        orphans = db.execute(
            "select count(*) from commands where seq not in (select seq from events)"
        ).fetchone()[0]
        assert orphans == 0
        rows = db.execute(
            "select worker_id, requested_t, started_t, ended_t, ended_by from workers"
        ).fetchall()
    assert all(requested is not None for _, requested, _, _, _ in rows)
    ended = [row for row in rows if row[3] is not None]
    exited = [row for row in ended if row[4] == "exit"]
    assert exited, "the demo has worker exits"
    for worker_id, requested, started, ended_t, _ in ended:
        assert started is not None, worker_id
        assert requested <= started <= ended_t, worker_id
    for _, requested, started, _, _ in rows:
        if started is not None:
            assert started >= requested
    # exits in the events table match the workers that ended by an exit
    with sqlite3.connect(out) as db:
        exits = db.execute("select count(*) from events where type = 'WorkerExited'").fetchone()[0]
    assert len(exited) == exits


def test_sqlite_export_replaces_an_existing_file(
    demo_log: Path, tmp_path: Path, counts: dict[str, int]
) -> None:
    out = tmp_path / "out.db"
    assert run_tool(demo_log, "--sqlite", out).returncode == 0
    assert run_tool(demo_log, "--sqlite", out).returncode == 0
    with sqlite3.connect(out) as db:
        assert db.execute("select count(*) from events").fetchone()[0] == counts["events"]
        assert db.execute("select count(*) from commands").fetchone()[0] == counts["commands"]


def test_sqlite_export_writes_over_nothing_but_an_export(demo_log: Path, tmp_path: Path) -> None:
    notes = tmp_path / "notes.txt"
    notes.write_text("mine\n")
    theirs = tmp_path / "theirs.db"
    with contextlib.closing(sqlite3.connect(theirs)) as db:
        db.execute("create table runs (name text)")
        db.commit()
    theirs_bytes = theirs.read_bytes()
    log_bytes = demo_log.read_bytes()
    for out, why in [
        (demo_log, "is the log being read"),
        (notes, "is a file, not a deo replay --sqlite export"),
        (theirs, "is a file, not a deo replay --sqlite export"),
        (tmp_path, "is a folder"),
        (tmp_path / "no" / "out.db", "no such folder"),
        (Path("/proc/deo-export.db"), "cannot write it"),  # a folder no file can be made in
    ]:
        proc = run_tool(demo_log, "-q", "--sqlite", out)
        assert proc.returncode == 2 and why in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr
    assert demo_log.read_bytes() == log_bytes and notes.read_text() == "mine\n"
    assert theirs.read_bytes() == theirs_bytes


def test_a_log_cut_before_its_last_commands_verifies_with_a_note(demo_log: Path) -> None:
    # Cut where deo writes an event's commands: after the event, before its commands.
    lines = demo_log.read_bytes().splitlines(keepends=True)
    index = max(i for i, line in enumerate(lines) if b'"kind":"commands"' in line)
    demo_log.write_bytes(b"".join(lines[:index]))
    proc = run_tool(demo_log, "-q")
    assert proc.returncode == 0, proc.stdout
    assert f"line {index}: the log ends before the commands" in proc.stdout
    assert "DIVERGED" not in proc.stdout


def test_an_empty_log_or_a_bad_time_exits_2(demo_log: Path, tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.touch()
    proc = run_tool(empty, "-q")
    assert proc.returncode == 2 and "is empty: not a deo log" in proc.stderr
    notes = tmp_path / "notes.txt"
    notes.write_text("remember the envs\n")
    proc = run_tool(notes, "-q")
    assert proc.returncode == 2 and proc.stdout == ""
    assert f"{notes} is not a deo log (its first line is no deo log header)" in proc.stderr
    proc = run_tool(demo_log, "--at", "nan")
    assert proc.returncode == 2 and "--at nan" in proc.stderr


# --- --set (what if) ---------------------------------------------------------------------------


def test_set_replays_open_loop_under_a_changed_configuration(demo_log: Path) -> None:
    proc = run_tool(demo_log, "--set", "pools.envs.max_workers=4")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "open loop" in out
    assert "pools.envs.max_workers=4" in out.splitlines()[0]
    found = re.search(r"(\d+) of (\d+) events would have led to different decisions", out)
    assert found is not None
    assert int(found.group(1)) > 0
    # exits of workers that max_workers=4 never started cannot apply
    skipped = re.search(r"; (\d+) recorded inputs did not apply", out)
    assert skipped is not None
    assert int(skipped.group(1)) > 0
    assert "  - recorded  ScalePool" in out
    assert "  + now       " in out
    now_targets = [int(m) for m in re.findall(r"^  \+ now\s+scale\s+envs \d+ -> (\d+)", out, re.M)]
    assert now_targets, "no scale decision listed"
    assert max(now_targets) <= 4
    # the recorded run went above 4; those decisions are listed as differences
    recorded_targets = [
        int(m)
        for m in re.findall(
            r"^\s+[\d.]+s\s+#\d+ scale\s+envs \d+ -> (\d+)", run_tool(demo_log).stdout, re.M
        )
    ]
    assert max(recorded_targets) > 4


def test_set_unchanged_configuration_finds_no_difference(demo_log: Path) -> None:
    proc = run_tool(demo_log, "--set", "pools.envs.max_workers=24")
    assert proc.returncode == 0
    assert re.search(r"^0 of \d+ events would have led to different decisions", proc.stdout, re.M)
    assert "+ now" not in proc.stdout


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ("nonsense=1", "--set nonsense: unknown key"),
        ("pools.envs.bogus=1", "pools have no field bogus"),
        ("pools.envs.max_workers", "expected key=value"),
        ("pools.envs.max_workers=-1", "max_workers"),
        ("pools.envs.max_workers=4.5", "pools.envs.max_workers: expected an integer, got 4.5"),
        ("pools.envs.max_workers=abc", "expected an integer, got 'abc'"),
        ("pools.nosuch.max_workers=1", "names nosuch, which no configuration in"),
        ("pools.envs.policy=bogus", "unknown policy 'bogus'"),
        ("pools.envs.policy.name=bogus", "unknown policy 'bogus'"),
        ("pools.envs.policy.target_batches=-1", "policy.target_batches must be >= 0"),
        ('pools.envs.policy={name="hpa"}', "--set pools.envs.policy: a policy's name"),
        ("pools.envs.env={A=1}", "pools.envs.env.A: names are identifiers, values strings"),
        ('gpus="auto"', "a replay cannot discover GPUs"),
        ("gpus=", "--set gpus: a list of GPU ids"),
    ],
)
def test_bad_setting_exits_2(demo_log: Path, setting: str, message: str) -> None:
    proc = run_tool(demo_log, "--set", setting)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr
    assert "would have led" not in proc.stdout


@pytest.mark.parametrize(
    "setting", ['pools.envs.env={ SEED = "7" }', "gpus=[0]", "pools.envs.max_workers=4"]
)
def test_set_values_are_read_as_the_configuration_file_writes_them(
    demo_log: Path, setting: str
) -> None:
    proc = run_tool(demo_log, "-q", "--set", setting)
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"^\d+ of \d+ events would have led to different decisions", proc.stdout, re.M)


def test_set_on_a_log_with_unreadable_lines_exits_2(demo_log: Path) -> None:
    bad_line = damage(demo_log, "malformed")
    proc = run_tool(demo_log, "--set", "pools.envs.max_workers=4")
    assert f"line {bad_line}: malformed JSON" in proc.stdout
    assert proc.returncode == 2


def test_explain_zero_when_the_first_event_has_no_commands(tmp_path: Path) -> None:
    path = tmp_path / "ticks.jsonl"
    log, _ = EventLog.open(path)
    log.record(Reducer(), Tick(t=0.0))
    log.close()
    proc = run_tool(path, "--explain", 0)
    assert "Traceback" not in proc.stderr
    assert proc.returncode == 2
    assert "numbered from 1" in proc.stderr


def test_refused_event_without_a_rejected_record_is_reported_and_skipped(tmp_path: Path) -> None:
    path = tmp_path / "rejected.jsonl"
    log, _ = EventLog.open(path)
    reducer = Reducer()
    log.record(reducer, Tick(t=0.0))
    with pytest.raises(InvalidEvent):
        log.record(
            reducer,
            QueueSampled(t=1.0, pool="nope", queued_sequences=0, batch_size_seqs=8, trainer_step=0),
        )
    log.record(reducer, Tick(t=2.0))
    log.close()
    lines = path.read_bytes().splitlines(keepends=True)
    assert b'"kind":"rejected"' in lines[3]
    del lines[3]
    path.write_bytes(b"".join(lines))
    proc = run_tool(path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"{path}: line 3: refused (QueueSampled: unknown pool 'nope'" in proc.stdout
    assert "the log records no refusal; skipped" in proc.stdout
    assert "DIVERGED" not in proc.stdout
    # the Ticks before and after it are replayed and verified
    assert summary(proc.stdout) == ("replayed with problems", 2, 0)


@pytest.mark.parametrize("mode", ["at", "explain", "sqlite"])
def test_other_modes_report_unreadable_lines(
    demo_log: Path, tmp_path: Path, counts: dict[str, int], mode: str
) -> None:
    bad_line = damage(demo_log, "malformed")
    args = {
        "at": ["--at", "10000"],
        # the log is read only as far as the command asked for: ask for the last one
        "explain": ["--explain", counts["commands"]],
        "sqlite": ["--sqlite", tmp_path / "out.db"],
    }[mode]
    proc = run_tool(demo_log, *args)
    assert f"{demo_log}: line {bad_line}: malformed JSON" in proc.stdout
    assert proc.returncode == 2


def test_set_with_fewer_workers_still_takes_the_sightings_of_those_it_made(
    tmp_path: Path,
) -> None:
    # Recorded: three workers seen every second, none hung. Under max_workers=1 only envs-0
    # exists; the recorded batches also name envs-1 and envs-2, which must not cost envs-0 its
    # sightings (it would be found hung 5 s in).
    path = tmp_path / "seen.jsonl"
    spec = PoolSpec(
        name="envs",
        argv=["python", "env.py"],
        min_workers=0,
        max_workers=4,
        heartbeat_grace_s=5.0,
        policy=PolicySpec(name="static", params={"count": 3}),
    )
    ids = ["envs-0", "envs-1", "envs-2"]
    log, _ = EventLog.open(path)
    reducer = Reducer()
    log.record(reducer, Configured(t=0.0, config=Config(pools=[spec])))
    for pid, worker_id in enumerate(ids, start=100):
        log.record(reducer, WorkerStarted(t=1.0, worker_id=worker_id, pid=pid, start_time=pid))
    for second in range(2, 40):
        log.record(reducer, WorkersSeen(t=float(second), worker_ids=set(ids)))
        log.record(reducer, Tick(t=second + 0.5, interval_s=1.0))
    log.close()

    proc = run_tool(path, "--set", "pools.envs.max_workers=1")

    assert proc.returncode == 0, proc.stdout + proc.stderr
    # The one difference: how many it starts. envs-0 is never found hung.
    assert re.search(r"^1 of \d+ events would have led", proc.stdout, re.M), proc.stdout
    assert "silent for" not in proc.stdout, proc.stdout
    # Only the starts of the two workers it never made did not apply.
    skipped = re.search(r"; (\d+) recorded inputs did not apply", proc.stdout)
    assert skipped is not None and int(skipped.group(1)) == 2, proc.stdout
