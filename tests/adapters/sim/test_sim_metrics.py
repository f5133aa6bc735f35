"""Metrics from hand-made records: each definition checked against its arithmetic."""

from __future__ import annotations

import math
from typing import Any

import attrs
import pytest

from adapters.sim.metrics import Metrics, SimResult, measure, worker_hours_ratio_since
from adapters.sim.oracle import GRID_S, LowerBound, OraclePoint, OracleResult
from adapters.sim.scenario import EnvPool, Pause, Scenario, TrainerSpec
from adapters.sim.world import ScaleRecord, SeriesPoint, WorkerSpan, WorldRecord

SCENARIO = Scenario(
    name="hand",
    duration_s=1000.0,
    trainer=TrainerSpec(pauses=(Pause(at_s=500.0, duration_s=100.0),)),
    pools=(EnvPool(name="envs", stabilization_s=120.0, gpus_per_worker=2),),
)


def make_record(**changes: Any) -> WorldRecord:
    fields: dict[str, Any] = {
        "duration_s": 1000.0,
        "steps": 10,
        "starved": (),
        "lag_seqs": {},
        "spans": (),
        "scales": (),
        "series": (),
        "groups_completed": 0,
        "groups_lost": 0,
    }
    fields.update(changes)
    return WorldRecord(**fields)


def make_oracle(
    unavoidable: tuple[tuple[float, float], ...] = (), partial: dict[int, float] | None = None
) -> OracleResult:
    """An oracle starving whole cells in ``unavoidable`` and ``partial`` seconds in others."""
    cells = [0.0] * round(SCENARIO.duration_s / GRID_S)
    for start, end in unavoidable:
        for i in range(round(start / GRID_S), round(end / GRID_S)):
            cells[i] = GRID_S
    for i, seconds in (partial or {}).items():
        cells[i] = seconds
    bound = LowerBound(
        worker_hours=1.0,
        starvation_share=0.0,
        starved=(),
        starved_cells=tuple(cells),
        steps=10,
        first_batch_t=0.0,
    )
    return OracleResult(
        worker_hours=2.0,
        unavoidable_starvation_share=0.05,
        unavoidable=unavoidable,
        unavoidable_cells=tuple(cells),
        first_batch_t=0.0,
        series=(),
        bound=bound,
    )


def scale(
    t: float, previous: int, target: int, source: str = "policy", pool: str = "envs"
) -> ScaleRecord:
    return ScaleRecord(t=t, pool=pool, previous=previous, target=target, source=source)


def metrics(**changes: Any) -> Metrics:
    oracle = changes.pop("oracle", make_oracle())
    return measure(SCENARIO, make_record(**changes), oracle)


def test_starvation_excludes_pauses_and_unavoidable_intervals() -> None:
    # 900 s trained (pause 500-600). Starved 0-40 and 700-790: 130 s -> 130 / 900.
    # Unavoidable 0-30: avoidable = 130 - 30 = 100 s over 900 - 30 = 870 s.
    m = metrics(starved=((0.0, 40.0), (700.0, 790.0)), oracle=make_oracle(((0.0, 30.0),)))
    assert m.starvation_share == pytest.approx(130 / 900)
    assert m.avoidable_starvation_share == pytest.approx(100 / 870)
    assert m.unavoidable_starvation_share == 0.05


def test_a_partial_shortfall_excuses_only_its_part_within_a_minute() -> None:
    # The oracle starves 0.25 s of every second in [120, 180): 15 s in that minute. The trainer
    # waits 20 s there, in one stretch (a batch at a time): 5 s avoidable. Elsewhere a wait of
    # 10 s in [300, 310) is all avoidable, the oracle starving nothing in that minute.
    partial = {i: 0.25 for i in range(120, 180)}
    m = metrics(starved=((130.0, 150.0), (300.0, 310.0)), oracle=make_oracle(partial=partial))
    assert m.starvation_share == pytest.approx(30 / 900)
    assert m.avoidable_starvation_share == pytest.approx(15 / (900 - 15))
    # The same waits at the same places, the oracle starving nothing: all 30 s avoidable.
    m = metrics(starved=((130.0, 150.0), (300.0, 310.0)))
    assert m.avoidable_starvation_share == pytest.approx(30 / 900)


def test_a_stretch_the_oracle_starves_through_is_compared_as_a_whole() -> None:
    # From 0 to 360 s the oracle is short of capacity: it starves 0.25 s of every second, 15 s
    # a minute. The trainer, short too, waits a batch at a time: 5 s in one minute, 25 s in the
    # next, 90 s in all against the oracle's 90. Minute by minute that would read 30 s avoidable
    # (10 s in each minute it waited 25); as one stretch, none.
    partial = {i: 0.25 for i in range(0, 360)}
    waits = tuple(
        (minute * 60.0, minute * 60.0 + (5.0 if minute % 2 == 0 else 25.0)) for minute in range(6)
    )
    m = metrics(starved=waits, oracle=make_oracle(partial=partial))
    assert m.starvation_share == pytest.approx(90 / 900)
    assert m.avoidable_starvation_share == 0.0
    # A wait after the stretch, in a minute the oracle does not starve in, is avoidable whatever
    # the trainer saved within the stretch; so is a stretch's excess.
    m = metrics(starved=((0.0, 5.0), (400.0, 410.0)), oracle=make_oracle(partial=partial))
    assert m.avoidable_starvation_share == pytest.approx(10 / (900 - 90))
    m = metrics(starved=((0.0, 100.0),), oracle=make_oracle(partial=partial))
    assert m.avoidable_starvation_share == pytest.approx(10 / (900 - 90))


def test_worker_hours_count_gpus_from_spawn_to_exit_or_the_end() -> None:
    spans = (
        WorkerSpan(worker_id="envs-0", pool="envs", cost=2, spawned_t=0.0, exited_t=360.0),
        WorkerSpan(worker_id="envs-1", pool="envs", cost=2, spawned_t=640.0, exited_t=None),
    )
    m = metrics(spans=spans)
    # 2 GPUs x (360 s + 360 s) = 1440 GPU-seconds = 0.4 GPU-hours; the oracle needs 2.0.
    assert m.worker_hours == pytest.approx(0.4)
    assert m.oracle_worker_hours == 2.0
    assert m.worker_hours_ratio == pytest.approx(0.2)


def test_worker_hours_after_a_time_count_only_what_is_held_from_then_on_both_sides() -> None:
    # Held: 2 GPUs from 0 to 360 s and from 640 s to the end (1000 s). The oracle holds 3
    # workers of 2 GPUs until 500 s, then 1.
    spans = (
        WorkerSpan(worker_id="envs-0", pool="envs", cost=2, spawned_t=0.0, exited_t=360.0),
        WorkerSpan(worker_id="envs-1", pool="envs", cost=2, spawned_t=640.0, exited_t=None),
    )
    record = make_record(spans=spans)
    held = [3 if i * GRID_S < 500 else 1 for i in range(round(1000 / GRID_S))]
    series = tuple(
        OraclePoint(
            t=i * GRID_S, workers=n, gpus=2 * n, consumption_seqs_s=1.0, capacity_seqs_s=1.0
        )
        for i, n in enumerate(held)
    )
    oracle = attrs.evolve(make_oracle(), series=series)
    result = SimResult(
        scenario="hand",
        policy="deo",
        metrics=measure(SCENARIO, record, oracle),
        series=(),
        oracle=oracle,
        record=record,
    )
    # From 300 s: held 2 x (60 + 360) = 840; the oracle 2 x (3 x 200 + 1 x 500) = 2200.
    assert worker_hours_ratio_since(result, 300.0) == pytest.approx(840 / 2200)
    # From 0 s: 1440 against 2 x (1500 + 500) = 4000 GPU-seconds.
    assert worker_hours_ratio_since(result, 0.0) == pytest.approx(1440 / 4000)
    with pytest.raises(ValueError, match="from_s must be within the run"):
        worker_hours_ratio_since(result, 1000.0)
    with pytest.raises(ValueError, match="record"):
        worker_hours_ratio_since(attrs.evolve(result, record=None), 300.0)


def test_lag_mean_and_p95_per_sequence() -> None:
    # 90 sequences at lag 0, 6 at lag 1, 4 at lag 5: mean (6 + 20) / 100 = 0.26; the 95th
    # sequence in lag order has lag 1.
    m = metrics(lag_seqs={0: 90, 1: 6, 5: 4})
    assert m.mean_lag_steps == pytest.approx(0.26)
    assert m.p95_lag_steps == 1.0
    assert metrics(lag_seqs={0: 90, 1: 4, 5: 6}).p95_lag_steps == 5.0
    assert math.isnan(metrics().mean_lag_steps)  # nothing consumed


def test_flaps_are_reversals_over_any_span_and_counted_per_hour() -> None:
    scales = (
        scale(0.0, 0, 1, source="config"),  # not the policy's
        scale(10.0, 1, 5),
        scale(70.0, 5, 4),  # down after up: reversal 1
        scale(100.0, 4, 3),  # same direction
        scale(300.0, 3, 6),  # up 200 s after the last down: reversal 2, however long after
        scale(419.0, 6, 5),  # reversal 3
        scale(420.0, 5, 4, source="operator"),
        scale(420.0, 1, 2, pool="other"),  # another pool's history
        scale(539.0, 5, 6),  # reversal 4
        scale(900.0, 6, 6),  # no change: no direction
        scale(1200.0, 6, 7),  # same direction as the last change
    )
    m = metrics(scales=scales)
    assert m.flaps == 4
    assert m.scale_actions == 9  # the 8 policy decisions of envs and the other pool's one
    assert m.reversals_per_hour == pytest.approx(4 * 3600 / m.duration_s)


def test_peak_workers_and_counts() -> None:
    series = tuple(
        SeriesPoint(
            t=float(t),
            workers=w,
            active_workers=w,
            target=w,
            queued_batches=0.0,
            trainer_waiting=False,
            trainer_step=0,
        )
        for t, w in ((2, 3), (4, 7), (6, 5))
    )
    m = metrics(series=series, groups_lost=3, steps=42)
    assert (m.peak_workers, m.groups_lost, m.steps) == (7, 3, 42)
