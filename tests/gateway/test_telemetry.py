"""The gateway's /metrics and /healthz, scraped over HTTP and parsed with the Prometheus client's parser."""

from __future__ import annotations

import aiohttp
from grpclib.client import Channel
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from gpuscaler.gateway.process import Gateway
from gpuscaler.generated import externalscaler as keda
from tests.gateway.conftest import StartGateway, StartNode
from tests.waiting import until, until_result


async def scrape(gateway: Gateway) -> dict[str, list[Sample]]:
    """Every sample on the gateway's /metrics, by series name; the scrape must answer 200."""
    assert gateway.frontend.metrics is not None
    url = f"http://127.0.0.1:{gateway.frontend.metrics.port}/metrics"
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        assert response.status == 200
        text = await response.text()
    series: dict[str, list[Sample]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            series.setdefault(sample.name, []).append(sample)
    return series


async def healthz(gateway: Gateway) -> int:
    """The HTTP status the gateway's /healthz answers."""
    assert gateway.frontend.metrics is not None
    url = f"http://127.0.0.1:{gateway.frontend.metrics.port}/healthz"
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        return response.status


def by_labels(samples: list[Sample], *names: str) -> dict[tuple[str, ...], float]:
    """Each sample's value, keyed by its values of the labels ``names``."""
    return {tuple(s.labels[name] for name in names): s.value for s in samples}


async def test_metrics_show_each_agent_node_and_rpc(start_node: StartNode, start_gateway: StartGateway) -> None:
    """Agents by state, each agent heard with its snapshot age and count, RPCs, streams and compositions."""
    a, b = await start_node("node-a"), await start_node("node-b")
    gateway = await start_gateway(a, b)
    await until(lambda: gateway.view.latest is not None and len(gateway.view.latest.nodes) == 2, timeout=10)
    channel = Channel("127.0.0.1", gateway.port)
    try:
        ref = keda.ScaledObjectRef(name="so", namespace="ml", scaler_metadata={})
        await keda.ExternalScalerStub(channel).is_active(ref)
    finally:
        channel.close()

    series = await scrape(gateway)
    states = by_labels(series["gpuscaler_gateway_agents"], "state")
    assert states[("heard",)] == 2
    assert states[("silent",)] == states[("unheard",)] == 0
    heard = by_labels(series["gpuscaler_gateway_agent_heard"], "node")
    assert heard == {("node-a",): 1.0, ("node-b",): 1.0}
    ages = by_labels(series["gpuscaler_gateway_node_snapshot_age_seconds"], "node")
    assert set(ages) == {("node-a",), ("node-b",)}
    assert all(0 <= age < 5 for age in ages.values())
    snapshots = by_labels(series["gpuscaler_gateway_agent_snapshots_total"], "node")
    assert all(count >= 1 for count in snapshots.values())
    assert series["gpuscaler_gateway_gpus"][0].value == 4
    handled = by_labels(series["gpuscaler_rpc_handled_total"], "method", "code")
    assert handled[("/externalscaler.ExternalScaler/IsActive", "OK")] == 1
    assert series["gpuscaler_gateway_compose_duration_seconds_count"][0].value >= 1
    assert await until_result(lambda: healthz(gateway), lambda code: code == 200, timeout=10) == 200

    await b.stop()
    silent = await until_result(
        lambda: scrape(gateway),
        lambda s: by_labels(s["gpuscaler_gateway_agents"], "state")[("silent",)] == 1,
        timeout=10,
    )
    assert by_labels(silent["gpuscaler_gateway_agent_heard"], "node")[("node-b",)] == 0.0
    await a.stop()
    assert await until_result(lambda: healthz(gateway), lambda code: code == 503, timeout=10) == 503
