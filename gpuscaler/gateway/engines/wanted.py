"""One pod the scraper reads: the intervals queries ask it at, when its next read is due, and its newest scrape."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from gpuscaler.model.engines import Engine, PodScrape
from gpuscaler.signals.engines.pods import Endpoint

# KEDA polls every 30 s: a pod asked for by polls alone is read for a while after each, so the next finds it fresh.
# A push stream asks again after every scrape of its pods (``Evaluator``), well within this.
FORGET_AFTER_SECONDS = 120.0
# A pod whose reads keep failing is next read after its interval doubled per failure in a row, up to this (or its
# interval, when that is longer): a dead pod costs a slot for a timeout about every 10 s, not every interval, and
# one that comes back is read again within 10 s.
BACKOFF_MAX_SECONDS = 10.0
# The distinct intervals a pod remembers being asked at; past it the longest is forgotten first, which can only
# keep the pod read more often than asked, never less. Queries on one pod rarely ask more than two or three.
MAX_ASKED_INTERVALS = 16


def backoff_seconds(interval: float, failures: int) -> float:
    """How long after a read the next one is due, when the reads have failed ``failures`` times in a row."""
    if failures <= 1:
        return interval
    return max(interval, min(interval * 2.0 ** (failures - 1), BACKOFF_MAX_SECONDS))


@dataclass(slots=True)
class WantedPod:
    """What the scraper keeps of one pod while queries want it; the scraper's queues and slots say when it runs."""

    engine: Engine
    endpoint: Endpoint
    interval: float  # the shortest in ``asks``
    asked_at: float
    due_at: float  # when the next read is due; set when a read ends, from its result
    first: asyncio.Future[None]  # done once the first read has landed (or the pod is no longer wanted)
    scrape: PodScrape | None = None
    task: asyncio.Task[None] | None = None
    queued_at: float | None = None  # while it waits in its namespace's queue for a slot
    held_back: bool = False  # it waited because its namespace held its share (counted once per read)
    failures: int = 0  # reads failed in a row
    asks: dict[float, float] = field(default_factory=dict)  # interval -> when it was last asked

    def ask(self, interval_seconds: float, now: float) -> None:
        """A query asks for the pod at ``interval_seconds`` again: a shorter interval brings a healthy pod's read
        forward."""
        self.asked_at = now
        self.asks.pop(interval_seconds, None)  # re-inserted: the dict stays in order of last ask
        self.asks[interval_seconds] = now
        if len(self.asks) > MAX_ASKED_INTERVALS:
            del self.asks[max(i for i in self.asks if i != interval_seconds)]
        if interval_seconds < self.interval:
            self.interval = interval_seconds
            if self.failures == 0:
                self.due_at = min(self.due_at, now + interval_seconds)

    def forget_old_asks(self, now: float) -> None:
        """Drop the intervals not asked for within FORGET_AFTER_SECONDS; the pod is then read at the shortest left."""
        if not self.asks or now - next(iter(self.asks.values())) <= FORGET_AFTER_SECONDS:  # the oldest ask
            return
        for interval in [i for i, at in self.asks.items() if now - at > FORGET_AFTER_SECONDS]:
            del self.asks[interval]
        if self.asks:
            self.interval = min(self.asks)

    def read_ended(self, ok: bool, now: float) -> float:
        """Set when the next read is due by this one's result, and return how long after this one that is."""
        self.failures = 0 if ok else self.failures + 1
        # From when this one was due, so that starting up to a tick late does not stretch every interval; from now
        # when it is a whole interval behind (a first read, a slow page, a timeout).
        delay = backoff_seconds(self.interval, self.failures)
        self.due_at = self.due_at + delay if now - self.due_at < delay else now + delay
        return delay

    def failed(self, reason: str) -> None:
        """The read failed for ``reason``: that is the pod's answer now, beside the pages it last had."""
        before = self.scrape
        self.scrape = PodScrape(
            self.endpoint.url,
            before.page if before is not None else None,
            before.previous if before is not None else None,
            reason,
        )

    def settle(self) -> None:
        """Wake whoever waits for the pod's first read."""
        if not self.first.done():
            self.first.set_result(None)
