"""A stand-in for a vLLM or SGLang server, for tests and benchmarks: no model, and no GPU unless
asked to hold its memory on one (``--memory-on gpu``).

    python -m deo_worker.engine_standin --port P --engine vllm|sglang [--memory-mib M]
        [--memory-on host|gpu] [--tokens-per-s R] [--max-concurrency C] [--startup-s S]
        [--model NAME] [--control-delay-s D]

It is *not* an inference engine: it answers the HTTP routes deo and its router use with the
shapes and behaviours of the real servers (see docs/engines.md), generating placeholder tokens at
``--tokens-per-s`` per request, at most ``--max-concurrency`` requests at once (the rest wait,
counted as waiting). What it serves:

- ``GET /health``, ``GET /v1/models``, ``POST /v1/completions`` and ``POST
  /v1/chat/completions`` (``"stream": true`` answers Server-Sent Events ending in ``data:
  [DONE]``), ``GET /metrics`` (Prometheus text, the engine's own metric names);
- vLLM: ``POST /sleep?level=0|1|2[&mode=abort|wait|keep]``, ``POST /wake_up``, ``GET
  /is_sleeping``, ``POST /reset_prefix_cache``;
- SGLang: ``POST /release_memory_occupation``, ``POST /resume_memory_occupation``, ``POST
  /pause_generation``, ``POST /continue_generation``, ``POST /flush_cache``.

It holds ``--memory-mib`` of touched anonymous memory (standing in for the GPU memory an engine
holds: visible in the process's RSS) that sleeping or releasing frees and waking takes back, so a
test can see a sleep free memory. With ``--memory-on gpu`` that memory is on the first CUDA device
it may use (``CUDA_VISIBLE_DEVICES``), through PyTorch, so NVML sees a sleep free it as it sees a
real engine's (the CUDA context itself stays, as it does in a sleeping engine). How it follows the
real servers:

- vLLM: the API server listens only once the engine is up (``--startup-s`` later); ``/health`` is
  200 while alive, asleep or not. Level 1 and 2 free the memory, level 0 only pauses. ``mode``
  abort (the default) ends in-flight requests with ``finish_reason: "abort"`` (HTTP 200), wait
  lets them finish first, keep freezes them until wake-up. Requests sent while asleep wait until
  wake-up.
- SGLang: the server listens at once and answers 503 until started. Releasing memory waits until
  no request runs (current releases defer it); generation is not blocked while released, and a
  request then fails with 500 (the real engine's memory is gone). ``/flush_cache`` is 400 while a
  request runs or waits; errors are ``{"error": {"message": ...}}``.

One route exists only here: ``POST /standin/fail_next`` with ``{"count": N, "status": 503}``
makes the next N completion requests fail with that status before any body (to test retries);
with ``"route": "/wake_up"`` (any sleep, wake or flush route) the next N calls of that route fail
instead. ``--control-delay-s`` makes every sleep, wake and flush route answer that much later (a
slow release of a large model). ``POST /standin/slow_control`` with ``{"seconds": S}`` makes every
sleep and wake route do its work and then wait S seconds before it answers (an engine whose answer
is late though the work is done: a caller's timeout must not be taken for a failed call).
Every completion names the stand-in that served it: ``system_fingerprint`` is
``"standin-<port>"`` and the ``x-standin-port`` header carries the port.
"""

from __future__ import annotations

import argparse
import importlib
import json
import mmap
import os
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import anyio
import uvicorn
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

__all__ = ["EngineStandin", "build_app", "main"]

ENGINES = ("vllm", "sglang")
_PAGE_BYTES = mmap.PAGESIZE
_MIB = 1024 * 1024


class _Memory:
    """Anonymous memory that counts in RSS while held: every page is written once."""

    def __init__(self, size_bytes: int) -> None:
        self.size_bytes = size_bytes
        self._buffer: mmap.mmap | None = None

    @property
    def held_bytes(self) -> int:
        return self.size_bytes if self._buffer is not None else 0

    def take(self) -> None:
        if self._buffer is not None or self.size_bytes == 0:
            return
        buffer = mmap.mmap(-1, self.size_bytes)
        # One byte per page makes the kernel back every page, so RSS grows by the whole size.
        buffer[::_PAGE_BYTES] = b"\x01" * len(range(0, self.size_bytes, _PAGE_BYTES))
        self._buffer = buffer

    def release(self) -> None:
        if self._buffer is not None:
            # munmap hands the pages back to the kernel at once (free() might keep them).
            self._buffer.close()
            self._buffer = None


class _GpuMemory:
    """Memory on the GPU, through PyTorch (imported only for ``--memory-on gpu``)."""

    def __init__(self, size_bytes: int) -> None:
        try:
            self._torch = importlib.import_module("torch")
        except ImportError:
            raise ValueError("--memory-on gpu needs PyTorch, which is not installed") from None
        if not self._torch.cuda.is_available():
            raise ValueError("--memory-on gpu: PyTorch sees no CUDA device")
        self.size_bytes = size_bytes
        self._block: Any = None

    @property
    def held_bytes(self) -> int:
        return self.size_bytes if self._block is not None else 0

    def take(self) -> None:
        if self._block is not None or self.size_bytes == 0:
            return
        torch = self._torch
        self._block = torch.ones(self.size_bytes, dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()

    def release(self) -> None:
        if self._block is not None:
            self._block = None
            # Back to the driver, not kept in PyTorch's cache: a sleeping engine's memory is free.
            self._torch.cuda.empty_cache()


class _Aborted(Exception):
    """The request was aborted by a sleep or pause: it ends with finish_reason "abort"."""


class EngineStandin:
    """The stand-in engine's state: memory, gates and the requests running and waiting."""

    def __init__(
        self,
        *,
        engine: str,
        port: int,
        memory_mib: int = 64,
        memory_on: str = "host",
        tokens_per_s: float = 100.0,
        max_concurrency: int = 8,
        startup_s: float = 0.0,
        model: str = "standin-model",
        control_delay_s: float = 0.0,
    ) -> None:
        if engine not in ENGINES:
            raise ValueError(f"--engine must be one of {', '.join(ENGINES)}, got {engine!r}")
        if memory_on not in ("host", "gpu"):
            raise ValueError(f"--memory-on must be host or gpu, got {memory_on!r}")
        if (
            memory_mib < 0
            or not tokens_per_s > 0
            or max_concurrency < 1
            or startup_s < 0
            or control_delay_s < 0
        ):
            raise ValueError(
                "--memory-mib must be >= 0, --tokens-per-s > 0, --max-concurrency >= 1, "
                "--startup-s >= 0 and --control-delay-s >= 0"
            )
        self.engine = engine
        self.port = port
        self.model = model
        self.token_interval_s = 1.0 / tokens_per_s
        self.startup_s = startup_s
        self.memory = (_Memory if memory_on == "host" else _GpuMemory)(memory_mib * _MIB)
        self.started = False
        self.running = 0
        self.waiting = 0
        self.finished: dict[str, int] = {}
        #: vLLM: "awake", or the level it sleeps at; SGLang: "awake" or "released".
        self.sleep_state = "awake"
        self.fail_next: list[int] = []
        #: Failures to answer, per control route (``/wake_up``, ...), in order.
        self.fail_control: dict[str, list[int]] = {}
        #: Seconds each sleep, wake or flush route waits before it does its work.
        self.control_delay_s = control_delay_s
        #: Seconds each sleep or wake route waits, its work done, before it answers.
        self.answer_delay_s = 0.0
        self._slots = anyio.Semaphore(max_concurrency)
        # Requests start while _admit is set and generate while _run is set; closing a gate
        # swaps in an unset event, opening it sets the current one.
        self._admit = anyio.Event()
        self._admit.set()
        self._run = anyio.Event()
        self._run.set()
        # Bumped by every abort: a request that began under an older epoch ends as aborted.
        self._abort_epoch = 0

    # -- start-up -----------------------------------------------------------------------------

    async def start(self) -> None:
        """Load: wait ``startup_s``, take the memory, then serve requests."""
        await anyio.sleep(self.startup_s)
        self.memory.take()
        self.started = True

    # -- gates --------------------------------------------------------------------------------

    def hold_new(self) -> None:
        """New requests wait (counted as waiting) until :meth:`resume`."""
        if self._admit.is_set():
            self._admit = anyio.Event()

    def freeze(self) -> None:
        """New requests wait and running ones stop between tokens until :meth:`resume`."""
        self.hold_new()
        if self._run.is_set():
            self._run = anyio.Event()

    def resume(self) -> None:
        self._admit.set()
        self._run.set()

    def abort_all(self) -> None:
        """End every request in hand (running or waiting) with finish_reason "abort"."""
        self._abort_epoch += 1
        admit_open, run_open = self._admit.is_set(), self._run.is_set()
        # Wake the waiters so that they see the abort, then close the gates that were closed.
        self._admit.set()
        self._run.set()
        if not admit_open:
            self._admit = anyio.Event()
        if not run_open:
            self._run = anyio.Event()

    async def wait_running(self) -> None:
        """Until no request is generating (waiting ones may remain)."""
        while self.running:
            await anyio.sleep(0.01)

    # -- generation ---------------------------------------------------------------------------

    async def generate(self, max_tokens: int) -> AsyncIterator[str]:
        """Yield ``max_tokens`` placeholder tokens; _Aborted if a sleep or pause aborts it."""
        epoch = self._abort_epoch
        self.waiting += 1
        waiting = True
        try:
            async with self._slots:
                while not self._admit.is_set() and epoch == self._abort_epoch:
                    await self._admit.wait()
                if epoch != self._abort_epoch:
                    raise _Aborted
                if self.engine == "sglang" and self.memory.held_bytes < self.memory.size_bytes:
                    raise RuntimeError("memory released: the engine cannot generate")
                self.waiting -= 1
                waiting = False
                self.running += 1
                try:
                    for index in range(max_tokens):
                        await anyio.sleep(self.token_interval_s)
                        while not self._run.is_set() and epoch == self._abort_epoch:
                            await self._run.wait()
                        if epoch != self._abort_epoch:
                            raise _Aborted
                        yield f" t{index}"
                finally:
                    self.running -= 1
        finally:
            if waiting:
                self.waiting -= 1

    def count(self, finish_reason: str) -> None:
        self.finished[finish_reason] = self.finished.get(finish_reason, 0) + 1

    # -- metrics ------------------------------------------------------------------------------

    def collect(self) -> Iterator[Metric]:
        """The engine's gauges under its real names (Prometheus collector protocol)."""
        if self.engine == "vllm":
            labels = ["model_name", "engine"]
            values = [self.model, "0"]
            running = GaugeMetricFamily(
                "vllm:num_requests_running", "Requests in model execution batches", labels=labels
            )
            waiting = GaugeMetricFamily(
                "vllm:num_requests_waiting", "Requests waiting to be processed", labels=labels
            )
            usage = GaugeMetricFamily("vllm:kv_cache_usage_perc", "KV-cache usage", labels=labels)
            sleep = GaugeMetricFamily(
                "vllm:engine_sleep_state", "Engine sleep state", labels=[*labels, "sleep_state"]
            )
            for state in ("awake", "weights_offloaded", "discard_all"):
                current = {"awake": "awake", "1": "weights_offloaded", "2": "discard_all"}.get(
                    self.sleep_state, "awake"
                )
                sleep.add_metric([*values, state], 1.0 if state == current else 0.0)
            success = CounterMetricFamily(
                "vllm:request_success",
                "Finished requests",
                labels=[*labels, "finished_reason"],
            )
            for reason, count in sorted(self.finished.items()):
                success.add_metric([*values, reason], count)
            extra: list[Metric] = [sleep, success]
        else:
            labels = ["model_name", "engine_type", "tp_rank", "pp_rank"]
            values = [self.model, "unified", "0", "0"]
            running = GaugeMetricFamily(
                "sglang:num_running_reqs", "The number of running requests", labels=labels
            )
            waiting = GaugeMetricFamily(
                "sglang:num_queue_reqs",
                "The number of requests in the waiting queue",
                labels=labels,
            )
            usage = GaugeMetricFamily("sglang:token_usage", "The token usage", labels=labels)
            total = GaugeMetricFamily(
                "sglang:max_total_num_tokens", "Maximum total tokens in the KV cache", labels=labels
            )
            total.add_metric(values, 65536.0)
            extra = [total]
        running.add_metric(values, self.running)
        waiting.add_metric(values, self.waiting)
        usage.add_metric(values, min(1.0, self.running / 64))
        held = GaugeMetricFamily("standin_memory_held_bytes", "Memory the stand-in holds")
        held.add_metric([], self.memory.held_bytes)
        yield from (running, waiting, usage, *extra, held)


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "code": status}}, status_code=status)


def _max_tokens(body: dict[str, Any]) -> int:
    value = body.get("max_tokens", body.get("max_completion_tokens", 16))
    if type(value) is not int or value < 0:
        raise ValueError(f"max_tokens must be a non-negative integer, got {value!r}")
    return value


def build_app(standin: EngineStandin) -> Starlette:
    """The stand-in's routes over ``standin``'s state."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(standin)
    fingerprint = f"standin-{standin.port}"
    headers = {"x-standin-port": str(standin.port)}

    def not_started() -> Response | None:
        if standin.started:
            return None
        return _error(503, "the engine is starting")

    async def health(request: Request) -> Response:
        return not_started() or Response(status_code=200)

    async def models(request: Request) -> Response:
        owner = standin.engine
        data = [{"id": standin.model, "object": "model", "created": 0, "owned_by": owner}]
        return JSONResponse({"object": "list", "data": data})

    async def metrics(request: Request) -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    def completion(chat: bool) -> Callable[[Request], Any]:
        kind = "chat.completion" if chat else "text_completion"

        def choice(text: str, finish: str | None, delta: bool) -> dict[str, Any]:
            if not chat:
                return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
            key = "delta" if delta else "message"
            return {
                "index": 0,
                key: {"role": "assistant", "content": text},
                "finish_reason": finish,
            }

        async def endpoint(request: Request) -> Response:
            if (early := not_started()) is not None:
                return early
            try:
                body = json.loads(await request.body())
                if not isinstance(body, dict):
                    raise ValueError("the body must be a JSON object")
                max_tokens = _max_tokens(body)
            except ValueError as exc:
                return _error(400, str(exc))
            if standin.fail_next:
                return _error(standin.fail_next.pop(0), "injected failure")
            ident = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
            base = {"id": ident, "created": int(time.time()), "model": standin.model}
            base["system_fingerprint"] = fingerprint
            if body.get("stream"):
                return StreamingResponse(
                    stream(base, max_tokens),
                    media_type="text/event-stream",
                    headers=headers,
                )
            text = []
            finish = "length"
            try:
                async for token in standin.generate(max_tokens):
                    text.append(token)
            except _Aborted:
                finish = "abort"
            except RuntimeError as exc:
                return _error(500, str(exc))
            standin.count(finish)
            usage = {"prompt_tokens": 1, "completion_tokens": len(text)}
            usage["total_tokens"] = 1 + len(text)
            answer = {**base, "object": kind, "choices": [choice("".join(text), finish, False)]}
            return JSONResponse({**answer, "usage": usage}, headers=headers)

        async def stream(base: dict[str, Any], max_tokens: int) -> AsyncIterator[bytes]:
            chunk_kind = "chat.completion.chunk" if chat else "text_completion"
            finish = "length"
            try:
                async for token in standin.generate(max_tokens):
                    chunk = {**base, "object": chunk_kind, "choices": [choice(token, None, True)]}
                    yield b"data: " + json.dumps(chunk).encode() + b"\n\n"
            except _Aborted:
                finish = "abort"
            except RuntimeError as exc:
                finish = "error"
                message = {"error": {"message": str(exc), "code": 500}}
                yield b"data: " + json.dumps(message).encode() + b"\n\n"
            standin.count(finish)
            last = {**base, "object": chunk_kind, "choices": [choice("", finish, True)]}
            yield b"data: " + json.dumps(last).encode() + b"\n\ndata: [DONE]\n\n"

        return endpoint

    async def fail_next(request: Request) -> Response:
        body = json.loads(await request.body() or b"{}")
        count, status = int(body.get("count", 1)), int(body.get("status", 503))
        route = body.get("route")
        failures = (
            standin.fail_next if route is None else standin.fail_control.setdefault(route, [])
        )
        failures.extend([status] * count)
        return JSONResponse({"fail_next": len(failures)})

    def control(handler: Callable[[Request], Any]) -> Callable[[Request], Any]:
        """A sleep, wake or flush route, late by --control-delay-s and failing when told to."""

        async def route(request: Request) -> Response:
            if standin.control_delay_s:
                await anyio.sleep(standin.control_delay_s)
            failures = standin.fail_control.get(request.url.path)
            if failures:
                return _error(failures.pop(0), "injected failure")
            response: Response = await handler(request)
            return response

        return route

    async def slow_control(request: Request) -> Response:
        body = json.loads(await request.body() or b"{}")
        standin.answer_delay_s = float(body.get("seconds", 0.0))
        return JSONResponse({"answer_delay_s": standin.answer_delay_s})

    async def answered(response: Response) -> Response:
        """``response`` to a sleep or wake call, once the configured delay has passed."""
        if standin.answer_delay_s > 0:
            await anyio.sleep(standin.answer_delay_s)
        return response

    # -- vLLM --------------------------------------------------------------------------------

    async def sleep(request: Request) -> Response:
        level = request.query_params.get("level", "1")
        mode = request.query_params.get("mode", "abort")
        if level not in ("0", "1", "2") or mode not in ("abort", "wait", "keep"):
            return _error(400, f"level must be 0, 1 or 2 and mode abort, wait or keep: {level!r}")
        if mode == "wait":
            # New requests queue behind the sleep; the ones running are let finish first.
            standin.hold_new()
            await standin.wait_running()
        standin.freeze()
        if mode == "abort":
            standin.abort_all()
        if level != "0":
            standin.memory.release()
        standin.sleep_state = level if level != "0" else "paused"
        return await answered(Response(status_code=200))

    async def wake_up(request: Request) -> Response:
        standin.memory.take()
        standin.sleep_state = "awake"
        standin.resume()
        return await answered(Response(status_code=200))

    async def is_sleeping(request: Request) -> Response:
        return JSONResponse({"is_sleeping": standin.sleep_state != "awake"})

    async def reset_prefix_cache(request: Request) -> Response:
        return Response(status_code=200)

    # -- SGLang ------------------------------------------------------------------------------

    async def release_memory(request: Request) -> Response:
        if (early := not_started()) is not None:
            return early
        await standin.wait_running()
        standin.memory.release()
        standin.sleep_state = "released"
        return await answered(JSONResponse(None))

    async def resume_memory(request: Request) -> Response:
        if (early := not_started()) is not None:
            return early
        standin.memory.take()
        standin.sleep_state = "awake"
        return await answered(JSONResponse(None))

    async def pause_generation(request: Request) -> Response:
        body = json.loads(await request.body() or b"{}")
        mode = body.get("mode", "abort") if isinstance(body, dict) else None
        if mode not in ("abort", "retract", "in_place"):
            return _error(400, f"mode must be abort, retract or in_place, got {mode!r}")
        standin.freeze()
        if mode == "abort":
            standin.abort_all()
        return JSONResponse(None)

    async def continue_generation(request: Request) -> Response:
        standin.resume()
        return JSONResponse(None)

    async def flush_cache(request: Request) -> Response:
        if standin.running or standin.waiting:
            return _error(400, "cannot flush the cache while requests are running or waiting")
        return Response("Cache flushed.", status_code=200)

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/v1/completions", completion(chat=False), methods=["POST"]),
        Route("/v1/chat/completions", completion(chat=True), methods=["POST"]),
        Route("/standin/fail_next", fail_next, methods=["POST"]),
        Route("/standin/slow_control", slow_control, methods=["POST"]),
    ]
    if standin.engine == "vllm":
        routes += [
            Route("/sleep", control(sleep), methods=["POST"]),
            Route("/wake_up", control(wake_up), methods=["POST"]),
            Route("/is_sleeping", control(is_sleeping), methods=["GET"]),
            Route("/reset_prefix_cache", control(reset_prefix_cache), methods=["POST"]),
        ]
    else:
        routes += [
            Route("/release_memory_occupation", control(release_memory), methods=["POST"]),
            Route("/resume_memory_occupation", control(resume_memory), methods=["POST"]),
            Route("/pause_generation", control(pause_generation), methods=["POST"]),
            Route("/continue_generation", control(continue_generation), methods=["POST"]),
            Route("/flush_cache", control(flush_cache), methods=["POST"]),
        ]
    return Starlette(routes=routes)


async def _serve(standin: EngineStandin, host: str) -> None:
    config = uvicorn.Config(
        build_app(standin), host=host, port=standin.port, log_level="warning", lifespan="off"
    )
    server = uvicorn.Server(config)
    if standin.engine == "vllm":
        # vLLM's API server listens only once its engine is up.
        await standin.start()
        await server.serve()
    else:
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(standin.start)
            await server.serve()
            tasks.cancel_scope.cancel()


def main(argv: list[str] | None = None) -> int:
    """Run the stand-in until SIGINT or SIGTERM."""
    parser = argparse.ArgumentParser(
        prog="python -m deo_worker.engine_standin",
        description="A stand-in vLLM or SGLang server (no model): for tests and benchmarks.",
    )
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--engine", choices=ENGINES, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--memory-mib", type=int, default=64)
    parser.add_argument("--memory-on", choices=("host", "gpu"), default="host")
    parser.add_argument("--tokens-per-s", type=float, default=100.0)
    parser.add_argument("--max-concurrency", type=int, default=8)
    parser.add_argument("--startup-s", type=float, default=0.0)
    parser.add_argument("--model", default="standin-model")
    parser.add_argument("--control-delay-s", type=float, default=0.0)
    args = parser.parse_args(argv)
    try:
        standin = EngineStandin(
            engine=args.engine,
            port=args.port,
            memory_mib=args.memory_mib,
            memory_on=args.memory_on,
            tokens_per_s=args.tokens_per_s,
            max_concurrency=args.max_concurrency,
            startup_s=args.startup_s,
            model=args.model,
            control_delay_s=args.control_delay_s,
        )
    except ValueError as exc:
        parser.error(str(exc))
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    anyio.run(_serve, standin, args.host)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
