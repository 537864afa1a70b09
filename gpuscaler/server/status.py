"""The one place where our errors become gRPC statuses.

Anything a user can cause maps to a specific code with our message; UNKNOWN and INTERNAL are left
for our own bugs, which are logged with their traceback.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager

import structlog
from grpclib.const import Status
from grpclib.exceptions import GRPCError

from gpuscaler.errors import GpuscalerError, InvalidMetadata, Unavailable, UnknownMetricName, Unsupported

log = structlog.get_logger(__name__)

STATUS_FOR_ERROR: Mapping[type[GpuscalerError], Status] = {
    InvalidMetadata: Status.INVALID_ARGUMENT,
    UnknownMetricName: Status.NOT_FOUND,
    Unsupported: Status.FAILED_PRECONDITION,
    Unavailable: Status.UNAVAILABLE,
}


def status_for(error: GpuscalerError) -> Status:
    for kind in type(error).__mro__:
        if kind in STATUS_FOR_ERROR:
            return STATUS_FOR_ERROR[kind]
    return Status.INTERNAL


def to_grpc_error(error: GpuscalerError) -> GRPCError:
    return GRPCError(status_for(error), error.message)


@asynccontextmanager
async def grpc_errors(method: str) -> AsyncIterator[None]:
    """Turn a GpuscalerError raised inside the block into its gRPC status."""
    try:
        yield
    except GpuscalerError as error:
        log.debug("rpc_refused", method=method, code=status_for(error).name, message=error.message)
        raise to_grpc_error(error) from None
