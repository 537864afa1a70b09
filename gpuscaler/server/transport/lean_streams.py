"""grpclib's per-stream objects, without the memory that a stream which never waits does not need.

KEDA holds two push streams per ``external-push`` ScaledObject (StreamIsActive and, since 2.21, StreamMetricSpec),
all open for as long as the ScaledObject lives, so what one stream costs times ``--max-streams`` must fit the
chart's memory limit; every stream the server takes, whatever its method, is a ``LeanStream``. grpclib's stream made
three ``asyncio.Event``s and a ``Buffer`` over an ``asyncio.Queue``: nine ``collections.deque``
(each allocates a 520-byte block up front) and another Event, about 4 KB of a stream's 19 KB (measured with
tracemalloc, 2,000 streams). Here an event makes its deque only when something waits on it, and the buffer
keeps its chunks in a list with one future for its one reader. Behaviour is grpclib's: the same methods,
the same wake-ups.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import time
from collections.abc import Callable, Coroutine
from typing import Any, Literal

from grpclib.protocol import Buffer, Connection, Stream, UnackedData
from h2.connection import H2Connection


class LeanEvent(asyncio.Event):
    """``asyncio.Event`` whose deque of waiters exists only once someone has waited."""

    def __init__(self) -> None:  # not Event's: it makes the deque
        self._value = False
        self._waiters: collections.deque[asyncio.Future[Any]] | None = None  # type: ignore[assignment]

    def set(self) -> None:
        if not self._value:
            self._value = True
            for waiter in self._waiters or ():
                if not waiter.done():
                    waiter.set_result(True)

    async def wait(self) -> Literal[True]:
        if self._value:
            return True
        if self._waiters is None:
            self._waiters = collections.deque()
        return await super().wait()


class _LeanQueue:
    """What grpclib's ``Buffer`` uses of ``asyncio.Queue``, for its single reader."""

    __slots__ = ("_items", "_reader")

    def __init__(self) -> None:
        self._items: list[UnackedData] = []
        self._reader: asyncio.Future[None] | None = None

    def put_nowait(self, item: UnackedData) -> None:
        self._items.append(item)
        if self._reader is not None and not self._reader.done():
            self._reader.set_result(None)

    async def get(self) -> UnackedData:
        while not self._items:
            self._reader = asyncio.get_running_loop().create_future()
            try:
                await self._reader
            finally:
                self._reader = None
        return self._items.pop(0)

    def get_nowait(self) -> UnackedData:
        if not self._items:
            raise asyncio.QueueEmpty
        return self._items.pop(0)

    def empty(self) -> bool:
        return not self._items

    def qsize(self) -> int:
        return len(self._items)


class _LeanBuffer(Buffer):
    def __init__(self, ack_callback: Callable[[int], None]) -> None:  # grpclib 0.4.9's, with the lean queue
        self._ack_callback = ack_callback
        self._eof = False
        self._unacked = _LeanQueue()  # type: ignore[assignment]
        self._acked = collections.deque()
        self._acked_size = 0


class LeanStream(Stream):
    """grpclib's protocol stream with lean events and buffer; ``window_updated`` is the caller's."""

    def __init__(
        self,
        connection: Connection,
        h2_connection: H2Connection,
        transport: asyncio.Transport,
        window_updated: asyncio.Event,
        *,
        stream_id: int | None = None,
        wrapper: Any = None,
    ) -> None:
        # grpclib 0.4.9's Stream.__init__ (pinned), with our events.
        self.connection = connection
        self._h2_connection = h2_connection
        self._transport = transport
        self.wrapper = wrapper
        if stream_id is not None:
            self.init_stream(stream_id, self.connection)
        self.window_updated = window_updated
        self.headers = None
        self.headers_received = LeanEvent()
        self.trailers = None
        self.trailers_received = LeanEvent()

    def init_stream(self, stream_id: int, connection: Connection) -> None:
        # grpclib 0.4.9's (pinned), with the lean buffer; ``created`` is what a reset's age counts from: the
        # protocol sets it back to when the call's HEADERS were read, where a later turn took them in.
        self.id = stream_id
        self.buffer = _LeanBuffer(functools.partial(connection.ack, stream_id))
        self.connection.streams_started += 1
        self.created = self.connection.last_stream_created = time.monotonic()
        self.deadline_at: float | None = None  # created + the call's grpc-timeout, where it has one
        self.answered = False  # whether the server has begun its answer: a reset then abandons no work

    def send_headers(self, headers: Any, end_stream: bool = False) -> Coroutine[Any, Any, None]:
        self.answered = True  # not a coroutine of its own: one more frame on every call's answer for a flag
        return super().send_headers(headers, end_stream)
