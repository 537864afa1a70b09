"""NvmlCollector's PCIe and NVLink traffic against the fake pynvml: GPM, the older calls, no NVLink, MIG, losses."""

from __future__ import annotations

from typing import Any

import pytest

from gpuscaler.agent.collectors.nvml import NvmlCollector
from gpuscaler.model.gpu_metrics import FALLBACK_READINGS, Metric, Reading
from gpuscaler.model.samples import GpuSample, ReadErrorKind
from tests.fakes.fake_nvml import (
    GPU_IS_LOST,
    NOT_SUPPORTED,
    NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX,
    TIMEOUT,
    FakeDevice,
    FakeNvml,
)

TRAFFIC = (Metric.PCIE_TX, Metric.PCIE_RX, Metric.NVLINK_TX, Metric.NVLINK_RX)
FALLBACK_CALLS = ("nvmlDeviceGetPcieThroughput", "nvmlDeviceGetFieldValues")


class Clock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def started(nvml: FakeNvml, clock: Clock | None = None) -> NvmlCollector:
    """An opened NvmlCollector on node-a over the fake ``nvml``, its NVLink rates timed by ``clock``."""
    collector = NvmlCollector(node="node-a", nvml=nvml, clock=clock or Clock())
    collector.open()
    return collector


def ampere(uuid: str = "GPU-a100", **fields: Any) -> FakeDevice:
    """An A100 SXM: NVLink, no GPM."""
    return FakeDevice(uuid, name="NVIDIA A100-SXM4-80GB", gpm_supported=False, **fields)


def traffic(sample: GpuSample) -> list[float | None]:
    """PCIe TX, PCIe RX, NVLink TX, NVLink RX in MB/s (None where absent)."""
    return [sample.value(metric) for metric in TRAFFIC]


def reason(sample: GpuSample, metric: Metric) -> tuple[ReadErrorKind, str]:
    """The kind and words of the error that made ``metric`` absent."""
    error = sample.error_for(metric)
    assert error is not None, metric
    return error.kind, error.detail


def test_on_hopper_traffic_is_gpms_in_megabytes_per_second() -> None:
    """GPM's MiB/s become MB/s (x 1.048576); the older calls are not made where GPM answers."""
    nvml = FakeNvml([FakeDevice("GPU-h100")])
    collector = started(nvml)
    [gpu] = collector.discover()
    first = collector.read(gpu)
    assert traffic(first) == [None] * 4
    assert "first" in reason(first, Metric.NVLINK_TX)[1]

    sample = collector.read(gpu)
    assert sample.errors == ()
    assert traffic(sample) == pytest.approx([1048.576, 3145.728, 52428.8, 41943.04])
    assert not set(FALLBACK_CALLS) & set(nvml.calls)


def test_before_hopper_pcie_is_the_older_calls_kilobytes_in_megabytes_per_second() -> None:
    """Without GPM, PCIe reads nvmlDeviceGetPcieThroughput's KB/s (1024 bytes) as MB/s from the first tick."""
    collector = started(FakeNvml([ampere(pcie_tx_kbps=500_000, pcie_rx_kbps=1_000_000)]))
    [gpu] = collector.discover()
    sample = collector.read(gpu)
    assert sample.value(Metric.PCIE_TX) == pytest.approx(512.0)
    assert sample.value(Metric.PCIE_RX) == pytest.approx(1024.0)
    assert sample.error_for(Metric.PCIE_TX) is None
    assert sample.value(Metric.SM_ACTIVE) is None  # GPM-only readings stay absent
    assert "GPM is not supported" in reason(sample, Metric.SM_ACTIVE)[1]


def test_before_hopper_nvlink_is_the_counters_rate_between_two_reads() -> None:
    """The all-links KiB counters' increase over the monotonic time between reads; the first read is absent."""
    device = ampere(nvlink_tx_kib=10_000_000, nvlink_rx_kib=20_000_000)
    clock = Clock()
    collector = started(FakeNvml([device]), clock)
    [gpu] = collector.discover()

    first = collector.read(gpu)
    assert first.value(Metric.NVLINK_TX) is None
    assert first.value(Metric.NVLINK_RX) is None
    kind, detail = reason(first, Metric.NVLINK_TX)
    assert kind is ReadErrorKind.OTHER
    assert "this is gpu 0's first" in detail

    clock.now += 2.0
    device.nvlink_tx_kib += 4_000_000  # 4 096 000 000 bytes in 2 s
    device.nvlink_rx_kib += 1_000_000
    sample = collector.read(gpu)
    assert sample.value(Metric.NVLINK_TX) == pytest.approx(2048.0)
    assert sample.value(Metric.NVLINK_RX) == pytest.approx(512.0)
    assert [sample.error_for(metric) for metric in TRAFFIC] == [None] * 4

    clock.now += 0.5
    idle = collector.read(gpu)
    assert idle.value(Metric.NVLINK_TX) == 0.0  # links that moved nothing: a true 0
    assert idle.error_for(Metric.NVLINK_TX) is None


def test_a_counter_that_went_down_is_a_reset_absent_for_one_tick_never_negative() -> None:
    """A counter below its previous read (a driver reload) is absent with that reason; the next tick has a rate."""
    device = ampere(nvlink_tx_kib=50_000_000, nvlink_rx_kib=50_000_000)
    clock = Clock()
    collector = started(FakeNvml([device]), clock)
    [gpu] = collector.discover()
    collector.read(gpu)

    clock.now += 1.0
    device.nvlink_tx_kib = 1_000
    device.nvlink_rx_kib += 1_000
    reset = collector.read(gpu)
    assert reset.value(Metric.NVLINK_TX) is None
    kind, detail = reason(reset, Metric.NVLINK_TX)
    assert kind is ReadErrorKind.OTHER
    assert "went down from 50000000 to 1000 KiB" in detail
    assert "nvmlDeviceGetFieldValues[field 138](gpu 0)" in detail
    assert reset.value(Metric.NVLINK_RX) == pytest.approx(1.024)  # the other counter did not reset

    clock.now += 1.0
    device.nvlink_tx_kib += 1_000_000
    assert collector.read(gpu).value(Metric.NVLINK_TX) == pytest.approx(1024.0)


@pytest.mark.parametrize("gpm", [True, False], ids=["hopper", "before-hopper"])
def test_a_gpu_without_nvlink_has_no_nvlink_readings_but_has_pcie(gpm: bool) -> None:
    """A PCIe card without NVLink reads NVLink as NOT_SUPPORTED, never GPM's 0, asked once; PCIe still reads."""
    nvml = FakeNvml([FakeDevice("GPU-pcie", name="NVIDIA H100 PCIe", gpm_supported=gpm, nvlink=False)])
    collector = started(nvml)
    [gpu] = collector.discover()
    for _ in range(3):
        sample = collector.read(gpu)
        for metric in (Metric.NVLINK_TX, Metric.NVLINK_RX):
            assert sample.value(metric) is None
            kind, detail = reason(sample, metric)
            assert kind is ReadErrorKind.NOT_SUPPORTED
            assert "nvmlDeviceGetNvLinkState(gpu 0, link 0): Not Supported" in detail
            assert "this GPU has no NVLink" in detail
    assert sample.value(Metric.PCIE_TX) is not None
    assert sample.value(Metric.PCIE_RX) is not None
    assert nvml.calls["nvmlDeviceGetNvLinkState"] == 1
    assert "nvmlDeviceGetFieldValues" not in nvml.calls


def test_a_driver_without_the_nvlink_state_call_has_no_nvlink_asked_once() -> None:
    """FUNCTION_NOT_FOUND (a driver without nvmlDeviceGetNvLinkState) will not pass either: NVLink is absent
    NOT_SUPPORTED, asked once, rather than an NVML error every tick that an error-rate alert would count."""
    nvml = FakeNvml([FakeDevice("GPU-old", gpm_supported=False, errors={"nvmlDeviceGetNvLinkState": 13})])
    collector = started(nvml)
    [gpu] = collector.discover()
    for _ in range(3):
        sample = collector.read(gpu)
        kind, detail = reason(sample, Metric.NVLINK_TX)
        assert kind is ReadErrorKind.NOT_SUPPORTED
        assert "this GPU has no NVLink" in detail
    assert nvml.calls["nvmlDeviceGetNvLinkState"] == 1


def test_counters_nvml_does_not_support_are_absent_not_supported() -> None:
    """When the links answer but the throughput counters are NOT_SUPPORTED, NVLink is absent with that reason."""
    collector = started(FakeNvml([ampere(field_errors={138: NOT_SUPPORTED, 139: NOT_SUPPORTED})]))
    [gpu] = collector.discover()
    sample = collector.read(gpu)
    kind, detail = reason(sample, Metric.NVLINK_TX)
    assert kind is ReadErrorKind.NOT_SUPPORTED
    assert "nvmlDeviceGetFieldValues[field 138](gpu 0): Not Supported" in detail
    assert "no NVLink" in detail


def test_one_counter_nvml_refuses_is_absent_alone() -> None:
    """A field value with its own error is absent naming the call, the field and NVML's words; the other reads."""
    device = ampere(field_errors={NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX: TIMEOUT})
    clock = Clock()
    collector = started(FakeNvml([device]), clock)
    [gpu] = collector.discover()
    collector.read(gpu)
    clock.now += 1.0
    sample = collector.read(gpu)
    kind, detail = reason(sample, Metric.NVLINK_TX)
    assert kind is ReadErrorKind.TIMEOUT
    assert detail.startswith("nvmlDeviceGetFieldValues[field 138](gpu 0): Timeout")
    assert sample.value(Metric.NVLINK_RX) == 0.0


def test_an_nvlink_state_that_fails_for_now_is_asked_again() -> None:
    """A timeout of nvmlDeviceGetNvLinkState makes NVLink absent for that tick only, not NOT_SUPPORTED for good."""
    device = ampere(errors={"nvmlDeviceGetNvLinkState": TIMEOUT})
    clock = Clock()
    nvml = FakeNvml([device])
    collector = started(nvml, clock)
    [gpu] = collector.discover()
    sample = collector.read(gpu)
    kind, detail = reason(sample, Metric.NVLINK_TX)
    assert kind is ReadErrorKind.TIMEOUT
    assert "nvmlDeviceGetNvLinkState(gpu 0): Timeout" in detail
    assert sample.value(Metric.PCIE_TX) is not None

    device.errors.clear()
    collector.read(gpu)
    clock.now += 1.0
    assert collector.read(gpu).value(Metric.NVLINK_TX) == 0.0
    assert nvml.calls["nvmlDeviceGetNvLinkState"] == 2


@pytest.mark.parametrize("gpm", [True, False], ids=["hopper", "before-hopper"])
def test_mig_instances_have_no_traffic_of_their_own(gpm: bool) -> None:
    """PCIe and NVLink belong to the physical GPU: a MIG instance reads them as NOT_SUPPORTED, saying so."""
    instance = FakeDevice("MIG-a", gpu_instance_id=7)
    instance.errors["nvmlDeviceGetUtilizationRates"] = NOT_SUPPORTED
    nvml = FakeNvml([FakeDevice("GPU-parent", gpm_supported=gpm, mig_instances=[instance])])
    collector = started(nvml)
    [gpu] = collector.discover()
    collector.read(gpu)
    sample = collector.read(gpu)
    assert traffic(sample) == [None] * 4
    for metric in TRAFFIC:
        kind, detail = reason(sample, metric)
        assert kind is ReadErrorKind.NOT_SUPPORTED
        assert "per physical GPU, not per MIG instance" in detail
    assert not {*FALLBACK_CALLS, "nvmlDeviceGetNvLinkState"} & set(nvml.calls)


def test_a_lost_gpu_forgets_its_counters_and_its_nvlink_answer() -> None:
    """GPU_IS_LOST makes the traffic absent as lost; back, there is no rate across the loss and NVLink is asked anew."""
    device = ampere(nvlink_tx_kib=1_000_000)
    clock = Clock()
    nvml = FakeNvml([device])
    collector = started(nvml, clock)
    [gpu] = collector.discover()
    collector.read(gpu)
    clock.now += 1.0
    assert collector.read(gpu).value(Metric.NVLINK_TX) == 0.0

    device.errors["nvmlDeviceGetUtilizationRates"] = GPU_IS_LOST
    clock.now += 1.0
    lost = collector.read(gpu)
    assert traffic(lost) == [None] * 4
    assert {reason(lost, metric)[0] for metric in TRAFFIC} == {ReadErrorKind.GPU_LOST}

    device.errors.clear()
    device.nvlink_tx_kib += 9_000_000  # moved while the GPU was gone: not a rate over one tick
    clock.now += 1.0
    back = collector.read(gpu)
    assert back.value(Metric.NVLINK_TX) is None
    assert "first" in reason(back, Metric.NVLINK_TX)[1]
    assert nvml.calls["nvmlDeviceGetNvLinkState"] == 2


def test_while_gpm_support_is_unknown_pcie_comes_from_the_older_call() -> None:
    """When the GPM support query fails for now, GPM-only readings carry its error and traffic reads the older way."""
    collector = started(FakeNvml([FakeDevice("GPU-h100", errors={"nvmlGpmQueryDeviceSupport": TIMEOUT})]))
    [gpu] = collector.discover()
    sample = collector.read(gpu)
    assert sample.value(Metric.PCIE_TX) == pytest.approx(512.0)
    assert sample.error_for(Metric.PCIE_TX) is None
    assert reason(sample, Metric.SM_ACTIVE)[0] is ReadErrorKind.TIMEOUT


@pytest.mark.parametrize("reading", FALLBACK_READINGS, ids=lambda reading: reading.field)
def test_every_reading_with_a_fallback_is_read_by_it_without_gpm(reading: Reading) -> None:
    """Each reading the metric table gives a fallback is read, by that call, on a GPU without GPM."""
    device = ampere()
    clock = Clock()
    nvml = FakeNvml([device])
    collector = started(nvml, clock)
    [gpu] = collector.discover()
    collector.read(gpu)
    clock.now += 1.0
    device.nvlink_tx_kib += 1_000_000
    device.nvlink_rx_kib += 2_000_000
    expected = {
        "pcie_tx_megabytes_per_second": 512.0,
        "pcie_rx_megabytes_per_second": 1024.0,
        "nvlink_tx_megabytes_per_second": 1024.0,
        "nvlink_rx_megabytes_per_second": 2048.0,
    }
    assert getattr(collector.read(gpu), reading.field) == pytest.approx(expected[reading.field])
    assert reading.fallback is not None
    assert nvml.calls[reading.fallback] >= 1
