"""Simulator scenarios: a trainer, env pools, optional shared inference and faults, from TOML.

A scenario file needs only a few lines; everything else has a default (``docs/scenarios.md``
documents every key)::

    name = "steady"
    duration_s = 3600
    [trainer]
    batch_size_seqs = 128
    step_s = 5.0
    [pools.envs]
    latency_mean_s = 12.0

:func:`load_scenario` reads a file, applies ``--set``-style overrides (dotted keys, values read
as TOML literals) and validates everything; a mistake raises :class:`ScenarioError` naming the
key (``pools.envs.latency_sigma: expected a number, got "high"``), unknown keys included, with a
suggestion when one is close. Pools' policies are looked up in a
:class:`~core.policies.PolicyCatalog` (``policies=``; the core's unless the caller has more).
"""

from __future__ import annotations

import difflib
import math
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

import attrs

from adapters.runtime.config_file import literal
from core.config import AUTO, Config, CrashLoopRules, PolicySpec, PoolSpec
from core.errors import ConfigError
from core.policies import BUILT_INS, PolicyCatalog

__all__ = [
    "FAULT_KINDS",
    "EnvPool",
    "Fault",
    "InferenceSpec",
    "Pause",
    "Phase",
    "Scenario",
    "ScenarioError",
    "TrainerSpec",
    "load_scenario",
    "parse_override",
    "parse_scenario",
]


T = TypeVar("T")


class ScenarioError(ConfigError):
    """A scenario that cannot be used; the message starts with the offending key."""


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ScenarioError(message)


def _finite(value: float) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


# --- the model ------------------------------------------------------------------------------------


#: What one simulation may be asked for: beyond these it would run for hours or exhaust memory
#: (a typo such as duration_s = 1e300 is refused rather than run).
MAX_DURATION_S = 31 * 86_400.0
MAX_TRAINER_STEPS = 10_000_000
MAX_BATCH_SEQS = 1_000_000
MAX_POOL_WORKERS = 10_000


@attrs.frozen(slots=True, kw_only=True)
class Phase:
    """From ``at_s`` on, a trainer step takes ``step_s`` seconds (once its batch is ready)."""

    at_s: float
    step_s: float

    def __attrs_post_init__(self) -> None:
        _require(_finite(self.at_s) and self.at_s >= 0, f"at_s: must be >= 0, got {self.at_s!r}")
        _require(
            _finite(self.step_s) and self.step_s > 0, f"step_s: must be > 0, got {self.step_s!r}"
        )


@attrs.frozen(slots=True, kw_only=True)
class Pause:
    """The trainer takes no batch in [at_s, at_s + duration_s): evaluation, checkpointing.

    A step in progress at ``at_s`` finishes. Paused time is neither consuming nor starving.
    """

    at_s: float
    duration_s: float
    kind: str = "eval"

    def __attrs_post_init__(self) -> None:
        _require(_finite(self.at_s) and self.at_s >= 0, f"at_s: must be >= 0, got {self.at_s!r}")
        _require(
            _finite(self.duration_s) and self.duration_s > 0,
            f"duration_s: must be > 0, got {self.duration_s!r}",
        )
        _require(bool(self.kind), "kind: must not be empty")

    @property
    def end_s(self) -> float:
        return self.at_s + self.duration_s


def _tuple(value: Any) -> tuple[Any, ...]:
    return tuple(value)


@attrs.frozen(slots=True, kw_only=True)
class TrainerSpec:
    """The consumer: one batch of ``batch_size_seqs`` sequences per step, FIFO."""

    batch_size_seqs: int = 64
    #: Seconds per step before the first phase.
    step_s: float = 4.0
    #: Step times vary: each step takes the phase's ``step_s`` times a lognormal factor of mean 1
    #: and this log-standard deviation (0: every step takes exactly ``step_s``).
    step_sigma: float = 0.0
    phases: tuple[Phase, ...] = attrs.field(default=(), converter=_tuple)
    pauses: tuple[Pause, ...] = attrs.field(default=(), converter=_tuple)
    #: Takes every full batch queued at once, as atroposlib's ``/batch`` does (it hands the rest
    #: out on the next calls): the queue the source reads then excludes them, and the step counter
    #: counts batches taken, not steps.
    fetch_all: bool = False

    def __attrs_post_init__(self) -> None:
        _require(
            1 <= self.batch_size_seqs <= MAX_BATCH_SEQS,
            f"batch_size_seqs: must be from 1 to {MAX_BATCH_SEQS:,}, got {self.batch_size_seqs}",
        )
        _require(
            _finite(self.step_s) and self.step_s > 0, f"step_s: must be > 0, got {self.step_s!r}"
        )
        _require(
            _finite(self.step_sigma) and self.step_sigma >= 0,
            f"step_sigma: must be >= 0, got {self.step_sigma!r}",
        )
        for i in range(1, len(self.phases)):
            _require(
                self.phases[i].at_s > self.phases[i - 1].at_s,
                f"phases[{i}].at_s: phases must be in increasing order of at_s",
            )

    def step_s_at(self, t: float) -> float:
        """Seconds a step started at ``t`` takes."""
        step_s = self.step_s
        for phase in self.phases:
            if t >= phase.at_s:
                step_s = phase.step_s
        return step_s

    def paused_at(self, t: float) -> bool:
        return any(p.at_s <= t < p.end_s for p in self.pauses)


LATENCY_DISTRIBUTIONS = ("lognormal", "pareto")


@attrs.frozen(slots=True, kw_only=True)
class EnvPool:
    """One kind of env worker and how deo manages it.

    A worker keeps up to ``groups_in_flight`` groups of ``group_size`` sequences in generation;
    each group takes a latency drawn from ``latency_dist`` with mean ``latency_mean_s`` at the
    start of the run, growing linearly to ``latency_mean_s * latency_growth`` at its end.
    """

    name: str
    group_size: int = 8
    groups_in_flight: int = 4
    latency_mean_s: float = 8.0
    latency_dist: str = "lognormal"
    #: Lognormal: the standard deviation of log(latency).
    latency_sigma: float = 0.8
    #: Pareto: the tail index (> 1; below 2 the variance is infinite).
    latency_alpha: float = 2.5
    latency_growth: float = 1.0
    #: From SpawnWorker until the worker produces (process start, model load, registration).
    startup_s: float = 30.0
    #: Start-up times vary: each worker's is ``startup_s`` times a lognormal factor of mean 1 and
    #: this log-standard deviation (0: every worker takes exactly ``startup_s``).
    startup_sigma: float = 0.0
    #: The worker reports readiness (WorkerReady) when it produces; its process starts after
    #: min(1 s, startup_s). Without it, WorkerStarted comes when it produces.
    require_ready: bool = False
    gpus_per_worker: int = 1
    min_workers: int = 1
    max_workers: int = 32
    #: At most this many workers starting at once, as the core's ``PoolSpec.max_starting``: the
    #: reducer requests the rest as those come up, under every policy, and the oracle and the
    #: lower bound start theirs the same way.
    max_starting: int = 32
    #: atroposlib's max_batches_offpolicy: no new group while this many batches are queued.
    max_batches_offpolicy: int = 3
    policy: PolicySpec = attrs.field(factory=PolicySpec)
    # deo's pool settings (core.config.PoolSpec), with deo's defaults.
    stabilization_s: float = 120.0
    #: Seconds, or "auto": measured from the pool's drains (core.drains).
    drain_timeout_s: float | str = AUTO
    metrics_stale_s: float = 30.0
    start_timeout_s: float = 300.0
    crash_loop: CrashLoopRules = attrs.field(factory=CrashLoopRules)

    def __attrs_post_init__(self) -> None:
        for key in ("group_size", "groups_in_flight", "max_batches_offpolicy", "max_starting"):
            value = getattr(self, key)
            _require(value >= 1, f"{key}: must be >= 1, got {value}")
        _require(
            self.max_workers <= MAX_POOL_WORKERS,
            f"max_workers: at most {MAX_POOL_WORKERS:,} in a simulation, got {self.max_workers}",
        )
        for key in ("latency_mean_s", "latency_sigma", "latency_growth"):
            value = getattr(self, key)
            _require(_finite(value) and value > 0, f"{key}: must be > 0, got {value!r}")
        _require(
            _finite(self.latency_alpha) and self.latency_alpha > 1,
            f"latency_alpha: must be > 1 (a finite mean), got {self.latency_alpha!r}",
        )
        _require(
            self.latency_dist in LATENCY_DISTRIBUTIONS,
            f"latency_dist: {self.latency_dist!r} is not one of {', '.join(LATENCY_DISTRIBUTIONS)}",
        )
        _require(
            _finite(self.startup_s) and self.startup_s >= 0,
            f"startup_s: must be >= 0, got {self.startup_s!r}",
        )
        _require(
            _finite(self.startup_sigma) and self.startup_sigma >= 0,
            f"startup_sigma: must be >= 0, got {self.startup_sigma!r}",
        )

    @property
    def cost_per_worker(self) -> int:
        """GPU-hours per worker-hour; a CPU worker (0 GPUs) counts one worker-hour."""
        return max(self.gpus_per_worker, 1)

    def latency_mean_at(self, t: float, duration_s: float) -> float:
        """Mean group latency at ``t`` (linear growth over the run)."""
        return self.latency_mean_s * (1.0 + (self.latency_growth - 1.0) * t / duration_s)

    def latency_cdf(self, x: float, mean_s: float) -> float:
        """P(latency <= x) when the mean is ``mean_s``."""
        if x <= 0:
            return 0.0
        if self.latency_dist == "pareto":
            scale = mean_s * (self.latency_alpha - 1) / self.latency_alpha
            return 0.0 if x < scale else 1.0 - (scale / x) ** self.latency_alpha
        sigma = self.latency_sigma
        mu = math.log(mean_s) - sigma * sigma / 2
        return 0.5 * math.erfc(-(math.log(x) - mu) / (sigma * math.sqrt(2)))

    def pool_spec(
        self,
        policy: PolicySpec | None = None,
        overrides: Mapping[str, Any] | None = None,
        policies: PolicyCatalog = BUILT_INS,
    ) -> PoolSpec:
        """The core's PoolSpec for this pool; ``policy`` and ``overrides`` replace the scenario's.

        Policy parameters that describe the world rather than the policy are filled in from the
        pool when the policy has them and they are not given: ``max_batches_offpolicy``,
        ``group_size`` and ``capacity_per_worker`` (= ``groups_in_flight``).
        """
        spec = PoolSpec(
            name=self.name,
            argv=["sim-env", "--pool", "{pool}", "--slot", "{index}"],
            min_workers=self.min_workers,
            max_workers=self.max_workers,
            max_starting=self.max_starting,
            gpus_per_worker=self.gpus_per_worker,
            policy=self.world_params(policy or self.policy, policies),
            require_ready=self.require_ready,
            start_timeout_s=self.start_timeout_s,
            drain_timeout_s=self.drain_timeout_s,
            metrics_stale_s=self.metrics_stale_s,
            stabilization_s=self.stabilization_s,
            crash_loop=self.crash_loop,
        )
        if overrides:
            spec = attrs.evolve(spec, **overrides)
        return spec

    def world_params(self, policy: PolicySpec, policies: PolicyCatalog = BUILT_INS) -> PolicySpec:
        """``policy`` with the world's facts filled in where it takes them and lacks them."""
        cls = policies.policies.get(policy.name)
        if cls is None:
            return policy  # PolicyCatalog.build reports the unknown name
        facts: dict[str, Any] = {
            "max_batches_offpolicy": self.max_batches_offpolicy,
            "group_size": self.group_size,
            "capacity_per_worker": self.groups_in_flight,
        }
        params = dict(policy.params)
        for field in attrs.fields(cls):
            if field.name in facts and field.name not in params:
                kind = type(field.default)
                params[field.name] = kind(facts[field.name])
        if params == policy.params:
            return policy
        return PolicySpec(name=policy.name, params=params)


@attrs.frozen(slots=True, kw_only=True)
class InferenceSpec:
    """Shared inference capacity: up to ``max_concurrent_groups`` groups in generation at nominal
    speed; beyond it every group slows in proportion (processor sharing), so throughput caps."""

    max_concurrent_groups: int

    def __attrs_post_init__(self) -> None:
        _require(
            self.max_concurrent_groups >= 1,
            f"max_concurrent_groups: must be >= 1, got {self.max_concurrent_groups}",
        )


#: Per fault kind: the keys it requires and the keys it may have (besides kind and at_s).
FAULT_KINDS: dict[str, tuple[frozenset[str], frozenset[str]]] = {
    # A GPU runs slow (thermal throttling): groups its worker starts take `factor` times longer,
    # and its samples report thermal throttling. Until the end when duration_s is not given.
    "gpu_throttle": (frozenset({"gpu"}), frozenset({"duration_s", "factor"})),
    # A GPU falls off the bus: GpuLost, its worker dies, in-flight groups are lost.
    "gpu_loss": (frozenset({"gpu"}), frozenset()),
    # `count` producing workers of `pool` (the first pool by default) crash, oldest first.
    "worker_crash": (frozenset(), frozenset({"pool", "count"})),
    # Every worker of `pool` that starts in the window exits with code 1 `exit_after_s` later.
    "crash_loop": (frozenset({"duration_s"}), frozenset({"pool", "exit_after_s"})),
    # The pressure source of `pool` (every pool by default) answers SourceDown instead.
    "source_down": (frozenset({"duration_s"}), frozenset({"pool"})),
}


@attrs.frozen(slots=True, kw_only=True)
class Fault:
    """One fault injected at ``at_s``; its ``kind`` says which keys apply (:data:`FAULT_KINDS`)."""

    kind: str
    at_s: float
    duration_s: float | None = None
    #: A GPU by index (0 .. gpus - 1).
    gpu: int | None = None
    #: gpu_throttle: how many times slower the worker on the GPU generates.
    factor: float = 2.0
    pool: str | None = None
    count: int = 1
    exit_after_s: float = 5.0

    def __attrs_post_init__(self) -> None:
        _require(
            self.kind in FAULT_KINDS,
            f"kind: {self.kind!r} is not one of {', '.join(sorted(FAULT_KINDS))}",
        )
        _require(_finite(self.at_s) and self.at_s >= 0, f"at_s: must be >= 0, got {self.at_s!r}")
        required, _ = FAULT_KINDS[self.kind]
        for key in sorted(required):
            _require(getattr(self, key) is not None, f"{key}: a {self.kind} fault needs it")
        if self.duration_s is not None:
            _require(
                _finite(self.duration_s) and self.duration_s > 0,
                f"duration_s: must be > 0, got {self.duration_s!r}",
            )
        _require(self.gpu is None or self.gpu >= 0, f"gpu: must be >= 0, got {self.gpu}")
        _require(
            _finite(self.factor) and self.factor >= 1, f"factor: must be >= 1, got {self.factor}"
        )
        _require(self.count >= 1, f"count: must be >= 1, got {self.count}")
        _require(
            _finite(self.exit_after_s) and self.exit_after_s > 0,
            f"exit_after_s: must be > 0, got {self.exit_after_s!r}",
        )

    @property
    def end_s(self) -> float:
        """When the fault's window ends (infinity when it has none)."""
        return math.inf if self.duration_s is None else self.at_s + self.duration_s

    def covers(self, t: float) -> bool:
        return self.at_s <= t < self.end_s


def _pool_tuple(value: Any) -> tuple[EnvPool, ...]:
    return tuple(value)


@attrs.frozen(slots=True, kw_only=True)
class Scenario:
    """Everything the simulator needs for one run. Same scenario (seed included), same run."""

    name: str
    description: str = ""
    duration_s: float = 3600.0
    seed: int = 1
    #: Every pool gets a QueueSampled and a LoadSampled this often (SourceDown while down).
    sample_interval_s: float = 2.0
    #: Every GPU gets a GpuSampled this often.
    gpu_sample_interval_s: float = 10.0
    #: GPUs "0" .. "gpus-1"; None: enough for every pool at its maximum.
    gpus: int | None = None
    trainer: TrainerSpec = attrs.field(factory=TrainerSpec)
    pools: tuple[EnvPool, ...] = attrs.field(
        factory=lambda: (EnvPool(name="envs"),), converter=_pool_tuple
    )
    inference: InferenceSpec | None = None
    faults: tuple[Fault, ...] = attrs.field(default=(), converter=_tuple)

    def __attrs_post_init__(self) -> None:
        _require(bool(self.name), "name: must not be empty")
        for key in ("duration_s", "sample_interval_s", "gpu_sample_interval_s"):
            value = getattr(self, key)
            _require(_finite(value) and value > 0, f"{key}: must be > 0, got {value!r}")
        _require(
            self.duration_s <= MAX_DURATION_S,
            f"duration_s: at most {MAX_DURATION_S:g} s (31 days), got {self.duration_s:g}",
        )
        shortest_step_s = min([self.trainer.step_s, *(p.step_s for p in self.trainer.phases)])
        steps = self.duration_s / shortest_step_s
        _require(
            steps <= MAX_TRAINER_STEPS,
            f"trainer.step_s: {shortest_step_s:g} s steps over {self.duration_s:g} s make up to "
            f"{steps:,.0f} trainer steps; a simulation takes at most {MAX_TRAINER_STEPS:,}",
        )
        _require(self.gpus is None or self.gpus >= 0, f"gpus: must be >= 0, got {self.gpus}")
        _require(bool(self.pools), "pools: a scenario needs at least one env pool")
        names = [pool.name for pool in self.pools]
        for pool in self.pools:
            _require(names.count(pool.name) == 1, f"pools.{pool.name}: declared twice")
            _require(
                pool.gpus_per_worker <= self.gpu_count,
                f"pools.{pool.name}.gpus_per_worker: {pool.gpus_per_worker} exceeds the "
                f"scenario's {self.gpu_count} GPUs",
            )
        for i, fault in enumerate(self.faults):
            if fault.gpu is not None:
                _require(
                    fault.gpu < self.gpu_count,
                    f"faults[{i}].gpu: GPU {fault.gpu} is not one of the scenario's "
                    f"{self.gpu_count} GPUs (0 .. {self.gpu_count - 1})",
                )
            if fault.pool is not None:
                _require(
                    fault.pool in names,
                    f"faults[{i}].pool: no pool {fault.pool!r} (pools: {', '.join(names)})",
                )

    @property
    def gpu_count(self) -> int:
        if self.gpus is not None:
            return self.gpus
        return sum(pool.max_workers * pool.gpus_per_worker for pool in self.pools)

    @property
    def gpu_ids(self) -> tuple[str, ...]:
        return tuple(str(i) for i in range(self.gpu_count))

    def pool(self, name: str) -> EnvPool:
        for pool in self.pools:
            if pool.name == name:
                return pool
        raise KeyError(name)

    def config(
        self,
        policy: PolicySpec | None = None,
        pool_overrides: Mapping[str, Any] | None = None,
        policies: PolicyCatalog = BUILT_INS,
    ) -> Config:
        """The core's configuration: every pool (``policy``/``pool_overrides`` applied), GPUs."""
        return Config(
            pools=[pool.pool_spec(policy, pool_overrides, policies) for pool in self.pools],
            gpus=self.gpu_ids,
        )


# --- reading files --------------------------------------------------------------------------------


def load_scenario(
    path: str | Path,
    overrides: Mapping[str, str] | None = None,
    policies: PolicyCatalog = BUILT_INS,
) -> Scenario:
    """Read the TOML scenario at ``path``, apply ``overrides`` (``{"trainer.step_s": "2"}``).

    Override values are TOML literals (``2``, ``2.5``, ``true``, ``"text"``, ``[1, 2]``); a value
    that is not one is taken as a string. Raises :class:`ScenarioError` naming the key.
    """
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ScenarioError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise ScenarioError(f"{path}: is a directory, not a scenario file") from None
    except OSError as exc:
        raise ScenarioError(f"{path}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise ScenarioError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except tomllib.TOMLDecodeError as exc:
        raise ScenarioError(f"{path}: not valid TOML: {exc}") from None
    for key, raw in (overrides or {}).items():
        _override(data, key, parse_override(raw))
    if "name" not in data:
        data["name"] = path.stem
    return parse_scenario(data, policies)


def parse_override(raw: str) -> Any:
    """A ``--set`` value: a TOML literal, else the text itself."""
    return literal(raw)


#: Tables a --set key may create when the file has none: (depth, name) pairs.
_CREATABLE = {(0, "trainer"), (0, "inference"), (0, "pools"), (2, "policy"), (2, "crash_loop")}


def _override(data: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    if not all(parts):
        raise ScenarioError(f"--set {key}: not a dotted key (e.g. trainer.step_s)")
    node: Any = data
    for depth, part in enumerate(parts[:-1]):
        where = ".".join(parts[: depth + 1])
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise ScenarioError(
                    f"--set {key}: {where}: no such entry ({len(node)} in the list)"
                )
            node = node[int(part)]
            continue
        if part not in node:
            if depth == 1 and parts[0] == "pools":
                known = ", ".join(sorted(node)) or "none"
                raise ScenarioError(f"--set {key}: no pool {part!r} (pools: {known})")
            if (depth, part) not in _CREATABLE:
                raise ScenarioError(f"--set {key}: {where} is not a table")
            node[part] = {}
        node = node[part]
        if not isinstance(node, (dict, list)):
            raise ScenarioError(f"--set {key}: {where} is not a table")
    if isinstance(node, list):
        raise ScenarioError(f"--set {key}: {'.'.join(parts[:-1])} is a list; give an index")
    node[parts[-1]] = value


def parse_scenario(data: Mapping[str, Any], policies: PolicyCatalog = BUILT_INS) -> Scenario:
    """A scenario from parsed TOML (a dict); :class:`ScenarioError` naming the key if wrong."""
    table = dict(data)
    _known(
        table,
        "",
        {f.name for f in attrs.fields(Scenario)},
    )
    values = _scalars(Scenario, "", table, skip={"trainer", "pools", "inference", "faults"})
    if "trainer" in table:
        values["trainer"] = _trainer(_typed("trainer", table["trainer"], dict))
    if "pools" in table:
        pools = _typed("pools", table["pools"], dict)
        values["pools"] = [
            _env_pool(name, _typed(f"pools.{name}", raw, dict), policies)
            for name, raw in pools.items()
        ]
    if "inference" in table:
        values["inference"] = _construct(
            InferenceSpec, "inference", _typed("inference", table["inference"], dict)
        )
    if "faults" in table:
        faults = _typed("faults", table["faults"], list)
        values["faults"] = [_fault(f"faults[{i}]", raw) for i, raw in enumerate(faults)]
    return _construct(Scenario, "", values, typed=True)


def _trainer(table: dict[str, Any]) -> TrainerSpec:
    values = _scalars(TrainerSpec, "trainer", table, skip={"phases", "pauses"})
    for key, cls in (("phases", Phase), ("pauses", Pause)):
        if key in table:
            items = _typed(f"trainer.{key}", table[key], list)
            values[key] = [
                _construct(cls, f"trainer.{key}[{i}]", _typed(f"trainer.{key}[{i}]", raw, dict))
                for i, raw in enumerate(items)
            ]
    return _construct(TrainerSpec, "trainer", values, typed=True)


def _env_pool(name: str, table: dict[str, Any], policies: PolicyCatalog) -> EnvPool:
    where = f"pools.{name}"
    values = _scalars(EnvPool, where, table, skip={"name", "policy", "crash_loop"})
    if "policy" in table:
        policy = dict(_typed(f"{where}.policy", table["policy"], dict))
        policy_name = _typed(f"{where}.policy.name", policy.pop("name", "buffer"), str)
        try:
            spec = PolicySpec(name=policy_name, params=policy)
        except ConfigError as exc:
            raise ScenarioError(f"{where}.{exc}") from None
        values["policy"] = spec
    if "crash_loop" in table:
        values["crash_loop"] = _construct(
            CrashLoopRules,
            f"{where}.crash_loop",
            _typed(f"{where}.crash_loop", table["crash_loop"], dict),
        )
    pool = _construct(EnvPool, where, {"name": name, **values}, typed=True)
    try:
        # The policy and its parameters, checked by key.
        policies.build(pool.world_params(pool.policy, policies))
        pool.pool_spec()  # deo's own checks of the pool (min <= max, timeouts, ...)
    except ScenarioError:
        raise
    except ConfigError as exc:
        message = str(exc)
        raise ScenarioError(
            message if message.startswith("pools.") else f"{where}.{message}"
        ) from None
    return pool


def _fault(where: str, raw: Any) -> Fault:
    table = dict(_typed(where, raw, dict))
    kind = _typed(f"{where}.kind", table.get("kind"), str) if "kind" in table else None
    if kind is None:
        raise ScenarioError(f"{where}.kind: missing; one of {', '.join(sorted(FAULT_KINDS))}")
    if kind not in FAULT_KINDS:
        raise ScenarioError(
            f"{where}.kind: {kind!r} is not one of {', '.join(sorted(FAULT_KINDS))}"
        )
    required, optional = FAULT_KINDS[kind]
    allowed = {"kind", "at_s"} | required | optional
    _known(table, where, allowed)
    for key in sorted(({"at_s"} | required) - set(table)):
        raise ScenarioError(f"{where}.{key}: missing (a {kind} fault needs it)")
    return _construct(Fault, where, table)


# --- small checks, by key -------------------------------------------------------------------------

_NAMES: dict[type, str] = {
    int: "an integer",
    float: "a number",
    str: "a string",
    bool: "true or false",
    dict: "a table",
    list: "a list",
}


def _known(table: Mapping[str, Any], where: str, known: set[str] | frozenset[str]) -> None:
    for key in table:
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=1)
            hint = (
                f" (did you mean {close[0]}?)" if close else f"; known: {', '.join(sorted(known))}"
            )
            raise ScenarioError(f"{where + '.' if where else ''}{key}: unknown key{hint}")


def _typed(where: str, value: Any, kind: type) -> Any:
    """``value`` if it is a ``kind`` (an int is a float too, a bool is not an int)."""
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, kind) and not (kind in (int, float) and isinstance(value, bool)):
        return value
    name = _NAMES.get(kind, kind.__name__)
    raise ScenarioError(f"{where}: expected {name}, got {value!r}")


def _scalar_kind(cls: type, key: str) -> type:
    """The scalar type of an attrs field, from its default (None defaults: see _OPTIONAL)."""
    field = attrs.fields_dict(cls)[key]
    optional = _OPTIONAL.get((cls.__name__, key))
    if optional is not None:
        return optional
    default = field.default
    if isinstance(default, attrs.Factory):  # type: ignore[arg-type]
        raise AssertionError(f"{cls.__name__}.{key} is not a scalar")
    if default is attrs.NOTHING:
        return _REQUIRED[(cls.__name__, key)]
    return type(default)


#: Fields whose default is None (or that have none): their type when given.
_OPTIONAL: dict[tuple[str, str], type] = {
    ("Scenario", "gpus"): int,
    ("Fault", "duration_s"): float,
    ("Fault", "gpu"): int,
    ("Fault", "pool"): str,
    ("EnvPool", "drain_timeout_s"): float,  # or "auto"
}
_REQUIRED: dict[tuple[str, str], type] = {
    ("Scenario", "name"): str,
    ("EnvPool", "name"): str,
    ("Phase", "at_s"): float,
    ("Phase", "step_s"): float,
    ("Pause", "at_s"): float,
    ("Pause", "duration_s"): float,
    ("InferenceSpec", "max_concurrent_groups"): int,
    ("Fault", "kind"): str,
    ("Fault", "at_s"): float,
}


def _scalars(
    cls: type,
    where: str,
    table: Mapping[str, Any],
    *,
    skip: set[str] | frozenset[str] = frozenset(),
) -> dict[str, Any]:
    """The scalar fields of ``cls`` in ``table``, type-checked; unknown keys are errors."""
    fields = set(attrs.fields_dict(cls))
    _known(table, where, fields - {"name"} if cls is EnvPool else fields)
    prefix = f"{where}." if where else ""
    return {
        key: (
            value
            if (cls, key, type(value)) == (EnvPool, "drain_timeout_s", str)  # "auto"
            else _typed(f"{prefix}{key}", value, _scalar_kind(cls, key))
        )
        for key, value in table.items()
        if key not in skip
    }


def _construct(cls: type[T], where: str, values: Mapping[str, Any], *, typed: bool = False) -> T:
    """``cls(**values)``, its own complaint prefixed with ``where``; scalars type-checked unless
    ``typed`` says the caller did it."""
    prefix = f"{where}." if where else ""
    if not typed:
        values = _scalars(cls, where, values)
    try:
        return cls(**values)
    except ScenarioError as exc:
        message = str(exc)
        if message.startswith(("pools.", "faults[")) and not where:
            raise
        raise ScenarioError(f"{prefix}{message}") from None
    except ConfigError as exc:  # deo's own records (CrashLoopRules) name their keys already
        message = str(exc)
        if "." in message.split(":")[0] and where:
            message = message.split(".", 1)[1]
        raise ScenarioError(f"{prefix}{message}") from None
    except TypeError as exc:  # a required key is missing
        missing = re.findall(r"'(\w+)'", str(exc)) if "missing" in str(exc) else []
        if missing:
            keys = ", ".join(f"{prefix}{key}" for key in missing)
            raise ScenarioError(f"{keys}: missing") from None
        raise ScenarioError(f"{where or 'scenario'}: {exc}") from None
