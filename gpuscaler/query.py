"""A query: what one trigger asks of the GPUs, after metadata, profile and defaults were applied."""

from __future__ import annotations

import enum
import hashlib
from dataclasses import dataclass

from gpuscaler.durations import format_duration
from gpuscaler.samples import Metric


class Aggregation(enum.StrEnum):
    """How the selected GPUs' values combine into the one value KEDA gets."""

    MAX = "max"
    MIN = "min"
    AVG = "avg"
    SUM = "sum"
    MEDIAN = "median"
    P90 = "p90"
    P95 = "p95"
    P99 = "p99"


class WindowFunction(enum.StrEnum):
    """How one GPU's samples inside the window reduce to one value, before GPUs are combined."""

    AVG = "avg"
    MAX = "max"
    MIN = "min"
    LAST = "last"


@dataclass(frozen=True, slots=True)
class GpuSelection:
    """Which GPUs a query reads: all of the node's (both fields None), some indices, or some UUIDs."""

    indices: tuple[int, ...] | None = None
    uuids: tuple[str, ...] | None = None

    @property
    def everything(self) -> bool:
        return self.indices is None and self.uuids is None

    def describe(self) -> str:
        if self.indices is not None:
            return "gpuIndex " + ",".join(map(str, self.indices))
        if self.uuids is not None:
            return "gpuUUID " + ",".join(self.uuids)
        return "all GPUs"


@dataclass(frozen=True, slots=True)
class ValueQuery:
    """The part of a query that decides its value; queries equal here share one evaluation."""

    metric: Metric
    aggregation: Aggregation
    selection: GpuSelection
    window_seconds: float | None
    window_function: WindowFunction


@dataclass(frozen=True, slots=True)
class ActivationRule:
    """Hysteresis: active when value > activation, inactive again when value <= deactivation."""

    activation_threshold: float
    deactivation_threshold: float


@dataclass(frozen=True, slots=True)
class Query:
    """Everything a trigger's metadata means. Hashable: streams with equal queries share their work."""

    value: ValueQuery
    activation: ActivationRule
    target: float
    metric_name: str
    profile: str | None = None

    @property
    def activation_key(self) -> tuple[ValueQuery, ActivationRule]:
        """Queries with the same key share one activation state, whatever their names."""
        return (self.value, self.activation)


def default_metric_name(value: ValueQuery) -> str:
    """A stable, lowercase, URL-safe name that tells what the value is (KEDA prefixes it with ``sN-``)."""
    parts = ["gpuscaler", value.metric.value, value.aggregation.value]
    if value.selection.indices is not None:
        parts.append("gpu" + "-".join(map(str, value.selection.indices)))
    if value.selection.uuids is not None:
        # UUIDs match case-insensitively, so the name must not depend on how they were spelled.
        digest = hashlib.sha256(",".join(uuid.lower() for uuid in value.selection.uuids).encode()).hexdigest()[:10]
        parts.append("uuid" + digest)
    if value.window_seconds is not None:
        parts.append(f"{value.window_function.value}{format_duration(value.window_seconds)}")
    return "-".join(parts).replace(".", "_")
