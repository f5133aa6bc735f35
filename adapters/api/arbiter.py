"""The GPU arbiter's HTTP endpoints, status rows and metrics (see docs/arbiter.md).

Every endpoint is a write. Registering a pipeline takes the operator token and answers the
pipeline's own token (``"token"``: an HMAC of its name under deo's worker secret, never logged;
``POST /v1/arbiter/pipelines/{p}/token`` with the operator token answers it again). Every
endpoint under ``/v1/arbiter/pipelines/{p}/`` takes the operator token or ``p``'s own; another
pipeline's token is refused (403, naming whose it is). Each turns a request into one arbiter
event (checked and constructed before it reaches the log, so a malformed request leaves no
trace) and hands it to :meth:`Runner.submit`:

- ``POST /v1/arbiter/pipelines``: ``{"pipeline", "clusters": [{"name", "kind",
  "device_mapping", "tp_size", "max_dp_size", "engine_pool"}]}``: a pipeline and its clusters,
  in one step; answers ``{"commands", "pipeline", "token"}``;
- ``POST /v1/arbiter/pipelines/{p}/unregister``;
- ``POST /v1/arbiter/pipelines/{p}/clusters/{c}/request``: ``{"priority",
  "estimate_trajectories", "timeout_s", "request_id"}``, a long poll: 200 with the grant once it
  is made, or 408 ``{"waiting": true}`` at ``timeout_s`` with the request still queued: asking
  again waits in the same place (a cluster whose request is already queued is not queued twice,
  and one granted while its caller was away is answered with what it holds). ``request_id``
  (1-64 of ``A-Z a-z 0-9 . _ -``, the same on every poll of one request) makes a poll sent
  again name its request: after a release withdrew it, or its GPUs were lost, it is answered
  409 (from the log's state, across restarts of deo) rather than queued anew;
- ``POST /v1/arbiter/pipelines/{p}/clusters/{c}/release``;
- ``POST /v1/arbiter/pipelines/{p}/release-and-request``: ``{"release_cluster", "cluster",
  "priority", "estimate_trajectories", "timeout_s", "request_id"}``, a long poll like a request;
- ``POST /v1/arbiter/pipelines/{p}/progress``: ``{"stream", "target_trajectories",
  "completed_trajectories"}``; ``.../progress/clear``: ``{"stream"}`` (all when absent);
- ``POST /v1/arbiter/pipelines/{p}/rollout/open`` and ``.../rollout/close``.

``GET /v1/arbiter`` (a read) is the arbiter's part of ``/global-status``. While a configured
arbiter's GPUs are not declared yet (deo is starting), the writes answer 503: ask again.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import anyio
from prometheus_client.core import GaugeMetricFamily, Metric
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from adapters.runtime.arbiter import ArbiterBoard
from adapters.runtime.runner import Runner
from core import (
    Command,
    DeoError,
    Event,
    InvalidEvent,
    RaiseAlert,
    Refused,
    State,
    WorkerState,
)
from core.arbiter import (
    ClusterSpec,
    GapRatioPlanner,
    GpusReleased,
    GpusReleasedAndRequested,
    GpusRequested,
    PipelineRegistered,
    PipelineUnregistered,
    Priority,
    ProgressCleared,
    ProgressReported,
    RolloutClosed,
    RolloutOpened,
    Share,
    planner_in_use,
)
from core.arbiter.engines import rank_engines
from core.arbiter.model import ArbiterState, Cluster
from core.vocabulary import AlertName

__all__ = [
    "DEFAULT_WAIT_S",
    "MAX_WAIT_S",
    "arbiter_metrics",
    "arbiter_routes",
    "arbiter_status",
]

#: How long a request waits for its grant when the caller names no ``timeout_s``.
DEFAULT_WAIT_S = 30.0
#: The longest one long poll may wait: the caller asks again after it.
MAX_WAIT_S = 300.0

#: How often a waiting long poll looks at the state anyway: the board wakes it at each arbiter
#: command and engine confirmation; this is a fallback.
RECHECK_S = 3.0

_CLUSTER_FIELDS = ("name", "kind", "device_mapping", "tp_size", "max_dp_size", "engine_pool")

Endpoint = Callable[[Request], Awaitable[Response]]


class Starting(DeoError):
    """deo serves an arbiter but has not declared its GPUs yet (it is starting): ask again."""

    http_status = 503


class StillWaiting(DeoError):
    """A long poll ended before its request was answered; the request stays queued."""

    http_status = 408


def arbiter_routes(
    runner: Runner,
    board: ArbiterBoard,
    *,
    authorize: Callable[[Request, tuple[bytes, ...]], None],
    pipeline_token: Callable[[str], str | None],
    read_object: Callable[[Request], Awaitable[dict[str, Any]]],
    reply: Callable[[Any, int], Response],
    read: Callable[[Callable[[Request], Response]], Endpoint],
    api_error: Callable[[int, str], DeoError],
) -> list[Route]:
    """The arbiter's routes on deo's API. ``authorize`` checks the operator token (or one of the
    tokens it is given too), ``pipeline_token`` is a registered pipeline's own token (None: not
    registered), ``read_object`` reads a JSON object body, ``reply`` answers JSON, ``read``
    guards a read and ``api_error`` builds a refusal of a malformed request (the API module's
    own)."""

    def token_owner(request: Request) -> str | None:
        """The registered pipeline whose token the request carries, if any."""
        scheme, _, credential = request.headers.get("authorization", "").strip().partition(" ")
        given = credential.strip().encode("latin-1", "replace")
        owners = [
            p
            for p in runner.state.arbiter.pipelines
            if hmac.compare_digest(given, (pipeline_token(p) or "").encode())
        ]
        return owners[0] if scheme.lower() == "bearer" and owners else None

    def authorize_started(request: Request, pipeline: str | None = None) -> None:
        """The operator's token, or (``pipeline`` given) that pipeline's own; 403 naming whose
        token it is when it is another pipeline's."""
        if pipeline is None:
            authorize(request, ())
        else:
            try:
                own = pipeline_token(pipeline)
                authorize(request, () if own is None else (own.encode(),))
            except DeoError as exc:
                other = token_owner(request) if exc.http_status == 403 else None
                if other is not None:
                    raise api_error(
                        403,
                        f"the bearer token is pipeline {other!r}'s: it speaks for that pipeline"
                        f" only, not for {pipeline!r} (use {pipeline!r}'s token or the"
                        " operator's)",
                    ) from None
                raise
        if board.configured and not runner.state.arbiter.gpus:
            raise Starting("deo is starting: the arbiter's GPUs are not declared yet; retry")

    def only(body: dict[str, Any], allowed: tuple[str, ...], where: str = "") -> None:
        for name in body:
            if name not in allowed:
                expected = ", ".join(allowed) or "no fields"
                raise api_error(422, f"{where}unexpected field {name!r} (expected: {expected})")

    def text(body: dict[str, Any], name: str) -> str:
        value = body.get(name)
        if not isinstance(value, str) or not value:
            raise api_error(422, f"field {name!r} must be a non-empty string, got {value!r}")
        return value

    def optional_text(body: dict[str, Any], name: str) -> str | None:
        return None if body.get(name) is None else text(body, name)

    def count(body: dict[str, Any], name: str, *, required: bool = True) -> int | None:
        value = body.get(name)
        if value is None and not required:
            return None
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            wanted = "an integer >= 0" + ("" if required else " or null")
            raise api_error(422, f"field {name!r} must be {wanted}, got {value!r}")
        return value

    def priority(body: dict[str, Any], field: str = "priority", where: str = "") -> Priority:
        value = body.get(field)
        names = ", ".join(p.name for p in Priority)
        if isinstance(value, str) and value.upper() in Priority.__members__:
            return Priority[value.upper()]
        if isinstance(value, int) and not isinstance(value, bool) and value in set(Priority):
            return Priority(value)
        raise api_error(
            422, f"{where}field {field!r} must be one of {names} (or 0-6), got {value!r}"
        )

    def wait_s(body: dict[str, Any]) -> float:
        value = body.get("timeout_s", DEFAULT_WAIT_S)
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not 0 <= value <= MAX_WAIT_S
        ):
            raise api_error(
                422, f"field 'timeout_s' must be seconds in [0, {MAX_WAIT_S:g}], got {value!r}"
            )
        return float(value)

    def name(request: Request, key: str) -> str:
        value = request.path_params[key]
        assert isinstance(value, str)
        return value

    async def submit_checked(event: Event, who: str) -> list[Command]:
        """Submit ``event``; refused (409) when the arbiter refused its plan (nothing ran)."""
        commands = await runner.submit(event)
        for command in commands:
            if isinstance(command, RaiseAlert) and command.alert == AlertName.PLAN_REFUSED:
                raise Refused(f"{who}: nothing was done: {command.reason}")
        return commands

    async def submit(event: Event) -> Response:
        who = "/".join(
            getattr(event, key) for key in ("pipeline", "cluster") if hasattr(event, key)
        )
        commands = await submit_checked(event, who or type(event).__name__)
        return reply(
            {"commands": [{"type": type(c).__name__, "reason": c.reason} for c in commands]}, 200
        )

    def action(build: Callable[[Request, dict[str, Any], float], Event]) -> Endpoint:
        """An endpoint of one pipeline (in its path): its token or the operator's."""

        async def endpoint(request: Request) -> Response:
            authorize_started(request, name(request, "pipeline"))
            body = await read_object(request)
            return await submit(build(request, body, runner.clock()))

        return endpoint

    async def register(request: Request) -> Response:
        """Operator only; answers the pipeline's own token with the commands."""
        authorize_started(request)
        body = await read_object(request)
        event = build_register(request, body, runner.clock())
        assert isinstance(event, PipelineRegistered)
        commands = await submit_checked(event, event.pipeline)
        answer = {
            "commands": [{"type": type(c).__name__, "reason": c.reason} for c in commands],
            "pipeline": event.pipeline,
            "token": pipeline_token(event.pipeline),
        }
        return reply(answer, 200)

    async def token(request: Request) -> Response:
        """Operator only: a registered pipeline's token, to hand to its training loop."""
        authorize_started(request)
        only(await read_object(request), ())
        pipeline = name(request, "pipeline")
        if pipeline not in runner.state.arbiter.pipelines:
            raise api_error(404, f"unknown pipeline {pipeline!r}: register it first")
        return reply({"pipeline": pipeline, "token": pipeline_token(pipeline)}, 200)

    def build_register(request: Request, body: dict[str, Any], t: float) -> Event:
        only(body, ("pipeline", "clusters"))
        pipeline = text(body, "pipeline")
        raw = body.get("clusters", [])
        if not isinstance(raw, list):
            raise api_error(422, f"field 'clusters' must be a list, got {raw!r}")
        specs = []
        for index, cluster in enumerate(raw):
            where = f"clusters[{index}]: "
            if not isinstance(cluster, dict):
                raise api_error(422, f"{where}must be an object, got {cluster!r}")
            only(cluster, _CLUSTER_FIELDS, where)
            for key in ("name", "kind", "device_mapping"):
                if key not in cluster:
                    raise api_error(422, f"{where}missing field {key!r}")
            mapping = cluster["device_mapping"]
            if not isinstance(mapping, list) or not all(isinstance(g, str) for g in mapping):
                raise api_error(422, f"{where}'device_mapping' must be a list of GPU ids")
            kind = priority(cluster, "kind", where)
            try:
                spec = ClusterSpec(
                    name=text(cluster, "name"),
                    kind=kind,
                    device_mapping=mapping,
                    tp_size=cluster.get("tp_size", 1),
                    max_dp_size=cluster.get("max_dp_size"),
                    engine_pool=cluster.get("engine_pool"),
                )
            except InvalidEvent as exc:
                raise api_error(422, f"{where}{exc}") from None
            specs.append(spec)
        return PipelineRegistered(t=t, pipeline=pipeline, clusters=specs)

    def build_unregister(request: Request, body: dict[str, Any], t: float) -> Event:
        only(body, ())
        return PipelineUnregistered(t=t, pipeline=name(request, "pipeline"))

    def build_release(request: Request, body: dict[str, Any], t: float) -> Event:
        only(body, ())
        return GpusReleased(
            t=t, pipeline=name(request, "pipeline"), cluster=name(request, "cluster")
        )

    def build_progress(request: Request, body: dict[str, Any], t: float) -> Event:
        only(body, ("stream", "target_trajectories", "completed_trajectories"))
        target = count(body, "target_trajectories")
        completed = count(body, "completed_trajectories")
        assert target is not None and completed is not None
        return ProgressReported(
            t=t,
            pipeline=name(request, "pipeline"),
            stream=optional_text(body, "stream") or "default",
            target_trajectories=target,
            completed_trajectories=completed,
        )

    def build_clear(request: Request, body: dict[str, Any], t: float) -> Event:
        only(body, ("stream",))
        return ProgressCleared(
            t=t, pipeline=name(request, "pipeline"), stream=optional_text(body, "stream")
        )

    def build_rollout(opened: bool) -> Callable[[Request, dict[str, Any], float], Event]:
        def build(request: Request, body: dict[str, Any], t: float) -> Event:
            only(body, ())
            cls = RolloutOpened if opened else RolloutClosed
            return cls(t=t, pipeline=name(request, "pipeline"))

        return build

    async def long_poll(
        pipeline: str, cluster: str, event: GpusRequested | GpusReleasedAndRequested, wait: float
    ) -> Response:
        """Submit ``event`` unless the cluster's request is already queued or answered, then wait
        for the answer until ``wait`` seconds have passed."""
        state = runner.state.arbiter
        found = _cluster(state, pipeline, cluster)
        same = (
            event.request_id is not None
            and found is not None
            and found.request_id == event.request_id
        )
        asked = found is not None and (same or _released(state, event))
        settled = found is not None and bool(
            found.held or found.active_ranks or found.request_ended is not None
        )
        if same and found is not None and found.request is None and settled:
            pass  # this very request, asked before: answered below (granted, withdrawn, failed)
        elif same and found is not None and found.request is None:
            # Granted, then preempted before the caller read the grant (training took every
            # rank back): nothing is left to answer, so it is asked anew, under the same id.
            await submit_checked(event, f"{pipeline}/{cluster}")
        elif asked and found is not None and found.request is not None:
            # Queued by an earlier call whose long poll ended: wait in the same place.
            if found.request.priority is not event.priority:
                raise Refused(
                    f"{pipeline}/{cluster} already waits with priority "
                    f"{found.request.priority.name}; release it to ask with {event.priority.name}"
                )
        elif asked and found is not None and found.held:
            pass  # granted while the caller was away (its long poll had ended): the same answer
        else:
            await submit_checked(event, f"{pipeline}/{cluster}")
        deadline = anyio_now() + wait
        while True:
            answer = _answer(runner.state, pipeline, cluster)
            if answer is not None:
                return reply(answer, 200)
            left = deadline - anyio_now()
            if left <= 0:
                state = runner.state.arbiter
                waiting = _cluster(state, pipeline, cluster)
                since = waiting.request.t if waiting and waiting.request else state.now
                trouble = _engine_trouble(runner.state, waiting)
                raise StillWaiting(
                    f"{pipeline}/{cluster} is still waiting for GPUs after {wait:g} s "
                    f"(queued {max(runner.clock() - since, 0.0):.1f} s); the request stays "
                    f"queued: ask again to keep waiting in its place{trouble}"
                )
            await board.wait(min(left, RECHECK_S))

    async def request_gpus(request: Request) -> Response:
        authorize_started(request, name(request, "pipeline"))
        body = await read_object(request)
        only(body, ("priority", "estimate_trajectories", "timeout_s", "request_id"))
        pipeline, cluster = name(request, "pipeline"), name(request, "cluster")
        event = GpusRequested(
            t=runner.clock(),
            pipeline=pipeline,
            cluster=cluster,
            priority=priority(body),
            estimate_trajectories=count(body, "estimate_trajectories", required=False),
            request_id=body.get("request_id"),
        )
        return await long_poll(pipeline, cluster, event, wait_s(body))

    async def release_and_request(request: Request) -> Response:
        authorize_started(request, name(request, "pipeline"))
        body = await read_object(request)
        only(
            body,
            (
                "release_cluster",
                "cluster",
                "priority",
                "estimate_trajectories",
                "timeout_s",
                "request_id",
            ),
        )
        pipeline = name(request, "pipeline")
        release, cluster = text(body, "release_cluster"), text(body, "cluster")
        event = GpusReleasedAndRequested(
            t=runner.clock(),
            pipeline=pipeline,
            release_cluster=release,
            cluster=cluster,
            priority=priority(body),
            estimate_trajectories=count(body, "estimate_trajectories", required=False),
            request_id=body.get("request_id"),
        )
        return await long_poll(pipeline, cluster, event, wait_s(body))

    def status(request: Request) -> Response:
        return reply(arbiter_status(runner.state), 200)

    base = "/v1/arbiter/pipelines"
    return [
        Route("/v1/arbiter", read(status), methods=["GET"]),
        Route(base, register, methods=["POST"]),
        Route(f"{base}/{{pipeline}}/token", token, methods=["POST"]),
        Route(f"{base}/{{pipeline}}/unregister", action(build_unregister), methods=["POST"]),
        Route(f"{base}/{{pipeline}}/clusters/{{cluster}}/request", request_gpus, methods=["POST"]),
        Route(
            f"{base}/{{pipeline}}/clusters/{{cluster}}/release",
            action(build_release),
            methods=["POST"],
        ),
        Route(f"{base}/{{pipeline}}/release-and-request", release_and_request, methods=["POST"]),
        Route(f"{base}/{{pipeline}}/progress", action(build_progress), methods=["POST"]),
        Route(f"{base}/{{pipeline}}/progress/clear", action(build_clear), methods=["POST"]),
        Route(f"{base}/{{pipeline}}/rollout/open", action(build_rollout(True)), methods=["POST"]),
        Route(f"{base}/{{pipeline}}/rollout/close", action(build_rollout(False)), methods=["POST"]),
    ]


def anyio_now() -> float:
    """The event loop's clock (monotonic), for long-poll deadlines."""
    return anyio.current_time()


def _released(state: ArbiterState, event: GpusRequested | GpusReleasedAndRequested) -> bool:
    """Whether what ``event`` releases (if anything) is already released: then a cluster that
    holds its GPUs was granted for this very request, before its caller asked again."""
    if isinstance(event, GpusRequested):
        return True
    released = _cluster(state, event.pipeline, event.release_cluster)
    return released is None or not (released.held or released.active_ranks)


def _cluster(state: ArbiterState, pipeline: str, cluster: str) -> Cluster | None:
    found = state.pipelines.get(pipeline)
    return None if found is None else found.clusters.get(cluster)


def _granted(pipeline: str, cluster: Cluster, why: str) -> dict[str, Any]:
    gpus = cluster.active_gpus() if cluster.spec.is_generation else cluster.held
    return {
        "granted": True,
        "pipeline": pipeline,
        "cluster": cluster.spec.name,
        "gpus": list(gpus),
        "ranks": sorted(cluster.active_ranks) if cluster.spec.is_generation else [],
        "reason": why,
    }


def _answer(state: State, pipeline: str, name: str) -> dict[str, Any] | None:
    """The answer to ``pipeline/name``'s request once there is one (None: still waiting).

    A grant is answered only once no other deo worker may still hold memory on its GPUs (an
    engine there confirmed asleep, or gone). Raises :class:`Refused` when the request can no
    longer be answered: it failed (its GPUs are lost), was withdrawn (released) or its
    pipeline left. All of it is read from the state, which the log rebuilds: a caller waiting
    across a restart of deo gets the same answer."""
    cluster = _cluster(state.arbiter, pipeline, name)
    if cluster is None:
        raise Refused(f"{pipeline}/{name} is gone (its pipeline unregistered) before an answer")
    if cluster.request is not None:
        return None
    if cluster.held:
        if _engines_holding(state, cluster.held):
            return None  # the engines there have not confirmed their memory is released
        return _granted(pipeline, cluster, "granted")
    if cluster.active_ranks:
        if not _engine_awake(state, cluster):
            return None  # its engines are starting or waking
        if _engines_holding(state, cluster.active_gpus(), but=cluster.spec.engine_pool):
            return None  # another pipeline's engine there has not confirmed its sleep
        return _granted(pipeline, cluster, "granted")
    if cluster.request_ended is not None:
        raise Refused(f"{pipeline}/{name}: {cluster.request_ended}")
    if cluster.spec.is_generation:
        # Preempted before an answer (training took every rank back), not released: the caller
        # waits (408 at its deadline; asking again, with the same request id or none, queues it
        # anew).
        return None
    raise Refused(f"{pipeline}/{name}: the request was withdrawn (released) before an answer")


def _engines_holding(state: State, gpus: tuple[str, ...], *, but: str | None = None) -> list[str]:
    """deo's workers on ``gpus`` (of any pool but ``but``) that may still hold memory there:
    every one not confirmed asleep."""
    wanted = set(gpus)
    return [
        w.worker_id
        for w in state.workers.values()
        if w.pool != but and w.state is not WorkerState.SLEEPING and wanted & set(w.gpus)
    ]


def _engine_trouble(state: State, cluster: Cluster | None) -> str:
    """Why a cluster may wait long (GPUs of its mapping cordoned; an engine-run cluster's pool
    alerts), for a 408."""
    if cluster is None:
        return ""
    notes = []
    cordoned = sorted(set(cluster.spec.device_mapping) & state.arbiter.cordoned)
    if cordoned:
        notes.append(f"GPUs {cordoned} of its mapping are cordoned: nothing new goes there")
    name = cluster.spec.engine_pool
    if name is None:
        return "".join(f"; {note}" for note in notes)
    pool = state.pools.get(name)
    if pool is not None and (AlertName.CRASH_LOOP, name) in state.alerts:
        wait_s = max(pool.backoff_until_t - state.now, 0.0)
        notes.append(
            f"engine pool {name!r} is in a crash loop ({pool.failures} failures in a row; next "
            f"start in {wait_s:.0f} s): see its engines' output"
        )
    if (AlertName.NO_FREE_PORTS, name) in state.alerts:
        notes.append(f"every port of engine pool {name!r} is held")
    return "".join(f"; {note}" for note in notes)


def _engine_awake(state: State, cluster: Cluster) -> bool:
    """Whether a generation cluster has a rank whose engine is confirmed awake (always, for a
    cluster run by the pipeline itself)."""
    pool = cluster.spec.engine_pool
    if pool is None:
        return True
    found, _ = rank_engines([w for w in state.workers.values() if w.pool == pool], cluster)
    return any(found[r].state is WorkerState.ACTIVE for r in cluster.active_ranks if r in found)


# --- the operator's view -------------------------------------------------------------------------


def _shares(arbiter: ArbiterState) -> dict[tuple[str, str], Share]:
    """Each generation cluster's share, as the planner that runs computes it (none for a
    planner without shares)."""
    planner = planner_in_use(arbiter)
    return planner.shares(arbiter) if isinstance(planner, GapRatioPlanner) else {}


def arbiter_status(state: State) -> dict[str, Any]:
    """Pipelines, their clusters and priorities, GPUs held, generation share against target and
    waiting requests (with how long they have waited, by the state's clock)."""
    arbiter = state.arbiter
    shares = _shares(arbiter) if arbiter.gpus else {}
    pipelines = {}
    for pipeline_id, pipeline in arbiter.pipelines.items():
        clusters = {}
        for cluster in pipeline.clusters.values():
            spec = cluster.spec
            row: dict[str, Any] = {
                "kind": spec.kind.name,
                "device_mapping": list(spec.device_mapping),
                "tp_size": spec.tp_size,
                "held": list(cluster.held),
            }
            if spec.is_generation:
                share = shares.get((pipeline_id, spec.name))
                row["active_ranks"] = sorted(cluster.active_ranks)
                row["active_gpus"] = list(cluster.active_gpus())
                row["ranks"] = spec.ranks
                if spec.engine_pool is not None:
                    row["engine_pool"] = spec.engine_pool
                    found, _ = rank_engines(
                        [w for w in state.workers.values() if w.pool == spec.engine_pool],
                        cluster,
                    )
                    row["engines"] = {
                        str(r): {"worker": w.worker_id, "state": w.state.value}
                        for r, w in sorted(found.items())
                    }
                if share is not None:
                    row["share"] = {
                        "remaining_trajectories": share.remaining,
                        "eligible": share.eligible,
                        "probe": share.probe,
                        "target_gpus": share.target_gpus,
                        "active_gpus": share.active_gpus,
                    }
            if cluster.request is not None:
                row["waiting"] = {
                    "priority": cluster.request.priority.name,
                    "since_t": cluster.request.t,
                    "waited_s": max(state.now - cluster.request.t, 0.0),
                }
            clusters[spec.name] = row
        pipelines[pipeline_id] = {
            "clusters": clusters,
            "rollout_open": pipeline.rollout_open,
            "progress": {
                stream: {
                    "target_trajectories": p.target_trajectories,
                    "completed_trajectories": p.completed_trajectories,
                }
                for stream, p in sorted(pipeline.progress.items())
            },
        }
    return {
        "gpus": list(arbiter.gpus),
        "idle": sorted(arbiter.idle),
        "lost": sorted(arbiter.lost),
        "pipelines": pipelines,
    }


def arbiter_metrics(state: State) -> Iterator[Metric]:
    """The arbiter's figures for Prometheus (nothing without an arbiter)."""
    arbiter = state.arbiter
    if not arbiter.gpus:
        return
    gpus = GaugeMetricFamily(
        "deo_arbiter_gpus",
        "The arbiter's GPUs by use: held (training), generation (ranks awake), idle, lost",
        labels=["use"],
    )
    held = sum(len(c.held) for _, c in arbiter.clusters())
    awake = sum(len(c.active_gpus()) for _, c in arbiter.clusters())
    for use, number in (
        ("held", held),
        ("generation", awake),
        ("idle", len(arbiter.idle)),
        ("lost", len(arbiter.lost)),
    ):
        gpus.add_metric([use], number)
    cluster_gpus = GaugeMetricFamily(
        "deo_arbiter_cluster_gpus",
        "GPUs each cluster holds (training) or has awake (generation)",
        labels=["pipeline", "cluster", "kind"],
    )
    target = GaugeMetricFamily(
        "deo_arbiter_generation_target_gpus",
        "Each generation cluster's target share of GPUs (the gap-ratio planner's next plan)",
        labels=["pipeline", "cluster"],
    )
    remaining = GaugeMetricFamily(
        "deo_arbiter_generation_remaining_trajectories",
        "Trajectories each pipeline has left, as the planner counts them",
        labels=["pipeline", "cluster"],
    )
    waiting = GaugeMetricFamily(
        "deo_arbiter_request_waiting_seconds",
        "How long each waiting request has waited",
        labels=["pipeline", "cluster", "priority"],
    )
    for pipeline_id, cluster in arbiter.clusters():
        spec = cluster.spec
        number = len(cluster.active_gpus()) if spec.is_generation else len(cluster.held)
        cluster_gpus.add_metric([pipeline_id, spec.name, spec.kind.name], number)
        if cluster.request is not None:
            waiting.add_metric(
                [pipeline_id, spec.name, cluster.request.priority.name],
                max(state.now - cluster.request.t, 0.0),
            )
    for (pipeline_id, name), share in sorted(_shares(arbiter).items()):
        target.add_metric([pipeline_id, name], share.target_gpus)
        remaining.add_metric([pipeline_id, name], share.remaining)
    yield from (gpus, cluster_gpus, target, remaining, waiting)
