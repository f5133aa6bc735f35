"""A trainer that takes every full batch at once (atroposlib's ``/batch``): in the simulator, in
the what-if's reading of a log, and on a recorded real ``deo demo`` log.

``data/demo_60s.jsonl`` is the event log of a real 60 s ``deo demo`` (atroposlib 0.4.0 API server,
the demo trainer at 1.0 s, 0.4 s and 2.5 s per step, stand-in env workers, the buffer policy); its
trainer reported waiting 0.5 s for data in the 60 s after its first batch. It replays exactly: the
log of a run whose policy decided otherwise than the present one does not (the fit would read a
diverged replay).
"""

from __future__ import annotations

import itertools
import random
import re
import statistics
import subprocess
from pathlib import Path
from typing import Any

import pytest
from conftest import deo_command

from adapters.postmortem.fit import _one_per_step, fit_scenario, read_run
from adapters.sim.driver import simulate
from adapters.sim.scenario import EnvPool, Phase, Scenario, TrainerSpec
from bench.baselines import CATALOG

DEMO_LOG = Path(__file__).resolve().parent / "data" / "demo_60s.jsonl"


def deo(*args: Any, cwd: Path) -> subprocess.CompletedProcess[str]:
    command, env = deo_command()
    return subprocess.run(
        [*command, *map(str, args)], cwd=cwd, capture_output=True, text=True, timeout=300, env=env
    )


def demo_like(*, fetch_all: bool, duration_s: float = 600.0) -> Scenario:
    """The demo's world, longer: 32-sequence batches at 1.0 s then 2.5 s per step, 1.5 s groups
    of 8, two in flight per worker, at most 8 workers, the queue sampled every 0.5 s."""
    return Scenario(
        name="demo-like",
        duration_s=duration_s,
        seed=3,
        sample_interval_s=0.5,
        trainer=TrainerSpec(
            batch_size_seqs=32,
            step_s=1.0,
            phases=(Phase(at_s=duration_s / 2, step_s=2.5),),
            fetch_all=fetch_all,
        ),
        pools=(
            EnvPool(
                name="envs",
                group_size=8,
                groups_in_flight=2,
                latency_mean_s=1.5,
                startup_s=2.0,
                gpus_per_worker=0,
                max_workers=8,
            ),
        ),
    )


def test_a_fetch_all_trainer_takes_every_full_batch_and_holds_the_rest(tmp_path: Path) -> None:
    log = tmp_path / "run.jsonl"
    result = simulate(demo_like(fetch_all=True, duration_s=120.0), log_path=log, policies=CATALOG)
    samples = read_run(log).queue
    jumps = [b[3] - a[3] for a, b in itertools.pairwise(samples) if b[3] > a[3]]
    assert max(jumps) >= 3  # at the off-policy limit (3 batches) a fetch takes them all
    # The counter counts batches taken: the steps taken so far, plus at most those held.
    assert 0 <= samples[-1][3] - result.metrics.steps <= 3
    # Right after a fetch the queue mostly holds less than a batch: it took every full one (a
    # group may land between the fetch and the sample).
    after_fetch = [b for a, b in itertools.pairwise(samples) if b[3] - a[3] >= 2]
    emptied = [queued < batch for _, queued, batch, _ in after_fetch]
    assert sum(emptied) >= 0.8 * len(emptied)


@pytest.mark.parametrize("fetch_all", [True, False])
def test_the_fit_reads_step_times_whichever_way_the_trainer_fetches(
    tmp_path: Path, fetch_all: bool
) -> None:
    log = tmp_path / "run.jsonl"
    simulate(demo_like(fetch_all=fetch_all), log_path=log, policies=CATALOG)
    facts = read_run(log)
    assert facts.fetch_all is fetch_all
    fitted = fit_scenario(facts, "fitted", CATALOG, calibrate=False)
    trainer = fitted.scenario.trainer
    assert trainer.fetch_all is fetch_all
    steps = [trainer.step_s, *(p.step_s for p in trainer.phases)]
    assert steps[0] == pytest.approx(1.0, rel=0.1)
    assert steps[-1] == pytest.approx(2.5, rel=0.1)
    noted = any("takes every full batch queued at once" in note for note in fitted.notes)
    assert noted is fetch_all


def test_a_real_demo_log_is_fitted_with_its_fit_error_reported_and_bounded(
    tmp_path: Path,
) -> None:
    # 12 seeds: over 3, the simulated starvation of a 60 s run moves by a few points from one
    # controller version to the next (seed noise, not the fit).
    args = ["--what-if", "policy=static", "--what-if-seeds", "12", "--fitted-out", "f.toml"]
    proc = deo("replay", DEMO_LOG, *args, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "the trainer takes every full batch queued at once (atroposlib's /batch)" in out
    # Three speeds read (1.0, 0.4 and 2.5 s a step, plus the trainer's own fetch overhead).
    trainer = re.search(r"step time ([\d.]+) s from 0 s, ([\d.]+) s from \d+ s, ([\d.]+) s", out)
    assert trainer is not None, out
    first, fast, slow = map(float, trainer.groups())
    assert first == pytest.approx(1.0, rel=0.1)
    assert fast < first < slow
    # The trainer reported waiting 1% of the time; counting fetches as steps would read
    # starvation in every span a fetch's batches were held.
    recorded = re.search(r"trainer starvation, log read +([\d.]+)%", out)
    assert recorded is not None and float(recorded.group(1)) <= 5.0
    error = re.search(
        r"^  starvation ([-+][\d.]+) points \(allowed [\d.]+\), worker-hours ([-+][\d.]+)%",
        out,
        re.M,
    )
    assert error is not None, out
    assert abs(float(error.group(1))) <= 5.0
    assert abs(float(error.group(2))) <= 30.0
    assert "fetch_all = true" in (tmp_path / "f.toml").read_text()


def test_a_fitted_scenario_with_a_fetch_all_trainer_loads_back(tmp_path: Path) -> None:
    scenario = demo_like(fetch_all=True, duration_s=60.0)
    log = tmp_path / "run.jsonl"
    simulate(scenario, log_path=log, policies=CATALOG)
    proc = deo(
        "replay",
        log,
        "--what-if",
        "max_workers=4",
        "--what-if-seeds",
        "1",
        "--fitted-out",
        "f.toml",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    sim = deo("simulate", "f.toml", cwd=tmp_path)
    assert sim.returncode == 0, sim.stdout + sim.stderr


# --- unrolling fetches into steps ----------------------------------------------------------------

Queue = list[tuple[float, int, int, int]]


def fetching_every_6_s(t0: float, fetches: int) -> Queue:
    """Samples every second of a trainer that takes 3 batches of 32 at once every 6 s, with a
    batch queued at the sample before each fetch (it fetches the moment it is done)."""
    return [(t0 + j, 32 if j % 6 == 5 else 0, 32, 3 * (j // 6)) for j in range(6 * fetches + 1)]


def test_a_fetch_is_unrolled_into_steps_and_the_batches_held_count_as_queued() -> None:
    queue = fetching_every_6_s(0.0, 4)
    unrolled = _one_per_step(queue, end_s=queue[-1][0])
    # Fetched at 5.5 s: steps at 5.5, 7.5 and 9.5 s. At 6 s one is taken, two held (queued).
    assert unrolled[6] == (6.0, 64, 32, 1)
    assert unrolled[8] == (8.0, 32, 32, 2)
    assert unrolled[10] == (10.0, 0, 32, 3)


def test_after_a_trainer_restart_its_fetches_are_unrolled_again() -> None:
    before = fetching_every_6_s(0.0, 4)
    after = fetching_every_6_s(100.0, 4)  # restarted: its counter starts again at 0
    unrolled = _one_per_step(before + after, end_s=after[-1][0])
    assert unrolled[: len(before)] == _one_per_step(before, end_s=after[0][0])
    assert unrolled[len(before) + 6] == (106.0, 64, 32, 1)
    assert unrolled[len(before) :] == _one_per_step(after, end_s=after[-1][0])


def one_per_step_by_scanning(queue: Queue, end_s: float) -> Queue:
    """The same reading, written as a scan of every sample and fed span for each fetch."""
    fetches = [
        ((a[0] + b[0]) / 2, b[3] - a[3]) for a, b in itertools.pairwise(queue) if b[3] > a[3]
    ]
    fed_before: list[bool] = []
    for index, (t, _) in enumerate(fetches):
        if index + 1 == len(fetches):
            fed_before.append(False)
            continue
        next_t = fetches[index + 1][0]
        between = [sample for sample in queue if t < sample[0] < next_t]
        fed_before.append(bool(between) and between[-1][1] >= between[-1][2])
    fed_steps = [
        (t, (fetches[i + 1][0] - t) / k)
        for i, (t, k) in enumerate(fetches)
        if fed_before[i] and i + 1 < len(fetches)
    ]
    starts: list[float] = []
    for i, (t, k) in enumerate(fetches):
        stop = fetches[i + 1][0] if i + 1 < len(fetches) else end_s
        even = (stop - t) / k
        step_s = even
        if not fed_before[i]:
            nearby = [s for at, s in fed_steps if abs(at - t) <= 30.0] or [s for _, s in fed_steps]
            step_s = min(even, statistics.median(nearby)) if nearby else even
        starts += [t + n * step_s for n in range(k)]
    first = queue[0][3]
    out = []
    for t, queued, batch, taken in queue:
        started = first + sum(1 for start in starts if start <= t)
        held = max(taken - started, 0)
        out.append((t, queued + held * batch, batch, min(started, taken)))
    return out


@pytest.mark.parametrize("seed", range(5))
def test_the_unrolling_reads_any_queue_as_a_scan_of_it_would(seed: int) -> None:
    rng = random.Random(seed)
    t, taken, queue = 0.0, rng.randrange(5), []
    for _ in range(400):
        t += rng.uniform(0.2, 3.0)
        if rng.random() < 0.3:
            taken += rng.choice([1, 1, 2, 3, 4])
        queue.append((round(t, 3), rng.randrange(0, 100), 32, taken))
    end_s = t + rng.uniform(0.0, 5.0)
    assert _one_per_step(queue, end_s) == one_per_step_by_scanning(queue, end_s)
