"""Every GPU metric, once: the readings a sample holds, and the metrics a trigger can scale on.

A *reading* is one value NVML gives per device: a field of ``GpuSample`` with its unit in the name, the NVML
call it comes from, and its Prometheus series. A *metric* is what trigger metadata names: computed from one
reading or two, with its unit, what a fake GPU reads when idle, and the defaults a trigger that names only
the metric gets. The collectors, the fake GPUs, the scenario files, /metrics, the profiles and the docs'
tables (checked by tests) all read these two tables; a new metric is one entry in each. A new reading goes at
the end of ``READINGS``: the wire packs each GPU's readings in that order (``Snapshot.readings``).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field

from gpuscaler.model.aggregation import Aggregation


class Metric(enum.StrEnum):
    """The metric names that trigger metadata, the fake collector and the docs share."""

    GPU_UTILIZATION = "gpu_utilization"
    MEMORY_UTILIZATION = "memory_utilization"
    MEMORY_USED_PERCENT = "memory_used_percent"
    TEMPERATURE = "temperature"
    POWER_DRAW = "power_draw"
    POWER_PERCENT = "power_percent"
    SM_ACTIVE = "sm_active"
    SM_OCCUPANCY = "sm_occupancy"
    TENSOR_ACTIVE = "tensor_active"
    DRAM_BANDWIDTH = "dram_bandwidth"
    POWER_AVERAGE = "power_average"
    PCIE_TX = "pcie_tx"
    PCIE_RX = "pcie_rx"
    NVLINK_TX = "nvlink_tx"
    NVLINK_RX = "nvlink_rx"


@dataclass(frozen=True, slots=True)
class Reading:
    """One value NVML gives per device, kept as a ``GpuSample`` field."""

    field: str  # the GpuSample attribute, unit in its name
    nvml: str  # the call it comes from
    series: str  # the Prometheus series, in base units: a gauge, or a counter (``_total`` added on export)
    help: str
    scale: float = 1.0  # from the field's unit to the series' (percent to ratio: 0.01)
    counter: bool = False  # a value that only grows (energy since the driver loaded)
    gpm_metric: int | None = None  # the NVML_GPM_METRIC_* id of a GPM reading: a rate between two GPM samples
    gpm_scale: float = 1.0  # from the GPM metric's unit to the field's (MiB/s to MB/s: 1.048576)
    # The older NVML call a GPU without GPM (before Hopper) reads it with; None: absent there, as GPM-only.
    fallback: str | None = None


# NVML_GPM_METRIC_* ids (nvml.h); named here so that the collector and the fake NVML share them.
GPM_GRAPHICS_UTIL = 1
GPM_SM_UTIL = 2
GPM_SM_OCCUPANCY = 3
GPM_ANY_TENSOR_UTIL = 5
GPM_DRAM_BW_UTIL = 10
GPM_PCIE_TX_PER_SEC = 20
GPM_PCIE_RX_PER_SEC = 21
GPM_NVLINK_TOTAL_RX_PER_SEC = 60
GPM_NVLINK_TOTAL_TX_PER_SEC = 61

# GPM's throughputs are in MiB/s; the readings are in decimal MB/s, the unit the prior art's targets are in.
MIB_PER_SECOND_IN_MB_PER_SECOND = 1024**2 / 1e6


READINGS: tuple[Reading, ...] = (
    Reading(
        "gpu_utilization_percent",
        "nvmlDeviceGetUtilizationRates",
        "gpuscaler_gpu_utilization_ratio",
        "Share of the last sample period the GPU's SMs were busy (NVML utilization.gpu / 100).",
        0.01,
    ),
    Reading(
        "memory_utilization_percent",
        "nvmlDeviceGetUtilizationRates",
        "gpuscaler_gpu_memory_utilization_ratio",
        "Share of the last sample period the memory controller was busy (NVML utilization.memory / 100).",
        0.01,
    ),
    Reading(
        "memory_used_bytes",
        "nvmlDeviceGetMemoryInfo",
        "gpuscaler_gpu_memory_used_bytes",
        "VRAM in use (NVML memory info v2 used).",
    ),
    Reading("memory_total_bytes", "nvmlDeviceGetMemoryInfo", "gpuscaler_gpu_memory_total_bytes", "VRAM size."),
    Reading(
        "temperature_celsius", "nvmlDeviceGetTemperatureV", "gpuscaler_gpu_temperature_celsius", "GPU die temperature."
    ),
    Reading("power_draw_watts", "nvmlDeviceGetPowerUsage", "gpuscaler_gpu_power_draw_watts", "Board power draw."),
    Reading(
        "power_limit_watts",
        "nvmlDeviceGetEnforcedPowerLimit",
        "gpuscaler_gpu_power_limit_watts",
        "Enforced power limit.",
    ),
    Reading(
        "sm_active_percent",
        "nvmlGpmMetricsGet",
        "gpuscaler_gpu_sm_active_ratio",
        "Share of the SMs that were busy between the last two GPM samples (NVML_GPM_METRIC_SM_UTIL / 100).",
        0.01,
        gpm_metric=GPM_SM_UTIL,
    ),
    Reading(
        "sm_occupancy_percent",
        "nvmlGpmMetricsGet",
        "gpuscaler_gpu_sm_occupancy_ratio",
        "Resident warps against the SMs' maximum between the last two GPM samples "
        "(NVML_GPM_METRIC_SM_OCCUPANCY / 100).",
        0.01,
        gpm_metric=GPM_SM_OCCUPANCY,
    ),
    Reading(
        "tensor_active_percent",
        "nvmlGpmMetricsGet",
        "gpuscaler_gpu_tensor_active_ratio",
        "Share of the time the SMs ran any tensor-core instruction (NVML_GPM_METRIC_ANY_TENSOR_UTIL / 100).",
        0.01,
        gpm_metric=GPM_ANY_TENSOR_UTIL,
    ),
    Reading(
        "dram_bandwidth_percent",
        "nvmlGpmMetricsGet",
        "gpuscaler_gpu_dram_bandwidth_ratio",
        "DRAM bandwidth used against the GPU's maximum between the last two GPM samples "
        "(NVML_GPM_METRIC_DRAM_BW_UTIL / 100).",
        0.01,
        gpm_metric=GPM_DRAM_BW_UTIL,
    ),
    Reading(
        "energy_joules",
        "nvmlDeviceGetTotalEnergyConsumption",
        "gpuscaler_gpu_energy_joules",
        "Energy the board used since the driver loaded (NVML total energy consumption, mJ / 1000).",
        counter=True,
    ),
    # Appended after energy_joules, as every new reading is: the wire's packed order must not move.
    Reading(
        "pcie_tx_megabytes_per_second",
        "nvmlGpmMetricsGet",
        "gpuscaler_gpu_pcie_tx_bytes_per_second",
        "Bytes per second the GPU sent over PCIe (NVML_GPM_METRIC_PCIE_TX_PER_SEC; before Hopper "
        "nvmlDeviceGetPcieThroughput, a 20 ms sample).",
        1e6,
        gpm_metric=GPM_PCIE_TX_PER_SEC,
        gpm_scale=MIB_PER_SECOND_IN_MB_PER_SECOND,
        fallback="nvmlDeviceGetPcieThroughput",
    ),
    Reading(
        "pcie_rx_megabytes_per_second",
        "nvmlGpmMetricsGet",
        "gpuscaler_gpu_pcie_rx_bytes_per_second",
        "Bytes per second the GPU received over PCIe (NVML_GPM_METRIC_PCIE_RX_PER_SEC; before Hopper "
        "nvmlDeviceGetPcieThroughput, a 20 ms sample).",
        1e6,
        gpm_metric=GPM_PCIE_RX_PER_SEC,
        gpm_scale=MIB_PER_SECOND_IN_MB_PER_SECOND,
        fallback="nvmlDeviceGetPcieThroughput",
    ),
    Reading(
        "nvlink_tx_megabytes_per_second",
        "nvmlGpmMetricsGet",
        "gpuscaler_gpu_nvlink_tx_bytes_per_second",
        "Bytes per second the GPU sent over all its NVLinks (NVML_GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC; before "
        "Hopper the NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX counter's rate between two reads).",
        1e6,
        gpm_metric=GPM_NVLINK_TOTAL_TX_PER_SEC,
        gpm_scale=MIB_PER_SECOND_IN_MB_PER_SECOND,
        fallback="nvmlDeviceGetFieldValues",
    ),
    Reading(
        "nvlink_rx_megabytes_per_second",
        "nvmlGpmMetricsGet",
        "gpuscaler_gpu_nvlink_rx_bytes_per_second",
        "Bytes per second the GPU received over all its NVLinks (NVML_GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC; "
        "before Hopper the NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX counter's rate between two reads).",
        1e6,
        gpm_metric=GPM_NVLINK_TOTAL_RX_PER_SEC,
        gpm_scale=MIB_PER_SECOND_IN_MB_PER_SECOND,
        fallback="nvmlDeviceGetFieldValues",
    ),
)
READING_FIELDS: tuple[str, ...] = tuple(reading.field for reading in READINGS)
GPM_READINGS: tuple[Reading, ...] = tuple(reading for reading in READINGS if reading.gpm_metric is not None)
# GPM readings that an older call also gives: a GPU without GPM reads these through ``Reading.fallback``.
FALLBACK_READINGS: tuple[Reading, ...] = tuple(reading for reading in READINGS if reading.fallback is not None)


@dataclass(frozen=True, slots=True)
class MetricDefaults:
    """What a trigger that names only ``metric`` gets."""

    aggregation: Aggregation
    target: float
    activation_threshold: float
    why: str


@dataclass(frozen=True, slots=True)
class MetricInfo:
    """A metric a trigger can scale on: its reading, or the share one reading is of another."""

    unit: str
    reading: str  # the field it is, or the part of ``of``, or the counter of a rate
    of: str | None  # for a percentage of another field: the whole
    fake_idle: float | None  # an idle fake GPU's value; None for one computed from others
    defaults: MetricDefaults
    # A rate: the reading's increase per second between two samples (energy in J -> average W), so one
    # sample has no value; the evaluation takes it over the window (``agent/rates.py``).
    rate: bool = False
    # The ``ProcessUsage`` field that gives one pod's own share of a shared GPU (``shares.py``); None when
    # NVML has no per-process figure for it and a pod reads the whole GPU's value.
    per_process: str | None = None
    # What ``rate`` means elsewhere, said once here: code asks these, never ``rate`` but to compute one. Fields, not
    # properties: read per GPU on every call. Whether one sample holds its value (its columns, a fake GPU's
    # setting); a rate's needs two.
    in_one_sample: bool = field(init=False)
    # The window a query that names none reads: a rate's is the newest two samples (0 s, the only window of 0 s
    # there is); None for every other metric, which reads the newest sample.
    default_window_seconds: float | None = field(init=False)
    # Whether ``windowFunction`` reduces it over a window; a rate over a window is its average by construction.
    takes_window_function: bool = field(init=False)
    # Whether one reading stands for the poll interval that ends at it (a gauge; GPM's rates over exactly that
    # interval); a counter's rate covers only the span between its first and last reading.
    reading_covers_interval: bool = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "in_one_sample", not self.rate)
        object.__setattr__(self, "default_window_seconds", 0.0 if self.rate else None)
        object.__setattr__(self, "takes_window_function", not self.rate)
        object.__setattr__(self, "reading_covers_interval", not self.rate)

    @property
    def fields(self) -> tuple[str, ...]:
        """The sample fields it needs; an error on any of them makes it absent."""
        return (self.reading,) if self.of is None else (self.reading, self.of)

    @property
    def percent(self) -> bool:
        return self.unit == "%"


# KEDA's default metricType is AverageValue, where the HPA computes desired = ceil(value / target): the
# defaults sum with a per-replica target, over the pods (each pod's GPUs reduced by podAggregation, default avg)
# or, without a pod selection, over the GPUs (see profiles.py and docs/hpa.md). Temperature is the exception: a
# sum of temperatures means nothing, so it takes the max and is meant for `metricType: Value` or as a guard.
METRICS: Mapping[Metric, MetricInfo] = {
    Metric.GPU_UTILIZATION: MetricInfo(
        "%",
        "gpu_utilization_percent",
        None,
        0.0,
        MetricDefaults(Aggregation.SUM, 70.0, 5.0, "sum of SM busy %; one replica per 70% of a GPU"),
        per_process="sm_percent",
    ),
    Metric.MEMORY_UTILIZATION: MetricInfo(
        "%",
        "memory_utilization_percent",
        None,
        0.0,
        MetricDefaults(Aggregation.SUM, 60.0, 5.0, "sum of memory-controller busy %; bandwidth-bound work"),
        per_process="memory_utilization_percent",
    ),
    Metric.MEMORY_USED_PERCENT: MetricInfo(
        "%",
        "memory_used_bytes",
        "memory_total_bytes",
        0.0,
        MetricDefaults(Aggregation.SUM, 80.0, 1.0, "sum of VRAM used %; for jobs whose memory grows with load"),
        per_process="memory_used_bytes",
    ),
    Metric.TEMPERATURE: MetricInfo(
        "°C",
        "temperature_celsius",
        None,
        30.0,
        MetricDefaults(Aggregation.MAX, 80.0, 0.0, "hottest GPU; a guard, best with metricType Value"),
    ),
    Metric.POWER_DRAW: MetricInfo(
        "W",
        "power_draw_watts",
        None,
        60.0,
        MetricDefaults(Aggregation.SUM, 300.0, 0.0, "sum of watts; set the target to a share of your GPU's limit"),
    ),
    Metric.POWER_PERCENT: MetricInfo(
        "%",
        "power_draw_watts",
        "power_limit_watts",
        None,
        MetricDefaults(
            Aggregation.SUM, 70.0, 0.0, "sum of % of each GPU's enforced power limit; portable across models"
        ),
    ),
    # GPM (Hopper and newer): what share of the GPU works, where gpu_utilization says only whether anything does.
    Metric.SM_ACTIVE: MetricInfo(
        "%",
        "sm_active_percent",
        None,
        0.0,
        MetricDefaults(
            Aggregation.SUM, 60.0, 5.0, "sum of SM-active %: the share of SMs at work, not the duty cycle; GPM"
        ),
    ),
    Metric.SM_OCCUPANCY: MetricInfo(
        "%",
        "sm_occupancy_percent",
        None,
        0.0,
        MetricDefaults(Aggregation.SUM, 50.0, 5.0, "sum of warp occupancy %: how full the busy SMs are; GPM"),
    ),
    Metric.TENSOR_ACTIVE: MetricInfo(
        "%",
        "tensor_active_percent",
        None,
        0.0,
        MetricDefaults(Aggregation.SUM, 50.0, 5.0, "sum of tensor-core active %: matrix math, the work of AI; GPM"),
    ),
    Metric.DRAM_BANDWIDTH: MetricInfo(
        "%",
        "dram_bandwidth_percent",
        None,
        0.0,
        MetricDefaults(
            Aggregation.SUM, 60.0, 5.0, "sum of DRAM bandwidth %: what bounds LLM decoding and other memory-bound work"
        ),
    ),
    Metric.POWER_AVERAGE: MetricInfo(
        "W",
        "energy_joules",
        None,
        None,
        MetricDefaults(
            Aggregation.SUM, 300.0, 0.0, "sum of each GPU's average watts over the window, from its energy counter"
        ),
        rate=True,
    ),
    # Interconnect traffic, per physical GPU: GPM on Hopper and newer, NVML's older calls before it. A sum over
    # GPUs with a per-replica target, as for the percentages: each replica's GPUs move their share of the bytes.
    Metric.PCIE_TX: MetricInfo(
        "MB/s",
        "pcie_tx_megabytes_per_second",
        None,
        0.0,
        MetricDefaults(
            Aggregation.SUM,
            10000.0,
            1000.0,
            "sum of MB/s sent over PCIe; 10000 is a third of a Gen4 x16 link: busy, not saturated",
        ),
    ),
    Metric.PCIE_RX: MetricInfo(
        "MB/s",
        "pcie_rx_megabytes_per_second",
        None,
        0.0,
        MetricDefaults(
            Aggregation.SUM,
            10000.0,
            1000.0,
            "sum of MB/s received over PCIe (input pipelines); 10000 is a third of a Gen4 x16 link",
        ),
    ),
    Metric.NVLINK_TX: MetricInfo(
        "MB/s",
        "nvlink_tx_megabytes_per_second",
        None,
        0.0,
        MetricDefaults(
            Aggregation.SUM,
            50000.0,
            5000.0,
            "sum of MB/s sent over NVLink: collective traffic in data- and tensor-parallel training; the prior "
            "art's target",
        ),
    ),
    Metric.NVLINK_RX: MetricInfo(
        "MB/s",
        "nvlink_rx_megabytes_per_second",
        None,
        0.0,
        MetricDefaults(
            Aggregation.SUM,
            50000.0,
            5000.0,
            "sum of MB/s received over NVLink: the other half of nvlink_tx's collective traffic",
        ),
    ),
}
