"""bench/floor.py, the least server on our stack that the agent's latency is read against, so that it cannot rot."""

from __future__ import annotations

from grpclib.client import Channel

from bench.floor import METRICS, make_server
from gpuscaler.generated import externalscaler as keda
from gpuscaler.generated.grpc.health.v1 import HealthCheckRequest, HealthCheckResponseServingStatus, HealthStub


async def test_the_floor_answers_a_constant_and_says_serving() -> None:
    """GetMetrics gives the one prepared answer whatever is asked; health is SERVING for the server and the scaler."""
    server = make_server()
    await server.start("127.0.0.1", 0)
    port = server._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    channel = Channel("127.0.0.1", port)
    try:
        scaler = keda.ExternalScalerStub(channel)
        request = keda.GetMetricsRequest(scaled_object_ref=keda.ScaledObjectRef(name="x", namespace="y"))
        assert await scaler.get_metrics(request) == METRICS
        assert (await scaler.is_active(keda.ScaledObjectRef(name="x"))).result is True
        health = HealthStub(channel)
        for service in ("", "externalscaler.ExternalScaler"):
            answer = await health.check(HealthCheckRequest(service=service))
            assert answer.status == HealthCheckResponseServingStatus.SERVING
    finally:
        channel.close()
        server.close()
        await server.wait_closed()
