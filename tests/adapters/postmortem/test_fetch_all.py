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
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
from conftest import deo_command

from adapters.postmortem.fit import fit_scenario, read_run
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
    samples = read_run(log, CATALOG).queue
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
    facts = read_run(log, CATALOG)
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
    proc = deo(
        "replay", DEMO_LOG, "--what-if", "policy=static", "--fitted-out", "f.toml", cwd=tmp_path
    )
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
