"""Every GPU metric, once: the readings a sample holds, and the metrics a trigger can scale on.

A *reading* is one value NVML gives per device: a field of ``GpuSample`` with its unit in the name, the NVML
call it comes from, and its Prometheus series. A *metric* is what trigger metadata names: computed from one
reading or two, with its unit, what a fake GPU reads when idle, and the defaults a trigger that names only
the metric gets. The collectors, the fake GPUs, the scenario files, /metrics, the profiles and the docs'
tables (checked by tests) all read these two tables; a new metric is one entry in each.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass

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


# NVML_GPM_METRIC_* ids (nvml.h); named here so that the collector and the fake NVML share them.
GPM_GRAPHICS_UTIL = 1
GPM_SM_UTIL = 2
GPM_SM_OCCUPANCY = 3
GPM_ANY_TENSOR_UTIL = 5
GPM_DRAM_BW_UTIL = 10


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
)
READING_FIELDS: tuple[str, ...] = tuple(reading.field for reading in READINGS)
GPM_READINGS: tuple[Reading, ...] = tuple(reading for reading in READINGS if reading.gpm_metric is not None)


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
    # sample has no value; the evaluation takes it over the window (``rates.py``).
    rate: bool = False
    # The ``ProcessUsage`` field that gives one pod's own share of a shared GPU (``shares.py``); None when
    # NVML has no per-process figure for it and a pod reads the whole GPU's value.
    per_process: str | None = None

    @property
    def fields(self) -> tuple[str, ...]:
        """The sample fields it needs; an error on any of them makes it absent."""
        return (self.reading,) if self.of is None else (self.reading, self.of)

    @property
    def percent(self) -> bool:
        return self.unit == "%"


# KEDA's default metricType is AverageValue, where the HPA computes desired = ceil(value / target): the
# defaults sum over GPUs with a per-GPU target (see profiles.py). Temperature is the exception: a sum of
# temperatures means nothing, so it takes the max and is meant for `metricType: Value` or as a guard.
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
}
