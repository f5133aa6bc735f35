"""A reducer with one pool of started workers, for the liveness tests."""

from __future__ import annotations

from adapters.runtime.liveness import Liveness
from core import Config, Configured, PolicySpec, PoolSpec, Reducer, WorkerStarted


def running(count: int, grace_s: float | None) -> Reducer:
    """A reducer whose pool ``envs`` has ``count`` workers (``envs-0``...) started at 0 s, judged
    hung after ``grace_s`` of silence (None: never)."""
    spec = PoolSpec(
        name="envs",
        argv=["w"],
        max_workers=count,
        heartbeat_grace_s=grace_s,
        policy=PolicySpec(name="static", params={"count": count}),
    )
    reducer = Reducer(check_invariants=True)
    reducer.step(Configured(t=0.0, config=Config(pools=[spec])))
    for k in range(count):
        reducer.step(WorkerStarted(t=0.0, worker_id=f"envs-{k}", pid=100 + k, start_time=k))
    return reducer


def past_first_sightings(reducer: Reducer, liveness: Liveness) -> None:
    """Record every worker's first sighting at 0 s (recorded at once, whatever the grace), so
    what a test reads next is the batching of later sightings."""
    for worker_id in reducer.state.workers:
        liveness.saw(reducer.state, worker_id, 0.0)
    for event in liveness.records(reducer.state, 0.0, 1.0):
        reducer.step(event)
    assert liveness.pending == frozenset()
