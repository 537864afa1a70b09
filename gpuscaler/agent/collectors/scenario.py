"""Fake GPU scenarios: per-GPU values, constant or shaped over time, from a small YAML or JSON file.

    defaults:                      # every GPU; optional
      memory_total_bytes: 85899345920
      power_limit_watts: 700
      values: {gpu_utilization: 10}
    gpus:                          # by index, each below --fake-gpus; optional
      0:
        uuid: GPU-busy-0           # default GPU-fake-<node>-<index>
        name: Fake GPU
        minor: 0                   # its /dev/nvidiaN number; default: counted down from the last index
        values:
          gpu_utilization: {shape: sine, min: 20, max: 95, period: 120s}
          power_draw: {shape: square, low: 120, high: 600, period: 30s}
          temperature: {shape: ramp, from: 35, to: 80, duration: 5m}
          memory_utilization: {shape: triangle, min: 5, max: 70, period: 60s}
          memory_used_percent: 40
          sm_active: {shape: sine, min: 10, max: 60, period: 120s}    # GPM metrics, as on Hopper
          tensor_active: 30
          nvlink_tx: {shape: square, low: 0, high: 80000, period: 20s}  # MB/s, as pcie_tx, pcie_rx, nvlink_rx
      1:
        minor: 1                   # DRA names its instances gpu-1-mig-1g10gb-19-0 and gpu-1-mig-3g40gb-9-4
        values: {temperature: 60}  # a GPU in MIG mode: its instances read its temperature
        mig:                       # MIG mode: the GPU is enumerated as these instances in place of itself
          - profile: 1g.10gb       # as NVIDIA writes it (<n>g.<m>gb, optionally +me and the like)
            profile_id: 19         # GPU instance profile id (nvmlGpuInstanceGetInfo's profileId)
            placement_start: 0     # its first memory slice
            gpu_instance_id: 7     # default: 1 + its position in the list
            uuid: MIG-busy-1-0     # default MIG-fake-<node>-<index>-<position>
            values: {gpu_utilization: 80, memory_used_percent: 50}
          - {profile: 3g.40gb, profile_id: 9, placement_start: 4}

Shapes take their time from the agent's start. Every error names the path of the bad entry. ``power_average``
is not set: it is computed from the energy counter, which a fake GPU counts from its power draw.

A GPU with ``mig`` is in MIG mode, as NVML enumerates one: each instance is a device of the GPU's index and minor
number, ``<name> MIG <profile>``, with ``<m>`` GiB of memory (at most the GPU's). An instance reads what
docs/mig.md says a MIG instance has: its own ``values`` (over the defaults' and an idle GPU's) of
``gpu_utilization``, ``memory_used_percent`` and the GPM metrics, and its GPU's temperature; power, energy,
``memory_utilization`` and PCIe/NVLink traffic are absent. ``mig: []`` is MIG mode with no instance made yet.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpuscaler.agent.collectors.shapes import Constant, Ramp, Shape, Sine, Square, Triangle
from gpuscaler.model.durations import parse_duration
from gpuscaler.model.errors import ConfigError
from gpuscaler.model.gpu_metrics import METRICS, Metric

DEFAULT_MEMORY_TOTAL_BYTES = 80 * 1024**3
DEFAULT_POWER_LIMIT_WATTS = 700.0
FAKE_GPU_NAME = "Fake GPU"
MAX_MINOR = 254  # /dev/nvidia255 is nvidiactl
# A MIG profile as NVIDIA writes it: ``1g.10gb``, ``1c.2g.20gb``, ``1g.10gb+me``, ``1g.24gb+me.all``, ``1g.12gb-me``.
MIG_PROFILE = re.compile(r"^(?:[0-9]+c\.)?[0-9]+g\.([0-9]+)gb(?:[+-][a-z][a-z0-9]*(?:\.[a-z][a-z0-9]*)*)*$")
# What a MIG instance reads of its own (docs/mig.md): its temperature is its GPU's, and power, energy, memory
# controller time and PCIe/NVLink traffic are the physical GPU's alone.
MIG_METRICS = frozenset(
    {
        Metric.GPU_UTILIZATION,
        Metric.MEMORY_USED_PERCENT,
        Metric.SM_ACTIVE,
        Metric.SM_OCCUPANCY,
        Metric.TENSOR_ACTIVE,
        Metric.DRAM_BANDWIDTH,
    }
)

# An idle GPU: nothing running, a cool die, idle board power (power_percent is computed from power_draw).
IDLE_VALUES: Mapping[Metric, float] = {
    metric: info.fake_idle for metric, info in METRICS.items() if info.fake_idle is not None
}


@dataclass(frozen=True, slots=True)
class MigScenario:
    """One MIG instance of a fake GPU in MIG mode: its profile, placement, GPU instance id and own values."""

    profile: str
    profile_id: int
    placement_start: int
    gpu_instance_id: int
    uuid: str | None = None
    values: Mapping[Metric, Shape] = field(default_factory=dict)

    @property
    def memory_gibibytes(self) -> int:
        """The ``<m>`` of its profile's ``<n>g.<m>gb``."""
        match = MIG_PROFILE.match(self.profile)
        assert match is not None  # checked when parsed
        return int(match.group(1))


@dataclass(frozen=True, slots=True)
class GpuScenario:
    """What one fake GPU starts as; unset fields fall back to the defaults, then to an idle GPU."""

    uuid: str | None = None
    name: str | None = None
    minor: int | None = None
    memory_total_bytes: int | None = None
    power_limit_watts: float | None = None
    values: Mapping[Metric, Shape] = field(default_factory=dict)
    # MIG mode's instances, in slot order; None: not in MIG mode (an empty tuple is MIG mode with none made yet).
    mig: tuple[MigScenario, ...] | None = None


@dataclass(frozen=True, slots=True)
class Scenario:
    """A checked scenario file: what every GPU starts as, and the GPUs that differ, by index."""

    defaults: GpuScenario = field(default_factory=GpuScenario)
    gpus: Mapping[int, GpuScenario] = field(default_factory=dict)


def load_scenario(path: Path, *, gpu_count: int) -> Scenario:
    """Read and check a scenario file; ConfigError names the file and the bad entry."""
    import yaml  # only here: the agent starts faster and smaller without it

    try:
        document = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as error:
        raise ConfigError(f"--fake-scenario {str(path)!r}: cannot read: {error.strerror}") from None
    except yaml.YAMLError as error:
        raise ConfigError(f"--fake-scenario {str(path)!r}: not YAML or JSON: {error}") from None
    try:
        return parse_scenario(document, gpu_count=gpu_count)
    except ConfigError as error:
        raise ConfigError(f"--fake-scenario {str(path)!r}: {error}") from None


def parse_scenario(document: Any, *, gpu_count: int) -> Scenario:
    """Check a loaded YAML or JSON document (None: no scenario); ConfigError names the path of the bad entry."""
    if document is None:
        return Scenario()
    root = _mapping(document, "the file", {"defaults", "gpus"})
    defaults = _gpu(root.get("defaults"), "defaults", identity=False)
    gpus: dict[int, GpuScenario] = {}
    for key, entry in _mapping(root.get("gpus", {}), "gpus", None).items():
        index = _gpu_index(key, gpu_count)
        gpus[index] = _gpu(entry, f"gpus.{index}", identity=True)
    scenario = Scenario(defaults=defaults, gpus=gpus)
    holders: dict[int, int] = {}
    for index in range(gpu_count):
        minor = fake_minor(scenario, index, gpu_count)
        if minor in holders:
            raise ConfigError(
                f"gpus.{index}.minor {minor} is GPU {holders[minor]}'s minor number too (unset, a GPU's is "
                f"{gpu_count - 1} minus its index); give each GPU its own"
            )
        holders[minor] = index
    _check_mig_uuids(scenario)
    return scenario


def _check_mig_uuids(scenario: Scenario) -> None:
    """No two devices share a UUID: each MIG instance's set UUID is its own."""
    owners = {gpu.uuid: f"gpus.{index}.uuid" for index, gpu in scenario.gpus.items() if gpu.uuid is not None}
    for index, gpu in sorted(scenario.gpus.items()):
        for slot, instance in enumerate(gpu.mig or ()):
            if instance.uuid is None:
                continue
            path = f"gpus.{index}.mig.{slot}.uuid"
            if instance.uuid in owners:
                raise ConfigError(
                    f"{path} {instance.uuid!r} is {owners[instance.uuid]}'s too; give each device its own"
                )
            owners[instance.uuid] = path


def fake_minor(scenario: Scenario, index: int, gpu_count: int) -> int:
    """GPU ``index``'s minor number: the scenario's, or counted down from the last index (so it differs from it)."""
    own = scenario.gpus.get(index)
    return own.minor if own is not None and own.minor is not None else gpu_count - 1 - index


def parse_value(metric_name: str, text: str) -> tuple[Metric, float]:
    """One ``METRIC=VALUE`` from the command line, checked like a scenario constant."""
    metric = _metric(metric_name, "METRIC")
    return metric, _number(text, f"{metric.value}", metric)


def _gpu(document: Any, path: str, *, identity: bool) -> GpuScenario:
    if document is None:
        return GpuScenario()
    allowed = {"memory_total_bytes", "power_limit_watts", "values"} | (
        {"uuid", "name", "minor", "mig"} if identity else set()
    )
    entry = _mapping(document, path, allowed)
    values = _values(entry.get("values", {}), f"{path}.values")
    if Metric.POWER_DRAW in values and Metric.POWER_PERCENT in values:
        raise ConfigError(f"{path}.values sets both power_draw and power_percent; set one")
    return GpuScenario(
        uuid=_string(entry["uuid"], f"{path}.uuid") if "uuid" in entry else None,
        name=_string(entry["name"], f"{path}.name") if "name" in entry else None,
        minor=_minor(entry["minor"], f"{path}.minor") if "minor" in entry else None,
        memory_total_bytes=(
            int(_positive(entry["memory_total_bytes"], f"{path}.memory_total_bytes"))
            if "memory_total_bytes" in entry
            else None
        ),
        power_limit_watts=(
            _positive(entry["power_limit_watts"], f"{path}.power_limit_watts") if "power_limit_watts" in entry else None
        ),
        values=values,
        mig=_mig(entry["mig"], f"{path}.mig") if "mig" in entry else None,
    )


def _values(document: Any, path: str) -> dict[Metric, Shape]:
    values: dict[Metric, Shape] = {}
    for name, spec in _mapping(document, path, None).items():
        metric = _metric(name, path)
        values[metric] = _shape(spec, f"{path}.{metric.value}", metric)
    return values


def _mig(document: Any, path: str) -> tuple[MigScenario, ...]:
    if not isinstance(document, list):
        raise ConfigError(f"{path} must be a list of MIG instances, not {type(document).__name__}")
    instances: list[MigScenario] = []
    placements: dict[tuple[int, int], int] = {}
    instance_ids: dict[int, int] = {}
    for slot, item in enumerate(document):
        here = f"{path}.{slot}"
        entry = _mapping(item, here, {"profile", "profile_id", "placement_start", "gpu_instance_id", "uuid", "values"})
        missing = [key for key in ("profile", "profile_id", "placement_start") if key not in entry]
        if missing:
            raise ConfigError(f"{here} lacks {', '.join(missing)}")
        profile = entry["profile"]
        if not isinstance(profile, str) or not MIG_PROFILE.match(profile):
            raise ConfigError(
                f"{here}.profile {profile!r} is not a MIG profile; write it as NVIDIA does: <n>g.<m>gb, "
                "optionally with a suffix such as +me (1g.10gb, 3g.40gb, 1g.10gb+me)"
            )
        profile_id = _whole(entry["profile_id"], f"{here}.profile_id")
        start = _whole(entry["placement_start"], f"{here}.placement_start")
        if (profile_id, start) in placements:
            other = f"{path}.{placements[profile_id, start]}"
            raise ConfigError(
                f"{here} (profile_id {profile_id}, placement_start {start}) is {other}'s placement too; a GPU holds "
                "one instance per profile and placement"
            )
        placements[profile_id, start] = slot
        gpu_instance_id = (
            _whole(entry["gpu_instance_id"], f"{here}.gpu_instance_id") if "gpu_instance_id" in entry else slot + 1
        )
        if gpu_instance_id in instance_ids:
            raise ConfigError(
                f"{here}.gpu_instance_id {gpu_instance_id} is {path}.{instance_ids[gpu_instance_id]}'s too (unset, it "
                "is 1 + the position in the list); give each instance on a GPU its own"
            )
        instance_ids[gpu_instance_id] = slot
        uuid = None
        if "uuid" in entry:
            uuid = _string(entry["uuid"], f"{here}.uuid")
            if not uuid.startswith("MIG-"):
                raise ConfigError(f"{here}.uuid {uuid!r} must start with 'MIG-', as NVML's MIG instance UUIDs do")
        values = _values(entry.get("values", {}), f"{here}.values")
        for metric in values:
            if metric not in MIG_METRICS:
                raise ConfigError(
                    f"{here}.values.{metric.value}: a MIG instance has no {metric.value} of its own (docs/mig.md); "
                    f"set one of: {', '.join(sorted(m.value for m in MIG_METRICS))}"
                    + ("; its temperature is its GPU's" if metric is Metric.TEMPERATURE else "")
                )
        instances.append(
            MigScenario(
                profile=profile,
                profile_id=profile_id,
                placement_start=start,
                gpu_instance_id=gpu_instance_id,
                uuid=uuid,
                values=values,
            )
        )
    return tuple(instances)


_SHAPE_FIELDS = {
    "sine": ({"min", "max", "period"}, {"phase"}),
    "square": ({"low", "high", "period"}, set()),
    "triangle": ({"min", "max", "period"}, set()),
    "ramp": ({"from", "to", "duration"}, set()),
}


def _shape(spec: Any, path: str, metric: Metric) -> Shape:
    if not isinstance(spec, Mapping):
        return Constant(_number(spec, path, metric))
    kind = spec.get("shape")
    if kind not in _SHAPE_FIELDS:
        raise ConfigError(f"{path}.shape {kind!r} is not allowed; use one of: {', '.join(_SHAPE_FIELDS)}")
    required, optional = _SHAPE_FIELDS[kind]
    _mapping(spec, path, required | optional | {"shape"})
    missing = sorted(required - set(spec))
    if missing:
        raise ConfigError(f"{path} ({kind}) lacks {', '.join(missing)}")

    def number(key: str) -> float:
        return _number(spec[key], f"{path}.{key}", metric)

    def seconds(key: str) -> float:
        text = str(spec[key])
        try:
            value = parse_duration(text)
        except ValueError as error:
            raise ConfigError(f"{path}.{key} {error}") from None
        if value <= 0:
            raise ConfigError(f"{path}.{key} {text!r} must be longer than 0")
        return value

    if kind == "sine":
        phase = seconds("phase") if "phase" in spec else 0.0
        return Sine(number("min"), number("max"), seconds("period"), phase)
    if kind == "square":
        return Square(number("low"), number("high"), seconds("period"))
    if kind == "triangle":
        return Triangle(number("min"), number("max"), seconds("period"))
    return Ramp(number("from"), number("to"), seconds("duration"))


def _mapping(document: Any, path: str, allowed: set[str] | None) -> Mapping[Any, Any]:
    if not isinstance(document, Mapping):
        raise ConfigError(f"{path} must be a mapping, not {type(document).__name__}")
    if allowed is not None:
        unknown = sorted(str(key) for key in document if key not in allowed)
        if unknown:
            raise ConfigError(f"{path} has unknown key {unknown[0]!r}; allowed: {', '.join(sorted(allowed))}")
    return document


def _metric(name: Any, path: str) -> Metric:
    settable = [metric.value for metric, info in METRICS.items() if info.in_one_sample]
    try:
        metric = Metric(name)
    except ValueError:
        raise ConfigError(f"{path}: {name!r} is not a metric; use one of: {', '.join(settable)}") from None
    if not METRICS[metric].in_one_sample:
        raise ConfigError(
            f"{path}: {name!r} is computed from the energy counter, which a fake GPU counts from its power draw; "
            "set power_draw or power_percent"
        )
    return metric


def _number(value: Any, path: str, metric: Metric) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ConfigError(f"{path} {value!r} is not a number")
    try:
        number = float(value)
    except ValueError:
        raise ConfigError(f"{path} {value!r} is not a number") from None
    if not math.isfinite(number) or number < 0:
        raise ConfigError(f"{path} {value!r} must be a finite number >= 0")
    if METRICS[metric].percent and number > 100:
        raise ConfigError(f"{path} {value!r} is a percentage; it must be between 0 and 100")
    return number


def _positive(value: Any, path: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{path} {value!r} is not a number")
    if not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{path} {value!r} must be a finite number > 0")
    return float(value)


def _string(value: Any, path: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{path} {value!r} must be a non-empty string")
    return value.strip()


def _gpu_index(key: Any, gpu_count: int) -> int:
    try:
        index = int(key)
    except (TypeError, ValueError):
        raise ConfigError(f"gpus key {key!r} is not a GPU index") from None
    if not 0 <= index < gpu_count:
        raise ConfigError(f"gpus.{index} is out of range; --fake-gpus {gpu_count} gives indices 0-{gpu_count - 1}")
    return index


def _whole(value: Any, path: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{path} {value!r} must be a whole number >= 0")
    return value


def _minor(value: Any, path: str) -> int:
    # /dev/nvidiaN: the driver numbers at most a few hundred GPUs per node, and device names print it in decimal.
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_MINOR:
        raise ConfigError(f"{path} {value!r} must be a whole number from 0 to {MAX_MINOR}")
    return value
