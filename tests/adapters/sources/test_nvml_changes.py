"""GPU readings reach the core when they matter to its cordon rules, and at least once per
keep-alive: the readings of a steady GPU cost the log almost nothing."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio
import attrs
import pytest

from adapters.sources.nvml import (
    GpuGone,
    GpuHealth,
    GpuMonitor,
    NvmlSettings,
    ReadFailed,
    poll_gpus,
    sample_filter,
)
from core import ConfigError, CordonRules, Event, GpuLost, GpuSampled

GIB = 1 << 30
RULES = CordonRules(max_temperature_c=90.0, max_memory_fraction=0.9, uncordon_after_s=120)


def health(**fields: Any) -> GpuHealth:
    base: dict[str, Any] = {
        "memory_used_bytes": 10 * GIB,
        "memory_total_bytes": 80 * GIB,
        "temperature_c": 60.0,
    }
    return GpuHealth(**{**base, **fields})


def monitor(held: frozenset[str] = frozenset(), **settings: Any) -> GpuMonitor:
    changes = sample_filter(NvmlSettings(**settings), lambda: RULES, lambda: held)
    return GpuMonitor(["a:0"], changes)


def sent(monitor: GpuMonitor, t: float, reading: Any) -> list[Event]:
    events, _ = monitor.step({"a:0": reading}, t)
    return events


def test_a_steady_gpu_is_sent_once_then_only_per_keepalive() -> None:
    gpus = monitor(keepalive_s=60.0)
    assert len(sent(gpus, 0.0, health())) == 1
    # Jitter within the tolerances: nothing for the core.
    for t in range(2, 60, 2):
        assert sent(gpus, float(t), health(temperature_c=60.0 + t % 3)) == [], t
    [keepalive] = sent(gpus, 60.0, health(temperature_c=61.0))
    assert isinstance(keepalive, GpuSampled) and keepalive.t == 60.0
    assert sent(gpus, 62.0, health()) == []


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"temperature_c": 91.0}, "temperature over the rules' limit"),
        ({"temperature_c": 66.0}, "temperature moved by the tolerance"),
        ({"throttle_reasons": frozenset({"thermal"})}, "a throttle reason the rules cordon on"),
        ({"new_errors": 1}, "a new XID/ECC error"),
        ({"memory_used_bytes": 73 * GIB}, "memory over the rules' fraction"),
        ({"memory_used_bytes": 15 * GIB}, "memory moved by more than the tolerance"),
        ({"memory_total_bytes": 40 * GIB, "memory_used_bytes": 10 * GIB}, "another total"),
    ],
)
def test_a_change_that_matters_is_sent_at_once(change: dict[str, Any], why: str) -> None:
    gpus = monitor(keepalive_s=600.0)
    assert len(sent(gpus, 0.0, health())) == 1
    assert len(sent(gpus, 2.0, health(**change))) == 1, why
    # ... and going back is a change too (a cooled GPU's clean reading starts its uncordon clock).
    back = len(sent(gpus, 4.0, health()))
    assert back == (0 if "new_errors" in change else 1), why


def test_a_throttle_reason_the_rules_ignore_is_not_a_change() -> None:
    gpus = monitor(keepalive_s=600.0)
    sent(gpus, 0.0, health())
    assert sent(gpus, 2.0, health(throttle_reasons=frozenset({"power_cap"}))) == []


def test_full_memory_is_sent_again_when_a_deo_worker_takes_or_leaves_the_gpu() -> None:
    held: set[str] = set()
    changes = sample_filter(NvmlSettings(keepalive_s=600.0), lambda: RULES, lambda: set(held))
    gpus = GpuMonitor(["a:0"], changes)
    full = health(memory_used_bytes=79 * GIB)
    assert len(sent(gpus, 0.0, full)) == 1
    assert sent(gpus, 2.0, full) == []
    held.add("a:0")  # ours now: full memory is normal, the core must hear it
    assert len(sent(gpus, 4.0, full)) == 1
    assert sent(gpus, 6.0, full) == []


def test_new_rules_take_effect_at_the_next_reading() -> None:
    rules = [RULES]
    changes = sample_filter(NvmlSettings(keepalive_s=600.0), lambda: rules[0])
    gpus = GpuMonitor(["a:0"], changes)
    warm = health(temperature_c=85.0)
    assert len(sent(gpus, 0.0, warm)) == 1
    assert sent(gpus, 2.0, warm) == []  # under 90 C: nothing new for the core
    rules[0] = attrs.evolve(RULES, max_temperature_c=80.0)
    # The same reading is over the new limit: the core hears it now, not a keep-alive later.
    assert len(sent(gpus, 4.0, warm)) == 1
    assert sent(gpus, 6.0, warm) == []


def test_after_a_loss_or_a_failed_read_the_next_reading_is_sent() -> None:
    gpus = monitor(keepalive_s=600.0)
    sent(gpus, 0.0, health())
    assert [type(e) for e in sent(gpus, 2.0, GpuGone(error="fell off the bus"))] == [GpuLost]
    assert len(sent(gpus, 4.0, health())) == 1
    assert sent(gpus, 6.0, ReadFailed(error="timeout")) == []
    assert len(sent(gpus, 8.0, health())) == 1


def test_keepalive_zero_or_no_rules_sends_every_reading() -> None:
    gpus = monitor(keepalive_s=0.0)
    assert [len(sent(gpus, float(t), health())) for t in range(3)] == [1, 1, 1]
    assert sample_filter(NvmlSettings(), None) is None


@pytest.mark.parametrize("key", ["keepalive_s", "memory_tolerance", "temperature_tolerance_c"])
def test_bad_tolerances_are_refused_by_name(key: str) -> None:
    with pytest.raises(ConfigError, match=f"nvml.{key}"):
        NvmlSettings(**{key: -1.0})


def test_the_poller_emits_a_steady_file_gpu_once(tmp_path: Path) -> None:
    path = tmp_path / "gpus.json"
    reading = {"memory_used_bytes": GIB, "memory_total_bytes": 80 * GIB, "temperature_c": 50}
    path.write_text(json.dumps({"0": reading}))
    settings = NvmlSettings(backend="file", file=path, interval_s=0.01, keepalive_s=600.0)
    emitted: list[Event] = []
    lines: list[str] = []
    polls = [0]

    def rules() -> CordonRules:
        polls[0] += 1  # the filter reads the rules once per poll
        return RULES

    async def main() -> None:
        with anyio.move_on_after(60):
            async with anyio.create_task_group() as tg:
                tg.start_soon(
                    poll_gpus,
                    settings,
                    {"0": "0"},
                    emitted.append,
                    anyio.current_time,
                    lines.append,
                    rules,
                )
                while not emitted:
                    await anyio.sleep(0.01)
                first = polls[0]
                while polls[0] < first + 20:  # twenty more polls of the same reading
                    await anyio.sleep(0.01)
                path.write_text(json.dumps({"0": {**reading, "temperature_c": 95}}))
                while len(emitted) < 2:
                    await anyio.sleep(0.01)
                tg.cancel_scope.cancel()

    anyio.run(main)
    assert [e.temperature_c for e in emitted if isinstance(e, GpuSampled)] == [50.0, 95.0]
