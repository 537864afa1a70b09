"""gRPC health, asked through grpclib's own protobuf client as any health checker would ask."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from grpclib.client import Stream
from grpclib.const import Status
from grpclib.exceptions import GRPCError
from grpclib.health.check import ServiceStatus
from grpclib.health.v1.health_grpc import HealthStub
from grpclib.health.v1.health_pb2 import HealthCheckRequest, HealthCheckResponse
from grpclib.testing import ChannelFor

from gpuscaler.generated.externalscaler import ExternalScalerBase
from gpuscaler.server.health import HealthService, service_names

SCALER = "externalscaler.ExternalScaler"


@pytest.fixture
def status() -> ServiceStatus:
    """The status the service reports, SERVING at first."""
    status = ServiceStatus()
    status.set(True)
    return status


@pytest.fixture
async def health(status: ServiceStatus) -> AsyncIterator[HealthStub]:
    """grpclib's health client, talking to our health service over grpclib's in-memory channel."""
    async with ChannelFor([HealthService(status, [SCALER])]) as channel:
        yield HealthStub(channel)


async def next_status(stream: Stream[HealthCheckRequest, HealthCheckResponse]) -> int:
    """The status in the next message of a Watch stream."""
    response = await stream.recv_message()
    assert response is not None
    return response.status


def test_service_names_come_from_the_method_paths() -> None:
    """A servicer's gRPC service name is read from its method paths, as KEDA's probes name it."""
    assert service_names([ExternalScalerBase()]) == {SCALER}


@pytest.mark.parametrize("service", ["", SCALER])
async def test_check_answers_the_status(health: HealthStub, status: ServiceStatus, service: str) -> None:
    """Check answers SERVING or NOT_SERVING as the status is, for the server and for each named service."""
    assert (await health.Check(HealthCheckRequest(service=service))).status == HealthCheckResponse.SERVING
    status.set(False)
    assert (await health.Check(HealthCheckRequest(service=service))).status == HealthCheckResponse.NOT_SERVING


async def test_check_of_an_unknown_service_is_not_found(health: HealthStub) -> None:
    """Check of a service the server does not serve is NOT_FOUND, as the health protocol says."""
    with pytest.raises(GRPCError) as raised:
        await health.Check(HealthCheckRequest(service="no.such.Service"))
    assert raised.value.status == Status.NOT_FOUND


async def test_watch_sends_the_status_then_each_change(health: HealthStub, status: ServiceStatus) -> None:
    """Watch answers the status now, then every change of it, and nothing for a set that changes nothing."""
    async with health.Watch.open() as stream:
        await stream.send_message(HealthCheckRequest(service=SCALER), end=True)
        assert await next_status(stream) == HealthCheckResponse.SERVING
        status.set(True)
        status.set(False)
        assert await next_status(stream) == HealthCheckResponse.NOT_SERVING
        status.set(True)
        assert await next_status(stream) == HealthCheckResponse.SERVING
        await stream.cancel()


async def test_watch_of_an_unknown_service_says_so_and_stays_open(health: HealthStub) -> None:
    """Watch of an unknown service answers SERVICE_UNKNOWN and keeps the stream open."""
    async with health.Watch.open() as stream:
        await stream.send_message(HealthCheckRequest(service="no.such.Service"), end=True)
        assert await next_status(stream) == HealthCheckResponse.SERVICE_UNKNOWN
        await stream.cancel()
