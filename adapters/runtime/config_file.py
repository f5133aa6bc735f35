"""``deo run --config FILE``: the TOML file, read into the core's Config plus runtime settings.

Every problem is reported with its key (``pools.envs.max_workers: expected an integer, got
"8"``), unknown keys included, with a suggestion when one is close. See ``examples/local.toml``.
"""

from __future__ import annotations

import difflib
import ipaddress
import math
import os
import tomllib
import types
import typing
from pathlib import Path
from typing import Any

import attrs
import orjson

from adapters.sources.atropos import AtroposSource
from adapters.sources.json_pressure import JsonSource
from adapters.sources.nvml import NvmlSettings, discover_gpus
from core import (
    Config,
    ConfigError,
    Configured,
    CordonRules,
    CrashLoopRules,
    DeoError,
    LoadSampled,
    PolicySpec,
    PoolSpec,
    QueueSampled,
    decode,
    encode,
)
from core.arbiter import PlannerSettings
from core.policies import POLICIES, build

__all__ = [
    "ApiSettings",
    "ArbiterSettings",
    "ExecutorSettings",
    "RunSettings",
    "Source",
    "check_loggable",
    "load",
    "load_api",
]

#: ``executor.kind`` values: processes on this machine, or actors on a Ray cluster.
EXECUTOR_KINDS = ("local", "ray")


#: The shortest tick a configuration file may ask for.
MIN_TICK_INTERVAL_S = 0.01


@attrs.frozen(slots=True, kw_only=True)
class ExecutorSettings:
    """Where workers run (``[executor]``): ``kind = "local"`` (processes on this machine) or
    ``"ray"`` (actors on a Ray cluster at ``address``, in ``namespace``: by default one derived
    from the log's path). See docs/ray.md."""

    kind: str = "local"
    #: The Ray cluster: "auto" (the one ``ray start`` runs on this machine) or HOST:PORT.
    address: str = "auto"
    namespace: str | None = None
    #: How long a worker's actor may wait to be placed before its spawn fails.
    spawn_timeout_s: float = 120.0
    #: How long one call to the cluster may go unanswered before the cluster counts as
    #: unreachable (a ``cluster_unreachable`` alert).
    call_timeout_s: float = 30.0

    def __attrs_post_init__(self) -> None:
        if self.kind not in EXECUTOR_KINDS:
            raise ConfigError(
                f"executor.kind: {self.kind!r} is not one of {', '.join(map(repr, EXECUTOR_KINDS))}"
            )
        if not self.address:
            raise ConfigError("executor.address: empty")
        if self.namespace is not None and not self.namespace:
            raise ConfigError("executor.namespace: empty")
        for key in ("spawn_timeout_s", "call_timeout_s"):
            value = getattr(self, key)
            if not (math.isfinite(value) and value > 0):
                raise ConfigError(f"executor.{key} must be > 0, got {value}")


@attrs.frozen(slots=True, kw_only=True)
class ApiSettings:
    """Where the HTTP API listens, the bearer token its mutating endpoints require, and how many
    connections it holds."""

    host: str = "127.0.0.1"
    port: int = 8787
    #: The name of the environment variable holding the operator token.
    token_env: str = "DEO_TOKEN"
    #: Beyond loopback, reads need the operator token too unless this says they stay open.
    open_reads: bool = False
    #: Most connections held at once (fewer where the open-file limit leaves less).
    max_connections: int = 256
    #: How long a connection has to deliver a complete request before it is closed.
    request_timeout_s: float = 10.0

    def __attrs_post_init__(self) -> None:
        if not self.host:
            raise ConfigError("api.host: empty (it would listen on every interface)")
        if not 0 <= self.port < 65536:
            raise ConfigError(f"api.port: {self.port} is not in 0-65535 (0 picks a free port)")
        if not self.token_env:
            raise ConfigError("api.token_env: empty")
        if self.max_connections < 1:
            raise ConfigError(f"api.max_connections must be >= 1, got {self.max_connections}")
        if not (math.isfinite(self.request_timeout_s) and self.request_timeout_s > 0):
            raise ConfigError(f"api.request_timeout_s must be > 0, got {self.request_timeout_s}")

    @property
    def loopback(self) -> bool:
        """The API listens on a loopback address only (reachable from this machine alone)."""
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False  # a host name: it may resolve beyond loopback


@attrs.frozen(slots=True, kw_only=True)
class ArbiterSettings:
    """The GPU arbiter ``deo run`` serves (``[arbiter]``; see docs/arbiter.md): the GPUs it
    shares among RL pipelines, ids as in ``deo.gpus``, and its planner (``[arbiter.planner]``,
    recorded in the log)."""

    gpus: tuple[str, ...] = attrs.field(converter=tuple)
    planner: PlannerSettings = attrs.field(factory=PlannerSettings)

    def __attrs_post_init__(self) -> None:
        if not self.gpus:
            raise ConfigError("arbiter.gpus: empty (list the GPUs the arbiter shares)")
        for gpu in self.gpus:
            if not isinstance(gpu, str) or not gpu:
                raise ConfigError(f"arbiter.gpus: {gpu!r} is not a GPU id")
            if self.gpus.count(gpu) > 1:
                raise ConfigError(f"arbiter.gpus: {gpu!r} listed twice")


#: Where a pool's pressure comes from: ``kind = "json"`` (the default) or ``kind = "atropos"``.
Source = JsonSource | AtroposSource
_SOURCE_KINDS: dict[str, type[JsonSource] | type[AtroposSource]] = {
    "json": JsonSource,
    "atropos": AtroposSource,
}


@attrs.frozen(slots=True, kw_only=True)
class RunSettings:
    """Everything ``deo run`` needs: the core's configuration and how to run around it."""

    config: Config
    log: Path
    fsync: bool = True
    snapshot_every: int = 10_000
    #: A snapshot taken once the log is this long starts a new segment (0: one file forever).
    segment_bytes: int = 64 * 2**20
    #: Earlier segments kept (None: all, ``keep_segments = "all"``).
    keep_segments: int | None = 10
    tick_interval_s: float = 1.0
    worker_logs: Path = Path("deo-workers")
    api: ApiSettings = attrs.field(factory=ApiSettings)
    sources: tuple[Source, ...] = ()
    #: GPU health monitoring (``[nvml]``): NVML when a driver answers, by default.
    nvml: NvmlSettings = attrs.field(factory=NvmlSettings)
    executor: ExecutorSettings = attrs.field(factory=ExecutorSettings)
    #: The GPU arbiter (``[arbiter]``); None: deo serves none.
    arbiter: ArbiterSettings | None = None
    #: A first SIGINT or SIGTERM drains every worker and then stops, as ``deo stop --drain``
    #: does (a second stops at once): for a run whose workers are its own, such as ``deo demo``.
    #: (``deo run`` leaves its workers running for a restart to adopt.)
    drain_on_signal: bool = False

    def __attrs_post_init__(self) -> None:
        if self.arbiter is not None:
            outside = [g for g in self.arbiter.gpus if g not in self.config.gpus]
            if outside:
                raise ConfigError(
                    f"arbiter.gpus: {outside} not among deo.gpus {list(self.config.gpus)} "
                    f"(deo watches only those GPUs' health)"
                )
        if not (math.isfinite(self.tick_interval_s) and self.tick_interval_s > 0):
            raise ConfigError(f"deo.tick_interval_s must be > 0, got {self.tick_interval_s}")
        if self.tick_interval_s < MIN_TICK_INTERVAL_S:
            # Every tick is a log record: a microsecond tick fills the disk, not the trainer.
            raise ConfigError(
                f"deo.tick_interval_s must be >= {MIN_TICK_INTERVAL_S:g} (each tick is a log "
                f"record), got {self.tick_interval_s:g}"
            )
        if self.snapshot_every < 1:
            raise ConfigError(f"deo.snapshot_every must be >= 1, got {self.snapshot_every}")
        if self.segment_bytes < 0:
            raise ConfigError(f"deo.segment_bytes must be >= 0, got {self.segment_bytes}")
        if self.keep_segments is not None and self.keep_segments < 0:
            raise ConfigError(f'deo.keep_segments must be >= 0 or "all", got {self.keep_segments}')
        policies = {pool.name: build(pool.policy) for pool in self.config.pools}
        policy_names = {pool.name: pool.policy.name for pool in self.config.pools}
        for source in self.sources:
            wanted = policies[source.pool].reacts_to
            given = (
                LoadSampled
                if isinstance(source, JsonSource) and source.in_flight_requests is not None
                else QueueSampled
            )
            if wanted is not given:
                gives = "in_flight_requests" if given is LoadSampled else "a trainer queue"
                needs = (
                    "nothing"
                    if wanted is None
                    else ("in_flight_requests" if wanted is LoadSampled else "a trainer queue")
                )
                able = sorted(
                    name
                    for name, cls in POLICIES.items()
                    if getattr(cls, "reacts_to", None) is given
                )
                raise ConfigError(
                    f"pools.{source.pool}.source: its policy "
                    f"{policy_names[source.pool]!r} reads {needs}; this source gives {gives} "
                    f"(the policies that read it: {', '.join(map(repr, able))})"
                )


def _read(path: Path) -> dict[str, Any]:
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(exc.strerror or str(exc)) from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"not valid TOML: {exc}") from None
    _refuse_non_finite(data, "")
    return data


def _api_settings(data: dict[str, Any]) -> ApiSettings:
    settings: ApiSettings = _build(ApiSettings, "api", _table(data, "api", None))
    return settings


def load_api(path: Path) -> ApiSettings:
    """Only the ``[api]`` table of ``path``: where a running deo listens, for its clients."""
    return _api_settings(_read(path))


def load_log_path(path: Path) -> Path:
    """Only ``deo.log`` of ``path``, resolved as :func:`load` resolves it."""
    deo = _table(_read(path), "deo", None)
    return path.parent.resolve() / _file_name(deo, "log", "deo.jsonl")


def _file_name(deo: dict[str, Any], key: str, default: str) -> str:
    """``deo.KEY``: a path, not empty (an empty one would name the configuration's folder)."""
    value: str = typed(f"deo.{key}", deo.get(key, default), str)
    if not value.strip():
        raise ConfigError(f"deo.{key}: empty; give a path (default {default!r})")
    return value


def load(path: Path) -> RunSettings:
    """Read ``path``; :class:`ConfigError` naming the key on any problem (callers name the file).

    ``deo.gpus = "auto"`` asks NVML (or the ``[nvml]`` file) for the GPUs here.
    """
    data = _read(path)
    base = path.parent.resolve()  # absolute: workers get these paths and may change directory
    deo = _table(
        data,
        "deo",
        {
            "log",
            "fsync",
            "snapshot_every",
            "segment_bytes",
            "keep_segments",
            "tick_interval_s",
            "worker_logs",
            "gpus",
        },
    )
    _known(data, "", {"arbiter", "deo", "api", "cordon", "executor", "nvml", "pools"})
    pools_table = _table(data, "pools", None)
    pools, sources = [], []
    for name, raw in pools_table.items():
        if not isinstance(raw, dict):
            raise ConfigError(f"pools.{name}: expected a table ([pools.{name}])")
        pool, source = _pool(name, raw)
        pools.append(pool)
        if source is not None:
            sources.append(source)
    nvml = _nvml_settings(_table(data, "nvml", None), base)
    gpus = deo.get("gpus", [])
    if gpus == "auto":
        gpus = discover_gpus(nvml, os.environ.get("CUDA_VISIBLE_DEVICES"))
    elif isinstance(gpus, str):
        raise ConfigError(f'deo.gpus: expected a list of GPU ids or "auto", got {gpus!r}')
    config = Config(
        pools=pools,
        gpus=[str(g) for g in typed("deo.gpus", gpus, list)],
        cordon=_build(CordonRules, "cordon", _table(data, "cordon", None)),
    )
    settings: dict[str, Any] = {}
    for key, kind in (
        ("fsync", bool),
        ("snapshot_every", int),
        ("segment_bytes", int),
        ("tick_interval_s", float),
    ):
        if key in deo:
            settings[key] = typed(f"deo.{key}", deo[key], kind)
    if "keep_segments" in deo:
        keep = deo["keep_segments"]
        settings["keep_segments"] = None if keep == "all" else typed("deo.keep_segments", keep, int)
    check_loggable(config)
    executor = _build(ExecutorSettings, "executor", _table(data, "executor", None))
    return RunSettings(
        config=config,
        log=base / _file_name(deo, "log", "deo.jsonl"),
        worker_logs=base / _file_name(deo, "worker_logs", "deo-workers"),
        api=_api_settings(data),
        sources=tuple(sources),
        nvml=nvml,
        executor=executor,
        arbiter=_arbiter_settings(data["arbiter"]) if "arbiter" in data else None,
        **settings,
    )


def _arbiter_settings(raw: Any) -> ArbiterSettings:
    table = dict(typed("arbiter", raw, dict))
    planner = _planner_settings(table.pop("planner", {}))
    settings: ArbiterSettings = _build(ArbiterSettings, "arbiter", table)
    return attrs.evolve(settings, planner=planner)


#: ``[arbiter.planner]`` keys that take ``"never"`` (no limit).
_NEVER = frozenset({"stale_after_s", "reserve_s", "reserve_factor"})


def _planner_settings(raw: Any) -> PlannerSettings:
    """``[arbiter.planner]``: the planner's parameters (docs/arbiter.md), ``"never"`` for no
    limit where one may be switched off."""
    table = typed("arbiter.planner", raw, dict)
    _known(table, "arbiter.planner", {f.name for f in attrs.fields(PlannerSettings)})
    values: dict[str, Any] = {}
    for key, value in table.items():
        where = f"arbiter.planner.{key}"
        if key == "name":
            values[key] = typed(where, value, str)
        elif key == "rate_over_awake_gpu_s":
            values[key] = typed(where, value, bool)
        elif key in _NEVER and value == "never":
            values[key] = None
        else:
            values[key] = typed(where, value, float)
    try:
        return PlannerSettings(**values)
    except DeoError as exc:
        raise ConfigError(f"arbiter.planner: {exc}") from None


def check_loggable(config: Config) -> None:
    """Return if ``config`` comes back from the event log exactly as it is; else ConfigError.

    The log is the only record of the configuration a run applied: one that does not survive
    encode -> JSON -> decode would be applied now and read back differently (or not at all) by
    the next start and by ``deo replay``. The error names the first key that differs.
    """
    event = Configured(t=0.0, config=config)
    given = encode(event)
    try:
        logged = orjson.loads(orjson.dumps(given))
    except TypeError as exc:  # orjson's JSONEncodeError
        raise ConfigError(f"the configuration cannot be written to the event log: {exc}") from None
    differs = _first_difference(given, logged, "")
    if differs is None:
        try:
            back = decode(logged)
        except DeoError as exc:
            raise ConfigError(
                f"the configuration would not read back from the log: {exc}"
            ) from None
        if back != event:
            differs = _first_difference(given, encode(back), "") or ("config", config, back.config)
    if differs is not None:
        where, value, read_back = differs
        raise ConfigError(
            f"{where or 'config'}: {value!r} would read back from the event log as {read_back!r}"
        )


def _first_difference(given: Any, logged: Any, where: str) -> tuple[str, Any, Any] | None:
    """(dotted key, given value, logged value) where two encoded values first differ."""
    if isinstance(given, dict) and isinstance(logged, dict):
        for key in given:
            if key == "@":
                continue
            found = _first_difference(given[key], logged.get(key), _join(where, key, given))
            if found is not None:
                return found
        return None
    if isinstance(given, list) and isinstance(logged, list) and len(given) == len(logged):
        for index, (a, b) in enumerate(zip(given, logged, strict=True)):
            item = a.get("name", index) if isinstance(a, dict) else index
            found = _first_difference(a, b, f"{where}.{item}" if where else str(item))
            if found is not None:
                return found
        return None
    # NaN is not equal to itself: a logged NaN never reads back as the same configuration.
    same = given == logged and not (isinstance(given, float) and math.isnan(given))
    return None if same else (where, given, logged)


def _join(where: str, key: str, parent: dict[str, Any]) -> str:
    if parent.get("@") == "Configured" and key == "config":
        return where  # the event's own wrapping is not a key of the file
    return f"{where}.{key}" if where else key


def _refuse_non_finite(value: Any, where: str) -> None:
    """ConfigError naming the key of the first infinite or NaN number in the parsed file."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(
            f"{where}: {value} is not a finite number (the event log, JSON, cannot hold it)"
        )
    if isinstance(value, dict):
        for key, item in value.items():
            _refuse_non_finite(item, f"{where}.{key}" if where else key)
    elif isinstance(value, list):
        for index, item in enumerate(value):
            _refuse_non_finite(item, f"{where}[{index}]")


def _nvml_settings(table: dict[str, Any], base: Path) -> NvmlSettings:
    table = dict(table)
    if "file" in table:
        table["file"] = base / typed("nvml.file", table["file"], str)
    settings: NvmlSettings = _build(NvmlSettings, "nvml", table)
    return settings


def _pool(name: str, raw: dict[str, Any]) -> tuple[PoolSpec, Source | None]:
    where = f"pools.{name}"
    fields: dict[str, Any] = {}
    hints = typing.get_type_hints(PoolSpec)
    known = {f.name for f in attrs.fields(PoolSpec)} - {"name"} | {"source"}
    _known(raw, where, known)
    for key, value in raw.items():
        if key == "policy":
            policy = dict(typed(f"{where}.policy", value, dict))
            policy_name = typed(f"{where}.policy.name", policy.pop("name", "buffer"), str)
            fields["policy"] = PolicySpec(name=policy_name, params=policy)
            try:
                build(fields["policy"])  # check the policy and its parameters now, by key
            except ConfigError as exc:
                raise ConfigError(f"{where}.{exc}") from None
        elif key == "crash_loop":
            fields["crash_loop"] = _build(CrashLoopRules, f"{where}.crash_loop", value)
        elif key != "source":
            fields[key] = typed(f"{where}.{key}", value, hints[key])
    source = None
    if "source" in raw:
        table = dict(typed(f"{where}.source", raw["source"], dict))
        kind = typed(f"{where}.source.kind", table.pop("kind", "json"), str)
        cls = _SOURCE_KINDS.get(kind)
        if cls is None:
            raise ConfigError(
                f"{where}.source.kind: unknown kind {kind!r}; known: {', '.join(_SOURCE_KINDS)}"
            )
        # `pool` is the table's own name: given inside the table it is an unknown key.
        _known(table, f"{where}.source", {f.name for f in attrs.fields(cls)} - {"pool"})
        source = _build(cls, f"{where}.source", {**table, "pool": name}, skip={"pool"})
    missing = [
        f.name
        for f in attrs.fields(PoolSpec)
        if f.default is attrs.NOTHING and f.name != "name" and f.name not in fields
    ]
    if missing:
        raise ConfigError(f"{where}.{missing[0]}: required")
    return PoolSpec(name=name, **fields), source


def _build(
    cls: type, where: str, raw: Any, *, skip: frozenset[str] | set[str] = frozenset()
) -> Any:
    table = typed(where, raw, dict)
    hints = typing.get_type_hints(cls)
    _known(
        {k: v for k, v in table.items() if k not in skip},
        where,
        {f.name for f in attrs.fields(cls)} - set(skip),
    )
    values = {
        key: value if key in skip else typed(f"{where}.{key}", value, hints[key])
        for key, value in table.items()
    }
    missing = [
        f.name for f in attrs.fields(cls) if f.default is attrs.NOTHING and f.name not in values
    ]
    if missing:
        raise ConfigError(f"{where}.{missing[0]}: required")
    return cls(**values)


def _table(data: dict[str, Any], key: str, known: set[str] | None) -> dict[str, Any]:
    table = data.get(key, {})
    if not isinstance(table, dict):
        raise ConfigError(f"{key}: expected a table ([{key}])")
    if known is not None:
        _known(table, key, known)
    return table


def _known(table: dict[str, Any], where: str, known: set[str]) -> None:
    for key in table:
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            hint = (
                f" (did you mean {close[0]}?)" if close else f"; known: {', '.join(sorted(known))}"
            )
            raise ConfigError(f"{where + '.' if where else ''}{key}: unknown key{hint}")


_NAMES = {
    int: "an integer",
    float: "a number",
    str: "a string",
    bool: "true or false",
    list: "a list",
    dict: "a table",
    tuple: "a list",
    frozenset: "a list",
}


def literal(raw: str) -> Any:
    """A ``--set`` value as the configuration files would write it: a TOML literal (``4``,
    ``true``, ``"auto"``, ``[1, 2]``, ``{A = "1"}``), else the text itself."""
    try:
        return tomllib.loads(f"value = {raw}")["value"]
    except tomllib.TOMLDecodeError:
        return raw


def typed(where: str, value: Any, hint: Any) -> Any:
    """``value`` if it fits the annotation ``hint`` (ints accepted for floats), else ConfigError."""
    options = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    for option in options:
        if option is type(None) and value is None:
            return value
        kind = typing.get_origin(option) or option
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        if kind is int and isinstance(value, bool):
            continue
        if isinstance(kind, type) and isinstance(value, kind):
            return value
        if kind in (tuple, frozenset) and isinstance(value, list):
            return value
    expected = " or ".join(
        _NAMES.get(typing.get_origin(o) or o, str(o)) for o in options if o is not type(None)
    )
    raise ConfigError(f"{where}: expected {expected}, got {value!r}")
