"""``simulate``: one scenario run by the real reducer in simulated time.

The loop is a runner's loop with the world in place of sources and executors: the world emits an
event, the reducer steps on it (through the event log when one is asked for), the world carries
out the commands. Nothing reads a clock or the global random state, so the same scenario and
seed give the same result, and the same log bytes apart from the header's creation time.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from adapters.log import EventLog, snapshot_path
from adapters.outputs import OutputRefused, is_simulated_log, output_problem
from adapters.sim.metrics import SimResult, measure
from adapters.sim.oracle import oracle
from adapters.sim.scenario import Scenario
from adapters.sim.world import World
from core import Command, Configured, Event, PolicySpec, Reducer
from core.policies import BUILT_INS, PolicyCatalog

__all__ = ["simulate"]

#: Records buffered between writes of the log.
_FLUSH_EVERY = 4096


def _make_way(path: Path) -> None:
    """Remove what a new simulated run's log at ``path`` replaces: an earlier simulated run's
    log and its snapshot, and nothing else (a real run's log, in use or not, or any other file
    raises :class:`~adapters.outputs.OutputRefused`)."""
    problem = output_problem(path, what="a simulated run's log", replaceable=is_simulated_log)
    if problem is not None:
        raise OutputRefused(f"{path} {problem}")
    snapshot = snapshot_path(path)
    if snapshot.exists() and not path.exists():
        # A snapshot is replaced with the log it belongs to, never on its own.
        raise OutputRefused(
            f"{path}: {snapshot} lies beside no log; it is left as it is (remove it to write a "
            f"simulated log here)"
        )
    for stale in (path, snapshot):
        stale.unlink(missing_ok=True)


def simulate(
    scenario: Scenario,
    policy: PolicySpec | None = None,
    *,
    pool_overrides: Mapping[str, Any] | None = None,
    log_path: Path | None = None,
    check_invariants: bool = False,
    policies: PolicyCatalog = BUILT_INS,
) -> SimResult:
    """Run ``scenario`` with the real reducer and return its metrics and series.

    ``policy`` replaces every pool's policy (None: the scenario's own); ``pool_overrides``
    replaces PoolSpec fields of every pool (``{"stabilization_s": 0.0}``). With ``log_path`` every
    event and command is written to a fresh event log there (``deo replay`` verifies it).
    ``check_invariants`` checks the core's invariants after every step (slower). ``policies``:
    the policies a pool may run, by name (the benchmark passes one with its baselines).
    Raises :class:`~core.errors.ConfigError` when the policy or overrides are invalid, and
    :class:`~adapters.outputs.OutputRefused` when ``log_path`` cannot be written or holds
    anything but a simulated run's log.
    """
    config = scenario.config(policy, pool_overrides, policies)
    world = World(scenario)
    reducer = Reducer(policies=policies, check_invariants=check_invariants)
    log: EventLog | None = None
    if log_path is not None:
        log_path = Path(log_path)
        _make_way(log_path)
        log, _ = EventLog.open(log_path, fsync=False, policies=policies, simulated=True)

    def feed(event: Event) -> None:
        commands: list[Command] = reducer.step(event) if log is None else log.record(reducer, event)
        for command in commands:
            world.carry_out(command)

    try:
        feed(Configured(t=0.0, config=config))
        fed = 0
        while (event := world.next_event()) is not None:
            feed(event)
            fed += 1
            if log is not None and fed % _FLUSH_EVERY == 0:
                log.flush()
    finally:
        if log is not None:
            log.close()
    record = world.finish()
    reference = oracle(scenario)
    return SimResult(
        scenario=scenario.name,
        policy="+".join(sorted({spec.policy.name for spec in config.pools})),
        metrics=measure(scenario, record, reference),
        series=record.series,
        oracle=reference,
        record=record,
    )
