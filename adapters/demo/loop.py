"""``deo demo``: a real Atropos loop on this machine, scaled by deo, in about a minute.

It starts, all on loopback:

* atroposlib's trajectory API server (``uvicorn atroposlib.api.server:app``, what ``run-api`` runs);
* a small trainer (:mod:`adapters.demo.trainer`) that registers and pulls 32-sequence batches with a
  step time that changes: 1.0 s, then 0.4 s (it outruns the envs: deo scales up), then 2.5 s (the
  queue fills: deo scales down and the drained envs disconnect);
* deo itself (:func:`adapters.run.run`) with one pool of stand-in env workers
  (:mod:`deo_worker.demo_env`: groups of 8 sequences, heavy-tailed latency, atroposlib's own
  backpressure, drain on SIGUSR1), its default ``buffer`` policy and the Atropos source.

It prints progress every few seconds, then drains every worker, stops, and prints a summary
(:mod:`adapters.demo.summary`: the trainer's wait against a static pool of the same maximum,
worker-seconds saved, workers over time, every decision and why) and the command that replays
its log.
"""

from __future__ import annotations

import contextlib
import glob
import importlib.util
import json
import os
import secrets
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import anyio
import attrs
import httpx
from anyio.abc import Process
from anyio.streams.buffered import BufferedByteReceiveStream

from adapters.demo.summary import RunFacts, StaticEstimate, facts_of, render, simulate_static
from adapters.log import segments, snapshot_path
from adapters.outputs import DEMO_ENV_MODULE, is_demo_log, output_problem
from adapters.postmortem.engine import replay
from adapters.runtime.config_file import ApiSettings, RunSettings
from adapters.sources.atropos import AtroposSource
from adapters.sources.nvml import NvmlSettings
from core import Config, DeoError, PolicySpec, PoolSpec
from deo_worker.demo_env import DemoEnvSettings

__all__ = ["DemoOutcome", "DemoSettings", "measure_demo", "run_demo"]

_TOKEN_ENV = "DEO_DEMO_TOKEN"


#: The longest demo run: a demo is a minute, not a service.
DEMO_MAX_DURATION_S = 86_400.0


@attrs.frozen(slots=True, kw_only=True)
class DemoSettings:
    """The demo's embedded defaults."""

    duration_s: float = 60.0
    batch_size_seqs: int = 32
    group_size: int = 8
    #: Seconds per trainer step in the first, second and last third of the run.
    step_s: tuple[float, float, float] = (1.0, 0.4, 2.5)
    group_latency_s: float = 1.5
    groups_in_flight: int = 2
    max_workers: int = 8
    progress_every_s: float = 3.0
    #: The pool's policy: ``buffer`` (deo's default) or ``static`` (the pool at its maximum
    #: throughout: the comparison ``bench/atropos_loop.py`` runs on the same loop).
    policy: str = "buffer"

    def __attrs_post_init__(self) -> None:
        if not self.duration_s >= 10:
            raise ValueError(f"--duration-s: at least 10 seconds, got {self.duration_s:g}")
        if not self.duration_s <= DEMO_MAX_DURATION_S:
            raise ValueError(
                f"--duration-s: at most {DEMO_MAX_DURATION_S:g} seconds (a day), got "
                f"{self.duration_s:g}"
            )
        if self.policy not in ("buffer", "static"):
            raise ValueError(f"policy: 'buffer' or 'static', got {self.policy!r}")

    @property
    def phases(self) -> str:
        """The trainer's START_S:STEP_S phases."""
        third = self.duration_s / 3
        return ",".join(f"{i * third:.0f}:{step:g}" for i, step in enumerate(self.step_s))


def _worker_logs(log: Path) -> Path:
    """Where the workers', the API server's and the trainer's output go: beside the log."""
    return log.with_name(log.stem + "-workers")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _settings(demo: DemoSettings, log: Path, api_url: str, deo_port: int) -> RunSettings:
    argv = [sys.executable, "-m", DEMO_ENV_MODULE, "--api", api_url]
    argv += ["--group-size", str(demo.group_size), "--latency-s", str(demo.group_latency_s)]
    argv += ["--groups-in-flight", str(demo.groups_in_flight), "--seed", "{index}"]
    # The buffer policy's time constants, shortened to fit a one-minute run.
    policy = PolicySpec(
        name="buffer",
        params={
            "refill_s": 3.0,
            "integral_s": 60.0,
            "rate_window_s": 2.0,
            "production_window_s": 6.0,
            "max_down_fraction": 0.5,
            "down_cooldown_s": 2.0,
        },
    )
    if demo.policy == "static":
        policy = PolicySpec(name="static", params={"count": demo.max_workers})
    pool = PoolSpec(
        name="envs",
        argv=argv,
        min_workers=1,
        max_workers=demo.max_workers,
        policy=policy,
        heartbeat_grace_s=15.0,
        drain_timeout_s=10.0,
        stop_timeout_s=3.0,
        metrics_stale_s=10.0,
        stabilization_s=5.0,
    )
    return RunSettings(
        config=Config(pools=[pool]),
        log=log,
        tick_interval_s=0.5,
        worker_logs=_worker_logs(log),
        api=ApiSettings(port=deo_port, token_env=_TOKEN_ENV),
        drain_on_signal=True,  # the demo's workers are its own: Ctrl-C ends them too
        # (A static pool reads no queue: deo refuses a source its policy would not read.)
        sources=(
            (AtroposSource(pool="envs", url=api_url, group_size=demo.group_size, interval_s=0.5),)
            if demo.policy == "buffer"
            else ()
        ),
        nvml=NvmlSettings(backend="off"),
    )


@contextlib.asynccontextmanager
async def _process(argv: list[str], log: Path) -> AsyncIterator[Process]:
    """``argv`` running, its output appended to ``log``; terminated (killed after 10 s) at exit."""
    with log.open("ab") as out:
        proc = await anyio.open_process(
            argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT
        )
    try:
        yield proc
    finally:
        with anyio.CancelScope(shield=True):
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.terminate()
                with anyio.move_on_after(10):
                    await proc.wait()
                if proc.returncode is None:
                    proc.kill()
            await proc.aclose()


class DemoFailed(DeoError):
    """Something the demo needs did not come up; the message says what and where to look."""


async def _wait_for(url: str, what: str, timeout_s: float = 30.0) -> None:
    with anyio.move_on_after(timeout_s):
        async with httpx.AsyncClient(timeout=1.0) as client:
            while True:
                try:
                    (await client.get(url)).raise_for_status()
                    return
                except httpx.HTTPError:
                    await anyio.sleep(0.1)
    raise DemoFailed(f"{what} did not answer at {url} within {timeout_s:g}s")


@attrs.define
class _Progress:
    """What the demo saw while it ran."""

    workers: list[tuple[float, int]] = attrs.field(factory=list)
    trainer: dict[str, Any] = attrs.field(factory=dict)


def _line(t: float, status: dict[str, Any], trainer: dict[str, Any]) -> str:
    pool = status["pools"].get("envs")
    if pool is None:
        return f"{t:5.0f}s  draining"
    by_state = pool["workers_by_state"]
    queue = pool["queue"]
    queued = f"{queue['queued_batches']:.1f}" if queue else "-"
    waited = trainer.get("waited_s", 0.0)
    busy = f"step {trainer.get('step', 0):3d} ({trainer.get('step_s', '-')} s/step)"
    states = ", ".join(f"{n} {s}" for s, n in by_state.items() if n and s != "active")
    return (
        f"{t:5.0f}s  trainer {busy}, waited {waited:5.1f}s | queue {queued} batches | "
        f"envs: {by_state.get('active', 0)} active" + (f" ({states})" if states else "")
    )


async def _drive(
    demo: DemoSettings,
    deo_url: str,
    token: str,
    trainer: Process,
    progress: _Progress,
    out: Callable[[str], None],
) -> None:
    """Watch the run, print progress, then ask deo to drain everything and stop."""
    start = time.monotonic()
    await _wait_for(deo_url + "/global-status", "deo's API")
    async with httpx.AsyncClient(base_url=deo_url, timeout=5.0) as client:
        while (t := time.monotonic() - start) < demo.duration_s and trainer.returncode is None:
            status = (await client.get("/global-status")).json()
            pool = status["pools"].get("envs", {})
            progress.workers.append((t, pool.get("workers_by_state", {}).get("active", 0)))
            out(_line(t, status, progress.trainer))
            await anyio.sleep(demo.progress_every_s)
        out(f"{time.monotonic() - start:5.0f}s  draining every env worker, then stopping deo")
        headers = {"Authorization": f"Bearer {token}"}
        (await client.post("/v1/stop", json={"drain": True}, headers=headers)).raise_for_status()


async def _read_trainer(lines: BufferedByteReceiveStream, progress: _Progress) -> None:
    """Take the trainer's JSON lines into ``progress`` until its output ends."""
    while True:
        try:
            line = await lines.receive_until(b"\n", 1 << 16)
        except (anyio.EndOfStream, anyio.IncompleteRead, anyio.DelimiterNotFound):
            return
        with contextlib.suppress(ValueError):
            progress.trainer.update(json.loads(line))


def _sparkline(samples: list[tuple[float, int]], width: int = 30) -> str:
    if not samples:
        return "-"
    step = max(1, len(samples) // width)
    return " ".join(str(n) for _, n in samples[::step])


def _verify(log: Path) -> tuple[int, int, RunFacts]:
    """(events, mismatches or unreadable lines, what the log says about the run) of ``log``."""
    problems: list[Any] = []
    events = mismatches = 0
    steps: list[tuple[float, object, list[object]]] = []
    for step in replay(log, problems=problems):
        events += 1
        mismatches += not step.matches
        steps.append((step.event.t, step.event, list(step.produced)))
    return events, mismatches + len(problems), facts_of(steps)


@attrs.frozen(slots=True, kw_only=True)
class DemoOutcome:
    """What one demo run measured: the trainer's own figures and those of deo's log."""

    steps: int
    #: Seconds the trainer waited for a batch after its first one, and the span they count in
    #: (from its first batch to its last step).
    waited_s: float
    busy_s: float
    #: Worker-seconds (each worker from its spawn to its exit) and scaling decisions, from the log.
    worker_s: float
    decisions: int
    #: The log replays exactly.
    replays: bool


def run_demo(
    log: Path, settings: DemoSettings | None = None, out: Callable[[str], None] = print
) -> int:
    """Run the demo, writing deo's event log to ``log``; returns the exit status."""
    return measure_demo(log, settings, out)[0]


def measure_demo(
    log: Path, settings: DemoSettings | None = None, out: Callable[[str], None] = print
) -> tuple[int, DemoOutcome | None]:
    """Run the demo as :func:`run_demo` does; returns the exit status and what the run measured
    (None where it did not get that far)."""
    from adapters.run import IGNORED_SIGNALS, STOP_SIGNALS, run

    demo = settings or DemoSettings()
    if importlib.util.find_spec("atroposlib") is None:
        out(
            "deo demo: atroposlib is not installed; its API server is all the demo needs: "
            "pip install --no-deps atroposlib==0.4.0"
        )
        return 2, None
    log = log.absolute()
    try:
        log.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        out(f"deo demo: --log {log}: cannot make its folder: {exc.strerror}")
        return 2, None
    problem = output_problem(log, what="a demo run's log", replaceable=is_demo_log)
    if problem is not None:
        out(f"deo demo: --log {log} {problem}")
        return 2, None
    # A fresh run each time: this log and everything deo keeps beside it are the demo's own.
    beside = (
        snapshot_path(log),
        *segments(log),
        *log.parent.glob(f"{glob.escape(log.name)}.torn-*"),
        log.with_name(log.name + ".worker-secret"),
        log.with_name(log.name + ".token"),
    )
    for old in (log, *beside):
        old.unlink(missing_ok=True)
    files = _worker_logs(log)
    files.mkdir(exist_ok=True)
    api_url = f"http://127.0.0.1:{_free_port()}"
    deo_port = _free_port()
    deo_url = f"http://127.0.0.1:{deo_port}"
    token = secrets.token_urlsafe(16)
    os.environ[_TOKEN_ENV] = token
    progress = _Progress()
    out(f"deo demo: atroposlib API server on {api_url}, deo on {deo_url}")
    out(
        f"deo demo: trainer batches of {demo.batch_size_seqs} sequences, step time phases "
        f"{demo.phases} (start_s:s/step); env workers make groups of {demo.group_size}"
    )
    api_argv = [sys.executable, "-m", "uvicorn", "atroposlib.api.server:app"]
    api_argv += ["--host", "127.0.0.1", "--port", api_url.rsplit(":", 1)[1]]
    trainer_argv = [sys.executable, "-m", "adapters.demo.trainer", "--api", api_url]
    trainer_argv += ["--batch-size-seqs", str(demo.batch_size_seqs), "--phases", demo.phases]
    trainer_argv += ["--duration-s", str(demo.duration_s + 30)]
    started = time.monotonic()

    async def main() -> int:
        async with _process(api_argv, files / "atropos-api.log"):
            await _wait_for(api_url + "/status", "the atroposlib API server")
            trainer = await anyio.open_process(trainer_argv, stdin=subprocess.DEVNULL, stderr=None)
            assert trainer.stdout is not None
            lines = BufferedByteReceiveStream(trainer.stdout)
            try:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(_read_trainer, lines, progress)
                    tg.start_soon(_drive, demo, deo_url, token, trainer, progress, out)
                    status = await run(_settings(demo, log, api_url, deo_port), out=_quiet(out))
                    tg.cancel_scope.cancel()
            finally:
                with anyio.CancelScope(shield=True):
                    with contextlib.suppress(ProcessLookupError):
                        trainer.terminate()
                    await _read_trainer(lines, progress)  # its summary line, then end of file
                    await trainer.aclose()
            return status

    # `run` leaves deo's signals ignored when it returns (a `deo run` process is then exiting);
    # the demo goes on to its summary, which Ctrl-C must still interrupt.
    handled = (*STOP_SIGNALS, *IGNORED_SIGNALS, signal.SIGXFSZ)
    handlers = {signum: signal.getsignal(signum) for signum in handled}
    try:
        status = anyio.run(main)
    except Exception as exc:
        failed = _demo_failure(exc)
        if failed is None:
            raise
        out(f"deo demo: {failed}; see {_shown(files)}")
        return 1, None
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
    if status != 0:
        out(f"deo demo: deo exited with status {status}; see {log}")
        return status, None
    events, wrong, facts = _verify(log)
    # A static pool is its own comparison.
    estimate = _estimate(demo, facts, log, api_url, deo_port) if demo.policy == "buffer" else None
    outcome = _summary(demo, progress, facts, estimate, out, replays=not wrong)
    out(f"deo demo: done in {time.monotonic() - started:.0f}s")
    verdict = "replays exactly" if not wrong else f"DOES NOT replay exactly ({wrong} problems)"
    out(f"deo demo: log {_shown(log)} ({events} events) {verdict}")
    out(f"deo demo: replay it with `deo replay {_shown(log)}`")
    return (0 if not wrong else 1), outcome


def _demo_failure(exc: BaseException) -> DemoFailed | None:
    # A task group wraps what its tasks raise in an ExceptionGroup.
    if isinstance(exc, DemoFailed):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            if (found := _demo_failure(inner)) is not None:
                return found
    return None


def _quiet(out: Callable[[str], None]) -> Callable[[str], None]:
    # deo's own start/stop lines; the demo prints its progress instead.
    def write(line: str) -> None:
        if "stopped" in line or "cannot" in line or "refused" in line:
            out(line)

    return write


def _shown(path: Path) -> str:
    with contextlib.suppress(ValueError):
        return str(path.relative_to(Path.cwd()))
    return str(path)


def _estimate(
    demo: DemoSettings, facts: RunFacts, log: Path, api_url: str, deo_port: int
) -> StaticEstimate | None:
    """The static pool of the same maximum, simulated on this run (None: no start-up measured)."""
    if not facts.startups_s:
        return None
    env = DemoEnvSettings(api_url=api_url)
    return simulate_static(
        duration_s=demo.duration_s,
        batch_size_seqs=demo.batch_size_seqs,
        step_s=demo.step_s,
        group_size=demo.group_size,
        groups_in_flight=demo.groups_in_flight,
        latency_s=demo.group_latency_s,
        latency_sigma=env.latency_sigma,
        max_batches_offpolicy=env.max_batches_offpolicy,
        startup_s=statistics.median(facts.startups_s),
        pool=_settings(demo, log, api_url, deo_port).config.pools[0],
    )


def _summary(
    demo: DemoSettings,
    progress: _Progress,
    facts: RunFacts,
    estimate: StaticEstimate | None,
    out: Callable[[str], None],
    *,
    replays: bool,
) -> DemoOutcome:
    trainer = progress.trainer
    first = trainer.get("first_batch_s")
    counts = [n for _, n in progress.workers]
    outcome = DemoOutcome(
        steps=int(trainer.get("steps", trainer.get("step", 0))),
        waited_s=float(trainer.get("waited_s", 0.0)),
        busy_s=max(float(trainer.get("elapsed_s", facts.span_s)) - float(first or 0.0), 0.0),
        worker_s=facts.worker_s,
        decisions=len(facts.decisions),
        replays=replays,
    )
    out("")
    render(
        steps=outcome.steps,
        waited_s=outcome.waited_s,
        busy_span_s=outcome.busy_s,
        first_batch_s=first,
        facts=facts,
        estimate=estimate,
        policy=demo.policy,
        out=out,
    )
    if counts:
        out(
            f"  env workers: {min(counts)} to {max(counts)} active; over time: "
            + _sparkline(progress.workers)
        )
    return outcome
