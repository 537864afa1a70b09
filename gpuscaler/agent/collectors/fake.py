"""Fake GPUs that behave like NVML ones: values from a scenario or set live, and NVML's failures on demand.

A ``timeout`` failure blocks the read the way a hung NVML call blocks its thread, so the poll loop's
timeout path is the one under test, not a shortcut. A fake GPU is a Hopper with NVLink: its GPM metrics,
PCIe and NVLink traffic included, are absent on its first read (and on the first after it was lost), as
NVML's rates between two samples are; the energy counter grows by the power drawn between two reads.

A fake GPU's minor number (``/dev/nvidiaN``, which the kubelet's device names use) counts down from the last index
unless its scenario sets ``minor``: on a node of several fake GPUs, minor and index differ, as they do on GPUs the
driver renumbered, so attribution that confuses the two shows in the dev stack and the tests.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gpuscaler.agent.collectors.scenario import (
    DEFAULT_MEMORY_TOTAL_BYTES,
    DEFAULT_POWER_LIMIT_WATTS,
    FAKE_GPU_NAME,
    IDLE_VALUES,
    Constant,
    Scenario,
    Shape,
    fake_minor,
)
from gpuscaler.model.gpu_metrics import GPM_READINGS, METRICS, READING_FIELDS, Metric
from gpuscaler.model.samples import DEVICE_FIELD, GpuIdentity, GpuSample, ReadError, ReadErrorKind

# A hung read gives up after this long even if nobody heals it, so no thread is stuck forever.
HUNG_READ_LIMIT_SECONDS = 60.0
# Each GPM reading with the metric a scenario sets it by.
_GPM_METRICS = tuple(
    (metric, reading) for reading in GPM_READINGS for metric, info in METRICS.items() if info.reading == reading.field
)


class Failure(enum.Enum):
    """How a fake GPU's reads fail, as NVML's do: the GPU lost, every reading not supported, or a hung call."""

    LOST = "lost"
    NOT_SUPPORTED = "not_supported"
    TIMEOUT = "timeout"


@dataclass(slots=True)
class FakeGpu:
    """One fake GPU's live state: its identity, the shape of each value, any failure, its energy and GPM counters."""

    identity: GpuIdentity
    memory_total_bytes: int
    power_limit_watts: float
    shapes: dict[Metric, Shape]
    failure: Failure | None = None
    healed: threading.Event = field(default_factory=threading.Event)
    energy_joules: float = 0.0
    energy_read_at: float | None = None  # monotonic seconds of the last read that counted energy
    gpm_primed: bool = False  # a previous GPM sample exists


class FakeCollector:
    """``gpu_count`` fake GPUs on ``node``, shaped by ``scenario``; safe to set from another thread."""

    def __init__(self, *, node: str, gpu_count: int, scenario: Scenario | None = None) -> None:
        self._node = node
        self._started = time.monotonic()
        self._lock = threading.Lock()
        scenario = scenario or Scenario()
        self._gpus = [self._build(index, gpu_count, scenario) for index in range(gpu_count)]
        self.reads_started = 0  # for tests that need to know a read is under way

    def _build(self, index: int, gpu_count: int, scenario: Scenario) -> FakeGpu:
        own = scenario.gpus.get(index)
        defaults = scenario.defaults
        shapes: dict[Metric, Shape] = {metric: Constant(value) for metric, value in IDLE_VALUES.items()}
        for source in (defaults, own):
            if source is None:
                continue
            if Metric.POWER_PERCENT in source.values:
                shapes.pop(Metric.POWER_DRAW, None)
            if Metric.POWER_DRAW in source.values:
                shapes.pop(Metric.POWER_PERCENT, None)
            shapes.update(source.values)
        uuid = (own.uuid if own else None) or f"GPU-fake-{self._node}-{index}"
        name = (own.name if own else None) or FAKE_GPU_NAME
        minor = fake_minor(scenario, index, gpu_count)
        return FakeGpu(
            identity=GpuIdentity(index=index, uuid=uuid, name=name, minor=minor),
            memory_total_bytes=(own and own.memory_total_bytes)
            or defaults.memory_total_bytes
            or DEFAULT_MEMORY_TOTAL_BYTES,
            power_limit_watts=(own and own.power_limit_watts)
            or defaults.power_limit_watts
            or DEFAULT_POWER_LIMIT_WATTS,
            shapes=shapes,
        )

    @property
    def node(self) -> str:
        return self._node

    def open(self) -> None:
        pass

    def close(self) -> None:
        self.heal(None)  # release any read blocked in a simulated hang

    def discover(self) -> Sequence[GpuIdentity]:
        return [gpu.identity for gpu in self._gpus]

    def read(self, gpu: GpuIdentity) -> GpuSample:
        fake = self._gpus[gpu.index]
        with self._lock:
            self.reads_started += 1
            failure = fake.failure
            healed = fake.healed
            values = self._values_locked(fake)
            first_gpm = not fake.gpm_primed
            if failure is None:
                fake.gpm_primed = True
            elif failure is Failure.LOST:
                fake.gpm_primed = False  # the collector frees a lost GPU's GPM samples
            if failure is None:
                energy = self._count_energy_locked(fake, self._power(fake, values))
        if failure is Failure.TIMEOUT:
            healed.wait(HUNG_READ_LIMIT_SECONDS)
            return GpuSample(
                gpu=gpu,
                node=self._node,
                errors=(ReadError(DEVICE_FIELD, ReadErrorKind.TIMEOUT, "fake NVML call hung"),),
            )
        if failure is Failure.LOST:
            detail = f"nvmlDeviceGetUtilizationRates(gpu {gpu.index}): GPU is lost (fake)"
            return GpuSample(
                gpu=gpu, node=self._node, errors=(ReadError(DEVICE_FIELD, ReadErrorKind.GPU_LOST, detail),)
            )
        if failure is Failure.NOT_SUPPORTED:
            errors = tuple(
                ReadError(name, ReadErrorKind.NOT_SUPPORTED, f"gpu {gpu.index}: Not Supported (fake)")
                for name in READING_FIELDS
            )
            return GpuSample(gpu=gpu, node=self._node, errors=errors)
        used_percent = values[Metric.MEMORY_USED_PERCENT]
        # Any: the fields are named at run time, from the metric table.
        gpm: dict[str, Any] = {reading.field: values[metric] for metric, reading in _GPM_METRICS}
        gpm_errors: tuple[ReadError, ...] = ()
        if first_gpm:
            gpm = {}
            gpm_errors = tuple(
                ReadError(
                    reading.field,
                    ReadErrorKind.OTHER,
                    f"GPM metrics are rates between two samples, and this is gpu {gpu.index}'s first: they are "
                    "read from the next tick on (fake)",
                )
                for reading in GPM_READINGS
            )
        sample = GpuSample(
            gpu=gpu,
            node=self._node,
            gpu_utilization_percent=values[Metric.GPU_UTILIZATION],
            memory_utilization_percent=values[Metric.MEMORY_UTILIZATION],
            memory_used_bytes=round(used_percent / 100.0 * fake.memory_total_bytes),
            memory_total_bytes=fake.memory_total_bytes,
            temperature_celsius=values[Metric.TEMPERATURE],
            power_draw_watts=self._power(fake, values),
            power_limit_watts=fake.power_limit_watts,
            energy_joules=energy,
            errors=gpm_errors,
        )
        return sample._replace(**gpm)

    @staticmethod
    def _power(fake: FakeGpu, values: Mapping[Metric, float]) -> float:
        if Metric.POWER_PERCENT in values:
            return values[Metric.POWER_PERCENT] / 100.0 * fake.power_limit_watts
        return values[Metric.POWER_DRAW]

    def _count_energy_locked(self, fake: FakeGpu, watts: float) -> float:
        """The energy counter after ``watts`` drawn since the previous read (since the start, at the first)."""
        now = time.monotonic()
        fake.energy_joules += watts * (
            now - (fake.energy_read_at if fake.energy_read_at is not None else self._started)
        )
        fake.energy_read_at = now
        return fake.energy_joules

    def _values_locked(self, fake: FakeGpu) -> dict[Metric, float]:
        elapsed = time.monotonic() - self._started
        return {metric: shape.at(elapsed) for metric, shape in fake.shapes.items()}

    # Live control (the FakeControl gRPC service calls these).

    def set_values(self, index: int | None, values: Mapping[Metric, float]) -> None:
        """Replace the shapes of ``values``' metrics with constants, on one GPU or all (index None)."""
        with self._lock:
            for fake in self._select(index):
                if Metric.POWER_PERCENT in values:
                    fake.shapes.pop(Metric.POWER_DRAW, None)
                if Metric.POWER_DRAW in values:
                    fake.shapes.pop(Metric.POWER_PERCENT, None)
                fake.shapes.update({metric: Constant(value) for metric, value in values.items()})

    def fail(self, index: int, failure: Failure) -> None:
        with self._lock:
            fake = self._select(index)[0]
            fake.failure = failure
            # A read still hung from an earlier failure waits on the current event: keep it until heal sets it.
            if fake.healed.is_set():
                fake.healed = threading.Event()

    def heal(self, index: int | None) -> None:
        with self._lock:
            for fake in self._select(index):
                fake.failure = None
                fake.healed.set()

    def state(self) -> list[tuple[GpuIdentity, dict[Metric, float], Failure | None]]:
        with self._lock:
            return [(fake.identity, self._values_locked(fake), fake.failure) for fake in self._gpus]

    def _select(self, index: int | None) -> list[FakeGpu]:
        if index is None:
            return list(self._gpus)
        if not 0 <= index < len(self._gpus):
            raise IndexError(f"gpu {index} is out of range; this agent has GPUs 0-{len(self._gpus) - 1}")
        return [self._gpus[index]]
