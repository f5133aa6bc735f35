"""``deo run`` on a log it must not trust or cannot write: the real program, real workers, real
files, a real file size limit and real file permissions."""

from __future__ import annotations

import contextlib
import os
import re
import resource
import signal
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from spawned import marked_processes
from waiting import wait_for

from adapters.log import segments, snapshot_path
from adapters.run import (
    WORKER_SECRET_CHARS,
    worker_secret_for,
    worker_secret_path,
    write_operator_token,
)

ROOT = Path(__file__).resolve().parents[3]

SILENT = "import time; time.sleep(600)"


class Deo:
    """``deo run`` with a static pool of two silent workers, in ``directory``."""

    def __init__(self, directory: Path, extra: str = "") -> None:
        self.dir = directory
        self.marker = uuid.uuid4().hex
        self.log = directory / "run.jsonl"
        self.config = directory / "deo.toml"
        self.config.write_text(
            f'[deo]\nlog = "run.jsonl"\ntick_interval_s = 0.2\n{extra}[api]\nport = 0\n'
            f'[pools.envs]\nargv = ["{sys.executable}", "-c", "{SILENT}"]\n'
            f'env = {{ TEST_DEO_MARKER = "{self.marker}" }}\nmax_workers = 4\n'
            f'[pools.envs.policy]\nname = "static"\ncount = 2\n'
        )
        self.runs = 0

    def start(self, preexec: Callable[[], None] | None = None) -> subprocess.Popen[str]:
        self.runs += 1
        return subprocess.Popen(
            [sys.executable, "-m", "adapters.cli", "run", "--config", str(self.config)],
            cwd=self.dir,
            env={**os.environ, "DEO_TOKEN": "test-token"},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
            preexec_fn=preexec,
        )

    def workers(self) -> list[int]:
        return marked_processes(self.marker)

    def two_workers_started(self) -> bool:
        """Whether both workers run and the log records both as started."""
        return len(self.workers()) == 2 and self.log.read_bytes().count(b'"@":"WorkerStarted"') == 2

    def run_two_workers_and_stop(self) -> None:
        """Start deo, wait for both workers to be logged as started, stop deo (they live on)."""
        process = self.start()
        try:
            wait_for("two workers", self.two_workers_started)
        finally:
            process.send_signal(signal.SIGTERM)
            process.communicate(timeout=60)

    def cleanup(self) -> None:
        for pid in self.workers():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)


@pytest.fixture
def deo(tmp_path: Path) -> Iterator[Callable[..., Deo]]:
    made: list[Deo] = []

    def make(directory: Path = tmp_path, extra: str = "") -> Deo:
        made.append(Deo(directory, extra))
        return made[-1]

    yield make
    for instance in made:
        instance.cleanup()


def finished(process: subprocess.Popen[str]) -> tuple[int, str]:
    output, _ = process.communicate(timeout=120)
    return process.returncode, output


def test_a_lost_configuration_line_stops_start_up_and_spawns_nothing(
    deo: Callable[..., Deo],
) -> None:
    d = deo()
    d.run_two_workers_and_stop()
    workers = d.workers()
    lines = d.log.read_bytes().splitlines(keepends=True)
    assert b'"@":"Configured"' in lines[1]
    lines[1] = b"#" * (len(lines[1]) - 1) + b"\n"
    d.log.write_bytes(b"".join(lines))
    snapshot_path(d.log).unlink(missing_ok=True)
    damaged = d.log.read_bytes()

    status, output = finished(d.start())
    assert status == 2, output
    assert f"{d.log}: line 2 cannot be read" in output
    assert "may have held the configuration" in output and "move the log aside" in output
    assert "Traceback" not in output
    assert d.workers() == workers  # none spawned, none stopped
    assert d.log.read_bytes() == damaged


def test_a_file_that_is_not_a_deo_log_is_refused_and_left_untouched(
    deo: Callable[..., Deo],
) -> None:
    d = deo()
    notes = b"remember: 2 GPUs for the envs"  # one line, no line end: not a torn header
    d.log.write_bytes(notes)
    status, output = finished(d.start())
    assert status == 2, output
    assert f"{d.log} is not a deo log" in output and "Traceback" not in output
    assert d.log.read_bytes() == notes
    assert sorted(p.name for p in d.dir.iterdir()) == ["deo.toml", "run.jsonl"]
    assert d.workers() == []


def test_a_worker_logs_path_that_is_a_file_stops_start_up_before_the_log_is_written(
    deo: Callable[..., Deo],
) -> None:
    d = deo(extra='worker_logs = "notes.txt"\n')
    (d.dir / "notes.txt").write_text("mine\n")
    status, output = finished(d.start())
    assert status == 2, output
    assert "deo.worker_logs" in output and "a file, not a folder" in output
    assert "Traceback" not in output
    assert not d.log.exists()
    assert (d.dir / "notes.txt").read_text() == "mine\n"
    assert d.workers() == []


def test_a_file_size_limit_stops_deo_with_one_line_and_leaves_the_workers(
    deo: Callable[..., Deo],
) -> None:
    d = deo(extra="snapshot_every = 1000000\n")
    process = d.start()
    try:
        wait_for("two workers", d.two_workers_started)
        # From now on the log cannot grow: its next write fails with EFBIG (deo ignores the
        # SIGXFSZ that would otherwise kill it).
        size = d.log.stat().st_size
        resource.prlimit(process.pid, resource.RLIMIT_FSIZE, (size, size))
        status, output = finished(process)
    finally:
        with contextlib.suppress(ProcessLookupError):
            process.kill()
    assert status == 3, output
    assert "Traceback" not in output and "ExceptionGroup" not in output
    last = output.strip().splitlines()[-1]
    assert re.search(rf"{re.escape(str(d.log))}: cannot write the log: .*EFBIG", last), last
    assert "2 worker(s) left running" in last
    assert len(d.workers()) == 2
    # What was written before is intact: a restart (without the limit) recovers and adopts.
    restarted = d.start()
    try:
        wait_for("the workers adopted", lambda: d.log.read_bytes().count(b"WorkerAdopted") == 2)
    finally:
        restarted.send_signal(signal.SIGTERM)
        status, output = finished(restarted)
    assert status == 0, output
    assert len(d.workers()) == 2


@pytest.mark.parametrize(
    ("change", "said"),
    [
        (lambda log: log.unlink(), "removed"),
        (lambda log: log.rename(log.with_name("run.jsonl.1")), "moved away"),
        (lambda log: os.truncate(log, 0), "cut short"),
    ],
    ids=["removed", "moved", "truncated"],
)
def test_a_log_taken_away_while_deo_runs_stops_it_and_leaves_the_workers(
    deo: Callable[..., Deo], change: Callable[[Path], None], said: str
) -> None:
    d = deo()
    process = d.start()
    try:
        wait_for("two workers", d.two_workers_started)
        change(d.log)  # the next tick's record finds it gone
        status, output = finished(process)
    finally:
        with contextlib.suppress(ProcessLookupError):
            process.kill()
    assert status == 3, output
    assert "Traceback" not in output and "ExceptionGroup" not in output
    last = output.strip().splitlines()[-1]
    assert last.startswith(f"deo: {d.log}: the log was {said}"), output
    advice = "put the log back where it was" if said == "moved away" else "restore it from a copy"
    assert advice in last and "2 worker(s) left running" in last
    assert len(d.workers()) == 2


def test_a_new_log_beside_a_snapshot_of_running_workers_is_refused(
    deo: Callable[..., Deo],
) -> None:
    d = deo(extra="snapshot_every = 5\n")
    process = d.start()
    try:
        wait_for(
            "two workers and a snapshot that holds them",
            lambda: len(d.workers()) == 2 and snapshot_bytes(d.log).count(b'"@":"Worker",') == 2,
        )
    finally:
        process.send_signal(signal.SIGTERM)
        process.communicate(timeout=60)
    workers = d.workers()
    d.log.unlink()  # lost while deo was stopped: its two workers still run
    status, output = finished(d.start())
    assert status == 2, output
    assert "Traceback" not in output
    assert "names 2 worker(s) of an earlier log at this path that still run" in output, output
    assert f"stop them and remove {snapshot_path(d.log)} to start afresh" in output
    assert snapshot_path(d.log).exists()
    assert d.workers() == workers  # none spawned beside them


def snapshot_bytes(log: Path) -> bytes:
    try:
        return snapshot_path(log).read_bytes()
    except FileNotFoundError:
        return b""


@contextlib.contextmanager
def read_only(path: Path) -> Iterator[None]:
    """``path`` (a file or a directory) read-only for deo: by its mode, or, for root (whom
    modes do not stop), by the immutable attribute."""
    if os.geteuid() != 0:
        mode = path.stat().st_mode
        path.chmod(0o555 if path.is_dir() else 0o444)
        try:
            yield
        finally:
            path.chmod(mode)
        return
    if subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode != 0:
        pytest.skip("running as root without a way to make a file read-only (chattr +i)")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", str(path)], check=True)


@pytest.mark.parametrize("what", ["log", "directory"])
def test_a_read_only_log_or_directory_stops_deo_with_one_line(
    deo: Callable[..., Deo], what: str
) -> None:
    d = deo(extra="snapshot_every = 5\n")
    d.run_two_workers_and_stop()
    workers = d.workers()
    snapshot_path(d.log).unlink(missing_ok=True)  # so the next one is written into the directory
    before = d.log.read_bytes()
    with read_only(d.log if what == "log" else d.dir):
        status, output = finished(d.start())
    assert status == 3, output
    assert "Traceback" not in output and "ExceptionGroup" not in output
    last = output.strip().splitlines()[-1]
    assert str(d.dir) in last and re.search("Permission denied|Operation not permitted", last)
    assert d.workers() == workers
    if what == "log":
        assert d.log.read_bytes() == before


def test_a_rotating_log_keeps_its_run_id_and_replays_with_tools_replay(
    deo: Callable[..., Deo],
) -> None:
    d = deo(extra='snapshot_every = 5\nsegment_bytes = 2000\nkeep_segments = "all"\n')
    d.run_two_workers_and_stop()
    workers = d.workers()
    process = d.start()
    try:
        wait_for("the workers adopted", lambda: d.log.read_bytes().count(b"WorkerAdopted") == 2)
        wait_for("two segments", lambda: len(segments(d.log)) >= 2)
    finally:
        process.send_signal(signal.SIGTERM)
        status, output = finished(process)
    assert status == 0, output
    assert d.workers() == workers  # adopted across rotation: none lost, none started again
    assert b"WorkerLost" not in b"".join(p.read_bytes() for p in [*segments(d.log), d.log])
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "replay"), "-q", str(d.log)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "verified:" in proc.stdout


def test_a_segment_whose_state_record_cannot_be_used_stops_start_up_and_spawns_nothing(
    deo: Callable[..., Deo],
) -> None:
    d = deo(extra='snapshot_every = 5\nsegment_bytes = 2000\nkeep_segments = "all"\n')
    process = d.start()
    try:
        wait_for(
            "two workers started and the log rotated",
            lambda: (
                len(d.workers()) == 2
                and b"".join(p.read_bytes() for p in [*segments(d.log), d.log]).count(
                    b'"@":"WorkerStarted"'
                )
                == 2
                and segments(d.log)
            ),
        )
    finally:
        process.send_signal(signal.SIGTERM)
        status, output = finished(process)
    assert status == 0, output
    workers = d.workers()
    lines = d.log.read_bytes().splitlines(keepends=True)
    assert b'"kind":"state"' in lines[1]
    # Valid JSON that decodes to no state: the segment's events alone lack the workers.
    lines[1] = b'{"kind":"state","seq":1,"state":{"@":"NoSuchState"}}\n'
    d.log.write_bytes(b"".join(lines))
    snapshot_path(d.log).unlink(missing_ok=True)
    damaged = d.log.read_bytes()

    status, output = finished(d.start())
    assert status == 2, output
    assert f"{d.log}: line 2, the state this segment of the log starts from" in output
    assert "Traceback" not in output
    assert d.workers() == workers  # none spawned, none stopped
    assert d.log.read_bytes() == damaged


def test_an_empty_worker_secret_and_a_stale_operator_token_are_replaced_at_start(
    deo: Callable[..., Deo],
) -> None:
    d = deo()
    d.log.with_name("run.jsonl.worker-secret").write_bytes(b"")  # cut short before it was written
    stale = d.log.with_name("run.jsonl.token")
    stale.write_text("token-of-an-earlier-run\n")
    process = d.start()  # with $DEO_TOKEN set
    try:
        wait_for("two workers", lambda: len(d.workers()) == 2)
    finally:
        process.send_signal(signal.SIGTERM)
        status, output = finished(process)
    assert status == 0, output
    assert "Traceback" not in output
    secret = d.log.with_name("run.jsonl.worker-secret")
    assert len(secret.read_text().strip()) >= WORKER_SECRET_CHARS
    assert secret.stat().st_mode & 0o777 == 0o600
    assert not stale.exists()  # `deo stop --log` must not send a token this run refuses
    assert not list(d.dir.glob("*.partial"))


def test_a_worker_secret_that_cannot_be_read_stops_deo_with_status_3(
    deo: Callable[..., Deo],
) -> None:
    d = deo()
    d.log.with_name("run.jsonl.worker-secret").mkdir()
    status, output = finished(d.start())
    assert status == 3, output
    assert "Traceback" not in output
    last = output.strip().splitlines()[-1]
    assert f"cannot write beside {d.log}" in last and "run.jsonl.worker-secret" in last
    assert d.workers() == []


@pytest.mark.parametrize("damaged", [b"", b"abc\n", b"\xff\xfe" * 30])
def test_a_damaged_worker_secret_file_is_replaced_whole(tmp_path: Path, damaged: bytes) -> None:
    log = tmp_path / "run.jsonl"
    path = worker_secret_path(log)
    path.write_bytes(damaged)
    secret = worker_secret_for(log)
    assert len(secret) >= WORKER_SECRET_CHARS
    assert path.read_text().strip() == secret and path.stat().st_mode & 0o777 == 0o600
    assert worker_secret_for(log) == secret  # kept from then on
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]


def test_a_missing_worker_secret_is_written_private_and_kept(tmp_path: Path) -> None:
    log = tmp_path / "run.jsonl"
    old = os.umask(0o022)
    try:
        secret = worker_secret_for(log)
    finally:
        os.umask(old)
    assert worker_secret_path(log).stat().st_mode & 0o777 == 0o600
    assert worker_secret_for(log) == secret


def test_the_operator_token_replaces_the_file_whole_and_private(tmp_path: Path) -> None:
    path = tmp_path / "run.jsonl.token"
    path.write_text("old\n")
    path.chmod(0o644)
    path.with_name(path.name + ".partial").write_text("left by a crash")
    write_operator_token(path, "new-token")
    assert path.read_text() == "new-token\n" and path.stat().st_mode & 0o777 == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]


def test_a_token_file_that_cannot_be_written_leaves_no_partial_file(tmp_path: Path) -> None:
    path = tmp_path / "run.jsonl.token"
    path.mkdir()  # renaming a file over a directory fails
    with pytest.raises(OSError):
        write_operator_token(path, "new-token")
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]


@pytest.mark.parametrize("token", ["secret\n", " secret", "sécret", "se cret"])
def test_a_token_no_client_could_send_stops_start_up_unquoted(
    deo: Callable[..., Deo], token: str
) -> None:
    d = deo()
    done = subprocess.run(
        [sys.executable, "-m", "adapters.cli", "run", "--config", str(d.config)],
        cwd=d.dir,
        env={**os.environ, "DEO_TOKEN": token},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "deo: $DEO_TOKEN: " in done.stdout and "no client could send it" in done.stdout
    assert token.strip() not in done.stdout + done.stderr  # a secret is never echoed
    assert not d.log.exists() and d.workers() == []
