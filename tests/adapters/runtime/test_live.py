"""The live view shows pools, GPUs, alerts and the last decisions."""

from __future__ import annotations

from adapters.runtime.live import render
from adapters.runtime.runner import Decision
from core import Config, Configured, GpuCordonRequested, PolicySpec, PoolSpec, Reducer


def test_render_shows_pools_gpus_alerts_and_decisions() -> None:
    reducer = Reducer()
    spec = PoolSpec(
        name="envs",
        argv=["w"],
        min_workers=3,
        max_workers=4,
        gpus_per_worker=1,
        policy=PolicySpec(name="static", params={"count": 3}),
    )
    commands = reducer.step(Configured(t=5.0, config=Config(pools=[spec], gpus=["0", "1"])))
    commands += reducer.step(GpuCordonRequested(t=6.0, gpu_id="1"))
    text = render(reducer.state, [Decision(t=6.0, command=c) for c in commands], last=3)
    lines = text.splitlines()
    assert lines[0] == "deo  6.0s"
    assert lines[1].startswith("envs: target 3 (desired 3); workers: 2 requested")
    assert "GPUs 0:ok  1:cordoned(operator)" in lines
    assert "ALERT below_min envs" in lines and "ALERT no_free_gpus envs" in lines
    decisions = lines[lines.index("last decisions:") + 1 :]
    assert len(decisions) == 3 and "cordon" in decisions[-1]
    assert all(len(line) <= 120 for line in lines)
