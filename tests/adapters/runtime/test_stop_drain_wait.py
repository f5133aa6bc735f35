"""How long ``deo stop --drain`` waits for its workers: until the latest deadline a worker has,
not the deadline a drain would get now."""

from __future__ import annotations

import attrs

from adapters.run import drain_all_wait_s
from core import (
    Config,
    Configured,
    DrainRequested,
    PolicySpec,
    PoolSpec,
    State,
    WorkerStarted,
    WorkerState,
    drains,
    reduce,
)

T0 = 1_795_350_000.0


def with_drains(state: State, measured: tuple[tuple[float, bool], ...]) -> State:
    """``state`` with the pool ``envs`` having measured ``measured`` drains."""
    pool = attrs.evolve(state.pools["envs"], drains=measured)
    return attrs.evolve(state, pools={**state.pools, "envs": pool})


def start_requested(state: State, t: float) -> State:
    for worker in list(state.workers.values()):
        if worker.state is WorkerState.REQUESTED:
            started = WorkerStarted(
                t=t, worker_id=worker.worker_id, pid=1000 + worker.index, start_time=1
            )
            state, _ = reduce(state, started)
    return state


def test_a_drain_begun_under_a_longer_measured_deadline_is_waited_for() -> None:
    pool = PoolSpec(
        name="envs",
        argv=["python", "env.py"],
        max_workers=2,
        stop_timeout_s=10.0,
        policy=PolicySpec(name="static", params={"count": 1}),
    )
    state, _ = reduce(State(), Configured(t=T0, config=Config(pools=[pool])))
    state = start_requested(state, T0)
    # Drains took 100 s: the next drain gets 150 s.
    state = with_drains(state, ((100.0, False),) * drains.MIN_DRAINS)
    [first] = state.workers
    state, _ = reduce(state, DrainRequested(t=T0 + 10, worker_id=first))
    assert state.workers[first].deadline_t == T0 + 160
    state = start_requested(state, T0 + 11)
    # Since then the pool's drains got short: a drain now gets the 10 s floor.
    state = with_drains(state, ((2.0, False),) * drains.WINDOW_DRAINS)
    assert drains.drain_timeout(pool, state.pools["envs"].drains)[0] == drains.FLOOR_S
    # deo stop --drain removes every pool.
    now = T0 + 20
    state, _ = reduce(state, Configured(t=now, config=Config(pools=[])))
    assert all(w.state is WorkerState.DRAINING for w in state.workers.values())
    # The first worker may drain until T0 + 160, then SIGTERM and SIGKILL get 10 s each.
    assert drain_all_wait_s(state, now) == 160 - 20 + 2 * 10.0


def test_no_worker_no_wait() -> None:
    assert drain_all_wait_s(State(), T0) == 0.0
