"""The epp-wake profile: active while the EPP holds a request queued or running, unknown without a Ready EPP."""

from __future__ import annotations

from types import SimpleNamespace
from typing import cast

import pytest

from gpuscaler.model.engines import PodScrape
from gpuscaler.model.errors import InvalidMetadata, Unavailable
from gpuscaler.model.pods import PodInfo
from gpuscaler.query.metadata import Limits, parse_metadata
from gpuscaler.query.query import CombinedQuery, EngineQuery, Query
from gpuscaler.signals.activation import next_state
from gpuscaler.signals.combined import evaluate_combined
from gpuscaler.signals.engines.evaluation import evaluate_engine
from gpuscaler.signals.engines.source import EngineSource
from tests.engines.test_epp import POOL, epp_pod, page_of
from tests.fakes.fake_engine import epp_page
from tests.signals.test_evaluation_workloads import Directory

LIMITS = Limits(history_seconds=300.0, cluster=True)


def wake(**keys: str) -> Query:
    """The epp-wake profile's query on the EPP pods of app=epp in ml."""
    return parse_metadata(
        {"profile": "epp-wake", "inferencePool": POOL, "podSelector": "app=epp", **keys}, LIMITS, namespace="ml"
    )


def answer(query: Query, pods: list[tuple[PodInfo, str]]) -> tuple[float | None, Unavailable | None]:
    """``query`` over ``pods``, each with its page, at 10 s: the evaluator's value and error."""
    directory = Directory()
    scrapes = {}
    for info, text in pods:
        directory.add(info)
        scrapes[(info.namespace, info.pod)] = PodScrape(
            f"http://{info.ip}:9090/metrics", page_of(text, at=10.0), page_of(text, at=0.0)
        )
    engines = cast("EngineSource", SimpleNamespace(timeout_seconds=1.0, max_pods=100, scrape=scrapes.get))
    assert isinstance(query.value, CombinedQuery)

    def one(part: object) -> object:
        assert isinstance(part, EngineQuery)
        return evaluate_engine(part, engines, directory, None, now=10.0)

    evaluation = evaluate_combined(query.value, one)  # type: ignore[arg-type]
    assert evaluation.error is None or isinstance(evaluation.error, Unavailable), evaluation.error
    return evaluation.value, evaluation.error


def test_epp_wake_reads_the_pools_queue_and_the_epps_running_requests() -> None:
    """The profile is the queue (8 a replica) and the running requests (32 a replica) of one EPP selection, the pool
    filtering the queue alone (running requests carry no pool label), active above 0 and inactive only at 0."""
    query = wake()
    assert isinstance(query.value, CombinedQuery)
    parts = {part.query.name: (part.target, getattr(part.query, "pool", None)) for part in query.value.signals}
    assert parts == {"epp_queue": (8.0, POOL), "epp_running": (32.0, None)}
    assert (query.activation.activation_threshold, query.activation.deactivation_threshold) == (0.0, 0.0)
    assert query.profile == "epp-wake"


@pytest.mark.parametrize(
    ("previous", "values", "active"),
    [
        pytest.param(None, {"waiting": 0, "running": 0}, False, id="idle-pool-stays-at-zero"),
        pytest.param(False, {"waiting": 1, "running": 0}, True, id="first-queued-request-wakes"),
        pytest.param(True, {"waiting": 0, "running": 3}, True, id="running-requests-keep-it-awake"),
        pytest.param(True, {"waiting": 0, "running": 0}, False, id="nothing-left-lets-it-go"),
    ],
)
def test_epp_wake_is_active_while_a_request_is_queued_or_running(
    previous: bool | None, values: dict[str, float], active: bool
) -> None:
    """The evaluator's answer for an EPP page with the kv gauge (flow control on) and ``values``, through the
    profile's activation rule from ``previous``: one queued request activates, running requests alone keep it."""
    query = wake()
    value, error = answer(query, [(epp_pod("epp-a", 1), epp_page({**values, "kv": 0.0}, llmd=True))])
    assert error is None
    assert value is not None
    assert next_state(previous, value, query.activation) is active


@pytest.mark.parametrize("llmd", [True, False], ids=["llm-d", "gie-v1.5.0"])
def test_epp_wake_without_a_ready_epp_is_unavailable_never_inactive(llmd: bool) -> None:
    """No Ready EPP pod (a failover) makes the wake answer UNAVAILABLE naming the signal, never 0 (inactive)."""
    standby = epp_pod("epp-b", 2, ready=False)
    value, error = answer(wake(), [(standby, epp_page({"waiting": 2, "running": 1, "kv": 1.0}, llmd=llmd))])
    assert value is None
    assert error is not None
    assert "signal epp_queue: epp_queue of" in error.message
    assert "no Ready epp pod is selected (pod ml/epp-b: not Ready" in error.message
    value, error = answer(wake(), [])
    assert value is None
    assert error is not None


def test_signals_takes_the_epps_summed_signals_together_and_refuses_the_rest() -> None:
    """signals may combine the EPP's queue and running requests (one selection, the EPP's pods), but not an EPP
    signal with a model server's, nor the pool's saturation or queue wait (not sums over the EPP's pods), and it
    refuses inferencePool where no signal names a pool."""
    query = parse_metadata(
        {"signals": "epp_queue:4,epp_running:16", "inferencePool": POOL, "podSelector": "app=epp"},
        LIMITS,
        namespace="ml",
    )
    assert isinstance(query.value, CombinedQuery)
    with pytest.raises(InvalidMetadata, match="give it a trigger of its own"):
        parse_metadata({"signals": "epp_running:8,vllm_queue:8", "workload": "llm"}, LIMITS, namespace="ml")
    with pytest.raises(InvalidMetadata, match="epp_saturation, which is one value for the whole pool"):
        parse_metadata(
            {"signals": "epp_queue:8,epp_saturation:80", "inferencePool": POOL, "podSelector": "app=epp"},
            LIMITS,
            namespace="ml",
        )
    with pytest.raises(InvalidMetadata, match="epp_queue needs inferencePool"):
        parse_metadata({"profile": "epp-wake", "podSelector": "app=epp"}, LIMITS, namespace="ml")
    with pytest.raises(InvalidMetadata, match="key 'inferencePool' does not apply to signals"):
        parse_metadata({"signals": "vllm_queue:8,vllm_kv_cache:80", "inferencePool": POOL}, LIMITS, namespace="ml")
