"""One gRPC call: admitted or refused, its request read under our bounds, answered even past its deadline.

grpclib reads a request's gRPC frame with an ``assert`` on its length and a NotImplementedError for the
compressed flag, and the generated handlers assert that a request message came; all three reached the
client as UNKNOWN and our log as "Application error". The request is at fault, so we answer
INVALID_ARGUMENT and UNIMPLEMENTED instead. grpclib also takes in a message of any declared size: we
refuse one over MAX_RECEIVE_MESSAGE_BYTES with RESOURCE_EXHAUSTED before reading its body.

After ``close()`` grpclib still starts a handler for every request that arrives on an open connection,
and as the process exits those handlers never run ("Task was destroyed but it is pending!"). Ours
refuses such requests with RST_STREAM REFUSED_STREAM, which gRPC clients know was not processed.
"""

from __future__ import annotations

import asyncio
import functools
import math
from collections.abc import Awaitable, Callable
from typing import Any

import grpclib.server
from grpclib.const import Cardinality, Handler, Status
from grpclib.exceptions import GRPCError
from grpclib.metadata import Deadline
from grpclib.protocol import Stream
from grpclib.server import Handler as ConnectionHandler
from grpclib.server import Stream as ServerStream
from grpclib.server import request_handler
from grpclib.utils import DeadlineWrapper
from h2.errors import ErrorCodes

from gpuscaler.server.transport.h2 import peer_name
from gpuscaler.server.transport.lean_streams import LeanStream
from gpuscaler.server.transport.limits import ConnectionGuard
from gpuscaler.server.transport.sliced_work import sliced_queue

# Every request we serve is a ScaledObjectRef or smaller: a name (at most 253 bytes), a namespace (63) and
# the trigger's metadata, about twenty short keys; a large real one (a long podSelector) is under 1 KiB.
# grpclib has no limit of its own and decodes on the event loop, where betterproto2 spends ~16 us per map
# entry: 8 KiB of the smallest entries (~1,200) holds the loop for ~20 ms, 4 MiB would hold it for seconds
# and every sample would go stale. bench/stall.py measures the worst an accepted request does.
MAX_RECEIVE_MESSAGE_BYTES = 8 * 1024
# A method's handler, and what puts one around it (given the method's :path), built once per method rather than
# per call: grpclib's RecvRequest event would build an event object and await each listener for every call.
MethodFunc = Callable[[ServerStream[Any, Any]], Awaitable[None]]
CallWrapper = Callable[[str, MethodFunc], MethodFunc]
# A call with less than this left of its deadline when it starts cannot be answered in time.
EXPIRED_WITHIN_SECONDS = 0.001


class _CancellingDeadlineWrapper(DeadlineWrapper):
    """grpclib's deadline, which cancels the call when it passes, even when it passed before the call began.

    grpclib's ``start`` raises TimeoutError outside the wrapper that turns it into DEADLINE_EXCEEDED when no
    time is left (docs/security.md, item 5), and no precheck can close that race: the process can be
    descheduled between ours in ``BoundedH2Connection._handle`` and grpclib's. Scheduling the cancel for "now"
    instead lets grpclib's own handling answer DEADLINE_EXCEEDED.
    """

    def start(self, deadline: Deadline) -> _DeadlineTimer:  # type: ignore[override]  # a context manager too
        return _DeadlineTimer(self, deadline)


class _DeadlineTimer:
    """The cancel at a call's deadline, for the ``with`` block around the call: a class, not a generator-based
    context manager, as it runs for every call."""

    __slots__ = ("_deadline", "_timer", "_wrapper")

    def __init__(self, wrapper: DeadlineWrapper, deadline: Deadline) -> None:
        self._wrapper = wrapper
        self._deadline = deadline
        self._timer: asyncio.TimerHandle | None = None

    def __enter__(self) -> None:
        self._timer = asyncio.get_running_loop().call_later(
            max(self._deadline.time_remaining(), 0.0), self._wrapper.cancel, TimeoutError("Deadline exceeded")
        )

    def __exit__(self, *exc_info: object) -> None:
        if self._timer is not None:
            self._timer.cancel()


grpclib.server.DeadlineWrapper = _CancellingDeadlineWrapper  # type: ignore[attr-defined]  # the name request_handler looks up


class RefusingHandler(ConnectionHandler):
    """grpclib's per-connection handler: a call past max_streams or during the close is refused, and each call
    is forgotten the moment it ends.

    grpclib rebuilds its table of request tasks every 10 requests to drop finished ones: with 10,000 push
    streams open, that is 1,000 tasks looked at per call. Ours drops each request's task from the table as
    it finishes, so the table holds only calls in progress and what a finished call made dies with it (kept
    for a later rebuild, it was promoted to the oldest generation, where full collections walked it: 40 ms
    each under GetMetrics load, 4 ms without). grpclib also keeps every task it cancels (a stream the peer
    reset) in a set that only that rebuild empties: each leaves it here when it finishes, so after any number
    of resets (CVE-2023-44487's rapid reset, or KEDA cancelling) no task, stream or message is held.

    A call whose deadline has passed (or is within EXPIRED_WITHIN_SECONDS) when it starts is answered
    DEADLINE_EXCEEDED here, before grpclib builds anything for it; one that runs out between this check and
    grpclib's is cancelled by ``_CancellingDeadlineWrapper``.
    """

    def __init__(self, *args: Any, guard: ConnectionGuard, expired: Callable[[str], None]) -> None:
        super().__init__(*args)
        self._guard = guard
        self._expired = expired

    def __gc_step__(self) -> None:
        pass  # nothing finished stays in the table or the cancelled set: no rebuild is needed

    def accept(self, stream: Stream, headers: Any, release_stream: Callable[[], Any]) -> None:
        streaming = self._is_streaming(headers)
        if self.closing or not self._guard.admit_stream(streaming=streaming):
            if not self.closing:
                self._guard.act("max_streams", peer_name(stream.connection._transport), open=self._guard.streams)
            stream.reset_nowait(ErrorCodes.REFUSED_STREAM)
            release_stream()
            return
        release = _Once(release_stream)
        task = self.loop.create_task(self._handle(stream, headers, release))
        self._tasks[stream] = task
        task.add_done_callback(functools.partial(self._finished, stream, release, streaming))

    def _is_streaming(self, headers: Any) -> bool:
        for name, value in headers:
            if name == ":path":
                method = self.mapping.get(value)  # an unknown path is answered UNIMPLEMENTED, a unary call
                return method is not None and bool(method.cardinality.server_streaming)
        return False

    async def _handle(self, stream: Stream, headers: Any, release_stream: Callable[[], Any]) -> None:
        if self.closing:
            # The connection closed before this call's first step (it came in the turn before the close): its
            # cancel waits in the turn queue, and grpclib would now build a stream on a connection already gone.
            release_stream()
            return
        if _time_left(stream, headers, self._guard) < EXPIRED_WITHIN_SECONDS:
            try:
                await _answer_deadline_exceeded(stream)
            finally:
                release_stream()
            self._expired(dict(headers).get(":path", ""))
            return
        await request_handler(
            self.mapping, stream, headers, self.codec, self.status_details_codec, self.dispatch, release_stream
        )

    def _finished(self, stream: Stream, release: _Once, streaming: bool, task: asyncio.Task[None]) -> None:
        # A task cancelled before its first step (the peer's RST_STREAM came in the same read as its
        # HEADERS) never ran the handler's own release: grpclib would hold the stream for the connection's life.
        release()
        self._guard.release_stream(streaming=streaming)
        if self._tasks.get(stream) is task:
            del self._tasks[stream]
        self._cancelled.discard(task)

    def close(self) -> None:
        # grpclib cancels every call's task here, and its connection then cancels each again through its stream's
        # wrapper, all in one callback, and every cancelled task runs its cleanup in the next turn: a connection
        # closing with 10,000 push streams held the event loop 0.3 s, then 0.4 s. Here the cancels take their turns
        # (sliced_work.py), and each task counts as cancelled (``tasks``, ``wait_closed``) from now. Only the task is
        # cancelled: the wrapper raises its StreamTerminatedError from a frame that holds the wrapper, a cycle that
        # kept each closed stream's frames (73 objects) for the next full collection (0.8 s for 10,000 streams).
        self.closing = True
        queue = sliced_queue()
        tasks, self._tasks = self._tasks, {}
        for stream, task in tasks.items():
            self._cancelled.add(task)
            stream.wrapper = None  # grpclib's close would cancel it through this, at once
            queue.add(task.cancel)

    def cancel(self, stream: Stream) -> None:
        task = self._tasks.pop(stream, None)
        if task is not None:
            task.cancel()
            self._cancelled.add(task)  # until it has run its cleanup; _finished takes it out

    @property
    def tasks(self) -> int:
        """Request tasks alive on this connection, cancelled ones that have not finished included."""
        return len(self._tasks) + len(self._cancelled)


def _time_left(stream: Stream, headers: Any, guard: ConnectionGuard) -> float:
    """Seconds left of the call's deadline (infinite without one): from the deadline the protocol stamped on its
    stream when the call's HEADERS were read, so its grpc-timeout is not parsed again here (grpclib parses it too)."""
    if isinstance(stream, LeanStream) and stream.created is not None:
        return math.inf if stream.deadline_at is None else stream.deadline_at - guard.clock()
    try:
        deadline = Deadline.from_headers(headers)
    except ValueError:
        return math.inf  # grpclib answers a bad grpc-timeout itself
    return math.inf if deadline is None else deadline.time_remaining()


class _Once:
    """``release_stream`` that does its work the first time only: grpclib's pops the stream, once."""

    __slots__ = ("_release",)

    def __init__(self, release: Callable[[], Any]) -> None:
        self._release: Callable[[], Any] | None = release

    def __call__(self) -> None:
        release, self._release = self._release, None
        if release is not None:
            release()


async def _answer_deadline_exceeded(stream: Stream) -> None:
    await stream.send_headers(
        [
            (":status", "200"),
            ("content-type", "application/grpc"),  # grpc-go reads an answer without it as UNKNOWN
            ("grpc-status", str(Status.DEADLINE_EXCEEDED.value)),
            ("grpc-message", "the deadline passed before the call could start"),
        ],
        end_stream=True,
    )
    if stream.closable:
        stream.reset_nowait()


def guard_framing(guard: ConnectionGuard) -> CallWrapper:
    """The wrapper that puts our checks around reading each call's request message, for each method once."""
    request_timeout = guard.limits.request_timeout_seconds

    def wrap(method: str, handler: MethodFunc) -> MethodFunc:
        async def guarded(stream: ServerStream[Any, Any]) -> None:
            receive = stream.recv_message
            h2_stream = stream._stream
            _limit_message_size(stream)

            async def recv_message() -> Any:
                try:
                    if h2_stream.buffer._eof:
                        # The request came whole (its END_STREAM was taken in with it, as a unary call's usually
                        # is): reading it cannot wait, so it needs no timer.
                        message = await receive()
                    else:
                        async with asyncio.timeout(request_timeout):
                            message = await receive()
                except TimeoutError:
                    peer = peer_name(h2_stream.connection._transport)
                    guard.act("request_timeout", peer, seconds=request_timeout)
                    raise GRPCError(
                        Status.DEADLINE_EXCEEDED,
                        f"the request message did not arrive within {request_timeout:g} s of its headers",
                    ) from None
                except NotImplementedError:  # grpclib: "Compression not implemented"
                    raise GRPCError(
                        Status.UNIMPLEMENTED, "compressed messages are not supported; send them uncompressed"
                    ) from None
                except AssertionError:  # grpclib: the body is shorter than the frame's declared length
                    raise GRPCError(
                        Status.INVALID_ARGUMENT, "the request ended before the length its gRPC frame declares"
                    ) from None
                if message is None:  # every method we serve takes exactly one request message
                    raise GRPCError(Status.INVALID_ARGUMENT, "the request has no message; send exactly one")
                return message

            stream.recv_message = recv_message  # type: ignore[method-assign]
            try:
                await handler(stream)
            finally:
                # Each closure holds its stream, which holds it: a cycle per call, left for the cycle collector.
                del stream.recv_message
                del h2_stream.recv_data

        return guarded

    return wrap


def _limit_message_size(stream: ServerStream[Any, Any]) -> None:
    """Refuse a request whose gRPC frame declares more than MAX_RECEIVE_MESSAGE_BYTES, before reading it."""
    h2_stream = stream._stream  # grpclib's protocol stream; its recv_data feeds grpclib's recv_message
    read = h2_stream.recv_data
    first = True

    async def recv_data(size: int) -> bytes:
        nonlocal first
        data = await read(size)
        if first and size == 5 and len(data) == 5:  # the 5-byte prefix: compressed flag, then the length
            declared = int.from_bytes(data[1:], "big")
            if declared > MAX_RECEIVE_MESSAGE_BYTES:
                raise GRPCError(
                    Status.RESOURCE_EXHAUSTED,
                    f"the request message is {declared} bytes; at most {MAX_RECEIVE_MESSAGE_BYTES} are accepted",
                )
        first = False
        return data

    h2_stream.recv_data = recv_data  # type: ignore[method-assign]


async def _unimplemented(method_name: str, stream: ServerStream[Any, Any]) -> None:
    raise GRPCError(Status.UNIMPLEMENTED, f"Method not found: {method_name}")


class AnswerUnknownMethods(dict[str, Handler]):
    """The method table, answering a method it lacks with a handler that says UNIMPLEMENTED.

    grpclib answers an unknown method itself, but without a content-type, which grpc-go clients such as KEDA
    read as UNKNOWN "malformed header"; KEDA gives up on an optional method only on UNIMPLEMENTED (2.21's
    StreamMetricSpec, which it opens for ``external-push`` triggers only, and which we now serve). Through a
    handler the answer is a proper gRPC one. The request is never read.
    """

    def __init__(self, mapping: dict[str, Handler]) -> None:
        super().__init__(mapping)
        self._wrappers: list[CallWrapper] = []

    def wrap(self, wrapper: CallWrapper) -> None:
        """Put ``wrapper`` around every method's handler now, and around each unknown method's as it is asked for."""
        for name, handler in list(self.items()):
            self[name] = handler._replace(func=wrapper(name, handler.func))
        self._wrappers.append(wrapper)

    def get(self, method_name: str, default: Handler | None = None) -> Handler:  # type: ignore[override]  # never None
        found = super().get(method_name)
        if found is not None:
            return found
        func: MethodFunc = functools.partial(_unimplemented, method_name)
        for wrapper in self._wrappers:
            func = wrapper(method_name, func)
        return Handler(func, Cardinality.UNARY_UNARY, object, object)
