"""The NVML GPU-health source: ids, throttle names, readers, readings -> events, the poller.

The NVML backend is driven through a fake pynvml module here (the real error class and
constants, fake devices); the one test of the real NVML runs only where a driver answers.
"""

from __future__ import annotations

import json
import re
import threading
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import attrs
import pytest

from adapters.sources import nvml as nvml_adapter
from adapters.sources.nvml import (
    APPLICATION_XIDS,
    THROTTLE_REASON_BITS,
    FileNvml,
    GpuGone,
    GpuHealth,
    GpuMonitor,
    GpuSourceError,
    NvmlSettings,
    NvmlUnavailable,
    PynvmlReader,
    ReadFailed,
    import_pynvml,
    physical_gpu_ids,
    poll_gpus,
    throttle_reasons,
)
from core import ConfigError, CordonRules, Event, GpuLost, GpuSampled

pynvml = import_pynvml()  # the module is installed everywhere; only its driver may be missing
GIB = 2**30


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def nvml_answers() -> bool:
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return False
    pynvml.nvmlShutdown()
    return True


# --- throttle reasons ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("constants", "expected"),
    [
        (["SwThermalSlowdown"], {"thermal"}),
        (["HwThermalSlowdown"], {"thermal"}),
        (["SwThermalSlowdown", "HwThermalSlowdown"], {"thermal"}),
        (["HwPowerBrakeSlowdown"], {"power"}),
        (["SwPowerCap"], {"power_cap"}),
        (["HwSlowdown"], {"hw_slowdown"}),
        (
            ["HwThermalSlowdown", "HwPowerBrakeSlowdown", "HwSlowdown"],
            {"thermal", "power", "hw_slowdown"},
        ),
        (["GpuIdle"], set()),
        (["None"], set()),
        (["SyncBoost", "ApplicationsClocksSetting"], {"sync_boost", "applications_clocks"}),
        (["DisplayClockSetting"], {"display_clocks"}),
    ],
)
def test_nvml_reason_bits_map_to_the_names_cordon_rules_use(
    constants: list[str], expected: set[str]
) -> None:
    bitmask = 0
    for name in constants:
        bitmask |= getattr(pynvml, f"nvmlClocksThrottleReason{name}")
    assert throttle_reasons(bitmask) == expected


def test_the_event_reason_constants_are_the_throttle_reason_constants() -> None:
    for name in ("SwThermalSlowdown", "HwThermalSlowdown", "HwPowerBrakeSlowdown", "SwPowerCap"):
        assert getattr(pynvml, f"nvmlClocksEventReason{name}") == getattr(
            pynvml, f"nvmlClocksThrottleReason{name}"
        )


def test_every_known_bit_has_a_name_and_unknown_bits_are_not_hidden() -> None:
    # What deo promises, whichever NVML version is installed (their constant sets differ): each
    # bit deo knows gets its name, idle gets none, any other bit is shown by its value.
    idle = pynvml.nvmlClocksThrottleReasonGpuIdle
    known = idle
    for bit, name in THROTTLE_REASON_BITS:
        assert throttle_reasons(bit) == {name}, hex(bit)
        known |= bit
    assert throttle_reasons(idle) == set()
    for shift in range(64):
        if not known & (1 << shift):
            assert throttle_reasons(1 << shift) == {f"0x{1 << shift:x}"}, shift
    assert throttle_reasons(0x800 | 0x20 | idle) == {"thermal", "0x800"}
    # So every reason the installed NVML reports has a name or its value, never nothing.
    for shift in range(64):
        bit = 1 << shift
        if bit & pynvml.nvmlClocksThrottleReasonAll and bit != idle:
            assert throttle_reasons(bit), hex(bit)


@pytest.mark.parametrize(
    ("ours", "theirs"),
    [
        ("_NVML_ERROR_INVALID_ARGUMENT", "NVML_ERROR_INVALID_ARGUMENT"),
        ("_NVML_ERROR_NOT_SUPPORTED", "NVML_ERROR_NOT_SUPPORTED"),
        ("_NVML_ERROR_NO_PERMISSION", "NVML_ERROR_NO_PERMISSION"),
        ("_NVML_ERROR_NOT_FOUND", "NVML_ERROR_NOT_FOUND"),
        ("_NVML_ERROR_TIMEOUT", "NVML_ERROR_TIMEOUT"),
        ("_NVML_ERROR_FUNCTION_NOT_FOUND", "NVML_ERROR_FUNCTION_NOT_FOUND"),
        ("_NVML_ERROR_GPU_IS_LOST", "NVML_ERROR_GPU_IS_LOST"),
        ("_NVML_TEMPERATURE_GPU", "NVML_TEMPERATURE_GPU"),
        ("_NVML_MEMORY_ERROR_TYPE_UNCORRECTED", "NVML_MEMORY_ERROR_TYPE_UNCORRECTED"),
        ("_NVML_VOLATILE_ECC", "NVML_VOLATILE_ECC"),
        ("_NVML_EVENT_TYPE_XID_CRITICAL_ERROR", "nvmlEventTypeXidCriticalError"),
        ("_IDLE_BIT", "nvmlClocksEventReasonGpuIdle"),
    ],
)
def test_the_nvml_constants_deo_spells_out_are_nvmls(ours: str, theirs: str) -> None:
    assert getattr(nvml_adapter, ours) == getattr(pynvml, theirs)


def test_the_default_cordon_rules_name_reasons_nvml_produces() -> None:
    produced = {name for _, name in THROTTLE_REASON_BITS}
    assert CordonRules().throttle_reasons <= produced
    # A GPU at its software power cap is a busy GPU: the default rules must not cordon it.
    assert (
        not throttle_reasons(pynvml.nvmlClocksThrottleReasonSwPowerCap)
        & CordonRules().throttle_reasons
    )


# --- ids -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("gpus", "visible", "expected"),
    [
        (["0", "1"], None, {"0": "0", "1": "1"}),
        (["GPU-a", "3"], None, {"GPU-a": "GPU-a", "3": "3"}),
        (["0", "1"], "2,3", {"0": "2", "1": "3"}),
        (["1"], " 5 , 7 ", {"1": "7"}),
        (["0", "1"], "GPU-aaa,GPU-bbb", {"0": "GPU-aaa", "1": "GPU-bbb"}),
        (["GPU-bbb"], "GPU-aaa,GPU-bbb", {"GPU-bbb": "GPU-bbb"}),
        (["GPU-bbb-full-uuid"], "GPU-aaa,GPU-bbb", {"GPU-bbb-full-uuid": "GPU-bbb-full-uuid"}),
        (["GPU-bb"], "GPU-aaa,GPU-bbb", {"GPU-bb": "GPU-bbb"}),
        (["GPU-x"], "2,3", {"GPU-x": "GPU-x"}),  # cannot be checked against indices
        (["MIG-1234"], None, {"MIG-1234": "MIG-1234"}),
        (["0"], "4,-1,5", {"0": "4"}),
        (["1"], "4,5,", {"1": "5"}),
        ([], "", {}),
    ],
)
def test_configured_ids_map_through_deos_own_cuda_visible_devices(
    gpus: list[str], visible: str | None, expected: dict[str, str]
) -> None:
    assert physical_gpu_ids(gpus, visible) == expected


@pytest.mark.parametrize(
    ("gpus", "visible", "message"),
    [
        (
            ["2"],
            "2,3",
            "deo.gpus: GPU '2' is outside deo's CUDA_VISIBLE_DEVICES='2,3', which makes 2 GPU(s) "
            "visible (ids 0-1)",
        ),
        (
            ["0"],
            "",
            "GPU '0' is outside deo's CUDA_VISIBLE_DEVICES='', which makes 0 GPU(s) visible (none)",
        ),
        (["0"], "-1", "which makes 0 GPU(s) visible"),
        (["1"], "4,-1,5", "which makes 1 GPU(s) visible (ids 0-0)"),
        (
            ["GPU-c"],
            "GPU-a1,GPU-b1",
            "deo.gpus: GPU 'GPU-c' is not in deo's CUDA_VISIBLE_DEVICES='GPU-a1,GPU-b1'",
        ),
        (["GPU-"], None, "deo.gpus: 'GPU-' is neither a GPU index"),
        (["GPU-a"], "GPU-a1,GPU-a2", "matches more than one entry"),
        (
            ["gpu0"],
            None,
            "deo.gpus: 'gpu0' is neither a GPU index (0, 1, ...) nor a UUID (GPU-...)",
        ),
        (["-1"], None, "'-1' is neither"),
        (["0"], "0,x", "CUDA_VISIBLE_DEVICES='0,x': 'x' is neither a GPU index nor a UUID"),
        (["GPU-a"], "-1", "deo.gpus: GPU 'GPU-a' is not in deo's CUDA_VISIBLE_DEVICES='-1'"),
        (["0", "GPU-a"], "GPU-a,GPU-b", "deo.gpus: '0' and 'GPU-a' are the same GPU (GPU-a)"),
    ],
)
def test_ids_outside_deos_list_are_refused_with_the_id_and_the_list(
    gpus: list[str], visible: str | None, message: str
) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        physical_gpu_ids(gpus, visible)


# --- settings ------------------------------------------------------------------------------------


def test_settings_defaults_and_a_string_file_path() -> None:
    assert NvmlSettings() == NvmlSettings(backend="auto", file=None, interval_s=2.0)
    settings = NvmlSettings(backend="file", file="gpus.json")
    assert settings.file == Path("gpus.json")


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"backend": "dcgm"}, "nvml.backend: 'dcgm' is not one of 'auto', 'pynvml', 'file', 'off'"),
        ({"backend": "file"}, 'nvml.file: required with nvml.backend = "file"'),
        (
            {"file": Path("x.json")},
            "nvml.file: only read with nvml.backend = \"file\" (the backend is 'auto')",
        ),
        ({"interval_s": 0.0}, "nvml.interval_s: must be a number of seconds > 0, got 0.0"),
        ({"interval_s": -1.0}, "nvml.interval_s"),
        ({"interval_s": float("nan")}, "nvml.interval_s"),
        ({"interval_s": float("inf")}, "nvml.interval_s"),
    ],
)
def test_bad_settings_name_their_key(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        NvmlSettings(**fields)


# --- the file backend and readings -> events -----------------------------------------------------


def reading(**fields: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "memory_used_bytes": 2 * GIB,
        "memory_total_bytes": 80 * GIB,
        "temperature_c": 45,
    }
    return {**base, **fields}


class Readings:
    """A readings file and a FileNvml + GpuMonitor reading it, one poll per call."""

    def __init__(self, tmp_path: Path, gpus: list[str], visible: str | None = None) -> None:
        self.path = tmp_path / "gpus.json"
        self.reader = FileNvml(self.path, physical_gpu_ids(gpus, visible))
        self.monitor = GpuMonitor(gpus)
        self.t = 0.0

    def poll(self, data: Any) -> tuple[list[Event], list[str]]:
        self.path.write_text(json.dumps(data))
        self.t += 1.0
        return self.monitor.step(self.reader.read(), self.t)


def test_a_file_reading_becomes_a_sample_with_the_configured_id(tmp_path: Path) -> None:
    file = Readings(tmp_path, ["0", "1"], visible="6,7")
    events, lines = file.poll(
        {
            "6": reading(throttle_reasons=["thermal", "power"]),
            "7": reading(memory_used_bytes=79 * GIB, temperature_c=91.5, throttle_reasons=0x80),
        }
    )
    assert events == [
        GpuSampled(
            t=1.0,
            gpu_id="0",
            memory_used_bytes=2 * GIB,
            memory_total_bytes=80 * GIB,
            temperature_c=45.0,
            throttle_reasons={"thermal", "power"},
        ),
        GpuSampled(
            t=1.0,
            gpu_id="1",
            memory_used_bytes=79 * GIB,
            memory_total_bytes=80 * GIB,
            temperature_c=91.5,
            throttle_reasons={"power"},
        ),
    ]
    assert lines == []


def test_new_errors_are_the_increase_of_the_error_count_since_the_last_poll(
    tmp_path: Path,
) -> None:
    file = Readings(tmp_path, ["0"])
    new_errors = []
    for total in (3, 3, 5, 6, 6, 0, 1):  # 3 before deo looked: the baseline; 0: a reset
        [event], _ = file.poll({"0": reading(errors_total=total)})
        assert isinstance(event, GpuSampled)
        new_errors.append(event.new_errors)
    assert new_errors == [0, 0, 2, 1, 0, 0, 1]


def test_a_lost_gpu_is_reported_once_and_again_only_after_it_answered(tmp_path: Path) -> None:
    file = Readings(tmp_path, ["0", "1"])
    healthy = {"0": reading(), "1": reading()}
    events, _ = file.poll({**healthy, "1": {"lost": "fell off the bus"}})
    assert [type(e) for e in events] == [GpuSampled, GpuLost]
    assert events[1] == GpuLost(t=1.0, gpu_id="1", error="fell off the bus")
    events, _ = file.poll({**healthy, "1": {"lost": True}})
    assert [e.gpu_id for e in events if isinstance(e, GpuSampled)] == ["0"]
    assert not [e for e in events if isinstance(e, GpuLost)]  # still lost: not repeated
    events, _ = file.poll(healthy)
    assert [type(e) for e in events] == [GpuSampled, GpuSampled]
    events, _ = file.poll({**healthy, "1": {"lost": True}})
    assert [e for e in events if isinstance(e, GpuLost)] == [
        GpuLost(t=4.0, gpu_id="1", error="reported lost in gpus.json")
    ]


@pytest.mark.parametrize(
    ("entry", "error"),
    [
        (None, "no entry '1'"),
        ("hot", "'1': expected an object, got str"),
        (
            {"temperature_c": 40, "memory_total_bytes": 1},
            "'1'.memory_used_bytes: expected an integer >= 0, missing",
        ),
        (reading(memory_used_bytes=-1), "'1'.memory_used_bytes: expected an integer >= 0, got -1"),
        (
            reading(memory_total_bytes=1.5),
            "'1'.memory_total_bytes: expected an integer >= 0, got 1.5",
        ),
        (reading(temperature_c="hot"), "'1'.temperature_c: expected a number, got 'hot'"),
        (
            reading(throttle_reasons="thermal"),
            "'1'.throttle_reasons: expected a list of names or an NVML bitmask",
        ),
        (reading(errors_total=True), "'1'.errors_total: expected an integer >= 0, got True"),
        (reading(lost=1), "'1'.lost: expected true/false or a message, got 1"),
        (reading(temp=3), "'1': unknown key 'temp'"),
        (
            reading(memory_used_bytes=2, memory_total_bytes=1),
            "memory_used_bytes (2) exceeds memory_total_bytes (1)",
        ),
    ],
)
def test_a_bad_entry_is_a_line_naming_it_and_the_other_gpus_are_still_read(
    tmp_path: Path, entry: Any, error: str
) -> None:
    file = Readings(tmp_path, ["0", "1"])
    data = {"0": reading(), **({} if entry is None else {"1": entry})}
    events, lines = file.poll(data)
    assert [e.gpu_id for e in events if isinstance(e, GpuSampled)] == ["0"]
    assert len(lines) == 1 and lines[0].startswith("deo: GPU 1: cannot read health: ")
    assert error in lines[0]
    events, lines = file.poll(data)
    assert len(events) == 1 and lines == []  # told once, not on every poll
    events, lines = file.poll({"0": reading(), "1": reading()})
    assert len(events) == 2 and lines == ["deo: GPU 1: health readable again"]


@pytest.mark.parametrize(
    ("content", "error"),
    [
        (None, "No such file or directory"),
        ("{", "not valid JSON"),
        ("[1, 2]", "expected a JSON object keyed by GPU id, got list"),
    ],
)
def test_an_unreadable_file_fails_the_whole_poll(
    tmp_path: Path, content: str | None, error: str
) -> None:
    path = tmp_path / "gpus.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(GpuSourceError, match=re.escape(error)):
        FileNvml(path, {"0": "0"}).read()


def test_the_monitor_tells_a_failed_poll_once_and_its_recovery() -> None:
    monitor = GpuMonitor(["0"])
    assert monitor.failed("gpus.json: not valid JSON") == [
        "deo: GPU health: gpus.json: not valid JSON"
    ]
    assert monitor.failed("gpus.json: not valid JSON") == []
    health = GpuHealth(memory_used_bytes=0, memory_total_bytes=1, temperature_c=30.0)
    events, lines = monitor.step({"0": health}, 5.0)
    assert len(events) == 1 and lines == ["deo: GPU health readable again"]


def test_the_monitor_tells_unsupported_fields_and_xids_as_lines() -> None:
    monitor = GpuMonitor(["0"])
    health = GpuHealth(
        memory_used_bytes=0,
        memory_total_bytes=1,
        temperature_c=30.0,
        new_errors=2,
        xids=(79, 48),
        unsupported=frozenset({"ecc", "temperature"}),
    )
    events, lines = monitor.step({"0": health}, 1.0)
    assert [e.new_errors for e in events if isinstance(e, GpuSampled)] == [2]
    assert lines == [
        "deo: GPU 0: cannot report ecc, temperature; those checks are off",
        "deo: GPU 0: XID 79, 48",
    ]
    _, lines = monitor.step({"0": attrs.evolve(health, new_errors=0, xids=())}, 2.0)
    assert lines == []  # the same unsupported fields are not told again
    events, lines = monitor.step({}, 3.0)
    assert events == [] and lines == ["deo: GPU 0: cannot read health: no reading"]
    events, lines = monitor.step({"0": attrs.evolve(health, temperature_c=float("nan"))}, 4.0)
    assert events == [] and len(lines) == 1
    assert lines[0].startswith("deo: GPU 0: ")
    assert "GpuSampled.temperature_c must be a finite number, got nan" in lines[0]


# --- the NVML backend, through a fake pynvml -----------------------------------------------------


@attrs.define
class FakeGpu:
    uuid: str
    used: int = 1 * GIB
    total: int = 80 * GIB
    temperature: int = 50
    reasons: int = 0
    #: Uncorrected volatile ECC count; None: ECC not supported (e.g. turned off).
    ecc: int | None = 0
    xids: list[int] = attrs.field(factory=list)
    events_supported: bool = True
    lost: bool = False
    #: An NVML error code every memory read fails with (a flaky GPU).
    memory_error: int | None = None
    #: False: a driver older than nvmlDeviceGetCurrentClocksEventReasons.
    has_event_reasons: bool = True


@attrs.define
class FakeEventSet:
    gpu: FakeGpu | None = None
    freed: bool = False


def fail(code: int) -> Any:
    return pynvml.NVMLError(code)


class FakeNvml:
    """The pynvml functions the reader calls, over fake GPUs; the real errors and constants."""

    NVMLError = pynvml.NVMLError

    def __init__(self, gpus: list[FakeGpu], init_error: int | None = None) -> None:
        self.gpus = gpus
        self.init_error = init_error
        self.initialized = 0
        self.event_sets: list[FakeEventSet] = []

    def _alive(self, gpu: FakeGpu) -> FakeGpu:
        if gpu.lost:
            raise fail(pynvml.NVML_ERROR_GPU_IS_LOST)
        return gpu

    def nvmlInit(self) -> None:
        if self.init_error is not None:
            raise fail(self.init_error)
        self.initialized += 1

    def nvmlShutdown(self) -> None:
        self.initialized -= 1

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeGpu:
        if not 0 <= index < len(self.gpus):
            raise fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return self._alive(self.gpus[index])

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> FakeGpu:
        for gpu in self.gpus:
            if gpu.uuid == uuid:
                return self._alive(gpu)
        raise fail(pynvml.NVML_ERROR_NOT_FOUND)

    def nvmlDeviceGetSupportedEventTypes(self, gpu: FakeGpu) -> int:
        if not self._alive(gpu).events_supported:
            raise fail(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return int(pynvml.nvmlEventTypeXidCriticalError | pynvml.nvmlEventTypeSingleBitEccError)

    def nvmlEventSetCreate(self) -> FakeEventSet:
        self.event_sets.append(FakeEventSet())
        return self.event_sets[-1]

    def nvmlDeviceRegisterEvents(self, gpu: FakeGpu, types_: int, events: FakeEventSet) -> None:
        assert types_ == pynvml.nvmlEventTypeXidCriticalError
        events.gpu = gpu

    def nvmlEventSetWait(self, events: FakeEventSet, timeout_ms: int) -> Any:
        assert timeout_ms == 0  # a poll must never wait
        assert events.gpu is not None and not events.freed
        if not self._alive(events.gpu).xids:
            raise fail(pynvml.NVML_ERROR_TIMEOUT)
        xid = events.gpu.xids.pop(0)
        return types.SimpleNamespace(eventType=pynvml.nvmlEventTypeXidCriticalError, eventData=xid)

    def nvmlEventSetFree(self, events: FakeEventSet) -> None:
        events.freed = True

    def nvmlDeviceGetMemoryInfo(self, gpu: FakeGpu) -> Any:
        if self._alive(gpu).memory_error is not None:
            raise fail(gpu.memory_error)  # type: ignore[arg-type]
        return types.SimpleNamespace(used=gpu.used, total=gpu.total, free=gpu.total - gpu.used)

    def nvmlDeviceGetTemperature(self, gpu: FakeGpu, sensor: int) -> int:
        assert sensor == pynvml.NVML_TEMPERATURE_GPU
        return self._alive(gpu).temperature

    def nvmlDeviceGetCurrentClocksEventReasons(self, gpu: FakeGpu) -> int:
        if not self._alive(gpu).has_event_reasons:
            raise fail(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        return gpu.reasons

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, gpu: FakeGpu) -> int:
        return self._alive(gpu).reasons

    def nvmlDeviceGetTotalEccErrors(self, gpu: FakeGpu, error_type: int, counter: int) -> int:
        assert error_type == pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
        assert counter == pynvml.NVML_VOLATILE_ECC
        if self._alive(gpu).ecc is None:
            raise fail(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return gpu.ecc  # type: ignore[return-value]


def three_gpus() -> list[FakeGpu]:
    return [FakeGpu(uuid=f"GPU-{n}{n}{n}") for n in "abc"]


def test_the_nvml_reader_reads_every_field_by_index_and_by_uuid() -> None:
    gpus = three_gpus()
    gpus[1].reasons = (
        pynvml.nvmlClocksEventReasonHwThermalSlowdown | pynvml.nvmlClocksEventReasonGpuIdle
    )
    gpus[2].used, gpus[2].temperature = 70 * GIB, 83
    fake = FakeNvml(gpus)
    reader = PynvmlReader({"0": "0", "1": "1", "x": "GPU-ccc"}, nvml=fake)
    readings = reader.read()
    assert readings == {
        "0": GpuHealth(memory_used_bytes=GIB, memory_total_bytes=80 * GIB, temperature_c=50.0),
        "1": GpuHealth(
            memory_used_bytes=GIB,
            memory_total_bytes=80 * GIB,
            temperature_c=50.0,
            throttle_reasons=frozenset({"thermal"}),
        ),
        "x": GpuHealth(memory_used_bytes=70 * GIB, memory_total_bytes=80 * GIB, temperature_c=83.0),
    }
    reader.close()
    assert fake.initialized == 0
    assert all(s.freed for s in fake.event_sets) and len(fake.event_sets) == 3


def test_xids_and_uncorrected_ecc_errors_count_as_new_errors_application_xids_do_not() -> None:
    gpus = three_gpus()
    gpus[0].ecc = 4  # from before deo looked
    fake = FakeNvml(gpus)
    reader = PynvmlReader({"0": "0", "1": "1"}, nvml=fake)
    assert [r.new_errors for r in reader.read().values() if isinstance(r, GpuHealth)] == [0, 0]
    gpus[0].ecc = 6
    gpus[1].xids = [79, 31, 48, 13]  # 31 and 13 are an application's faults
    readings = reader.read()
    assert readings["0"] == GpuHealth(
        memory_used_bytes=GIB, memory_total_bytes=80 * GIB, temperature_c=50.0, new_errors=2
    )
    assert isinstance(readings["1"], GpuHealth)
    assert (readings["1"].new_errors, readings["1"].xids) == (2, (79, 48))
    assert {31, 13} <= APPLICATION_XIDS
    later = reader.read()
    assert [r.new_errors for r in later.values() if isinstance(r, GpuHealth)] == [0, 0]


def test_unsupported_fields_are_tolerated_and_reported() -> None:
    gpus = three_gpus()
    gpus[0].ecc = None
    gpus[0].events_supported = False
    gpus[1].has_event_reasons = False  # an older driver: the older function answers
    gpus[1].reasons = pynvml.nvmlClocksThrottleReasonHwPowerBrakeSlowdown
    reader = PynvmlReader({"0": "0", "1": "1"}, nvml=FakeNvml(gpus))
    readings = reader.read()
    assert readings["0"] == GpuHealth(
        memory_used_bytes=GIB,
        memory_total_bytes=80 * GIB,
        temperature_c=50.0,
        unsupported=frozenset({"ecc", "xid"}),
    )
    assert isinstance(readings["1"], GpuHealth)
    assert readings["1"].throttle_reasons == {"power"} and not readings["1"].unsupported


def test_a_lost_gpu_is_gone_and_the_others_are_still_read() -> None:
    gpus = three_gpus()
    fake = FakeNvml(gpus)
    reader = PynvmlReader({"0": "0", "1": "1", "2": "2"}, nvml=fake)
    reader.read()
    gpus[1].lost = True
    gpus[2].memory_error = pynvml.NVML_ERROR_UNKNOWN
    readings = reader.read()
    assert isinstance(readings["0"], GpuHealth)
    assert readings["1"] == GpuGone(error="NVML: GPU is lost")
    assert readings["2"] == ReadFailed(error="NVML: Unknown Error")
    assert fake.event_sets[1].freed  # the lost GPU's handle and events are dropped
    gpus[1].lost = False  # back after a reset: it is opened again
    gpus[2].memory_error = None
    readings = reader.read()
    assert all(isinstance(r, GpuHealth) for r in readings.values())
    assert len(fake.event_sets) == 4


def test_an_id_nvml_does_not_know_is_gone() -> None:
    reader = PynvmlReader({"0": "0", "7": "7", "GPU-zzz": "GPU-zzz"}, nvml=FakeNvml(three_gpus()))
    readings = reader.read()
    assert isinstance(readings["0"], GpuHealth)
    assert readings["7"] == GpuGone(error="NVML has no GPU '7' (Invalid Argument)")
    assert readings["GPU-zzz"] == GpuGone(error="NVML has no GPU 'GPU-zzz' (Not Found)")


def test_nvml_that_cannot_start_is_unavailable() -> None:
    with pytest.raises(NvmlUnavailable, match="Driver Not Loaded"):
        PynvmlReader({"0": "0"}, nvml=FakeNvml([], init_error=pynvml.NVML_ERROR_DRIVER_NOT_LOADED))


# --- the poller ----------------------------------------------------------------------------------


async def poll_for(
    settings: NvmlSettings,
    gpus: list[str],
    until: Callable[[list[Event]], bool] = lambda events: False,
    visible: str | None = None,
) -> tuple[list[Event], list[str]]:
    """Run poll_gpus until it returns or ``until(events)``; the events and lines it gave.

    ``visible`` is deo's own CUDA_VISIBLE_DEVICES, which ``deo run`` resolves the devices from."""
    events: list[Event] = []
    lines: list[str] = []
    clock = iter(range(1, 10_000))
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:

            async def watch() -> None:
                while not until(events):
                    await anyio.sleep(0.01)
                tg.cancel_scope.cancel()

            async def poll() -> None:
                await poll_gpus(
                    settings,
                    physical_gpu_ids(gpus, visible),
                    events.append,
                    lambda: float(next(clock)),
                    lines.append,
                )
                tg.cancel_scope.cancel()

            tg.start_soon(watch)
            tg.start_soon(poll)
    return events, lines


@pytest.mark.anyio
async def test_auto_without_a_driver_says_so_in_one_line_and_returns() -> None:
    if nvml_answers():
        pytest.skip("a driver answers here: auto would monitor")
    events, lines = await poll_for(NvmlSettings(), ["0", "1"])
    assert events == []
    assert len(lines) == 1
    assert re.fullmatch(
        r"deo: NVML unavailable \(.+\); GPU health not monitored, GPUs from configuration only",
        lines[0],
    ), lines


@pytest.mark.anyio
async def test_without_pynvml_or_with_init_failing_deo_says_so_and_returns(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def no_module() -> Any:
        raise NvmlUnavailable("cannot import pynvml: No module named 'pynvml'")

    monkeypatch.setattr(nvml_adapter, "import_pynvml", no_module)
    events, lines = await poll_for(NvmlSettings(backend="pynvml"), ["0"])
    assert events == [] and lines == [
        "deo: NVML unavailable (cannot import pynvml: No module named 'pynvml'); GPU health not "
        "monitored, GPUs from configuration only"
    ]
    broken = FakeNvml([], init_error=pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)
    monkeypatch.setattr(nvml_adapter, "import_pynvml", lambda: broken)
    events, lines = await poll_for(NvmlSettings(), ["0"])
    assert events == [] and lines == [
        "deo: NVML unavailable (NVML Shared Library Not Found); GPU health not monitored, GPUs "
        "from configuration only"
    ]


@pytest.mark.anyio
async def test_the_poller_emits_nvml_readings_under_the_configured_ids(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gpus = three_gpus()
    gpus[2].lost = True
    fake = FakeNvml(gpus)
    monkeypatch.setattr(nvml_adapter, "import_pynvml", lambda: fake)
    events, lines = await poll_for(
        NvmlSettings(backend="pynvml", interval_s=0.01),
        ["0", "1"],
        until=lambda events: len(events) >= 5,
        visible="1,2",
    )
    assert lines == ["deo: GPU health of 2 GPU(s) from NVML every 0.01s"]
    assert events[0] == GpuSampled(
        t=1.0, gpu_id="0", memory_used_bytes=GIB, memory_total_bytes=80 * GIB, temperature_c=50.0
    )
    assert events[1] == GpuLost(t=1.0, gpu_id="1", error="NVML: GPU is lost")  # physical 2
    assert all(isinstance(e, GpuSampled) and e.gpu_id == "0" for e in events[2:])
    assert fake.initialized == 0  # shut down when cancelled


@pytest.mark.anyio
async def test_the_poller_keeps_going_through_a_bad_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "gpus.json"
    settings = NvmlSettings(backend="file", file=path, interval_s=0.01)
    reads = [0]

    class CountedFile(FileNvml):
        def read(self) -> dict[str, Any]:
            reads[0] += 1  # once per poll
            return super().read()

    monkeypatch.setattr(nvml_adapter, "open_reader", lambda _, ids, *rest: CountedFile(path, ids))
    # The file appears only after the poller told that it is missing (once).
    events: list[Event] = []
    lines: list[str] = []
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:

            async def poll() -> None:
                await poll_gpus(settings, {"0": "0"}, events.append, lambda: 1.0, lines.append)

            async def fix() -> None:
                while not any("No such file" in line for line in lines):
                    await anyio.sleep(0.01)
                first = reads[0]
                while reads[0] < first + 5:  # five more polls: still told once
                    await anyio.sleep(0.01)
                path.write_text(json.dumps({"0": reading()}))
                while not events:
                    await anyio.sleep(0.01)
                tg.cancel_scope.cancel()

            tg.start_soon(poll)
            tg.start_soon(fix)
    assert lines[0] == f"deo: GPU health of 1 GPU(s) from file {path} every 0.01s"
    assert lines[1] == f"deo: GPU health: {path}: No such file or directory"
    assert lines[2:] == ["deo: GPU health readable again"]
    assert isinstance(events[0], GpuSampled)


@pytest.mark.anyio
async def test_a_read_stuck_in_the_driver_does_not_hold_up_a_stopping_deo(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    release = threading.Event()
    reading = threading.Event()
    closed = threading.Event()

    class StuckReader:
        def read(self) -> dict[str, Any]:
            reading.set()
            release.wait(30)  # a wedged driver
            return {}

        def close(self) -> None:
            closed.set()

    monkeypatch.setattr(nvml_adapter, "open_reader", lambda *args: StuckReader())
    lines: list[str] = []
    try:
        with anyio.fail_after(10):  # far below the 30 s the read is stuck for
            async with anyio.create_task_group() as tg:
                tg.start_soon(
                    poll_gpus, NvmlSettings(), {"0": "0"}, print, lambda: 1.0, lines.append
                )
                while not reading.is_set():  # stuck in the read
                    await anyio.sleep(0.01)
                tg.cancel_scope.cancel()
    finally:
        release.set()
    assert closed.is_set()
    assert lines == ["deo: GPU health of 1 GPU(s) from NVML every 2s"]


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("settings", "gpus", "expected"),
    [
        (
            NvmlSettings(backend="off"),
            ["0"],
            ["deo: GPU health not monitored (nvml.backend = off)"],
        ),
        (NvmlSettings(), [], []),
    ],
)
async def test_nothing_to_monitor_returns_at_once(
    settings: NvmlSettings, gpus: list[str], expected: list[str]
) -> None:
    events, lines = await poll_for(settings, gpus)
    assert events == [] and lines == expected


# --- the real NVML -------------------------------------------------------------------------------


@pytest.mark.skipif(not nvml_answers(), reason="no NVML driver on this machine")
@pytest.mark.anyio
async def test_the_real_nvml_reads_every_gpu_sanely() -> None:
    pynvml.nvmlInit()
    try:
        count = pynvml.nvmlDeviceGetCount()
        uuids = [
            pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(i)) for i in range(count)
        ]
    finally:
        pynvml.nvmlShutdown()
    uuids = [u.decode() if isinstance(u, bytes) else u for u in uuids]
    assert count >= 1
    ids = [str(i) for i in range(count)]
    # By index (NVML's order ignores CUDA_VISIBLE_DEVICES) and by UUID, through the poller.
    events, lines = await poll_for(
        NvmlSettings(backend="pynvml", interval_s=0.05),
        [*ids, uuids[0]],
        until=lambda events: len(events) >= 2 * (count + 1),
    )
    assert lines[0] == f"deo: GPU health of {count + 1} GPU(s) from NVML every 0.05s", lines
    assert not [line for line in lines[1:] if "cannot read health" in line], lines
    samples = [e for e in events if isinstance(e, GpuSampled)]
    assert len(samples) == len(events), events  # nothing lost
    assert {s.gpu_id for s in samples} == {*ids, uuids[0]}
    for sample in samples:
        assert sample.memory_total_bytes > 0, sample
        assert 0 <= sample.memory_used_bytes <= sample.memory_total_bytes, sample
        assert 0 <= sample.temperature_c <= 120, sample
        assert sample.new_errors == 0, sample  # the first poll is the baseline
        assert all(re.fullmatch(r"[a-z_]+|0x[0-9a-f]+", r) for r in sample.throttle_reasons)
    by_id = {s.gpu_id: s for s in samples}
    assert by_id["0"].memory_total_bytes == by_id[uuids[0]].memory_total_bytes
