"""The arbiter's reducer: ``reduce_arbiter(state, event, planner) -> (state, commands)``.

Theory of operation. Each event is first checked against the state (unknown pipeline, GPU outside
the inventory, a request that contradicts its cluster's kind...): bad input raises a
:class:`~core.errors.DeoError` and the state given is the state kept. The event's bookkeeping
(requests, progress, open rollouts, lost GPUs) then gives the *pre* state and the event's own
ownership changes (a release frees or shrinks, a leaving pipeline is removed). The planner plans
on top of them; the whole plan is checked against the pre state
(:func:`~core.arbiter.invariants.plan_violations`). A sound plan is applied and becomes commands,
shrinks first (memory must be released before anyone else uses it), then expansions, then
answers to waiting requests. A plan with any violation is refused: the state stays as it was
before the event and a ``plan_refused`` alert carries every violation, so nothing of it runs.

Time comes only from events (``t`` orders nothing here but is kept on requests); the request
order is the state's own counter, so a log replays to the same commands.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import attrs

from core import commands as c
from core import events as e
from core.arbiter import events as ae
from core.arbiter.commands import ExpandGeneration, GrantGpus, RequestFailed, ShrinkGeneration
from core.arbiter.invariants import plan_violations
from core.arbiter.model import (
    PLANNER_SETTINGS_UNRECORDED,
    ArbiterState,
    Cluster,
    Pipeline,
    Priority,
    Progress,
    Request,
)
from core.arbiter.plan import ClusterKey, GpuOp, Plan, RankOp, apply_plan
from core.arbiter.planner import (
    Planner,
    observe_phase,
    observe_rate,
    overstaying,
    planner_for,
)
from core.errors import InvalidEvent, Refused, UnknownSubject
from core.vocabulary import AlertName

__all__ = ["ArbiterReducer", "planner_in_use", "reduce_arbiter"]

_Handler = Callable[[ArbiterState, Any], tuple[ArbiterState, Plan, list[c.Command]]]


def _pipeline(state: ArbiterState, pipeline_id: str, event: e.Event) -> Pipeline:
    pipeline = state.pipelines.get(pipeline_id)
    if pipeline is None:
        raise UnknownSubject(f"{type(event).__name__}: unknown pipeline {pipeline_id!r}")
    return pipeline


def _cluster(state: ArbiterState, pipeline_id: str, name: str, event: e.Event) -> Cluster:
    cluster = _pipeline(state, pipeline_id, event).clusters.get(name)
    if cluster is None:
        raise UnknownSubject(
            f"{type(event).__name__}: pipeline {pipeline_id!r} has no cluster {name!r}"
        )
    return cluster


def _active(state: ArbiterState, pipeline_id: str, t: float) -> ArbiterState:
    """``state`` with the pipeline's last sign of life at ``t``."""
    pipeline = state.pipelines[pipeline_id]
    return _put_pipeline(state, attrs.evolve(pipeline, activity_t=t))


def _put_pipeline(state: ArbiterState, pipeline: Pipeline) -> ArbiterState:
    return attrs.evolve(state, pipelines={**state.pipelines, pipeline.pipeline_id: pipeline})


def _put_cluster(state: ArbiterState, pipeline_id: str, cluster: Cluster) -> ArbiterState:
    pipeline = state.pipelines[pipeline_id]
    clusters = {**pipeline.clusters, cluster.spec.name: cluster}
    return _put_pipeline(state, attrs.evolve(pipeline, clusters=clusters))


def _release(state: ArbiterState, pipeline_id: str, cluster: Cluster, why: str) -> Plan:
    """The plan that gives back everything ``cluster`` holds."""
    name = cluster.spec.name
    frees = (
        (GpuOp(pipeline=pipeline_id, cluster=name, gpus=cluster.held, reason=why),)
        if cluster.held
        else ()
    )
    shrinks = (
        (
            RankOp(
                pipeline=pipeline_id,
                cluster=name,
                ranks=tuple(sorted(cluster.active_ranks)),
                reason=why,
            ),
        )
        if cluster.active_ranks
        else ()
    )
    return Plan(frees=frees, shrinks=shrinks)


def _servable(state: ArbiterState, cluster: Cluster) -> bool:
    """Whether a request of ``cluster`` could ever be answered (none of its GPUs lost that it
    needs: the whole mapping, or one bundle of a generation cluster)."""
    spec = cluster.spec
    if spec.is_generation:
        return any(not set(spec.bundle(r)) & state.lost for r in range(spec.ranks))
    return not set(spec.device_mapping) & state.lost


# --- handlers: (state, event) -> (pre state, the event's own plan, commands) -------------------


def _declared(state: ArbiterState, event: ae.ArbiterGpusDeclared) -> Any:
    if state.gpus:
        if set(state.gpus) == set(event.gpus):
            # The same GPUs (the first declaration's order stays); the planner settings may change.
            return attrs.evolve(state, planner=event.planner), Plan(), []
        raise Refused(
            f"ArbiterGpusDeclared: GPUs already declared as {list(state.gpus)}; a second "
            f"declaration must name the same GPUs (in any order)"
        )
    usable = frozenset(event.gpus) - state.lost
    return attrs.evolve(state, gpus=event.gpus, idle=usable, planner=event.planner), Plan(), []


def _pipeline_registered(state: ArbiterState, event: ae.PipelineRegistered) -> Any:
    if event.pipeline in state.pipelines:
        raise Refused(f"PipelineRegistered: pipeline {event.pipeline!r} is already registered")
    pipeline = Pipeline(pipeline_id=event.pipeline, activity_t=event.t, registered_t=event.t)
    state = _put_pipeline(state, pipeline)
    for spec in event.clusters:  # each checked as its own ClusterRegistered; one refusal: none
        state, _, _ = _cluster_registered(
            state, ae.ClusterRegistered(t=event.t, pipeline=event.pipeline, spec=spec)
        )
    return state, Plan(), []


def _cluster_registered(state: ArbiterState, event: ae.ClusterRegistered) -> Any:
    pipeline = _pipeline(state, event.pipeline, event)
    spec = event.spec
    where = f"ClusterRegistered: {event.pipeline}/{spec.name}"
    if spec.name in pipeline.clusters:
        raise Refused(f"{where} is already registered")
    if not state.gpus:
        raise Refused(f"{where}: no GPUs declared yet (ArbiterGpusDeclared first)")
    outside = [g for g in spec.device_mapping if g not in state.gpus]
    if outside:
        raise UnknownSubject(
            f"{where}: device mapping names GPUs outside the inventory {list(state.gpus)}:"
            f" {outside}"
        )
    if spec.is_generation and pipeline.generation() is not None:
        raise Refused(f"{where}: pipeline already has a generation cluster")
    return _put_cluster(state, event.pipeline, Cluster(spec=spec)), Plan(), []


def _pipeline_unregistered(state: ArbiterState, event: ae.PipelineUnregistered) -> Any:
    pipeline = _pipeline(state, event.pipeline, event)
    plan = Plan()
    why = f"pipeline {event.pipeline} left"
    for cluster in pipeline.clusters.values():
        plan = plan.then(_release(state, event.pipeline, cluster, why))
    removed = tuple((event.pipeline, name) for name in pipeline.clusters)
    return state, plan.then(Plan(removed=removed)), []


def _request(
    state: ArbiterState,
    event: ae.GpusRequested | ae.GpusReleasedAndRequested,
) -> tuple[ArbiterState, list[c.Command]]:
    cluster = _cluster(state, event.pipeline, event.cluster, event)
    where = f"{type(event).__name__}: {event.pipeline}/{event.cluster}"
    generation = cluster.spec.is_generation
    if generation != (event.priority is Priority.GENERATION):
        raise Refused(
            f"{where}: a {cluster.spec.kind.name} cluster cannot ask with priority"
            f" {event.priority.name} (GENERATION is for generation clusters only)"
        )
    if cluster.request is not None:
        raise Refused(f"{where} already has a waiting request")
    if cluster.held:
        raise Refused(f"{where} already holds {list(cluster.held)}; release them first")
    if not _servable(state, cluster):
        raise Refused(f"{where}: its GPUs are lost {sorted(state.lost)}; it can never be served")
    asked = attrs.evolve(cluster, request_id=event.request_id, request_ended=None)
    state = _put_cluster(state, event.pipeline, asked)
    cluster = _cluster(state, event.pipeline, event.cluster, event)
    if generation and cluster.active_ranks:
        answer = GrantGpus(
            reason=f"{event.pipeline}/{event.cluster} already has ranks awake",
            pipeline=event.pipeline,
            cluster=event.cluster,
            priority=event.priority,
            gpus=cluster.active_gpus(),
        )
        return state, [answer]
    request = Request(
        priority=event.priority,
        seq=state.next_seq,
        t=event.t,
        estimate_trajectories=event.estimate_trajectories,
    )
    state = _active(attrs.evolve(state, next_seq=state.next_seq + 1), event.pipeline, event.t)
    return _put_cluster(state, event.pipeline, attrs.evolve(cluster, request=request)), []


def _requested(state: ArbiterState, event: ae.GpusRequested) -> Any:
    state, commands = _request(state, event)
    return state, Plan(), commands


def _released_state(state: ArbiterState, pipeline_id: str, cluster: Cluster) -> ArbiterState:
    """``state`` with ``cluster``'s request withdrawn; releasing a generation cluster also ends
    its pipeline's rollout (its durable demand), so the same step does not wake it again."""
    ended = (
        "the request was withdrawn (released) before an answer"
        if cluster.request is not None
        else "its GPUs were released since the grant"
    )
    state = _put_cluster(
        state, pipeline_id, attrs.evolve(cluster, request=None, request_ended=ended)
    )
    if cluster.spec.is_generation:
        pipeline = state.pipelines[pipeline_id]
        state = _put_pipeline(state, attrs.evolve(pipeline, rollout_open=False))
    return state


def _released(state: ArbiterState, event: ae.GpusReleased) -> Any:
    cluster = _cluster(state, event.pipeline, event.cluster, event)
    plan = _release(state, event.pipeline, cluster, f"{event.pipeline}/{event.cluster} released")
    return _released_state(state, event.pipeline, cluster), plan, []


def _released_and_requested(state: ArbiterState, event: ae.GpusReleasedAndRequested) -> Any:
    cluster = _cluster(state, event.pipeline, event.release_cluster, event)
    why = f"{event.pipeline}/{event.release_cluster} released (then {event.cluster} requested)"
    plan = _release(state, event.pipeline, cluster, why)
    released = _released_state(state, event.pipeline, cluster)
    # The request is judged as if the release had happened; when it is refused this raises and
    # the release is not kept either.
    requested, commands = _request(apply_plan(released, plan), event)
    # Answered at once (commands), no request waits; else the request queued in ``requested``.
    request = requested.pipelines[event.pipeline].clusters[event.cluster].request
    target = released.pipelines[event.pipeline].clusters[event.cluster]
    asked = attrs.evolve(target, request=request, request_id=event.request_id, request_ended=None)
    pre = _put_cluster(released, event.pipeline, asked)
    if request is not None:  # a request queued is a sign of life, as in _request
        pre = _active(pre, event.pipeline, event.t)
    return attrs.evolve(pre, next_seq=requested.next_seq), plan, commands


def _progress(state: ArbiterState, event: ae.ProgressReported) -> Any:
    pipeline = _pipeline(state, event.pipeline, event)
    report = Progress(
        target_trajectories=event.target_trajectories,
        completed_trajectories=event.completed_trajectories,
    )
    progress = {**pipeline.progress, event.stream: report}
    settings = state.planner or PLANNER_SETTINGS_UNRECORDED
    changed = observe_rate(
        attrs.evolve(pipeline, progress=progress, activity_t=event.t),
        event.t,
        over_awake_gpu_s=settings.rate_over_awake_gpu_s,
    )
    return _put_pipeline(state, changed), Plan(), []


def _progress_cleared(state: ArbiterState, event: ae.ProgressCleared) -> Any:
    pipeline = _pipeline(state, event.pipeline, event)
    progress = (
        {}
        if event.stream is None
        else {k: v for k, v in pipeline.progress.items() if k != event.stream}
    )
    return _put_pipeline(state, attrs.evolve(pipeline, progress=progress)), Plan(), []


def _rollout(state: ArbiterState, event: ae.RolloutOpened | ae.RolloutClosed) -> Any:
    pipeline = _pipeline(state, event.pipeline, event)
    opened = isinstance(event, ae.RolloutOpened)
    changed = attrs.evolve(pipeline, rollout_open=opened)
    if opened:
        changed = attrs.evolve(changed, activity_t=event.t)
    return _put_pipeline(state, changed), Plan(), []


def _tick(state: ArbiterState, event: e.Tick) -> Any:
    return state, Plan(), []


def _gpu_lost(state: ArbiterState, event: e.GpuLost) -> Any:
    if event.gpu_id not in state.gpus or event.gpu_id in state.lost:
        # Another GPU on the same event stream (deo's reducer ignores unknown GPUs too).
        return state, Plan(), []
    state = attrs.evolve(state, lost=state.lost | {event.gpu_id}, idle=state.idle - {event.gpu_id})
    shrinks = []
    commands: list[c.Command] = []
    for pipeline_id, cluster in list(state.clusters()):
        hit = tuple(
            r for r in sorted(cluster.active_ranks) if event.gpu_id in cluster.spec.bundle(r)
        )
        if hit:
            shrinks.append(
                RankOp(
                    pipeline=pipeline_id,
                    cluster=cluster.spec.name,
                    ranks=hit,
                    reason=f"GPU {event.gpu_id} lost: {event.error}",
                )
            )
        if cluster.request is not None and not _servable(state, cluster):
            why = f"GPU {event.gpu_id} lost: the request can never be served"
            ended = attrs.evolve(cluster, request=None, request_ended=f"the request failed: {why}")
            state = _put_cluster(state, pipeline_id, ended)
            commands.append(
                RequestFailed(
                    reason=why,
                    pipeline=pipeline_id,
                    cluster=cluster.spec.name,
                )
            )
    return state, Plan(shrinks=tuple(shrinks)), commands


HANDLERS: Mapping[type[e.Event], _Handler] = MappingProxyType(
    {
        ae.ArbiterGpusDeclared: _declared,
        ae.PipelineRegistered: _pipeline_registered,
        ae.ClusterRegistered: _cluster_registered,
        ae.PipelineUnregistered: _pipeline_unregistered,
        ae.GpusRequested: _requested,
        ae.GpusReleased: _released,
        ae.GpusReleasedAndRequested: _released_and_requested,
        ae.ProgressReported: _progress,
        ae.ProgressCleared: _progress_cleared,
        ae.RolloutOpened: _rollout,
        ae.RolloutClosed: _rollout,
        e.GpuLost: _gpu_lost,
        e.Tick: _tick,
    }
)


def _spec_of(state: ArbiterState, key: ClusterKey) -> Cluster:
    return state.pipelines[key[0]].clusters[key[1]]


def _rank_command(
    kind: type[ShrinkGeneration | ExpandGeneration], pre: ArbiterState, op: RankOp
) -> c.Command:
    spec = _spec_of(pre, op.key).spec
    gpus = tuple(g for r in op.ranks for g in spec.bundle(r))
    return kind(
        reason=op.reason, pipeline=op.pipeline, cluster=op.cluster, ranks=op.ranks, gpus=gpus
    )


def _commands(pre: ArbiterState, plan: Plan, after: ArbiterState) -> list[c.Command]:
    out: list[c.Command] = [_rank_command(ShrinkGeneration, pre, op) for op in plan.shrinks]
    out += [_rank_command(ExpandGeneration, pre, op) for op in plan.expands]
    for grant in plan.grants:
        request = _spec_of(pre, grant.key).request
        assert request is not None  # the planner grants waiting requests only
        out.append(
            GrantGpus(
                reason=grant.reason,
                pipeline=grant.pipeline,
                cluster=grant.cluster,
                priority=request.priority,
                gpus=grant.gpus,
            )
        )
    for pipeline_id, cluster in after.clusters():
        if cluster.spec.is_generation and cluster.request and cluster.active_ranks:
            out.append(
                GrantGpus(
                    reason=f"{pipeline_id}/{cluster.spec.name} has"
                    f" {len(cluster.active_ranks)} rank(s) awake",
                    pipeline=pipeline_id,
                    cluster=cluster.spec.name,
                    priority=cluster.request.priority,
                    gpus=cluster.active_gpus(),
                )
            )
    return out


def _woken(pre: ArbiterState, after: ArbiterState) -> ArbiterState:
    """``after`` with ``woken_t`` set for each pipeline whose generation woke from zero ranks."""
    for pipeline_id, pipeline in after.pipelines.items():
        cluster = pipeline.generation()
        before = pre.pipelines.get(pipeline_id)
        was = before.generation() if before is not None else None
        if cluster and cluster.active_ranks and was is not None and not was.active_ranks:
            woken = attrs.evolve(after.pipelines[pipeline_id], woken_t=after.now)
            after = _put_pipeline(after, woken)
    return after


def _phases(before: ArbiterState, after: ArbiterState) -> ArbiterState:
    """``after`` with each pipeline's generation phases followed
    (:func:`~core.arbiter.planner.observe_phase`)."""
    for pipeline_id, pipeline in after.pipelines.items():
        followed = observe_phase(before.pipelines.get(pipeline_id), pipeline, after.now)
        if followed is not pipeline:
            after = _put_pipeline(after, followed)
    return after


def _answered(after: ArbiterState, commands: list[c.Command]) -> ArbiterState:
    for command in commands:
        if isinstance(command, GrantGpus):
            cluster = after.pipelines[command.pipeline].clusters[command.cluster]
            after = _put_cluster(after, command.pipeline, attrs.evolve(cluster, request=None))
    return after


def reduce_arbiter(
    state: ArbiterState, event: e.Event, planner: Planner | None = None
) -> tuple[ArbiterState, list[c.Command]]:
    """One step: the state after ``event`` and the commands to carry out, in order.

    ``planner``: the one the state's recorded settings describe unless given
    (:func:`~core.arbiter.planner.planner_for`). Raises a
    :class:`~core.errors.DeoError` on bad input, leaving ``state`` as it was; a plan that breaks
    an invariant is refused with a ``plan_refused`` alert and ``state`` is kept.
    """
    handler = HANDLERS.get(type(event))
    if handler is None:
        raise InvalidEvent(f"{type(event).__name__} is not an event the arbiter knows")
    pre, own, commands = handler(attrs.evolve(state, now=max(state.now, event.t)), event)
    chosen: Planner = planner if planner is not None else planner_for(pre.planner)
    planned = chosen.plan(apply_plan(pre, own))
    plan = own.then(planned)
    violations = plan_violations(pre, plan)
    if violations:
        alert = c.RaiseAlert(
            reason=f"{chosen.name} plan after {type(event).__name__} refused: "
            + "; ".join(violations),
            alert=AlertName.PLAN_REFUSED,
            subject="arbiter",
        )
        return state, [alert]
    after = _woken(pre, apply_plan(pre, plan))
    planned_commands = _commands(pre, plan, after)
    after = _phases(state, _answered(after, planned_commands))
    after, alerts = _overstaying_alerts(after, chosen)
    after, cordoned_alerts = _cordoned_hold_alerts(after)
    return after, planned_commands + commands + alerts + cordoned_alerts


def _cordoned_hold_alerts(after: ArbiterState) -> tuple[ArbiterState, list[c.Command]]:
    """An alert for each holder whose held GPUs became cordoned (a hold is never revoked: it
    stays until released), resolved once it released them or they are uncordoned."""
    found = {
        f"{pipeline_id}/{cluster.spec.name}": sorted(set(cluster.held) & after.cordoned)
        for pipeline_id, cluster in after.clusters()
        if set(cluster.held) & after.cordoned
    }
    alerts = _alert_changes(
        AlertName.HOLD_ON_CORDONED,
        after.holds_on_cordoned,
        found,
        raised=lambda name: (
            f"{name} holds GPUs {found[name]}, which are cordoned: a hold is not"
            " revoked, so it keeps them until it releases them; nothing new goes there"
        ),
        resolved=lambda name: f"{name} no longer holds a cordoned GPU",
    )
    return attrs.evolve(after, holds_on_cordoned=frozenset(found)), alerts


def _overstaying_alerts(
    after: ArbiterState, planner: Planner
) -> tuple[ArbiterState, list[c.Command]]:
    """``after`` with its overstaying holders (:func:`~core.arbiter.planner.overstaying`)
    brought up to date, and an alert raised for each new one and resolved for each gone."""
    found = overstaying(after, planner)
    alerts = _alert_changes(
        AlertName.HOLDER_OVERSTAYING,
        after.overstaying,
        found,
        raised=lambda name: f"{found[name]}: requests of lower priority are served ahead of it",
        resolved=lambda name: f"{name} no longer holds up a waiting request",
    )
    return attrs.evolve(after, overstaying=frozenset(found)), alerts


def _alert_changes(
    alert: AlertName,
    known: frozenset[str],
    found: Mapping[str, object],
    *,
    raised: Callable[[str], str],
    resolved: Callable[[str], str],
) -> list[c.Command]:
    """``alert`` raised for each subject in ``found`` but not ``known``, resolved for each
    subject ``known`` but no longer found."""
    commands: list[c.Command] = [
        c.RaiseAlert(reason=raised(name), alert=alert, subject=name)
        for name in sorted(set(found) - known)
    ]
    commands += [
        c.ResolveAlert(reason=resolved(name), alert=alert, subject=name)
        for name in sorted(known - set(found))
    ]
    return commands


def planner_in_use(state: ArbiterState) -> Planner:
    """The planner :func:`reduce_arbiter` runs for ``state`` when given none: status views
    compute their shares and targets with it, so they show the plans that run."""
    return planner_for(state.planner)


class ArbiterReducer:
    """Feed events, read commands; ``state`` is the state after the last accepted event."""

    def __init__(self, state: ArbiterState | None = None, *, planner: Planner | None = None):
        self.state = state if state is not None else ArbiterState()
        #: None: the planner the state's recorded settings describe.
        self.planner: Planner | None = planner

    def step(self, event: e.Event) -> list[c.Command]:
        self.state, commands = reduce_arbiter(self.state, event, self.planner)
        return commands
