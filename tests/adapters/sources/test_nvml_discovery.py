"""``deo.gpus = "auto"``: the GPUs NVML (or the ``[nvml]`` file) sees, within deo's
CUDA_VISIBLE_DEVICES. NVML is driven through the fake pynvml of test_nvml; the real one answers
only where a driver does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_nvml import FakeGpu, FakeNvml, nvml_answers, pynvml

from adapters.runtime.config_file import load
from adapters.sources.nvml import NvmlSettings, discover_gpus, physical_gpu_ids
from core import ConfigError


class ListingNvml(FakeNvml):
    """The fake NVML with the two calls that list the GPUs."""

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetUUID(self, gpu: FakeGpu) -> str:
        return gpu.uuid


def four() -> ListingNvml:
    return ListingNvml([FakeGpu(uuid=f"GPU-{n}{n}{n}-0") for n in "abcd"])


NVML = NvmlSettings(backend="pynvml")


@pytest.mark.parametrize(
    ("cuda_visible_devices", "expected"),
    [
        (None, ["0", "1", "2", "3"]),
        ("2,0", ["0", "1"]),  # positions in deo's list, as a configured index counts
        ("3", ["0"]),
        ("GPU-ccc,GPU-aaa-0", ["0", "1"]),  # UUIDs and their unique prefixes
        ("1,7,2", ["0"]),  # CUDA ends the list at the first id that names no GPU
        ("1,-1,2", ["0"]),
    ],
)
def test_auto_takes_every_gpu_nvml_sees_within_deos_list(
    cuda_visible_devices: str | None, expected: list[str]
) -> None:
    fake = four()
    assert discover_gpus(NVML, cuda_visible_devices, nvml=fake) == expected
    assert fake.initialized == 0  # NVML shut down again
    # every id found maps back to a distinct GPU of deo's list
    devices = physical_gpu_ids(expected, cuda_visible_devices)
    assert len(set(devices.values())) == len(expected)


@pytest.mark.parametrize(
    ("nvml", "cuda_visible_devices", "message"),
    [
        (ListingNvml([]), None, 'deo.gpus = "auto" found no GPU: NVML lists none'),
        (
            four(),
            "-1",
            'deo.gpus = "auto" found no GPU: NVML lists none within deo\'s '
            "CUDA_VISIBLE_DEVICES='-1'",
        ),
        (four(), "9", "NVML lists none within deo's CUDA_VISIBLE_DEVICES='9'"),
        (
            ListingNvml([], init_error=pynvml.NVML_ERROR_DRIVER_NOT_LOADED),
            None,
            'deo.gpus = "auto" found no GPU: NVML unavailable (Driver Not Loaded)',
        ),
    ],
)
def test_no_gpu_found_is_a_clear_error(
    nvml: ListingNvml, cuda_visible_devices: str | None, message: str
) -> None:
    with pytest.raises(ConfigError) as info:
        discover_gpus(NVML, cuda_visible_devices, nvml=nvml)
    assert message in str(info.value)


def test_a_failure_while_listing_is_named_and_nvml_shut_down() -> None:
    fake = four()
    fake.gpus[2].lost = True
    with pytest.raises(ConfigError, match=r'"auto" found no GPU: NVML failed listing the GPUs'):
        discover_gpus(NVML, None, nvml=fake)
    assert fake.initialized == 0


def test_backend_off_cannot_discover() -> None:
    with pytest.raises(ConfigError, match=r'nvml.backend is "off"'):
        discover_gpus(NvmlSettings(backend="off"), None)


def test_the_file_backend_lists_its_gpus(tmp_path: Path) -> None:
    readings = tmp_path / "gpus.json"
    readings.write_text(json.dumps({"10": {}, "2": {}, "GPU-x": {}}))
    settings = NvmlSettings(backend="file", file=readings)
    assert discover_gpus(settings, None) == ["2", "10", "GPU-x"]
    assert discover_gpus(settings, "10,3") == ["0"]
    readings.write_text("[]")
    with pytest.raises(ConfigError, match=r"nvml\.file: .*gpus\.json: expected a JSON object"):
        discover_gpus(settings, None)


def test_a_config_file_with_auto_gets_the_gpus(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "gpus.json").write_text(json.dumps({"0": {}, "1": {}}))
    config = tmp_path / "deo.toml"
    config.write_text(
        '[deo]\ngpus = "auto"\n[nvml]\nbackend = "file"\nfile = "gpus.json"\n'
        '[pools.envs]\nargv = ["true"]\ngpus_per_worker = 2\n'
    )
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert load(config).config.gpus == ("0", "1")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    with pytest.raises(ConfigError, match=r"gpus_per_worker \(2\) exceeds the 1 GPUs declared"):
        load(config)


def test_a_config_file_with_another_string_is_refused(tmp_path: Path) -> None:
    config = tmp_path / "deo.toml"
    config.write_text('[deo]\ngpus = "all"\n')
    with pytest.raises(ConfigError, match=r'deo\.gpus: expected a list of GPU ids or "auto"'):
        load(config)


@pytest.mark.skipif(nvml_answers(), reason="a driver answers here: NVML finds GPUs")
def test_without_a_driver_auto_says_so(tmp_path: Path) -> None:
    config = tmp_path / "deo.toml"
    config.write_text('[deo]\ngpus = "auto"\n')
    with pytest.raises(ConfigError, match=r'^deo\.gpus = "auto" found no GPU: NVML unavailable'):
        load(config)


@pytest.mark.skipif(not nvml_answers(), reason="no NVML driver on this machine")
def test_the_real_nvml_lists_its_gpus() -> None:
    pynvml.nvmlInit()
    try:
        count = pynvml.nvmlDeviceGetCount()
    finally:
        pynvml.nvmlShutdown()
    assert discover_gpus(NVML, None) == [str(i) for i in range(count)]
