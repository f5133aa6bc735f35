"""adapters.describe: one line per event, as ``deo replay`` prints a timeline."""

from __future__ import annotations

import pytest

from adapters.describe import event_line
from core import WorkerExited


@pytest.mark.parametrize(
    ("event", "line"),
    [
        (
            WorkerExited(t=1.0, worker_id="envs-0", exit_code=3),
            "exit       envs-0 exited with code 3",
        ),
        (
            WorkerExited(t=1.0, worker_id="envs-0", signal=9),
            "exit       envs-0 killed by signal 9",
        ),
        (
            WorkerExited(t=1.0, worker_id="envs-0"),
            "exit       envs-0 exited (status unknown: adopted, not deo's child)",
        ),
    ],
)
def test_an_exit_says_how_the_worker_ended_as_far_as_deo_can_know(
    event: WorkerExited, line: str
) -> None:
    assert event_line(event) == line
