"""A query: what one trigger asks of the GPUs, after metadata, profile and defaults were applied."""

from __future__ import annotations

import fnmatch
import hashlib
import math
from dataclasses import dataclass

from gpuscaler.model.aggregation import Aggregation, WindowFunction
from gpuscaler.model.engines import EngineMetric
from gpuscaler.model.gpu_metrics import METRICS, Metric
from gpuscaler.model.pods import PodInfo
from gpuscaler.model.windows import WindowKey
from gpuscaler.query.selectors import LabelSelector


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
class PodSelection:
    """Which pods' GPUs a query reads: the pods in ``namespace`` that meet every criterion given.

    Each pod reduces its own GPUs with ``pod_aggregation``; the query's ``aggregation`` then combines
    the pods (one value per replica, summed by default, which is what KEDA's AverageValue divides).
    """

    namespace: str
    pod: str | None = None  # a glob on the pod name (fnmatch: *, ?, [...])
    workload: str | None = None  # the owning Deployment / StatefulSet / ... name
    labels: LabelSelector | None = None
    pod_aggregation: Aggregation = Aggregation.AVG
    # scaleTargetPods: the pods of this ScaledObject's scaleTargetRef, resolved at evaluation (signals/scale_targets.py)
    scale_target: str | None = None
    workload_kind: str | None = None  # with workload: only owners of this kind
    origin: str | None = None  # where a resolved selection came from, for people

    @property
    def needs_directory(self) -> bool:
        """Whether matching needs pod labels or owners, which only a pod directory knows."""
        return self.workload is not None or self.labels is not None or self.scale_target is not None

    def selects_name(self, namespace: str, pod: str) -> bool:
        """Whether a pod so named may be selected: what its name alone tells."""
        return namespace == self.namespace and (self.pod is None or fnmatch.fnmatchcase(pod, self.pod))

    def selects(self, info: PodInfo) -> bool:
        """Whether the selection takes the pod ``info`` describes (a resolved one: scaleTargetPods is not)."""
        if not self.selects_name(info.namespace, info.pod):
            return False
        if self.workload is not None and info.workload != self.workload:
            return False
        if self.workload_kind is not None and info.workload_kind != self.workload_kind:
            return False
        return self.labels is None or self.labels.matches(info.labels)

    def describe(self) -> str:
        if self.scale_target is not None:
            return f"pods of the scaleTargetRef of ScaledObject {self.namespace}/{self.scale_target} (scaleTargetPods)"
        parts = [f"namespace {self.namespace}"]
        if self.pod is not None:
            parts.append(f"pod {self.pod}")
        if self.workload is not None:
            parts.append(f"workload {self.workload_kind + '/' if self.workload_kind else ''}{self.workload}")
        if self.labels is not None:
            parts.append(f"podSelector {self.labels.text}")
        described = "pods in " + ", ".join(parts)
        return f"{described}: {self.origin}" if self.origin else described


@dataclass(frozen=True, slots=True)
class NodeQuorum:
    """How many nodes must contribute fresh samples: a count, or a fraction of the nodes known."""

    count: int | None = None
    fraction: float | None = None

    def required(self, known: int) -> int:
        if self.count is not None:
            return self.count
        assert self.fraction is not None
        return max(1, math.ceil(self.fraction * known - 1e-9))

    def describe(self) -> str:
        return str(self.count) if self.count is not None else f"{100 * (self.fraction or 0):g}%"


@dataclass(frozen=True, slots=True)
class UnreadableTolerance:
    """How many of a selection's GPUs an answer may leave out because they cannot be read now (``maxUnreadable``):
    a count, or a fraction of the GPUs it would count. Only GPUs on nodes that still answer with some readable GPU
    are counted against it; a node with nothing readable is unknown, like a silent node (``minNodes``)."""

    count: int | None = None
    fraction: float | None = None

    def allowed(self, gpus: int) -> int:
        """How many of ``gpus`` may be left out: a share rounds down, so a small selection is strict."""
        if self.count is not None:
            return self.count
        assert self.fraction is not None
        return math.floor(self.fraction * gpus + 1e-9)

    def describe(self) -> str:
        return str(self.count) if self.count is not None else f"{100 * (self.fraction or 0):g}%"


# 5%: half the HPA's default tolerance (10%, --horizontal-pod-autoscaler-tolerance), so what it leaves out alone
# never moves a steady HPA; and strict below 20 GPUs, so one 8-GPU node (or two) answers UNAVAILABLE for one lost GPU.
DEFAULT_MAX_UNREADABLE = UnreadableTolerance(fraction=0.05)


@dataclass(frozen=True, slots=True)
class GpuQuery:
    """A query on a GPU metric: the part of a ``Query`` that decides its value; equal ones share one evaluation."""

    metric: Metric
    aggregation: Aggregation
    selection: GpuSelection
    window_seconds: float | None
    window_function: WindowFunction
    pods: PodSelection | None = None
    min_nodes: NodeQuorum | None = None
    max_unreadable: UnreadableTolerance = DEFAULT_MAX_UNREADABLE
    # scaleTargetPods was set beside an explicit selector, which wins; the description says so.
    scale_target_ignored: bool = False

    @property
    def name(self) -> str:
        """The metric's name, as logs and Explain say it."""
        return self.metric.value

    def describe_selection(self) -> str:
        described = self.pods.describe() if self.pods is not None else self.selection.describe()
        if self.scale_target_ignored:
            described += " (an explicit selector: scaleTargetPods is not used)"
        return described

    @property
    def window(self) -> WindowKey | None:
        """The GPU-level window reduction it reads, if it has a window. A rate always has one: without
        ``window`` it is the rate between the newest two samples (``seconds`` 0)."""
        if self.window_seconds is None:
            default = METRICS[self.metric].default_window_seconds
            return None if default is None else WindowKey(self.metric, default, self.window_function)
        return WindowKey(self.metric, self.window_seconds, self.window_function)


@dataclass(frozen=True, slots=True)
class EngineQuery:
    """A query on an engine signal: read from the selected pods' own metrics pages, by the gateway only."""

    metric: EngineMetric
    pods: PodSelection
    aggregation: Aggregation
    interval_seconds: float = 1.0  # how often each selected pod is scraped while the query is asked
    # ``inferencePool``: the pool whose label sets a pool-labelled signal keeps (the EPP's); None for the rest.
    pool: str | None = None

    window_seconds = None  # engine signals are read as of the newest scrape, with no window
    window = None

    @property
    def name(self) -> str:
        return self.metric.value

    def describe_selection(self) -> str:
        return self.pods.describe() + (f", inferencePool {self.pool}" if self.pool is not None else "")


# One metric's query: a GPU or an engine query (a combined query's signals each hold one).
SingleQuery = GpuQuery | EngineQuery


@dataclass(frozen=True, slots=True)
class SignalTarget:
    """One signal of a combined query: its query, and the value one replica should carry of it."""

    query: SingleQuery
    target: float


@dataclass(frozen=True, slots=True)
class CombinedQuery:
    """Several signals, each asking for ``value / target`` replicas: the answer is the most any asks for.

    Each signal sums over its pods (or GPUs): for a queue that is the queue, for a utilisation it is the
    ready pods times their average, the HPA's own utilisation rule. With a target of 1 and KEDA's
    AverageValue the HPA then gives ``ceil(answer)`` replicas (docs/hpa.md works an example).
    """

    signals: tuple[SignalTarget, ...]

    window_seconds = None
    window = None

    @property
    def name(self) -> str:
        return "max(" + ", ".join(f"{part.query.name}/{part.target:g}" for part in self.signals) + ")"

    @property
    def windows(self) -> tuple[WindowKey, ...]:
        return tuple(w for part in self.signals if (w := part.query.window) is not None)

    def describe_selection(self) -> str:
        selections = {part.query.describe_selection() for part in self.signals}
        return "; ".join(sorted(selections))


# What a Query asks the value of: a GPU, an engine or a combined query (``Query.value``).
ValueSpec = GpuQuery | EngineQuery | CombinedQuery


def windows_of(value: ValueSpec) -> tuple[WindowKey, ...]:
    """The GPU-level windows a query reads, which a gateway asks its agents for."""
    if isinstance(value, CombinedQuery):
        return value.windows
    return (value.window,) if value.window is not None else ()


@dataclass(frozen=True, slots=True)
class ActivationRule:
    """Hysteresis: active when value > activation, inactive again when value <= deactivation."""

    activation_threshold: float
    deactivation_threshold: float


@dataclass(frozen=True, slots=True)
class Query:
    """Everything a trigger's metadata means. Hashable: streams with equal queries share their work."""

    value: ValueSpec
    activation: ActivationRule
    target: float
    metric_name: str
    profile: str | None = None

    @property
    def activation_key(self) -> tuple[ValueSpec, ActivationRule]:
        """Queries with the same key share one activation state, whatever their names."""
        return (self.value, self.activation)


def default_metric_name(value: GpuQuery) -> str:
    """A stable, lowercase, URL-safe name that tells what the value is (KEDA prefixes it with ``sN-``)."""
    parts = ["gpuscaler", value.metric.value, value.aggregation.value]
    if value.selection.indices is not None:
        parts.append("gpu" + "-".join(map(str, value.selection.indices)))
    if value.selection.uuids is not None:
        # UUIDs match case-insensitively, so the name must not depend on how they were spelled.
        digest = hashlib.sha256(",".join(uuid.lower() for uuid in value.selection.uuids).encode()).hexdigest()[:10]
        parts.append("uuid" + digest)
    if value.pods is not None:
        # The pod aggregation is spelled out; the selection, free text, goes in as a digest.
        pods = value.pods
        selection = "\x00".join(
            [pods.namespace, pods.pod or "", pods.workload or "", pods.labels.text if pods.labels else ""]
            + ([f"scaleTarget:{pods.scale_target}"] if pods.scale_target is not None else [])
        )
        parts.append(f"pods{pods.pod_aggregation.value}{hashlib.sha256(selection.encode()).hexdigest()[:10]}")
    if value.window_seconds is not None:
        parts.append(f"{value.window_function.value}{_name_duration(value.window_seconds)}")
    return "-".join(parts).replace(".", "_")


def _name_duration(seconds: float) -> str:
    """``seconds`` as metric names have always spelled it: the largest whole unit, else 6 significant digits.

    Not ``format_duration``, which keeps every digit to the microsecond so that what it writes reads back: the two
    differ only for a duration of 7 or more significant digits (``1000001ms``, written here ``1000s``, as it was
    before durations were strict), and a metric name KEDA and the HPA already hold must not change on an upgrade.
    """
    for unit, size in (("h", 3600.0), ("m", 60.0), ("s", 1.0)):
        if seconds >= size and (seconds / size).is_integer():
            return f"{int(seconds / size)}{unit}"
    return f"{seconds:g}s" if seconds >= 1 else f"{seconds * 1000:g}ms"


def digest_name(value: EngineQuery | CombinedQuery) -> str:
    """``default_metric_name`` for engine signals and combined queries: what is read, then a digest of the rest."""
    if isinstance(value, EngineQuery):
        parts = ["gpuscaler", value.metric.value, value.aggregation.value]
        described = [value.pods.describe(), _name_duration(value.interval_seconds)]
        if value.pool is not None:
            described.append(value.pool)
    else:
        parts = ["gpuscaler", "signals", *(part.query.name for part in value.signals)]
        described = [value.name, value.describe_selection()]
        described += [str(part.query.window) for part in value.signals]
    digest = hashlib.sha256("\x00".join(described).encode()).hexdigest()[:10]
    return "-".join([*parts, digest]).replace(".", "_")[:100].strip("-_")
