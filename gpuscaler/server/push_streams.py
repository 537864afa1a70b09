"""What a push stream costs the event loop besides its message: wake-ups in turns, log lines within a budget.

The poll loop shares the event loop with every stream (docs/security.md, ``--max-streams``). Streams with equal
queries share one evaluation per snapshot, but when their state moves each stream still sends its own message, and
each opened and closed with a line in the log: at 10,000 streams, 10,000 handler steps in one turn of the loop, and
about 40 us of logging per stream opened and 20 us per stream closed (0.4 s and 0.2 s of one connection's opening
and closing, and 20,000 lines). Here a wake-up takes its turn in the loop's ``SlicedQueue``, and the open and close
lines stop at a budget per interval, past which one line says how many were left out.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import structlog

from gpuscaler.server.transport.sliced_work import sliced_queue

log = structlog.get_logger(__name__)

# stream_opened and stream_closed lines per interval; past that, one line per interval counts the rest. KEDA opens a
# stream per external-push ScaledObject when it starts, so a restart of a large cluster's KEDA is logged in full up
# to this many streams, and a flood of streams costs the log one line per interval.
STREAM_LINES = 200
STREAM_LINES_EVERY_SECONDS = 10.0


class QueuedEvent(asyncio.Event):
    """An ``asyncio.Event`` whose ``set`` takes its turn in the loop's ``SlicedQueue``; ``wait`` and ``clear`` are
    Event's. A push stream's ``changed``: a change of state wakes the streams a slice a turn, not all in one."""

    def __init__(self) -> None:
        super().__init__()
        self._queued = False

    def set(self) -> None:
        if not self._queued and not self.is_set():
            self._queued = True
            sliced_queue().add(self._set_now)

    def _set_now(self) -> None:
        self._queued = False
        super().set()


class StreamLines:
    """``event`` logged at info level at most ``budget`` times per ``every_seconds``; past that, the lines left out
    are counted into one ``stream_lines_left_out`` line at the end of the interval."""

    def __init__(
        self,
        event: str,
        *,
        budget: int = STREAM_LINES,
        every_seconds: float = STREAM_LINES_EVERY_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._event = event
        self._budget = budget
        self._every = every_seconds
        self._clock = clock
        self._started = -float("inf")
        self._logged = 0
        self.left_out = 0
        self._report_due: asyncio.TimerHandle | None = None

    def __call__(self, **fields: Any) -> None:
        now = self._clock()
        if now - self._started >= self._every:
            self.report()
            self._started, self._logged = now, 0
        if self._logged < self._budget:
            self._logged += 1
            log.info(self._event, **fields)
            return
        self.left_out += 1
        if self._report_due is None:
            self._report_due = asyncio.get_running_loop().call_later(self._started + self._every - now, self.report)

    def report(self) -> None:
        """Log how many lines were left out since the last report, if any (at the interval's end by itself)."""
        if self._report_due is not None:
            self._report_due.cancel()
            self._report_due = None
        if self.left_out:
            log.info(
                "stream_lines_left_out",
                line=self._event,
                left_out=self.left_out,
                budget=self._budget,
                seconds=self._every,
            )
            self.left_out = 0
