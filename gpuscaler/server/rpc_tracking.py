"""Per-RPC bookkeeping from grpclib's server events: calls in flight (for the drain) and outcomes.

A client that cancels its stream is KEDA going away, not an error of ours: it counts as ``CANCELLED``.
Only an exception of our own counts as ``UNKNOWN``.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from grpclib.events import RecvRequest, listen
from grpclib.exceptions import GRPCError, StreamTerminatedError
from grpclib.server import Server, Stream

Observer = Callable[[str, str, float], None]  # method, status code name, seconds


class RpcTracker:
    """Counts calls in flight and finished calls by (method, status)."""

    def __init__(self) -> None:
        self.in_flight = 0
        self.finished: Counter[tuple[str, str]] = Counter()
        self._idle = asyncio.Event()
        self._idle.set()
        self._observers: list[Observer] = []

    def add_observer(self, observer: Observer) -> None:
        self._observers.append(observer)

    def attach(self, server: Server) -> None:
        listen(server, RecvRequest, self._on_request)

    async def _on_request(self, event: RecvRequest) -> None:
        method = event.method_name
        handler = event.method_func

        async def tracked(stream: Stream[Any, Any]) -> None:
            self._started()
            started = time.perf_counter()
            code = "UNKNOWN"
            try:
                await handler(stream)
                code = "OK"
            except GRPCError as error:
                code = error.status.name
                raise
            except (asyncio.CancelledError, StreamTerminatedError):
                code = "CANCELLED"  # the client went away, or the server is closing
                raise
            except TimeoutError:
                code = "DEADLINE_EXCEEDED"
                raise
            finally:
                self._finished(method, code, time.perf_counter() - started)

        event.method_func = tracked

    def _started(self) -> None:
        self.in_flight += 1
        self._idle.clear()

    def _finished(self, method: str, code: str, seconds: float) -> None:
        self.in_flight -= 1
        self.finished[(method, code)] += 1
        if self.in_flight == 0:
            self._idle.set()
        for observer in self._observers:
            observer(method, code, seconds)

    async def wait_idle(self) -> None:
        await self._idle.wait()
