"""The operator's command line against a real ``deo run``: ``deo status``, ``stop`` and the
actions (pause, resume, pin, unpin, drain, cordon, uncordon), found through ``--config``."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import free_port
from test_run import WELL_BEHAVED, Deo, alive, deo, pool, verified
from waiting import wait_for

__all__ = ["deo"]  # the fixture, shared with test_run

TOKEN_ENV = "DEO_CLI_TEST_TOKEN"


def cli(*args: Any, token: str | None, cwd: Path) -> subprocess.CompletedProcess[str]:
    """``deo ARGS`` as the operator types it, with the operator token in $DEO_CLI_TEST_TOKEN."""
    env = {k: v for k, v in os.environ.items() if k not in (TOKEN_ENV, "DEO_TOKEN")}
    if token is not None:
        env[TOKEN_ENV] = token
    return subprocess.run(
        [sys.executable, "-m", "adapters.cli", *map(str, args)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def with_api(d: Deo, *, deo_table: str = "", extra: str = "") -> None:
    """Give ``d`` a fixed port and its own token variable (unset: deo run makes a token)."""
    text = d.config.read_text()
    text = text.replace(
        "[api]\nport = 0\n", f'[api]\nport = {free_port()}\ntoken_env = "{TOKEN_ENV}"\n'
    )
    d.config.write_text(text.replace("[deo]\n", f"[deo]\n{deo_table}", 1) + extra)


def written_token(d: Deo) -> str:
    """The operator token deo run generated: only in the file it names, never on its output."""
    found = re.search(
        rf"no \${TOKEN_ENV}; operator token written to (\S+) \(mode 0600\)", d.output()
    )
    assert found is not None, d.output()
    token = Path(found.group(1)).read_text().strip()
    assert token and token not in d.output()
    return token


def test_actions_reach_deo_through_its_config_file(deo: Callable[[str], Deo]) -> None:
    d = deo(
        pool(
            "envs",
            [sys.executable, str(WELL_BEHAVED), "0.2"],
            min_workers=0,
            max_workers=3,
            policy='name = "static"\ncount = 1',
        )
    )
    with_api(d, deo_table='gpus = ["0"]\n', extra='[nvml]\nbackend = "off"\n')
    d.start()
    token = written_token(d)
    wait_for("one worker", lambda: len(d.workers("active")) == 1)

    def run(*args: Any, token: str | None = token) -> subprocess.CompletedProcess[str]:
        return cli(*args, "--config", d.config, token=token, cwd=d.dir)

    shown = run("status")
    assert shown.returncode == 0, shown.stderr
    assert re.search(r"^envs\s+1\s+1\s+1 active$", shown.stdout, re.M), shown.stdout
    pushed = httpx.post(
        f"{d.url}/v1/pools/envs/pressure",
        json={"in_flight_requests": 5},
        headers={"Authorization": f"Bearer {token}"},
        timeout=30,
    )
    assert pushed.status_code == 200, pushed.text
    shown = run("status")
    assert re.search(r"^\s+5 requests in flight \(\d+s old\)$", shown.stdout, re.M), shown.stdout

    pinned = run("pin", "envs", "3")
    assert pinned.returncode == 0, pinned.stderr
    assert pinned.stdout.splitlines()[:2] == [
        "deo pin: pool envs pinned at 3 worker(s)",
        "  ScalePool: operator pinned envs at 3 workers",
    ]
    assert "  SpawnWorker: envs has 1 workers, target 3: starting envs-" in pinned.stdout
    wait_for("three workers", lambda: len(d.workers("active")) == 3)

    outside = run("pin", "envs", "9")
    assert outside.returncode == 1
    assert "deo pin: refused (409): " in outside.stderr
    assert "outside pool 'envs' bounds [0, 3]" in outside.stderr

    victim = d.workers("active")[0]
    drained = run("drain", victim["id"])
    assert drained.returncode == 0, drained.stderr
    assert drained.stdout.startswith(f"deo drain: draining worker {victim['id']}\n")
    wait_for("the drained worker to exit", lambda: not alive(victim["pid"]))

    assert run("unpin", "envs").returncode == 0
    assert d.status()["pools"]["envs"]["pinned"] is None

    paused = run("pause", "envs")
    assert paused.returncode == 0, paused.stderr
    assert paused.stdout == "deo pause: autoscaling paused for pool envs\n"
    assert d.status()["pools"]["envs"]["paused"] is True
    assert run("resume").stdout == "deo resume: autoscaling resumed for every pool\n"
    assert d.status()["pools"]["envs"]["paused"] is False

    cordoned = run("cordon", "0")
    assert cordoned.returncode == 0, cordoned.stderr
    assert cordoned.stdout.startswith("deo cordon: GPU 0 cordoned\n")
    assert d.status()["gpus"][0]["causes"] == ["operator"]
    again = run("cordon", "0")
    assert again.stdout == (
        "deo cordon: GPU 0 was already cordoned by an operator: nothing changed\n"
    )
    uncordoned = run("uncordon", "0")
    assert uncordoned.returncode == 0, uncordoned.stderr
    assert uncordoned.stdout.startswith("deo uncordon: GPU 0 uncordoned\n")
    assert d.status()["gpus"][0]["causes"] == []
    again = run("uncordon", "0")
    assert again.returncode == 0, again.stderr
    assert again.stdout == "deo uncordon: GPU 0 was not cordoned: nothing changed\n"

    unknown = run("cordon", "7")
    assert unknown.returncode == 1
    assert "deo cordon: refused (404): " in unknown.stderr and "'7'" in unknown.stderr

    # Without the variable, the file's deo.log says where deo run wrote the token it generated.
    from_file = run("pause", token=None)
    assert from_file.returncode == 0, from_file.stderr
    assert d.status()["paused_all"] is True
    assert run("resume", token=None).returncode == 0
    no_token = cli("pause", "--url", d.url, "--token-env", TOKEN_ENV, token=None, cwd=d.dir)
    assert no_token.returncode == 2
    assert f"set ${TOKEN_ENV} to the operator token" in no_token.stderr
    wrong_token = run("pause", token="not-the-token")
    assert wrong_token.returncode == 1 and "403" in wrong_token.stderr
    assert d.status()["paused_all"] is False  # neither reached the core

    stopped = run("stop")
    assert stopped.returncode == 0, stopped.stderr
    assert d.process is not None
    d.process.wait(timeout=60)
    gone = run("status")
    assert gone.returncode == 2
    assert "is deo running there?" in gone.stderr
    verified(d)


def test_status_shows_how_old_the_pressure_is_during_a_source_outage(
    deo: Callable[[str], Deo], tmp_path: Path
) -> None:
    served = tmp_path / "served"
    served.mkdir()
    (served / "trainer.json").write_text(json.dumps({"q": 32, "b": 64, "s": 5}))
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "http.server", "--bind", "127.0.0.1", str(port)],
        cwd=served,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        source = (
            "[pools.envs.source]\n"
            f'url = "http://127.0.0.1:{port}/trainer.json"\ninterval_s = 0.2\n'
            'queued_sequences = "q"\nbatch_size_seqs = "b"\ntrainer_step = "s"\n'
        )
        d = deo(
            pool(
                "envs",
                [sys.executable, str(WELL_BEHAVED), "0.2"],
                min_workers=1,
                max_workers=1,
                policy='name = "buffer"',
            )
            + source
        )
        with_api(d)
        d.start()
        wait_for("a queue sample", lambda: d.status()["pools"]["envs"]["queue"] is not None)
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=30)
        wait_for("the outage", lambda: d.status()["pools"]["envs"]["source_error"])

        def outage_shown_with_age() -> str | None:
            shown = cli("status", "--config", d.config, token=None, cwd=d.dir)
            assert shown.returncode == 0, shown.stderr
            # deo's clock moves on with its ticks: wait until the sample is visibly old
            old = re.search(r"trainer step 5 \(([1-9]\d*)s old\)", shown.stdout)
            return shown.stdout if old else None

        out = wait_for("the sample's age", outage_shown_with_age)
        assert "queue 0.50 batches of 64 sequences" in out
        assert re.search(r"^ +drain deadline \d+s: ", out, re.M), out
        found = re.search(r"pressure source down \(last sample (\d+)s ago\): (.+)$", out, re.M)
        assert found is not None, out
        assert f"127.0.0.1:{port}" in found.group(2)
        verified(d)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(timeout=30)


def test_a_config_with_a_free_port_asks_for_the_url(tmp_path: Path) -> None:
    config = tmp_path / "deo.toml"
    config.write_text('[api]\nport = 0\n[pools.envs]\nargv = ["true"]\n')
    shown = cli("status", "--config", config, token=None, cwd=tmp_path)
    assert shown.returncode == 2
    assert "api.port = 0" in shown.stderr and "give --url" in shown.stderr


@pytest.mark.parametrize("args", [["status"], ["pin", "envs", "2"]])
def test_a_bad_config_file_is_named(tmp_path: Path, args: list[str]) -> None:
    config = tmp_path / "deo.toml"
    config.write_text("[api]\nprot = 8787\n")
    shown = cli(*args, "--config", config, token="t", cwd=tmp_path)
    assert shown.returncode == 2
    assert f"{config}: api.prot: unknown key (did you mean port?)" in shown.stderr
