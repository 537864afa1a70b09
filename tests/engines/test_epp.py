"""The EPP's demand signals from its own exposition, under llm-d's names and GIE v1.5.0's: the pool, the arithmetic,
the bounds, and no Ready EPP as unknown."""

from __future__ import annotations

from types import SimpleNamespace
from typing import cast

import pytest

from gpuscaler.gateway.engines.page import MalformedPage, prefilter, read_whole_page
from gpuscaler.model.engines import (
    DEFAULT_PORTS,
    ENGINE_SIGNALS,
    Engine,
    EngineMetric,
    EnginePage,
    PodScrape,
    engine_series,
    series_bounds,
    series_labels,
)
from gpuscaler.model.errors import InvalidMetadata, Unavailable
from gpuscaler.model.pods import PodInfo
from gpuscaler.query.metadata import Limits, parse_metadata
from gpuscaler.query.query import EngineQuery
from gpuscaler.signals.engines.evaluation import evaluate_engine
from gpuscaler.signals.engines.source import EngineSource
from gpuscaler.signals.engines.values import signal_value
from tests.fakes.fake_engine import epp_page
from tests.signals.test_evaluation_workloads import Directory

POOL = "vllm-llama3-8b-instruct"
WANTED = prefilter(engine_series(Engine.EPP), series_bounds(Engine.EPP), series_labels(Engine.EPP))
GENERATIONS = pytest.mark.parametrize("llmd", [True, False], ids=["llm-d", "gie-v1.5.0"])
URL = "http://10.0.0.1:9090/metrics"


def page_of(text: str, at: float = 0.0) -> EnginePage:
    """``text`` read as the gateway reads an EPP's page."""
    return read_whole_page(text.encode(), WANTED, at=at)


def read(metric: EngineMetric, now: str, before: str | None = None, pool: str | None = POOL) -> float | str:
    """The pod's value of ``metric`` from page ``now`` (read at 10 s), after ``before`` (read at 0 s) if given."""
    previous = page_of(before, at=0.0) if before is not None else None
    scrape = PodScrape(URL, page_of(now, at=10.0), previous)
    return signal_value(ENGINE_SIGNALS[metric], scrape, now=10.0, stale_after=3.0, pool=pool)


@GENERATIONS
def test_each_epp_gauge_reads_under_both_names(llmd: bool) -> None:
    """Queue, saturation (llm-d's effective stage, not prefill's or decode's) and running requests read alike from
    current llm-d's page (llm_d_epp_* beside the old names) and GIE v1.5.0's (the old names alone)."""
    text = epp_page({"waiting": 3, "running": 5, "kv": 0.25, "success": 10, "queue_us": 8}, llmd=llmd)
    assert read(EngineMetric.EPP_QUEUE, text) == 3.0
    assert read(EngineMetric.EPP_SATURATION, text) == pytest.approx(25.0)
    assert read(EngineMetric.EPP_RUNNING, text, pool=None) == 5.0
    page = page_of(text)
    series = "llm_d_epp_flow_control_pool_saturation" if llmd else "inference_extension_flow_control_pool_saturation"
    assert page.counts[series] == 1  # prefill's and decode's label sets were left out before reading


@GENERATIONS
def test_the_queue_wait_is_the_mean_wait_of_the_requests_that_left_between_two_scrapes(llmd: bool) -> None:
    """4 requests dispatched between two scrapes waited 2 s in all: 500 ms each; the 7 rejected at once (no wait)
    are not in the mean."""
    before = epp_page({"waiting": 0, "kv": 0.5, "success": 10, "queue_us": 3.0}, llmd=llmd)
    after = epp_page({"waiting": 0, "kv": 0.5, "success": 14, "queue_us": 5.0}, llmd=llmd)
    assert read(EngineMetric.EPP_QUEUE_WAIT, after, before) == pytest.approx(500.0)


def test_a_queue_wait_with_nothing_left_is_zero_when_nothing_waits_and_unknown_when_requests_do() -> None:
    """No request left between two scrapes: 0 while the queue is empty; with 3 waiting (a pool at zero, whose queue
    nothing leaves) the wait is unknown, never 0."""
    idle = epp_page({"waiting": 0, "kv": 1.0, "success": 10, "queue_us": 3.0}, llmd=True)
    assert read(EngineMetric.EPP_QUEUE_WAIT, idle, idle) == 0.0
    stuck = epp_page({"waiting": 3, "kv": 1.0, "success": 10, "queue_us": 3.0}, llmd=True)
    answer = read(EngineMetric.EPP_QUEUE_WAIT, stuck, stuck)
    assert isinstance(answer, str)
    assert "3 requests wait and none left the queue" in answer
    assert "not 0" in answer


@GENERATIONS
def test_an_epp_that_never_queued_reads_zero_from_its_start(llmd: bool) -> None:
    """A vector shows a label set only once it is set, and flow control writes nothing before its first request: a
    fresh EPP's page has its info series alone, which shows it is an EPP, so its queue, its wait and its running
    requests are 0; the pool's saturation, not measured yet, is unknown, never 0."""
    fresh = epp_page({}, llmd=llmd)
    assert read(EngineMetric.EPP_QUEUE, fresh) == 0.0
    assert read(EngineMetric.EPP_QUEUE_WAIT, fresh, fresh) == 0.0
    assert read(EngineMetric.EPP_RUNNING, fresh, pool=None) == 0.0
    answer = read(EngineMetric.EPP_SATURATION, fresh)
    assert isinstance(answer, str)
    assert "flow_control_pool_saturation" in answer


def test_a_page_that_is_not_an_epps_is_unread_never_zero() -> None:
    """A page with no EPP series at all (no info series) is no EPP's: each signal says what it lacks."""
    for metric, pool in ((EngineMetric.EPP_QUEUE, POOL), (EngineMetric.EPP_RUNNING, None)):
        answer = read(metric, "# TYPE other gauge\nother 1\n", pool=pool)
        assert isinstance(answer, str)
        assert "is it a epp pod?" in answer


def test_only_the_named_pools_label_sets_count() -> None:
    """Label sets of another pool on the same page never add to the named pool's queue or saturation."""
    ours = epp_page({"waiting": 3, "kv": 0.4}, llmd=False)
    theirs = epp_page({"waiting": 50, "kv": 0.9}, llmd=False, pool="other-pool")
    both = ours + "".join(line + "\n" for line in theirs.splitlines() if not line.startswith("#"))
    assert read(EngineMetric.EPP_QUEUE, both) == 3.0
    assert read(EngineMetric.EPP_SATURATION, both) == pytest.approx(40.0)
    assert read(EngineMetric.EPP_QUEUE, both, pool="other-pool") == 50.0
    assert page_of(both).values["inference_extension_flow_control_queue_size"] == 53.0  # /metrics: the page's sum


def test_another_pools_epp_is_unread_naming_the_pool_it_serves() -> None:
    """An EPP pod whose page names only another pool is no EPP of the named pool: unread, saying which it serves."""
    theirs = epp_page({"waiting": 50, "kv": 0.9}, llmd=True, pool="other-pool")
    answer = read(EngineMetric.EPP_QUEUE, theirs)
    assert isinstance(answer, str)
    assert "inference_pool 'other-pool', not 'vllm-llama3-8b-instruct'" in answer


@pytest.mark.parametrize(
    ("values", "refused"),
    [
        ({"waiting": 1_000_001, "kv": 0.5}, "inference_extension_flow_control_queue_size is 1e"),
        ({"kv": 1_000_001}, "inference_extension_flow_control_pool_saturation is 1e"),
        ({"running": 1_000_001, "kv": 0.5}, "inference_objective_running_requests is 1e"),
    ],
)
def test_a_gauge_past_its_bound_makes_the_page_malformed(values: dict[str, float], refused: str) -> None:
    """A million and one requests queued or running in one label set, or a saturation past a million times the set
    point, is no EPP's."""
    with pytest.raises(MalformedPage, match=refused + r"\+06, past the"):
        page_of(epp_page(values, llmd=True))  # the old names come first in the page's sorted series


def test_a_saturation_past_the_set_point_is_believed_within_its_bound() -> None:
    """Saturation reads past 100%: 1.0 is the set point, not a ceiling (a queue past its threshold)."""
    assert read(EngineMetric.EPP_SATURATION, epp_page({"kv": 3.5}, llmd=True)) == pytest.approx(350.0)
    page = epp_page({"kv": 1_000_000, "waiting": 1_000_000}, llmd=True)  # at the bounds: believed
    assert read(EngineMetric.EPP_SATURATION, page) == pytest.approx(100_000_000.0)
    assert read(EngineMetric.EPP_QUEUE, page) == 1_000_000.0


def test_a_queue_wait_past_a_day_is_unread() -> None:
    """One request that waited over a day (86,400 s) between two scrapes is no queue's."""
    before = epp_page({"kv": 0.5, "success": 1, "queue_us": 0.0}, llmd=True)
    after = epp_page({"kv": 0.5, "success": 2, "queue_us": 86_401.0}, llmd=True)
    answer = read(EngineMetric.EPP_QUEUE_WAIT, after, before)
    assert isinstance(answer, str)
    assert "past the 8.64e+07 ms" in answer


LIMITS = Limits(history_seconds=600, cluster=True)


def parse(**metadata: str) -> EngineQuery:
    """A trigger's metadata as the gateway parses it for ScaledObject ml/llama."""
    query = parse_metadata(metadata, LIMITS, namespace="ml", name="llama")
    assert isinstance(query.value, EngineQuery)
    return query.value


def test_inference_pool_is_required_where_the_series_name_pools_and_refused_elsewhere() -> None:
    """epp_queue needs inferencePool and keeps it; epp_running (no pool label) and a model server's signal refuse
    it; a namespace/name or an invalid name is refused naming the key and the value."""
    assert parse(metric="epp_queue", inferencePool=POOL, podSelector="app=epp").pool == POOL
    with pytest.raises(InvalidMetadata, match="epp_queue needs inferencePool"):
        parse(metric="epp_queue", podSelector="app=epp")
    with pytest.raises(InvalidMetadata, match="does not apply to epp_running: the EPP counts it without a pool"):
        parse(metric="epp_running", inferencePool=POOL, podSelector="app=epp")
    with pytest.raises(InvalidMetadata, match="does not apply to engine signal vllm_queue"):
        parse(metric="vllm_queue", inferencePool=POOL, workload="llama")
    with pytest.raises(InvalidMetadata, match="inferencePool 'ml/llama' is not allowed; the EPP's inference_pool"):
        parse(metric="epp_saturation", inferencePool="ml/llama", podSelector="app=epp")
    with pytest.raises(InvalidMetadata, match="inferencePool 'Llama_3' is not allowed"):
        parse(metric="epp_saturation", inferencePool="Llama_3", podSelector="app=epp")
    with pytest.raises(InvalidMetadata, match="does not apply to GPU metric gpu_utilization"):
        parse_metadata({"metric": "gpu_utilization", "inferencePool": POOL}, LIMITS, namespace="ml", name="llama")


def test_epp_signals_take_a_trigger_of_their_own_and_saturation_is_never_summed() -> None:
    """signals refuses an EPP signal (its pods are not the model servers'), and aggregation 'sum' on the pool's
    saturation is refused; its default is the max."""
    with pytest.raises(InvalidMetadata, match="give it a trigger of its own"):
        parse_metadata({"signals": "vllm_queue:8,epp_queue:8", "workload": "llama"}, LIMITS, namespace="ml", name="x")
    with pytest.raises(InvalidMetadata, match="aggregation 'sum' is not allowed for epp_saturation"):
        parse(metric="epp_saturation", inferencePool=POOL, podSelector="app=epp", aggregation="sum")
    assert parse(metric="epp_saturation", inferencePool=POOL, podSelector="app=epp").aggregation.value == "max"


def epp_pod(name: str, number: int, *, ready: bool = True) -> PodInfo:
    """An EPP pod of app=epp in ml, serving its metrics on the EPP's default port."""
    return PodInfo(
        "ml",
        name,
        {"app": "epp"},
        "epp",
        "Deployment",
        ip=f"10.0.0.{number}",
        phase="Running",
        ready=ready,
        ports=(("metrics", DEFAULT_PORTS[Engine.EPP]),),
    )


def evaluate(metric: str, pods: list[tuple[PodInfo, str]]) -> tuple[float | None, Unavailable | None]:
    """``metric`` of pool POOL (where it names pools) over ``pods``, each with its page, at 10 s."""
    directory = Directory()
    scrapes = {}
    for info, text in pods:
        directory.add(info)
        scrapes[(info.namespace, info.pod)] = PodScrape(
            f"http://{info.ip}:9090/metrics", page_of(text, at=10.0), page_of(text, at=0.0)
        )
    pool = {"inferencePool": POOL} if metric != "epp_running" else {}
    query = parse(metric=metric, podSelector="app=epp", **pool)
    engines = cast("EngineSource", SimpleNamespace(timeout_seconds=1.0, max_pods=100, scrape=scrapes.get))
    evaluation = evaluate_engine(query, engines, directory, None, now=10.0)
    assert evaluation.error is None or isinstance(evaluation.error, Unavailable), evaluation.error
    return evaluation.value, evaluation.error


def test_epp_pods_combine_queues_by_sum_and_the_pools_saturation_by_max() -> None:
    """Two EPP replicas without leader election hold 3 and 4 requests: 7; they read the pool at 60% and 90%: 90%,
    never 150%."""
    a = epp_page({"waiting": 3, "kv": 0.6, "running": 2}, llmd=True)
    b = epp_page({"waiting": 4, "kv": 0.9, "running": 5}, llmd=False)
    pods = [(epp_pod("epp-a", 1), a), (epp_pod("epp-b", 2), b)]
    assert evaluate("epp_queue", pods) == (7.0, None)
    assert evaluate("epp_running", pods) == (7.0, None)
    value, error = evaluate("epp_saturation", pods)
    assert error is None
    assert value == pytest.approx(90.0)


@pytest.mark.parametrize("metric", ["epp_queue", "epp_queue_wait", "epp_saturation", "epp_running"])
def test_no_ready_epp_pod_is_unavailable_naming_the_selection_never_zero(metric: str) -> None:
    """A failover (the leader gone, the other not Ready) leaves no EPP pod that counts: the demand is unknown, and
    the answer names the selection and the pod left out; a model server's signal at zero is still a true 0."""
    standby = epp_pod("epp-b", 2, ready=False)
    value, error = evaluate(metric, [(standby, epp_page({"waiting": 9, "kv": 1.0}, llmd=True))])
    assert value is None
    assert error is not None
    assert f"{metric} of pods in namespace ml, podSelector app=epp" in error.message
    assert "no Ready epp pod is selected (pod ml/epp-b: not Ready" in error.message
    assert "never 0" in error.message
    value, error = evaluate(metric, [])
    assert error is not None
    assert "no pod at all" in error.message


def test_a_model_servers_queue_at_zero_replicas_is_still_a_true_zero() -> None:
    """engines.md's rule for model servers holds beside the EPP's: no vLLM pod that counts is 0."""
    directory = Directory()
    query = parse(metric="vllm_queue", workload="llama")
    engines = cast("EngineSource", SimpleNamespace(timeout_seconds=1.0, max_pods=100, scrape={}.get))
    evaluation = evaluate_engine(query, engines, directory, None, now=10.0)
    assert (evaluation.value, evaluation.error) == (0.0, None)
