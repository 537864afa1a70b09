"""The EPP's demand signals through a gateway in-process: fake EPPs on loopback (llm-d's page and GIE v1.5.0's)."""

from __future__ import annotations

import re
from pathlib import Path

import aiohttp
import pytest
from grpclib import GRPCError, Status
from grpclib.client import Channel
from rich.console import Console

from gpuscaler.client.explain import collect
from gpuscaler.client.render import report_renderable
from gpuscaler.model.engines import Engine
from tests.fakes.fake_engine import FakeEngine
from tests.gateway.calls import explain, value
from tests.gateway.conftest import StartGateway, StartNode
from tests.gateway.test_engine_signals import engines, gateway_with, write_pods

__all__ = ["engines"]  # the fixture, used by name

POOL = "vllm-llama3-8b-instruct"  # the fake EPP's --pool-name


async def serve_epp(started: list[FakeEngine], *, llmd: bool, **values: float) -> FakeEngine:
    """A fake EPP on loopback: current llm-d's page, or GIE v1.5.0's (``v0``)."""
    fake = await FakeEngine(Engine.EPP, dict(values), v0=not llmd).start()
    started.append(fake)
    return fake


async def test_the_pools_queue_sums_over_llm_d_and_gie_epps_in_explain_query_and_metrics(
    start_node: StartNode, start_gateway: StartGateway, engines: list[FakeEngine], tmp_path: Path
) -> None:
    """Two EPP replicas, one writing llm-d's names and one GIE v1.5.0's, hold 3 and 4 requests: KEDA gets 7, the
    pool's saturation is the larger of their 60% and 90%; Explain and `gpuscaler query` show each pod's value; the
    gateway's /metrics shows the series read per pod, with no label more."""
    a = await serve_epp(engines, llmd=True, waiting=3, kv=0.6)
    b = await serve_epp(engines, llmd=False, waiting=4, kv=0.9)
    pods = write_pods(tmp_path / "pods.yaml", ("epp-a", a, {}), ("epp-b", b, {}))
    gateway = await gateway_with(start_node, start_gateway, pods)
    assert await value(gateway, metric="epp_queue", inferencePool=POOL, workload="llm") == 7.0
    assert await value(gateway, metric="epp_saturation", inferencePool=POOL, workload="llm") == 90.0
    explained = await explain(gateway, metric="epp_queue", inferencePool=POOL, workload="llm")
    assert {p.pod: p.value for p in explained.pods} == {"epp-a": 3.0, "epp-b": 4.0}
    channel = Channel("127.0.0.1", gateway.port)
    try:
        metadata = {"metric": "epp_saturation", "inferencePool": POOL, "workload": "llm"}
        report = await collect(channel, metadata, scaled_object=("ml", "so"))
    finally:
        channel.close()
    console = Console(record=True, width=200)
    console.print(report_renderable(report))
    text = console.export_text()
    assert re.search(r"ml/epp-a .* 60\.000", text), text
    assert re.search(r"ml/epp-b .* 90\.000", text), text
    assert gateway.frontend.metrics is not None
    url = f"http://127.0.0.1:{gateway.frontend.metrics.port}/metrics"
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        page = await response.text()
    series = 'gpuscaler_gateway_engine_series{{namespace="ml",pod="{}",series="{}"}} {}'
    assert series.format("epp-a", "llm_d_epp_flow_control_queue_size", "3.0") in page
    assert series.format("epp-b", "inference_extension_flow_control_queue_size", "4.0") in page
    assert "inference_pool" not in page  # the pool filters what a query reads, and adds no series


async def test_no_ready_epp_is_unavailable_naming_it_never_zero(
    start_node: StartNode, start_gateway: StartGateway, engines: list[FakeEngine], tmp_path: Path
) -> None:
    """The only EPP pod not Ready (a failover): KEDA gets UNAVAILABLE naming it, and the pod is never read."""
    standby = await serve_epp(engines, llmd=True, waiting=9, kv=1.0)
    pods = write_pods(tmp_path / "pods.yaml", ("epp-b", standby, {"ready": False}))
    gateway = await gateway_with(start_node, start_gateway, pods)
    with pytest.raises(GRPCError) as raised:
        await value(gateway, metric="epp_queue", inferencePool=POOL, workload="llm")
    assert raised.value.status is Status.UNAVAILABLE
    assert "no Ready epp pod is selected (pod ml/epp-b: not Ready" in (raised.value.message or "")
    assert standby.requests == 0
