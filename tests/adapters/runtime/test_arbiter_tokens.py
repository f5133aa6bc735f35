"""Pipeline tokens on the arbiter's API of ``deo run`` (a real process, real HTTP): registering
answers the pipeline's own token; it authorizes that pipeline's calls only, is never logged,
outlives a restart and is void once the pipeline registers again."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from arbiter_deo import GPUS, ArbiterDeo

from deo_worker.arbiter_client import ArbiterClient, ArbiterError, Cluster

TOKEN = "test-operator-token"


@pytest.fixture
def deo(tmp_path: Path) -> Iterator[ArbiterDeo]:
    running = ArbiterDeo(tmp_path, TOKEN)
    yield running
    if running.process is not None and running.process.poll() is None:
        running.kill()


def post(
    deo: ArbiterDeo, path: str, token: str, body: dict[str, Any] | None = None
) -> httpx.Response:
    return httpx.post(
        f"{deo.url}/v1/arbiter/pipelines{path}",
        json=body or {},
        headers={"Authorization": f"Bearer {token}"},
        timeout=30,
    )


def test_a_pipeline_token_speaks_for_its_pipeline_only(deo: ArbiterDeo) -> None:
    deo.start()
    clusters = [Cluster("train", "ACTOR_TRAINING", ["0", "1"]), Cluster("gen", "GENERATION", GPUS)]
    tokens = {}
    for name in ("p1", "p2"):
        with ArbiterClient(deo.url, TOKEN, pipeline=name) as operator:
            tokens[name] = operator.register(clusters)
    p1, p2 = tokens["p1"], tokens["p2"]
    assert p1 != p2 and TOKEN not in (p1, p2)

    # Only the operator registers, and only the operator is told a token again.
    refused = post(deo, "", p1, {"pipeline": "p3", "clusters": []})
    assert refused.status_code == 403
    assert post(deo, "/p1/token", p2).status_code == 403
    assert post(deo, "/p1/token", TOKEN).json()["token"] == p1

    # p1's own token works for every call of p1's ...
    with ArbiterClient(deo.url, p1, pipeline="p1") as trainer:
        trainer.open_rollout()
        trainer.progress("rollout", 64, 0)
        assert trainer.request("train", "ACTOR_TRAINING", deadline_s=60).gpus == ("0", "1")
        trainer.release("train")
        trainer.close_rollout()
    # ... and none of p2's: the refusal says whose token it is.
    for path, body in (
        ("/p2/clusters/gen/request", {"priority": "GENERATION", "timeout_s": 0}),
        ("/p2/clusters/train/release", {}),
        ("/p2/progress", {"stream": "s", "target_trajectories": 1, "completed_trajectories": 0}),
        ("/p2/rollout/open", {}),
        ("/p2/rollout/close", {}),
        ("/p2/release-and-request", {"release_cluster": "gen", "cluster": "train", "priority": 1}),
        ("/p2/unregister", {}),
    ):
        answer = post(deo, path, p1, body)
        assert answer.status_code == 403, (path, answer.text)
        assert "pipeline 'p1''s" in answer.json()["error"] and "'p2'" in answer.json()["error"]
    assert post(deo, "/p2/rollout/open", "not-a-token").status_code == 403
    with ArbiterClient(deo.url, p1, pipeline="p2") as wrong, pytest.raises(ArbiterError) as err:
        wrong.open_rollout()
    assert err.value.status == 403
    assert not deo.status()["pipelines"]["p2"]["rollout_open"]  # nothing of it was done

    # Never logged; the same after a restart (derived from the secret kept beside the log).
    assert p1 not in deo.log.read_text() and p2 not in deo.log.read_text()
    deo.kill()
    deo.start()
    assert post(deo, "/p2/rollout/open", p2).is_success

    # Registered again under the same name, a pipeline gets a new token: the old one is void.
    with ArbiterClient(deo.url, TOKEN, pipeline="p2") as operator:
        operator.unregister()
        renewed = operator.register(clusters)
    assert renewed != p2
    assert post(deo, "/p2/rollout/open", p2).status_code == 403
    assert post(deo, "/p2/rollout/open", renewed).is_success
    assert deo.stop() == 0
    deo.replays()
