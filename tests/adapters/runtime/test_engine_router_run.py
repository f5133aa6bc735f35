"""An engine pool's router and load source under ``deo run``: requests go through the router to
active engines, verl's figures appear in /global-status and /metrics, and a scale-down under load
answers every request once, the engine put to sleep as soon as its last request finished."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families
from waiting import wait_for

from bench.ports import reserve_port
from tests.adapters.runtime.test_engines_run import Deo, deo

__all__ = ["deo"]  # the fixture, used by name

BODY = {"model": "standin-model", "prompt": "x", "max_tokens": 20}


def figures(run: Deo) -> dict[str, Any]:
    engines: dict[str, Any] = httpx.get(f"{run.url}/global-status", timeout=30).json()["pools"][
        "gen"
    ]["engines"]
    return engines


def test_router_serves_active_engines_and_a_scale_down_under_load_loses_nothing(
    deo: Callable[..., Deo],
) -> None:
    router_port = reserve_port()
    # A long drain timeout: the drain must end because nothing is in flight, not at a timeout.
    run = deo(router_port=router_port, drain_timeout_s=60.0).start()
    run.wait_states({"gen-0": "active", "gen-1": "active"})
    router = f"http://127.0.0.1:{router_port}"
    wait_for(
        "the router",
        lambda: httpx.get(f"{router}/health", timeout=10).status_code == 200,
        retry_on=(httpx.HTTPError,),
    )
    # The second request is sent while the first is in flight: it goes to the other engine.
    with httpx.Client(timeout=60) as http:
        long = {**BODY, "max_tokens": 400, "stream": True}
        with http.stream("POST", f"{router}/v1/completions", json=long) as first:
            assert first.status_code == 200
            second = http.post(f"{router}/v1/completions", json=BODY)
            assert second.status_code == 200, second.text
            served = {first.headers["x-deo-engine"], second.headers["x-deo-engine"]}
    assert served == {"gen-0", "gen-1"}
    wait_for(
        "a load sample",
        lambda: figures(run)["load_ratio"] is not None,
        retry_on=(httpx.HTTPError,),
    )
    shown = figures(run)
    assert (shown["active"], shown["draining"], shown["inactive"], shown["starting"]) == (
        2,
        0,
        0,
        0,
    )
    assert shown["total_capacity"] == 2 * shown["capacity_per_engine"]
    metrics = httpx.get(f"{run.url}/metrics", timeout=30).text
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(metrics)
        for s in family.samples
    }
    assert samples[("deo_engine_pool_engines", (("pool", "gen"), ("state", "active")))] == 2.0

    answers: list[tuple[int, str, str]] = []
    errors: list[str] = []
    stop = threading.Event()

    def client() -> None:
        with httpx.Client(timeout=60) as http:
            while not stop.is_set():
                try:
                    reply = http.post(f"{router}/v1/completions", json=BODY)
                    finish = reply.json()["choices"][0]["finish_reason"]
                    answers.append((reply.status_code, finish, reply.json()["id"]))
                except Exception as exc:
                    errors.append(repr(exc))

    clients = [threading.Thread(target=client) for _ in range(6)]
    for thread in clients:
        thread.start()
    try:
        wait_for("load on both engines", lambda: len(answers) > 20)
        run.post("/v1/pools/gen/pin", {"count": 1})
        run.wait_states({"gen-0": "active", "gen-1": "sleeping"})
        after = len(answers)
        wait_for("more answers after the sleep", lambda: len(answers) > after + 20)
    finally:
        stop.set()
        for thread in clients:
            thread.join(timeout=60)
    assert errors == []
    assert {status for status, _, _ in answers} == {200}
    assert {finish for _, finish, _ in answers} == {"length"}  # none aborted by the sleep
    assert len({ident for _, _, ident in answers}) == len(answers)
    # The sleep call went once the engine reported nothing in flight, long before the timeout.
    sleep = next(c for c in run.commands("SleepEngine") if c["worker_id"] == "gen-1")
    assert "nothing in flight" in sleep["reason"] or "in flight" in sleep["reason"], sleep
    assert "after it left routing" not in sleep["reason"], sleep
    idle = [e for e in run.events("EngineLoadSampled") if e["worker_id"] == "gen-1"]
    assert idle and idle[-1]["in_flight_requests"] == 0
    shown = figures(run)
    assert (shown["active"], shown["inactive"]) == (1, 1)


class LoadEndpoint:
    """A JSON endpoint serving a fixed in-flight count: a pool source of the pool's own."""

    def __init__(self) -> None:
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = json.dumps({"in_flight": 10}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/load"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_a_pool_with_its_own_source_still_ends_drains_at_zero_in_flight(
    deo: Callable[..., Deo],
) -> None:
    router_port = reserve_port()
    load = LoadEndpoint()
    source = (
        f'[pools.gen.source]\nkind = "json"\nurl = "{load.url}"\nin_flight_requests = "in_flight"\n'
    )
    try:
        # The drain timeout outlasts the test's wait: only a count of 0 can end the drain.
        # 10 in flight over 2 x 8: a ratio of 0.62, inside verl's band: the pin alone scales.
        policy = 'name = "threshold"\ncapacity_per_worker = 8'
        run = deo(
            router_port=router_port,
            drain_timeout_s=300.0,
            min_workers=1,
            tables=source,
            policy=policy,
        ).start()
        run.wait_states({"gen-0": "active", "gen-1": "active"})
        router = f"http://127.0.0.1:{router_port}"
        wait_for(
            "the router",
            lambda: httpx.get(f"{router}/health", timeout=10).status_code == 200,
            retry_on=(httpx.HTTPError,),
        )
        answers: list[tuple[int, str]] = []
        errors: list[str] = []
        stop = threading.Event()

        def client() -> None:
            with httpx.Client(timeout=60) as http:
                while not stop.is_set():
                    try:
                        reply = http.post(f"{router}/v1/completions", json=BODY)
                        answers.append(
                            (reply.status_code, reply.json()["choices"][0]["finish_reason"])
                        )
                    except Exception as exc:
                        errors.append(repr(exc))

        clients = [threading.Thread(target=client) for _ in range(4)]
        for thread in clients:
            thread.start()
        try:
            wait_for("load on both engines", lambda: len(answers) > 10)
            run.post("/v1/pools/gen/pin", {"count": 1})
            run.wait_states({"gen-0": "active", "gen-1": "sleeping"})
        finally:
            stop.set()
            for thread in clients:
                thread.join(timeout=60)
    finally:
        load.close()
    assert errors == []
    assert set(answers) == {(200, "length")}  # none aborted by the sleep
    sleep = next(c for c in run.commands("SleepEngine") if c["worker_id"] == "gen-1")
    assert "after it left routing" not in sleep["reason"], sleep
    # The pool's load came from its source, not from the engines.
    assert {e["in_flight_requests"] for e in run.events("LoadSampled")} == {10}


def test_a_router_port_in_use_stops_deo_at_start_naming_the_pool(
    deo: Callable[..., Deo], tmp_path: Path
) -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        run = deo(router_port=port)
        done = subprocess.run(
            [sys.executable, "-m", "adapters.cli", "run", "--config", str(tmp_path / "deo.toml")],
            cwd=tmp_path,
            env={**os.environ, "DEO_TOKEN": "token"},
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"pools.gen.router_port {port}: Address already in use" in done.stdout + done.stderr
    assert run.proc is None  # nothing was started
