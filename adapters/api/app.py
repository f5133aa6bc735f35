"""deo's status and control HTTP API: a Starlette app served by uvicorn behind deo's own guard.

Reads (``GET /global-status``, ``GET /metrics`` in Prometheus text format, ``GET /v1/workers``)
change nothing and are open by default; :func:`serve` binds to loopback (127.0.0.1) by default.
With ``reads_need_token`` (what ``deo run`` sets when it listens beyond loopback) they need the
operator token too.

Writes need ``Authorization: Bearer <token>``: the operator token for operator actions (pause,
resume, pin, drain, cordon, uncordon, pressure, stop). A worker speaks only for itself:
``POST /v1/workers/{id}/heartbeat`` and ``POST /v1/workers/{id}/ready`` take the operator token
or that worker's own token, :func:`worker_token` of the run's worker secret and its id, which
``deo run`` puts in the worker's environment. An arbiter pipeline's calls take the operator token
or that pipeline's own, :func:`pipeline_token`, answered when it registers
(:mod:`adapters.api.arbiter`). A missing token is 401, a wrong one 403.

Every write is turned into one core event and handed to :meth:`Runner.submit`, which answers with
the commands it produced or raises the error the core refused the event with. The request is
checked (auth, size, JSON, field types) and its event constructed *before* it is submitted,
because the runner logs every event it is given: a malformed request must leave no trace in the
event log, while a refusal by the reducer (an unknown pool, a pin outside the bounds) is a real
input and is logged as rejected. Worker requests are checked further before they reach the log:
a worker id that is too long or not one of the live workers is refused (404) and only counted
(``deo_api_requests_refused_total``). A heartbeat is not logged by itself: the runner records
the workers it saw once per tick (:meth:`Runner.saw`). A readiness report is logged only while
it changes the worker's state (the worker is starting), at most once per
``min_worker_interval_s`` (the others are counted as coalesced); from a worker already past
starting it is a sighting like a heartbeat, and from one whose start is not handled yet it is
answered 429 with ``Retry-After``. So workers add at most one record per worker and interval to
the log, whatever they send.

Errors are JSON ``{"error": "..."}`` naming what was wrong, with the status every
:class:`~core.errors.DeoError` carries (``http_status``): 400/413/422 for a malformed request, 401
and 403 for a missing or wrong token, 404 for an unknown pool, worker or GPU, 409 for a request
the subject's current state refuses, 429 for a readiness report from a worker whose start is not
handled yet, 503 while deo stops.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping
from typing import Any

import attrs
import orjson
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

from adapters.api.arbiter import arbiter_metrics, arbiter_routes, arbiter_status
from adapters.api.guard import (
    GuardCounters,
)
from adapters.api.serving import listen, serve
from adapters.describe import pool_summary
from adapters.engine_endpoints import engine_figures
from adapters.runtime.arbiter import ArbiterBoard
from adapters.runtime.runner import Runner, Stopping
from core import (
    AutoscalingPaused,
    AutoscalingResumed,
    Command,
    DeoError,
    DrainRequested,
    EnginesWakeRequested,
    Event,
    GpuCordonRequested,
    GpuUncordonRequested,
    LoadSampled,
    PoolPinned,
    QueueSampled,
    State,
    WorkerReady,
    WorkerState,
)
from core.drains import drain_timeout
from core.state import PoolState, Worker, split_worker_id

__all__ = [
    "MAX_WORKER_ID_CHARS",
    "build_app",
    "listen",
    "pipeline_token",
    "serve",
    "worker_token",
]

#: Worker states reported per pool; exited workers are forgotten by the core, so never counted.
_LIVE_STATES: tuple[WorkerState, ...] = tuple(s for s in WorkerState if s is not WorkerState.EXITED)

_QUEUE_FIELDS = ("queued_sequences", "batch_size_seqs", "trainer_step")

#: Longest worker id the API takes; deo's own ids (``pool-index``) are far shorter.
MAX_WORKER_ID_CHARS = 128
#: A starting worker's readiness reports closer together than this are logged once: the others
#: are answered as sightings (coalesced). Heartbeats are always sightings, never logged alone.
DEFAULT_MIN_WORKER_INTERVAL_S = 1.0
#: The Retry-After (seconds) of a readiness report from a worker whose start is not handled yet.
REQUESTED_RETRY_S = 1


def worker_token(worker_secret: str, worker_id: str) -> str:
    """The API token of worker ``worker_id``: an HMAC of its id under the run's worker secret.

    It authorizes requests for that worker only; the secret itself is never given to workers.
    """
    return hmac.new(worker_secret.encode(), worker_id.encode(), hashlib.sha256).hexdigest()


def pipeline_token(worker_secret: str, pipeline: str, registered_t: float | None) -> str:
    """The API token of arbiter pipeline ``pipeline`` registered at ``registered_t``: an HMAC of
    its name and registration time under the run's worker secret (with a prefix no worker id has,
    so it is never a worker's token). Registering the name again gives a new token, so a holder
    of the old one no longer speaks for it; ``registered_t`` None (a pipeline registered before
    deo recorded the time) keeps the token it had.

    It authorizes that pipeline's arbiter calls only; deo answers it when the pipeline registers
    and never logs it."""
    registration = "" if registered_t is None else f"@{registered_t!r}"
    message = f"pipeline/{pipeline}{registration}".encode()
    return hmac.new(worker_secret.encode(), message, hashlib.sha256).hexdigest()


@attrs.define
class _RequestCounters:
    """Worker requests answered without reaching the log, for /metrics."""

    #: By reason: "token", "worker_id" (too long), "unknown_worker", "state" (not started yet).
    refused: dict[str, int] = attrs.field(factory=dict)
    coalesced: int = 0

    def refuse(self, reason: str) -> None:
        self.refused[reason] = self.refused.get(reason, 0) + 1


# --- responses and errors ------------------------------------------------------------------------


class _ApiError(DeoError):
    """A request refused before it became an event (auth, size, JSON), with its status."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.http_status = status
        self.headers = headers


def _json(content: Any, status: int = 200, headers: Mapping[str, str] | None = None) -> Response:
    # orjson rather than Starlette's JSONResponse: a NaN reading (a GPU temperature from a broken
    # sensor) becomes null instead of failing the whole status page.
    return Response(orjson.dumps(content), status, headers, media_type="application/json")


async def _deo_error(request: Request, exc: Exception) -> Response:
    # The request's own refusals and the core's alike: the error's class carries the status.
    assert isinstance(exc, DeoError)
    headers = exc.headers if isinstance(exc, _ApiError) else None
    return _json({"error": str(exc)}, exc.http_status, headers)


async def _http_error(request: Request, exc: Exception) -> Response:
    # Starlette's own refusals (no such route, wrong method) in the same JSON shape as ours.
    assert isinstance(exc, HTTPException)
    message = f"{exc.detail}: {request.method} {request.url.path}"
    return _json({"error": message}, exc.status_code, exc.headers)


async def _server_error(request: Request, exc: Exception) -> Response:
    return _json({"error": f"internal error: {type(exc).__name__}"}, 500)


def _commands_json(commands: list[Command]) -> dict[str, Any]:
    return {"commands": [{"type": type(c).__name__, "reason": c.reason} for c in commands]}


# --- request checks ------------------------------------------------------------------------------


def _authorize(request: Request, accepted: tuple[bytes, ...]) -> None:
    """Return if the request carries one of the ``accepted`` bearer tokens, else raise 401/403."""
    header = request.headers.get("authorization")
    if header is None:
        raise _ApiError(
            401,
            "missing Authorization header: send 'Authorization: Bearer <token>'",
            {"WWW-Authenticate": "Bearer"},
        )
    scheme, _, credential = header.strip().partition(" ")
    if scheme.lower() != "bearer" or not credential.strip():
        raise _ApiError(
            401,
            "Authorization header is not of the form 'Bearer <token>'",
            {"WWW-Authenticate": "Bearer"},
        )
    # Header values arrive decoded as latin-1, so encoding them back gives the bytes sent.
    given = credential.strip().encode("latin-1")
    # Compare against every accepted token (no early exit), each in constant time.
    matches = [hmac.compare_digest(given, token) for token in accepted]
    if not any(matches):
        raise _ApiError(403, "the bearer token is not accepted for this endpoint")


def _json_kind(value: object) -> str:
    kinds = {dict: "an object", list: "an array", str: "a string", bool: "a boolean"}
    if value is None:
        return "null"
    if isinstance(value, float):
        if value.is_integer() and abs(value) >= 2**63:
            # The JSON parser reads a whole number past 64 bits as a float.
            return f"a whole number too large for an integer ({value:g})"
        return f"the number {value!r}"
    return kinds.get(type(value), "a number")


async def _read_object(request: Request, max_body_bytes: int) -> dict[str, Any]:
    """The request body as a JSON object ({} when empty); 413, 400 or 422 if it is not one."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            declared_bytes = int(declared)
        except ValueError:
            raise _ApiError(400, f"Content-Length {declared!r} is not a number") from None
        if declared_bytes > max_body_bytes:
            raise _ApiError(
                413,
                f"request body of {declared_bytes} bytes exceeds the {max_body_bytes}-byte limit",
            )
    # Count what actually arrives too: a chunked body declares no length.
    chunks: list[bytes] = []
    received_bytes = 0
    try:
        async for chunk in request.stream():
            received_bytes += len(chunk)
            if received_bytes > max_body_bytes:
                raise _ApiError(413, f"request body exceeds the {max_body_bytes}-byte limit")
            chunks.append(chunk)
    except ClientDisconnect:
        # Gone (or cut off at its request deadline) before its body arrived: nothing to do.
        raise _ApiError(400, "the connection closed before the request body arrived") from None
    raw = b"".join(chunks)
    if not raw.strip():
        return {}
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise _ApiError(400, f"request body is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise _ApiError(422, f"request body must be a JSON object, got {_json_kind(value)}")
    return value


def _only(body: dict[str, Any], allowed: tuple[str, ...]) -> None:
    for name in body:
        if name not in allowed:
            expected = ", ".join(allowed) or "no fields"
            raise _ApiError(422, f"unexpected field {name!r} (expected: {expected})")


def _int_field(body: dict[str, Any], name: str, *, nullable: bool = False) -> int | None:
    if name not in body:
        raise _ApiError(422, f"missing field {name!r}")
    value = body[name]
    if value is None and nullable:
        return None
    # bool is an int to Python but not to a JSON client; 2.0 is not a count either.
    if not isinstance(value, int) or isinstance(value, bool):
        wanted = "an integer or null" if nullable else "an integer"
        raise _ApiError(422, f"field {name!r} must be {wanted}, got {_json_kind(value)}")
    return value


def _optional_str_field(body: dict[str, Any], name: str) -> str | None:
    value = body.get(name)
    if value is not None and not isinstance(value, str):
        raise _ApiError(422, f"field {name!r} must be a string or null, got {_json_kind(value)}")
    return value


def _pressure_event(pool: str, body: dict[str, Any], t: float) -> Event:
    """A QueueSampled or LoadSampled from a pressure push, whichever shape the body has."""
    _only(body, (*_QUEUE_FIELDS, "in_flight_requests"))
    queue_given = [name for name in _QUEUE_FIELDS if name in body]
    if "in_flight_requests" in body:
        if queue_given:
            raise _ApiError(
                422,
                f"give either {', '.join(_QUEUE_FIELDS)} or in_flight_requests, not both "
                f"(got {', '.join([*queue_given, 'in_flight_requests'])})",
            )
        in_flight = _int_field(body, "in_flight_requests")
        assert in_flight is not None
        return LoadSampled(t=t, pool=pool, in_flight_requests=in_flight)
    if not queue_given:
        raise _ApiError(
            422,
            f"missing fields: give {', '.join(_QUEUE_FIELDS)} (a trainer queue) "
            f"or in_flight_requests (request load)",
        )
    queued, batch, step = (_int_field(body, name) for name in _QUEUE_FIELDS)
    assert queued is not None and batch is not None and step is not None
    return QueueSampled(
        t=t, pool=pool, queued_sequences=queued, batch_size_seqs=batch, trainer_step=step
    )


# --- status --------------------------------------------------------------------------------------


def _command_pool(command: Command, state: State) -> str | None:
    """The pool a decision concerns, if any (GPU-only decisions concern none)."""
    pool = getattr(command, "pool", None)
    if isinstance(pool, str):
        return pool
    subject = getattr(command, "worker_id", None) or getattr(command, "subject", None)
    if not isinstance(subject, str):
        return None
    if subject in state.pools:
        return subject
    parsed = split_worker_id(subject)
    # Only a pool that exists: a GPU UUID such as "GPU-ab-1" also splits like a worker id.
    return parsed[0] if parsed is not None and parsed[0] in state.pools else None


def _pool_json(runner: Runner, state: State, name: str, pool: PoolState) -> dict[str, Any]:
    workers = state.workers_of(name)
    ids = {s.value: [w.worker_id for w in workers if w.state is s] for s in _LIVE_STATES}
    spec = pool.spec
    queue = pool.queue
    load = pool.load
    held = pool.held_at(state.now)
    return {
        "target": pool.target,
        "desired": pool.desired,
        "pinned": pool.pinned,
        "paused": pool.paused,
        "removed": pool.removed,
        "min_workers": spec.min_workers,
        "max_workers": spec.max_workers,
        "gpus_per_worker": spec.gpus_per_worker,
        "policy": spec.policy.name,
        "workers_by_state": {state_name: len(found) for state_name, found in ids.items()},
        "worker_ids_by_state": ids,
        "queue": None
        if queue is None
        else {
            "t": queue.t,
            "queued_sequences": queue.queued_sequences,
            "batch_size_seqs": queue.batch_size_seqs,
            "trainer_step": queue.trainer_step,
            "queued_batches": queue.queued_sequences / queue.batch_size_seqs,
        },
        "load": None
        if load is None
        else {"t": load.t, "in_flight_requests": load.in_flight_requests},
        # verl's figures for an engine pool (load ratio, engines by state, capacity); else None.
        "engines": engine_figures(state, name),
        "last_sample_t": pool.last_sample_t,
        "source_error": pool.source_error,
        "failures": pool.failures,
        "last_failure_t": pool.last_failure_t,
        "backoff_until_t": pool.backoff_until_t,
        "last_scale_up_t": pool.last_scale_up_t,
        # A removal the stabilization window holds back (None: none now).
        "held": None
        if held is None
        else {
            "target": held.target,
            "since_t": held.since_t,
            "until_t": held.until_t,
            "reason": held.reason,
        },
        "decisions": [
            {"t": d.t, "type": type(d.command).__name__, "reason": d.command.reason}
            for d in runner.decisions
            if _command_pool(d.command, state) == name
        ],
        "drain_deadline": _drain_deadline(pool),
        "summary": pool_summary(state, name),
    }


def _drain_deadline(pool: PoolState) -> dict[str, Any]:
    """The deadline a drain of this pool gets now, and why (measured or configured)."""
    seconds, why = drain_timeout(pool.spec, pool.drains)
    return {"seconds": seconds, "why": why, "measured_drains": len(pool.drains)}


def _global_status(runner: Runner) -> dict[str, Any]:
    state = runner.state  # one immutable snapshot: the page is consistent
    holders: dict[str, list[str]] = {}
    for worker in state.workers.values():
        for gpu_id in worker.gpus:
            holders.setdefault(gpu_id, []).append(worker.worker_id)
    return {
        "now": state.now,
        "paused_all": state.paused_all,
        "events_handled": runner.events_handled,
        "pools": {
            name: _pool_json(runner, state, name, pool)
            for name, pool in sorted(state.pools.items())
        },
        "gpus": [
            {
                "id": gpu.gpu_id,
                "cordoned": gpu.cordoned,
                "causes": sorted(gpu.causes),
                "temperature_c": gpu.temperature_c,
                "memory_used_bytes": gpu.memory_used_bytes,
                "memory_total_bytes": gpu.memory_total_bytes,
                "workers": sorted(holders.get(gpu.gpu_id, [])),
            }
            for gpu in state.gpus.values()
        ],
        "alerts": [{"alert": a, "subject": s} for a, s in sorted(state.alerts)],
        **({"arbiter": arbiter_status(state)} if state.arbiter.gpus else {}),
    }


def _worker_json(worker: Worker, state: State) -> dict[str, Any]:
    return {
        "id": worker.worker_id,
        "pool": worker.pool,
        "state": worker.state.value,
        "pid": worker.pid,
        "gpus": list(worker.gpus),
        "requested_t": worker.requested_t,
        "started_t": worker.started_t,
        "last_seen": state.last_seen.get(worker.worker_id),
        "deadline_t": worker.deadline_t,
        "stop_cause": worker.stop_cause,
        "port": worker.port,
    }


class _StateCollector:
    """Prometheus metrics computed from the runner's state at each scrape (nothing to keep in
    sync: the state is the single source of truth)."""

    def __init__(
        self, runner: Runner, requests: _RequestCounters, connections: GuardCounters
    ) -> None:
        self.runner = runner
        self.requests = requests
        self.connections = connections

    def collect(self) -> Iterator[Metric]:
        state = self.runner.state
        workers = GaugeMetricFamily(
            "deo_pool_workers",
            "Live workers per pool and lifecycle state",
            labels=["pool", "state"],
        )
        target = GaugeMetricFamily("deo_pool_target", "Target worker count", labels=["pool"])
        queued = GaugeMetricFamily(
            "deo_pool_queued_batches",
            "Queued sequences over the batch size, from the last queue sample",
            labels=["pool"],
        )
        for name, pool in sorted(state.pools.items()):
            counts = dict.fromkeys(_LIVE_STATES, 0)
            for worker in state.workers_of(name):
                counts[worker.state] += 1
            for worker_state, count in counts.items():
                workers.add_metric([name, worker_state.value], count)
            target.add_metric([name], pool.target)
            if pool.queue is not None:
                queue = pool.queue
                queued.add_metric([name], queue.queued_sequences / queue.batch_size_seqs)
        cordoned = GaugeMetricFamily("deo_gpu_cordoned", "1 if the GPU is cordoned", labels=["gpu"])
        for gpu in state.gpus.values():
            cordoned.add_metric([gpu.gpu_id], 1.0 if gpu.cordoned else 0.0)
        alerts = GaugeMetricFamily(
            "deo_alerts_active", "1 per active alert", labels=["alert", "subject"]
        )
        for alert, subject in sorted(state.alerts):
            alerts.add_metric([alert, subject], 1.0)
        handled = CounterMetricFamily(
            "deo_events_handled", "Events the runner handled (accepted or refused)"
        )
        handled.add_metric([], self.runner.events_handled)
        yield from (workers, target, queued, cordoned, alerts, handled)
        yield from _engine_metrics(state)
        yield from arbiter_metrics(state)
        yield from self._api_metrics()

    def _api_metrics(self) -> Iterator[Metric]:
        refused = CounterMetricFamily(
            "deo_api_requests_refused",
            "Worker requests refused before reaching the log, by reason",
            labels=["reason"],
        )
        for reason, count in sorted(self.requests.refused.items()):
            refused.add_metric([reason], count)
        coalesced = CounterMetricFamily(
            "deo_api_ready_reports_coalesced",
            "Readiness reports answered without being logged (one was logged just before)",
        )
        coalesced.add_metric([], self.requests.coalesced)
        c = self.connections
        open_ = GaugeMetricFamily("deo_api_connections_open", "Open API connections")
        open_.add_metric([], c.open)
        cap = GaugeMetricFamily("deo_api_connection_cap", "Most API connections held at once")
        cap.add_metric([], c.cap)
        closed = CounterMetricFamily(
            "deo_api_connections_closed",
            "Connections the API closed: evicted at the cap, or no request within the deadline",
            labels=["reason"],
        )
        closed.add_metric(["evicted"], c.evicted)
        closed.add_metric(["timed_out"], c.timed_out)
        accept = CounterMetricFamily(
            "deo_api_accept_errors", "Accepts that failed for want of descriptors or memory"
        )
        accept.add_metric([], c.accept_errors)
        yield from (refused, coalesced, open_, cap, closed, accept)


# --- the app -------------------------------------------------------------------------------------

_Build = Callable[[Request, dict[str, Any], float], Event]


def _engine_metrics(state: State) -> Iterator[Metric]:
    """verl's figures for each engine pool, and each engine's requests in flight."""
    ratio = GaugeMetricFamily(
        "deo_engine_pool_load_ratio",
        "Requests in flight over the active engines' capacity (verl's load ratio)",
        labels=["pool"],
    )
    engines = GaugeMetricFamily(
        "deo_engine_pool_engines",
        "Engines per pool by verl's state (active, draining, inactive, starting)",
        labels=["pool", "state"],
    )
    capacity = GaugeMetricFamily(
        "deo_engine_pool_capacity_requests",
        "Requests the active engines serve well (active engines x capacity per engine)",
        labels=["pool"],
    )
    in_flight = GaugeMetricFamily(
        "deo_engine_in_flight_requests",
        "Requests in flight at each serving or draining engine, as last sampled",
        labels=["pool", "worker"],
    )
    for name in sorted(state.pools):
        figures = engine_figures(state, name)
        if figures is None:
            continue
        if figures["load_ratio"] is not None:
            ratio.add_metric([name], figures["load_ratio"])
        for verl_state in ("active", "draining", "inactive", "starting"):
            engines.add_metric([name, verl_state], figures[verl_state])
        capacity.add_metric([name], figures["total_capacity"])
        for worker_id, count in sorted(figures["in_flight_by_engine"].items()):
            if count is not None:
                in_flight.add_metric([name, worker_id], count)
    yield from (ratio, engines, capacity, in_flight)


def build_app(
    runner: Runner,
    *,
    token: str,
    worker_secret: str,
    max_body_bytes: int = 65_536,
    reads_need_token: bool = False,
    min_worker_interval_s: float = DEFAULT_MIN_WORKER_INTERVAL_S,
    arbiter: ArbiterBoard | None = None,
) -> Starlette:
    """The API app for ``runner``. ``token`` authorizes operator actions (and reads, with
    ``reads_need_token``); a worker's requests take ``token`` or that worker's
    :func:`worker_token` under ``worker_secret``. ``arbiter``: the board that carries out the
    runner's arbiter commands (its long polls wake on them). Serve it with :func:`serve`."""
    if not token or not worker_secret:
        raise ValueError("token and worker_secret must be non-empty")
    if hmac.compare_digest(token.encode(), worker_secret.encode()):
        raise ValueError("worker_secret must differ from token")
    if max_body_bytes < 0:
        raise ValueError(f"max_body_bytes must be >= 0, got {max_body_bytes}")
    if min_worker_interval_s < 0:
        raise ValueError(f"min_worker_interval_s must be >= 0, got {min_worker_interval_s}")
    operator_only = (token.encode(),)
    requests = _RequestCounters()
    connections = GuardCounters()
    registry = CollectorRegistry()
    registry.register(_StateCollector(runner, requests, connections))
    #: When each worker's last report was logged (monotonic seconds), for coalescing.
    logged_at: dict[str, float] = {}

    def action(
        accepted: tuple[bytes, ...], build: _Build
    ) -> Callable[[Request], Awaitable[Response]]:
        """An endpoint that turns a request into one event and answers with its commands.

        A field the event refuses (InvalidEvent) and a refusal by the core reach the client
        through the DeoError handler, with the status of the error's class."""

        async def endpoint(request: Request) -> Response:
            _authorize(request, accepted)
            body = await _read_object(request, max_body_bytes)
            event = build(request, body, runner.clock())
            if runner.stop_requested.is_set():
                # A pin or a drain while every pool is being removed would only be undone.
                raise Stopping("deo is stopping: it takes no more actions")
            commands = await runner.submit(event)
            return _json(_commands_json(commands))

        return endpoint

    def path(request: Request, name: str) -> str:
        value = request.path_params[name]
        assert isinstance(value, str)
        return value

    def subject(request: Request, name: str) -> str:
        """The pool, worker or GPU an operator action names; one longer than any id deo makes
        is refused before it reaches the log, and is not echoed back whole."""
        value = path(request, name)
        if len(value) > MAX_WORKER_ID_CHARS:
            raise _ApiError(
                404,
                f"no {name.removesuffix('_id')} {value[:32]!r}... of {len(value)} characters "
                f"(ids have at most {MAX_WORKER_ID_CHARS})",
            )
        return value

    def build_pause(cls: type[AutoscalingPaused] | type[AutoscalingResumed]) -> _Build:
        def build(request: Request, body: dict[str, Any], t: float) -> Event:
            _only(body, ("pool",))
            return cls(t=t, pool=_optional_str_field(body, "pool"))

        return build

    def build_pin(request: Request, body: dict[str, Any], t: float) -> Event:
        _only(body, ("count",))
        count = _int_field(body, "count", nullable=True)
        return PoolPinned(t=t, pool=subject(request, "pool"), count=count)

    def build_wake(request: Request, body: dict[str, Any], t: float) -> Event:
        _only(body, ("hold_s",))
        hold_s = body.get("hold_s")
        if hold_s is not None and (isinstance(hold_s, bool) or not isinstance(hold_s, int | float)):
            raise _ApiError(400, f"hold_s: expected a number of seconds or null, got {hold_s!r}")
        return EnginesWakeRequested(t=t, pool=subject(request, "pool"), hold_s=hold_s)

    def build_pressure(request: Request, body: dict[str, Any], t: float) -> Event:
        return _pressure_event(subject(request, "pool"), body, t)

    def no_body(make: Callable[[str, float], Event], name: str) -> _Build:
        def build(request: Request, body: dict[str, Any], t: float) -> Event:
            _only(body, ())
            return make(subject(request, name), t)

        return build

    def read(endpoint: Callable[[Request], Response]) -> Callable[[Request], Awaitable[Response]]:
        async def guarded(request: Request) -> Response:
            if reads_need_token:
                _authorize(request, operator_only)
            return endpoint(request)

        return guarded

    def global_status(request: Request) -> Response:
        return _json(_global_status(runner))

    def metrics(request: Request) -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    def workers(request: Request) -> Response:
        state = runner.state
        live = sorted(state.workers.values(), key=lambda w: (w.pool, w.index))
        return _json({"workers": [_worker_json(w, state) for w in live]})

    async def stop(request: Request) -> Response:
        # Not an event: stopping is the runtime's business. A drain first goes through the log
        # as the configuration with every pool removed.
        _authorize(request, operator_only)
        body = await _read_object(request, max_body_bytes)
        _only(body, ("drain",))
        drain = body.get("drain", False)
        if not isinstance(drain, bool):
            raise _ApiError(422, f"drain: expected true or false, got {drain!r}")
        runner.request_stop(drain=drain)
        return _json({"stopping": True, "drain": drain})

    def worker_report(ready: bool) -> Callable[[Request], Awaitable[Response]]:
        """A heartbeat (a sighting the runner batches) or a readiness report: checked before
        anything reaches the log. Only a starting worker's readiness changes its state, so only
        that is logged (at most once per ``min_worker_interval_s``); from a live worker past
        that it is a sighting, and from one whose start is not handled yet a 429."""

        async def endpoint(request: Request) -> Response:
            worker_id = path(request, "worker_id")
            if len(worker_id) > MAX_WORKER_ID_CHARS:
                requests.refuse("worker_id")
                raise _ApiError(
                    404,
                    f"no worker {worker_id[:32]!r}... of {len(worker_id)} characters "
                    f"(worker ids have at most {MAX_WORKER_ID_CHARS})",
                )
            try:
                _authorize(
                    request, (*operator_only, worker_token(worker_secret, worker_id).encode())
                )
            except _ApiError:
                requests.refuse("token")
                raise
            _only(await _read_object(request, max_body_bytes), ())
            worker = runner.state.workers.get(worker_id)
            if worker is None:
                requests.refuse("unknown_worker")
                raise _ApiError(404, f"unknown worker {worker_id!r}: not a live worker of deo")
            if not ready:
                # Not an event of its own: the runner batches sightings into one record per tick.
                runner.saw(worker_id)
                return _json(_commands_json([]))
            if worker.state is WorkerState.REQUESTED:
                # Its start is not handled yet: the core would refuse the report. Nothing is
                # submitted; the worker asks again (deo_worker.ready retries a 429).
                requests.refuse("state")
                raise _ApiError(
                    429,
                    f"worker {worker_id!r} has not started yet; retry in {REQUESTED_RETRY_S}s",
                    {"Retry-After": str(REQUESTED_RETRY_S)},
                )
            if worker.state is not WorkerState.STARTING:
                # Active, draining, ...: the core takes a report now as a sign of life only.
                runner.saw(worker_id)
                return _json(_commands_json([]))
            now_s = time.monotonic()
            last_s = logged_at.get(worker_id)
            if last_s is not None and now_s - last_s < min_worker_interval_s:
                # Another report of this starting worker is already on its way to the log.
                requests.coalesced += 1
                runner.saw(worker_id)
                return _json({"commands": [], "coalesced": True})
            logged_at[worker_id] = now_s
            if len(logged_at) > 2 * len(runner.state.workers) + 16:
                for gone in [w for w in logged_at if w not in runner.state.workers]:
                    del logged_at[gone]
            ready_event = WorkerReady(t=runner.clock(), worker_id=worker_id)
            return _json(_commands_json(await runner.submit(ready_event)))

        return endpoint

    def post(route: str, build: _Build) -> Route:
        return Route(route, action(operator_only, build), methods=["POST"])

    routes = [
        Route("/global-status", read(global_status), methods=["GET"]),
        Route("/metrics", read(metrics), methods=["GET"]),
        Route("/v1/workers", read(workers), methods=["GET"]),
        Route("/v1/stop", stop, methods=["POST"]),
        Route("/v1/workers/{worker_id}/heartbeat", worker_report(False), methods=["POST"]),
        Route("/v1/workers/{worker_id}/ready", worker_report(True), methods=["POST"]),
        post("/v1/pause", build_pause(AutoscalingPaused)),
        post("/v1/resume", build_pause(AutoscalingResumed)),
        post("/v1/pools/{pool}/pin", build_pin),
        post("/v1/pools/{pool}/wake", build_wake),
        post("/v1/pools/{pool}/pressure", build_pressure),
        post(
            "/v1/workers/{worker_id}/drain",
            no_body(lambda w, t: DrainRequested(t=t, worker_id=w), "worker_id"),
        ),
        post(
            "/v1/gpus/{gpu_id}/cordon",
            no_body(lambda g, t: GpuCordonRequested(t=t, gpu_id=g), "gpu_id"),
        ),
        post(
            "/v1/gpus/{gpu_id}/uncordon",
            no_body(lambda g, t: GpuUncordonRequested(t=t, gpu_id=g), "gpu_id"),
        ),
    ]

    def registered_pipeline_token(pipeline: str) -> str | None:
        registered = runner.state.arbiter.pipelines.get(pipeline)
        if registered is None:
            return None
        return pipeline_token(worker_secret, pipeline, registered.registered_t)

    routes += arbiter_routes(
        runner,
        arbiter if arbiter is not None else ArbiterBoard(),
        authorize=lambda request, also: _authorize(request, (*operator_only, *also)),
        pipeline_token=registered_pipeline_token,
        read_object=lambda request: _read_object(request, max_body_bytes),
        reply=_json,
        read=read,
        api_error=_ApiError,
    )
    app = Starlette(
        routes=routes,
        exception_handlers={
            DeoError: _deo_error,
            HTTPException: _http_error,
            Exception: _server_error,
        },
    )
    # serve() counts its connections here, for /metrics.
    app.state.guard_counters = connections
    return app
