"""What deo's engine router costs and whether scaling down under load loses a request.

    python -m bench.router [--requests N] [--concurrency C]

Everything runs on this machine against stand-in engines (``deo_worker.engine_standin``, real
processes answering one token at once), so the numbers are the router's own cost, not a model's:

1. latency: N sequential one-token completions straight to one engine, then the same through
   the router (a separate process, as in ``deo run``); p50 and p99 of each and their difference;
2. throughput: N completions from C concurrent clients through the router to two engines, and
   the same straight to one engine, in requests per second;
3. scale-down under load: C clients send completions through a router over three engines; one
   engine is set draining mid-load (no longer routable), is stopped once the router counts none
   of its requests in flight, and the load goes on. Every request must be answered exactly once
   (200, a complete completion, its id not seen before), and the engines' own counts of finished
   requests must add up to the number sent.

The client is Python (httpx) on the same cores, so requests/s is a floor for the router, bounded
by the client as much as by the router; the latency difference is the router's added cost.
"""

from __future__ import annotations

import argparse
import collections
import os
import shlex
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import anyio
import httpx

from adapters.router import EngineEndpoint, EngineRouter, serve_router

REPO = Path(__file__).resolve().parents[1]
ONE_TOKEN = {"model": "standin-model", "prompt": "x", "max_tokens": 1}


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


class _Process:
    def __init__(self, argv: list[str], url: str) -> None:
        self.url = url
        self.proc = subprocess.Popen(argv, env=_env(), cwd=REPO)
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{shlex.join(argv)} did not become healthy")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout=30)


def _standin(tokens_per_s: float = 10_000, max_concurrency: int = 512) -> _Process:
    port = _free_port()
    argv = [sys.executable, "-m", "deo_worker.engine_standin", "--port", str(port)]
    argv += ["--engine", "vllm", "--memory-mib", "1", "--tokens-per-s", str(tokens_per_s)]
    argv += ["--max-concurrency", str(max_concurrency)]
    return _Process(argv, f"http://127.0.0.1:{port}")


def _router_process(engines: Sequence[_Process]) -> _Process:
    port = _free_port()
    argv = [sys.executable, "-m", "bench.router", "--serve-router", str(port)]
    argv += [engine.url for engine in engines]
    return _Process(argv, f"http://127.0.0.1:{port}")


def _static(urls: Sequence[str]) -> list[EngineEndpoint]:
    return [
        EngineEndpoint(worker_id=f"e{index}", base_url=url, routable=True)
        for index, url in enumerate(urls)
    ]


async def _serve_static(port: int, urls: Sequence[str]) -> None:
    endpoints = _static(urls)
    await serve_router(EngineRouter("bench", lambda: endpoints), port=port)


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _latencies_ms(url: str, requests: int) -> list[float]:
    with httpx.Client(base_url=url, timeout=60) as client:
        for _ in range(50):  # warm the connections and both servers
            client.post("/v1/completions", json=ONE_TOKEN).raise_for_status()
        samples = []
        for _ in range(requests):
            start = time.perf_counter()
            client.post("/v1/completions", json=ONE_TOKEN).raise_for_status()
            samples.append((time.perf_counter() - start) * 1000)
        return samples


async def _throughput(url: str, requests: int, concurrency: int) -> float:
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:
        left = requests

        async def worker() -> None:
            nonlocal left
            while left > 0:
                left -= 1
                (await client.post("/v1/completions", json=ONE_TOKEN)).raise_for_status()

        start = time.perf_counter()
        async with anyio.create_task_group() as tasks:
            for _ in range(concurrency):
                tasks.start_soon(worker)
        return requests / (time.perf_counter() - start)


async def _scale_down(concurrency: int, duration_s: float) -> dict[str, object]:
    engines = [_standin(tokens_per_s=200) for _ in range(3)]
    endpoints = _static([engine.url for engine in engines])
    router = EngineRouter("bench", lambda: endpoints)
    sent = 0
    answers: collections.Counter[str] = collections.Counter()
    problems: list[str] = []
    served: collections.Counter[str] = collections.Counter()
    after_drain: collections.Counter[str] = collections.Counter()
    draining = False
    finished_at_stop = 0.0
    try:
        async with anyio.create_task_group() as tasks:
            ports: list[int] = []
            tasks.start_soon(lambda: serve_router(router, started=ports.append))
            while not ports:
                await anyio.sleep(0.01)
            limits = httpx.Limits(max_connections=concurrency)
            client = httpx.AsyncClient(
                base_url=f"http://127.0.0.1:{ports[0]}", timeout=60, limits=limits
            )
            end = time.monotonic() + duration_s

            async def worker() -> None:
                nonlocal sent
                while time.monotonic() < end:
                    sent += 1
                    sent_while_draining = draining
                    body = {**ONE_TOKEN, "max_tokens": 20}
                    try:
                        reply = await client.post("/v1/completions", json=body)
                        answer = reply.json()
                        if reply.status_code != 200 or answer["choices"][0]["finish_reason"] != (
                            "length"
                        ):
                            problems.append(f"{reply.status_code} {reply.text[:120]}")
                            continue
                        answers[answer["id"]] += 1
                        engine = reply.headers["x-deo-engine"]
                        served[engine] += 1
                        if sent_while_draining:
                            after_drain[engine] += 1
                    except Exception as exc:
                        problems.append(repr(exc))

            async def scale_down() -> None:
                nonlocal endpoints, draining, finished_at_stop
                await anyio.sleep(duration_s / 3)
                endpoints = [
                    EngineEndpoint(worker_id=e.worker_id, base_url=e.base_url, routable=False)
                    if e.worker_id == "e2"
                    else e
                    for e in endpoints
                ]
                draining = True
                drain_start = time.monotonic()
                while router.in_flight_of("e2"):
                    await anyio.sleep(0.01)
                drained_s = time.monotonic() - drain_start
                finished_at_stop = _finished(engines[2].url)
                engines[2].stop()
                print(f"  e2 drained in {drained_s * 1000:.0f} ms, then stopped")

            async with anyio.create_task_group() as load:
                for _ in range(concurrency):
                    load.start_soon(worker)
                load.start_soon(scale_down)
            await client.aclose()
            tasks.cancel_scope.cancel()
        engine_finished = finished_at_stop + sum(_finished(e.url) for e in engines[:2])
    finally:
        for engine in engines:
            engine.stop()
    return {
        "sent": sent,
        "answered": sum(answers.values()),
        "answered twice": sum(1 for count in answers.values() if count > 1),
        "failed": len(problems),
        "finished at the engines": int(engine_finished),
        "served per engine": dict(sorted(served.items())),
        "served, of those sent after the drain began": dict(sorted(after_drain.items())),
        "first problems": problems[:3],
    }


def _finished(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith("vllm:request_success_total{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.router", description=__doc__)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--scale-down-s", type=float, default=9.0)
    parser.add_argument(
        "--serve-router", nargs="+", metavar=("PORT", "URL"), help=argparse.SUPPRESS
    )
    args = parser.parse_args(argv)
    if args.serve_router:
        port, *urls = args.serve_router
        anyio.run(_serve_static, int(port), urls)
        return 0
    print("command: python -m bench.router " + shlex.join((argv or sys.argv)[1:]))
    print(f"cpus: {os.cpu_count()}, python {sys.version.split()[0]}")

    one = _standin()
    two = _standin()
    router = _router_process([one, two])
    try:
        direct = _latencies_ms(one.url, args.requests)
        routed = _latencies_ms(router.url, args.requests)
        direct_again = _latencies_ms(one.url, args.requests)
        direct += direct_again
        print(f"latency, {args.requests} sequential one-token completions (ms):")
        for name, values in (("direct", direct), ("router", routed)):
            print(
                f"  {name:7s} p50 {statistics.median(values):6.2f}  p99 "
                f"{_percentile(values, 0.99):6.2f}"
            )
        added_p50 = statistics.median(routed) - statistics.median(direct)
        added_p99 = _percentile(routed, 0.99) - _percentile(direct, 0.99)
        print(f"  added   p50 {added_p50:6.2f}  p99 {added_p99:6.2f}")
        direct_rps = anyio.run(_throughput, one.url, args.requests, args.concurrency)
        routed_rps = anyio.run(_throughput, router.url, args.requests, args.concurrency)
        print(f"throughput, {args.requests} one-token completions, {args.concurrency} clients:")
        print(f"  direct to one engine   {direct_rps:7.0f} requests/s")
        print(f"  router over two        {routed_rps:7.0f} requests/s")
    finally:
        for process in (router, one, two):
            process.stop()

    print(f"scale-down under load: {args.concurrency} clients, 3 engines, one drained and stopped")
    result = anyio.run(_scale_down, args.concurrency, args.scale_down_s)
    for key, value in result.items():
        print(f"  {key}: {value}")
    ok = (
        result["sent"] == result["answered"] == result["finished at the engines"]
        and result["answered twice"] == 0
        and result["failed"] == 0
    )
    print("  every request answered exactly once: " + ("yes" if ok else "NO"))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
