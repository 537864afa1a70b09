"""The calls the gateway tests make: KEDA's value for some metadata, Explain, push results, and waiting for a view."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from grpclib.client import Channel

from gpuscaler.gateway.process import Gateway
from gpuscaler.generated import externalscaler as keda
from gpuscaler.generated.gpuscaler import v1 as pb
from tests.waiting import until


def ref(namespace: str = "ml", **metadata: str) -> keda.ScaledObjectRef:
    """A ScaledObjectRef named so in ``namespace``, with ``metadata`` as its trigger's."""
    return keda.ScaledObjectRef(name="so", namespace=namespace, scaler_metadata=metadata)


async def value(gateway: Gateway, **metadata: str) -> float:
    """The value the gateway gives KEDA for ``metadata``: GetMetricSpec, then GetMetrics with its metric name."""
    channel = Channel("127.0.0.1", gateway.port)
    try:
        stub = keda.ExternalScalerStub(channel)
        scaled = ref(**metadata)
        spec = await stub.get_metric_spec(scaled)
        answer = await stub.get_metrics(
            keda.GetMetricsRequest(scaled_object_ref=scaled, metric_name=spec.metric_specs[0].metric_name)
        )
        return answer.metric_values[0].metric_value_float
    finally:
        channel.close()


async def explain(gateway: Gateway, **metadata: str) -> pb.Explanation:
    """The gateway's Explain for ``metadata`` from namespace ml: the nodes, GPUs and pods behind the value."""
    channel = Channel("127.0.0.1", gateway.port)
    try:
        return await pb.AgentStub(channel).explain(pb.ExplainRequest(scaler_metadata=metadata, namespace="ml"))
    finally:
        channel.close()


async def view_has(gateway: Gateway, nodes: int) -> None:
    """Wait (up to 10 s) until the gateway's cluster view holds ``nodes`` nodes."""
    await until(lambda: gateway.view.latest is not None and len(gateway.view.latest.nodes) == nodes, timeout=10)


@contextlib.asynccontextmanager
async def pushed(gateway: Gateway, scaled: keda.ScaledObjectRef) -> AsyncIterator[list[bool]]:
    """Every StreamIsActive result the gateway sends for ``scaled`` while the block runs, in order."""
    channel = Channel("127.0.0.1", gateway.port)
    seen: list[bool] = []
    stream = keda.ExternalScalerStub(channel).stream_is_active(scaled)

    async def read() -> None:
        async for message in stream:
            seen.append(message.result)

    reader = asyncio.create_task(read())
    try:
        yield seen
    finally:
        reader.cancel()
        await asyncio.gather(reader, return_exceptions=True)
        channel.close()
