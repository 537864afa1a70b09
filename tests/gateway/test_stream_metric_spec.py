"""A gateway's StreamMetricSpec records what GetMetricSpec records and nothing more: no window is asked of the
agents, no push stream's evaluation is made, and /metrics learns only the target, while it is open and after."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

from grpclib.client import Channel

from gpuscaler.generated import externalscaler as keda
from tests.gateway.calls import ref, view_has
from tests.gateway.conftest import StartGateway, StartNode
from tests.gateway.test_telemetry import scrape
from tests.waiting import until

# A windowed trigger: a GetMetrics or a StreamIsActive for it would make the gateway ask its agents for the window.
WINDOWED = {"metric": "gpu_utilization", "window": "30s", "windowFunction": "max", "targetValue": "40"}


async def test_a_spec_stream_asks_the_agents_for_nothing_and_records_only_the_target(
    start_node: StartNode, start_gateway: StartGateway
) -> None:
    """The stream's one message is GetMetricSpec's; while it is open and after it ends, the windows the gateway
    asks for are none and no push stream is held, and /metrics has the target and no value."""
    node = await start_node("node-a")
    gateway = await start_gateway(node)
    await view_has(gateway, 1)
    channel = Channel("127.0.0.1", gateway.port)
    try:
        stub = keda.ExternalScalerStub(channel)
        scaled = ref(**WINDOWED)
        stream = stub.stream_metric_spec(scaled)
        first = await asyncio.wait_for(anext(stream), timeout=10)
        assert first == await stub.get_metric_spec(scaled)
        await until(lambda: gateway.frontend.scaler.open_spec_streams == 1)
        assert gateway.view.windows == ()
        assert gateway.frontend.scaler.open_streams == 0
        exposition = await scrape(gateway)
        assert isinstance(stream, AsyncGenerator)
        await stream.aclose()  # the client goes
    finally:
        channel.close()
    await until(lambda: gateway.frontend.scaler.open_spec_streams == 0)
    assert gateway.view.windows == ()
    targets = exposition.get("gpuscaler_scaler_metric_target", [])
    assert [(sample.labels["scaled_object"], sample.value) for sample in targets] == [("so", 40.0)], targets
    assert exposition.get("gpuscaler_scaler_metric_value", []) == []
