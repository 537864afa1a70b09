"""A test-only external scaler that implements StreamMetricSpec in front of a real gpuscaler gateway.

KEDA 2.21's ``StreamMetricSpec`` is left UNIMPLEMENTED by our gateway; to measure what implementing it would change,
this scaler serves KEDA's ``ExternalScaler`` service on loopback, passes IsActive, StreamIsActive, GetMetricSpec and
GetMetrics through to the gateway unchanged, and answers StreamMetricSpec with the gateway's own GetMetricSpec answer,
sent again every ``resend_seconds``: a new ScalersCache that KEDA builds after a scaler error gets the spec too, the
most an implementation could do for the fallback. It runs as its own process (``python -m``), so that a test can
SIGKILL it as a gateway dies; it logs one JSON line per event (started with its port, each stream opened, each spec
sent) for ``e2e.support.process.Process``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpclib.const
import grpclib.server
from grpclib.client import Channel
from grpclib.server import Server

from gpuscaler.generated.externalscaler import (
    ExternalScalerBase,
    ExternalScalerStub,
    GetMetricSpecResponse,
    GetMetricsRequest,
    GetMetricsResponse,
    IsActiveResponse,
    ScaledObjectRef,
)

STREAM_METRIC_SPEC = "/externalscaler.ExternalScaler/StreamMetricSpec"


@dataclass
class StreamingScaler(ExternalScalerBase):
    """The gateway at ``upstream_port`` behind a loopback server that also streams its metric spec."""

    upstream_port: int
    resend_seconds: float = 1.0
    port: int = 0
    _server: Server | None = None
    _channel: Channel | None = None
    _upstream: ExternalScalerStub | None = field(default=None, repr=False)

    async def start(self) -> StreamingScaler:
        self._channel = Channel("127.0.0.1", self.upstream_port)
        self._upstream = ExternalScalerStub(self._channel)
        self._server = Server([self])
        # A socket bound here gives the ephemeral port without reaching into grpclib's server.
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.bind(("127.0.0.1", 0))
        self.port = int(listener.getsockname()[1])
        await self._server.start(sock=listener)
        return self

    @property
    def upstream(self) -> ExternalScalerStub:
        assert self._upstream is not None, "start() first"
        return self._upstream

    async def is_active(self, message: ScaledObjectRef) -> IsActiveResponse:
        return await self.upstream.is_active(message)

    async def stream_is_active(self, message: ScaledObjectRef) -> AsyncIterator[IsActiveResponse]:
        async for answer in self.upstream.stream_is_active(message):
            yield answer

    async def get_metric_spec(self, message: ScaledObjectRef) -> GetMetricSpecResponse:
        return await self.upstream.get_metric_spec(message)

    async def get_metrics(self, message: GetMetricsRequest) -> GetMetricsResponse:
        return await self.upstream.get_metrics(message)

    async def _stream_metric_spec(self, stream: grpclib.server.Stream[ScaledObjectRef, GetMetricSpecResponse]) -> None:
        request = await stream.recv_message()
        assert request is not None
        log("stream_opened")
        while True:
            await stream.send_message(await self.upstream.get_metric_spec(request))
            log("spec_sent")
            await asyncio.sleep(self.resend_seconds)

    def __mapping__(self) -> dict[str, grpclib.const.Handler]:
        mapping = super().__mapping__()
        mapping[STREAM_METRIC_SPEC] = grpclib.const.Handler(
            self._stream_metric_spec, grpclib.const.Cardinality.UNARY_STREAM, ScaledObjectRef, GetMetricSpecResponse
        )
        return mapping


def log(event: str, **fields: object) -> None:
    """One JSON line on stdout, the shape ``Process`` reads."""
    print(json.dumps({"event": event, **fields}), flush=True)


async def serve(upstream_port: int) -> None:
    """Serves until killed."""
    scaler = await StreamingScaler(upstream_port).start()
    log("stream_metric_spec_started", port=scaler.port)
    await asyncio.Event().wait()


def main() -> None:
    """``python -m e2e.support.stream_metric_spec --upstream-port PORT``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--upstream-port", type=int, required=True, help="the gateway's loopback port")
    asyncio.run(serve(parser.parse_args().upstream_port))


if __name__ == "__main__":
    main()
