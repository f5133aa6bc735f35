"""bench/soak.py: a short soak of a real ``deo run``, its report, its leak verdict, its cleanup.

The soak runs as a real program for a few seconds against a real deo with real worker processes,
into a copy of a benchmarks.md whose other sections must survive untouched.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import attrs
import pytest
from conftest import deo_command
from waiting import wait_for

from bench.soak import (
    END_MARK,
    MARKER_ENV,
    MIB,
    START_MARK,
    DeoUnderTest,
    Sample,
    SoakError,
    SoakSettings,
    alive,
    cleanup,
    count_log,
    environ_value,
    processes_with,
    verdict,
    write_section,
)

ROOT = Path(__file__).resolve().parents[2]
OTHER_SECTION = "<!-- bench_core:start -->\n## Core\nnumbers\n<!-- bench_core:end -->\n"
DURATION_S = 6
INTERVAL_S = 0.5


@pytest.fixture(scope="module")
def soaked(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[subprocess.CompletedProcess[str], Path]:
    tmp = tmp_path_factory.mktemp("soak")
    (tmp / "benchmarks.md").write_text("# deo benchmarks\n\n" + OTHER_SECTION)
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "soak.py"),
            f"--duration-s={DURATION_S}",
            f"--sample-interval-s={INTERVAL_S}",
            "--pin-interval-s=0.5",
            "--kill-interval-s=1",
            "--requests-per-s=10",
            f"--out={tmp / 'benchmarks.md'}",
            f"--json={tmp / 'soak.json'}",
            f"--workdir={tmp / 'run'}",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    return done, tmp


def result_of(tmp: Path) -> dict[str, Any]:
    found: dict[str, Any] = json.loads((tmp / "soak.json").read_text())
    return found


def test_the_soak_samples_deo_while_churning(
    soaked: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    done, tmp = soaked
    # 1 only for a suspected leak, which a few seconds of warm-up may well look like.
    assert done.returncode in (0, 1), done.stdout + done.stderr
    result = result_of(tmp)
    samples = result["samples"]
    assert len(samples) == DURATION_S / INTERVAL_S + 1
    assert all(s["rss_bytes"] > 0 and s["threads"] > 0 for s in samples)
    # deo listens on a socket and holds its log open, whatever else it has open.
    assert all(s["open_fds"] > s["sockets"] + s["pidfds"] and s["sockets"] > 0 for s in samples)
    assert [s["t_s"] for s in samples] == sorted(s["t_s"] for s in samples)
    assert samples[-1]["cpu_s"] >= samples[0]["cpu_s"] > 0
    assert samples[-1]["log_bytes"] > samples[0]["log_bytes"]
    traffic = result["traffic"]
    assert traffic["pins"] + traffic["unpins"] > 0
    assert traffic["gets"] > 0
    assert traffic["failures"] == [] and traffic["failed_requests"] == 0
    counts = result["ending"]["log_counts"]
    events = counts["events"]
    assert events["WorkerStarted"] > 0 and events["WorkerExited"] > 0
    assert events["PoolPinned"] == traffic["pins"] + traffic["unpins"]
    # Heartbeats are not logged one each but as sightings, at most one record a tick (and none
    # in a run this short if no worker lives a quarter of its 30 s grace).
    assert events.get("WorkersSeen", 0) <= events["Tick"] + 1
    assert counts["sightings"] >= events.get("WorkersSeen", 0)
    assert counts["heartbeats"] == 0 and "WorkerHeartbeat" not in events
    assert counts["segments"] == 1
    assert counts["log_bytes"] >= samples[-1]["log_bytes"]


def test_the_soak_ends_clean(soaked: tuple[subprocess.CompletedProcess[str], Path]) -> None:
    _, tmp = soaked
    ending = result_of(tmp)["ending"]
    assert ending["stop_status"] == 0
    assert ending["deo_status"] == 0
    assert ending["orphans"] == []
    assert ending["replay_status"] == 0, ending["replay_summary"]
    assert ending["clean"]


def test_the_soak_writes_its_section_and_keeps_the_others(
    soaked: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    done, tmp = soaked
    text = (tmp / "benchmarks.md").read_text()
    assert OTHER_SECTION in text
    section = text[text.index(START_MARK) : text.index(END_MARK)]
    assert f"- Command: `python bench/soak.py --duration-s {DURATION_S} " in section
    assert "no process left carrying the run's DEO_RUN_ID" in section
    assert ("no leak" in section) == (done.returncode == 0)
    # Only the command line names the temporary directory the run went to.
    rest = [line for line in section.splitlines() if not line.startswith("- Command:")]
    assert not [line for line in rest if str(tmp) in line]


def event_line(seq: int, event: dict[str, Any]) -> str:
    return json.dumps({"seq": seq, "kind": "event", "event": event}) + "\n"


def test_the_log_is_counted_across_every_segment(tmp_path: Path) -> None:
    log = tmp_path / "soak.jsonl"
    seen = {"@": "WorkersSeen", "t": 1.0, "worker_ids": ["w1", "w2"]}
    tick = {"@": "Tick", "t": 1.0}
    (tmp_path / "soak.jsonl.000001").write_text(
        '{"kind": "header"}\n' + event_line(1, seen) + event_line(2, tick)
    )
    (tmp_path / "soak.jsonl.000002").write_text(
        '{"kind": "header"}\n{"kind": "state", "seq": 2, "state": {}}\n' + event_line(3, seen)
    )
    log.write_text('{"kind": "header"}\n' + event_line(4, tick) + "torn")
    (tmp_path / "soak.jsonl.snapshot").write_text("x" * 1000)
    (tmp_path / "soak.jsonl.worker-token").write_text("secret")

    counts = count_log(log)

    assert counts.segments == 3
    assert counts.records == 9
    assert counts.unreadable == 1
    assert counts.events == {"WorkersSeen": 2, "Tick": 2}
    assert counts.sightings == 4
    assert counts.heartbeats == 0
    files = ["soak.jsonl.000001", "soak.jsonl.000002", "soak.jsonl"]
    assert counts.log_bytes == sum((tmp_path / name).stat().st_size for name in files)
    assert 0 < counts.share("Tick") < counts.share("WorkersSeen") < 1
    assert [name for name, _ in counts.largest(2)] == ["WorkersSeen", "Tick"]
    assert sum(share for _, share in counts.largest(10)) == pytest.approx(1 - 4 / counts.log_bytes)


def test_a_log_of_one_record_per_heartbeat_is_still_counted(tmp_path: Path) -> None:
    log = tmp_path / "old.jsonl"
    beat = {"@": "WorkerHeartbeat", "t": 1.0, "worker_id": "w1"}
    log.write_text(event_line(1, beat) + event_line(2, beat) + event_line(3, {"@": "Tick"}))

    counts = count_log(log)

    assert counts.segments == 1
    assert counts.heartbeats == 2
    assert counts.sightings == 0
    assert counts.events_of("WorkersSeen") == 0


def sample(t_s: float, rss_mib: float, fds: int) -> Sample:
    return Sample(
        t_s=t_s,
        rss_bytes=int(rss_mib * MIB),
        open_fds=fds,
        sockets=2,
        pidfds=3,
        threads=3,
        cpu_s=t_s / 100,
        log_bytes=int(t_s * 1000),
        snapshot_bytes=0,
        live_workers=3,
    )


def test_flat_memory_and_descriptors_after_warm_up_are_no_leak() -> None:
    # Warm-up growth in the first half does not count; noise in the second half does not.
    samples = [sample(t, 40 + min(t, 50) / 5 + (t % 3) * 0.1, 12 + t % 2) for t in range(100)]
    found = verdict(samples, SoakSettings())
    assert not found.leak, str(found)
    assert str(found).startswith("no leak")


def test_memory_growing_over_the_second_half_is_a_leak() -> None:
    samples = [sample(t, 50 + t * 0.2, 12) for t in range(100)]  # 720 MiB an hour
    found = verdict(samples, SoakSettings())
    assert found.leak and found.rss_leak and not found.fd_leak
    assert found.rss_mib_per_h == pytest.approx(720, rel=0.1)
    assert str(found).startswith("SUSPECTED LEAK")


def test_descriptors_growing_over_the_second_half_are_a_leak() -> None:
    samples = [sample(t, 50, 12 + t // 5) for t in range(100)]  # one every 5 s
    found = verdict(samples, SoakSettings())
    assert found.leak and found.fd_leak and not found.rss_leak
    assert found.fd_growth > 2


def test_descriptors_of_more_live_workers_are_no_leak() -> None:
    # deo holds one pidfd per live worker: more workers late in the run is not a leak.
    samples = [
        attrs.evolve(sample(t, 50, 12 + t // 10), live_workers=3 + t // 10) for t in range(100)
    ]
    assert not verdict(samples, SoakSettings()).leak


def test_growth_within_the_noise_floor_is_no_leak_at_any_rate() -> None:
    samples = [sample(t, 50 + (0.5 if t > 80 else 0), 12) for t in range(100)]
    found = verdict(samples, SoakSettings())
    assert found.rss_mib_per_h > 5  # half a MiB in under a minute
    assert not found.leak


def test_slow_growth_below_the_tolerated_rate_is_no_leak() -> None:
    # An hour at 3 MiB an hour: more than the noise floor over the second half, below 5 MiB/h.
    samples = [sample(t, 50 + 3 * t / 3600, 12) for t in range(0, 3601, 10)]
    found = verdict(samples, SoakSettings())
    assert found.rss_growth_bytes > MIB
    assert not found.leak
    assert verdict(samples, SoakSettings(rss_tolerance_mib_per_h=2)).leak


def test_a_process_carrying_the_marker_is_found_and_cleaned_up(tmp_path: Path) -> None:
    deo = DeoUnderTest(tmp_path, SoakSettings())
    child = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(600)"],
        env={**os.environ, MARKER_ENV: deo.marker},
    )
    try:
        wait_for("the marked process found", lambda: child.pid in deo.leftovers())
        assert deo.leftovers() == [child.pid]
        cleanup(deo)
        assert child.wait(timeout=30) < 0  # killed by a signal
        assert deo.leftovers() == []
    finally:
        child.kill()
        child.wait()


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"duration_s": 0.0}, "--duration-s"),
        ({"duration_s": 10.0, "sample_interval_s": 5.0}, "fewer than 4 samples"),
        ({"max_workers": 0}, "--max-workers"),
        ({"requests_per_s": float("nan")}, "--requests-per-s"),
        ({"fd_tolerance_per_h": -1.0}, "--fd-tolerance-per-h"),
    ],
)
def test_bad_settings_are_refused_by_name(changes: dict[str, Any], named: str) -> None:
    with pytest.raises(SoakError, match=named):
        SoakSettings(**changes)


def test_broken_markers_are_refused_and_the_file_left_alone(tmp_path: Path) -> None:
    out = tmp_path / "benchmarks.md"
    out.write_text(f"# deo benchmarks\n\n{END_MARK}\nkeep\n{START_MARK}\n")
    before = out.read_text()
    with pytest.raises(SoakError, match="broken"):
        write_section(out, f"{START_MARK}\nnew\n{END_MARK}\n")
    assert out.read_text() == before


def test_a_soak_stopped_by_sigterm_kills_deo_and_its_workers(tmp_path: Path) -> None:
    soak = subprocess.Popen(
        [
            sys.executable,
            str(ROOT / "bench" / "soak.py"),
            "--duration-s=600",
            f"--out={tmp_path / 'benchmarks.md'}",
            f"--workdir={tmp_path / 'run'}",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert soak.stdout is not None
        first = soak.stdout.readline()  # "deo run (pid N) on URL; ..." once deo's API answers
        deo_pid = int(first.split("(pid ", 1)[1].split(")", 1)[0])
        marker = environ_value(deo_pid, MARKER_ENV)
        assert marker
        marked = f"{MARKER_ENV}={marker}"
        # Workers start: the soak's deo is asked for 3 by its static policy.
        # deo and at least one worker
        wait_for("deo and a worker", lambda: len(processes_with([marked])) >= 2)
        soak.send_signal(signal.SIGTERM)
        _, err = soak.communicate(timeout=60)
    finally:
        if soak.poll() is None:
            soak.kill()
            soak.wait()
    assert soak.returncode == 2
    assert "SIGTERM: stopped early" in err
    assert [p for p in processes_with([marked]) if alive(p)] == []
    assert not (tmp_path / "benchmarks.md").exists()


def test_bad_arguments_exit_2_with_the_flag_named() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "soak.py"), "--duration-s=-5"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "python bench/soak.py: error: --duration-s" in done.stderr


def test_deo_bench_soak_refuses_broken_markers_before_it_starts_deo(tmp_path: Path) -> None:
    out = tmp_path / "benchmarks.md"
    out.write_text(f"{START_MARK}\nno end\n")
    command, env = deo_command()
    done = subprocess.run(
        [*command, "bench", "soak", f"--out={out}", f"--workdir={tmp_path / 'run'}"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert done.returncode == 2
    assert "deo bench soak: error:" in done.stderr and "broken" in done.stderr
    assert not (tmp_path / "run").exists()  # nothing was started
