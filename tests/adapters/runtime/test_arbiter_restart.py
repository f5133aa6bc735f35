"""The arbiter's answers that must outlive ``deo run`` (a real process, killed with SIGKILL and
started again on the same log): a request withdrawn by a release stays withdrawn."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from arbiter_deo import GPUS, ArbiterDeo

TOKEN = "test-operator-token"
OPERATOR = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def deo(tmp_path: Path) -> Iterator[ArbiterDeo]:
    running = ArbiterDeo(tmp_path, TOKEN)
    yield running
    if running.process is not None and running.process.poll() is None:
        running.kill()


def post(deo: ArbiterDeo, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(
        f"{deo.url}/v1/arbiter/pipelines{path}", json=body, headers=OPERATOR, timeout=30
    )


def test_a_request_released_before_a_restart_is_answered_withdrawn_after_it(
    deo: ArbiterDeo,
) -> None:
    deo.start()
    train = {"name": "train", "kind": "ACTOR_TRAINING", "device_mapping": GPUS}
    gen = {"name": "gen", "kind": "GENERATION", "device_mapping": GPUS}
    assert post(deo, "", {"pipeline": "q", "clusters": [train]}).is_success
    assert post(deo, "/q/clusters/train/request", {"priority": 1}).is_success  # holds every GPU
    assert post(deo, "", {"pipeline": "p", "clusters": [gen]}).is_success
    poll = {"priority": "GENERATION", "timeout_s": 0, "request_id": "gen-step-1"}
    assert post(deo, "/p/clusters/gen/request", poll).status_code == 408  # queued
    assert post(deo, "/p/clusters/gen/release", {}).is_success  # withdrawn before an answer

    deo.kill()
    deo.start()
    again = post(deo, "/p/clusters/gen/request", poll)  # the caller's poll, sent again
    assert again.status_code == 409, again.text
    assert "withdrawn (released)" in again.json()["error"]
    assert "waiting" not in deo.status()["pipelines"]["p"]["clusters"]["gen"]  # not queued anew

    # A new request (another id) is queued as usual.
    fresh = {**poll, "request_id": "gen-step-2"}
    assert post(deo, "/p/clusters/gen/request", fresh).status_code == 408
    assert "waiting" in deo.status()["pipelines"]["p"]["clusters"]["gen"]
    assert deo.stop() == 0
    deo.replays()
