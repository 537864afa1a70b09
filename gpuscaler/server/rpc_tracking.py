"""Per-RPC bookkeeping around each method's handler: calls in flight (for the drain) and outcomes.

A client that cancels its stream is KEDA going away, not an error of ours: it counts as ``CANCELLED``.
Only an exception of our own counts as ``UNKNOWN``.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, Protocol

from grpclib._typing import IServable
from grpclib.exceptions import GRPCError, StreamTerminatedError
from grpclib.server import Stream
from h2.exceptions import StreamClosedError

# The method label of a call to a method no service has (answered UNIMPLEMENTED).
UNKNOWN_METHOD = "unknown"

StartObserver = Callable[[str], None]  # method
FinishObserver = Callable[[str, str, float, bool], None]  # method, status code name, seconds, streaming
MethodFunc = Callable[[Stream[Any, Any]], Awaitable[None]]


class WrapsCalls(Protocol):
    """A server that puts a wrapper, given each method's :path, around that method's handler."""

    def wrap_calls(self, wrapper: Callable[[str, MethodFunc], MethodFunc]) -> None: ...


class RpcTracker:
    """Counts calls in flight and finished calls by (method, status)."""

    def __init__(self) -> None:
        self.in_flight = 0
        self.finished: Counter[tuple[str, str]] = Counter()
        self._idle = asyncio.Event()
        self._idle.set()
        self._streaming: frozenset[str] = frozenset()
        self._known: frozenset[str] = frozenset()
        self._on_start: list[StartObserver] = []
        self._on_finish: list[FinishObserver] = []

    def add_observers(self, on_start: StartObserver, on_finish: FinishObserver) -> None:
        self._on_start.append(on_start)
        self._on_finish.append(on_finish)

    def attach(self, server: WrapsCalls, services: Iterable[IServable]) -> None:
        """Track every call ``server`` receives; ``services`` tell which methods are server streams."""
        mappings = [service.__mapping__() for service in services]
        self._known = frozenset(name for mapping in mappings for name in mapping)
        self._streaming = frozenset(
            name for mapping in mappings for name, handler in mapping.items() if handler.cardinality.server_streaming
        )
        server.wrap_calls(self._track)

    def _track(self, path: str, handler: MethodFunc) -> MethodFunc:
        # A method no service has is answered UNIMPLEMENTED; its path is the client's to choose, so it is
        # counted under one name (a label per path would let any client grow the series without bound).
        method = path if path in self._known else UNKNOWN_METHOD

        async def tracked(stream: Stream[Any, Any]) -> None:
            self._started(method)
            started = time.perf_counter()
            code = "UNKNOWN"
            try:
                await handler(stream)
                code = "OK"
            except GRPCError as error:
                code = error.status.name
                raise
            except (asyncio.CancelledError, StreamTerminatedError):
                # grpclib ends a call past its deadline by cancelling it too; otherwise the client went
                # away, or the server is closing.
                deadline = stream.deadline
                code = "DEADLINE_EXCEEDED" if deadline is not None and not deadline.time_remaining() else "CANCELLED"
                raise
            except TimeoutError:
                code = "DEADLINE_EXCEEDED"
                raise
            except StreamClosedError:
                code = "CANCELLED"  # the client reset the stream while we answered (h2 knew before grpclib)
                raise
            finally:
                self._finished(method, code, time.perf_counter() - started)

        return tracked

    def count_expired(self, path: str) -> None:
        """A call answered DEADLINE_EXCEEDED before it started (its deadline had passed on arrival)."""
        method = path if path in self._known else UNKNOWN_METHOD
        self._started(method)
        self._finished(method, "DEADLINE_EXCEEDED", 0.0)

    def _started(self, method: str) -> None:
        self.in_flight += 1
        self._idle.clear()
        for observer in self._on_start:
            observer(method)

    def _finished(self, method: str, code: str, seconds: float) -> None:
        self.in_flight -= 1
        self.finished[(method, code)] += 1
        if self.in_flight == 0:
            self._idle.set()
        streaming = method in self._streaming
        for observer in self._on_finish:
            observer(method, code, seconds, streaming)

    async def wait_idle(self) -> None:
        await self._idle.wait()
