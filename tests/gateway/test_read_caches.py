"""A read at a gateway (Explain, a preview of KEDA's calls) uses an evaluation KEDA's calls kept for the newest
snapshot or scrape, and keeps none it makes: the evaluator's kept evaluations and node memo are as it found them."""

from __future__ import annotations

from gpuscaler.model.engines import EnginePage, PodScrape
from gpuscaler.query.metadata import Limits, parse_metadata
from gpuscaler.query.query import Query
from tests.gateway.test_read_windows import gateway
from tests.signals.test_engine_interest import OWN, Engines
from tests.signals.test_engine_interest import gateway as engine_gateway


def cluster(**metadata: str) -> Query:
    """A query over every GPU of the cluster (so the node memo keeps its nodes' parts)."""
    return parse_metadata(metadata, Limits(3600, cluster=True))


KEDAS = cluster(aggregation="avg")
NOBODYS = cluster(aggregation="max")


async def test_a_read_of_a_query_no_keda_call_asked_keeps_nothing() -> None:
    """KEDA's query is evaluated (kept, its node's part in the memo); a read of another query answers it, and the
    evaluations and memo kept are exactly those before, for this snapshot and at the next one's first evaluation."""
    async with gateway() as (view, evaluator, _, agent):
        assert evaluator.evaluate(KEDAS.value).value == 50.0
        before = evaluator.kept()
        assert before == (frozenset({KEDAS.value}), {KEDAS.value: frozenset({"node-a"})})
        assert (await evaluator.read(NOBODYS)).value == 50.0
        assert evaluator.kept() == before
        # At the next snapshot, the memo keeps the queries evaluated at the last: KEDA's, not the read's.
        sequence = view.latest.sequence if view.latest is not None else 0
        agent.send()
        await view.wait_newer(sequence)
        assert evaluator.evaluate(KEDAS.value).value == 50.0
        assert evaluator.kept() == before


async def test_a_read_of_a_query_keda_asked_gets_keda_s_evaluation() -> None:
    """The read answers with the very evaluation KEDA's call kept for this snapshot, evaluating nothing anew."""
    async with gateway() as (_, evaluator, _, _):
        kedas = evaluator.evaluate(KEDAS.value)
        before = evaluator.kept()
        assert await evaluator.read(KEDAS) is kedas
        assert evaluator.kept() == before


async def test_an_engine_read_uses_keda_s_evaluation_of_this_scrape_and_keeps_none_of_its_own() -> None:
    """KEDA's engine query is prepared (its pods wanted, read) and evaluated: a read of it is that evaluation; a read
    of another query on the same pods (read by KEDA's interest, so not read once) keeps no evaluation of its own."""
    engines = Engines()
    evaluator, kedas = engine_gateway(engines)
    page = EnginePage(values={"vllm:num_requests_waiting": 3.0}, at=99.5)
    engines.scrapes = {pod: PodScrape("http://10.0.0.1:8000/metrics", page) for pod in OWN}
    await evaluator.prepare(kedas)
    evaluation = evaluator.evaluate(kedas.value)
    before = evaluator.kept()
    assert before == (frozenset({kedas.value}), {})
    assert await evaluator.read(kedas) is evaluation
    other = evaluator.parse({"metric": "vllm_queue", "workload": "llm", "scrapeInterval": "2s"}, "ml", "llm")
    assert (await evaluator.read(other)).value == 6.0
    assert evaluator.kept() == before
