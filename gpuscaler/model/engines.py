"""Every engine signal, once: what an inference server's own /metrics page says about its queue and its cache.

An *engine* is the inference server a workload's pods run (vLLM, Triton, SGLang, TGI). A *signal* is one value
per pod computed from the series that engine exposes: a gauge combined over its label sets (one per model or per
data-parallel engine: a count summed, a usage share averaged), or the ratio of two counters' increases between two
scrapes of the same pod. The table below is the one place that names the series; the scraper, the evaluation, the
profiles and docs/engines.md all read it.

Series names were taken from each engine's own source (docs/engines.md lists the versions).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field

from gpuscaler.model.aggregation import Aggregation


class Engine(enum.StrEnum):
    """The inference servers whose metrics pages gpuscaler reads."""

    VLLM = "vllm"
    TRITON = "triton"
    SGLANG = "sglang"
    TGI = "tgi"


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


class SignalKind(enum.Enum):
    """How a signal is computed from a pod's page."""

    GAUGE = "gauge"  # the series' value now, combined over the page's label sets by the signal's ``label_sets``
    # The increase of ``series`` per second between this pod's last two scrapes (a counter).
    RATE = "rate"
    # The increase of ``series`` over the increase of ``per`` between the last two scrapes (two counters).
    RATIO = "ratio"


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
    # How an idle pod's RATIO reads when ``per`` did not move: nothing finished, so nothing waited.
    idle: float = 0.0

    def __post_init__(self) -> None:
        if self.kind is not SignalKind.GAUGE and self.label_sets is not LabelSets.SUM:
            raise ValueError(
                f"{self.series[0]}: a {self.kind.value} sums its counters' label sets; only a gauge averages"
            )

    @property
    def aggregation(self) -> Aggregation:
        """How the selected pods combine by default."""
        return Aggregation.SUM if self.additive else Aggregation.AVG

    @property
    def names(self) -> tuple[str, ...]:
        """Every series name it may read, counters' ``_total`` samples included (as the page spells them)."""
        counted = (*self.series, *((self.per,) if self.per else ()))
        if self.kind is SignalKind.GAUGE:
            return counted
        return counted + tuple(name + "_total" for name in counted if not name.endswith("_total"))


# Bounds (docs/engines.md, "Bounds"): a value past one is no engine's, and the pod is unread rather than believed.
# Requests queued or running in one label set (one model): each is an open connection or a request in the
# server's memory, and one process holds at most its descriptor limit's worth (1,048,576 in most containers).
REQUESTS_BOUND = 1_000_000.0
PERCENT_BOUND = 100.0  # a share of a cache: each label set's 0-1 fraction, in %
QUEUE_WAIT_BOUND_MS = 86_400_000.0  # a request's average wait in Triton's queue: a day
REQUEST_RATE_BOUND = 10_000_000.0  # requests finished a second by one pod, over its models

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
}

# The container port an engine serves /metrics on by default: read only where the pod declares it (see
# ``pods.metrics_endpoint``). vLLM, SGLang and TGI serve it on their API port; Triton on a port of its own.
DEFAULT_PORTS: Mapping[Engine, int] = {
    Engine.VLLM: 8000,
    Engine.TRITON: 8002,
    Engine.SGLANG: 30000,
    Engine.TGI: 80,
}


def engine_series(engine: Engine) -> frozenset[str]:
    """Every series name a scrape of ``engine`` keeps: the prefilter drops every other line unparsed."""
    return frozenset(name for signal in ENGINE_SIGNALS.values() if signal.engine is engine for name in signal.names)


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


@dataclass(frozen=True, slots=True)
class PodScrape:
    """The newest scrape of one pod's engine, and the page before it (a counter's increase needs two)."""

    endpoint: str  # the URL read, for people
    page: EnginePage | None = None  # the newest page read
    previous: EnginePage | None = None  # the page before ``page``
    error: str | None = None  # why the newest attempt failed; ``page`` is then an older one
