"""Configuration: what the operator declares. It reaches the reducer as a ``Configured`` event.

Configuration is data in the log like any other input, so a log replays on its own and
``deo replay --set`` can ask "what if the configuration had been different". Every value is
validated on construction and a bad one raises :class:`ConfigError` naming its key.
"""

from __future__ import annotations

import math
import re
import string
from collections.abc import Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

import attrs

from core.convert import str_set, str_tuple
from core.errors import ConfigError

__all__ = [
    "node_of",
    "ARGV_PLACEHOLDERS",
    "AUTO",
    "ENGINES",
    "ENGINE_ARGV_PLACEHOLDERS",
    "ENGINE_HOST",
    "fill_engine_host",
    "POOL_KINDS",
    "Config",
    "CordonRules",
    "CrashLoopRules",
    "PolicySpec",
    "PoolSpec",
]

#: Names an argv template may use, e.g. ``["python", "env.py", "--slot", "{index}"]``.
ARGV_PLACEHOLDERS = frozenset({"worker_id", "pool", "index", "gpus"})
#: What an engine pool's argv may use besides: the engine's port (required there) and the
#: address it binds on its machine (see :data:`ENGINE_HOST`).
ENGINE_ARGV_PLACEHOLDERS = ARGV_PLACEHOLDERS | {"port", "host"}
#: ``{host}`` in an engine's argv is left as this text in the spawn command (the log records
#: it): the executor fills it in with the address deo reaches the engine at on the machine that
#: runs it (127.0.0.1 on deo's own machine, the node's address on a Ray node). No argument a
#: process receives can hold a NUL, so no text of the config (a literal ``{{host}}`` included)
#: is ever taken for it.
ENGINE_HOST = "\x00deo-host\x00"


def fill_engine_host(argv: Sequence[str], host: str) -> list[str]:
    """An engine's rendered ``argv`` with :data:`ENGINE_HOST` replaced by ``host``."""
    return [arg.replace(ENGINE_HOST, host) for arg in argv]


#: Pool kinds: ``worker`` (processes signalled to drain, e.g. Atropos envs) or ``engine``
#: (inference servers deo controls over HTTP: sleep, wake, routed requests).
POOL_KINDS = frozenset({"worker", "engine"})
#: Inference engines deo speaks to (their control routes and metric names differ).
ENGINES = frozenset({"vllm", "sglang"})
#: vLLM serves its sleep routes only with this set; deo sets it in every vLLM engine's env.
VLLM_DEV_MODE_ENV = "VLLM_SERVER_DEV_MODE"

_NAME = re.compile(r"^[a-z0-9][a-z0-9_.]*$")
#: The longest pool name: its workers' ids (NAME-INDEX) stay within the 128 characters the API
#: takes for a worker id.
MAX_POOL_NAME_CHARS = 100
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_PARAM_NAME = re.compile(r"^[a-z_][a-z0-9_]*$")
_SIGNALS = frozenset({"SIGUSR1", "SIGUSR2", "SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT"})
#: Variables deo sets itself; a pool may not override them.
RESERVED_ENV = frozenset({"CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER"})
#: Every variable named with this prefix is deo's (a worker's id, run, token, API, heartbeat
#: file, ...): a pool may set none, so a worker always reports as the worker deo made.
RESERVED_ENV_PREFIX = "DEO_"
#: ``drain_timeout_s = "auto"``: the drain deadline is measured from the pool's drains
#: (:mod:`core.drains`).
AUTO = "auto"


def _finite(key: str, value: object) -> None:
    # The log is JSON: infinity and NaN have no spelling there, so a configuration holding one
    # would not come back from the log as it was applied.
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{key} must be a finite number, got {value!r}")


def _positive(key: str, value: float) -> None:
    _finite(key, value)
    if not value > 0:
        raise ConfigError(f"{key} must be > 0, got {value!r}")


def _non_negative(key: str, value: float) -> None:
    _finite(key, value)
    if not value >= 0:
        raise ConfigError(f"{key} must be >= 0, got {value!r}")


def _frozen_mapping(value: Mapping[str, Any] | None) -> dict[str, Any]:
    return dict(value or {})


@attrs.frozen(slots=True, kw_only=True)
class PolicySpec:
    """A policy by name with its parameters; ``core.policies.build`` turns it into a policy."""

    name: str = "buffer"
    params: dict[str, Any] = attrs.field(factory=dict, converter=_frozen_mapping, hash=False)

    def __attrs_post_init__(self) -> None:
        for key, value in self.params.items():
            if not _PARAM_NAME.match(key):
                raise ConfigError(f"policy.{key}: not a valid parameter name")
            if not isinstance(value, (int, float, str, bool)):
                raise ConfigError(
                    f"policy.{key}: expected a number, string or boolean, got {value!r}"
                )
            _finite(f"policy.{key}", value)


@attrs.frozen(slots=True, kw_only=True)
class CrashLoopRules:
    """When exits count as a crash loop and how respawns back off.

    A worker that exits on its own within ``early_exit_s`` of starting (or fails to spawn) is a
    failure, counted against its worker slot (the place in the pool's count it filled): after
    ``n`` failures in a row of one slot its replacement waits
    ``min(backoff_cap_s, backoff_base_s * 2**(n-1))`` after the last of them, while the rest
    of the pool is spawned as usual, so a large pool is judged like a small one. A slot that
    fails ``alert_after`` times in a row raises an alert; a replacement that stays up for
    ``early_exit_s`` ends its slot's count.
    """

    early_exit_s: float = 30.0
    backoff_base_s: float = 1.0
    backoff_cap_s: float = 300.0
    alert_after: int = 3

    def __attrs_post_init__(self) -> None:
        _positive("crash_loop.early_exit_s", self.early_exit_s)
        _positive("crash_loop.backoff_base_s", self.backoff_base_s)
        _finite("crash_loop.backoff_cap_s", self.backoff_cap_s)
        if self.backoff_cap_s < self.backoff_base_s:
            raise ConfigError(
                f"crash_loop.backoff_cap_s ({self.backoff_cap_s}) must be >= backoff_base_s "
                f"({self.backoff_base_s})"
            )
        if self.alert_after < 1:
            raise ConfigError(f"crash_loop.alert_after must be >= 1, got {self.alert_after}")

    def backoff_s(self, failures: int) -> float:
        """Delay before the next spawn after ``failures`` consecutive incidents (0 if none)."""
        if failures <= 0:
            return 0.0
        # 2**60 already exceeds any cap; bounding the exponent keeps the float finite.
        return float(min(self.backoff_cap_s, self.backoff_base_s * 2.0 ** min(failures - 1, 60)))


def _port_range(value: Any) -> Any:
    # JSON and TOML give lists; the spec must compare equal after a round trip through the log.
    # Anything else is kept for the check to name.
    return tuple(value) if isinstance(value, list | tuple) else value


def _argv_tuple(value: Iterable[str], spec: Any) -> tuple[str, ...]:
    # Converters run in field order, so the pool's name is already set.
    if isinstance(value, str):
        raise ConfigError(
            f"pools.{spec.name}.argv: a list of strings is expected, not the string {value!r} "
            f"(no shell is used)"
        )
    return tuple(value)


@attrs.frozen(slots=True, kw_only=True)
class PoolSpec:
    """One kind of worker: how to start it, how many, on how many GPUs, scaled by which policy."""

    name: str
    argv: tuple[str, ...] = attrs.field(
        converter=attrs.Converter(_argv_tuple, takes_self=True)  # type: ignore[misc]
    )
    min_workers: int = 0
    max_workers: int = 1
    gpus_per_worker: int = 0
    env: dict[str, str] = attrs.field(factory=dict, converter=_frozen_mapping, hash=False)
    policy: PolicySpec = attrs.field(factory=PolicySpec)
    #: A worker is active as soon as it starts, unless it must report ready first.
    require_ready: bool = False
    start_timeout_s: float = 300.0
    #: None: heartbeats are not required. Otherwise a silent worker is hung after this long.
    heartbeat_grace_s: float | None = None
    drain_signal: str = "SIGUSR1"
    #: Seconds a drained worker gets to exit before SIGTERM, or ``"auto"``: measured from the
    #: pool's recent drains (see :mod:`core.drains`).
    drain_timeout_s: float | str = AUTO
    #: Between SIGTERM and SIGKILL of the process group, and again between SIGKILL and giving up.
    stop_timeout_s: float = 10.0
    #: Pressure older than this is stale: the pool holds its count.
    metrics_stale_s: float = 30.0
    #: No policy scale-down within this long after a scale-up (no flapping).
    stabilization_s: float = 120.0
    #: A trainer queue deeper than this many batches is more than the trainer can use before the
    #: data goes stale (atroposlib's envs stop at max_batches_offpolicy, 3 by default): alert.
    queue_alert_batches: float = 4.0
    #: At most this many workers of the pool starting at once (requested, not yet running or
    #: ready): the rest are requested as those come up, so one step's work is bounded by this,
    #: never by ``max_workers``. The default leaves pools of up to 32 workers unthrottled.
    max_starting: int = 32
    crash_loop: CrashLoopRules = attrs.field(factory=CrashLoopRules)
    #: ``worker`` or ``engine`` (see :data:`POOL_KINDS`); the rest of these fields are engines'.
    kind: str = "worker"
    #: ``vllm`` or ``sglang``: which control routes and metric names the engines speak.
    engine: str | None = None
    #: Inclusive [first, last] range of ports; each engine gets the lowest one no live engine of
    #: the pool holds, in its argv as ``{port}`` and at ``http://HOST:{port}`` (HOST: 127.0.0.1,
    #: or the node's address with the Ray executor; ``{host}`` in the argv).
    ports: tuple[int, ...] | None = attrs.field(default=None, converter=_port_range)
    #: Requests in flight one engine serves well: the ``threshold`` policy's capacity per worker
    #: unless its parameters say otherwise.
    capacity_per_engine: int = 32
    #: Engines that may sleep (or be on their way to sleep) at once; scaling down further stops
    #: engines, the one asleep longest first. 0: scaling down always stops.
    max_asleep: int = 1
    #: The pool's OpenAI-compatible router on 127.0.0.1; 0: none.
    router_port: int = 0
    #: vLLM's sleep level: 1 offloads the weights to CPU memory, 2 discards them too.
    sleep_level: int = 1
    #: Each HTTP call to an engine (health, sleep, wake) gives up after this long.
    control_timeout_s: float = 60.0
    #: Tries of a sleep or wake call before the engine is stopped (and, for a wake, replaced).
    control_attempts: int = 3

    def __attrs_post_init__(self) -> None:
        where = f"pools.{self.name}"
        self._check_engine(where)
        if not _NAME.match(self.name):
            raise ConfigError(
                f"pools.{self.name!r}: a pool name is lower-case letters, digits, '_' and '.'"
            )
        if len(self.name) > MAX_POOL_NAME_CHARS:
            # Its workers' ids (NAME-INDEX) must stay within what the API takes in a path.
            raise ConfigError(
                f"pools.{self.name[:20]}...: {len(self.name)} characters; a pool name has at "
                f"most {MAX_POOL_NAME_CHARS}"
            )
        if not self.argv or not all(isinstance(a, str) for a in self.argv):
            raise ConfigError(f"{where}.argv: must be a non-empty list of strings")
        if not self.argv[0].strip():
            raise ConfigError(f"{where}.argv: its first item, the program to run, is empty")
        for arg in self.argv:
            try:
                fields = [field for _, field, _, _ in string.Formatter().parse(arg)]
            except ValueError as exc:
                raise ConfigError(
                    f"{where}.argv: {arg!r}: {exc} (write {{{{ for a brace)"
                ) from None
            for field in fields:
                if field in ("port", "host") and self.kind != "engine":
                    raise ConfigError(
                        f"{where}.argv: {{{field}}} in {arg!r} is only given to engine pools "
                        f'(kind = "engine")'
                    )
                if field is not None and field not in ENGINE_ARGV_PLACEHOLDERS:
                    raise ConfigError(
                        f"{where}.argv: unknown placeholder {{{field}}} in {arg!r}; "
                        f"known: {', '.join(sorted(ARGV_PLACEHOLDERS))} (write {{{{ for a brace)"
                    )
        try:
            # A format spec or conversion ({index:q}, {gpus!z}) fails only when filled in:
            # fill them in now, with values of the types a spawn gives, not at the first spawn.
            port = 8000 if self.kind == "engine" else None
            self.render_argv(worker_id=f"{self.name}-1", index=1, gpus=("0",), port=port)
        except ValueError as exc:
            raise ConfigError(
                f"{where}.argv: a placeholder cannot be filled in: {exc} (write {{{{ for a brace)"
            ) from None
        if self.min_workers < 0:
            raise ConfigError(f"{where}.min_workers must be >= 0, got {self.min_workers}")
        if self.max_workers < self.min_workers:
            raise ConfigError(
                f"{where}.max_workers ({self.max_workers}) must be >= min_workers "
                f"({self.min_workers})"
            )
        if self.max_starting < 1:
            raise ConfigError(f"{where}.max_starting must be >= 1, got {self.max_starting}")
        if self.gpus_per_worker < 0:
            raise ConfigError(f"{where}.gpus_per_worker must be >= 0, got {self.gpus_per_worker}")
        for key, value in self.env.items():
            if not _ENV_NAME.match(key) or not isinstance(value, str):
                raise ConfigError(f"{where}.env.{key}: names are identifiers, values strings")
            if key in RESERVED_ENV:
                raise ConfigError(f"{where}.env.{key}: deo sets this variable itself")
            if key.startswith(RESERVED_ENV_PREFIX):
                raise ConfigError(
                    f"{where}.env.{key}: variables named {RESERVED_ENV_PREFIX}* are deo's own "
                    "(it sets those a worker needs); rename it"
                )
        if self.drain_signal not in _SIGNALS:
            raise ConfigError(
                f"{where}.drain_signal: {self.drain_signal!r} is not one of {sorted(_SIGNALS)}"
            )
        if isinstance(self.drain_timeout_s, (str, bool)):
            if self.drain_timeout_s != AUTO:
                raise ConfigError(
                    f"{where}.drain_timeout_s: a number of seconds or {AUTO!r}, got "
                    f"{self.drain_timeout_s!r}"
                )
        else:
            _positive(f"{where}.drain_timeout_s", self.drain_timeout_s)
        for key in (
            "start_timeout_s",
            "stop_timeout_s",
            "metrics_stale_s",
            "queue_alert_batches",
        ):
            _positive(f"{where}.{key}", getattr(self, key))
        _non_negative(f"{where}.stabilization_s", self.stabilization_s)
        if self.heartbeat_grace_s is not None:
            _positive(f"{where}.heartbeat_grace_s", self.heartbeat_grace_s)

    def _check_engine(self, where: str) -> None:
        if self.kind not in POOL_KINDS:
            raise ConfigError(
                f"{where}.kind: unknown pool kind {self.kind!r}; known: "
                f"{', '.join(sorted(POOL_KINDS))}"
            )
        if self.kind != "engine":
            for key, default in _ENGINE_ONLY.items():
                if getattr(self, key) != default:
                    raise ConfigError(f'{where}.{key}: only engine pools (kind = "engine") take it')
            return
        if self.engine not in ENGINES:
            raise ConfigError(
                f"{where}.engine: {self.engine!r} is not an engine deo controls; known: "
                f"{', '.join(sorted(ENGINES))}"
            )
        if not any("{port}" in arg for arg in self.argv):
            raise ConfigError(
                f"{where}.argv: an engine pool's argv must pass the engine its port as {{port}} "
                f'(e.g. "--port", "{{port}}")'
            )
        ports = self.ports
        if ports is None:
            raise ConfigError(f"{where}.ports: required for an engine pool: [first, last]")
        if (
            not isinstance(ports, tuple)
            or len(ports) != 2
            or not all(type(p) is int for p in ports)
        ):
            raise ConfigError(
                f"{where}.ports: expected [first, last] (two integers), got {ports!r}"
            )
        first, last = ports
        if not 1 <= first <= last <= 65535:
            raise ConfigError(
                f"{where}.ports: [{first}, {last}] is not a range of ports (1 <= first <= last "
                f"<= 65535)"
            )
        if last - first + 1 < self.max_workers:
            raise ConfigError(
                f"{where}.ports: [{first}, {last}] holds {last - first + 1} port(s), fewer than "
                f"max_workers ({self.max_workers}), the least it needs (sleeping engines keep "
                f"theirs too: max_workers + max_asleep = {self.max_workers + self.max_asleep} "
                f"lets new engines start while others sleep)"
            )
        if not 0 <= self.router_port <= 65535:
            raise ConfigError(f"{where}.router_port must be a port or 0, got {self.router_port}")
        if first <= self.router_port <= last:
            raise ConfigError(
                f"{where}.router_port ({self.router_port}) is inside the engines' ports "
                f"[{first}, {last}]"
            )
        if self.router_port and self.min_workers == 0 and self.policy.name == "threshold":
            # With no engine awake nothing measures the load (the router's waiting requests
            # never reach a ratio of 0.8 on their own), so a pool scaled to 0 would stay there.
            raise ConfigError(
                f"{where}.min_workers: an engine pool with a router_port and the threshold policy "
                f"needs min_workers >= 1 (a pool scaled to no awake engine is never woken by "
                f"its requests)"
            )
        if self.capacity_per_engine < 1:
            raise ConfigError(
                f"{where}.capacity_per_engine must be >= 1, got {self.capacity_per_engine}"
            )
        if self.max_asleep < 0:
            raise ConfigError(f"{where}.max_asleep must be >= 0, got {self.max_asleep}")
        if self.sleep_level not in (1, 2):
            raise ConfigError(f"{where}.sleep_level must be 1 or 2, got {self.sleep_level}")
        _positive(f"{where}.control_timeout_s", self.control_timeout_s)
        if self.control_attempts < 1:
            raise ConfigError(f"{where}.control_attempts must be >= 1, got {self.control_attempts}")
        if self.policy.name == "threshold":
            # The policy's capacity is the engine's: one number to set, in the pool's terms; and
            # engines on their way (minutes for a cold start) count as capacity.
            defaults = {"capacity_per_worker": self.capacity_per_engine, "count_starting": True}
            params = {**defaults, **self.policy.params}
            if params != self.policy.params:
                object.__setattr__(self, "policy", PolicySpec(name=self.policy.name, params=params))

    @property
    def is_engine(self) -> bool:
        """An inference engine pool (controlled over HTTP, readiness from its ``/health``)."""
        return self.kind == "engine"

    @property
    def awaits_ready(self) -> bool:
        """Whether a worker is active only once it reports ready (an engine: its /health)."""
        return self.require_ready or self.kind == "engine"

    def port_range(self) -> range:
        """The engines' ports, in order (empty for a worker pool)."""
        if self.ports is None:
            return range(0)
        return range(self.ports[0], self.ports[1] + 1)

    def render_argv(
        self, *, worker_id: str, index: int, gpus: tuple[str, ...], port: int | None = None
    ) -> tuple[str, ...]:
        """The argv of one worker, placeholders filled in."""
        values = {
            "worker_id": worker_id,
            "pool": self.name,
            "index": index,
            "gpus": ",".join(gpus),
            "port": "" if port is None else port,
            # Known only where the engine is placed: the executor fills it in.
            "host": ENGINE_HOST,
        }
        return tuple(arg.format_map(values) for arg in self.argv)


#: Engine settings and their defaults: a worker pool must leave them so.
_ENGINE_ONLY: Mapping[str, Any] = MappingProxyType(
    {"engine": None, "ports": None, "router_port": 0}
)


@attrs.frozen(slots=True, kw_only=True)
class CordonRules:
    """When a GPU is cordoned (no new worker placed on it) and when it is released again.

    Throttling and memory saturation are transient: the GPU is uncordoned once its samples have
    been clean for ``uncordon_after_s`` (hysteresis). XID/ECC errors and loss point at hardware:
    those cordons stay until an operator lifts them.
    """

    max_temperature_c: float = 90.0
    throttle_reasons: frozenset[str] = attrs.field(
        default=frozenset({"thermal", "power"}), converter=str_set
    )
    #: Applies to GPUs no deo worker holds: memory used by someone else makes the GPU unusable.
    max_memory_fraction: float = 0.9
    uncordon_after_s: float = 120.0

    def __attrs_post_init__(self) -> None:
        _finite("cordon.max_temperature_c", self.max_temperature_c)
        if not 0 < self.max_memory_fraction <= 1:
            raise ConfigError(
                f"cordon.max_memory_fraction must be in (0, 1], got {self.max_memory_fraction}"
            )
        _non_negative("cordon.uncordon_after_s", self.uncordon_after_s)


def _pool_tuple(value: Iterable[PoolSpec]) -> tuple[PoolSpec, ...]:
    return tuple(value)


def _distinct_devices(value: Mapping[str, str] | None) -> dict[str, str]:
    # A GPU that is its own device is the default: leaving it out keeps one way to say it, so
    # equal configurations compare (and are logged) equal.
    return {gpu: device for gpu, device in (value or {}).items() if gpu != device}


@attrs.frozen(slots=True, kw_only=True)
class Config:
    """Everything the core needs to know: pools, the GPUs it may place workers on, cordon rules."""

    pools: tuple[PoolSpec, ...] = attrs.field(default=(), converter=_pool_tuple)
    #: GPU ids as CUDA_VISIBLE_DEVICES takes them: indices ("0") or UUIDs ("GPU-...").
    gpus: tuple[str, ...] = attrs.field(default=(), converter=str_tuple)
    #: GPU id -> the device id a worker on it is given in CUDA_VISIBLE_DEVICES, for the GPUs
    #: whose two ids differ (``deo run`` resolves them from its own CUDA_VISIBLE_DEVICES, where
    #: a configured index counts within deo's list). A GPU not listed is its own device.
    gpu_devices: dict[str, str] = attrs.field(factory=dict, converter=_distinct_devices, hash=False)
    cordon: CordonRules = attrs.field(factory=CordonRules)

    def __attrs_post_init__(self) -> None:
        names = [p.name for p in self.pools]
        for name in names:
            if names.count(name) > 1:
                raise ConfigError(f"pools.{name}: declared twice")
        for gpu in self.gpus:
            if not isinstance(gpu, str) or not gpu or "," in gpu:
                raise ConfigError(f"gpus: {gpu!r} is not a GPU id (an index or a UUID)")
            if self.gpus.count(gpu) > 1:
                raise ConfigError(f"gpus: {gpu!r} listed twice")
        devices: dict[str, str] = {}
        for gpu, device in self.gpu_devices.items():
            if gpu not in self.gpus:
                raise ConfigError(f"gpu_devices: {gpu!r} is not one of the gpus declared")
            if not isinstance(device, str) or not device or "," in device:
                raise ConfigError(f"gpu_devices.{gpu}: {device!r} is not a device id")
        for gpu in self.gpus:
            device = self.device_of(gpu)
            if device in devices:
                raise ConfigError(
                    f"gpu_devices: {devices[device]!r} and {gpu!r} are the same device {device!r}"
                )
            devices[device] = gpu
        taken: dict[int, str] = {}
        for pool in self.pools:
            owned = list(pool.port_range()) + ([pool.router_port] if pool.router_port else [])
            for port in owned:
                other = taken.setdefault(port, pool.name)
                if other != pool.name:
                    raise ConfigError(
                        f"pools.{pool.name}: port {port} is also pool {other}'s (engine ports and "
                        f"router ports of different pools must not overlap)"
                    )
        for pool in self.pools:
            if pool.gpus_per_worker > len(self.gpus):
                raise ConfigError(
                    f"pools.{pool.name}.gpus_per_worker ({pool.gpus_per_worker}) exceeds the "
                    f"{len(self.gpus)} GPUs declared"
                )

    def device_of(self, gpu_id: str) -> str:
        """The device id a worker on GPU ``gpu_id`` sees in CUDA_VISIBLE_DEVICES."""
        return self.gpu_devices.get(gpu_id, gpu_id)

    def pool(self, name: str) -> PoolSpec | None:
        """The pool called ``name``, or None."""
        for pool in self.pools:
            if pool.name == name:
                return pool
        return None


def node_of(gpu_id: str) -> str:
    """The node a GPU id names: the part before the last ':' of a node-qualified id
    (``NODE:INDEX``), "" for a local id (an index or a UUID: all on deo's own machine)."""
    node, _, _ = gpu_id.rpartition(":")
    return node
