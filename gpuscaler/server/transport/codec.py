"""The protobuf codec, decoding each distinct KEDA request once and encoding each reused answer once."""

from __future__ import annotations

from typing import Any

from grpclib.encoding.proto import ProtoCodec

from gpuscaler.generated.externalscaler import GetMetricsRequest, GetMetricsResponse, IsActiveResponse, ScaledObjectRef
from gpuscaler.generated.gpuscaler.v1 import Snapshot as AgentSnapshot

# KEDA's requests, decoded once per distinct bytes (see ReusingCodec): at most this many, each at most this long.
REUSED_REQUESTS: frozenset[type[Any]] = frozenset({ScaledObjectRef, GetMetricsRequest})
REUSE_ENTRIES = 1024
REUSE_MAX_BYTES = 4096
# Answers a handler gives out again as the same, never-changed message object (ExternalScalerService's GetMetrics
# answers and its push streams' two, AgentService's snapshot without windows): encoded once.
REUSED_ANSWERS: frozenset[type[Any]] = frozenset({GetMetricsResponse, IsActiveResponse, AgentSnapshot})


class ReusingCodec(ProtoCodec):
    """grpclib's protobuf codec, decoding each distinct KEDA request once and encoding each reused answer once.

    KEDA sends every ScaledObject's IsActive, GetMetricSpec and GetMetrics requests with the same
    bytes at every poll, and decoding one with betterproto2 took about 90 us of a call's 900 on
    the 2-core machine. Equal bytes decode to equal messages, so those requests (up to
    REUSE_MAX_BYTES) are kept, the oldest of REUSE_ENTRIES dropped first. The handlers that get
    them only read them (ExternalScalerService), so one message can serve many calls. The other way,
    ExternalScalerService gives the same GetMetrics answer object until the value moves (REUSED_ANSWERS),
    and its bytes are kept with it, as betterproto2 took about 28 us to encode one.
    """

    def __init__(self) -> None:
        super().__init__()
        self._decoded: dict[tuple[type[Any], bytes], Any] = {}
        # By id(): betterproto2 messages are not hashable. The entry keeps its message alive, so the id is
        # not reused by another object while the entry is here, and the ``is`` check below stays exact.
        self._encoded: dict[int, tuple[Any, bytes]] = {}

    def encode(self, message: Any, message_type: type[Any]) -> bytes:
        if message_type not in REUSED_ANSWERS:
            return super().encode(message, message_type)
        kept = self._encoded.get(id(message))
        if kept is not None and kept[0] is message:
            return kept[1]
        data = super().encode(message, message_type)
        if len(self._encoded) >= REUSE_ENTRIES:
            del self._encoded[next(iter(self._encoded))]
        self._encoded[id(message)] = (message, data)
        return data

    def decode(self, data: bytes, message_type: type[Any]) -> Any:
        if message_type not in REUSED_REQUESTS or len(data) > REUSE_MAX_BYTES:
            return super().decode(data, message_type)
        key = (message_type, bytes(data))
        message = self._decoded.get(key)
        if message is None:
            message = super().decode(data, message_type)
            if len(self._decoded) >= REUSE_ENTRIES:
                del self._decoded[next(iter(self._decoded))]
            self._decoded[key] = message
        return message
