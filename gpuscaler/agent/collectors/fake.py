"""Fake GPUs that behave like NVML ones: values from a scenario or set live, and NVML's failures on demand.

A ``timeout`` failure blocks the read the way a hung NVML call blocks its thread, so the poll loop's
timeout path is the one under test, not a shortcut. A fake GPU is a Hopper with NVLink: its GPM metrics,
PCIe and NVLink traffic included, are absent on its first read (and on the first after it was lost), as
NVML's rates between two samples are; the energy counter grows by the power drawn between two reads.

A fake GPU's minor number (``/dev/nvidiaN``, which the kubelet's device names use) counts down from the last index
unless its scenario sets ``minor``: on a node of several fake GPUs, minor and index differ, as they do on GPUs the
driver renumbered, so attribution that confuses the two shows in the dev stack and the tests.

A GPU whose scenario has ``mig`` is in MIG mode: it is enumerated as its MIG instances in place of itself, as NVML
enumerates one, with what docs/mig.md says an instance reads (its GPM metrics, so its utilisation too, absent on its
first read; its GPU's temperature; no power, energy, memory-controller time or traffic of its own). The live
controls take the GPU's index and act on its instances too, so a test sets an instance's load by its GPU's index.
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
    MIG_METRICS,
    GpuScenario,
    MigScenario,
    Scenario,
    fake_minor,
)
from gpuscaler.agent.collectors.shapes import Constant, Shape
from gpuscaler.model.gpu_metrics import GPM_READINGS, METRICS, READING_FIELDS, Metric
from gpuscaler.model.samples import DEVICE_FIELD, GpuIdentity, GpuSample, ReadError, ReadErrorKind

# A hung read gives up after this long even if nobody heals it, so no thread is stuck forever.
HUNG_READ_LIMIT_SECONDS = 60.0
# Each GPM reading with the metric a scenario sets it by.
_GPM_METRICS = tuple(
    (metric, reading) for reading in GPM_READINGS for metric, info in METRICS.items() if info.reading == reading.field
)
# A MIG instance's GPM readings (its traffic is its GPU's), and the readings it has none of, with NVML's reasons.
_MIG_GPM_METRICS = tuple((metric, reading) for metric, reading in _GPM_METRICS if metric in MIG_METRICS)
_MIG_ABSENT = (
    (("power_draw_watts", "power_limit_watts"), "power is measured per physical GPU, not per MIG instance"),
    (("energy_joules",), "energy is counted per physical GPU, not per MIG instance"),
    (("memory_utilization_percent",), "memory-controller time is not reported per MIG instance"),
    (
        tuple(reading.field for metric, reading in _GPM_METRICS if metric not in MIG_METRICS),
        "PCIe and NVLink traffic is measured per physical GPU, not per MIG instance",
    ),
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
    # A GPU in MIG mode: its instances, enumerated in its place; None when not in MIG mode.
    instances: list[FakeGpu] | None = None
    parent: FakeGpu | None = None  # a MIG instance's GPU, whose temperature it reads


class FakeCollector:
    """``gpu_count`` fake GPUs on ``node``, shaped by ``scenario``; safe to set from another thread."""

    def __init__(self, *, node: str, gpu_count: int, scenario: Scenario | None = None) -> None:
        self._node = node
        self._started = time.monotonic()
        self._lock = threading.Lock()
        scenario = scenario or Scenario()
        self._gpus = [self._build(index, gpu_count, scenario) for index in range(gpu_count)]
        # Every device a read may name, by UUID: an index holds several in MIG mode.
        self._devices = {device.identity.uuid: device for gpu in self._gpus for device in self._enumerated(gpu)}
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
        gpu = FakeGpu(
            identity=GpuIdentity(index=index, uuid=uuid, name=name, minor=minor),
            memory_total_bytes=(own and own.memory_total_bytes)
            or defaults.memory_total_bytes
            or DEFAULT_MEMORY_TOTAL_BYTES,
            power_limit_watts=(own and own.power_limit_watts)
            or defaults.power_limit_watts
            or DEFAULT_POWER_LIMIT_WATTS,
            shapes=shapes,
        )
        if own is not None and own.mig is not None:
            gpu.instances = [self._build_instance(gpu, slot, spec, defaults) for slot, spec in enumerate(own.mig)]
        return gpu

    def _build_instance(self, gpu: FakeGpu, slot: int, spec: MigScenario, defaults: GpuScenario) -> FakeGpu:
        """MIG instance ``slot`` of ``gpu``: the metrics an instance has, idle, then the defaults', then its own."""
        shapes: dict[Metric, Shape] = {
            metric: shape
            for source in (
                {metric: Constant(value) for metric, value in IDLE_VALUES.items()},
                defaults.values,
                spec.values,
            )
            for metric, shape in source.items()
            if metric in MIG_METRICS
        }
        parent = gpu.identity
        identity = GpuIdentity(
            index=parent.index,
            uuid=spec.uuid or f"MIG-fake-{self._node}-{parent.index}-{slot}",
            name=f"{parent.name} MIG {spec.profile}",
            mig_parent_uuid=parent.uuid,
            minor=parent.minor,
            gpu_instance_id=spec.gpu_instance_id,
            gpu_instance_profile_id=spec.profile_id,
            placement_start=spec.placement_start,
            mig_slot=slot,
        )
        return FakeGpu(
            identity=identity,
            memory_total_bytes=min(spec.memory_gibibytes * 1024**3, gpu.memory_total_bytes),
            power_limit_watts=gpu.power_limit_watts,
            shapes=shapes,
            parent=gpu,
        )

    @staticmethod
    def _enumerated(gpu: FakeGpu) -> list[FakeGpu]:
        """What NVML enumerates for ``gpu``: its MIG instances in MIG mode, else itself."""
        return gpu.instances if gpu.instances is not None else [gpu]

    @property
    def node(self) -> str:
        return self._node

    def open(self) -> None:
        pass

    def close(self) -> None:
        self.heal(None)  # release any read blocked in a simulated hang

    def discover(self) -> Sequence[GpuIdentity]:
        return [device.identity for gpu in self._gpus for device in self._enumerated(gpu)]

    def read(self, gpu: GpuIdentity) -> GpuSample:
        fake = self._devices[gpu.uuid]
        with self._lock:
            self.reads_started += 1
            failure = fake.failure
            healed = fake.healed
            values = self._values_locked(fake)
            if fake.parent is not None:  # one die, one sensor
                values[Metric.TEMPERATURE] = self._values_locked(fake.parent)[Metric.TEMPERATURE]
            first_gpm = not fake.gpm_primed
            if failure is None:
                fake.gpm_primed = True
            elif failure is Failure.LOST:
                fake.gpm_primed = False  # the collector frees a lost GPU's GPM samples
            if failure is None and fake.parent is None:
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
        if fake.parent is not None:
            return self._read_instance(gpu, fake, values, first_gpm)
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

    def _read_instance(
        self, gpu: GpuIdentity, fake: FakeGpu, values: Mapping[Metric, float], first_gpm: bool
    ) -> GpuSample:
        """A MIG instance's sample: its own utilisation (GPM's, so a rate), memory and GPM, its GPU's temperature."""
        errors = [
            ReadError(name, ReadErrorKind.NOT_SUPPORTED, f"{reason} (fake)")
            for names, reason in _MIG_ABSENT
            for name in names
        ]
        # Any: the fields are named at run time, from the metric table.
        gpm: dict[str, Any] = {reading.field: values[metric] for metric, reading in _MIG_GPM_METRICS}
        utilization: float | None = values[Metric.GPU_UTILIZATION]
        if first_gpm:
            # NVML has no utilisation per instance; the collector reads GPM's graphics activity, a rate too.
            gpm, utilization = {}, None
            errors.extend(
                ReadError(
                    name,
                    ReadErrorKind.OTHER,
                    f"GPM metrics are rates between two samples, and this is gpu {gpu.index}'s first: they are "
                    "read from the next tick on (fake)",
                )
                for name in ("gpu_utilization_percent", *(reading.field for _, reading in _MIG_GPM_METRICS))
            )
        sample = GpuSample(
            gpu=gpu,
            node=self._node,
            gpu_utilization_percent=utilization,
            memory_used_bytes=round(values[Metric.MEMORY_USED_PERCENT] / 100.0 * fake.memory_total_bytes),
            memory_total_bytes=fake.memory_total_bytes,
            temperature_celsius=values[Metric.TEMPERATURE],
            errors=tuple(errors),
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
        """Replace the shapes of ``values``' metrics with constants, on one GPU or all (index None).

        A GPU in MIG mode and its instances alike: each instance takes the metrics it has of its own.
        """
        with self._lock:
            for fake in self._select(index):
                if fake.parent is not None:
                    fake.shapes.update({m: Constant(value) for m, value in values.items() if m in MIG_METRICS})
                    continue
                if Metric.POWER_PERCENT in values:
                    fake.shapes.pop(Metric.POWER_DRAW, None)
                if Metric.POWER_DRAW in values:
                    fake.shapes.pop(Metric.POWER_PERCENT, None)
                fake.shapes.update({metric: Constant(value) for metric, value in values.items()})

    def fail(self, index: int, failure: Failure) -> None:
        """Make GPU ``index``'s reads fail (a GPU in MIG mode: each of its instances')."""
        with self._lock:
            for fake in self._select(index):
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
        """Each enumerated device's values and failure (a MIG instance's: its own, and its GPU's temperature)."""
        with self._lock:
            states = []
            for gpu in self._gpus:
                for fake in self._enumerated(gpu):
                    values = self._values_locked(fake)
                    if fake.parent is not None:
                        values[Metric.TEMPERATURE] = self._values_locked(fake.parent)[Metric.TEMPERATURE]
                    states.append((fake.identity, values, fake.failure))
            return states

    def _select(self, index: int | None) -> list[FakeGpu]:
        """GPU ``index`` (every GPU for None) and, in MIG mode, its instances."""
        if index is None:
            gpus = self._gpus
        elif not 0 <= index < len(self._gpus):
            raise IndexError(f"gpu {index} is out of range; this agent has GPUs 0-{len(self._gpus) - 1}")
        else:
            gpus = [self._gpus[index]]
        return [device for gpu in gpus for device in (gpu, *(gpu.instances or ()))]
