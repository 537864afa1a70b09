"""A test-only external scaler in front of a real gpuscaler gateway that answers StreamMetricSpec UNIMPLEMENTED.

The gateway serves KEDA 2.21's ``StreamMetricSpec``; to measure what serving it changes, this scaler serves KEDA's
``ExternalScaler`` service on loopback, passes IsActive, StreamIsActive, GetMetricSpec and GetMetrics through to the
gateway unchanged, and answers StreamMetricSpec UNIMPLEMENTED, as the gateway did before and as a scaler without it
does (KEDA then gives it up for good). It runs as its own process (``python -m``), so that a test can SIGKILL it as
a gateway dies; it logs one JSON line per event (started with its port, each StreamMetricSpec refused) for
``e2e.support.process.Process``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpclib.const
from grpclib.client import Channel
from grpclib.exceptions import GRPCError
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


@dataclass
class UnimplementedSpecScaler(ExternalScalerBase):
    """The gateway at ``upstream_port`` behind a loopback server that refuses StreamMetricSpec UNIMPLEMENTED."""

    upstream_port: int
    port: int = 0
    _server: Server | None = None
    _channel: Channel | None = None
    _upstream: ExternalScalerStub | None = field(default=None, repr=False)

    async def start(self) -> UnimplementedSpecScaler:
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

    async def stream_metric_spec(self, message: ScaledObjectRef) -> AsyncIterator[GetMetricSpecResponse]:
        log("stream_refused")
        none: tuple[GetMetricSpecResponse, ...] = ()
        for response in none:  # none: a yield makes this the async generator the generated base's handler iterates
            yield response
        raise GRPCError(grpclib.const.Status.UNIMPLEMENTED, "StreamMetricSpec is not served here")


def log(event: str, **fields: object) -> None:
    """One JSON line on stdout, the shape ``Process`` reads."""
    print(json.dumps({"event": event, **fields}), flush=True)


async def serve(upstream_port: int) -> None:
    """Serves until killed."""
    scaler = await UnimplementedSpecScaler(upstream_port).start()
    log("unimplemented_spec_scaler_started", port=scaler.port)
    await asyncio.Event().wait()


def main() -> None:
    """``python -m e2e.support.stream_metric_spec --upstream-port PORT``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--upstream-port", type=int, required=True, help="the gateway's loopback port")
    asyncio.run(serve(parser.parse_args().upstream_port))


if __name__ == "__main__":
    main()
