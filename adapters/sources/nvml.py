"""GPU health from NVML: memory, temperature, throttling, XID/ECC errors and lost GPUs.

:func:`poll_gpus` reads every configured GPU each ``interval_s`` and turns what it saw into the
core's ``GpuSampled`` and ``GpuLost`` events; the core's cordon rules (``[cordon]``) decide what
they mean. Readings come from a :class:`GpuReader`: :class:`PynvmlReader` (the real NVML through
pynvml) or :class:`FileNvml` (a JSON file read on every poll: tests and dry runs without GPUs).

NVML calls block, so every read runs in a worker thread. Without a driver deo says so in one line
and runs on: its GPUs then come from the configuration only, unmonitored. See docs/nvml.md.
"""

from __future__ import annotations

import contextlib
import math
import re
import threading
import warnings
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import anyio
import attrs
import orjson

from core import (
    ConfigError,
    CordonRules,
    DeoError,
    Event,
    GpuLost,
    GpuSampled,
    InvalidEvent,
    State,
)

__all__ = [
    "APPLICATION_XIDS",
    "BACKENDS",
    "FileNvml",
    "GpuGone",
    "GpuHealth",
    "GpuMonitor",
    "GpuReader",
    "GpuReading",
    "GpuSourceError",
    "NvmlSettings",
    "NvmlUnavailable",
    "PynvmlReader",
    "ReadFailed",
    "SampleFilter",
    "discover_gpus",
    "held_gpus",
    "import_pynvml",
    "open_reader",
    "physical_gpu_ids",
    "poll_gpus",
    "sample_filter",
    "throttle_reasons",
]

#: ``nvml.backend`` values: NVML when a driver answers (else off), NVML, a JSON file, nothing.
BACKENDS = ("auto", "pynvml", "file", "off")

#: NVML's clocks-event (formerly "throttle") reason bits and the names the core's cordon rules
#: use (``[cordon] throttle_reasons``, default thermal and power). Bit values are NVML's
#: ``nvmlClocksEventReason*`` / ``nvmlClocksThrottleReason*`` constants.
#: The software power cap is how a busy GPU normally runs at its power limit, so it gets a name
#: of its own ("power_cap") rather than "power": cordoning on it would cordon every busy GPU.
#: "power" is the hardware power brake (an external power-supply signal).
THROTTLE_REASON_BITS: tuple[tuple[int, str], ...] = (
    (0x0000000000000002, "applications_clocks"),  # ApplicationsClocksSetting
    (0x0000000000000004, "power_cap"),  # SwPowerCap
    (0x0000000000000008, "hw_slowdown"),  # HwSlowdown (heat, power brake or a power spike)
    (0x0000000000000010, "sync_boost"),  # SyncBoost
    (0x0000000000000020, "thermal"),  # SwThermalSlowdown
    (0x0000000000000040, "thermal"),  # HwThermalSlowdown
    (0x0000000000000080, "power"),  # HwPowerBrakeSlowdown
    (0x0000000000000100, "display_clocks"),  # DisplayClockSetting
    (0x0000000000000200, "board_limit"),  # BoardLimit
    (0x0000000000000400, "reliability"),  # Reliability
)
#: GpuIdle: clocks drop because nothing runs. Not a problem, never a reason.
_IDLE_BIT = 0x0000000000000001

#: XIDs that report an application's fault, not the GPU's (the GPU stays healthy); NVIDIA's
#: Kubernetes device plugin skips the same ones when it marks devices unhealthy.
APPLICATION_XIDS = frozenset(
    {
        13,  # graphics engine exception
        31,  # GPU memory page fault
        43,  # GPU stopped processing
        45,  # preemptive cleanup, due to previous errors
        68,  # video processor exception
    }
)

# NVML return codes (nvmlReturn_t) and constants this module uses, as NVML defines them.
_NVML_ERROR_INVALID_ARGUMENT = 2
_NVML_ERROR_NOT_SUPPORTED = 3
_NVML_ERROR_NO_PERMISSION = 4
_NVML_ERROR_NOT_FOUND = 6
_NVML_ERROR_TIMEOUT = 10
_NVML_ERROR_FUNCTION_NOT_FOUND = 13
_NVML_ERROR_GPU_IS_LOST = 15
#: A field NVML cannot give on this GPU (or to this user): the check is off for it, not failed.
_UNSUPPORTED = frozenset(
    {_NVML_ERROR_NOT_SUPPORTED, _NVML_ERROR_NO_PERMISSION, _NVML_ERROR_FUNCTION_NOT_FOUND}
)
_NVML_TEMPERATURE_GPU = 0
_NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
_NVML_VOLATILE_ECC = 0
_NVML_EVENT_TYPE_XID_CRITICAL_ERROR = 0x8
#: How long a stopping deo gives NVML to shut down cleanly.
_CLOSE_TIMEOUT_S = 5.0
#: At most this many XID events are taken from one GPU per poll (the rest wait for the next).
_MAX_XIDS_PER_POLL = 64

_INDEX = re.compile(r"[0-9]+")
_NEGATIVE = re.compile(r"-[0-9]+")


def _is_uuid(gpu_id: str) -> bool:
    return gpu_id.startswith(("GPU-", "MIG-")) and len(gpu_id) > 4


def _optional_path(value: Path | str | None) -> Path | None:
    return None if value is None else Path(value)


@attrs.frozen(slots=True, kw_only=True)
class NvmlSettings:
    """``[nvml]``: where GPU health comes from and how often it is read."""

    #: "auto" (NVML if a driver answers, else off), "pynvml", "file" or "off".
    backend: str = "auto"
    #: For backend "file": the JSON file of readings (see :class:`FileNvml`).
    file: Path | None = attrs.field(default=None, converter=_optional_path)
    interval_s: float = 2.0
    #: A GPU's reading reaches the core (and the log) when it matters to the cordon rules, and
    #: otherwise at least this often; 0: every reading (see :class:`SampleFilter`).
    keepalive_s: float = 600.0
    #: Memory use moving by more than this fraction of the GPU's memory is a change worth sending.
    memory_tolerance: float = 0.05
    #: A temperature moving by this many degrees or more is a change worth sending.
    temperature_tolerance_c: float = 5.0

    def __attrs_post_init__(self) -> None:
        for key in ("keepalive_s", "memory_tolerance", "temperature_tolerance_c"):
            value = getattr(self, key)
            if not (
                isinstance(value, (int, float))
                and not isinstance(value, bool)
                and math.isfinite(value)
                and value >= 0
            ):
                raise ConfigError(f"nvml.{key}: must be a number >= 0, got {value!r}")
        if self.backend not in BACKENDS:
            raise ConfigError(
                f"nvml.backend: {self.backend!r} is not one of {', '.join(map(repr, BACKENDS))}"
            )
        if self.backend == "file" and self.file is None:
            raise ConfigError('nvml.file: required with nvml.backend = "file"')
        if self.backend != "file" and self.file is not None:
            raise ConfigError(
                f'nvml.file: only read with nvml.backend = "file" (the backend is {self.backend!r})'
            )
        if not (
            isinstance(self.interval_s, (int, float))
            and math.isfinite(self.interval_s)
            and self.interval_s > 0
        ):
            raise ConfigError(
                f"nvml.interval_s: must be a number of seconds > 0, got {self.interval_s!r}"
            )


# --- ids -----------------------------------------------------------------------------------------


def _visible_devices(cuda_visible_devices: str) -> list[str]:
    """deo's own CUDA_VISIBLE_DEVICES as a list, read the way CUDA reads it."""
    visible: list[str] = []
    for raw in cuda_visible_devices.split(","):
        entry = raw.strip()
        if not entry or _NEGATIVE.fullmatch(entry):
            break  # CUDA stops at "-1" (the usual way to hide every GPU) or an empty entry
        if not (_INDEX.fullmatch(entry) or _is_uuid(entry)):
            raise ConfigError(
                f"CUDA_VISIBLE_DEVICES={cuda_visible_devices!r}: {entry!r} is neither a GPU "
                f"index nor a UUID (GPU-...)"
            )
        visible.append(str(int(entry)) if _INDEX.fullmatch(entry) else entry)
    return visible


def physical_gpu_ids(gpus: Sequence[str], cuda_visible_devices: str | None) -> dict[str, str]:
    """Configured GPU id -> the id to give a worker in CUDA_VISIBLE_DEVICES and to look up in NVML.

    Without ``cuda_visible_devices`` (deo's own CUDA_VISIBLE_DEVICES unset) every id is itself.
    With it, a configured index is a position in deo's list (``"0"`` is its first entry) and a
    configured UUID must be in the list when the list holds UUIDs (CUDA accepts a unique prefix,
    so does this). :class:`ConfigError` names the id outside deo's list and the list.
    """
    visible = None if cuda_visible_devices is None else _visible_devices(cuda_visible_devices)
    mapping: dict[str, str] = {}
    for gpu in gpus:
        if not isinstance(gpu, str) or not (_INDEX.fullmatch(gpu) or _is_uuid(gpu)):
            raise ConfigError(
                f"deo.gpus: {gpu!r} is neither a GPU index (0, 1, ...) nor a UUID (GPU-...)"
            )
        if visible is None:
            mapping[gpu] = gpu
        elif _INDEX.fullmatch(gpu):
            position = int(gpu)
            if position >= len(visible):
                shown = f"ids 0-{len(visible) - 1}" if visible else "none"
                raise ConfigError(
                    f"deo.gpus: GPU {gpu!r} is outside deo's CUDA_VISIBLE_DEVICES="
                    f"{cuda_visible_devices!r}, which makes {len(visible)} GPU(s) visible "
                    f"({shown}); a configured index counts within that list"
                )
            mapping[gpu] = visible[position]
        elif all(_is_uuid(v) for v in visible):  # an empty list holds no UUID either
            matches = [v for v in visible if v.startswith(gpu) or gpu.startswith(v)]
            if len(matches) != 1:
                why = "is not in" if not matches else "matches more than one entry of"
                raise ConfigError(
                    f"deo.gpus: GPU {gpu!r} {why} deo's CUDA_VISIBLE_DEVICES="
                    f"{cuda_visible_devices!r}"
                )
            mapping[gpu] = max(matches[0], gpu, key=len)  # the full UUID
        else:
            # A UUID names one device whatever the list says; with indices in the list it
            # cannot be checked without NVML.
            mapping[gpu] = gpu
    seen: dict[str, str] = {}
    for gpu, physical in mapping.items():
        if physical in seen:
            raise ConfigError(
                f"deo.gpus: {seen[physical]!r} and {gpu!r} are the same GPU ({physical}) under "
                f"CUDA_VISIBLE_DEVICES={cuda_visible_devices!r}"
            )
        seen[physical] = gpu
    return mapping


def discover_gpus(
    settings: NvmlSettings, cuda_visible_devices: str | None, nvml: Any | None = None
) -> list[str]:
    """The GPU ids for ``deo.gpus = "auto"``: every GPU the ``[nvml]`` backend sees that deo's
    own CUDA_VISIBLE_DEVICES lets it use.

    Without CUDA_VISIBLE_DEVICES: NVML's indices (``"0"``, ``"1"`` ...), or the ids the
    ``[nvml]`` file lists. With it: the positions ``"0"`` .. ``"n-1"`` in deo's list, as a
    configured index counts (:func:`physical_gpu_ids` maps them back); like CUDA, the list ends
    at its first entry that names no GPU. ``nvml`` replaces the pynvml module (tests).
    :class:`ConfigError` saying why when no GPU is found.
    """
    how = 'deo.gpus = "auto" found no GPU'
    if settings.backend == "off":
        raise ConfigError(
            f'{how}: it asks NVML, and nvml.backend is "off"; list the GPUs (gpus = ["0"]) '
            f"or leave gpus out to run without"
        )
    if settings.backend == "file":
        assert settings.file is not None  # NvmlSettings checks it
        indices, uuids = _ids_in_file(settings.file)
    else:
        indices, uuids = _ids_from_nvml(nvml, how)
    visible = None if cuda_visible_devices is None else _visible_devices(cuda_visible_devices)
    if visible is None:
        # NVML's UUIDs name the GPUs its indices already count; a file's name GPUs of their own.
        found = sorted(indices, key=int) + (uuids if settings.backend == "file" else [])
    else:
        found = []
        for position, entry in enumerate(visible):
            if entry not in indices and not any(uuid.startswith(entry) for uuid in uuids):
                break
            found.append(str(position))
    if not found:
        within = (
            ""
            if cuda_visible_devices is None
            else f" within deo's CUDA_VISIBLE_DEVICES={cuda_visible_devices!r}"
        )
        source = f"the file {settings.file}" if settings.backend == "file" else "NVML"
        raise ConfigError(f"{how}: {source} lists none{within}")
    return found


def _ids_in_file(path: Path) -> tuple[list[str], list[str]]:
    try:
        data = orjson.loads(path.read_bytes())
    except OSError as exc:
        raise ConfigError(f"nvml.file: {path}: {exc.strerror or exc}") from None
    except orjson.JSONDecodeError as exc:
        raise ConfigError(f"nvml.file: {path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"nvml.file: {path}: expected a JSON object keyed by GPU id")
    keys = list(data)
    return [k for k in keys if _INDEX.fullmatch(k)], [k for k in keys if _is_uuid(k)]


def _ids_from_nvml(nvml: Any | None, how: str) -> tuple[list[str], list[str]]:
    """(NVML's indices, the UUIDs at those indices)."""
    try:
        nvml = import_pynvml() if nvml is None else nvml
        nvml.nvmlInit()
    except NvmlUnavailable as exc:
        raise ConfigError(f"{how}: NVML unavailable ({exc})") from None
    except Exception as exc:  # NVMLError (no library, no driver), OSError, ...
        raise ConfigError(f"{how}: NVML unavailable ({exc or type(exc).__name__})") from None
    try:
        count = int(nvml.nvmlDeviceGetCount())
        uuids = []
        for index in range(count):
            uuid = nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetHandleByIndex(index))
            uuids.append(uuid.decode() if isinstance(uuid, bytes) else str(uuid))
    except nvml.NVMLError as exc:
        raise ConfigError(f"{how}: NVML failed listing the GPUs ({exc})") from None
    finally:
        with contextlib.suppress(Exception):  # nothing more to do about a failed shutdown
            nvml.nvmlShutdown()
    return [str(index) for index in range(count)], uuids


def throttle_reasons(bitmask: int) -> frozenset[str]:
    """The names of the reasons set in an NVML clocks-event (throttle) reason bitmask.

    Bits deo does not know are named by their value (``"0x800"``) so nothing is hidden.
    """
    names: set[str] = set()
    known = _IDLE_BIT
    for bit, name in THROTTLE_REASON_BITS:
        known |= bit
        if bitmask & bit:
            names.add(name)
    unknown = bitmask & ~known
    bit = 1
    while unknown >= bit:
        if unknown & bit:
            names.add(f"0x{bit:x}")
        bit <<= 1
    return frozenset(names)


# --- readings ------------------------------------------------------------------------------------


@attrs.frozen(slots=True, kw_only=True)
class GpuHealth:
    """One GPU read successfully."""

    memory_used_bytes: int
    memory_total_bytes: int
    temperature_c: float
    throttle_reasons: frozenset[str] = frozenset()
    #: XID events and uncorrected ECC errors since the previous reading of this GPU.
    new_errors: int = 0
    #: The XID numbers among ``new_errors`` (for the log line).
    xids: tuple[int, ...] = ()
    #: Fields this GPU cannot report ("memory", "temperature", "throttle_reasons", "ecc",
    #: "xid"); they read as zero/none and their checks are off.
    unsupported: frozenset[str] = frozenset()


@attrs.frozen(slots=True, kw_only=True)
class GpuGone:
    """The GPU is lost (fell off the bus, NVML reports it lost) or does not exist at all."""

    error: str


@attrs.frozen(slots=True, kw_only=True)
class ReadFailed:
    """This GPU could not be read this time; nothing is concluded from it."""

    error: str


GpuReading = GpuHealth | GpuGone | ReadFailed


class GpuReader(Protocol):
    """Reads every GPU it was opened for. Both methods may block: call them from a thread."""

    def read(self) -> dict[str, GpuReading]:
        """One reading per configured GPU id; :class:`GpuSourceError` if nothing could be read."""
        ...

    def close(self) -> None:
        """Release what the reader holds."""
        ...


class NvmlUnavailable(DeoError):
    """NVML cannot be used here (no pynvml, no libnvidia-ml, no driver); the message says why."""


class GpuSourceError(DeoError):
    """A whole poll failed (the readings file is missing or malformed, ...)."""


class _ErrorCounts:
    """Turns cumulative error counters into counts of new errors, per GPU."""

    def __init__(self) -> None:
        self._last: dict[str, int] = {}

    def new_since_last(self, gpu: str, total: int) -> int:
        previous = self._last.get(gpu)
        self._last[gpu] = total
        # The first count is the baseline (errors from before deo watched were dealt with then);
        # a count that went down was reset (a driver reload clears the volatile ECC counts).
        if previous is None or total < previous:
            return 0
        return total - previous


# --- the file backend ----------------------------------------------------------------------------

_FILE_KEYS = frozenset(
    {
        "memory_used_bytes",
        "memory_total_bytes",
        "temperature_c",
        "throttle_reasons",
        "errors_total",
        "lost",
    }
)


def _count(entry: Mapping[str, Any], key: str, where: str, default: int | None = None) -> int:
    value = entry.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        shown = "missing" if key not in entry else f"got {value!r}"
        raise ValueError(f"{where}.{key}: expected an integer >= 0, {shown}")
    return value


class FileNvml:
    """Readings from a JSON file, read again on every poll: a GPU source without GPUs.

    The file maps each GPU's physical id (an index or UUID, as NVML would see it: the configured
    id unless deo runs with CUDA_VISIBLE_DEVICES) to its reading::

        {"0": {"memory_used_bytes": 1000000000, "memory_total_bytes": 80000000000,
               "temperature_c": 45, "throttle_reasons": ["thermal"], "errors_total": 0,
               "lost": false}}

    ``throttle_reasons`` is a list of names or an NVML reason bitmask (an integer);
    ``errors_total`` is a cumulative count (XID/ECC): an increase is reported as new errors.
    ``lost`` (true, or a message) reports the GPU lost. Replace the file atomically (write a
    temporary file, then rename it) so that a poll never sees half of it.
    """

    def __init__(self, path: Path, physical: Mapping[str, str]) -> None:
        self.path = path
        self._physical = dict(physical)
        self._errors = _ErrorCounts()

    def read(self) -> dict[str, GpuReading]:
        try:
            data = orjson.loads(self.path.read_bytes())
        except OSError as exc:
            raise GpuSourceError(f"{self.path}: {exc.strerror or exc}") from None
        except orjson.JSONDecodeError as exc:
            raise GpuSourceError(f"{self.path}: not valid JSON ({exc})") from None
        if not isinstance(data, dict):
            raise GpuSourceError(
                f"{self.path}: expected a JSON object keyed by GPU id, got {type(data).__name__}"
            )
        readings: dict[str, GpuReading] = {}
        for gpu, physical in self._physical.items():
            entry = data.get(physical)
            if entry is None:
                readings[gpu] = ReadFailed(error=f"{self.path}: no entry {physical!r}")
                continue
            try:
                readings[gpu] = self._reading(gpu, physical, entry)
            except ValueError as exc:
                readings[gpu] = ReadFailed(error=f"{self.path}: {exc}")
        return readings

    def _reading(self, gpu: str, physical: str, entry: Any) -> GpuReading:
        where = repr(physical)
        if not isinstance(entry, dict):
            raise ValueError(f"{where}: expected an object, got {type(entry).__name__}")
        unknown = sorted(set(entry) - _FILE_KEYS)
        if unknown:
            raise ValueError(
                f"{where}: unknown key {unknown[0]!r}; known: {', '.join(sorted(_FILE_KEYS))}"
            )
        lost = entry.get("lost", False)
        if not isinstance(lost, (bool, str)):
            raise ValueError(f"{where}.lost: expected true/false or a message, got {lost!r}")
        if lost:
            return GpuGone(
                error=lost if isinstance(lost, str) else f"reported lost in {self.path.name}"
            )
        temperature = entry.get("temperature_c")
        if not isinstance(temperature, (int, float)) or isinstance(temperature, bool):
            raise ValueError(f"{where}.temperature_c: expected a number, got {temperature!r}")
        reasons = entry.get("throttle_reasons", [])
        if isinstance(reasons, int) and not isinstance(reasons, bool) and reasons >= 0:
            names = throttle_reasons(reasons)
        elif isinstance(reasons, list) and all(isinstance(r, str) and r for r in reasons):
            names = frozenset(reasons)
        else:
            raise ValueError(
                f"{where}.throttle_reasons: expected a list of names or an NVML bitmask, "
                f"got {reasons!r}"
            )
        used = _count(entry, "memory_used_bytes", where)
        total = _count(entry, "memory_total_bytes", where)
        errors_total = _count(entry, "errors_total", where, default=0)
        return GpuHealth(
            memory_used_bytes=used,
            memory_total_bytes=total,
            temperature_c=float(temperature),
            throttle_reasons=names,
            new_errors=self._errors.new_since_last(gpu, errors_total),
        )

    def close(self) -> None:
        """Nothing to release."""


# --- the NVML backend ----------------------------------------------------------------------------


def import_pynvml() -> Any:
    """The ``pynvml`` module (nvidia-ml-py), or :class:`NvmlUnavailable` saying why not."""
    with warnings.catch_warnings():
        # The deprecated "pynvml" distribution's import hook warns on every import of the
        # module nvidia-ml-py provides; the module itself is the right one.
        warnings.simplefilter("ignore", FutureWarning)
        try:
            import pynvml
        except ImportError as exc:
            raise NvmlUnavailable(f"cannot import pynvml: {exc}") from None
    return pynvml


@attrs.define(slots=True)
class _Device:
    handle: Any
    #: The XID event set, None where the GPU cannot report XID events.
    events: Any | None


class PynvmlReader:
    """The real backend: NVML through pynvml. Every method blocks; call it from a thread.

    Per GPU and poll: memory used/total, GPU temperature, clocks-event (throttle) reasons, XID
    critical-error events (an event set polled with a 0 ms wait; application XIDs skipped) and
    the uncorrected volatile ECC count (its increase since the previous poll). NVML's "GPU is
    lost" and an id NVML does not know make a :class:`GpuGone`; any other failure on one GPU is
    a :class:`ReadFailed` for that GPU alone.

    ``nvml`` replaces the pynvml module (tests); :class:`NvmlUnavailable` when NVML cannot start.
    """

    def __init__(self, physical: Mapping[str, str], nvml: Any | None = None) -> None:
        self._nvml = import_pynvml() if nvml is None else nvml
        try:
            self._nvml.nvmlInit()
        except Exception as exc:  # NVMLError (no library, no driver), OSError, ...
            raise NvmlUnavailable(str(exc) or type(exc).__name__) from None
        self._physical = dict(physical)
        self._devices: dict[str, _Device] = {}
        self._errors = _ErrorCounts()
        # A read abandoned when deo stops may still be running in its thread when close() runs.
        self._lock = threading.Lock()

    def read(self) -> dict[str, GpuReading]:
        with self._lock:
            return {gpu: self._read_one(gpu, phys) for gpu, phys in self._physical.items()}

    def close(self) -> None:
        with self._lock:
            for gpu in list(self._devices):
                self._forget(gpu)
            with contextlib.suppress(Exception):  # shutting down: nothing left to do about it
                self._nvml.nvmlShutdown()

    def _read_one(self, gpu: str, physical: str) -> GpuReading:
        nvml = self._nvml
        device = self._devices.get(gpu)
        try:
            if device is None:
                device = self._open(gpu, physical)
            return self._sample(gpu, device)
        except nvml.NVMLError as exc:
            code = getattr(exc, "value", None)
            if code == _NVML_ERROR_GPU_IS_LOST:
                self._forget(gpu)
                return GpuGone(error=f"NVML: {exc}")
            if gpu not in self._devices and code in (
                _NVML_ERROR_NOT_FOUND,
                _NVML_ERROR_INVALID_ARGUMENT,
            ):
                return GpuGone(error=f"NVML has no GPU {physical!r} ({exc})")
            return ReadFailed(error=f"NVML: {exc}")
        except Exception as exc:  # one GPU's surprise must not stop the others
            return ReadFailed(error=f"{type(exc).__name__}: {exc}")

    def _open(self, gpu: str, physical: str) -> _Device:
        nvml = self._nvml
        if _is_uuid(physical):
            handle = nvml.nvmlDeviceGetHandleByUUID(physical)
        else:
            handle = nvml.nvmlDeviceGetHandleByIndex(int(physical))
        events = None
        try:
            if nvml.nvmlDeviceGetSupportedEventTypes(handle) & _NVML_EVENT_TYPE_XID_CRITICAL_ERROR:
                events = nvml.nvmlEventSetCreate()
                try:
                    nvml.nvmlDeviceRegisterEvents(
                        handle, _NVML_EVENT_TYPE_XID_CRITICAL_ERROR, events
                    )
                except Exception:
                    nvml.nvmlEventSetFree(events)
                    raise
        except nvml.NVMLError as exc:
            if getattr(exc, "value", None) == _NVML_ERROR_GPU_IS_LOST:
                raise
            events = None  # XIDs are not watched on this GPU; the other checks still run
        device = _Device(handle=handle, events=events)
        self._devices[gpu] = device
        return device

    def _forget(self, gpu: str) -> None:
        device = self._devices.pop(gpu, None)
        if device is not None and device.events is not None:
            with contextlib.suppress(Exception):  # the device may be gone already
                self._nvml.nvmlEventSetFree(device.events)

    def _field(self, unsupported: set[str], name: str, *calls: Callable[[], Any]) -> Any:
        """The first of ``calls`` NVML has (newer NVML names before older), None where this GPU
        cannot report ``name`` (recorded in ``unsupported``)."""
        for call in calls:
            try:
                return call()
            except AttributeError:
                continue  # this pynvml predates the function
            except self._nvml.NVMLError as exc:
                code = getattr(exc, "value", None)
                if code == _NVML_ERROR_FUNCTION_NOT_FOUND:
                    continue  # this driver predates the function
                if code in _UNSUPPORTED:
                    break
                raise
        unsupported.add(name)
        return None

    def _sample(self, gpu: str, device: _Device) -> GpuHealth:
        nvml, handle = self._nvml, device.handle
        unsupported: set[str] = set()
        memory = self._field(unsupported, "memory", lambda: nvml.nvmlDeviceGetMemoryInfo(handle))
        temperature = self._field(
            unsupported,
            "temperature",
            lambda: nvml.nvmlDeviceGetTemperature(handle, _NVML_TEMPERATURE_GPU),
            lambda: nvml.nvmlDeviceGetTemperatureV(handle, _NVML_TEMPERATURE_GPU),
        )
        reasons = self._field(
            unsupported,
            "throttle_reasons",
            lambda: nvml.nvmlDeviceGetCurrentClocksEventReasons(handle),
            lambda: nvml.nvmlDeviceGetCurrentClocksThrottleReasons(handle),
        )
        ecc = self._field(
            unsupported,
            "ecc",
            lambda: nvml.nvmlDeviceGetTotalEccErrors(
                handle, _NVML_MEMORY_ERROR_TYPE_UNCORRECTED, _NVML_VOLATILE_ECC
            ),
        )
        if device.events is None:
            unsupported.add("xid")
            xids: list[int] = []
        else:
            xids = self._drain_xids(device.events)
        used, total = (int(memory.used), int(memory.total)) if memory is not None else (0, 0)
        new_ecc = self._errors.new_since_last(gpu, int(ecc)) if ecc is not None else 0
        return GpuHealth(
            # NVML's "used" is total minus free; it never exceeds total, but a torn read could.
            memory_used_bytes=min(used, total),
            memory_total_bytes=total,
            temperature_c=float(temperature) if temperature is not None else 0.0,
            throttle_reasons=throttle_reasons(int(reasons)) if reasons is not None else frozenset(),
            new_errors=len(xids) + new_ecc,
            xids=tuple(xids),
            unsupported=frozenset(unsupported),
        )

    def _drain_xids(self, events: Any) -> list[int]:
        nvml = self._nvml
        xids: list[int] = []
        for _ in range(_MAX_XIDS_PER_POLL):
            try:
                data = nvml.nvmlEventSetWait(events, 0)
            except nvml.NVMLError as exc:
                if getattr(exc, "value", None) == _NVML_ERROR_TIMEOUT:
                    break  # no event waiting
                raise
            if int(data.eventType) & _NVML_EVENT_TYPE_XID_CRITICAL_ERROR:
                xid = int(data.eventData)
                if xid not in APPLICATION_XIDS:
                    xids.append(xid)
        return xids


# --- turning readings into events ----------------------------------------------------------------


class SampleFilter:
    """Which readings the core needs: a GPU's reading is sent when it differs from the last one
    sent in a way the cordon rules could read differently, and otherwise once per keep-alive.

    Sent: the first reading (and the first after a loss or a failed read), any new XID/ECC
    error, a change in the throttle reasons the rules cordon on, the temperature crossing the
    rules' limit or moving by ``temperature_tolerance_c``, memory use crossing the rules'
    fraction (or staying above it while a deo worker takes or leaves the GPU) or moving by
    ``memory_tolerance`` of the GPU's memory, a different memory total, and any reading
    ``keepalive_s`` after the last one sent. The core's cordon decisions depend on the readings
    only through those thresholds, so it decides as it would on every reading; a transient
    cordon still ends ``uncordon_after_s`` after the first clean reading, judged on the ticks.
    deo's log holds only what was sent, so a replay decides exactly as the run did.
    """

    def __init__(
        self,
        settings: NvmlSettings,
        rules: Callable[[], CordonRules],
        held: Callable[[], Collection[str]] = frozenset,
    ) -> None:
        self.keepalive_s = settings.keepalive_s
        self.memory_tolerance = settings.memory_tolerance
        self.temperature_tolerance_c = settings.temperature_tolerance_c
        self._rules_now = rules
        self._held_now = held
        self._rules = CordonRules()
        self._held: Collection[str] = frozenset()
        #: GPU -> (time sent, the sample sent, whether a deo worker held the GPU then)
        self._sent: dict[str, tuple[float, GpuSampled, bool]] = {}

    def begin(self) -> None:
        """Take the core's current rules and GPU holders, once per poll.

        New rules clear what was sent: a crossing is judged under the rules it was sent under,
        so after a change every GPU's next reading goes to the core at once.
        """
        rules = self._rules_now()
        if rules != self._rules:
            self._sent.clear()
        self._rules = rules
        self._held = self._held_now()

    def forget(self, gpu: str) -> None:
        """The next reading of ``gpu`` is sent (it was lost or could not be read)."""
        self._sent.pop(gpu, None)

    def wanted(self, sample: GpuSampled) -> bool:
        """Whether ``sample`` goes to the core; if so it becomes the one later ones compare to."""
        held = sample.gpu_id in self._held
        last = self._sent.get(sample.gpu_id)
        if (
            last is None
            or sample.t - last[0] >= self.keepalive_s
            or self._differs(last[1], last[2], sample, held)
        ):
            self._sent[sample.gpu_id] = (sample.t, sample, held)
            return True
        return False

    def _differs(self, last: GpuSampled, was_held: bool, new: GpuSampled, held: bool) -> bool:
        rules = self._rules
        if new.new_errors or new.memory_total_bytes != last.memory_total_bytes:
            return True
        cordoned_on = rules.throttle_reasons
        if new.throttle_reasons & cordoned_on != last.throttle_reasons & cordoned_on:
            return True
        limit_c = rules.max_temperature_c
        if (new.temperature_c >= limit_c) != (last.temperature_c >= limit_c):
            return True
        if abs(new.temperature_c - last.temperature_c) >= self.temperature_tolerance_c:
            return True
        total = new.memory_total_bytes
        if total:
            # The core's own test, on the same numbers.
            full = new.memory_used_bytes / total >= rules.max_memory_fraction
            if full != (last.memory_used_bytes / total >= rules.max_memory_fraction):
                return True
            if full and held != was_held:
                return True  # full memory counts against a GPU only when no deo worker holds it
            moved = abs(new.memory_used_bytes - last.memory_used_bytes)
            if moved > self.memory_tolerance * total:
                return True
        return False


class GpuMonitor:
    """Readings -> the core's events, plus the lines worth telling the operator.

    A lost GPU is reported once (``GpuLost``), not on every poll; it is reported again only if
    it answered in between. A read failure, a field a GPU cannot report, and XIDs are told as
    lines, each only when it changes. With a :class:`SampleFilter` only the samples the core
    needs are emitted; without one, every reading.
    """

    def __init__(self, gpus: Sequence[str], changes: SampleFilter | None = None) -> None:
        self.gpus = tuple(gpus)
        self._changes = changes
        self._lost: set[str] = set()
        self._failing: dict[str, str] = {}
        self._unsupported: dict[str, frozenset[str]] = {}
        self._poll_error: str | None = None

    def step(self, readings: Mapping[str, GpuReading], t: float) -> tuple[list[Event], list[str]]:
        """The events and lines for one poll's readings taken at ``t``."""
        events: list[Event] = []
        lines: list[str] = []
        if self._changes is not None:
            self._changes.begin()
        if self._poll_error is not None:
            lines.append("deo: GPU health readable again")
            self._poll_error = None
        for gpu in self.gpus:
            reading = readings.get(gpu)
            if reading is None:
                reading = ReadFailed(error="no reading")
            if isinstance(reading, GpuGone):
                self._failing.pop(gpu, None)
                if self._changes is not None:
                    self._changes.forget(gpu)
                if gpu not in self._lost:
                    self._lost.add(gpu)
                    events.append(GpuLost(t=t, gpu_id=gpu, error=reading.error))
                continue
            if isinstance(reading, GpuHealth):
                try:
                    event = GpuSampled(
                        t=t,
                        gpu_id=gpu,
                        memory_used_bytes=reading.memory_used_bytes,
                        memory_total_bytes=reading.memory_total_bytes,
                        temperature_c=reading.temperature_c,
                        throttle_reasons=reading.throttle_reasons,
                        new_errors=reading.new_errors,
                    )
                except InvalidEvent as exc:
                    reading = ReadFailed(error=str(exc))
                else:
                    if self._changes is None or self._changes.wanted(event):
                        events.append(event)
                    self._lost.discard(gpu)
                    if self._failing.pop(gpu, None) is not None:
                        lines.append(f"deo: GPU {gpu}: health readable again")
                    if reading.unsupported != self._unsupported.get(gpu, frozenset()):
                        self._unsupported[gpu] = reading.unsupported
                        if reading.unsupported:
                            lines.append(
                                f"deo: GPU {gpu}: cannot report "
                                f"{', '.join(sorted(reading.unsupported))}; those checks are off"
                            )
                    if reading.xids:
                        lines.append(f"deo: GPU {gpu}: XID {', '.join(map(str, reading.xids))}")
                    continue
            if self._changes is not None:
                self._changes.forget(gpu)
            if self._failing.get(gpu) != reading.error:
                self._failing[gpu] = reading.error
                lines.append(f"deo: GPU {gpu}: cannot read health: {reading.error}")
        return events, lines

    def failed(self, error: str) -> list[str]:
        """The lines for a poll that read nothing at all."""
        if error == self._poll_error:
            return []
        self._poll_error = error
        return [f"deo: GPU health: {error}"]


# --- the poller ----------------------------------------------------------------------------------


def open_reader(
    settings: NvmlSettings, physical: Mapping[str, str], nvml: Any | None = None
) -> GpuReader | None:
    """The reader ``settings`` asks for (blocks: NVML starts here), None for backend "off".

    ``nvml`` is the pynvml module when the caller imported it already. :class:`NvmlUnavailable`
    when NVML cannot be used.
    """
    if settings.backend == "off":
        return None
    if settings.backend == "file":
        assert settings.file is not None  # NvmlSettings checks it
        return FileNvml(settings.file, physical)
    return PynvmlReader(physical, nvml)


async def poll_gpus(
    settings: NvmlSettings,
    devices: Mapping[str, str],
    emit: Callable[[Event], None],
    clock: Callable[[], float],
    out: Callable[[str], None],
    cordon: Callable[[], CordonRules] | None = None,
    held: Callable[[], Collection[str]] = frozenset,
) -> None:
    """Read the health of the GPUs in ``devices`` every ``settings.interval_s`` until cancelled.

    ``cordon`` gives the core's current cordon rules and ``held`` the GPUs its workers hold: with
    them (and ``settings.keepalive_s`` > 0) a GPU's reading is emitted only when it matters to
    the rules (:class:`SampleFilter`).

    ``devices`` maps each configured GPU id to its device id, as :func:`physical_gpu_ids` made it
    (the configuration's ``device_of``). Emits ``GpuSampled`` per GPU and poll and ``GpuLost``
    when a GPU is lost, each carrying the configured id. Without NVML (no pynvml, no driver) or
    with backend "off" it says so in one line through ``out`` and returns: deo runs on with GPUs
    from the configuration only.
    """
    if not devices:
        return
    if settings.backend == "off":
        out("deo: GPU health not monitored (nvml.backend = off)")
        return
    nvml = None
    if settings.backend in ("auto", "pynvml"):
        try:
            nvml = import_pynvml()  # here, not in a thread: it silences a warning process-wide
        except NvmlUnavailable as exc:
            out(_unavailable(exc))
            return
    try:
        # A wedged driver can block NVML for minutes: a stopping deo does not wait for it.
        reader = await anyio.to_thread.run_sync(
            open_reader, settings, devices, nvml, abandon_on_cancel=True
        )
    except NvmlUnavailable as exc:
        out(_unavailable(exc))
        return
    if reader is None:
        return
    source = f"file {settings.file}" if settings.backend == "file" else "NVML"
    out(f"deo: GPU health of {len(devices)} GPU(s) from {source} every {settings.interval_s:g}s")
    monitor = GpuMonitor(list(devices), sample_filter(settings, cordon, held))
    try:
        while True:
            try:
                readings = await anyio.to_thread.run_sync(reader.read, abandon_on_cancel=True)
            except Exception as exc:  # a source never takes deo down
                error = (
                    str(exc) if isinstance(exc, GpuSourceError) else f"{type(exc).__name__}: {exc}"
                )
                for line in monitor.failed(error):
                    out(line)
            else:
                events, lines = monitor.step(readings, clock())
                for event in events:
                    emit(event)
                for line in lines:
                    out(line)
            await anyio.sleep(settings.interval_s)
    finally:
        with anyio.move_on_after(_CLOSE_TIMEOUT_S, shield=True):
            await anyio.to_thread.run_sync(reader.close, abandon_on_cancel=True)


def held_gpus(state: State) -> frozenset[str]:
    """The GPUs deo's workers hold in ``state``."""
    return frozenset(gpu for worker in state.workers.values() for gpu in worker.gpus)


def sample_filter(
    settings: NvmlSettings,
    cordon: Callable[[], CordonRules] | None,
    held: Callable[[], Collection[str]] = frozenset,
) -> SampleFilter | None:
    """The filter ``settings`` ask for; None (every reading) without rules or keep-alive."""
    if cordon is None or settings.keepalive_s <= 0:
        return None
    return SampleFilter(settings, cordon, held)


def _unavailable(exc: NvmlUnavailable) -> str:
    return f"deo: NVML unavailable ({exc}); GPU health not monitored, GPUs from configuration only"
