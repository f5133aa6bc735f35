"""Why a request can no longer be granted is in the arbiter's state (so a log replays it and a
restarted deo answers a caller still polling): withdrawn by a release, or failed."""

from __future__ import annotations

from core import GpuLost, decode, encode
from core.arbiter import (
    GpusReleased,
    GpusReleasedAndRequested,
    GpusRequested,
    Priority,
)
from tests.core.arbiter_helpers import gpus, make_arbiter, register


def ask(pipeline: str, cluster: str, priority: Priority, request_id: str) -> GpusRequested:
    return GpusRequested(
        t=1.0, pipeline=pipeline, cluster=cluster, priority=priority, request_id=request_id
    )


def test_a_released_request_is_remembered_as_withdrawn_until_the_cluster_asks_again() -> None:
    arbiter = make_arbiter(2)
    register(arbiter, "holder", train=gpus(2))
    register(arbiter, "p", generation=gpus(2))
    arbiter.step(ask("holder", "train", Priority.ACTOR_TRAINING, "h-1"))
    arbiter.step(ask("p", "gen", Priority.GENERATION, "r-1"))
    gen = arbiter.state.pipelines["p"].clusters["gen"]
    assert gen.request is not None and gen.request_id == "r-1" and gen.request_ended is None

    arbiter.step(GpusReleased(t=2.0, pipeline="p", cluster="gen"))
    gen = arbiter.state.pipelines["p"].clusters["gen"]
    assert gen.request is None and gen.request_id == "r-1"
    assert gen.request_ended is not None and "withdrawn (released)" in gen.request_ended
    # The state, as a snapshot holds it, keeps it.
    assert decode(encode(arbiter.state)) == arbiter.state

    arbiter.step(ask("p", "gen", Priority.GENERATION, "r-2"))
    gen = arbiter.state.pipelines["p"].clusters["gen"]
    assert gen.request is not None and gen.request_id == "r-2" and gen.request_ended is None


def test_a_request_that_failed_says_why() -> None:
    arbiter = make_arbiter(2)
    register(arbiter, "holder", train=["1"])
    register(arbiter, "p", train=gpus(2))
    arbiter.step(ask("holder", "train", Priority.ACTOR_TRAINING, "h-1"))
    arbiter.step(ask("p", "train", Priority.ACTOR_TRAINING, "r-1"))
    arbiter.step(GpuLost(t=3.0, gpu_id="0", error="fell off the bus"))
    train = arbiter.state.pipelines["p"].clusters["train"]
    assert train.request is None and train.request_id == "r-1"
    assert train.request_ended is not None and "failed: GPU 0 lost" in train.request_ended


def test_release_then_request_names_the_new_request_and_withdraws_the_released_one() -> None:
    arbiter = make_arbiter(2)
    register(arbiter, "holder", train=gpus(2))
    register(arbiter, "p", train=gpus(2), generation=gpus(2))
    arbiter.step(ask("holder", "train", Priority.ACTOR_TRAINING, "h-1"))
    arbiter.step(ask("p", "gen", Priority.GENERATION, "g-1"))
    arbiter.step(
        GpusReleasedAndRequested(
            t=2.0,
            pipeline="p",
            release_cluster="gen",
            cluster="train",
            priority=Priority.ACTOR_TRAINING,
            request_id="t-1",
        )
    )
    clusters = arbiter.state.pipelines["p"].clusters
    assert clusters["gen"].request is None and clusters["gen"].request_ended is not None
    assert clusters["train"].request is not None and clusters["train"].request_id == "t-1"
    assert clusters["train"].request_ended is None
