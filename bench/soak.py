"""Soak benchmark: a real ``deo run`` under churn; does deo's memory, descriptors, CPU or log leak?

Run from the repository root::

    .venv/bin/python bench/soak.py                      # an hour (the default --duration-s 3600)
    .venv/bin/python bench/soak.py --duration-s 600     # ten minutes

It starts ``deo run`` as a process of its own, on a configuration file it writes into
``--workdir`` (a temporary directory by default): one pool of small worker processes
(``examples/worker.py``, heartbeating through their heartbeat files), the API on a free loopback
port, the operator token in ``$DEO_TOKEN``. For ``--duration-s`` it then, at the same time:

- pins the pool to a random size (0 to ``--max-workers``) every ``--pin-interval-s`` through
  ``POST /v1/pools/{pool}/pin``, and now and then unpins it (the static policy takes over);
- SIGKILLs a random active worker about every ``--kill-interval-s`` (a crash deo must notice,
  record and replace);
- sends ``GET /global-status``, ``/metrics`` and ``/v1/workers`` at ``--requests-per-s``, one
  request in five on a fresh connection so that the server accepts and closes sockets too;
- samples deo's resident memory (``/proc/PID/status``), open descriptors (``/proc/PID/fd``),
  threads and CPU time (``/proc/PID/stat``), and the size of its log (every segment on disk)
  and snapshot, every ``--sample-interval-s``.

Then it stops deo with ``deo stop --drain``, checks that no process carrying the run's
``DEO_RUN_ID`` (or the soak's own marker) is left, and that ``deo replay`` verifies the log.

The report compares a first and a last window (a tenth of the run each): levels, growth per hour,
CPU seconds per hour, log bytes per hour. The verdict "no leak" needs resident memory and open
descriptors flat over the second half of the run (the first half is warm-up: imports, caches,
allocator pools). Growth there is the median of its last quarter less that of its first, of
resident memory and of the descriptors open beyond one per live worker (deo holds a pidfd for
each); a leak is growth above a noise floor (1 MiB, 2 descriptors) at a rate above
``--rss-tolerance-mib-per-h`` or ``--fd-tolerance-per-h``.

The result goes to ``--out`` (``docs/benchmarks.md``) between ``<!-- soak:start -->`` and
``<!-- soak:end -->``, the rest of the file untouched; ``--json`` also writes every sample.

Exit status: 0 for a clean run without a leak; 1 when the verdict is a suspected leak or a check
at the end failed (deo's exit status, an orphaned process, a log that does not verify, failed API
requests); 2 on bad arguments or when deo could not be started.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import math
import os
import platform
import random
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, cast

import anyio
import attrs
import httpx

from adapters.log import segments
from adapters.runtime.config_file import RunSettings
from core import DeoError

__all__ = [
    "HELP",
    "DeoUnderTest",
    "Result",
    "Sample",
    "SoakError",
    "SoakSettings",
    "Verdict",
    "add_arguments",
    "main",
    "run",
    "verdict",
    "write_section",
]

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "benchmarks.md"
HELP = "soak a real deo run under churn; report its memory, descriptors, CPU and log growth"
START_MARK = "<!-- soak:start -->"
END_MARK = "<!-- soak:end -->"
WORKER = ROOT / "examples" / "worker.py"
POOL = "soak"
TOKEN_ENV = "DEO_TOKEN"
#: In the environment of deo and so of every worker it starts (deo passes on everything but its
#: own DEO_ variables and the operator token): finds what this soak started, whatever happened.
MARKER_ENV = "SOAK_RUN_MARKER"
RUN_ID_ENV = "DEO_RUN_ID"
MIB = 2**20
#: Growth over the second half never counted as a leak, whatever its rate: allocator noise, and
#: connections or worker starts in flight at the moment of a sample.
RSS_NOISE_BYTES = 1 * MIB
FD_NOISE = 2
CLOCK_TICKS_PER_S = os.sysconf("SC_CLK_TCK")
#: Generous: a loaded machine answers slowly, and slowness is not what this benchmark measures.
HTTP_TIMEOUT_S = 30.0
START_TIMEOUT_S = 60.0
#: How long the cleanup keeps looking for processes of the run to kill.
CLEANUP_S = 10.0


class SoakError(DeoError):
    """The soak could not run (bad arguments, deo did not start); the message says why."""


@attrs.frozen(slots=True, kw_only=True)
class SoakSettings:
    """How long and how hard to churn, how often to sample, what counts as a leak."""

    duration_s: float = 3600.0
    sample_interval_s: float = 10.0
    pin_interval_s: float = 5.0
    kill_interval_s: float = 15.0
    requests_per_s: float = 5.0
    max_workers: int = 6
    #: Seconds per item of the example worker: also its heartbeat period.
    worker_item_s: float = 0.5
    rss_tolerance_mib_per_h: float = 5.0
    fd_tolerance_per_h: float = 5.0
    seed: int = 20261123

    def __attrs_post_init__(self) -> None:
        for name in (
            "duration_s",
            "sample_interval_s",
            "pin_interval_s",
            "kill_interval_s",
            "requests_per_s",
            "worker_item_s",
        ):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise SoakError(f"--{name.replace('_', '-')}: must be > 0, got {value}")
        if self.duration_s < 4 * self.sample_interval_s:
            raise SoakError(
                f"--duration-s {self.duration_s:g} leaves fewer than 4 samples at "
                f"--sample-interval-s {self.sample_interval_s:g}"
            )
        if not 1 <= self.max_workers <= 64:
            raise SoakError(f"--max-workers: must be 1 to 64, got {self.max_workers}")
        for name in ("rss_tolerance_mib_per_h", "fd_tolerance_per_h"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise SoakError(f"--{name.replace('_', '-')}: must be >= 0, got {value}")


@attrs.frozen(slots=True, kw_only=True)
class Sample:
    """deo's process and files at one moment, ``t_s`` seconds into the churn."""

    t_s: float
    rss_bytes: int
    open_fds: int
    #: Of ``open_fds``: sockets (the API's connections, its listening socket) and pidfds.
    sockets: int
    pidfds: int
    threads: int
    cpu_s: float
    log_bytes: int
    snapshot_bytes: int
    live_workers: int


@attrs.define(slots=True)
class Traffic:
    """What the churn did, and what failed."""

    pins: int = 0
    unpins: int = 0
    kills: int = 0
    gets: int = 0
    fresh_connections: int = 0
    failed_requests: int = 0
    #: The first few failures, whole (the count says how many there were).
    failures: list[str] = attrs.field(factory=list)

    def failed(self, what: str) -> None:
        self.failed_requests += 1
        if len(self.failures) < 100:
            self.failures.append(what)


# --- reading /proc -------------------------------------------------------------------------------


def rss_bytes(pid: int) -> int:
    """Resident memory of ``pid`` (``VmRSS``)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise OSError(f"/proc/{pid}/status has no VmRSS (a zombie?)")


def open_fds(pid: int) -> tuple[int, int, int]:
    """(descriptors, sockets, pidfds) ``pid`` holds open."""
    total = sockets = pidfds = 0
    base = f"/proc/{pid}/fd"
    for name in os.listdir(base):
        try:
            target = os.readlink(f"{base}/{name}")
        except FileNotFoundError:
            continue  # closed since the listing
        total += 1
        sockets += target.startswith("socket:")
        pidfds += target == "anon_inode:[pidfd]"
    return total, sockets, pidfds


def cpu_and_threads(pid: int) -> tuple[float, int]:
    """(user + system CPU seconds, threads) of ``pid``, from ``/proc/PID/stat``."""
    # The command name may hold spaces and parentheses: the fields start after the last ")".
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    # fields[0] is field 3 (state); utime, stime are fields 14, 15; num_threads is field 20.
    utime, stime, threads = int(fields[11]), int(fields[12]), int(fields[17])
    return (utime + stime) / CLOCK_TICKS_PER_S, threads


def processes_with(variables: Sequence[str]) -> list[int]:
    """Pids of the processes whose environment holds any of ``variables`` (``NAME=value``)."""
    wanted = {v.encode() for v in variables}
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            environ = Path(entry.path, "environ").read_bytes()
        except OSError:
            continue  # gone, or not ours to read
        if wanted & set(environ.split(b"\0")):
            found.append(int(entry.name))
    return found


def environ_value(pid: int, name: str) -> str | None:
    """The value of ``name`` in the environment ``pid`` started with, if readable and set."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return None
    prefix = name.encode() + b"="
    for item in environ.split(b"\0"):
        if item.startswith(prefix):
            return item[len(prefix) :].decode(errors="replace")
    return None


def file_bytes(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


#: Records between snapshots: about one every four minutes at the soak's churn (the default,
#: 10,000, would take more than an hour).
SNAPSHOT_EVERY = 500
#: The log rotation ``deo run`` does by default, which the soak keeps.
DEFAULT_SEGMENT_BYTES = cast(int, attrs.fields(RunSettings).segment_bytes.default)
DEFAULT_KEEP_SEGMENTS = attrs.fields(RunSettings).keep_segments.default

# --- the deo under test --------------------------------------------------------------------------


def config_text(settings: SoakSettings) -> str:
    """The ``deo run`` configuration: one pool of example workers, pinned by the churn."""
    argv = [sys.executable, str(WORKER), f"{settings.worker_item_s:g}"]
    # Workers are killed at random a few seconds after they start: with the default crash-loop
    # rules (an exit within 30 s is a failure, backoff up to 300 s) the pool would sit in backoff.
    # Here only a worker that dies within a second counts, and backoff stays short.
    return f"""\
[deo]
log = "soak.jsonl"
worker_logs = "workers"
# More often than the default, so that a soak of minutes rewrites the snapshot too.
snapshot_every = {SNAPSHOT_EVERY}

[api]
host = "127.0.0.1"
port = 0
token_env = "{TOKEN_ENV}"

[pools.{POOL}]
argv = {json.dumps(argv)}
min_workers = 0
max_workers = {settings.max_workers}
heartbeat_grace_s = 30
drain_timeout_s = 10
stop_timeout_s = 5

[pools.{POOL}.policy]
name = "static"
count = {max(1, settings.max_workers // 2)}

[pools.{POOL}.crash_loop]
early_exit_s = 1.0
backoff_base_s = 0.5
backoff_cap_s = 4.0
"""


class DeoUnderTest:
    """One ``deo run`` process in ``workdir``, its API address and its files."""

    def __init__(self, workdir: Path, settings: SoakSettings) -> None:
        self.dir = workdir
        self.config = workdir / "soak.toml"
        self.log = workdir / "soak.jsonl"
        self.snapshot = workdir / "soak.jsonl.snapshot"
        self.output = workdir / "deo.out"
        self.marker = uuid.uuid4().hex
        self.token = uuid.uuid4().hex
        self.run_id: str | None = None
        self.url = ""
        self.config.write_text(config_text(settings))
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def environ(self) -> dict[str, str]:
        return {**os.environ, TOKEN_ENV: self.token, MARKER_ENV: self.marker}

    async def start(self) -> None:
        with self.output.open("wb") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "adapters.cli", "run", "--config", str(self.config)],
                cwd=self.dir,
                env=self.environ(),
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            found = re.search(r"API on (http://\S+)", self.output.read_text(errors="replace"))
            if found:
                self.url = found.group(1)
                return
            if self.process.poll() is not None:
                break
            await anyio.sleep(0.1)
        tail = self.output.read_text(errors="replace")[-2000:]
        raise SoakError(f"deo run did not start (exit status {self.process.poll()}):\n{tail}")

    def exited(self) -> int | None:
        """deo's exit status, None while it runs."""
        assert self.process is not None
        return self.process.poll()

    def process_status(self) -> int | None:
        """deo's exit status once it has exited (waiting a little for a dying process)."""
        assert self.process is not None
        try:
            return self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            return None

    def sample(self, t_s: float, live_workers: int) -> Sample:
        cpu_s, threads = cpu_and_threads(self.pid)
        fds, sockets, pidfds = open_fds(self.pid)
        return Sample(
            t_s=t_s,
            rss_bytes=rss_bytes(self.pid),
            open_fds=fds,
            sockets=sockets,
            pidfds=pidfds,
            threads=threads,
            cpu_s=cpu_s,
            log_bytes=self.log_bytes(),
            snapshot_bytes=file_bytes(self.snapshot),
            live_workers=live_workers,
        )

    def log_bytes(self) -> int:
        """The log's size on disk: its earlier segments (``soak.jsonl.000001``, ...) and the live
        one, the files ``count_log`` reads."""
        return sum(file_bytes(path) for path in log_files(self.log))

    def ours(self, pid: int) -> bool:
        """Whether ``pid`` is (still) a process this soak's deo started."""
        return environ_value(pid, MARKER_ENV) == self.marker and pid != self._own_pid()

    def _own_pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    def leftovers(self) -> list[int]:
        """Processes of this run still alive, deo excluded."""
        variables = [f"{MARKER_ENV}={self.marker}"]
        if self.run_id is not None:
            variables.append(f"{RUN_ID_ENV}={self.run_id}")
        own = self._own_pid()
        return [p for p in processes_with(variables) if p != own and alive(p)]


def alive(pid: int) -> bool:
    """Whether ``pid`` is a live process (not gone, not a zombie)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


# --- the churn -----------------------------------------------------------------------------------


async def churn(
    deo: DeoUnderTest,
    settings: SoakSettings,
    report: Callable[[Sample], None],
) -> tuple[list[Sample], Traffic, str | None]:
    """Drive ``deo`` for ``settings.duration_s``; (samples, traffic, why it ended early or None)."""
    rng = random.Random(settings.seed)
    traffic = Traffic()
    samples: list[Sample] = []
    headers = {"Authorization": f"Bearer {deo.token}"}
    live_workers = 0
    ended: str | None = None
    started = time.monotonic()

    async with (
        httpx.AsyncClient(base_url=deo.url, timeout=HTTP_TIMEOUT_S) as client,
        anyio.create_task_group() as tg,
    ):

        async def workers() -> list[dict[str, Any]]:
            response = await client.get("/v1/workers")
            response.raise_for_status()
            found: list[dict[str, Any]] = response.json()["workers"]
            return found

        async def pin() -> None:
            while True:
                await anyio.sleep(settings.pin_interval_s * rng.uniform(0.5, 1.5))
                count = None if rng.random() < 0.1 else rng.randint(0, settings.max_workers)
                try:
                    # Sent, a pin is logged: its answer is awaited even as the churn ends, so
                    # the pins counted are the pins in the log.
                    with anyio.CancelScope(shield=True):
                        response = await client.post(
                            f"/v1/pools/{POOL}/pin", json={"count": count}, headers=headers
                        )
                except httpx.HTTPError as exc:
                    traffic.failed(f"pin {count}: {exc!r}")
                    continue
                if response.status_code != 200:
                    traffic.failed(f"pin {count}: {response.status_code} {response.text[:200]}")
                elif count is None:
                    traffic.unpins += 1
                else:
                    traffic.pins += 1

        async def kill() -> None:
            while True:
                await anyio.sleep(settings.kill_interval_s * rng.uniform(0.5, 1.5))
                try:
                    active = [w for w in await workers() if w["state"] == "active" and w["pid"]]
                except httpx.HTTPError as exc:
                    traffic.failed(f"GET /v1/workers: {exc!r}")
                    continue
                if not active:
                    continue
                pid = rng.choice(active)["pid"]
                # The pid must still be our worker's: never signal a process deo did not start.
                if not deo.ours(pid):
                    continue
                deo.run_id = deo.run_id or environ_value(pid, RUN_ID_ENV)
                try:
                    os.kill(pid, signal.SIGKILL)
                    traffic.kills += 1
                except ProcessLookupError:
                    pass  # it exited by itself meanwhile

        async def get() -> None:
            paths = ("/global-status", "/metrics", "/v1/workers")
            while True:
                await anyio.sleep(rng.expovariate(settings.requests_per_s))
                path = rng.choice(paths)
                try:
                    if rng.random() < 0.2:
                        traffic.fresh_connections += 1
                        async with httpx.AsyncClient(
                            base_url=deo.url, timeout=HTTP_TIMEOUT_S
                        ) as fresh:
                            response = await fresh.get(path)
                    else:
                        response = await client.get(path)
                except httpx.HTTPError as exc:
                    traffic.failed(f"GET {path}: {exc!r}")
                    continue
                if response.status_code == 200:
                    traffic.gets += 1
                else:
                    traffic.failed(f"GET {path}: {response.status_code} {response.text[:200]}")

        async def sample() -> None:
            nonlocal live_workers, ended
            # A fixed schedule: a stall of this process or of the machine makes samples late,
            # never fewer (the late ones are taken at once, each with the time it was taken).
            steps = math.ceil(settings.duration_s / settings.sample_interval_s - 1e-9)
            for k in range(steps + 1):
                at_s = min(k * settings.sample_interval_s, settings.duration_s)
                await anyio.sleep(max(0.0, at_s - (time.monotonic() - started)))
                t_s = time.monotonic() - started
                try:
                    live = await workers()
                except httpx.HTTPError as exc:
                    traffic.failed(f"GET /v1/workers: {exc!r}")
                else:
                    live_workers = len(live)
                    for worker in live:
                        if deo.run_id is None and worker["pid"] and deo.ours(worker["pid"]):
                            deo.run_id = environ_value(worker["pid"], RUN_ID_ENV)
                try:
                    if deo.exited() is not None:
                        raise OSError("exited")
                    samples.append(deo.sample(t_s, live_workers))
                except OSError:
                    ended = f"deo exited with status {deo.process_status()} at t={t_s:.0f} s"
                    break
                report(samples[-1])
            tg.cancel_scope.cancel()

        tg.start_soon(pin)
        tg.start_soon(kill)
        tg.start_soon(get)
        tg.start_soon(sample)
    return samples, traffic, ended


@attrs.frozen(slots=True, kw_only=True)
class Ending:
    """What the checks after the churn found."""

    stop_status: int
    deo_status: int | None
    stop_s: float
    orphans: tuple[int, ...]
    replay_status: int
    replay_summary: str
    log_counts: LogCounts

    @property
    def clean(self) -> bool:
        return (
            self.stop_status == 0
            and self.deo_status == 0
            and not self.orphans
            and self.replay_status == 0
        )


async def finish(deo: DeoUnderTest) -> Ending:
    """``deo stop --drain``, wait for deo to exit, look for leftovers, replay the log."""
    began = time.monotonic()
    deo_cli = [sys.executable, "-m", "adapters.cli"]
    with anyio.fail_after(120):
        stop = await anyio.run_process(
            [*deo_cli, "stop", "--drain", "--url", deo.url, "--token-env", TOKEN_ENV],
            env=deo.environ(),
            check=False,
        )
    # deo bounds its own drain (drain, SIGTERM and SIGKILL deadlines); this is a safety net.
    deadline = time.monotonic() + 120.0
    while deo.exited() is None and time.monotonic() < deadline:
        await anyio.sleep(0.2)
    deo_status = deo.exited()
    stop_s = time.monotonic() - began
    if deo_status is None:
        deo.process.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
        await anyio.sleep(5)
    orphans = tuple(deo.leftovers())
    # Generous: an hour's log replays in well under a minute on a quiet machine.
    with anyio.fail_after(1800):
        replay = await anyio.run_process([*deo_cli, "replay", "-q", str(deo.log)], check=False)
    # The report names the log by its file name: the directory is a temporary one.
    summary = (replay.stdout + replay.stderr).decode(errors="replace").strip()
    summary = summary.replace(str(deo.log), deo.log.name)
    return Ending(
        stop_status=stop.returncode,
        deo_status=deo_status,
        stop_s=stop_s,
        orphans=orphans,
        replay_status=replay.returncode,
        replay_summary=summary.splitlines()[-1] if summary else "",
        log_counts=count_log(deo.log),
    )


def log_files(path: Path) -> list[Path]:
    """The files of the log at ``path``: its earlier segments, oldest first, then the live one."""
    return [*segments(path), *([path] if path.exists() else [])]


@attrs.frozen(slots=True, kw_only=True)
class LogCounts:
    """What the log's files hold, every segment present included."""

    #: Files read: the earlier segments still on disk and the live log.
    segments: int
    #: Lines of all of them: events, commands, segment headers and state records.
    records: int
    log_bytes: int
    #: Records by event type (``Tick``, ``WorkersSeen``, ...).
    events: dict[str, int]
    #: Bytes (newline included) of those records by event type.
    event_bytes: dict[str, int]
    #: Bytes of the records that are not events, by kind (``commands``, ``header``, ``state``,
    #: ``rejected``, ...).
    other_bytes: dict[str, int]
    #: Worker ids the ``WorkersSeen`` records hold, all together: each is one worker seen
    #: alive during one tick.
    sightings: int
    #: One record per heartbeat, as logs written by older versions of deo hold them.
    heartbeats: int
    unreadable: int

    def events_of(self, name: str) -> int:
        """How many records of event type ``name`` the log holds."""
        return self.events.get(name, 0)

    def share(self, name: str) -> float:
        """The fraction of the log's bytes taken by records of event type ``name``."""
        return self.event_bytes.get(name, 0) / self.log_bytes if self.log_bytes else 0.0

    def largest(self, n: int) -> list[tuple[str, float]]:
        """The ``n`` event types or other record kinds taking most of the log's bytes, with
        their fractions of it; record kinds are named in lower case, event types as classes."""
        if not self.log_bytes:
            return []
        both = {**self.other_bytes, **self.event_bytes}
        ranked = sorted(both.items(), key=lambda item: -item[1])[:n]
        return [(name, size / self.log_bytes) for name, size in ranked]


def count_log(path: Path) -> LogCounts:
    """Count the records of the log at ``path``, across every segment present."""
    events: Counter[str] = Counter()
    event_bytes: Counter[str] = Counter()
    other_bytes: Counter[str] = Counter()
    files = log_files(path)
    records = size = sightings = unreadable = 0
    for file in files:
        with file.open("rb") as f:
            for line in f:
                records += 1
                size += len(line)
                try:
                    record = json.loads(line)
                except ValueError:
                    unreadable += 1
                    continue
                if not isinstance(record, dict) or record.get("kind") != "event":
                    kind = record.get("kind") if isinstance(record, dict) else None
                    other_bytes[str(kind)] += len(line)
                    continue
                event = record.get("event")
                name = str(event.get("@")) if isinstance(event, dict) else "?"
                events[name] += 1
                event_bytes[name] += len(line)
                if name == "WorkersSeen" and isinstance(event, dict):
                    sightings += len(event.get("worker_ids") or ())
    return LogCounts(
        segments=len(files),
        records=records,
        log_bytes=size,
        events=dict(events),
        event_bytes=dict(event_bytes),
        other_bytes=dict(other_bytes),
        sightings=sightings,
        heartbeats=events.get("WorkerHeartbeat", 0),
        unreadable=unreadable,
    )


def cleanup(deo: DeoUnderTest) -> None:
    """Kill whatever of this run is still alive: deo, then every marked process, until a look
    finds none (a worker deo was forking as it died execs after the first look)."""
    if deo.process is not None and deo.process.poll() is None:
        deo.process.kill()
        deo.process.wait(timeout=30)
    deadline = time.monotonic() + CLEANUP_S
    while True:
        # The marker alone: a fork not yet exec'd has deo's environment, without a run id.
        left = [p for p in processes_with([f"{MARKER_ENV}={deo.marker}"]) if deo.ours(p)]
        left = [p for p in left if alive(p)]
        if not left or time.monotonic() >= deadline:
            return
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.2)


# --- analysis ------------------------------------------------------------------------------------


@attrs.frozen(slots=True, kw_only=True)
class Window:
    """A stretch of samples: levels and rates per hour."""

    first_s: float
    last_s: float
    rss_mib: float
    rss_mib_per_h: float
    fds_max: int
    sockets_max: int
    #: The median of the descriptors open beyond one per live worker (a slope of so few
    #: samples, which change by several as workers start and exit, would be noise).
    extra_fds: float
    threads_max: int
    cpu_s_per_h: float
    log_mb_per_h: float
    snapshot_kb: float


def _per_h(samples: Sequence[Sample], value: Callable[[Sample], float]) -> float:
    """The least-squares slope of ``value`` over ``samples``, per hour."""
    if len(samples) < 2 or samples[-1].t_s == samples[0].t_s:
        return 0.0
    slope, _ = statistics.linear_regression([s.t_s for s in samples], [value(s) for s in samples])
    return slope * 3600.0


def _rate_per_h(samples: Sequence[Sample], value: Callable[[Sample], float]) -> float:
    """How fast a counter (CPU time, bytes written) rose over ``samples``, per hour."""
    span = samples[-1].t_s - samples[0].t_s
    return (value(samples[-1]) - value(samples[0])) / span * 3600.0 if span > 0 else 0.0


def window(samples: Sequence[Sample]) -> Window:
    return Window(
        first_s=samples[0].t_s,
        last_s=samples[-1].t_s,
        rss_mib=statistics.mean(s.rss_bytes for s in samples) / MIB,
        rss_mib_per_h=_per_h(samples, lambda s: s.rss_bytes / MIB),
        fds_max=max(s.open_fds for s in samples),
        sockets_max=max(s.sockets for s in samples),
        extra_fds=statistics.median(s.open_fds - s.live_workers for s in samples),
        threads_max=max(s.threads for s in samples),
        cpu_s_per_h=_rate_per_h(samples, lambda s: s.cpu_s),
        log_mb_per_h=_rate_per_h(samples, lambda s: s.log_bytes / 1e6),
        snapshot_kb=samples[-1].snapshot_bytes / 1e3,
    )


@attrs.frozen(slots=True, kw_only=True)
class Verdict:
    """Memory and descriptors over the second half: flat, or a suspected leak.

    Growth is the difference of the medians of the half's last and first quarters (medians: a
    sample taken while a request or a worker's start is in flight does not move them); a rate is
    that growth over the time between the quarters' middles. A leak is growth beyond the noise
    floor at a rate beyond the tolerance, so that neither a few noisy samples of a short run nor a
    slow warm-up of a long one passes for one.
    """

    span_s: float
    rss_growth_bytes: float
    rss_allowed_mib_per_h: float
    fd_growth: float
    fd_allowed_per_h: float

    @property
    def rss_mib_per_h(self) -> float:
        return self.rss_growth_bytes / MIB / self.span_s * 3600 if self.span_s > 0 else 0.0

    @property
    def fds_per_h(self) -> float:
        return self.fd_growth / self.span_s * 3600 if self.span_s > 0 else 0.0

    @property
    def rss_leak(self) -> bool:
        return (
            self.rss_growth_bytes > RSS_NOISE_BYTES
            and self.rss_mib_per_h > self.rss_allowed_mib_per_h
        )

    @property
    def fd_leak(self) -> bool:
        return self.fd_growth > FD_NOISE and self.fds_per_h > self.fd_allowed_per_h

    @property
    def leak(self) -> bool:
        return self.rss_leak or self.fd_leak

    def __str__(self) -> str:
        what = "SUSPECTED LEAK" if self.leak else "no leak"
        return (
            f"{what}: over the second half RSS {self.rss_growth_bytes / MIB:+.1f} MiB "
            f"({self.rss_mib_per_h:+.1f} MiB/h{', a leak' if self.rss_leak else ''}), "
            f"descriptors beyond one per live worker {self.fd_growth:+g} "
            f"({self.fds_per_h:+.1f}/h{', a leak' if self.fd_leak else ''})"
        )


def verdict(samples: Sequence[Sample], settings: SoakSettings) -> Verdict:
    """Whether ``samples`` show deo's memory or descriptors growing over the second half."""
    half = [s for s in samples if s.t_s >= samples[-1].t_s / 2]
    quarter = max(1, len(half) // 4)
    early, late = half[:quarter], half[-quarter:]

    def growth(value: Callable[[Sample], float]) -> float:
        return float(statistics.median(map(value, late)) - statistics.median(map(value, early)))

    return Verdict(
        span_s=statistics.median(s.t_s for s in late) - statistics.median(s.t_s for s in early),
        rss_growth_bytes=growth(lambda s: s.rss_bytes),
        rss_allowed_mib_per_h=settings.rss_tolerance_mib_per_h,
        fd_growth=growth(lambda s: s.open_fds - s.live_workers),
        fd_allowed_per_h=settings.fd_tolerance_per_h,
    )


def windows(samples: Sequence[Sample]) -> tuple[Window, Window]:
    """The first and the last tenth of the run (at least 3 samples each)."""
    size = max(3, math.ceil(len(samples) / 10))
    return window(samples[:size]), window(samples[-size:])


# --- report --------------------------------------------------------------------------------------


def sample_line(s: Sample) -> str:
    return (
        f"{s.t_s:>8.0f} {s.rss_bytes / MIB:>9.1f} {s.open_fds:>5} {s.sockets:>7} {s.pidfds:>6} "
        f"{s.threads:>7} "
        f"{s.cpu_s:>8.1f} {s.log_bytes / 1e6:>9.2f} {s.snapshot_bytes / 1e3:>9.1f} "
        f"{s.live_workers:>7}"
    )


SAMPLE_HEADER = (
    f"{'t (s)':>8} {'RSS MiB':>9} {'fds':>5} {'sockets':>7} {'pidfds':>6} {'threads':>7} "
    f"{'CPU s':>8} {'log MB':>9} "
    f"{'snap kB':>9} {'workers':>7}"
)


def spread(samples: Sequence[Sample], rows: int) -> list[Sample]:
    """At most ``rows`` samples, evenly spaced, first and last included."""
    if len(samples) <= rows:
        return list(samples)
    step = (len(samples) - 1) / (rows - 1)
    return [samples[round(i * step)] for i in range(rows)]


def _load_average() -> str:
    try:
        return "/".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def _commit() -> str:
    try:
        done = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, timeout=30
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "core", "adapters", "bench", "examples"],
            cwd=ROOT,
            capture_output=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    if done.returncode != 0:
        return "unknown (not a git checkout)"
    commit = done.stdout.decode().strip()
    return commit + (" + uncommitted changes" if dirty.stdout.strip() else "")


@attrs.frozen(slots=True, kw_only=True)
class Result:
    """Everything one soak found."""

    command: str
    settings: SoakSettings
    date: str
    code: str
    load: tuple[str, str]
    samples: tuple[Sample, ...]
    traffic: Traffic
    ending: Ending
    verdict: Verdict

    @property
    def ok(self) -> bool:
        return self.ending.clean and not self.verdict.leak and self.traffic.failed_requests == 0

    def as_json(self) -> dict[str, Any]:
        return {
            "command": self.command,
            "settings": attrs.asdict(self.settings),
            "samples": [attrs.asdict(s) for s in self.samples],
            "traffic": attrs.asdict(self.traffic),
            "ending": {**attrs.asdict(self.ending), "clean": self.ending.clean},
            "verdict": {
                **attrs.asdict(self.verdict),
                "rss_mib_per_h": self.verdict.rss_mib_per_h,
                "fds_per_h": self.verdict.fds_per_h,
                "leak": self.verdict.leak,
            },
            "ok": self.ok,
        }


def _duration(seconds: float) -> str:
    if seconds >= 3600 and seconds % 3600 == 0:
        return f"{seconds / 3600:g} hour{'s' if seconds != 3600 else ''}"
    if seconds >= 60 and seconds % 60 == 0:
        return f"{seconds / 60:g} minutes"
    return f"{seconds:g} s"


def log_files_line(counts: LogCounts) -> str:
    """How many files the log took: the live one alone, or segments."""
    if counts.segments <= 1:
        return f"{counts.log_bytes / 1e6:.2f} MB in one file (it never reached a segment's size)"
    return f"{counts.log_bytes / 1e6:.2f} MB in {counts.segments} files (the live segment included)"


def composition_line(counts: LogCounts) -> str:
    """The record kinds and event types taking most of the log's bytes, with their shares."""
    return ", ".join(f"{name} {share:.0%}" for name, share in counts.largest(5)) or "none"


def sightings_line(counts: LogCounts) -> str:
    """The workers' signs of life in the log: batched sightings, or one record per heartbeat."""
    seen = (
        f"{counts.events_of('WorkersSeen'):,} `WorkersSeen` records holding {counts.sightings:,} "
        f"sightings of a worker ({counts.share('WorkersSeen'):.0%} of its bytes)"
    )
    if not counts.heartbeats:
        return seen
    return (
        f"{seen}, {counts.heartbeats:,} `WorkerHeartbeat` records "
        f"({counts.share('WorkerHeartbeat'):.0%} of its bytes)"
    )


def render(result: Result) -> str:
    """The markdown section for docs/benchmarks.md."""
    s, t, e = result.settings, result.traffic, result.ending
    first, last = windows(result.samples)
    counts = e.log_counts
    lines = [
        START_MARK,
        "## Soak: `deo run` under churn (`bench/soak.py`)",
        "",
        f"- Command: `{result.command}`",
        f"- Date: {result.date}",
        f"- Duration: {_duration(s.duration_s)}"
        + (
            ""
            if s.duration_s >= 3600
            else ", not the hour this benchmark runs by default: a slow leak may not show in it"
        ),
        f"- Result: {'no leak' if not result.verdict.leak else 'SUSPECTED LEAK'}; "
        + ("clean end" if e.clean else "the checks at the end FAILED")
        + f" (below); {t.failed_requests} failed requests.",
        f"- Code: commit {result.code}",
        f"- Python: {platform.python_implementation()} {platform.python_version()}; machine: "
        f"os.cpu_count()={os.cpu_count()}, {platform.platform()}",
        f"- Load average (1/5/15 min) at start {result.load[0]}, at end {result.load[1]} "
        "(the machine was shared; CPU time is deo's own, from /proc, and waiting for a core "
        "is not counted in it)",
        "- deo: `deo run` as a process of its own, its defaults but for a snapshot every "
        f"{SNAPSHOT_EVERY:,} records (1 s ticks, every write fsynced, API on a loopback port, "
        f"the log cut into a new segment past {DEFAULT_SEGMENT_BYTES / MIB:g} MiB with "
        f"{DEFAULT_KEEP_SEGMENTS} earlier segments kept); workers count as crash-looping only "
        "when they die within 1 s of starting.",
        f"- Churn: one pool of `examples/worker.py` processes (heartbeat files, "
        f"{s.worker_item_s:g} s per item), pinned to a random size 0-{s.max_workers} about every "
        f"{s.pin_interval_s:g} s ({t.pins} pins, {t.unpins} unpins); a random active worker "
        f"SIGKILLed about every {s.kill_interval_s:g} s ({t.kills} kills); "
        f"{t.gets} GETs of /global-status, /metrics and /v1/workers "
        f"({t.fresh_connections} on a fresh connection), {t.failed_requests} failed requests.",
        f"- The log: {log_files_line(counts)}; {counts.records:,} records; "
        f"{counts.events_of('WorkerStarted')} workers started, "
        f"{counts.events_of('WorkerExited')} exits, {counts.events_of('PoolPinned')} pins, "
        f"{counts.events_of('Tick'):,} ticks ({counts.share('Tick'):.0%} of its bytes), "
        f"{sightings_line(counts)}; its bytes, largest first: {composition_line(counts)}.",
        "",
        f"Samples every {s.sample_interval_s:g} s of deo's process (`/proc/PID/status` VmRSS, "
        "`/proc/PID/fd`, `/proc/PID/stat`) and files (log, snapshot); "
        f"{len(result.samples)} in all, {min(13, len(result.samples))} shown:",
        "",
        "| t (s) | RSS (MiB) | open fds | sockets | pidfds | threads | CPU (s) | log (MB) "
        "| snapshot (kB) | live workers |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for x in spread(result.samples, 13):
        lines.append(
            f"| {x.t_s:.0f} | {x.rss_bytes / MIB:.1f} | {x.open_fds} | {x.sockets} | "
            f"{x.pidfds} | {x.threads} | "
            f"{x.cpu_s:.1f} | {x.log_bytes / 1e6:.2f} | {x.snapshot_bytes / 1e3:.1f} | "
            f"{x.live_workers} |"
        )
    lines += [
        "",
        f"Start: the first window (t = {first.first_s:.0f}-{first.last_s:.0f} s); end: the last "
        f"(t = {last.first_s:.0f}-{last.last_s:.0f} s). Growth per hour: least-squares slope "
        "within the window; CPU and log: increase over the window, per hour.",
        "",
        "| measurement | start | end |",
        "|---|---|---|",
        f"| RSS (MiB, mean) | {first.rss_mib:.1f} | {last.rss_mib:.1f} |",
        f"| RSS growth (MiB per hour) | {first.rss_mib_per_h:+.1f} | {last.rss_mib_per_h:+.1f} |",
        f"| open descriptors (most) | {first.fds_max} | {last.fds_max} |",
        f"| descriptors beyond one per live worker (median) | {first.extra_fds:g} | "
        f"{last.extra_fds:g} |",
        f"| sockets (most) | {first.sockets_max} | {last.sockets_max} |",
        f"| threads (most) | {first.threads_max} | {last.threads_max} |",
        f"| CPU (s per hour) | {first.cpu_s_per_h:.0f} | {last.cpu_s_per_h:.0f} |",
        f"| log growth (MB per hour) | {first.log_mb_per_h:.1f} | {last.log_mb_per_h:.1f} |",
        f"| snapshot (kB) | {first.snapshot_kb:.1f} | {last.snapshot_kb:.1f} |",
        "",
        f"Verdict, {result.verdict}. Over the second half of the run, the median of its last "
        "quarter against that of its first: resident memory, and descriptors open beyond one "
        "per live worker (deo holds a pidfd for each). A leak: growth above "
        f"{RSS_NOISE_BYTES // MIB} MiB at more than {s.rss_tolerance_mib_per_h:g} MiB per hour, "
        f"or above {FD_NOISE} descriptors at more than {s.fd_tolerance_per_h:g} per hour.",
        "",
        f"At the end: `deo stop --drain` exit status {e.stop_status}, deo exited with "
        f"{e.deo_status} after {e.stop_s:.1f} s; "
        + (
            "no process left carrying the run's DEO_RUN_ID"
            if not e.orphans
            else f"ORPHANS: pids {', '.join(map(str, e.orphans))}"
        )
        + f"; `deo replay -q` exit status {e.replay_status} ({e.replay_summary or 'no output'}).",
        END_MARK,
    ]
    return "\n".join(lines) + "\n"


def write_section(path: Path, section: str) -> None:
    """Put ``section`` between the soak markers of ``path``, the rest of the file untouched."""
    check_markers(path)
    if path.exists():
        text = path.read_text()
        start, end = text.find(START_MARK), text.find(END_MARK)
        if start != -1:
            text = text[:start] + section + text[end + len(END_MARK) :].removeprefix("\n")
        else:
            text = text.rstrip("\n") + "\n\n" + section
    else:
        text = "# deo benchmarks\n\n" + section
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


# --- command line --------------------------------------------------------------------------------


#: The settings' command-line flags: (flag, type, help).
_SETTINGS_FLAGS: tuple[tuple[str, type, str], ...] = (
    ("--duration-s", float, "how long to churn"),
    ("--sample-interval-s", float, "seconds between samples of deo"),
    ("--pin-interval-s", float, "mean seconds between pins of the pool"),
    ("--kill-interval-s", float, "mean seconds between SIGKILLs of a worker"),
    ("--requests-per-s", float, "GETs per second"),
    ("--max-workers", int, "the pool's max_workers; pins go from 0 to it"),
    ("--worker-item-s", float, "seconds per item of each worker (its heartbeat period)"),
    ("--rss-tolerance-mib-per-h", float, "RSS growth per hour over the second half not a leak"),
    ("--fd-tolerance-per-h", float, "descriptor growth per hour over the second half not a leak"),
    ("--seed", int, "seed of the churn's random choices"),
)


def _dest(flag: str) -> str:
    return flag[2:].replace("-", "_")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare the soak's arguments on ``parser``."""
    defaults = SoakSettings()
    for flag, kind, help_text in _SETTINGS_FLAGS:
        default = getattr(defaults, _dest(flag))
        parser.add_argument(
            flag, type=kind, default=default, help=f"{help_text} (default {default})"
        )
    parser.add_argument(
        "--workdir",
        type=Path,
        metavar="DIR",
        help="where deo's config, log and worker logs go (default: a temporary directory)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=DOC,
        metavar="FILE",
        help="markdown file whose soak section is rewritten (default: docs/benchmarks.md)",
    )
    parser.add_argument("--json", type=Path, metavar="FILE", help="also write every sample here")


def _shown(path: Path) -> str:
    """``path`` as a command line would name it: relative to the repository when inside it."""
    try:
        return path.resolve().relative_to(ROOT).as_posix()
    except ValueError:
        return str(path)


def command_line(args: argparse.Namespace, program: Sequence[str]) -> str:
    """The invocation ``args`` stand for, defaults left out."""
    words = list(program)
    defaults = SoakSettings()
    for flag, _, _ in _SETTINGS_FLAGS:
        value = getattr(args, _dest(flag))
        if value != getattr(defaults, _dest(flag)):
            words += [flag, f"{value:g}" if isinstance(value, float) else str(value)]
    if args.workdir is not None:
        words += ["--workdir", _shown(args.workdir)]
    if args.out.resolve() != DOC.resolve():
        words += ["--out", _shown(args.out)]
    if args.json is not None:
        words += ["--json", _shown(args.json)]
    return shlex.join(words)


def check_markers(path: Path) -> None:
    """SoakError now, not after an hour, if ``path`` has broken soak markers."""
    if path.exists():
        text = path.read_text()
        start, end = text.find(START_MARK), text.find(END_MARK)
        if (start == -1) != (end == -1) or end < start:
            raise SoakError(f"{path}: broken {START_MARK} / {END_MARK} markers")


async def soak(settings: SoakSettings, workdir: Path, command: str) -> Result:
    """Run one soak in ``workdir``; the result, whatever the verdict.

    SIGINT or SIGTERM ends it early with :class:`SoakError`, deo and its workers killed first.
    """
    result: Result | None = None
    failed: SoakError | None = None
    interrupted = ""
    async with anyio.create_task_group() as tg:

        async def work() -> None:
            nonlocal result, failed
            try:
                result = await _soak(settings, workdir, command)
            except SoakError as exc:
                failed = exc  # raised below, not wrapped in the task group's exception group
            tg.cancel_scope.cancel()

        async def watch() -> None:
            nonlocal interrupted
            with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                async for signum in signals:
                    interrupted = signal.Signals(signum).name
                    tg.cancel_scope.cancel()
                    return

        tg.start_soon(watch)
        tg.start_soon(work)
    if failed is not None:
        raise failed
    if result is None:
        raise SoakError(f"{interrupted}: stopped early; deo and its workers were killed")
    return result


async def _soak(settings: SoakSettings, workdir: Path, command: str) -> Result:
    load_start = _load_average()
    code = _commit()  # now: the code that runs, whatever is committed meanwhile
    date = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    deo = DeoUnderTest(workdir, settings)
    try:
        await deo.start()
        print(f"deo run (pid {deo.pid}) on {deo.url}; churning for {settings.duration_s:g} s")
        print(SAMPLE_HEADER, flush=True)
        samples, traffic, ended = await churn(
            deo, settings, lambda s: print(sample_line(s), flush=True)
        )
        if ended is not None:
            tail = deo.output.read_text(errors="replace")[-2000:]
            raise SoakError(f"{ended}; its output ends:\n{tail}")
        try:
            ending = await finish(deo)
        except TimeoutError:
            raise SoakError("`deo stop --drain` or `deo replay` did not finish in time") from None
    finally:
        cleanup(deo)
    return Result(
        command=command,
        settings=settings,
        date=date,
        code=code,
        load=(load_start, _load_average()),
        samples=tuple(samples),
        traffic=traffic,
        ending=ending,
        verdict=verdict(samples, settings),
    )


def run(args: argparse.Namespace, program: Sequence[str]) -> int:
    """Run the soak ``args`` describe (``program``: how the report names the command)."""
    try:
        settings = SoakSettings(
            **{_dest(f): getattr(args, _dest(f)) for f, _, _ in _SETTINGS_FLAGS}
        )
        check_markers(args.out)
        with tempfile.TemporaryDirectory(prefix="deo-soak-") as tmp:
            workdir = args.workdir or Path(tmp)
            workdir.mkdir(parents=True, exist_ok=True)
            command = command_line(args, program)
            result = anyio.run(soak, settings, workdir.resolve(), command)
    except SoakError as exc:
        print(f"{' '.join(program)}: error: {exc}", file=sys.stderr)
        return 2
    first, last = windows(result.samples)
    print()
    print(
        f"start (t={first.first_s:.0f}-{first.last_s:.0f} s) vs end "
        f"(t={last.first_s:.0f}-{last.last_s:.0f} s):"
    )
    for label, a, b in (
        ("RSS MiB", f"{first.rss_mib:.1f}", f"{last.rss_mib:.1f}"),
        ("RSS MiB/h", f"{first.rss_mib_per_h:+.1f}", f"{last.rss_mib_per_h:+.1f}"),
        ("open fds (most)", f"{first.fds_max}", f"{last.fds_max}"),
        ("CPU s/h", f"{first.cpu_s_per_h:.0f}", f"{last.cpu_s_per_h:.0f}"),
        ("log MB/h", f"{first.log_mb_per_h:.1f}", f"{last.log_mb_per_h:.1f}"),
    ):
        print(f"  {label:<16} {a:>10} {b:>10}")
    print(result.verdict)
    e = result.ending
    print(
        f"end: stop {e.stop_status}, deo exit {e.deo_status} after {e.stop_s:.1f} s, "
        f"orphans {list(e.orphans)}, replay {e.replay_status} ({e.replay_summary})"
    )
    if result.traffic.failed_requests:
        print(f"{result.traffic.failed_requests} failed requests; the first:")
    for failure in result.traffic.failures[:10]:
        print(f"failed request: {failure}")
    try:
        write_section(args.out, render(result))
    except SoakError as exc:
        print(f"{' '.join(program)}: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}")
    if args.json is not None:
        args.json.write_text(json.dumps(result.as_json(), indent=1))
    return 0 if result.ok else 1


def main(argv: Sequence[str] | None = None) -> int:
    """``python bench/soak.py``; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python bench/soak.py", description=HELP)
    add_arguments(parser)
    return run(parser.parse_args(argv), ["python", "bench/soak.py"])


if __name__ == "__main__":
    sys.exit(main())
