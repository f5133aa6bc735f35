"""The Atropos source against a real atroposlib API server (odd answers via a mock transport)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from conftest import AtroposApi, free_port

from adapters.runtime.config_file import load
from adapters.sources.atropos import AtroposSource, poll_atropos, sample_atropos
from core import ConfigError, Event, QueueSampled, SourceDown


def post_groups(api: AtroposApi, count: int, group_size: int, env_id: int = 0) -> None:
    for _ in range(count):
        body: dict[str, Any] = {
            "tokens": [[1, 2, 3]] * group_size,
            "masks": [[1, 1, 1]] * group_size,
            "scores": [1.0] * group_size,
            "env_id": env_id,
        }
        httpx.post(api.url + "/scored_data", json=body).raise_for_status()


def register_env(api: AtroposApi, group_size: int) -> int:
    body = {"max_token_length": 64, "desired_name": "t", "weight": 1.0, "group_size": group_size}
    answer = httpx.post(api.url + "/register-env", json=body).raise_for_status().json()
    env_id: int = answer["env_id"]
    return env_id


async def sample(source: AtroposSource, transport: httpx.AsyncBaseTransport | None = None) -> Event:
    async with httpx.AsyncClient(base_url=source.url, transport=transport, timeout=2) as client:
        return await sample_atropos(client, source, lambda: 5.0)


def test_no_trainer_registered_is_a_source_down_that_says_so(atropos_api: AtroposApi) -> None:
    event = anyio.run(sample, AtroposSource(pool="envs", url=atropos_api.url, group_size=8))
    assert isinstance(event, SourceDown)
    assert event.pool == "envs" and event.t == 5.0
    assert "no trainer registered yet" in event.error and "batch_size -1" in event.error


def test_groups_are_converted_to_sequences_and_steps_read(atropos_api: AtroposApi) -> None:
    source = AtroposSource(pool="envs", url=atropos_api.url, group_size=8)
    atropos_api.register_trainer(batch_size_seqs=32)
    env_id = register_env(atropos_api, group_size=8)
    post_groups(atropos_api, 5, group_size=8, env_id=env_id)
    event = anyio.run(sample, source)
    # 5 groups x 8 sequences, a 32-sequence batch, no step taken yet (the first pull was empty)
    assert event == QueueSampled(
        t=5.0, pool="envs", queued_sequences=40, batch_size_seqs=32, trainer_step=0
    )
    batch = httpx.get(atropos_api.url + "/batch").json()["batch"]
    assert sum(len(group["tokens"]) for group in batch) == 32
    event = anyio.run(sample, source)
    # the trainer took 4 groups: one left, and the step advanced
    assert event == QueueSampled(
        t=5.0, pool="envs", queued_sequences=8, batch_size_seqs=32, trainer_step=1
    )


def test_unreachable_server_is_a_source_down() -> None:
    source = AtroposSource(pool="envs", url=f"http://127.0.0.1:{free_port()}", group_size=8)
    event = anyio.run(sample, source)
    assert isinstance(event, SourceDown)
    assert event.error.startswith(source.url)


@pytest.mark.parametrize(
    ("path", "status", "body", "expected"),
    [
        ("/info", 500, {"detail": "boom"}, "500"),
        ("/status", 200, {"current_step": "7", "queue_size": 1}, "current_step"),
        ("/status", 200, {"current_step": 1}, "queue_size"),
        ("/info", 200, [1, 2], "batch_size"),
        ("/status", 200, {"current_step": -1, "queue_size": 0}, "trainer_step"),
    ],
)
def test_odd_answers_are_a_source_down_naming_what_was_wrong(
    path: str, status: int, body: Any, expected: str
) -> None:
    answers = {
        "/info": (200, {"batch_size": 32, "max_token_len": 64}),
        "/status": (200, {"current_step": 3, "queue_size": 2}),
        path: (status, body),
    }

    def handler(request: httpx.Request) -> httpx.Response:
        code, payload = answers[request.url.path]
        return httpx.Response(code, json=payload)

    source = AtroposSource(pool="envs", url="http://atropos.test", group_size=8)
    event = anyio.run(sample, source, httpx.MockTransport(handler))
    assert isinstance(event, SourceDown)
    assert expected in event.error


def test_non_json_answer_is_a_source_down() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, text="<html>proxy error</html>")

    source = AtroposSource(pool="envs", url="http://atropos.test", group_size=8)
    event = anyio.run(sample, source, httpx.MockTransport(handler))
    assert isinstance(event, SourceDown)


def test_poller_samples_on_its_interval(atropos_api: AtroposApi) -> None:
    atropos_api.register_trainer(batch_size_seqs=16)
    source = AtroposSource(pool="envs", url=atropos_api.url, group_size=4, interval_s=0.05)
    events: list[Event] = []

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(poll_atropos, source, events.append, lambda: 1.0)
            with anyio.fail_after(30):
                while len(events) < 3:
                    await anyio.sleep(0.01)
            tg.cancel_scope.cancel()

    anyio.run(main)
    assert all(isinstance(e, QueueSampled) and e.batch_size_seqs == 16 for e in events)


def write_config(tmp_path: Path, source: str, policy: str = 'name = "buffer"') -> Path:
    path = tmp_path / "deo.toml"
    path.write_text(
        f"""
[pools.envs]
argv = ["python3", "env.py"]
max_workers = 4
[pools.envs.policy]
{policy}
[pools.envs.source]
{source}
"""
    )
    return path


def test_config_reads_an_atropos_source(tmp_path: Path) -> None:
    settings = load(write_config(tmp_path, 'kind = "atropos"\ngroup_size = 16\ninterval_s = 1'))
    assert settings.sources == (
        AtroposSource(pool="envs", url="http://127.0.0.1:8000", group_size=16, interval_s=1.0),
    )


@pytest.mark.parametrize(
    ("source", "policy", "message"),
    [
        ('kind = "atropos"', 'name = "buffer"', "group_size"),
        ('kind = "atropos"\ngroup_size = 0', 'name = "buffer"', "group_size must be >= 1"),
        ('kind = "atropos"\ngroup_size = 8\nurl = "ftp://x"', 'name = "buffer"', "source.url"),
        ('kind = "atropos"\ngroup_size = 8\nqueued = "x"', 'name = "buffer"', "source.queued"),
        ('kind = "kafka"', 'name = "buffer"', "unknown kind 'kafka'"),
        (
            'kind = "atropos"\ngroup_size = 8',
            'name = "hpa"',
            "its policy 'hpa' reads in_flight_requests; this source gives a trainer queue "
            "(the policies that read it: 'buffer')",
        ),
    ],
)
def test_config_errors_name_the_key(tmp_path: Path, source: str, policy: str, message: str) -> None:
    with pytest.raises(ConfigError, match=r"pools\.envs") as info:
        load(write_config(tmp_path, source, policy))
    assert message in str(info.value)
