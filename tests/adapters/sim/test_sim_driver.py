"""``simulate``: the real reducer in simulated time — determinism, overrides, logs, the library."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import attrs
import orjson
import pytest

from adapters.log import EventLog, NotALog, snapshot_path
from adapters.outputs import OutputRefused
from adapters.postmortem.engine import replay
from adapters.sim.driver import SimResult, simulate
from adapters.sim.metrics import worker_hours_ratio_since
from adapters.sim.scenario import Scenario, load_scenario
from core import ConfigError, PolicySpec

REPO = Path(__file__).resolve().parents[3]
LIBRARY = REPO / "bench" / "scenarios"
SHIPPED = sorted(LIBRARY.glob("*.toml"))


def short(name: str, duration_s: float = 900.0, **overrides: str) -> Scenario:
    """A shipped scenario, cut short (faults and phases after the end simply never happen)."""
    return load_scenario(LIBRARY / f"{name}.toml", {"duration_s": str(duration_s), **overrides})


def commands_in(log: Path) -> list[dict[str, Any]]:
    found = []
    for line in log.read_bytes().splitlines()[1:]:
        record = orjson.loads(line)
        if record["kind"] == "commands":
            found.extend(record["commands"])
    return found


def test_same_scenario_and_seed_give_the_same_result_and_log(tmp_path: Path) -> None:
    scenario = short("bursty_heavy_tail", 600.0)
    first = simulate(scenario, log_path=tmp_path / "a.jsonl")
    second = simulate(scenario, log_path=tmp_path / "b.jsonl")
    assert first == second
    a = (tmp_path / "a.jsonl").read_bytes().split(b"\n", 1)
    b = (tmp_path / "b.jsonl").read_bytes().split(b"\n", 1)
    assert a[0] != b"" and b"created" in a[0]  # the header differs only by its time
    assert a[1] == b[1]
    assert len(a[1]) > 100_000


def test_a_different_seed_gives_a_different_run() -> None:
    scenario = short("steady", 600.0)
    other = attrs.evolve(scenario, seed=scenario.seed + 1)
    first, second = simulate(scenario), simulate(other)
    assert first.series != second.series
    assert first.metrics != second.metrics


def test_the_log_replays_exactly(tmp_path: Path) -> None:
    log = tmp_path / "run.jsonl"
    simulate(short("gpu_throttle_and_loss", 2000.0), log_path=log)
    problems: list[Any] = []
    steps = list(replay(log, problems=problems))
    assert not problems
    assert len(steps) > 1000
    assert all(step.matches for step in steps)


def test_a_log_is_written_afresh_over_a_simulated_one_only(tmp_path: Path) -> None:
    log = tmp_path / "run.jsonl"
    simulate(short("steady", 100.0), log_path=log)
    first = log.read_bytes()
    simulate(short("steady", 50.0), log_path=log)
    assert log.read_bytes().startswith(b'{"kind":"header"') and log.read_bytes() != first
    # Anything else at the path is left as it is: a real run's log, a scenario, a folder.
    real = tmp_path / "real.jsonl"
    EventLog.open(real)[0].close()
    other = tmp_path / "steady.toml"
    other.write_text("not a log\n")
    for path, why in [
        (real, "is a deo event log, not a simulated run's log"),
        (other, "is a file, not a simulated run's log"),
        (tmp_path, "is a folder"),
        (tmp_path / "no" / "x.jsonl", "no such folder"),
    ]:
        before = path.read_bytes() if path.is_file() else None
        with pytest.raises(OutputRefused, match=why):
            simulate(short("steady", 50.0), log_path=path)
        assert (path.read_bytes() if path.is_file() else None) == before
    assert not (tmp_path / "no").exists()
    # A pipe reads as empty, but writing it would mean deleting it.
    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)
    with pytest.raises(OutputRefused, match="is not a regular file"):
        simulate(short("steady", 50.0), log_path=pipe)
    assert stat.S_ISFIFO(pipe.stat().st_mode)
    # A snapshot with no log beside it is not this run's to delete.
    orphan = tmp_path / "mine.jsonl"
    snapshot_path(orphan).write_text("mine\n")
    with pytest.raises(OutputRefused, match="lies beside no log"):
        simulate(short("steady", 50.0), log_path=orphan)
    assert snapshot_path(orphan).read_text() == "mine\n" and not orphan.exists()
    # And deo run's log refuses a simulated run's, whose workers and clock are not its own.
    with pytest.raises(NotALog, match="log of a simulated run"):
        EventLog.open(log)


def test_policy_replaces_every_pool_policy() -> None:
    result = simulate(short("steady", 600.0), PolicySpec(name="static", params={"count": 3}))
    assert result.policy == "static"
    assert {p.target for p in result.series} == {3}
    assert result.metrics.peak_workers == 3
    assert result.metrics.scale_actions == 0  # the count came from configuration


def test_pool_overrides_replace_pool_fields() -> None:
    result = simulate(short("steady", 600.0), pool_overrides={"max_workers": 2})
    assert result.metrics.peak_workers <= 2
    # Two workers (5.3 seq/s) cannot feed a 25.6 seq/s trainer.
    assert result.metrics.starvation_share > 0.5


def test_invalid_policy_or_overrides_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="unknown policy 'nope'"):
        simulate(short("steady", 100.0), PolicySpec(name="nope"))
    with pytest.raises(ConfigError, match="max_workers"):
        simulate(short("steady", 100.0), pool_overrides={"max_workers": -1})


def test_a_fed_trainer_is_measured_as_such() -> None:
    # 24 workers at a steady 2.67 seq/s each (64 seq/s) easily feed 51.2 seq/s: once the first
    # batch is there the trainer never waits, and the queue sits near the off-policy limit, where
    # every worker's groups in generation are discarded each time the queue reaches it.
    result = simulate(short("steady", 900.0), PolicySpec(name="static", params={"count": 24}))
    m = result.metrics
    assert m.avoidable_starvation_share < 0.01
    assert m.steps == pytest.approx((900 - result.oracle.first_batch_t) / 5.0, abs=10)
    assert m.mean_lag_steps > 1.5  # two to three batches ahead: stale data
    assert m.groups_discarded > 0 and m.discarded_generation_s > 0
    assert m.worker_hours == pytest.approx(24 * 900 / 3600, rel=0.01)
    # The oracle holds ceil(51.2 / 2.67) = 20 workers throughout: 24 / 20.
    assert m.oracle_worker_hours == pytest.approx(20 * 900 / 3600)
    assert m.worker_hours_ratio == pytest.approx(24 / 20, rel=0.01)
    # The same figure over the run's second half, and over the whole of it.
    assert worker_hours_ratio_since(result, 450.0) == pytest.approx(24 / 20, rel=0.01)
    assert worker_hours_ratio_since(result, 0.0) == pytest.approx(m.worker_hours_ratio)


def test_faults_reach_the_core(tmp_path: Path) -> None:
    cases = {
        "gpu_throttle_and_loss": ({"CordonGpu", "UncordonGpu", "TerminateWorker"}, "gpu_lost"),
        "crash_loop": ({"SpawnWorker"}, "crash_loop"),
        "metrics_outage": (set(), "source_down"),
    }
    # A fixed count keeps every fault's subject busy: GPU 5 held, crashed workers replaced.
    fixed = PolicySpec(name="static", params={"count": 20})
    for name, (kinds, alert) in cases.items():
        log = tmp_path / f"{name}.jsonl"
        simulate(short(name, 2400.0), fixed, log_path=log)
        commands = commands_in(log)
        seen = {c["@"] for c in commands}
        assert kinds <= seen, name
        assert alert in {c["alert"] for c in commands if c["@"] == "RaiseAlert"}, name


def test_groups_that_outlast_the_queue_at_the_off_policy_limit_raise_an_alert(
    tmp_path: Path,
) -> None:
    # Groups of 75 s (Pareto) against a step per 10 s and atroposlib's 3-batch limit: each time
    # the queue reaches the limit the envs cancel their groups in generation, and nothing lands
    # for the 20 s the queue lasts, whatever the pool's size. The steady run never sees that.
    slow = {
        "trainer.step_s": "10",
        "trainer.batch_size_seqs": "64",
        "pools.envs.latency_mean_s": "75",
        "pools.envs.latency_dist": '"pareto"',
        "pools.envs.latency_alpha": "2.5",
        "pools.envs.groups_in_flight": "4",
        "pools.envs.max_workers": "128",
    }
    for name, overrides, expected in [("slow", slow, True), ("steady", {}, False)]:
        log = tmp_path / f"{name}.jsonl"
        simulate(short("steady", 900.0, **overrides), log_path=log)
        raised = [c for c in commands_in(log) if c["@"] == "RaiseAlert"]
        stalls = [c for c in raised if c["alert"] == "offpolicy_stalls"]
        assert bool(stalls) is expected, (name, raised)
        assert all(
            c["subject"] == "envs" and "max_batches_offpolicy" in c["reason"] for c in stalls
        )


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_every_shipped_scenario_runs_with_the_core_invariants_checked(path: Path) -> None:
    scenario = load_scenario(path)
    result = simulate(scenario, check_invariants=True)
    m = result.metrics
    assert result.scenario == path.stem
    assert len(result.series) == int(scenario.duration_s / scenario.sample_interval_s)
    assert m.steps > 0
    assert m.worker_hours > 0
    assert 0 <= m.starvation_share <= 1
    assert 0 <= m.avoidable_starvation_share <= 1
    assert result.oracle.worker_hours > 0


def test_a_pool_asked_to_lets_its_workers_go_in_a_long_pause_and_gets_them_back() -> None:
    # A 3-minute evaluation from 900 s; workers start in 30 s. Held through it by default;
    # with pause_release_startups = 1 the pool goes to its minimum a start-up into it and
    # back to its count when the trainer steps again.
    release = {"pools.envs.policy.pause_release_startups": "1"}
    held = simulate(short("eval_checkpoint_pauses", 1320.0))
    released = simulate(short("eval_checkpoint_pauses", 1320.0, **release))

    def target_at(result: SimResult, t: float) -> int:
        return next(p.target for p in reversed(result.series) if p.t <= t)

    assert target_at(held, 1070.0) >= 15  # held through the pause
    let_go_t = next(p.t for p in released.series if p.t >= 900.0 and p.target == 1)
    assert 930.0 <= let_go_t < 1000.0  # a start-up (30 s) into the pause, and some steps
    before = target_at(released, let_go_t - 1.0)
    assert before >= 15
    assert target_at(released, 1070.0) == 1  # the pool's minimum, late in the pause
    assert target_at(released, 1100.0) >= before  # back once the trainer steps again
    assert released.metrics.worker_hours < held.metrics.worker_hours - 0.5


def test_a_trainer_that_slows_down_taken_for_a_pause_costs_nothing_after() -> None:
    # From 1200 s the trainer steps every 60 s instead of 5 s: the first slow step outlasts a
    # start-up, so a pool asked to let workers go in pauses lets them go, and gets them back at
    # that step. Afterwards it comes down by the need it measured, as the pool held through.
    slower = {"trainer.phases": "[{ at_s = 1200, step_s = 60.0 }]"}
    held = simulate(short("steady", 3600.0, **slower))
    released = simulate(
        short("steady", 3600.0, **slower, **{"pools.envs.policy.pause_release_startups": "1"})
    )
    assert any(p.target == 1 for p in released.series if 1200.0 <= p.t <= 1300.0)
    assert released.metrics.starvation_share <= held.metrics.starvation_share + 0.001
    assert released.metrics.worker_hours <= held.metrics.worker_hours + 0.1


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_trainer_stepping_seldom_on_large_batches_is_fed(seed: int) -> None:
    # A 1024-sequence batch every 44 s, 10-s start-ups, groups three times as slow by the end.
    # A start-up spans a fraction of a step, so the queue falls by a batch at a time and a
    # projection a start-up ahead never reads it empty: the pool grows before the queue falls
    # below the band's bottom. Growing only once it had (a projection to empty) starved
    # avoidably 4.1-5.2% of the time on these seeds.
    scenario = load_scenario(
        LIBRARY / "steady.toml",
        {
            "duration_s": "1800",
            "seed": str(seed),
            "trainer.step_s": "43.84",
            "trainer.batch_size_seqs": "1024",
            "pools.envs.latency_mean_s": "0.93",
            "pools.envs.groups_in_flight": "1",
            "pools.envs.startup_s": "10",
            "pools.envs.max_workers": "16",
            "pools.envs.latency_growth": "3.0",
        },
    )
    m = simulate(scenario).metrics
    assert m.avoidable_starvation_share <= 0.02
    assert m.worker_hours_ratio <= 1.15


def test_a_large_pool_held_near_the_limit_is_not_read_as_short() -> None:
    # large_pool_hours on its second seed: 128 workers come down at the off-policy limit, where
    # p, measured only after each visit there, read 0.73-0.79 seq/s per worker while the pool
    # held the queue up (at least D / active, 1.0-1.1). Read as the pool's, a dip of the queue
    # below its target looked like a pool 30% short and it grew back to 128: 1.40 x the
    # oracle's worker-hours and a mean lag of 1.60 steps. Held up, p is at least D / active.
    scenario = load_scenario(LIBRARY / "large_pool_hours.toml")
    m = simulate(attrs.evolve(scenario, seed=scenario.seed + 1)).metrics
    assert m.worker_hours_ratio <= 1.15
    assert m.mean_lag_steps <= 1.5
    assert m.avoidable_starvation_share <= 0.01


def test_a_large_pool_of_minute_long_groups_settles_instead_of_cycling() -> None:
    # 60-s groups, 96 workers needed of 128, four hours. The queue swings from empty to the
    # off-policy limit (each visit cancels the groups in generation), so the count the need
    # says holds starves now and then: each removal undone at the same need widens what the
    # next keeps, and the pool settles above it instead of cycling between it and a growth.
    scenario = load_scenario(
        LIBRARY / "steady.toml",
        {
            "duration_s": "14400",
            "pools.envs.latency_mean_s": "60.0",
            "pools.envs.max_workers": "128",
        },
    )
    m = simulate(scenario).metrics
    # (Without the damping this world and the next two seeds reverse 3.25-5.25 times an hour;
    # with it 1.75-2.25.)
    assert m.reversals_per_hour <= 2.5
    assert m.avoidable_starvation_share <= 0.01
    assert m.worker_hours_ratio <= 1.2


def test_a_cold_start_far_above_the_need_halves_with_long_start_ups() -> None:
    # slow_start_heavy_tail: 3-minute start-ups, a cold start to the pool's maximum (64), the
    # queue at the off-policy limit from then on, where a twentieth of the pool per start-up
    # took it to 34 only by the end of the hour (1.63 x the oracle's worker-hours). Production
    # measured below the limit puts the need at a fifth of the pool: it halves at the second
    # removal (a start-up after the first), and the trainer waits no more for it.
    result = simulate(short("slow_start_heavy_tail", 1200.0))
    assert max(p.target for p in result.series if p.t >= 400.0) <= 32
    assert result.metrics.avoidable_starvation_share <= 0.01
    # Past the cold start (every worker the pool may have, for a start-up, before any rate is
    # known): 1.19 x the oracle's hours; descending a twentieth per start-up it held 2.26 x.
    assert worker_hours_ratio_since(result, 600.0) <= 1.3


def test_a_pool_whose_trainer_waits_after_each_visit_to_the_limit_steps_down() -> None:
    # 75-s Pareto groups (none shorter than 45 s) and a 10-s trainer step: the three batches
    # the off-policy limit holds last 30 s, and each visit there cancels the groups in
    # generation, so the trainer waits whatever the pool. The cold start's 128 workers reach
    # the limit at once every time; the starvation that follows read as a short pool and held
    # them all (8 x the oracle's worker-hours past 10 minutes). Once the waits are reported,
    # each new one takes a quarter of the pool: past 10 minutes at most 26, 1.54 x (1.33 and
    # 1.22 x on the next two seeds; a wait counts once the trainer has stepped through the
    # batches it took, a few steps after the queue fell), and the trainer waits no more for
    # it.
    overrides = {
        "seed": "1029",
        "trainer.step_s": "9.76",
        "trainer.batch_size_seqs": "64",
        "pools.envs.latency_mean_s": "75.45",
        "pools.envs.latency_dist": '"pareto"',
        "pools.envs.latency_alpha": "2.5",
        "pools.envs.groups_in_flight": "4",
        "pools.envs.group_size": "8",
        "pools.envs.startup_s": "30",
        "pools.envs.max_workers": "128",
    }
    result = simulate(short("steady", 1800.0, **overrides))
    assert max(p.target for p in result.series if p.t >= 600.0) <= 32
    assert worker_hours_ratio_since(result, 600.0) <= 1.65
    # Holding 128 it starved 29.4% of the time avoidably; no count avoids most of it.
    assert result.metrics.avoidable_starvation_share <= 0.294
