"""gRPC health (``grpc.health.v1``, ``protos/grpc/health/v1/health.proto``): Check and Watch over one status.

It answers as grpclib's ``grpclib.health.service.Health`` does for one ``ServiceStatus`` shared by the server
("") and the services it names. grpclib's service is built on protobuf-generated messages, so serving it loads
the protobuf runtime, which nothing else in the agent needs: about 15 ms of every start and 3.3 MiB resident.
These messages are betterproto2's, like the rest of our wire.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable
from typing import Any

from grpclib.const import Status
from grpclib.exceptions import GRPCError
from grpclib.health.check import ServiceStatus

from gpuscaler.generated.grpc.health.v1 import (
    HealthBase,
    HealthCheckRequest,
    HealthCheckResponse,
    HealthCheckResponseServingStatus,
)

SERVING_STATUS = {
    None: HealthCheckResponseServingStatus.UNKNOWN,
    True: HealthCheckResponseServingStatus.SERVING,
    False: HealthCheckResponseServingStatus.NOT_SERVING,
}


def service_names(services: Iterable[Any]) -> set[str]:
    """The gRPC service names ("package.Service") that ``services`` serve, from their method paths."""
    return {path.split("/")[1] for service in services for path in service.__mapping__()}


class HealthService(HealthBase):
    """The status of ``status`` for the whole server ("") and for each of ``services``; NOT_FOUND for others."""

    def __init__(self, status: ServiceStatus, services: Iterable[str]) -> None:
        self._status = status
        self._services = frozenset({"", *services})

    def _response(self) -> HealthCheckResponse:
        return HealthCheckResponse(status=SERVING_STATUS[self._status.__status__()])

    async def check(self, message: HealthCheckRequest) -> HealthCheckResponse:
        if message.service not in self._services:
            raise GRPCError(Status.NOT_FOUND, f"unknown service {message.service!r}")
        return self._response()

    async def watch(self, message: HealthCheckRequest) -> AsyncIterator[HealthCheckResponse]:
        if message.service not in self._services:
            # The protocol's answer for a service that may appear later; it never will here, so the stream waits
            # until the client ends it (or the server's drain closes it).
            yield HealthCheckResponse(status=HealthCheckResponseServingStatus.SERVICE_UNKNOWN)
            await asyncio.Event().wait()
        changed = await self._status.__subscribe__()
        try:
            while True:
                changed.clear()
                yield self._response()
                await changed.wait()
        finally:
            await self._status.__unsubscribe__(changed)
