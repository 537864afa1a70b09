"""The gateway's engine scraper: each wanted pod's metrics page, read at the interval its queries ask.

Lazy: a pod is read only while a query asks for it (``want``), and is forgotten ``FORGET_AFTER_SECONDS`` after
the last ask. One scrape per pod serves every query on it, at the shortest interval any of them asks, with a
number in flight; each read is ``page_reader.PageReader``'s, and bounded there.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp
import structlog

from gpuscaler.gateway.engines.limits import DEFAULT_SCRAPE_LIMITS, ScrapeLimits
from gpuscaler.gateway.engines.page import MalformedPage
from gpuscaler.gateway.engines.page_reader import PageReader, ScrapeFailed
from gpuscaler.model.engines import Engine, PodScrape
from gpuscaler.signals.engine_pods import Endpoint
from gpuscaler.signals.engine_source import PodKey

log = structlog.get_logger(__name__)

# KEDA polls every 30 s: a pod asked for by polls alone is read for a while after each, so the next finds it fresh.
FORGET_AFTER_SECONDS = 120.0
# How often the loop looks for pods that are due, while any is wanted: a scrape starts at most this late. Listeners
# hear of the scrapes that landed at most this often too, so a thousand pods read a second wake push streams
# twenty times, not a thousand.
TICK_SECONDS = 0.05


@dataclass(slots=True)
class _Wanted:
    engine: Engine
    endpoint: Endpoint
    interval: float
    asked_at: float
    due_at: float
    scrape: PodScrape | None = None
    task: asyncio.Task[None] | None = None


class EngineScraper:
    """Reads the pods queries want; ``signals.engine_source.EngineSource`` for the evaluator."""

    def __init__(self, limits: ScrapeLimits | None = None, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.limits = limits or DEFAULT_SCRAPE_LIMITS
        self._clock = clock
        self._wanted: dict[PodKey, _Wanted] = {}
        self._listeners: list[Callable[[], None]] = []
        self._notify_scheduled = False
        self._someone_wants = asyncio.Event()  # the loop sleeps on it while nothing is wanted
        self._slots = asyncio.Semaphore(self.limits.concurrency)
        self._reader = PageReader(self.limits)
        self._loop_task: asyncio.Task[None] | None = None
        # What /metrics counts: scrapes by outcome, and the newest of each pod (``pods``).
        self.results: dict[str, int] = {}
        self.on_scrape: list[Callable[[float, str], None]] = []  # (seconds, outcome)

    @property
    def timeout_seconds(self) -> float:
        return self.limits.timeout_seconds

    async def start(self) -> None:
        await self._reader.start()
        self._loop_task = asyncio.get_running_loop().create_task(self._run(), name="engine-scraper")

    async def stop(self) -> None:
        tasks = [w.task for w in self._wanted.values() if w.task is not None]
        if self._loop_task is not None:
            tasks.append(self._loop_task)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self._reader.close()

    def want(self, pod: PodKey, engine: Engine, endpoint: Endpoint, interval_seconds: float) -> PodScrape | None:
        now = self._clock()
        wanted = self._wanted.get(pod)
        if wanted is None or wanted.endpoint != endpoint or wanted.engine is not engine:
            # A new pod, or one whose address changed (a restart keeps its name in a StatefulSet): start over.
            if wanted is not None and wanted.task is not None:
                wanted.task.cancel()
            wanted = self._wanted[pod] = _Wanted(engine, endpoint, interval_seconds, now, now)
            self._someone_wants.set()
            return None
        wanted.asked_at = now
        if interval_seconds < wanted.interval:
            wanted.interval = interval_seconds
            wanted.due_at = min(wanted.due_at, now + interval_seconds)
        return wanted.scrape

    async def settle(self) -> None:
        """Start the first read of every pod never read, and wait for each (each is bounded by the timeout)."""
        first = [
            self._start(pod, wanted)
            for pod, wanted in self._wanted.items()
            if wanted.scrape is None and wanted.task is None
        ]
        waiting = [w.task for w in self._wanted.values() if w.scrape is None and w.task is not None]
        if first or waiting:
            await asyncio.wait({*first, *waiting})

    def add_listener(self, listener: Callable[[], None]) -> None:
        self._listeners.append(listener)

    def pods(self) -> dict[PodKey, PodScrape]:
        """The newest scrape of each pod read now."""
        return {pod: w.scrape for pod, w in self._wanted.items() if w.scrape is not None}

    async def _run(self) -> None:
        while True:
            if not self._wanted:
                self._someone_wants.clear()
                await self._someone_wants.wait()
            now = self._clock()
            for pod in [p for p, w in self._wanted.items() if now - w.asked_at > FORGET_AFTER_SECONDS]:
                gone = self._wanted.pop(pod)
                if gone.task is not None:
                    gone.task.cancel()
            for pod, wanted in self._wanted.items():
                if wanted.task is None and now >= wanted.due_at:
                    self._start(pod, wanted)
            await asyncio.sleep(TICK_SECONDS)

    def _start(self, pod: PodKey, wanted: _Wanted) -> asyncio.Task[None]:
        now = self._clock()
        # From when it was due, so that starting up to a tick late does not stretch every interval; from now
        # when it is a whole interval behind (a first read, a slow page).
        wanted.due_at = (
            wanted.due_at + wanted.interval if now - wanted.due_at < wanted.interval else now + wanted.interval
        )
        task = asyncio.get_running_loop().create_task(self._scrape(pod, wanted), name=f"scrape {pod[0]}/{pod[1]}")
        wanted.task = task
        return task

    async def _scrape(self, pod: PodKey, wanted: _Wanted) -> None:
        started = self._clock()
        try:
            async with self._slots:
                body = await self._reader.fetch(wanted.endpoint)
            page = self._reader.parse(body, wanted.engine, at=self._clock())
            previous = wanted.scrape.page if wanted.scrape is not None else None
            wanted.scrape = PodScrape(wanted.endpoint.url, page, previous)
            outcome = "ok"
        except (ScrapeFailed, MalformedPage) as error:
            outcome = "malformed" if isinstance(error, MalformedPage) else error.outcome
            self._failed(wanted, str(error))
        except TimeoutError:
            outcome = "timeout"
            self._failed(wanted, f"no answer within {self.limits.timeout_seconds:g}s")
        except aiohttp.ClientError as error:
            outcome = "error"
            self._failed(wanted, f"cannot read it: {type(error).__name__}: {str(error)[:160]}")
        except Exception as error:  # a bug of ours or aiohttp's: the pod is unread, reads go on
            outcome = "error"
            log.exception("engine_scrape_failed", pod=f"{pod[0]}/{pod[1]}", url=wanted.endpoint.url)
            self._failed(wanted, f"cannot read it: {type(error).__name__}: {str(error)[:160]}")
        finally:
            if self._wanted.get(pod) is wanted:
                wanted.task = None
        self.results[outcome] = self.results.get(outcome, 0) + 1
        for observer in self.on_scrape:
            observer(self._clock() - started, outcome)
        self._notify_soon()

    def _failed(self, wanted: _Wanted, reason: str) -> None:
        before = wanted.scrape
        wanted.scrape = PodScrape(
            wanted.endpoint.url,
            before.page if before is not None else None,
            before.previous if before is not None else None,
            reason,
        )

    def _notify_soon(self) -> None:
        if self._notify_scheduled:
            return
        self._notify_scheduled = True
        asyncio.get_running_loop().call_later(TICK_SECONDS, self._notify)

    def _notify(self) -> None:
        self._notify_scheduled = False
        for listener in self._listeners:
            listener()
