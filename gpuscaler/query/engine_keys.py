"""The trigger keys of engine signals and combined queries: metric names, ``signals``, ``scrapeInterval``,
``inferencePool``.

No key takes a URL. The prior art's ``vllmEndpoint`` and ``tritonEndpoint`` are refused with the way to select
the pods instead: a URL in a ScaledObject lets whoever writes one make the scaler fetch any address, and a
Service's URL reads one pod of many.

The prior art's NVLink names (MB/s) mean ours in the same unit; its PCIe names are in KB/s, where ours are MB/s,
so they are refused with the conversion rather than read with a target a thousand times off.
"""

from __future__ import annotations

from collections.abc import Mapping

from gpuscaler.model.aggregation import Aggregation
from gpuscaler.model.durations import format_duration, parse_duration
from gpuscaler.model.engines import ENGINE_SIGNALS, EngineMetric
from gpuscaler.model.errors import InvalidMetadata
from gpuscaler.model.gpu_metrics import Metric
from gpuscaler.query.key_values import OBJECT_NAME, format_number, parse_name

# The prior art's metricType values for engine signals, read with our semantics (docs/migration.md).
PRIOR_ART_METRICS: Mapping[str, EngineMetric] = {
    "vllm_queue_depth": EngineMetric.VLLM_QUEUE,
    "vllm_kv_cache_usage": EngineMetric.VLLM_KV_CACHE,
    "triton_queue_wait_ms": EngineMetric.TRITON_QUEUE_WAIT,
}
# The prior art's GPU metricType values that are ours under another name, in the same unit.
PRIOR_ART_GPU_METRICS: Mapping[str, Metric] = {
    "nvlink_tx_mbps": Metric.NVLINK_TX,
    "nvlink_rx_mbps": Metric.NVLINK_RX,
}
# The prior art's KB/s names, and the MB/s metric each one's user wants.
PRIOR_ART_KILOBYTE_METRICS: Mapping[str, Metric] = {
    "pcie_tx_kbps": Metric.PCIE_TX,
    "pcie_rx_kbps": Metric.PCIE_RX,
}
ENDPOINT_KEYS = ("vllmEndpoint", "tritonEndpoint")
POOL_KEY = "inferencePool"
ENGINE_KEYS = ("signals", "scrapeInterval", POOL_KEY)
# Keys that say how GPUs are read: meaningless for a signal read from an engine's page.
GPU_ONLY_KEYS = (
    "gpuIndex",
    "gpuUUID",
    "window",
    "windowFunction",
    "minNodes",
    "maxUnreadable",
    "podAggregation",
    "targetGpuUtilization",
    "targetMemoryUtilization",
)
DEFAULT_SCRAPE_SECONDS = 1.0
# The shortest scrapeInterval a gateway allows unless told otherwise (``--engine-min-scrape-interval``): a pod's
# page once a second is 15 reads per HPA decision (every 15 s), and one selection of N pods costs N reads a second.
DEFAULT_MIN_SCRAPE_SECONDS = 1.0
MAX_SCRAPE_SECONDS = 60.0
MAX_SIGNALS = 4

AnyMetric = Metric | EngineMetric


def metric_names() -> list[str]:
    """Every name ``metric`` takes: GPU metrics, then engine signals."""
    return [m.value for m in Metric] + [m.value for m in EngineMetric]


def parse_any_metric(key: str, text: str) -> AnyMetric:
    """A GPU metric or an engine signal by name; the prior art's metricType values with our unit are accepted too."""
    name = text.strip()
    for kind in (Metric, EngineMetric):
        try:
            return kind(name)
        except ValueError:
            continue
    if name in PRIOR_ART_METRICS:
        return PRIOR_ART_METRICS[name]
    if name in PRIOR_ART_GPU_METRICS:
        return PRIOR_ART_GPU_METRICS[name]
    if name in PRIOR_ART_KILOBYTE_METRICS:
        ours = PRIOR_ART_KILOBYTE_METRICS[name]
        raise InvalidMetadata(
            f"{key} {text!r} is the prior art's PCIe traffic in KB/s, which gpuscaler does not read; use "
            f"{key}: {ours.value}, in MB/s, with the target divided by 1000 (a targetValue of 10000000 KB/s is "
            "10000 MB/s)"
        )
    raise InvalidMetadata(f"{key} {text!r} is not allowed; use one of: {', '.join(metric_names())}")


def endpoint_refusal(key: str) -> InvalidMetadata:
    """The refusal of a key that names a URL (the module says why)."""
    return InvalidMetadata(
        f"key {key!r} is not accepted: gpuscaler never fetches a URL named in a ScaledObject (anyone who can write "
        "one could aim the scaler at any address, and a Service URL reads one pod of many); select the engine's "
        "pods with workload, podSelector or scaleTargetPods: 'true', and the gateway reads each pod's own "
        "metrics port (docs/engines.md)"
    )


def refuse_gpu_keys(raw: Mapping[str, str], what: str) -> None:
    """Refuse a key that only GPU queries take, naming it."""
    for key in GPU_ONLY_KEYS:
        if key in raw:
            raise InvalidMetadata(
                f"key {key!r} does not apply to {what}, which is read from the selected pods' engines as of "
                "their newest scrape; leave it out"
            )


def parse_scrape_interval(raw: Mapping[str, str], minimum: float = DEFAULT_MIN_SCRAPE_SECONDS) -> float:
    """``scrapeInterval``: how often each selected pod's page is read while the query is asked; ``minimum`` is the
    gateway's ``--engine-min-scrape-interval``."""
    if "scrapeInterval" not in raw:
        return DEFAULT_SCRAPE_SECONDS
    text = raw["scrapeInterval"]
    try:
        seconds = parse_duration(text)
    except ValueError as error:
        raise InvalidMetadata(f"scrapeInterval {error}") from None
    if not minimum <= seconds <= MAX_SCRAPE_SECONDS:
        raise InvalidMetadata(
            f"scrapeInterval {text!r} is out of range; it must be from {format_duration(minimum)} (this gateway's "
            f"--engine-min-scrape-interval) to {format_duration(MAX_SCRAPE_SECONDS)}"
        )
    return seconds


def pooled_signals() -> list[str]:
    """The signals whose label sets name a pool (``inferencePool`` keeps that pool's)."""
    return [metric.value for metric, signal in ENGINE_SIGNALS.items() if signal.pool_label is not None]


def refuse_pool_key(raw: Mapping[str, str], what: str) -> None:
    """Refuse ``inferencePool`` on a query that reads no pool-labelled signal, naming what it is."""
    if POOL_KEY in raw:
        raise InvalidMetadata(
            f"key {POOL_KEY!r} does not apply to {what}; it names the InferencePool whose label sets the EPP's "
            f"{', '.join(pooled_signals())} keep (docs/engines.md): leave it out"
        )


def parse_pool(raw: Mapping[str, str], metric: EngineMetric) -> str | None:
    """``inferencePool``: the pool whose label sets ``metric`` keeps, required where its series name pools.

    Required because one selection may hold the EPP pods of several pools (``podSelector: app=epp`` in a
    namespace that serves two models), and each pod's page would then add its own pool's queue to this one's.
    """
    signal = ENGINE_SIGNALS[metric]
    if signal.pool_label is None:
        if signal.absent_unknown and POOL_KEY in raw:
            raise InvalidMetadata(
                f"key {POOL_KEY!r} does not apply to {metric.value}: the EPP counts it without a pool label "
                f"({signal.series[0]}), so only the selection picks the pool: an EPP serves the one InferencePool "
                "its --pool-name names, so select that EPP's pods and leave inferencePool out (docs/engines.md)"
            )
        refuse_pool_key(raw, f"engine signal {metric.value}")
        return None
    if POOL_KEY not in raw:
        raise InvalidMetadata(
            f"{metric.value} needs {POOL_KEY}: the name of the InferencePool whose {signal.pool_label} label sets it "
            "reads (the EPP's --pool-name), so that the EPP pods of another pool in the selection never add to "
            "it (docs/engines.md)"
        )
    text = raw[POOL_KEY]
    if "/" in text:
        raise InvalidMetadata(
            f"{POOL_KEY} {text!r} is not allowed; the EPP's {signal.pool_label} label holds the pool's name alone "
            "(its --pool-name), and the selection's namespace is the pool's: use the name, like 'vllm-llama3-8b'"
        )
    return parse_name(POOL_KEY, text, OBJECT_NAME, "an InferencePool's name like 'vllm-llama3-8b'")


def parse_signal_targets(text: str) -> tuple[tuple[AnyMetric, float], ...]:
    """``signals``: comma-separated ``name:target`` pairs, like ``vllm_queue:8,vllm_kv_cache:80``."""
    pairs: list[tuple[AnyMetric, float]] = []
    for item in text.split(","):
        name, colon, target_text = item.strip().partition(":")
        if not colon or not name.strip() or not target_text.strip():
            raise InvalidMetadata(
                f"signals {text!r}: entry {item.strip()!r} is not 'name:target'; use a comma-separated list "
                "like 'vllm_queue:8,vllm_kv_cache:80'"
            )
        metric = parse_any_metric("signals", name)
        try:
            target = float(target_text)
        except ValueError:
            target = -1.0
        if not 0 < target < float("inf"):
            raise InvalidMetadata(
                f"signals {text!r}: the target of {metric.value} is {target_text.strip()!r}; it must be a number "
                "above 0: the value one replica should carry"
            )
        if any(seen == metric for seen, _ in pairs):
            raise InvalidMetadata(f"signals {text!r} names {metric.value} twice; name each signal once")
        pairs.append((metric, target))
    if len(pairs) < 2 or len(pairs) > MAX_SIGNALS:
        raise InvalidMetadata(
            f"signals {text!r} names {len(pairs)} signal(s); combine 2 to {MAX_SIGNALS}, or use metric and "
            "targetValue for one"
        )
    _refuse_mixed_pods(text, pairs)
    return tuple(pairs)


def _refuse_mixed_pods(text: str, pairs: list[tuple[AnyMetric, float]]) -> None:
    """``signals`` reads one selection of pods: the EPP's (its summed signals alone), or the model servers'."""
    epp = [m for m, _ in pairs if isinstance(m, EngineMetric) and ENGINE_SIGNALS[m].absent_unknown]
    if not epp:
        return
    if len(epp) < len(pairs):
        other = next(m for m, _ in pairs if m not in epp)
        raise InvalidMetadata(
            f"signals {text!r} include {epp[0].value}, which is read from the EPP's pods, and {other.value}, "
            "which is not; signals reads every signal from one selection of pods: give it a trigger of its own, "
            "beside the model servers' (the HPA scales to the most any trigger asks for; docs/engines.md)"
        )
    summed = [m.value for m, s in ENGINE_SIGNALS.items() if s.absent_unknown and s.aggregation is Aggregation.SUM]
    for metric in epp:
        if ENGINE_SIGNALS[metric].aggregation is not Aggregation.SUM:
            raise InvalidMetadata(
                f"signals {text!r} include {metric.value}, which is one value for the whole pool, not a sum over "
                "the EPP's pods; signals combines requests that one replica carries: of the EPP's signals it takes "
                f"{', '.join(summed)} "
                "(give this one a trigger of its own; docs/engines.md)"
            )


def describe_targets(pairs: tuple[tuple[AnyMetric, float], ...]) -> str:
    """Signal targets as the ``signals`` key spells them."""
    return ",".join(f"{metric.value}:{format_number(target)}" for metric, target in pairs)
