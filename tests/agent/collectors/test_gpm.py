"""NvmlCollector's GPM reads against the fake pynvml: rates between two samples, support, MIG, and every free."""

from __future__ import annotations

import threading

import pytest

from gpuscaler.agent.collectors.nvml import NvmlCollector
from gpuscaler.model.gpu_metrics import GPM_DRAM_BW_UTIL, GPM_READINGS, GPM_SM_UTIL, Metric, Reading
from gpuscaler.model.samples import GpuSample, ReadErrorKind
from tests.fakes.fake_nvml import FUNCTION_NOT_FOUND, GPU_IS_LOST, NO_DATA, NOT_SUPPORTED, FakeDevice, FakeNvml

GPM_METRICS = (Metric.SM_ACTIVE, Metric.SM_OCCUPANCY, Metric.TENSOR_ACTIVE, Metric.DRAM_BANDWIDTH)


def started(nvml: FakeNvml) -> NvmlCollector:
    """An opened NvmlCollector on node-a over the fake ``nvml``."""
    collector = NvmlCollector(node="node-a", nvml=nvml)
    collector.open()
    return collector


def gpm_values(sample: GpuSample) -> list[float | None]:
    """The sample's four GPM metrics, in GPM_METRICS order (None where absent)."""
    return [sample.value(metric) for metric in GPM_METRICS]


def test_the_first_tick_is_absent_with_its_reason_then_each_tick_is_a_rate() -> None:
    """A GPM metric needs two samples: the first read has none of them (never 0), every later read has all."""
    device = FakeDevice("GPU-h100")
    collector = started(FakeNvml([device]))
    [gpu] = collector.discover()

    first = collector.read(gpu)
    assert gpm_values(first) == [None] * 4
    for metric in GPM_METRICS:
        error = first.error_for(metric)
        assert error is not None
        assert error.kind is ReadErrorKind.OTHER  # UNAVAILABLE: the next tick has it
        assert "first" in error.detail
        assert "gpu 0" in error.detail
    assert first.value(Metric.GPU_UTILIZATION) == 40.0  # the rest of the sample is there

    assert gpm_values(collector.read(gpu)) == [35.5, 22.25, 12.5, 48.0]
    device.gpm[GPM_SM_UTIL] = 90.0
    assert collector.read(gpu).value(Metric.SM_ACTIVE) == 90.0


def test_a_gpu_before_hopper_has_no_gpm_and_says_why() -> None:
    """A GPU without GPM has every GPM metric NOT_SUPPORTED, saying what to use; asked once, nothing allocated."""
    nvml = FakeNvml([FakeDevice("GPU-a100", name="NVIDIA A100-SXM4-80GB", gpm_supported=False)])
    collector = started(nvml)
    [gpu] = collector.discover()
    for _ in range(3):
        sample = collector.read(gpu)
        assert gpm_values(sample) == [None] * 4
        for metric in GPM_METRICS:
            error = sample.error_for(metric)
            assert error is not None
            assert error.kind is ReadErrorKind.NOT_SUPPORTED
            assert "GPM is not supported on gpu 0" in error.detail
            assert "gpu_utilization" in error.detail
    assert sample.value(Metric.GPU_UTILIZATION) == 40.0
    assert nvml.calls["nvmlGpmQueryDeviceSupport"] == 1
    assert nvml.gpm_allocated == 0


def test_a_driver_without_gpm_is_not_supported() -> None:
    """An older driver lacks the GPM functions (FUNCTION_NOT_FOUND): NOT_SUPPORTED, naming the call."""
    device = FakeDevice("GPU-old-driver", errors={"nvmlGpmQueryDeviceSupport": FUNCTION_NOT_FOUND})
    collector = started(FakeNvml([device]))
    [gpu] = collector.discover()
    error = collector.read(gpu).error_for(Metric.SM_ACTIVE)
    assert error is not None
    assert error.kind is ReadErrorKind.NOT_SUPPORTED
    assert "nvmlGpmQueryDeviceSupport(gpu 0): Function Not Found" in error.detail


def test_one_metric_nvml_refuses_is_absent_alone() -> None:
    """A metric whose own return code is an error is absent with that code; the other GPM metrics still read."""
    device = FakeDevice("GPU-h100", gpm_metric_errors={GPM_DRAM_BW_UTIL: NO_DATA})
    collector = started(FakeNvml([device]))
    [gpu] = collector.discover()
    collector.read(gpu)
    sample = collector.read(gpu)
    assert gpm_values(sample) == [35.5, 22.25, 12.5, None]
    error = sample.error_for(Metric.DRAM_BANDWIDTH)
    assert error is not None
    assert f"metric {GPM_DRAM_BW_UTIL}" in error.detail
    assert "No data" in error.detail


def test_each_device_keeps_two_samples_and_close_frees_them_all() -> None:
    """However many ticks, a device holds two GPM samples; closing the collector frees every one, once."""
    nvml = FakeNvml([FakeDevice("GPU-0"), FakeDevice("GPU-1")])
    collector = started(nvml)
    gpus = collector.discover()
    for _ in range(5):
        for gpu in gpus:
            collector.read(gpu)
    assert nvml.gpm_allocated == 4
    assert len(nvml.gpm_live) == 4
    collector.close()
    assert nvml.gpm_live == {}
    assert nvml.gpm_freed == 4


def test_a_device_that_leaves_the_enumeration_gives_its_samples_back() -> None:
    """A GPU gone at the next discovery (removed, or turned into MIG instances) has its samples freed."""
    nvml = FakeNvml([FakeDevice("GPU-0"), FakeDevice("GPU-1")])
    collector = started(nvml)
    first, _second = collector.discover()
    for gpu in collector.discover():
        collector.read(gpu)
    nvml.devices.pop()
    assert [gpu.uuid for gpu in collector.discover()] == ["GPU-0"]
    assert nvml.gpm_freed == 2
    assert len(nvml.gpm_live) == 2
    assert collector.read(first).value(Metric.SM_ACTIVE) == 35.5  # the one that stays keeps its previous sample


def test_a_lost_gpu_frees_its_samples_and_starts_over_when_back() -> None:
    """GPU_IS_LOST frees the device's samples; back, its first GPM read is absent again: no rate across the loss."""
    device = FakeDevice("GPU-0")
    nvml = FakeNvml([device])
    collector = started(nvml)
    [gpu] = collector.discover()
    collector.read(gpu)
    assert collector.read(gpu).value(Metric.SM_ACTIVE) == 35.5

    device.errors["nvmlDeviceGetUtilizationRates"] = GPU_IS_LOST
    lost = collector.read(gpu)
    assert lost.value(Metric.SM_ACTIVE) is None
    lost_error = lost.error_for(Metric.SM_ACTIVE)
    assert lost_error is not None
    assert lost_error.kind is ReadErrorKind.GPU_LOST
    assert nvml.gpm_live == {}
    assert nvml.gpm_freed == 2

    device.errors.clear()
    back = collector.read(gpu)
    assert back.value(Metric.SM_ACTIVE) is None
    error = back.error_for(Metric.SM_ACTIVE)
    assert error is not None
    assert "first" in error.detail
    assert collector.read(gpu).value(Metric.SM_ACTIVE) == 35.5


def test_a_hung_read_frees_the_samples_itself_when_its_device_went_meanwhile() -> None:
    """Samples in use by a hung GPM read are not freed under it; the read frees them when it returns, once."""
    nvml = FakeNvml([FakeDevice("GPU-0")])
    collector = started(nvml)
    [gpu] = collector.discover()
    collector.read(gpu)  # allocates
    nvml.gpm_release = threading.Event()
    result: list[GpuSample] = []
    reader = threading.Thread(target=lambda: result.append(collector.read(gpu)), daemon=True)
    reader.start()
    assert nvml.gpm_waiting.wait(10)

    nvml.devices.clear()
    collector.discover()  # the device is gone while its read still runs
    assert len(nvml.gpm_live) == 2, "freed under a running read"

    nvml.gpm_release.set()
    reader.join(10)
    assert not reader.is_alive()
    assert nvml.gpm_live == {}
    assert nvml.gpm_freed == 2
    collector.close()  # nothing is freed twice (the fake refuses a double free)
    assert nvml.gpm_freed == 2


def test_mig_instances_read_gpm_through_their_parent_and_get_utilisation_from_it() -> None:
    """A MIG instance samples GPM by GPU instance id on its parent; GPM's graphics activity fills gpu_utilization."""
    instance = FakeDevice("MIG-a", gpu_instance_id=7, gpm={1: 64.0, 2: 30.0, 3: 20.0, 5: 10.0, 10: 25.0})
    instance.errors["nvmlDeviceGetUtilizationRates"] = NOT_SUPPORTED
    other = FakeDevice("MIG-b", gpu_instance_id=8, gpm={1: 5.0, 2: 2.0, 3: 1.0, 5: 0.0, 10: 3.0})
    other.errors["nvmlDeviceGetUtilizationRates"] = NOT_SUPPORTED
    nvml = FakeNvml([FakeDevice("GPU-parent", mig_instances=[instance, other])])
    collector = started(nvml)
    first, second = collector.discover()
    collector.read(first)
    collector.read(second)

    sample = collector.read(first)
    assert sample.value(Metric.GPU_UTILIZATION) == 64.0
    assert sample.error_for(Metric.GPU_UTILIZATION) is None
    assert gpm_values(sample) == [30.0, 20.0, 10.0, 25.0]
    assert collector.read(second).value(Metric.GPU_UTILIZATION) == 5.0
    assert nvml.calls["nvmlGpmMigSampleGet"] >= 4
    assert "nvmlGpmSampleGet" not in nvml.calls
    assert sample.value(Metric.MEMORY_UTILIZATION) is None  # GPM has no memory-controller duty cycle


def test_mig_on_a_gpu_without_gpm_keeps_utilisation_absent() -> None:
    """An A100's MIG instances have no GPM: gpu_utilization stays NVML's NOT_SUPPORTED, never 0."""
    instance = FakeDevice("MIG-a")
    instance.errors["nvmlDeviceGetUtilizationRates"] = NOT_SUPPORTED
    collector = started(FakeNvml([FakeDevice("GPU-a100", gpm_supported=False, mig_instances=[instance])]))
    [gpu] = collector.discover()
    collector.read(gpu)
    sample = collector.read(gpu)
    assert sample.value(Metric.GPU_UTILIZATION) is None
    error = sample.error_for(Metric.GPU_UTILIZATION)
    assert error is not None
    assert error.kind is ReadErrorKind.NOT_SUPPORTED
    assert "nvmlDeviceGetUtilizationRates" in error.detail


@pytest.mark.parametrize("reading", GPM_READINGS, ids=lambda reading: reading.field)
def test_every_gpm_reading_is_read(reading: Reading) -> None:
    """Each GPM reading of the metric table is asked of NVML by its id and lands in its sample field, in its unit."""
    device = FakeDevice("GPU-h100", gpm={reading.gpm_metric or 0: 77.0})
    collector = started(FakeNvml([device]))
    [gpu] = collector.discover()
    collector.read(gpu)
    assert getattr(collector.read(gpu), reading.field) == pytest.approx(77.0 * reading.gpm_scale)
