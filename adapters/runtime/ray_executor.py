"""The Ray executor: the core's worker commands carried out on the nodes of a Ray cluster.

``[executor] kind = "ray"`` makes ``deo run`` connect to a Ray cluster (``address``) and run each
worker inside a detached, named actor (:class:`~adapters.runtime.ray_host.WorkerHost`) that owns
its process on a Ray node. What it reports is what the local executor reports: ``WorkerStarted``
(with the pid and start time on its node), ``SpawnFailed``, ``WorkerExited`` with the exit code.

- Names: every actor lives in the Ray namespace of its deo log (``namespace``, by default
  ``deo-`` and a digest of the log's path) and is named ``worker:WORKER_ID``. A deo that is
  restarted (even after kill -9) finds its actors by these names and adopts them
  (:meth:`RayExecutor.reconcile`); actors of the namespace the log does not name are removed
  (:meth:`RayExecutor.stop_strays`): no duplicate, no orphan.
- GPUs are node-qualified: ``NODE:INDEX``, where NODE is the node's deo name, declared as the
  custom resource ``deo-node:NODE`` when its Raylet starts (``ray start --resources
  '{"deo-node:gpu-a": 1}'``), and INDEX the GPU's CUDA index on that node. A worker on
  ``gpu-a:2,gpu-a:3`` is an actor placed on node gpu-a (it asks for a sliver of the node's
  resource) that reserves ``deo-gpu:gpu-a:2``, ``deo-gpu:gpu-a:3`` and 2 of Ray's ``GPU`` resources
  there, and the worker gets
  ``CUDA_VISIBLE_DEVICES=2,3``: the core's choice, which is what the log records and what cordons
  and GPU losses refer to. Each GPU is also declared as the custom resource ``deo-gpu:NODE:INDEX``
  and the actor asks for those of its GPUs, so Ray reserves exactly them; a spawn whose GPUs Ray
  counts under other indices fails (``SpawnFailed``) rather than share a GPU with something Ray
  placed. The GPUs of one worker must be on one node. CPU workers (no GPU) go
  wherever Ray finds room.
- Engines (``kind = "engine"`` pools) run in their actors like any worker; ``{host}`` in an
  engine's argv becomes the address Ray knows its node by, and deo reaches the engine there (its
  router, engine control, metrics and health: :meth:`RayExecutor.engine_host`). Whether the
  server answering on an engine's port is the engine's own is asked of its actor, which reads
  the node's ``/proc`` (:meth:`RayExecutor.engine_port_owned`).
- Drain sends the pool's signal to the worker alone; terminate SIGTERM and kill SIGKILL go to its
  process group, as locally. The core's deadlines escalate.
- Faults: an actor that dies (removed, its process killed) ends its worker (the worker dies with
  it) and is reported as ``WorkerExited`` without a code. A node that leaves the cluster loses
  its workers (their actors die with it) and its GPUs: ``GpuLost`` for each, so the core cordons
  them and places replacements elsewhere. When the cluster cannot be asked (the head does not
  answer within ``call_timeout_s``), deo says so once with ``ClusterUnreachable`` (a
  ``cluster_unreachable`` alert) and ``ClusterReachable`` when it answers again; meanwhile no
  worker is taken for lost and no GPU for gone on a guess.

Ray's client calls block, so each runs in a worker thread (:func:`anyio.to_thread.run_sync`); one
loop collects the exits of every worker with a single ``ray.wait``.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import anyio
import attrs
import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError

from adapters.runtime.config_file import RunSettings
from adapters.runtime.processes import signal_for
from adapters.runtime.ray_host import GpuAgent, WorkerHost
from adapters.sources.heartbeat import HEARTBEAT_ENV, heartbeat_path
from adapters.sources.nvml import (
    GpuMonitor,
    NvmlSettings,
    ReadFailed,
    held_gpus,
    sample_filter,
)
from core import (
    ClusterReachable,
    ClusterUnreachable,
    Command,
    ConfigError,
    DrainWorker,
    Event,
    GpuLost,
    KillWorker,
    LeftoverProcesses,
    LeftoverProcessesStopped,
    SpawnFailed,
    SpawnWorker,
    State,
    TerminateWorker,
    WorkerAdopted,
    WorkerExited,
    WorkerLost,
    WorkerStarted,
)
from core.vocabulary import AlertName

__all__ = [
    "ACTOR_PREFIX",
    "GPU_RESOURCE_PREFIX",
    "NODE_RESOURCE_PREFIX",
    "RayExecutor",
    "actor_name",
    "connect_ray_executor",
    "default_namespace",
    "split_gpu_id",
]
log = logging.getLogger("deo.ray")

#: A node's deo name is declared as this custom resource plus the name (amount 1).
NODE_RESOURCE_PREFIX = "deo-node:"
#: Each GPU deo may use is declared as this custom resource plus ``NODE:INDEX`` (amount 1): a
#: worker's actor asks for its GPUs' resources, so Ray reserves exactly the GPUs the core chose.
GPU_RESOURCE_PREFIX = "deo-gpu:"
#: Actors are named this plus the worker id, in the namespace of the deo log.
ACTOR_PREFIX = "worker:"
#: The sliver of a node's name resource an actor asks for: it only pins the actor to the node.
_NODE_SLIVER = 0.001
_Signalling = DrainWorker | TerminateWorker | KillWorker
#: How many ended workers are remembered (a late command for one of them is ignored).
_FINISHED_KEPT = 4096
#: Ray's setting (read from the environment at ``ray.init``) for how long a driver waits for an
#: unreachable head before it exits, and the value deo gives it: a week.
_GCS_RECONNECT_ENV = "RAY_gcs_rpc_server_reconnect_timeout_s"
_GCS_RECONNECT_S = 7 * 86_400


def default_namespace(log_path: Path) -> str:
    """The Ray namespace of the deo log at ``log_path``: its name and a digest of its path."""
    resolved = str(log_path.resolve())
    return f"deo-{log_path.stem}-{hashlib.sha256(resolved.encode()).hexdigest()[:12]}"


def actor_name(worker_id: str) -> str:
    """The name of the actor that hosts ``worker_id``."""
    return ACTOR_PREFIX + worker_id


def split_gpu_id(gpu_id: str) -> tuple[str, str]:
    """``NODE:INDEX`` -> (NODE, INDEX); ValueError naming the id when it has no node."""
    node, sep, index = gpu_id.rpartition(":")
    if not sep or not node or not index:
        raise ValueError(f"GPU id {gpu_id!r} is not node-qualified (NODE:INDEX)")
    return node, index


@attrs.define
class _Worker:
    worker_id: str
    pool: str | None
    gpus: tuple[str, ...]
    #: Its Ray actor, once created.
    actor: Any = None
    #: The ``wait`` call of its actor, once the worker runs.
    waiting: Any = None
    started: bool = False
    #: The address of its node (deo reaches an engine there), once the worker runs.
    host: str | None = None


class RayExecutor:
    """Carries out worker commands with Ray actors; reports results as events through ``emit``.

    Call :meth:`connect` first (it blocks on Ray: run it in a thread or at start-up), then run
    :meth:`run` in a task group beside the code that calls :meth:`execute`. ``state`` gives the
    core's current state (its pools and GPUs, for node losses and an unreachable head).
    Cancelling :meth:`run` leaves every actor, and so every worker, running.
    """

    def __init__(
        self,
        emit: Callable[[Event], None],
        *,
        clock: Callable[[], float],
        state: Callable[[], State],
        log_dir: Path,
        address: str,
        namespace: str,
        environ: Mapping[str, str] | None = None,
        secret_environ: Callable[[str], Mapping[str, str]] | None = None,
        poll_interval_s: float = 0.5,
        spawn_timeout_s: float = 120.0,
        call_timeout_s: float = 30.0,
        nvml: NvmlSettings | None = None,
        gpus: Iterable[str] = (),
        out: Callable[[str], None] = print,
    ) -> None:
        self._emit = emit
        self._clock = clock
        self._state = state
        self._log_dir = log_dir
        self.address = address
        self.namespace = namespace
        self._environ = dict(environ or {})
        self._secret_environ = secret_environ
        self._poll_interval_s = poll_interval_s
        self._spawn_timeout_s = spawn_timeout_s
        self._call_timeout_s = call_timeout_s
        self._workers: dict[str, _Worker] = {}
        #: The workers that ended most recently, oldest first (bounded: a long run with churn
        #: ends millions).
        self._finished: OrderedDict[str, None] = OrderedDict()
        self._pending: dict[str, list[_Signalling]] = {}
        #: One GPU worker placed at a time per node: Ray hands a node's lowest free GPU indices to
        #: whichever actor it places first, so concurrent placements can swap two workers' GPUs.
        self._placing: dict[str, anyio.Lock] = {}
        self._task_group: anyio.abc.TaskGroup | None = None
        self._host_class: Any = None
        #: Node names seen alive, and those whose loss was reported.
        self._nodes_alive: set[str] = set()
        self._nodes_lost: set[str] = set()
        self._head_down = False
        #: GPU health (``[nvml]``) of these GPUs, read on their nodes.
        self._nvml = nvml
        self._gpus = tuple(gpus)
        self._out = out

    # --- connection -------------------------------------------------------------------------------

    def connect(self) -> None:
        """Join the Ray cluster at ``address`` in this log's namespace (blocks)."""
        # A driver that loses the head ends its own process after this long (Ray's default:
        # 60 s). deo must outlive an outage of the head, holding its pools meanwhile.
        os.environ.setdefault(_GCS_RECONNECT_ENV, str(_GCS_RECONNECT_S))
        if not ray.is_initialized():
            ray.init(
                address=self.address,
                namespace=self.namespace,
                log_to_driver=False,
                configure_logging=False,
            )
        self._host_class = ray.remote(WorkerHost)

    # --- commands ---------------------------------------------------------------------------------

    async def execute(self, command: Command) -> None:
        """Carry out one command. A spawn finishes in the background: creating a named actor is
        a blocking call to the cluster's head, and placing it can wait."""
        if isinstance(command, SpawnWorker):
            self._spawn(command)
        elif isinstance(command, DrainWorker | TerminateWorker | KillWorker):
            signal_for(command)  # a bad signal name fails here
            worker = self._workers.get(command.worker_id)
            if worker is None:
                return  # ended (its exit is reported) or never spawned here
            if worker.started:
                self._signal(worker, command)
            else:
                self._pending.setdefault(command.worker_id, []).append(command)

    def _spawn(self, command: SpawnWorker) -> None:
        worker_id = command.worker_id
        if worker_id in self._workers or worker_id in self._finished:
            return
        try:
            options = self._placement(command.gpus)
        except ValueError as exc:
            self._fail(worker_id, str(exc))
            return
        worker = _Worker(worker_id, command.pool, tuple(command.gpus))
        self._workers[worker_id] = worker
        env = {
            **self._environ,
            HEARTBEAT_ENV: str(self.heartbeat_file(worker_id)),
            **command.env,
            **(self._secret_environ(worker_id) if self._secret_environ else {}),
        }
        if command.gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(split_gpu_id(g)[1] for g in command.gpus)
        log_path = str(self._log_dir / f"{worker_id}.log")
        engine = command.port is not None
        self._later(self._start, worker, options, list(command.argv), env, log_path, engine)

    def _placement(self, gpus: Iterable[str]) -> dict[str, Any]:
        gpus = list(gpus)
        nodes = {split_gpu_id(gpu)[0] for gpu in gpus}
        if not nodes:
            return {}
        if len(nodes) > 1:
            raise ValueError(
                f"GPUs {', '.join(gpus)} are on {len(nodes)} nodes; one worker's GPUs must share "
                f"a node"
            )
        (node,) = nodes
        # The GPUs' own resources make Ray reserve exactly these GPUs; num_gpus keeps Ray's
        # count of the node's GPUs true for anything else it places there.
        resources = {GPU_RESOURCE_PREFIX + gpu: 1.0 for gpu in gpus}
        resources[NODE_RESOURCE_PREFIX + node] = _NODE_SLIVER
        return {"num_gpus": len(gpus), "resources": resources}

    async def _start(
        self,
        worker: _Worker,
        options: dict[str, Any],
        argv: list[str],
        env: dict[str, str],
        log_path: str,
        engine: bool,
    ) -> None:
        def create() -> tuple[Any, Any]:
            actor = self._host_class.options(
                name=actor_name(worker.worker_id),
                namespace=self.namespace,
                lifetime="detached",
                max_restarts=0,
                num_cpus=0,
                **options,
            ).remote()
            return actor, actor.start.remote(argv, env, log_path, engine)

        if not worker.gpus:
            await self._place(worker, create)
            return
        node = split_gpu_id(worker.gpus[0])[0]
        async with self._placing.setdefault(node, anyio.Lock()):
            await self._place(worker, create)

    async def _place(self, worker: _Worker, create: Callable[[], tuple[Any, Any]]) -> None:
        try:
            # Ray registers a named actor with a synchronous call to its head, which stalls for
            # as long as the head does not answer: never on deo's loop.
            worker.actor, started = await anyio.to_thread.run_sync(create, abandon_on_cancel=True)
        except Exception as exc:  # whatever Ray raises (a timeout, a name taken) fails the spawn
            self._fail(worker.worker_id, f"Ray could not create its actor: {_first_line(exc)}")
            return
        await self._finish_spawn(worker, started)

    async def _finish_spawn(self, worker: _Worker, started: Any) -> None:
        try:
            info = await self._get(started, self._spawn_timeout_s)
        except GetTimeoutError:
            await self._remove(worker.actor)
            self._fail(
                worker.worker_id,
                f"Ray placed no actor within {self._spawn_timeout_s:g}s (resources taken, or no "
                f"node declares {self._resources_named(worker.gpus)})",
            )
            return
        except RayError as exc:
            await self._remove(worker.actor)
            self._fail(worker.worker_id, f"its Ray actor failed: {_first_line(exc)}")
            return
        error = info["error"]
        if error is None and (info["pid"] is None or info["start_time"] is None):
            error = "no process started"
        if error is None:
            error = _gpu_mismatch(worker.gpus, info.get("ray_gpu_ids") or [])
        if error is not None:
            await self._remove(worker.actor)
            self._fail(worker.worker_id, error)
            return
        worker.host = info.get("host")
        self._emit(
            WorkerStarted(
                t=self._clock(),
                worker_id=worker.worker_id,
                pid=info["pid"],
                start_time=info["start_time"],
            )
        )
        self._watch(worker)

    @staticmethod
    def _resources_named(gpus: Iterable[str]) -> str:
        named = [NODE_RESOURCE_PREFIX + split_gpu_id(g)[0] for g in gpus][:1]
        named += [GPU_RESOURCE_PREFIX + g for g in gpus]
        return ", ".join(named) if named else "room for it"

    def _fail(self, worker_id: str, error: str) -> None:
        self._workers.pop(worker_id, None)
        self._pending.pop(worker_id, None)
        self._ended(worker_id)
        self._emit(SpawnFailed(t=self._clock(), worker_id=worker_id, error=error))

    def _ended(self, worker_id: str) -> None:
        self._finished[worker_id] = None
        while len(self._finished) > _FINISHED_KEPT:
            self._finished.popitem(last=False)

    def _watch(self, worker: _Worker) -> None:
        worker.started = True
        worker.waiting = worker.actor.wait.remote()
        for pending in self._pending.pop(worker.worker_id, []):
            self._signal(worker, pending)

    def _signal(self, worker: _Worker, command: _Signalling) -> None:
        sig, group = signal_for(command)
        # Fire and forget: the answer only says whether the worker was still there, and its
        # exit comes through ``wait`` either way.
        worker.actor.signal.remote(sig.name, group)

    # --- engines (adapters.runtime.engine_hosts.EngineHosts) -----------------------------------

    def heartbeat_file(self, worker_id: str) -> Path:
        """The file worker ``worker_id`` touches to say it is alive (on a shared folder)."""
        return heartbeat_path(self._log_dir, worker_id)

    def engine_host(self, worker_id: str) -> str | None:
        """The address of the node engine ``worker_id`` runs on; None until it runs here (placed
        and started, or adopted after a restart)."""
        worker = self._workers.get(worker_id)
        return None if worker is None or not worker.started else worker.host

    async def engine_port_owned(self, worker_id: str, port: int, pid: int) -> bool | None:
        """Whether the socket listening on ``port`` on the engine's node is held by the engine's
        process (its actor reads the node's ``/proc``); RuntimeError or Ray's error when the
        actor cannot be asked now."""
        worker = self._workers.get(worker_id)
        if worker is None or not worker.started:
            raise RuntimeError(f"{worker_id} does not run here (yet)")
        answer = await self._get(worker.actor.port_held.remote(port), self._call_timeout_s)
        return None if answer is None else bool(answer)

    # --- restart ----------------------------------------------------------------------------------

    async def reconcile(self, state: State) -> list[Event]:
        """Events that bring a recovered state in line with the actors really there: each
        worker's actor is adopted (its exit, if it ended while deo was down, then follows with
        its code) or the worker is recorded lost."""
        names = set(await anyio.to_thread.run_sync(_named_actors))
        events: list[Event] = []
        node_hosts: dict[str, str] | None = None  # read once, if an engine's actor does not say
        for worker in state.workers.values():
            name = actor_name(worker.worker_id)
            if name not in names:
                why = f"no Ray actor {name!r} in namespace {self.namespace!r}"
                events.append(WorkerLost(t=self._clock(), worker_id=worker.worker_id, reason=why))
                continue
            try:
                actor = await anyio.to_thread.run_sync(_get_actor, name, self.namespace)
                info = await self._get(actor.info.remote(), self._call_timeout_s)
            except (RayError, ValueError) as exc:
                why = f"its Ray actor does not answer: {_first_line(exc)}"
                events.append(WorkerLost(t=self._clock(), worker_id=worker.worker_id, reason=why))
                continue
            pid, start = info["pid"], info["start_time"]
            if pid is None or start is None:
                await self._remove(actor)
                why = f"its Ray actor started no process ({info['error'] or 'never asked to'})"
                events.append(WorkerLost(t=self._clock(), worker_id=worker.worker_id, reason=why))
                continue
            if worker.pid is None:
                events.append(
                    WorkerStarted(
                        t=self._clock(), worker_id=worker.worker_id, pid=pid, start_time=start
                    )
                )
            elif (worker.pid, worker.start_time) != (pid, start):
                await self._remove(actor)
                why = f"its Ray actor holds pid {pid}, not the recorded pid {worker.pid}"
                events.append(WorkerLost(t=self._clock(), worker_id=worker.worker_id, reason=why))
                continue
            host = info.get("host")
            if host is None and worker.port is not None:
                # An engine's actor started by a deo that did not report hosts: its node's
                # address is in Ray's node table.
                if node_hosts is None:
                    node_hosts = await self._node_hosts()
                host = node_hosts.get(str(info.get("node_id")))
                if host is None:
                    log.warning(
                        "%s: the address of its Ray node %s is unknown, so deo cannot reach the "
                        "engine (no routing, health checks, sleep or wake)",
                        worker.worker_id,
                        info.get("node_id"),
                    )
            adopted = _Worker(worker.worker_id, worker.pool, tuple(worker.gpus), actor, host=host)
            self._workers[worker.worker_id] = adopted
            self._watch(adopted)
            events.append(WorkerAdopted(t=self._clock(), worker_id=worker.worker_id))
        return events

    async def _node_hosts(self) -> dict[str, str]:
        """Ray node id -> the address Ray knows the node by, for the live nodes ({} when the
        head does not answer)."""
        nodes: list[dict[str, Any]] = []
        with anyio.move_on_after(self._call_timeout_s):
            try:
                nodes = await anyio.to_thread.run_sync(ray.nodes, abandon_on_cancel=True)
            except (RayError, ConnectionError) as exc:
                log.warning("cannot read Ray's node table: %s", _first_line(exc))
        return {
            str(node["NodeID"]): str(node["NodeManagerAddress"])
            for node in nodes
            if node.get("Alive") and node.get("NodeManagerAddress")
        }

    async def stop_strays(self) -> int:
        """Remove every worker actor of this namespace that no known worker accounts for (its
        worker dies with it); returns how many. Call it after :meth:`reconcile`."""
        names = await anyio.to_thread.run_sync(_named_actors)
        strays = [
            name
            for name in names
            if name.startswith(ACTOR_PREFIX) and name[len(ACTOR_PREFIX) :] not in self._workers
        ]
        for name in strays:
            worker_id = name[len(ACTOR_PREFIX) :]
            self._emit(
                LeftoverProcesses(
                    t=self._clock(),
                    worker_id=worker_id,
                    count=1,
                    detail=f"Ray actor {name!r} in namespace {self.namespace!r}; removed",
                )
            )
            try:
                actor = await anyio.to_thread.run_sync(_get_actor, name, self.namespace)
            except ValueError:
                pass  # gone meanwhile
            else:
                await self._remove(actor)
            self._emit(LeftoverProcessesStopped(t=self._clock(), worker_id=worker_id))
        return len(strays)

    def leftovers_gone(self, state: State) -> list[LeftoverProcessesStopped]:
        """Nothing: :meth:`stop_strays` resolves what it finds as it removes it."""
        return []

    # --- watching ---------------------------------------------------------------------------------

    async def run(self) -> None:
        """Report worker exits, node losses and an unreachable head, until cancelled."""
        if self._task_group is not None:
            raise RuntimeError("RayExecutor.run() is already running")
        try:
            async with anyio.create_task_group() as task_group:
                self._task_group = task_group
                task_group.start_soon(self._exits_loop)
                task_group.start_soon(self._nodes_loop)
                if self._nvml is not None and self._nvml.backend != "off":
                    task_group.start_soon(self._health_loop, self._nvml)
                await anyio.sleep_forever()
        finally:
            self._task_group = None

    def _later(self, fn: Callable[..., Any], *args: Any) -> None:
        if self._task_group is None:
            raise RuntimeError("RayExecutor.run() must run before commands are executed")
        self._task_group.start_soon(fn, *args)

    async def _exits_loop(self) -> None:
        while True:
            waiting = {w.waiting: w for w in self._workers.values() if w.waiting is not None}
            if not waiting:
                await anyio.sleep(self._poll_interval_s)
                continue
            ready = await anyio.to_thread.run_sync(_ready, list(waiting), self._poll_interval_s)
            for ref in ready:
                worker = waiting[ref]
                exited = await self._exit_of(worker, ref)
                self._workers.pop(worker.worker_id, None)
                self._ended(worker.worker_id)
                self._emit(exited)
                await self._remove(worker.actor)

    async def _exit_of(self, worker: _Worker, ref: Any) -> WorkerExited:
        try:
            code, sig = await self._get(ref, self._call_timeout_s)
        except RayActorError as exc:
            log.warning("%s: its Ray actor died: %s", worker.worker_id, _first_line(exc))
            return WorkerExited(t=self._clock(), worker_id=worker.worker_id)
        except RayError as exc:
            log.warning("%s: no exit status from Ray: %s", worker.worker_id, _first_line(exc))
            return WorkerExited(t=self._clock(), worker_id=worker.worker_id)
        return WorkerExited(t=self._clock(), worker_id=worker.worker_id, exit_code=code, signal=sig)

    async def _nodes_loop(self) -> None:
        while True:
            # Ray's calls hang while its head is down: one call at a time, however long it
            # takes, and every poll without its answer holds the pools.
            answer: dict[str, Any] = {}
            answered = anyio.Event()
            assert self._task_group is not None
            self._task_group.start_soon(self._ask_nodes, answer, answered)
            with anyio.move_on_after(self._call_timeout_s):
                await answered.wait()
            while not answered.is_set():
                self._head_unreachable(f"no answer in {self._call_timeout_s:g}s")
                with anyio.move_on_after(self._call_timeout_s):
                    await answered.wait()
            if "error" in answer:
                self._head_unreachable(answer["error"])
            else:
                self._head_answers()
                self._check_nodes(answer["nodes"])
            await anyio.sleep(self._poll_interval_s)

    async def _ask_nodes(self, answer: dict[str, Any], answered: anyio.Event) -> None:
        try:
            answer["nodes"] = await anyio.to_thread.run_sync(ray.nodes)
        except (RayError, ConnectionError) as exc:
            answer["error"] = _first_line(exc)
        finally:
            answered.set()

    async def _health_loop(self, settings: NvmlSettings) -> None:
        """GPU health per node: one agent actor on each node with configured GPUs reads them
        (NVML, or ``[nvml]``'s file there) every ``interval_s``; the readings become the same
        ``GpuSampled`` and ``GpuLost`` events as on one machine, with node-qualified ids."""
        gpus = list(self._gpus)
        if not gpus:
            return
        by_node: dict[str, list[str]] = {}
        for gpu in gpus:
            node, index = split_gpu_id(gpu)
            by_node.setdefault(node, []).append(index)
        agent_class = ray.remote(GpuAgent)
        agents: dict[str, Any] = {
            node: agent_class.options(
                num_cpus=0,
                resources={NODE_RESOURCE_PREFIX + node: _NODE_SLIVER},
                max_restarts=-1,  # back with its node, wherever Ray finds the node's name again
            ).remote(node, settings.backend, _file_of(settings), indices)
            for node, indices in by_node.items()
        }
        self._out(
            f"deo: GPU health of {len(gpus)} GPU(s) on {len(agents)} Ray node(s) every "
            f"{settings.interval_s:g}s"
        )
        changes = sample_filter(
            settings, lambda: self._state().config.cordon, lambda: held_gpus(self._state())
        )
        monitor = GpuMonitor(gpus, changes)
        told: dict[str, str] = {}
        while True:
            refs = {node: agent.read.remote() for node, agent in agents.items()}
            # Every node at once: one wait for all the answers, a slow node holds none of them.
            ready = set(
                await anyio.to_thread.run_sync(_ready, list(refs.values()), self._call_timeout_s)
            )
            readings: dict[str, Any] = {}
            for node, ref in refs.items():
                try:
                    if ref not in ready:
                        raise GetTimeoutError(f"no answer in {self._call_timeout_s:g}s")
                    answer = await self._get(ref, self._call_timeout_s)
                except RayError as exc:
                    answer = f"its GPU agent does not answer: {_first_line(exc)}"
                if isinstance(answer, str):
                    if told.get(node) != answer:
                        self._out(f"deo: node {node}: GPU health: {answer}")
                        told[node] = answer
                    answer = {index: ReadFailed(error=answer) for index in by_node[node]}
                else:
                    told.pop(node, None)
                for index, reading in answer.items():
                    readings[f"{node}:{index}"] = reading
            events, lines = monitor.step(readings, self._clock())
            for event in events:
                self._emit(event)
            for line in lines:
                self._out(line)
            await anyio.sleep(settings.interval_s)

    def _head_unreachable(self, error: str) -> None:
        """The cluster does not answer: said once per outage, as a ``cluster_unreachable``
        alert that stays raised until :meth:`_head_answers`."""
        if self._head_down:
            return
        log.warning("the Ray cluster at %s does not answer: %s", self.address, error)
        self._head_down = True
        self._emit(
            ClusterUnreachable(
                t=self._clock(), address=self.address, error=f"Ray head unreachable: {error}"
            )
        )

    def _head_answers(self) -> None:
        """The cluster answered: an outage seen by this deo, or one recorded before a restart
        (the alert is in the state), is over."""
        recorded = (AlertName.CLUSTER_UNREACHABLE, self.address) in self._state().alerts
        if self._head_down or recorded:
            if self._head_down:
                log.warning("the Ray cluster at %s answers again", self.address)
            self._emit(ClusterReachable(t=self._clock(), address=self.address))
        self._head_down = False

    def _check_nodes(self, nodes: list[dict[str, Any]]) -> None:
        alive: set[str] = set()
        for node in nodes:
            names = {
                resource[len(NODE_RESOURCE_PREFIX) :]
                for resource in node.get("Resources", {})
                if resource.startswith(NODE_RESOURCE_PREFIX)
            }
            if node.get("Alive"):
                alive |= names
        # A node's name back on a live Raylet is a node back; its GPUs stay cordoned until an
        # operator uncordons them (the core's rule for lost GPUs).
        self._nodes_lost -= alive
        lost = (self._nodes_alive - alive) - self._nodes_lost
        self._nodes_alive = alive
        if not lost:
            return
        state = self._state()
        for name in sorted(lost):
            log.warning("Ray node %s left the cluster", name)
            self._nodes_lost.add(name)
            for gpu_id in state.gpus:
                if gpu_id.rpartition(":")[0] == name:
                    self._emit(
                        GpuLost(
                            t=self._clock(),
                            gpu_id=gpu_id,
                            error=f"Ray node {name} left the cluster",
                        )
                    )

    # --- Ray calls --------------------------------------------------------------------------------

    async def _get(self, ref: Any, timeout_s: float) -> Any:
        return await anyio.to_thread.run_sync(lambda: ray.get(ref, timeout=timeout_s))

    async def _remove(self, actor: Any) -> None:
        try:
            await anyio.to_thread.run_sync(lambda: ray.kill(actor, no_restart=True))
        except (RayError, ValueError) as exc:
            log.warning("cannot remove a Ray actor: %s", _first_line(exc))


def _named_actors() -> list[str]:
    return [str(name) for name in ray.util.list_named_actors()]


def _get_actor(name: str, namespace: str) -> Any:
    return ray.get_actor(name, namespace=namespace)


def _ready(refs: list[Any], timeout_s: float) -> list[Any]:
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    return list(ready)


def _gpu_mismatch(gpus: Iterable[str], ray_gpu_ids: Iterable[str]) -> str | None:
    """Why a worker on ``gpus`` may not run with the GPUs Ray reserved for its actor, or None.

    Ray hands an actor the lowest free GPUs of its node; the worker uses the core's (the log
    records them). Where the two differ, Ray's books say another GPU is taken, and it may place
    something else on the worker's GPU."""
    wanted = sorted(split_gpu_id(gpu)[1] for gpu in gpus)
    reserved = sorted(str(gpu) for gpu in ray_gpu_ids)
    if wanted == reserved:
        return None
    return (
        f"Ray reserved GPU(s) {','.join(reserved) or 'none'} of its node for it, not deo's "
        f"{','.join(gpus)}: start the node's Raylet seeing all its GPUs, and leave the node's "
        f"GPUs to deo (see docs/ray.md)"
    )


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


async def connect_ray_executor(
    settings: RunSettings,
    emit: Callable[[Event], None],
    *,
    clock: Callable[[], float],
    state: Callable[[], State],
    environ: Mapping[str, str],
    secret_environ: Callable[[str], Mapping[str, str]],
    out: Callable[[str], None] = print,
) -> RayExecutor:
    """The executor ``deo run`` uses for ``[executor] kind = "ray"``, connected to its cluster;
    :class:`~core.errors.ConfigError` naming the address when Ray cannot be joined."""
    executor_settings = settings.executor
    for gpu in settings.config.gpus:
        try:
            split_gpu_id(gpu)
        except ValueError as exc:
            raise ConfigError(
                f"deo.gpus: {exc}; with the Ray executor GPUs are named by node"
            ) from None
    executor = RayExecutor(
        emit,
        clock=clock,
        state=state,
        log_dir=settings.worker_logs,
        address=executor_settings.address,
        namespace=executor_settings.namespace or default_namespace(settings.log),
        environ=environ,
        secret_environ=secret_environ,
        spawn_timeout_s=executor_settings.spawn_timeout_s,
        call_timeout_s=executor_settings.call_timeout_s,
        nvml=settings.nvml,
        gpus=settings.config.gpus,
        out=out,
    )
    try:
        await anyio.to_thread.run_sync(executor.connect)
    except (RayError, ConnectionError, RuntimeError, ValueError) as exc:
        raise ConfigError(
            f"executor.address: cannot join the Ray cluster at {executor_settings.address!r}: "
            f"{_first_line(exc)}"
        ) from None
    return executor


def _file_of(settings: NvmlSettings) -> str | None:
    return None if settings.file is None else str(settings.file)
