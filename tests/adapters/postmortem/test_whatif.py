"""``deo replay LOG --what-if``: fitting a scenario to a recorded run and simulating it closed loop.

Logs come from the simulator (shipped scenarios, shortened) and from the conftest's simulated
run; ``deo replay --what-if`` runs as a real executable. The real ``deo demo`` log is covered in
``tests/adapters/test_cli.py`` beside the demo itself.
"""

from __future__ import annotations

import io
import math
import random
import re
import shutil
import statistics
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import pytest
from conftest import deo_command, write_simulated_log

from adapters.log import LogProblem, LogReader
from adapters.outputs import is_fitted_scenario
from adapters.postmortem.engine import replay
from adapters.postmortem.fit import (
    FitError,
    Fitted,
    Observed,
    _best_split,
    _placed,
    fit_scenario,
    observe,
    read_run,
)
from adapters.postmortem.whatif import WhatIfError, parse_changes, run_what_if
from adapters.sim.driver import simulate
from adapters.sim.scenario import EnvPool, Scenario, load_scenario
from bench.baselines import CATALOG
from core import WorkerStarted
from core.policies import PolicyCatalog
from core.policies.base import Decision
from core.policies.buffer import BufferPolicy

REPO = Path(__file__).resolve().parents[3]
SCENARIOS = REPO / "bench" / "scenarios"


def deo(*args: Any, cwd: Path) -> subprocess.CompletedProcess[str]:
    command, env = deo_command()
    return subprocess.run(
        [*command, *map(str, args)], cwd=cwd, capture_output=True, text=True, timeout=300, env=env
    )


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("what-if") / "run.jsonl"
    write_simulated_log(path)  # 15 minutes, a worker crash at 200 s
    return path


# --- fitting ---------------------------------------------------------------------------------


SimulatedFit = Callable[..., tuple[Scenario, Fitted]]


@pytest.fixture(scope="module")
def simulated_fit(tmp_path_factory: pytest.TempPathFactory) -> SimulatedFit:
    """Fits a shipped scenario's simulated run; each run is simulated once for the module."""
    logs: dict[tuple[str, int], Path] = {}

    def fit(name: str, duration_s: int, *, calibrate: bool) -> tuple[Scenario, Fitted]:
        truth = load_scenario(
            SCENARIOS / f"{name}.toml", {"duration_s": str(duration_s)}, policies=CATALOG
        )
        log = logs.get((name, duration_s))
        if log is None:
            log = tmp_path_factory.mktemp("fit") / f"{name}-{duration_s}.jsonl"
            simulate(truth, log_path=log, policies=CATALOG)
            logs[name, duration_s] = log
        fitted = fit_scenario(read_run(log), "fitted", CATALOG, calibrate=calibrate)
        return truth, fitted

    return fit


@pytest.mark.parametrize(
    ("name", "duration_s"),
    [("steady", 600), ("eval_checkpoint_pauses", 1200), ("crash_loop", 1500)],
)
def test_the_fit_reads_what_the_log_shows(
    simulated_fit: SimulatedFit, name: str, duration_s: int
) -> None:
    truth, fitted = simulated_fit(name, duration_s, calibrate=False)
    scenario = fitted.scenario
    pool, true_pool = scenario.pools[0], truth.pools[0]
    # What the log shows directly.
    assert scenario.trainer.batch_size_seqs == truth.trainer.batch_size_seqs
    assert abs(scenario.trainer.step_s / truth.trainer.step_s - 1) < 0.05, scenario.trainer
    assert pool.group_size == true_pool.group_size
    assert pool.groups_in_flight == true_pool.groups_in_flight
    assert abs(pool.startup_s - true_pool.startup_s) < 1.0
    assert pool.policy.name == true_pool.policy.name
    assert pool.max_workers == true_pool.max_workers
    if name == "eval_checkpoint_pauses":  # the eval pause at 900-1080 s
        (pause,) = scenario.trainer.pauses
        assert abs(pause.at_s - 900) < 10 and abs(pause.end_s - 1080) < 10, pause
    if name == "crash_loop":
        # The scenario: every worker started in the 300 s from 1200 s crashes early. The log
        # shows the first crash at 1200 s, then the slot's replacements crashing soon after
        # starting: a crash loop from about one start-up later.
        crash, loop = scenario.faults
        assert (crash.kind, crash.at_s, crash.count) == ("worker_crash", 1200.0, 1), crash
        assert loop.kind == "crash_loop" and 1200 < loop.at_s <= 1240, loop


def test_the_fit_keeps_how_many_workers_may_start_at_once(tmp_path: Path) -> None:
    # The pool's max_starting paces every controller's start-ups (and the oracle's): a what-if
    # that dropped it would start the recorded pool faster than it could have.
    truth = load_scenario(
        SCENARIOS / "steady.toml",
        {"duration_s": "300", "pools.envs.max_starting": "8"},
        policies=CATALOG,
    )
    log = tmp_path / "run.jsonl"
    simulate(truth, log_path=log, policies=CATALOG)
    fitted = fit_scenario(read_run(log), "fitted", CATALOG, calibrate=False)
    assert fitted.scenario.pools[0].max_starting == 8


@pytest.mark.parametrize(
    "phases",
    [
        # A trainer that speeds up, then slows down, at two sets of times (both speeds within
        # what the pool's 32 workers make: a trainer faster than that starves throughout its
        # phase, and a step time never seen fed is only bounded, not read).
        ((437.0, 3.5), (1013.0, 9.0)),
        ((517.0, 3.5), (1111.0, 12.0)),
    ],
)
def test_speed_changes_are_placed_where_they_happened_not_at_a_window_edge(
    tmp_path: Path, phases: tuple[tuple[float, float], ...]
) -> None:
    listed = ", ".join(f"{{at_s = {at}, step_s = {step}}}" for at, step in phases)
    truth = load_scenario(
        SCENARIOS / "trainer_speed_steps.toml",
        {"duration_s": "1500", "trainer.phases": f"[{listed}]"},
        policies=CATALOG,
    )
    log = tmp_path / "run.jsonl"
    simulate(truth, log_path=log, policies=CATALOG)
    trainer = fit_scenario(read_run(log), "fitted", CATALOG, calibrate=False).scenario.trainer
    assert trainer.step_s == pytest.approx(truth.trainer.step_s, rel=0.05)
    fitted = [(p.at_s, p.step_s) for p in trainer.phases]
    # One fitted phase per change (a window straddling a change used to read a mixed speed as
    # a phase of its own), each within two of the slower steps of where it happened.
    assert len(fitted) == len(phases), fitted
    slowest = truth.trainer.step_s
    for (at_s, step_s), (true_at_s, true_step_s) in zip(fitted, phases, strict=True):
        assert step_s == pytest.approx(true_step_s, rel=0.05), fitted
        assert abs(at_s - true_at_s) <= 2 * max(slowest, true_step_s), fitted
        slowest = true_step_s


@pytest.mark.parametrize("seed", range(5))
def test_the_best_split_is_the_least_squares_one(seed: int) -> None:
    # One pass over running sums picks the split that spreads computed side by side pick.
    rng = random.Random(seed)
    logs = [(math.log(rng.choice([2.0, 5.0]) * rng.uniform(0.8, 1.2)), rng.randint(1, 3))]
    logs += [(math.log(rng.uniform(1.0, 9.0)), rng.randint(1, 3)) for _ in range(40)]

    def spread(side: list[tuple[float, int]]) -> float:
        mean = sum(v * n for v, n in side) / sum(n for _, n in side)
        return sum(n * (v - mean) ** 2 for v, n in side)

    costs = [(spread(logs[:k]) + spread(logs[k:]), k) for k in range(2, len(logs) - 1)]
    assert _best_split(logs) == min(costs)[1]
    assert _best_split(logs[:3]) is None


def test_a_phase_between_two_of_one_speed_is_not_moved_by_noise() -> None:
    # Windows found a change near 1017 s as a mixed phase (5.4 s from 972 s) and a slow one
    # (9 s from 1080 s). Moving the mixed phase to the change leaves one speed on both sides of
    # the next change (9.5 s steps, then 8 s ones): its least-squares split is noise, and it
    # once left the mixed phase too few steps to be read, so the change landed at 1036 s.
    fast = [(t, t + 4.0, 1) for t in range(901, 1017, 4)]
    slow = [(1017.0, 1026.5, 1), (1026.5, 1036.0, 1)]
    slow += [(1036.0 + 8 * k, 1044.0 + 8 * k, 1) for k in range(40)]
    phases = [(0.0, 4.0), (972.0, 5.4), (1080.0, 9.0)]
    placed = _placed(phases, [(float(a), b, n) for a, b, n in fast] + slow, [], 1400.0)
    assert [at for at, _ in placed] == [0.0, 1017.0], placed
    assert placed[1][1] == pytest.approx(8.0, rel=0.1), placed


@pytest.mark.parametrize(
    ("name", "duration_s", "runs"), [("steady", 600, 1), ("eval_checkpoint_pauses", 1200, 3)]
)
def test_the_fitted_scenario_reproduces_a_simulated_run(
    tmp_path: Path, name: str, duration_s: int, runs: int
) -> None:
    # Under the recorded policy, the fitted scenario gives back the recorded run's figures,
    # both read from their logs the same way (as `deo replay --what-if` compares them). The
    # fitted side is a mean over seeds; with a pause in 20 minutes one recorded run's
    # starvation reads 3.3-5.3% over seeds where its fit reads 4.0-4.1%, so that side is a
    # mean over recorded runs too.
    truth = load_scenario(
        SCENARIOS / f"{name}.toml", {"duration_s": str(duration_s)}, policies=CATALOG
    )
    recorded: list[Observed] = []
    fitted: list[Observed] = []
    for k in range(runs):
        log = tmp_path / f"recorded-{k}.jsonl"
        simulate(attrs.evolve(truth, seed=truth.seed + k), log_path=log, policies=CATALOG)
        fit = fit_scenario(read_run(log), "fitted", CATALOG, calibrate=True)
        recorded.append(fit.observed)
        for seed in (1,) if name == "steady" else (1, 2, 3):
            again = tmp_path / f"fitted-{k}-{seed}.jsonl"
            simulate(attrs.evolve(fit.scenario, seed=seed), log_path=again, policies=CATALOG)
            fitted.append(observe(read_run(again)))

    def mean(readings: list[Observed], key: str) -> float:
        return statistics.fmean(getattr(o, key) for o in readings)

    hours = mean(fitted, "worker_hours") / mean(recorded, "worker_hours")
    assert abs(hours - 1) <= 0.10, (fitted, recorded)
    starving = mean(fitted, "starvation_share") - mean(recorded, "starvation_share")
    assert abs(starving) <= 0.01, (fitted, recorded)


def test_the_recorded_figures_are_the_simulators(recorded: Path) -> None:
    scenario = attrs.evolve(
        load_scenario(SCENARIOS / "steady.toml", {"duration_s": "900"}, policies=CATALOG)
    )
    log = recorded.with_name("steady.jsonl")
    truth = simulate(scenario, log_path=log, policies=CATALOG).metrics
    observed = fit_scenario(read_run(log), "x", CATALOG, calibrate=False).observed
    assert observed.worker_hours == pytest.approx(truth.worker_hours, rel=1e-6)
    assert abs(observed.starvation_share - truth.starvation_share) < 0.005
    assert observed.scale_actions == truth.scale_actions


def test_a_log_too_short_to_fit_says_so(tmp_path: Path) -> None:
    scenario = load_scenario(SCENARIOS / "steady.toml", {"duration_s": "10"}, policies=CATALOG)
    log = tmp_path / "short.jsonl"
    simulate(scenario, log_path=log, policies=CATALOG)
    with pytest.raises(FitError, match="too short to fit: 10 s and 5 queue samples"):
        fit_scenario(read_run(log), "x", CATALOG)


# --- the changes -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("items", "message"),
    [
        (["policy=nonsense"], "unknown policy 'nonsense' (policies: "),
        (["max_workers"], "expected KEY=VALUE"),
        (["=3"], "expected KEY=VALUE"),
        (["policy=3"], "a policy is named by a string"),
        (["min_workers=abc"], "'min_workers=abc': min_workers takes a whole number, not 'abc'"),
        (["max_workers=2.5"], "max_workers takes a whole number, not '2.5'"),
        (["max_workers=true"], "max_workers takes a whole number, not 'true'"),
        (["stabilization_s=soon"], "stabilization_s takes a number of seconds, not 'soon'"),
        (["require_ready=1"], "require_ready takes true or false, not '1'"),
    ],
)
def test_bad_changes_are_named(items: list[str], message: str) -> None:
    with pytest.raises(WhatIfError, match=message.replace("(", r"\(")):
        parse_changes(items)


def test_changes_parse() -> None:
    change = parse_changes(
        ["policy=k8s-hpa", "max_workers=12", "policy.tolerance=0.2", "stabilization_s=30"]
    )
    assert change.policy == "k8s-hpa"
    assert change.pool == {"max_workers": 12, "stabilization_s": 30}
    assert change.params == {"tolerance": 0.2}


# --- the command -------------------------------------------------------------------------------


def test_what_if_prints_both_runs_beside_the_recorded_one(recorded: Path, tmp_path: Path) -> None:
    fitted = tmp_path / "fitted.toml"
    proc = deo(
        "replay",
        recorded,
        "--what-if",
        "policy=static",
        "--what-if",
        "max_workers=2",
        "--what-if-seeds",
        "1",
        "--fitted-out",
        fitted,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert out.startswith(f"what if policy=static max_workers=2: {recorded} (900 s")
    assert "fitted from the log:" in out
    assert "worker crash at 200 s" in out
    assert f"wrote the fitted scenario to {fitted}" in out
    header = next(line for line in out.splitlines() if "recorded" in line and "what-if" in line)
    assert header.split() == ["recorded", "fitted,", "recorded", "config", "fitted,", "what-if"]
    assert "  recorded policy: buffer" in out
    assert "  what-if policy:  static (count=2)" in out
    rows = ("trainer starvation, log read", "worker-hours (GPU-hours)", "scale actions")
    for row in rows:
        assert any(line.strip().startswith(row) for line in out.splitlines()), row
    pathless = [
        line for line in out.splitlines() if str(tmp_path) not in line and str(recorded) not in line
    ]
    assert max(len(line) for line in pathless) <= 100, out
    assert "fit error (fitted under the recorded configuration against the recorded run):" in out
    assert re.search(r"starvation [+-]\d+\.\d\d points \(allowed", out), out
    # Two workers where the run kept about a dozen: the trainer starves more, and the summary
    # says so (the simulator's exact figures on both sides).
    change = re.search(r"the change: starvation ([+-]\d+\.\d\d) points", out)
    assert change is not None and float(change[1]) > 5, out
    # The fitted scenario is a scenario file the simulator runs as it is.
    scenario = load_scenario(fitted, policies=CATALOG)
    assert scenario.duration_s == pytest.approx(900, abs=2)
    assert deo("simulate", fitted, cwd=tmp_path).returncode == 0
    # One fitted before is written over; a scenario written by hand never is.
    assert is_fitted_scenario(fitted)
    assert not is_fitted_scenario(SCENARIOS / "steady.toml")


def test_fitted_out_leaves_a_hand_written_scenario_as_it_is(recorded: Path, tmp_path: Path) -> None:
    mine = tmp_path / "mine.toml"
    shutil.copyfile(SCENARIOS / "steady.toml", mine)
    before = mine.read_bytes()
    proc = deo("replay", recorded, "--what-if", "max_workers=2", "--fitted-out", mine, cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"--fitted-out {mine} is a file, not a scenario deo replay --what-if fitted" in (
        proc.stderr
    )
    assert mine.read_bytes() == before


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--what-if", "policy=nonsense"], "unknown policy 'nonsense'"),
        (["--what-if", "colour=blue"], "--what-if colour: not a parameter of policy 'buffer'"),
        (["--what-if", "max_workers=0"], "max_workers"),
        (["--what-if", "policy=static", "--set", "pools.envs.max_workers=4"], "give one"),
        (["--what-if", "policy=static", "--what-if-seeds", "0"], "--what-if-seeds 0"),
    ],
)
def test_bad_what_ifs_exit_2_with_a_clear_message(
    recorded: Path, tmp_path: Path, args: list[str], message: str
) -> None:
    proc = deo("replay", recorded, *args, "--fitted-out", tmp_path / "f.toml", cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.startswith("deo replay: "), proc.stderr
    assert message in proc.stderr
    assert proc.stdout == ""


def test_what_if_seeds_without_a_what_if_is_refused(recorded: Path, tmp_path: Path) -> None:
    proc = deo("replay", recorded, "--what-if-seeds", "5", cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr == (
        "deo replay: --what-if-seeds 5 sets how many seeds each --what-if configuration runs "
        "under: give --what-if too\n"
    )
    assert proc.stdout == ""


def test_a_log_with_no_configuration_cannot_be_fitted(tmp_path: Path) -> None:
    log = tmp_path / "empty.jsonl"
    log.write_text('{"kind": "header", "schema": 1, "deo": "0.1.0", "created": "x"}\n')
    proc = deo("replay", log, "--what-if", "policy=static", cwd=tmp_path)
    assert proc.returncode == 2
    assert "no Configured event" in proc.stderr


def test_a_what_if_writes_nothing_unless_asked(tmp_path: Path) -> None:
    scenario = load_scenario(SCENARIOS / "steady.toml", {"duration_s": "300"}, policies=CATALOG)
    log = tmp_path / "run.jsonl"
    simulate(scenario, log_path=log, policies=CATALOG)
    out = io.StringIO()
    status = run_what_if(log, ["max_workers=4"], seeds=1, fitted_out=None, out=out)
    assert status == 0, out.getvalue()
    assert "the change: starvation " in out.getvalue()
    assert "wrote" not in out.getvalue()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.jsonl"]


@attrs.frozen(slots=True, kw_only=True)
class _SwingingBuffer(BufferPolicy):
    """The buffer policy as another deo might have had it: all its workers, then 4, by turns."""

    def decide(self, context: Any, memory: Any) -> Decision:
        target = 4 if int(context.t // 120) % 2 else context.max_workers
        return Decision(target=target, reason="by turns")


def test_a_log_whose_replay_diverges_is_read_as_it_ran(tmp_path: Path) -> None:
    scenario = Scenario(
        name="diverged",
        duration_s=600.0,
        seed=3,
        pools=(EnvPool(name="envs", max_workers=24, gpus_per_worker=0, startup_s=5.0),),
    )
    other = PolicyCatalog(policies={**CATALOG.policies, "buffer": _SwingingBuffer})
    log = tmp_path / "run.jsonl"
    simulate(scenario, log_path=log, policies=other)
    started = sorted(
        record.event.worker_id
        for record in LogReader(log).events()
        if isinstance(record.event, WorkerStarted)
    )
    facts = read_run(log)
    assert facts.problems == []
    assert sorted(w.worker_id for w in facts.workers.values() if w.started_t is not None) == started
    # Re-reduced by today's buffer policy, the same log is refused in places (workers this deo
    # would never have started): the fit reads what happened, not what this deo would have done.
    problems: list[LogProblem] = []
    for _ in replay(log, problems=problems, policies=CATALOG):
        pass
    assert problems
