"""Calls the engine tests make on a gateway: KEDA's value for some metadata, and Explain."""

from __future__ import annotations

from grpclib.client import Channel

from gpuscaler.gateway.process import Gateway
from gpuscaler.generated import externalscaler as keda
from gpuscaler.generated.gpuscaler import v1 as pb


async def metric_value(gateway: Gateway, **metadata: str) -> float:
    """GetMetricSpec, then GetMetrics with its metric name, as KEDA does, for ScaledObject ml/so."""
    channel = Channel("127.0.0.1", gateway.port)
    try:
        stub = keda.ExternalScalerStub(channel)
        scaled = keda.ScaledObjectRef(name="so", namespace="ml", scaler_metadata=metadata)
        spec = await stub.get_metric_spec(scaled)
        answer = await stub.get_metrics(
            keda.GetMetricsRequest(scaled_object_ref=scaled, metric_name=spec.metric_specs[0].metric_name)
        )
        return answer.metric_values[0].metric_value_float
    finally:
        channel.close()


async def explain(gateway: Gateway, **metadata: str) -> pb.Explanation:
    """The gateway's Explain for ``metadata`` from namespace ml."""
    channel = Channel("127.0.0.1", gateway.port)
    try:
        return await pb.AgentStub(channel).explain(pb.ExplainRequest(scaler_metadata=metadata, namespace="ml"))
    finally:
        channel.close()
