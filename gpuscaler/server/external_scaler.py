"""KEDA's ExternalScaler service (``protos/externalscaler.proto``), answered from the evaluator.

betterproto2 names handlers in snake_case (``get_metrics`` serves ``GetMetrics``); the wire names are KEDA's. A call
marked as a preview (``preview.py``: ``gpuscaler query``) gets the answer KEDA would get now, and nothing is kept:
it is evaluated by ``Evaluator.read``, not prepared, so it wants no engine pod.
"""

from __future__ import annotations

import asyncio
import functools
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpclib.const
import grpclib.server
import structlog

from gpuscaler.generated.externalscaler import (
    ExternalScalerBase,
    GetMetricSpecResponse,
    GetMetricsRequest,
    GetMetricsResponse,
    IsActiveResponse,
    MetricSpec,
    MetricValue,
    ScaledObjectRef,
)
from gpuscaler.model.errors import InvalidMetadata, UnknownMetricName
from gpuscaler.query.query import Query
from gpuscaler.server.preview import PREVIEW_HEADER, PREVIEW_VALUE
from gpuscaler.server.push_streams import QueuedEvent, StreamLines
from gpuscaler.server.status import grpc_errors, time_left_of
from gpuscaler.server.telemetry import ScalerAnswers
from gpuscaler.server.transport.sliced_work import sliced_queue
from gpuscaler.signals.evaluator import Evaluator

log = structlog.get_logger(__name__)


INT64_MAX = 2**63 - 1
# GetMetrics answers kept for reuse (one per distinct metric and value), the oldest dropped first.
KEPT_RESPONSES = 1024
# IsActive's and a push stream's two possible answers, the same message objects every time: encoded once (codec.py).
ANSWERS = {True: IsActiveResponse(result=True), False: IsActiveResponse(result=False)}


def round_half_up(value: float) -> int:
    """The int field older KEDA reads: 2.5 -> 3, not Python's banker's 2; capped to fit the int64 field."""
    return min(math.floor(value + 0.5), INT64_MAX)


class ExternalScalerService(ExternalScalerBase):
    """KEDA's five calls. Requests are only read: calls with the same request bytes share one message.

    ``answers``, when given, learns each ScaledObject's target, value and failed GetMetrics for /metrics. A call
    whose metadata marks it as a preview (``preview=True`` below) is answered the same, from the state as it is:
    no activation state moves, and neither ``answers`` nor the evaluator's records learn of it.
    """

    def __init__(self, evaluator: Evaluator, answers: ScalerAnswers | None = None) -> None:
        self._evaluator = evaluator
        self._answers = answers
        self.open_streams = 0
        self._responses: dict[tuple[str, str], GetMetricsResponse] = {}
        self._opened_lines = StreamLines("stream_opened")
        self._closed_lines = StreamLines("stream_closed")
        # Each open StreamMetricSpec's end, set when the server closes (``evaluator.on_close``).
        self._spec_streams: set[asyncio.Future[None]] = set()
        self._spec_opened_lines = StreamLines("spec_stream_opened")
        self._spec_closed_lines = StreamLines("spec_stream_closed")
        evaluator.on_close.append(self._end_spec_streams)

    def _query(self, ref: ScaledObjectRef | None) -> Query:
        if ref is None:
            raise InvalidMetadata("scaledObjectRef is missing; KEDA always sends it, so is this client KEDA?")
        return self._evaluator.parse(ref.scaler_metadata, ref.namespace, ref.name)

    def __mapping__(self) -> dict[str, grpclib.const.Handler]:
        """The generated handlers' paths, each served by one that reads whether the call is a preview."""
        mapping = super().__mapping__()
        served: dict[str, Callable[[grpclib.server.Stream[Any, Any]], Awaitable[None]]] = {
            "/externalscaler.ExternalScaler/IsActive": self._serve_is_active,
            "/externalscaler.ExternalScaler/StreamIsActive": self._serve_stream_is_active,
            "/externalscaler.ExternalScaler/GetMetricSpec": self._serve_get_metric_spec,
            "/externalscaler.ExternalScaler/GetMetrics": self._serve_get_metrics,
            "/externalscaler.ExternalScaler/StreamMetricSpec": self._serve_stream_metric_spec,
        }
        return {path: handler._replace(func=served[path]) for path, handler in mapping.items()}

    async def _serve_is_active(self, stream: grpclib.server.Stream[ScaledObjectRef, IsActiveResponse]) -> None:
        request = await stream.recv_message()
        assert request is not None
        await stream.send_message(
            await self.is_active(request, preview=_preview(stream), time_left=time_left_of(stream))
        )

    async def _serve_stream_is_active(self, stream: grpclib.server.Stream[ScaledObjectRef, IsActiveResponse]) -> None:
        request = await stream.recv_message()
        assert request is not None
        async for response in self.stream_is_active(request, preview=_preview(stream), time_left=time_left_of(stream)):
            await stream.send_message(response)

    async def _serve_get_metric_spec(
        self, stream: grpclib.server.Stream[ScaledObjectRef, GetMetricSpecResponse]
    ) -> None:
        request = await stream.recv_message()
        assert request is not None
        await stream.send_message(await self.get_metric_spec(request, preview=_preview(stream)))

    async def _serve_stream_metric_spec(
        self, stream: grpclib.server.Stream[ScaledObjectRef, GetMetricSpecResponse]
    ) -> None:
        request = await stream.recv_message()
        assert request is not None
        async for response in self.stream_metric_spec(request, preview=_preview(stream)):
            await stream.send_message(response)

    async def _serve_get_metrics(self, stream: grpclib.server.Stream[GetMetricsRequest, GetMetricsResponse]) -> None:
        request = await stream.recv_message()
        assert request is not None
        await stream.send_message(
            await self.get_metrics(request, preview=_preview(stream), time_left=time_left_of(stream))
        )

    async def is_active(
        self, message: ScaledObjectRef, *, preview: bool = False, time_left: float | None = None
    ) -> IsActiveResponse:
        async with grpc_errors("IsActive"):
            query = self._query(message)
            if preview:
                value = await self._evaluator.preview_value(query, time_left=time_left)
                return ANSWERS[self._evaluator.would_be_active(query, value)]
            await self._evaluator.prepare(query, time_left=time_left)
            return ANSWERS[self._evaluator.is_active(query, (message.namespace, message.name))]

    async def get_metric_spec(self, message: ScaledObjectRef, *, preview: bool = False) -> GetMetricSpecResponse:
        async with grpc_errors("GetMetricSpec"):
            query = self._query(message)
        if self._answers is not None and not preview:
            self._answers.observe_target(message.namespace, message.name, query)
        spec = MetricSpec(
            metric_name=query.metric_name,
            target_size=max(1, round_half_up(query.target)),
            target_size_float=query.target,
        )
        return GetMetricSpecResponse(metric_specs=[spec])

    async def stream_metric_spec(
        self, message: ScaledObjectRef, *, preview: bool = False
    ) -> AsyncIterator[GetMetricSpecResponse]:
        """KEDA 2.21's spec stream, which it opens only for ``external-push`` triggers: GetMetricSpec's answer at
        once (the same errors, the same record), then held open until the client goes or the server closes.

        A trigger's spec is its metadata's metric name and target, and a stream's metadata never changes, so the
        first message is the only one: the stream holds no timer, task or subscription, only the future the close
        sets, and reads and changes nothing else (no interest, no activation state). KEDA keeps a streamed spec in
        its scalers cache, so with every gateway unreachable an ``external-push`` trigger with failureThreshold 0
        gets its fallback (docs/gateway.md). A preview sends the one message and ends.
        """
        yield await self.get_metric_spec(message, preview=preview)
        if preview or self._evaluator.closing:
            return
        ended = asyncio.get_running_loop().create_future()
        self._spec_streams.add(ended)
        scaled_object = f"{message.namespace}/{message.name}"
        self._spec_opened_lines(scaled_object=scaled_object)
        reason = "client_gone"
        try:
            await ended  # ends OK at the close; a client that goes cancels this
            reason = "shutdown"
        finally:
            self._spec_streams.discard(ended)
            self._spec_closed_lines(scaled_object=scaled_object, reason=reason)

    @property
    def open_spec_streams(self) -> int:
        """StreamMetricSpec streams held open now (past their one message)."""
        return len(self._spec_streams)

    def _end_spec_streams(self) -> None:
        """End every spec stream OK, a slice a turn as the push streams are woken (push_streams.py)."""
        queue = sliced_queue()
        for ended in self._spec_streams:
            queue.add(functools.partial(_end, ended))

    async def get_metrics(
        self, message: GetMetricsRequest, *, preview: bool = False, time_left: float | None = None
    ) -> GetMetricsResponse:
        ref = message.scaled_object_ref
        answers = None if preview else self._answers
        query: Query | None = None
        try:
            async with grpc_errors("GetMetrics"):
                query = self._query(ref)
                if message.metric_name.lower() != query.metric_name.lower():
                    raise UnknownMetricName(
                        f"metricName {message.metric_name!r} is not this trigger's metric; "
                        f"GetMetricSpec named it {query.metric_name!r}"
                    )
                if preview:
                    value = await self._evaluator.preview_value(query, time_left=time_left)
                else:
                    await self._evaluator.prepare(query, time_left=time_left)
                    value = self._evaluator.value(query, (ref.namespace, ref.name) if ref is not None else None)
        except Exception:  # an error answer, not a cancellation: the value KEDA had is unknown from now on
            if answers is not None and ref is not None:
                name = message.metric_name if query is None else query.metric_name
                answers.observe_error(ref.namespace, ref.name, name, query)
            raise
        if answers is not None and ref is not None:
            answers.observe_value(ref.namespace, ref.name, query, value)
        return self._metrics_response(query.metric_name, value)

    def _metrics_response(self, metric_name: str, value: float) -> GetMetricsResponse:
        # The same answer is the same message object, never changed once made: the server's codec sends the
        # bytes it encoded for it before (betterproto2 took ~28 us per answer) until the value moves on.
        key = (metric_name, float(value).hex())  # hex: -0.0 and 0.0 are different answers, and NaN equals NaN
        response = self._responses.get(key)
        if response is None:
            metric = MetricValue(metric_name=metric_name, metric_value=round_half_up(value), metric_value_float=value)
            response = GetMetricsResponse(metric_values=[metric])
            if len(self._responses) >= KEPT_RESPONSES:
                del self._responses[next(iter(self._responses))]
            self._responses[key] = response
        return response

    async def stream_is_active(
        self, message: ScaledObjectRef, *, preview: bool = False, time_left: float | None = None
    ) -> AsyncIterator[IsActiveResponse]:
        """KEDA's push stream; a preview sends the first message KEDA's would send now, waiting for it within
        ``time_left`` (seconds of the caller's deadline) and a cap, and ends."""
        async with grpc_errors("StreamIsActive"):
            query = self._query(message)
            if not preview:
                await self._evaluator.prepare(query)
            refusal = self._evaluator.evaluate(query.value, keep=not preview).error  # a preview keeps nothing
            if isinstance(refusal, InvalidMetadata):
                raise refusal  # a GPU the node lacks: refuse it as IsActive does, not with a silent stream
        if preview:
            async with grpc_errors("StreamIsActive"):
                first = await self._evaluator.first_push(query, time_left=time_left)
            yield ANSWERS[first]
            return
        scaled_object = f"{message.namespace}/{message.name}"
        if self._answers is not None:
            self._answers.stream_opened(message.namespace, message.name, query)
        self.open_streams += 1
        self._opened_lines(scaled_object=scaled_object, metric_name=query.metric_name)
        reason = "client_gone"
        try:
            # A change wakes the streams a slice a turn, not all in one.
            with self._evaluator.subscribe(query, event=QueuedEvent) as subscription:
                sent: bool | None = None
                while True:
                    if self._evaluator.closing:
                        reason = "shutdown"
                        return
                    active = subscription.active
                    if active is not None and active != sent:
                        yield ANSWERS[active]
                        sent = active
                    await subscription.changed.wait()
                    subscription.changed.clear()
        finally:
            self.open_streams -= 1
            if self._answers is not None:
                self._answers.stream_closed(message.namespace, message.name, query)
            self._closed_lines(scaled_object=scaled_object, metric_name=query.metric_name, reason=reason)


def _end(ended: asyncio.Future[None]) -> None:
    if not ended.done():  # its stream may have gone since the close queued this
        ended.set_result(None)


def _preview(stream: grpclib.server.Stream[Any, Any]) -> bool:
    """Whether the call's metadata marks it as a preview: one look-up, on every call."""
    return stream.metadata is not None and stream.metadata.get(PREVIEW_HEADER) == PREVIEW_VALUE
