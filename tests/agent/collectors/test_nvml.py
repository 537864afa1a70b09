"""NvmlCollector against a fake pynvml: values, units, absences with reasons, MIG, lost GPUs."""

from __future__ import annotations

import pytest

from gpuscaler.agent.collectors.base import CollectorUnavailable
from gpuscaler.agent.collectors.nvml import NvmlCollector
from gpuscaler.model.gpu_metrics import Metric
from gpuscaler.model.samples import DEVICE_FIELD, ReadErrorKind
from tests.fakes.fake_nvml import (
    FUNCTION_NOT_FOUND,
    GPU_IS_LOST,
    LIBRARY_NOT_FOUND,
    NOT_SUPPORTED,
    FakeDevice,
    FakeNvml,
)


def started(nvml: FakeNvml) -> NvmlCollector:
    """An opened NvmlCollector on node-a over the fake ``nvml``."""
    collector = NvmlCollector(node="node-a", nvml=nvml)
    collector.open()
    return collector


def test_reads_every_metric_in_its_unit() -> None:
    """A healthy GPU reads utilisation %, VRAM bytes (v2), °C, watts, joules and GPM %, as floats, not truncated."""
    collector = started(FakeNvml([FakeDevice("GPU-aaa")]))
    [gpu] = collector.discover()
    collector.read(gpu)  # GPM metrics are rates between two samples
    sample = collector.read(gpu)

    assert (gpu.index, gpu.uuid, gpu.name, gpu.mig_parent_uuid) == (0, "GPU-aaa", "NVIDIA H100 80GB HBM3", None)
    assert sample.errors == ()
    assert sample.value(Metric.GPU_UTILIZATION) == 40.0
    assert sample.value(Metric.MEMORY_UTILIZATION) == 20.0
    assert sample.value(Metric.MEMORY_USED_PERCENT) == 50.0
    assert sample.value(Metric.TEMPERATURE) == 55.0
    assert sample.value(Metric.POWER_DRAW) == 350.5
    assert sample.value(Metric.POWER_PERCENT) == pytest.approx(50.07, abs=0.01)
    assert sample.energy_joules == 123_456.789
    assert sample.value(Metric.SM_ACTIVE) == 35.5
    assert sample.value(Metric.SM_OCCUPANCY) == 22.25
    assert sample.value(Metric.TENSOR_ACTIVE) == 12.5
    assert sample.value(Metric.DRAM_BANDWIDTH) == 48.0
    assert sample.processes is None  # per-process reads are off unless asked for


def test_not_supported_field_is_absent_with_reason() -> None:
    """A field NVML does not support is None with a NOT_SUPPORTED error naming the call, never 0."""
    device = FakeDevice("GPU-aaa", errors={"nvmlDeviceGetPowerUsage": NOT_SUPPORTED})
    collector = started(FakeNvml([device]))
    sample = collector.read(collector.discover()[0])

    assert sample.value(Metric.POWER_DRAW) is None
    assert sample.value(Metric.GPU_UTILIZATION) == 40.0
    error = sample.error_for(Metric.POWER_DRAW)
    assert error is not None
    assert error.kind is ReadErrorKind.NOT_SUPPORTED
    assert "nvmlDeviceGetPowerUsage(gpu 0)" in error.detail
    assert "Not Supported" in error.detail


def test_old_drivers_fall_back_to_v1_memory_and_temperature() -> None:
    """Without nvmlDeviceGetMemoryInfo v2 or GetTemperatureV, the older calls are used."""
    device = FakeDevice(
        "GPU-aaa",
        errors={"nvmlDeviceGetMemoryInfo_v2": FUNCTION_NOT_FOUND, "nvmlDeviceGetTemperatureV": FUNCTION_NOT_FOUND},
    )
    nvml = FakeNvml([device])
    collector = started(nvml)
    sample = collector.read(collector.discover()[0])

    assert sample.value(Metric.MEMORY_USED_PERCENT) == 50.0
    assert sample.value(Metric.TEMPERATURE) == 55.0
    assert nvml.calls["nvmlDeviceGetMemoryInfo"] == 1
    assert nvml.calls["nvmlDeviceGetTemperature"] == 1


def test_lost_gpu_goes_missing_and_comes_back() -> None:
    """GpuIsLost empties that GPU's values, keeps the others, and a later read re-acquires the handle."""
    lost = FakeDevice("GPU-lost", errors=dict.fromkeys(_READS, GPU_IS_LOST))
    healthy = FakeDevice("GPU-ok")
    nvml = FakeNvml([lost, healthy])
    collector = started(nvml)
    first, second = collector.discover()

    gone = collector.read(first)
    assert all(gone.value(metric) is None for metric in Metric)
    error = gone.error_for(Metric.GPU_UTILIZATION)
    assert error is not None
    assert error.kind is ReadErrorKind.GPU_LOST
    assert collector.read(second).value(Metric.GPU_UTILIZATION) == 40.0

    lost.errors.clear()
    back = collector.read(first)
    assert back.value(Metric.GPU_UTILIZATION) == 40.0
    assert nvml.calls["nvmlDeviceGetHandleByUUID"] == 1


def test_handle_lookup_failure_is_a_device_error() -> None:
    """While a lost GPU cannot even be looked up again, its sample carries one device-wide error."""
    lost = FakeDevice("GPU-lost", errors=dict.fromkeys([*_READS, "nvmlDeviceGetHandleByUUID"], GPU_IS_LOST))
    collector = started(FakeNvml([lost]))
    [gpu] = collector.discover()
    collector.read(gpu)  # loses the cached handle
    sample = collector.read(gpu)

    assert [(e.field, e.kind) for e in sample.errors] == [(DEVICE_FIELD, ReadErrorKind.GPU_LOST)]
    assert "nvmlDeviceGetHandleByUUID(GPU-lost)" in sample.errors[0].detail


def test_mig_instances_are_devices_without_nvml_utilisation_or_power() -> None:
    """A MIG GPU is sampled as its instances: memory per instance, no utilisation or power, never 0."""
    instance_a = FakeDevice("MIG-a", name="NVIDIA H100 1g.10gb", used_bytes=5 * 1024**3, total_bytes=10 * 1024**3)
    instance_a.errors["nvmlDeviceGetUtilizationRates"] = NOT_SUPPORTED
    instance_b = FakeDevice("MIG-b", name="NVIDIA H100 1g.10gb", used_bytes=1 * 1024**3, total_bytes=10 * 1024**3)
    instance_b.errors["nvmlDeviceGetUtilizationRates"] = NOT_SUPPORTED
    parent = FakeDevice("GPU-parent", temperature=61, mig_instances=[instance_a, None, instance_b])
    plain = FakeDevice("GPU-plain")
    collector = started(FakeNvml([parent, plain]))

    devices = collector.discover()
    assert [(d.index, d.uuid, d.mig_parent_uuid) for d in devices] == [
        (0, "MIG-a", "GPU-parent"),
        (0, "MIG-b", "GPU-parent"),
        (1, "GPU-plain", None),
    ]
    sample = collector.read(devices[0])
    assert sample.value(Metric.MEMORY_USED_PERCENT) == 50.0
    assert sample.value(Metric.GPU_UTILIZATION) is None
    utilisation_error = sample.error_for(Metric.GPU_UTILIZATION)
    assert utilisation_error is not None
    assert utilisation_error.kind is ReadErrorKind.NOT_SUPPORTED
    assert sample.value(Metric.POWER_DRAW) is None
    power_error = sample.error_for(Metric.POWER_DRAW)
    assert power_error is not None
    assert "per physical GPU" in power_error.detail
    assert sample.value(Metric.TEMPERATURE) == 61.0  # the parent's sensor
    assert sample.energy_joules is None  # the board's counter, like its power


def test_mig_mode_unsupported_means_plain_gpu() -> None:
    """A GPU that does not support MIG at all is one plain device."""
    device = FakeDevice("GPU-old", mig_mode_error=NOT_SUPPORTED)
    collector = started(FakeNvml([device]))
    assert [d.uuid for d in collector.discover()] == ["GPU-old"]


def test_missing_library_is_one_line_that_says_what_to_do() -> None:
    """NVML missing at start raises CollectorUnavailable naming the runtime, nvmlHostMounts and --collector fake."""
    collector = NvmlCollector(node="node-a", nvml=FakeNvml([], init_error=LIBRARY_NOT_FOUND))
    with pytest.raises(CollectorUnavailable) as raised:
        collector.open()
    message = str(raised.value)
    assert "\n" not in message
    assert "NVML Shared Library Not Found" in message
    for advice in ("NVIDIA container runtime", "nvmlHostMounts", "--collector fake"):
        assert advice in message


def test_real_pynvml_without_driver_is_collector_unavailable() -> None:
    """The real nvidia-ml-py on a machine without a driver fails to open with the same one-line advice."""
    collector = NvmlCollector(node="node-a")
    try:
        collector.open()
    except CollectorUnavailable as error:
        message = str(error)
    else:  # a GPU machine: the collector must then enumerate and read
        try:
            for gpu in collector.discover():
                assert collector.read(gpu).gpu.uuid == gpu.uuid
        finally:
            collector.close()
        return
    assert "--collector fake" in message


_READS = (
    "nvmlDeviceGetUtilizationRates",
    "nvmlDeviceGetMemoryInfo_v2",
    "nvmlDeviceGetTemperatureV",
    "nvmlDeviceGetPowerUsage",
    "nvmlDeviceGetEnforcedPowerLimit",
    "nvmlDeviceGetTotalEnergyConsumption",
    "nvmlGpmQueryDeviceSupport",
)


def test_enumeration_failure_is_collector_unavailable() -> None:
    """An NVML error while listing GPUs after a good init is the same one-line advice, not a traceback."""
    nvml = FakeNvml([FakeDevice("GPU-aaa")])
    collector = started(nvml)

    def broken_count() -> int:
        raise nvml.NVMLError(9)  # driver not loaded

    nvml.nvmlDeviceGetCount = broken_count  # type: ignore[method-assign]
    with pytest.raises(CollectorUnavailable) as raised:
        collector.discover()
    assert "could not list the GPUs" in str(raised.value)
    assert "--collector fake" in str(raised.value)
