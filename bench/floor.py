"""The least ExternalScaler server our stack makes: grpclib and betterproto2 answering a constant, nothing else.

    .venv/bin/python -m bench unary --command '.venv/bin/python -m bench.floor --port {port}' --name floor \
        --streams 0 --callers 1

Every answer is the same GetMetricsResponse (one metric, value 1), made once; IsActive says true; health says
SERVING. No query is parsed, no sample read, no telemetry kept. Its latency is what grpclib, h2, hpack and
betterproto2 cost per call on this machine: the floor under any agent on the card's stack, as
``bench.gateway --receive-only`` is under the gateway. bench/README.md reads it beside ours and the prior art.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import AsyncIterator

from grpclib.health.check import ServiceStatus
from grpclib.server import Server
from grpclib.utils import graceful_exit

from gpuscaler.generated import externalscaler as keda
from gpuscaler.server.health import HealthService, service_names

METRICS = keda.GetMetricsResponse(metric_values=[keda.MetricValue(metric_name="floor", metric_value_float=1.0)])
SPEC = keda.GetMetricSpecResponse(metric_specs=[keda.MetricSpec(metric_name="floor", target_size_float=1.0)])


class ConstantScaler(keda.ExternalScalerBase):
    """Answers every call with the same message."""

    async def is_active(self, message: keda.ScaledObjectRef) -> keda.IsActiveResponse:
        return keda.IsActiveResponse(result=True)

    async def stream_is_active(self, message: keda.ScaledObjectRef) -> AsyncIterator[keda.IsActiveResponse]:
        yield keda.IsActiveResponse(result=True)
        await asyncio.Event().wait()  # held open, as KEDA holds it

    async def get_metric_spec(self, message: keda.ScaledObjectRef) -> keda.GetMetricSpecResponse:
        return SPEC

    async def get_metrics(self, message: keda.GetMetricsRequest) -> keda.GetMetricsResponse:
        return METRICS


def make_server() -> Server:
    """The constant scaler and a health service that says SERVING."""
    scaler = ConstantScaler()
    status = ServiceStatus()
    status.set(True)
    return Server([scaler, HealthService(status, service_names([scaler]))])


async def serve(port: int) -> None:
    """Serve on 127.0.0.1:``port`` until SIGTERM or SIGINT."""
    server = make_server()
    with graceful_exit([server]):
        await server.start("127.0.0.1", port)
        await server.wait_closed()


def main() -> None:
    """``--port N``: serve there."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True, help="the gRPC port, on 127.0.0.1")
    asyncio.run(serve(parser.parse_args().port))


if __name__ == "__main__":
    main()
