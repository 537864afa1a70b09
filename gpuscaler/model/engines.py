"""Every engine signal, once: what an inference server's own /metrics page says about its queue and its cache.

An *engine* is the inference server a workload's pods run (vLLM, Triton, SGLang, TGI), or the inference gateway's
endpoint picker (EPP) in front of them. A *signal* is one value per pod computed from the series that engine
exposes: a gauge combined over its label sets (one per model or per data-parallel engine: a count summed, a usage
share averaged), the ratio of two counters' increases between two scrapes of the same pod, or a histogram's mean
over the observations made between them. The table below is the one place that names the series; the scraper, the
evaluation, the profiles and docs/engines.md all read it.

Series names were taken from each engine's own source (docs/engines.md lists the versions).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field

from gpuscaler.model.aggregation import Aggregation
from gpuscaler.model.epp_series import (
    EPP_INFO_SERIES,
    EPP_POOL_LABEL,
    EPP_QUEUE_SERIES,
    EPP_QUEUE_WAIT_SERIES,
    EPP_RUNNING_SERIES,
    EPP_SATURATION_SERIES,
    EPP_WAITED_OUTCOMES,
)
from gpuscaler.model.series_labels import SeriesLabels


class Engine(enum.StrEnum):
    """The inference servers whose metrics pages gpuscaler reads."""

    VLLM = "vllm"
    TRITON = "triton"
    SGLANG = "sglang"
    TGI = "tgi"
    EPP = "epp"  # the inference gateway's endpoint picker: a pool's demand, which exists at zero replicas


class EngineMetric(enum.StrEnum):
    """The engine signal names trigger metadata shares with the docs (``metric: vllm_queue``)."""

    VLLM_QUEUE = "vllm_queue"
    VLLM_RUNNING = "vllm_running"
    VLLM_KV_CACHE = "vllm_kv_cache"
    TRITON_PENDING = "triton_pending"
    TRITON_QUEUE_WAIT = "triton_queue_wait"
    TRITON_REQUEST_RATE = "triton_request_rate"
    SGLANG_QUEUE = "sglang_queue"
    SGLANG_RUNNING = "sglang_running"
    SGLANG_TOKEN_USAGE = "sglang_token_usage"  # noqa: S105 (a metric name, not a password)
    TGI_QUEUE = "tgi_queue"
    TGI_BATCH = "tgi_batch"
    EPP_QUEUE = "epp_queue"
    EPP_QUEUE_WAIT = "epp_queue_wait"
    EPP_SATURATION = "epp_saturation"
    EPP_RUNNING = "epp_running"


class SignalKind(enum.Enum):
    """How a signal is computed from a pod's page."""

    GAUGE = "gauge"  # the series' value now, combined over the page's label sets by the signal's ``label_sets``
    # The increase of ``series`` per second between this pod's last two scrapes (a counter).
    RATE = "rate"
    # The increase of ``series`` over the increase of ``per`` between the last two scrapes (two counters).
    RATIO = "ratio"
    # A histogram's mean over the observations made between the last two scrapes: its ``_sum``'s increase over its
    # ``_count``'s (``series`` names the histogram).
    MEAN = "mean"


class LabelSets(enum.Enum):
    """How a gauge's label sets on one pod's page combine into the pod's value."""

    # Requests queued or running: each label set (a model, a data-parallel engine) holds its own, and the pod holds
    # them all.
    SUM = "sum"
    # A share of a cache: each data-parallel engine of the pod (vLLM labels it ``engine``) has a pool of its own, of
    # one size, and two at 50% and 70% make a pod 60% full, not 120%.
    MEAN = "mean"


@dataclass(frozen=True, slots=True)
class EngineSignal:
    """One engine signal: where it comes from and what a trigger that names only it gets."""

    engine: Engine
    # The series it reads, first found wins: an engine's current name first, then the names older versions used.
    series: tuple[str, ...]
    kind: SignalKind
    unit: str
    help: str
    target: float  # per replica, KEDA's AverageValue
    activation_threshold: float
    # Queues add up over replicas; a cache's fill does not, so replicas average it (the HPA's utilisation rule).
    additive: bool
    # The most it can honestly read, in ``unit``: for a gauge, each label set of its series (a page past it is
    # malformed); for a rate or a ratio, the pod's value. docs/engines.md gives each and why.
    bound: float
    # How its label sets on one page combine (a GAUGE's; a counter's increase is always summed over them).
    label_sets: LabelSets
    scale: float = 1.0  # from the series' unit to the signal's (a 0-1 fraction to %: 100)
    per: str | None = None  # RATIO: the counter it divides by
    # How an idle pod's RATIO or MEAN reads when ``per`` (a MEAN's ``_count``) did not move: nothing finished, so
    # nothing waited.
    idle: float = 0.0
    # The label naming a label set's pool: a query that names a pool keeps only that pool's label sets.
    pool_label: str | None = None
    # A label and the values it may have: a label set with another value is left out (one without it is kept).
    keep: tuple[tuple[str, frozenset[str]], ...] = ()
    # No pod that counts is UNAVAILABLE, not 0: the engine exists while the workload is at zero, so a selection
    # without one has lost the signal (a failover, a killed process), not its demand.
    absent_unknown: bool = False
    # Series (of the query's pool) whose presence shows the page would count the signal, which is then 0 where
    # the page lacks it (a Prometheus vector shows a label set only once it was first set).
    zero_when_absent_with: tuple[str, ...] = ()
    # Gauges (of the pool) whose value above 0 makes an idle MEAN or RATIO unknown: requests wait, none left.
    busy_with: tuple[str, ...] = ()
    # How the selected pods combine, where neither a sum (``additive``) nor an average says it.
    pods: Aggregation | None = None

    def __post_init__(self) -> None:
        if self.kind is not SignalKind.GAUGE and self.label_sets is not LabelSets.SUM:
            raise ValueError(
                f"{self.series[0]}: a {self.kind.value} sums its counters' label sets; only a gauge averages"
            )

    @property
    def aggregation(self) -> Aggregation:
        """How the selected pods combine by default."""
        if self.pods is not None:
            return self.pods
        return Aggregation.SUM if self.additive else Aggregation.AVG

    @property
    def read(self) -> tuple[str, ...]:
        """The names the page keeps a value under for this signal's own series: a MEAN's ``_sum`` samples."""
        return tuple(name + "_sum" for name in self.series) if self.kind is SignalKind.MEAN else self.series

    def per_of(self, name: str) -> str | None:
        """The counter ``name`` (one of ``read``) is divided by: a MEAN's ``_count``, a RATIO's ``per``."""
        if self.kind is SignalKind.MEAN:
            return name.removesuffix("_sum") + "_count"
        return self.per

    @property
    def names(self) -> tuple[str, ...]:
        """Every series name it may read, counters' ``_total`` samples included (as the page spells them)."""
        if self.kind is SignalKind.MEAN:
            counted: tuple[str, ...] = tuple(name + end for name in self.series for end in ("_sum", "_count"))
        else:
            counted = (*self.series, *((self.per,) if self.per else ()))
        extra = (*self.zero_when_absent_with, *self.busy_with)
        if self.kind is SignalKind.GAUGE:
            return counted + extra
        return counted + tuple(name + "_total" for name in counted if not name.endswith("_total")) + extra


# Bounds (docs/engines.md, "Bounds"): a value past one is no engine's, and the pod is unread rather than believed.
# Requests queued or running in one label set (one model): each is an open connection or a request in the
# server's memory, and one process holds at most its descriptor limit's worth (1,048,576 in most containers).
REQUESTS_BOUND = 1_000_000.0
PERCENT_BOUND = 100.0  # a share of a cache: each label set's 0-1 fraction, in %
QUEUE_WAIT_BOUND_MS = 86_400_000.0  # a request's average wait in Triton's queue: a day
REQUEST_RATE_BOUND = 10_000_000.0  # requests finished a second by one pod, over its models
# A pool's saturation, in %: each model server's waiting queue over the EPP's queue threshold (an integer, at least
# 1), or its KV cache over its threshold, averaged over the pool; a queue within REQUESTS_BOUND over a threshold of 1
# is at most a million times the set point.
SATURATION_BOUND = REQUESTS_BOUND * 100.0

ENGINE_SIGNALS: Mapping[EngineMetric, EngineSignal] = {
    EngineMetric.VLLM_QUEUE: EngineSignal(
        Engine.VLLM,
        ("vllm:num_requests_waiting",),
        SignalKind.GAUGE,
        "requests",
        "requests waiting for their first scheduling, per pod",
        target=8.0,
        activation_threshold=0.0,
        additive=True,
        bound=REQUESTS_BOUND,
        label_sets=LabelSets.SUM,
    ),
    EngineMetric.VLLM_RUNNING: EngineSignal(
        Engine.VLLM,
        ("vllm:num_requests_running",),
        SignalKind.GAUGE,
        "requests",
        "requests in the running batch, per pod",
        target=32.0,
        activation_threshold=0.0,
        additive=True,
        bound=REQUESTS_BOUND,
        label_sets=LabelSets.SUM,
    ),
    EngineMetric.VLLM_KV_CACHE: EngineSignal(
        Engine.VLLM,
        # V1 engine (0.10 and later); the V0 engine's name, a 0-1 fraction too, where the new one is absent.
        ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
        SignalKind.GAUGE,
        "%",
        "KV-cache blocks in use, as a share of the pod's cache",
        target=80.0,
        activation_threshold=0.0,
        additive=False,
        bound=PERCENT_BOUND,
        label_sets=LabelSets.MEAN,
        scale=100.0,
    ),
    EngineMetric.TRITON_PENDING: EngineSignal(
        Engine.TRITON,
        ("nv_inference_pending_request_count",),
        SignalKind.GAUGE,
        "requests",
        "requests received and not yet executing, over the pod's models",
        target=8.0,
        activation_threshold=0.0,
        additive=True,
        bound=REQUESTS_BOUND,
        label_sets=LabelSets.SUM,
    ),
    EngineMetric.TRITON_QUEUE_WAIT: EngineSignal(
        Engine.TRITON,
        ("nv_inference_queue_duration_us",),
        SignalKind.RATIO,
        "ms",
        "average time a request that finished between the last two scrapes waited in the queue",
        target=100.0,
        activation_threshold=0.0,
        additive=False,
        bound=QUEUE_WAIT_BOUND_MS,
        label_sets=LabelSets.SUM,
        scale=0.001,
        per="nv_inference_request_success",
    ),
    EngineMetric.TRITON_REQUEST_RATE: EngineSignal(
        Engine.TRITON,
        ("nv_inference_request_success",),
        SignalKind.RATE,
        "requests/s",
        "requests that finished per second between the last two scrapes, over the pod's models",
        target=50.0,
        activation_threshold=0.0,
        additive=True,
        bound=REQUEST_RATE_BOUND,
        label_sets=LabelSets.SUM,
    ),
    EngineMetric.SGLANG_QUEUE: EngineSignal(
        Engine.SGLANG,
        ("sglang:num_queue_reqs",),
        SignalKind.GAUGE,
        "requests",
        "requests in the waiting queue, per pod",
        target=8.0,
        activation_threshold=0.0,
        additive=True,
        bound=REQUESTS_BOUND,
        label_sets=LabelSets.SUM,
    ),
    EngineMetric.SGLANG_RUNNING: EngineSignal(
        Engine.SGLANG,
        ("sglang:num_running_reqs",),
        SignalKind.GAUGE,
        "requests",
        "requests in the running batch, per pod",
        target=32.0,
        activation_threshold=0.0,
        additive=True,
        bound=REQUESTS_BOUND,
        label_sets=LabelSets.SUM,
    ),
    EngineMetric.SGLANG_TOKEN_USAGE: EngineSignal(
        Engine.SGLANG,
        ("sglang:token_usage",),
        SignalKind.GAUGE,
        "%",
        "KV-cache token slots in use, as a share of the pod's pool",
        target=80.0,
        activation_threshold=0.0,
        additive=False,
        bound=PERCENT_BOUND,
        label_sets=LabelSets.MEAN,
        scale=100.0,
    ),
    EngineMetric.TGI_QUEUE: EngineSignal(
        Engine.TGI,
        ("tgi_queue_size",),
        SignalKind.GAUGE,
        "requests",
        "requests waiting in the router's queue, per pod",
        target=8.0,
        activation_threshold=0.0,
        additive=True,
        bound=REQUESTS_BOUND,
        label_sets=LabelSets.SUM,
    ),
    EngineMetric.TGI_BATCH: EngineSignal(
        Engine.TGI,
        ("tgi_batch_current_size",),
        SignalKind.GAUGE,
        "requests",
        "requests in the current batch, per pod",
        target=32.0,
        activation_threshold=0.0,
        additive=True,
        bound=REQUESTS_BOUND,
        label_sets=LabelSets.SUM,
    ),
    EngineMetric.EPP_QUEUE: EngineSignal(
        Engine.EPP,
        EPP_QUEUE_SERIES,
        SignalKind.GAUGE,
        "requests",
        "requests held in the EPP's flow-control queue for the pool, summed over the EPP's pods",
        target=8.0,
        activation_threshold=0.0,
        additive=True,
        bound=REQUESTS_BOUND,
        label_sets=LabelSets.SUM,
        pool_label=EPP_POOL_LABEL,
        absent_unknown=True,
        # Info is set at start, flow control's series at the first request (docs/engines.md): a fresh EPP is idle.
        zero_when_absent_with=EPP_INFO_SERIES,
    ),
    EngineMetric.EPP_QUEUE_WAIT: EngineSignal(
        Engine.EPP,
        EPP_QUEUE_WAIT_SERIES,
        SignalKind.MEAN,
        "ms",
        "average time the requests that left the EPP's queue for the pool between the last two scrapes waited in it",
        target=1000.0,
        activation_threshold=0.0,
        additive=False,
        bound=QUEUE_WAIT_BOUND_MS,
        label_sets=LabelSets.SUM,
        scale=1000.0,
        pool_label=EPP_POOL_LABEL,
        keep=(("outcome", EPP_WAITED_OUTCOMES),),
        absent_unknown=True,
        zero_when_absent_with=EPP_INFO_SERIES,
        busy_with=EPP_QUEUE_SERIES,
    ),
    EngineMetric.EPP_SATURATION: EngineSignal(
        Engine.EPP,
        EPP_SATURATION_SERIES,
        SignalKind.GAUGE,
        "%",
        "the pool's saturation as its EPP gates dispatch on it (100% is the set point), the most any EPP pod reads",
        target=80.0,
        # Never wakes a pool: a pool with no endpoint reads 100% (fail-closed), requests or none; its queue wakes it.
        activation_threshold=SATURATION_BOUND,
        additive=False,
        bound=SATURATION_BOUND,
        label_sets=LabelSets.MEAN,
        scale=100.0,
        pool_label=EPP_POOL_LABEL,
        # llm-d writes prefill's and decode's beside the ``effective`` one, the larger of the two, which gates.
        keep=(("stage", frozenset(("effective",))),),
        # Unknown until flow control first measures it: the pool's state may be anything (100% with no endpoint).
        absent_unknown=True,
        pods=Aggregation.MAX,  # each EPP pod gates on its own reading of the one pool: never summed
    ),
    EngineMetric.EPP_RUNNING: EngineSignal(
        Engine.EPP,
        EPP_RUNNING_SERIES,
        SignalKind.GAUGE,
        "requests",
        "requests the EPP routed to a model server and that have not finished, summed over the EPP's pods",
        target=32.0,
        activation_threshold=0.0,
        additive=True,
        bound=REQUESTS_BOUND,
        label_sets=LabelSets.SUM,
        # No pool label: an EPP serves the one pool its --pool-name names, so its pods are the pool's.
        absent_unknown=True,
        zero_when_absent_with=EPP_INFO_SERIES,
    ),
}

# The container port an engine serves /metrics on by default: read only where the pod declares it (see
# ``pods.metrics_endpoint``). vLLM, SGLang and TGI serve it on their API port; Triton on a port of its own.
DEFAULT_PORTS: Mapping[Engine, int] = {
    Engine.VLLM: 8000,
    Engine.TRITON: 8002,
    Engine.SGLANG: 30000,
    Engine.TGI: 80,
    Engine.EPP: 9090,  # the EPP's --metrics-port
}


def engine_series(engine: Engine) -> frozenset[str]:
    """Every series name a scrape of ``engine`` keeps: the prefilter drops every other line unparsed."""
    return frozenset(name for signal in ENGINE_SIGNALS.values() if signal.engine is engine for name in signal.names)


def series_labels(engine: Engine) -> dict[str, SeriesLabels]:
    """Each series ``engine``'s signals read whose labels matter, as the page keeps it (a MEAN's ``_sum`` and
    ``_count``)."""
    found: dict[str, SeriesLabels] = {}
    for signal in ENGINE_SIGNALS.values():
        if signal.engine is not engine or (signal.pool_label is None and not signal.keep):
            continue
        for name in signal.read:
            rule = SeriesLabels(signal.pool_label, signal.keep)
            found[name] = rule
            per = signal.per_of(name)
            if per is not None:
                found[per] = rule
    return found


def series_bounds(engine: Engine) -> dict[str, float]:
    """The most one label set of each gauge series ``engine``'s signals read may say, in the series' own unit."""
    return {
        name: signal.bound / signal.scale
        for signal in ENGINE_SIGNALS.values()
        if signal.engine is engine and signal.kind is SignalKind.GAUGE
        for name in signal.series
    }


@dataclass(frozen=True, slots=True)
class EnginePage:
    """What one scrape of one pod read: each series ``engine_series`` keeps, summed over its label sets, and how
    many label sets gave it (a signal that averages them divides the one by the other).

    A counter is kept under its family name (``_total`` dropped), whichever way the page spelled it.
    """

    at: float  # monotonic, when the answer was read
    values: Mapping[str, float]
    # Label sets read of each series in ``values``; a page made without them has none, and a signal that averages
    # its label sets is then unread, never divided by a guess.
    counts: Mapping[str, int] = field(default_factory=dict)
    # A pool-labelled series' value and label sets for each pool it names (``series_labels``): a query that names
    # a pool reads its pool's alone.
    pools: Mapping[str, Mapping[str, tuple[float, int]]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class PodScrape:
    """The newest scrape of one pod's engine, and the page before it (a counter's increase needs two)."""

    endpoint: str  # the URL read, for people
    page: EnginePage | None = None  # the newest page read
    previous: EnginePage | None = None  # the page before ``page``
    error: str | None = None  # why the newest attempt failed; ``page`` is then an older one
