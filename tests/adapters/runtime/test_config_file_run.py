"""``deo run`` with a configuration the event log could not hold: refused before anything runs."""

from __future__ import annotations

import sys
from collections.abc import Callable

from spawned import marked_processes
from test_run import WELL_BEHAVED, Deo, deo, pool

__all__ = ["deo"]  # the fixture, shared with test_run


def test_an_infinite_drain_timeout_is_refused_before_any_worker_starts(
    deo: Callable[[str], Deo],
) -> None:
    pools = pool("envs", [sys.executable, str(WELL_BEHAVED), "0.2"], min_workers=2, max_workers=2)
    d = deo(pools.replace("[pools.envs.policy]", "drain_timeout_s = inf\n[pools.envs.policy]"))
    proc = d.run_to_end()
    assert proc.returncode == 2, proc.stdout
    assert f"deo run: {d.config}: pools.envs.drain_timeout_s: inf is not a finite number" in (
        proc.stdout
    )
    assert "Traceback" not in proc.stdout
    assert not d.log.exists()  # nothing logged: a restart has nothing to misread
    assert marked_processes(d.marker) == []
