"""Trigger metadata for engine signals: the queries they make and the refusals that name what to do."""

from __future__ import annotations

import pytest

from gpuscaler.model.aggregation import Aggregation
from gpuscaler.model.engines import EngineMetric
from gpuscaler.model.errors import InvalidMetadata
from gpuscaler.model.gpu_metrics import Metric
from gpuscaler.query.metadata import Limits, parse_metadata
from gpuscaler.query.query import CombinedQuery, EngineQuery, GpuQuery

LIMITS = Limits(history_seconds=120.0, cluster=True)


def parse(**metadata: str):  # type: ignore[no-untyped-def]
    """The query the metadata makes for ScaledObject ml/llm at a gateway."""
    return parse_metadata(metadata, LIMITS, namespace="ml", name="llm")


def test_an_engine_metric_reads_the_selected_pods_with_its_defaults() -> None:
    """metric: vllm_queue with a workload makes an EngineQuery with the signal's target and aggregation; the
    keys override them."""
    query = parse(metric="vllm_queue", workload="llm")
    assert isinstance(query.value, EngineQuery)
    assert (query.value.metric, query.value.aggregation, query.target) == (
        EngineMetric.VLLM_QUEUE,
        Aggregation.SUM,
        8.0,
    )
    assert query.value.pods.workload == "llm"
    assert query.value.interval_seconds == 1.0
    cache = parse(metric="vllm_kv_cache", podSelector="app=llm", scrapeInterval="2s", targetValue="70")
    assert isinstance(cache.value, EngineQuery)
    assert (cache.value.aggregation, cache.target, cache.value.interval_seconds) == (Aggregation.AVG, 70.0, 2.0)


def test_prior_art_names_read_with_our_semantics() -> None:
    """The prior art's metricType values and profile name mean our signals."""
    assert parse(metricType="vllm_queue_depth", workload="llm").value.metric == EngineMetric.VLLM_QUEUE
    assert parse(profile="vllm-queue-depth", workload="llm").value.metric == EngineMetric.VLLM_QUEUE
    assert parse(metricType="triton_queue_wait_ms", workload="t").value.metric == EngineMetric.TRITON_QUEUE_WAIT


@pytest.mark.parametrize("key", ["vllmEndpoint", "tritonEndpoint", "vllmEndpointFromEnv"])
def test_a_url_key_is_refused_with_the_way_to_select_pods(key: str) -> None:
    """vllmEndpoint and tritonEndpoint (or their FromEnv forms) are refused, saying how to select pods instead."""
    with pytest.raises(InvalidMetadata, match=r"never fetches a URL.*workload, podSelector or scaleTargetPods"):
        parse(**{key: "http://10.0.0.1:8000/metrics", "metric": "vllm_queue", "workload": "llm"})


def test_an_engine_metric_without_pods_or_with_gpu_keys_is_refused() -> None:
    """An engine signal needs selected pods, takes no GPU-only key, and scrapeInterval is for engine signals only."""
    with pytest.raises(InvalidMetadata, match="no pods are selected"):
        parse(metric="tgi_queue")
    with pytest.raises(InvalidMetadata, match="key 'window' does not apply to engine signal tgi_queue"):
        parse(metric="tgi_queue", workload="tgi", window="30s")
    with pytest.raises(InvalidMetadata, match="scrapeInterval is set, but gpu_utilization is a GPU metric"):
        parse(metric="gpu_utilization", workload="tgi", scrapeInterval="1s")
    with pytest.raises(InvalidMetadata, match="scrapeInterval '10ms' is out of range"):
        parse(metric="tgi_queue", workload="tgi", scrapeInterval="10ms")


def test_signals_combine_engine_and_gpu_signals_with_a_target_of_one_replica() -> None:
    """signals makes one part per pair over the same pods, each GPU part a sum, and the target 1 replica."""
    query = parse(signals="vllm_queue:8, gpu_utilization:70", scaleTargetPods="true")
    assert isinstance(query.value, CombinedQuery)
    assert query.target == 1.0
    engine, gpu = (part.query for part in query.value.signals)
    assert isinstance(engine, EngineQuery)
    assert isinstance(gpu, GpuQuery)
    assert gpu.metric is Metric.GPU_UTILIZATION
    assert gpu.aggregation is Aggregation.SUM
    assert gpu.pods == engine.pods
    assert [part.target for part in query.value.signals] == [8.0, 70.0]
    saturation = parse(profile="vllm-saturation", workload="llm")
    assert isinstance(saturation.value, CombinedQuery)
    assert [p.query.name for p in saturation.value.signals] == ["vllm_queue", "vllm_kv_cache"]


@pytest.mark.parametrize(
    ("metadata", "says"),
    [
        ({"signals": "vllm_queue:8", "workload": "x"}, "names 1 signal"),
        ({"signals": "vllm_queue:8,vllm_queue:4", "workload": "x"}, "names vllm_queue twice"),
        ({"signals": "vllm_queue,tgi_queue:1", "workload": "x"}, "is not 'name:target'"),
        ({"signals": "vllm_queue:-1,tgi_queue:1", "workload": "x"}, "must be a number above 0"),
        (
            {"signals": "vllm_queue:8,tgi_queue:1", "workload": "x", "targetValue": "3"},
            "keys 'targetValue' and 'signals'",
        ),
        ({"signals": "vllm_queue:8,tgi_queue:1"}, "no pods are selected"),
        ({"signals": "vllm_queue:8,nope:1", "workload": "x"}, "signals 'nope' is not allowed"),
    ],
)
def test_bad_signals_are_refused_naming_the_entry(metadata: dict[str, str], says: str) -> None:
    """A bad signals value is refused naming the entry and what is allowed."""
    with pytest.raises(InvalidMetadata, match=says):
        parse(**metadata)


def test_a_scrape_interval_under_the_gateways_minimum_is_refused_naming_the_flag() -> None:
    """The shortest scrapeInterval is the gateway's --engine-min-scrape-interval: under it the query is refused,
    naming the key, the value and what is allowed; a gateway that allows 250ms takes it."""
    strict = Limits(history_seconds=120.0, cluster=True, min_scrape_seconds=2.0)
    with pytest.raises(InvalidMetadata) as refused:
        parse_metadata({"metric": "vllm_queue", "workload": "llm", "scrapeInterval": "1s"}, strict, namespace="ml")
    assert str(refused.value) == (
        "scrapeInterval '1s' is out of range; it must be from 2s (this gateway's --engine-min-scrape-interval) to 1m"
    )
    with pytest.raises(InvalidMetadata, match="scrapeInterval '250ms' is out of range; it must be from 1s"):
        parse(metric="vllm_queue", workload="llm", scrapeInterval="250ms")
    lenient = Limits(history_seconds=120.0, cluster=True, min_scrape_seconds=0.25)
    query = parse_metadata(
        {"metric": "vllm_queue", "workload": "llm", "scrapeInterval": "250ms"}, lenient, namespace="ml"
    )
    assert isinstance(query.value, EngineQuery)
    assert query.value.interval_seconds == 0.25
