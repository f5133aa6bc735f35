"""The core's side of processes a worker leaves behind: an alert raised, then resolved."""

from __future__ import annotations

from core import (
    Config,
    Configured,
    LeftoverProcesses,
    LeftoverProcessesStopped,
    RaiseAlert,
    Reducer,
    ResolveAlert,
)
from core.vocabulary import AlertName


def test_leftovers_raise_an_alert_naming_them_until_they_are_all_gone() -> None:
    reducer = Reducer(check_invariants=True)
    reducer.step(Configured(t=0.0, config=Config()))
    found = LeftoverProcesses(
        t=1.0, worker_id="envs-0", count=2, detail="pid 41 (child of pid 1), pid 42 (...)"
    )
    [raised] = reducer.step(found)
    assert isinstance(raised, RaiseAlert)
    assert (raised.alert, raised.subject) == (AlertName.LEFTOVER_PROCESSES, "envs-0")
    assert "2 process(es) of envs-0" in raised.reason and "pid 41" in raised.reason
    assert reducer.step(found) == []  # raised once
    assert (AlertName.LEFTOVER_PROCESSES, "envs-0") in reducer.state.alerts
    [resolved] = reducer.step(LeftoverProcessesStopped(t=3.0, worker_id="envs-0"))
    assert isinstance(resolved, ResolveAlert) and resolved.subject == "envs-0"
    assert not reducer.state.alerts
    # A late or repeated report changes nothing.
    assert reducer.step(LeftoverProcessesStopped(t=4.0, worker_id="envs-0")) == []
