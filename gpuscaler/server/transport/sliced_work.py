"""Work for many streams at once (waking them, cancelling them) done a slice at a time, one slice a turn of the loop.

asyncio runs, in one turn, every callback that was ready when the turn began, and a task woken or cancelled runs
its next step in the turn after. So a connection that closes with 10,000 push streams open cancelled 10,000 tasks
in one callback (0.3 s) and ran their cleanup in the next turn (0.4 s), and a change of state woken 10,000 streams
at once: the poll loop, health and every other caller waited behind it. Here such work waits in one queue per
event loop that does ``PER_SLICE`` items a turn; the selector, the poll loop's tick and other connections get their
turns between.
"""

from __future__ import annotations

import asyncio
import collections
import weakref
from collections.abc import Callable

# Items of work a turn. Each is a wake-up or a cancel, whose task then takes about 20-50 us (2-core machine) in the
# next turn: a few milliseconds a turn, so 10,000 streams take about 160 turns and stay out of the poll loop's way.
PER_SLICE = 64


class SlicedQueue:
    """Callables run oldest first, at most ``per_slice`` in one turn of ``loop``."""

    def __init__(self, loop: asyncio.AbstractEventLoop, per_slice: int = PER_SLICE) -> None:
        self._loop = loop
        self._per_slice = per_slice
        self._work: collections.deque[Callable[[], object]] = collections.deque()
        self._scheduled = False

    def __len__(self) -> int:
        return len(self._work)

    def add(self, work: Callable[[], object]) -> None:
        self._work.append(work)
        if not self._scheduled:
            self._scheduled = True
            self._loop.call_soon(self._turn)

    def _turn(self) -> None:
        try:
            for _ in range(min(self._per_slice, len(self._work))):
                self._work.popleft()()
        finally:
            if self._work:
                self._loop.call_soon(self._turn)
            else:
                self._scheduled = False


_QUEUES: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, SlicedQueue] = weakref.WeakKeyDictionary()


def sliced_queue() -> SlicedQueue:
    """The running loop's queue (one per loop: a test's loop never inherits another's)."""
    loop = asyncio.get_running_loop()
    queue = _QUEUES.get(loop)
    if queue is None:
        queue = _QUEUES[loop] = SlicedQueue(loop)
    return queue
