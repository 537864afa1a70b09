"""The one place where our errors become gRPC statuses.

Anything a user can cause maps to a specific code with our message; UNKNOWN and INTERNAL are left
for our own bugs, which are logged with their traceback.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import grpclib.server
import structlog
from grpclib.const import Status
from grpclib.exceptions import GRPCError

from gpuscaler.model.errors import (
    GpuscalerError,
    InvalidMetadata,
    InvalidRequest,
    NotServed,
    Unavailable,
    UnknownMetricName,
    Unsupported,
)

log = structlog.get_logger(__name__)

# grpc-message travels percent-encoded in an HTTP/2 trailer: grpcio refuses trailers over 8 KiB, and
# HPACK-encoding a megabyte blocks the event loop (and the poll loop with it). A message longer than this
# once encoded (it echoes a huge metadata value) is cut in the middle.
MAX_MESSAGE_BYTES = 6 * 1024

STATUS_FOR_ERROR: Mapping[type[GpuscalerError], Status] = {
    InvalidMetadata: Status.INVALID_ARGUMENT,
    InvalidRequest: Status.INVALID_ARGUMENT,
    UnknownMetricName: Status.NOT_FOUND,
    Unsupported: Status.FAILED_PRECONDITION,
    NotServed: Status.UNIMPLEMENTED,
    Unavailable: Status.UNAVAILABLE,
}


def time_left_of(stream: grpclib.server.Stream[Any, Any]) -> float | None:
    """Seconds left of the caller's deadline (its grpc-timeout), or None when it set none."""
    return stream.deadline.time_remaining() if stream.deadline is not None else None


def status_for(error: GpuscalerError) -> Status:
    """The status for ``error``: the one its nearest class has in STATUS_FOR_ERROR, INTERNAL for anything else."""
    for kind in type(error).__mro__:
        if kind in STATUS_FOR_ERROR:
            return STATUS_FOR_ERROR[kind]
    return Status.INTERNAL


def shorten(message: str, limit: int = MAX_MESSAGE_BYTES) -> str:
    """``message`` cut in the middle to about ``limit`` bytes on the wire, keeping its head (the key) and tail."""
    if _encoded_size(message) <= limit:
        return message
    head = _prefix_within(message[:limit], limit * 2 // 3)
    tail = _prefix_within(message[-limit:][::-1], limit // 3 - 100)[::-1]
    return f"{head}…({len(message) - len(head) - len(tail)} characters left out)…{tail}"


# grpc-message keeps printable ASCII but '%' as is, and percent-encodes every other byte of the UTF-8.
_KEPT_AS_IS = bytes(byte for byte in range(0x20, 0x7F) if byte != ord("%"))


def _encoded_size(text: str) -> int:
    """Bytes of ``text`` as grpc-message (counted in C: a message can echo kilobytes of metadata)."""
    encoded = text.encode("utf-8", "replace")
    return len(encoded) + 2 * len(encoded.translate(None, _KEPT_AS_IS))


def _prefix_within(text: str, budget: int) -> str:
    """The longest prefix of ``text`` whose encoded size is within ``budget`` (a binary search)."""
    low, high = 0, len(text)
    while low < high:
        middle = (low + high + 1) // 2
        if _encoded_size(text[:middle]) <= budget:
            low = middle
        else:
            high = middle - 1
    return text[:low]


def to_grpc_error(error: GpuscalerError) -> GRPCError:
    """``error`` as the GRPCError a handler raises: its status, and its message shortened to fit the trailer."""
    return GRPCError(status_for(error), shorten(error.message))


class grpc_errors:  # noqa: N801 - used as a function, ``async with grpc_errors("GetMetrics")``
    """Turn a GpuscalerError raised inside the block into its gRPC status.

    A class rather than an ``asynccontextmanager``: every call enters it, and a generator-based one costs an
    async generator, its first-iteration hook and two resumptions per call.
    """

    __slots__ = ("_method",)

    def __init__(self, method: str) -> None:
        self._method = method

    async def __aenter__(self) -> None:
        return None

    async def __aexit__(self, kind: type[BaseException] | None, error: BaseException | None, _: object) -> None:
        if isinstance(error, GpuscalerError):
            refusal = to_grpc_error(error)
            log.debug("rpc_refused", method=self._method, code=refusal.status.name, message=refusal.message)
            raise refusal from None
