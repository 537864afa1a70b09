"""The gateway's engine scraper: when each wanted pod's metrics page is read, and who gets the next free slot.

Lazy: a pod is read only while a query asks for it (``want``, from a query prepared or a stream held open), and is
forgotten ``FORGET_AFTER_SECONDS`` after the last ask. One scrape per pod serves every query on it, at the
shortest interval any of them asked within ``FORGET_AFTER_SECONDS``: a query that stopped asking stops setting
the pace, as it stops keeping the pod read. Reading a pod's scrape (``scrape``, ``pods``) changes nothing.

Slots are shared by namespace, the unit a cluster gives a tenant (its RBAC, its quotas, its ScaledObjects): due
reads wait in one queue per namespace, and a free slot goes to the next namespace in turn, so a namespace's many or
slow pods make its own reads wait, not another's. One namespace holds at most ``namespace_share`` of the slots, so
a tenant's pods that never answer cannot hold every slot for a timeout. A pod whose reads keep failing is read
less often (``wanted.backoff_seconds``, due from when each read ends, by that read's result); its answer stays its
failure, never an older page made to look fresh. What the scraper keeps of each pod, its pace and its backoff, is
``wanted.WantedPod``; each read is ``page_reader.PageReader``'s, and bounded there.

A read path (Explain, a preview of KEDA's calls) wants nothing: ``read_once`` reads the pods no query wants once for
its one answer, on at most ``once_slots`` slots of its own, within the caller's deadline, and keeps nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

import aiohttp
import structlog

from gpuscaler.gateway.engines.limits import DEFAULT_SCRAPE_LIMITS, ScrapeLimits
from gpuscaler.gateway.engines.page import MalformedPage
from gpuscaler.gateway.engines.page_reader import PageReader, ScrapeFailed
from gpuscaler.gateway.engines.wanted import FORGET_AFTER_SECONDS, WantedPod
from gpuscaler.model.engines import Engine, PodScrape
from gpuscaler.server.overload import LimitsActed
from gpuscaler.signals.engines.pods import Endpoint
from gpuscaler.signals.engines.source import PodKey

log = structlog.get_logger(__name__)

# How often the loop looks for pods that are due, while any is wanted: a scrape starts at most this late. Listeners
# hear of the scrapes that landed at most this often too, so a thousand pods read a second wake push streams
# twenty times, not a thousand.
TICK_SECONDS = 0.05
# The limits the scraper counts (gpuscaler_gateway_engine_limited_total{limit}), docs/security.md says each.
LIMITS = ("namespace_share", "backoff", "first_read_wait", "max_pods_per_selection")


def namespace_share(concurrency: int) -> int:
    """The slots one namespace may hold at once: three quarters, so a quarter is always there for the others."""
    return max(1, concurrency * 3 // 4)


def once_slots(concurrency: int) -> int:
    """The one-shot reads of read paths at once: a quarter of the scrape concurrency, apart from the scraper's slots,
    so that a flood of Explains waits on itself and KEDA's pods are read on time."""
    return max(1, concurrency // 4)


@dataclass(slots=True)
class _Namespace:
    queue: deque[tuple[PodKey, WantedPod]] = field(default_factory=deque)
    reading: int = 0


class EngineScraper:
    """Reads the pods queries want; ``signals.engines.source.EngineSource`` for the evaluator."""

    def __init__(
        self,
        limits: ScrapeLimits | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        reader: PageReader | None = None,
    ) -> None:
        """``clock`` and ``reader``: a test's fake time and pages; by default the monotonic clock and HTTP."""
        self.limits = limits or DEFAULT_SCRAPE_LIMITS
        self._clock = clock
        self._wanted: dict[PodKey, WantedPod] = {}
        self._generation = 0  # EngineSource.generation
        self._listeners: list[Callable[[], None]] = []
        self._notify_scheduled = False
        self._someone_wants = asyncio.Event()  # the loop sleeps on it while nothing is wanted
        self._namespaces: dict[str, _Namespace] = {}
        self._turns: deque[str] = deque()  # namespaces with reads waiting, the next to get a slot first
        self._reading = 0
        self._share = namespace_share(self.limits.concurrency)
        self._reader = reader or PageReader(self.limits)
        self._once = asyncio.Semaphore(once_slots(self.limits.concurrency))
        self._loop_task: asyncio.Task[None] | None = None
        self._running = False
        # What /metrics counts: scrapes by outcome, limits by the times each acted, and the newest of each pod.
        self.results: dict[str, int] = {}
        self._acted = LimitsActed("engine_limited", LIMITS)
        self.limited = self._acted.counts
        self.on_scrape: list[Callable[[float, str], None]] = []  # (seconds, outcome)

    @property
    def reader(self) -> PageReader:
        """The page reader (its ``authorize`` holds the EPP token's counts for /metrics)."""
        return self._reader

    @property
    def timeout_seconds(self) -> float:
        return self.limits.timeout_seconds

    @property
    def generation(self) -> int:
        return self._generation

    @property
    def max_pods(self) -> int:
        return self.limits.max_pods

    @property
    def min_interval_seconds(self) -> float:
        return self.limits.min_interval_seconds

    @property
    def reading(self) -> int:
        """Reads holding a slot now."""
        return self._reading

    async def start(self) -> None:
        await self._reader.start()
        self._running = True
        self._loop_task = asyncio.get_running_loop().create_task(self._run(), name="engine-scraper")
        self._dispatch()

    async def stop(self) -> None:
        self._running = False
        tasks = [w.task for w in self._wanted.values() if w.task is not None]
        if self._loop_task is not None:
            tasks.append(self._loop_task)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for wanted in self._wanted.values():
            wanted.settle()
        await self._reader.close()

    def want(self, pod: PodKey, engine: Engine, endpoint: Endpoint, interval_seconds: float) -> None:
        """Keep ``pod`` read at least every ``interval_seconds`` for a while; a pod never read is queued at once."""
        now = self._clock()
        wanted = self._wanted.get(pod)
        if wanted is None or wanted.endpoint != endpoint or wanted.engine is not engine:
            # A new pod, or one whose address changed (a restart keeps its name in a StatefulSet): start over.
            if wanted is not None:
                self._drop(wanted)
            first = asyncio.get_running_loop().create_future()
            wanted = self._wanted[pod] = WantedPod(engine, endpoint, interval_seconds, now, now, first)
            wanted.asks[interval_seconds] = now
            self._someone_wants.set()
            self._enqueue(pod, wanted)
            return
        wanted.ask(interval_seconds, now)

    def scrape(self, pod: PodKey) -> PodScrape | None:
        """The newest scrape of ``pod``, if it is read now; a read, which changes nothing."""
        wanted = self._wanted.get(pod)
        return wanted.scrape if wanted is not None else None

    async def first_reads(self, pods: Collection[PodKey], within_seconds: float) -> None:
        """Return once each of ``pods`` that is wanted and never read has had its first read land, or after
        ``within_seconds``; other pods' reads are not waited for."""
        waiting = [
            wanted.first
            for pod in pods
            if (wanted := self._wanted.get(pod)) is not None and wanted.scrape is None and not wanted.first.done()
        ]
        if not waiting:
            return
        if within_seconds > 0:
            _, pending = await asyncio.wait(waiting, timeout=within_seconds)
        else:
            pending = set(waiting)
        if pending:
            self.note_limited("first_read_wait", unread=len(pending), waited_seconds=round(max(within_seconds, 0), 3))

    async def read_once(
        self, reads: Sequence[tuple[PodKey, Engine, Endpoint]], within_seconds: float
    ) -> dict[PodKey, PodScrape]:
        """Each of ``reads`` no query wants, read once for one answer within ``within_seconds``: its scrape, or why
        it is unread (a read still waiting at the deadline is cancelled). Wants nothing and keeps nothing; a pod
        wanted at the same address is left out (its own scrape is the answer)."""
        once = {
            pod: (engine, endpoint)
            for pod, engine, endpoint in reads
            if (w := self._wanted.get(pod)) is None or w.endpoint != endpoint or w.engine is not engine
        }
        if not once:
            return {}
        if within_seconds <= 0:
            self.note_limited("first_read_wait", unread=len(once), waited_seconds=0)
            return {pod: PodScrape(endpoint.url, error=_NO_TIME) for pod, (_, endpoint) in once.items()}
        loop = asyncio.get_running_loop()
        tasks = {
            pod: loop.create_task(self._read_once(pod, *read), name=f"read once {pod[0]}/{pod[1]}")
            for pod, read in once.items()
        }
        _, pending = await asyncio.wait(tasks.values(), timeout=within_seconds)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        if pending:
            self.note_limited("first_read_wait", unread=len(pending), waited_seconds=round(within_seconds, 3))
        return {
            pod: task.result() if task not in pending else PodScrape(once[pod][1].url, error=_NO_TIME)
            for pod, task in tasks.items()
        }

    async def _read_once(self, pod: PodKey, engine: Engine, endpoint: Endpoint) -> PodScrape:
        async with self._once:
            try:
                # A read path's read: it asks the API for no token and counts none (epp_token.py).
                body = await self._reader.fetch(endpoint, pod=pod, engine=engine, ask=False)
                return PodScrape(endpoint.url, await self._reader.parse(body, engine, at=self._clock()))
            except (ScrapeFailed, MalformedPage) as error:
                return PodScrape(endpoint.url, error=str(error))
            except TimeoutError:
                return PodScrape(endpoint.url, error=f"no answer within {self.limits.timeout_seconds:g}s")
            except aiohttp.ClientError as error:
                return PodScrape(endpoint.url, error=_cannot_read(error))
            except Exception as error:  # a bug of ours or aiohttp's: the pod is unread, as a kept read's would be
                log.exception("engine_scrape_failed", url=endpoint.url, once=True)
                return PodScrape(endpoint.url, error=_cannot_read(error))

    def note_limited(self, limit: str, **detail: object) -> None:
        """Count that ``limit`` acted, and log it unless it was logged within the last few seconds."""
        self._acted(limit, **detail)

    def add_listener(self, listener: Callable[[], None]) -> None:
        self._listeners.append(listener)

    def pods(self) -> dict[PodKey, PodScrape]:
        """The newest scrape of each pod read now."""
        return {pod: w.scrape for pod, w in self._wanted.items() if w.scrape is not None}

    def wanted(self) -> dict[PodKey, float]:
        """The pods wanted now, each with the interval it is read at: what the read paths must leave as it is."""
        return {pod: w.interval for pod, w in self._wanted.items()}

    def tick(self) -> None:
        """One look at the clock, which the scraper makes every ``TICK_SECONDS`` while a pod is wanted: forget the
        pods and intervals no longer asked for, and queue the reads that are due."""
        now = self._clock()
        for pod in [p for p, w in self._wanted.items() if now - w.asked_at > FORGET_AFTER_SECONDS]:
            self._drop(self._wanted.pop(pod))
        for pod, wanted in self._wanted.items():
            wanted.forget_old_asks(now)
            if wanted.task is None and wanted.queued_at is None and now >= wanted.due_at:
                self._enqueue(pod, wanted, dispatch=False)
        self._dispatch()  # once for all the reads that fell due, not once each

    async def _run(self) -> None:
        while True:
            if not self._wanted:
                self._someone_wants.clear()
                await self._someone_wants.wait()
            self.tick()
            await asyncio.sleep(TICK_SECONDS)

    def _drop(self, wanted: WantedPod) -> None:
        # No longer wanted (forgotten, or its address changed): its queue entry is skipped, its read cancelled.
        self._generation += 1  # its scrape is no longer an answer
        wanted.queued_at = None
        if wanted.task is not None:
            wanted.task.cancel()
        wanted.settle()

    def _enqueue(self, pod: PodKey, wanted: WantedPod, *, dispatch: bool = True) -> None:
        wanted.queued_at = self._clock()
        wanted.held_back = False
        namespace = self._namespaces.get(pod[0])
        if namespace is None:
            namespace = self._namespaces[pod[0]] = _Namespace()
        if not namespace.queue:
            self._turns.append(pod[0])
        namespace.queue.append((pod, wanted))
        if dispatch:
            self._dispatch()

    def _dispatch(self) -> None:
        """Give free slots to waiting reads, one namespace after another (the module docstring says why)."""
        if not self._running:
            return
        passed = 0  # namespaces in turn that could take no slot now, in a row
        while self._reading < self.limits.concurrency and passed < len(self._turns):
            name = self._turns.popleft()
            namespace = self._namespaces[name]
            entry = self._next_of(namespace)
            if entry is None:  # only entries no longer wanted were left
                if namespace.reading == 0:
                    del self._namespaces[name]
                continue
            if namespace.reading >= self._share:
                namespace.queue.appendleft(entry)
                self._turns.append(name)
                passed += 1
                wanted = entry[1]
                if not wanted.held_back:
                    wanted.held_back = True
                    self.note_limited("namespace_share", namespace=name, reading=namespace.reading, share=self._share)
                continue
            passed = 0
            self._begin(entry, namespace)
            if namespace.queue:
                self._turns.append(name)

    def _next_of(self, namespace: _Namespace) -> tuple[PodKey, WantedPod] | None:
        while namespace.queue:
            pod, wanted = namespace.queue.popleft()
            if self._wanted.get(pod) is wanted and wanted.queued_at is not None:
                return pod, wanted
        return None

    def _begin(self, entry: tuple[PodKey, WantedPod], namespace: _Namespace) -> None:
        pod, wanted = entry
        queued_at = wanted.queued_at if wanted.queued_at is not None else self._clock()
        wanted.queued_at = None
        namespace.reading += 1
        self._reading += 1
        task = asyncio.get_running_loop().create_task(
            self._scrape(pod, wanted, queued_at), name=f"scrape {pod[0]}/{pod[1]}"
        )
        # The slot is given back when the task ends, however it ends (a task cancelled before it ran runs no
        # finally of its own).
        task.add_done_callback(lambda _: self._release(pod[0], namespace))
        wanted.task = task

    def _release(self, name: str, namespace: _Namespace) -> None:
        namespace.reading -= 1
        self._reading -= 1
        if namespace.reading == 0 and not namespace.queue and self._namespaces.get(name) is namespace:
            del self._namespaces[name]
        self._dispatch()

    async def _scrape(self, pod: PodKey, wanted: WantedPod, queued_at: float) -> None:
        try:
            body = await self._reader.fetch(wanted.endpoint, pod=pod, engine=wanted.engine)
            page = await self._reader.parse(body, wanted.engine, at=self._clock())
            previous = wanted.scrape.page if wanted.scrape is not None else None
            wanted.scrape = PodScrape(wanted.endpoint.url, page, previous)
            outcome = "ok"
        except (ScrapeFailed, MalformedPage) as error:
            outcome = "malformed" if isinstance(error, MalformedPage) else error.outcome
            wanted.failed(str(error))
        except TimeoutError:
            outcome = "timeout"
            wanted.failed(f"no answer within {self.limits.timeout_seconds:g}s")
        except aiohttp.ClientError as error:
            outcome = "error"
            wanted.failed(_cannot_read(error))
        except Exception as error:  # a bug of ours or aiohttp's: the pod is unread, reads go on
            outcome = "error"
            log.exception("engine_scrape_failed", pod=f"{pod[0]}/{pod[1]}", url=wanted.endpoint.url)
            wanted.failed(_cannot_read(error))
        finally:
            if self._wanted.get(pod) is wanted:
                wanted.task = None
        delay = wanted.read_ended(outcome == "ok", self._clock())
        if delay > wanted.interval:
            self.note_limited(
                "backoff", pod=f"{pod[0]}/{pod[1]}", failures=wanted.failures, next_in_seconds=round(delay, 3)
            )
        wanted.settle()
        self._generation += 1
        self.results[outcome] = self.results.get(outcome, 0) + 1
        for observer in self.on_scrape:
            observer(self._clock() - queued_at, outcome)
        self._notify_soon()

    def _notify_soon(self) -> None:
        if self._notify_scheduled:
            return
        self._notify_scheduled = True
        asyncio.get_running_loop().call_later(TICK_SECONDS, self._notify)

    def _notify(self) -> None:
        self._notify_scheduled = False
        for listener in self._listeners:
            listener()


# A one-shot read that had not landed when the caller's deadline came.
_NO_TIME = "not read within the call's deadline (a read path reads a pod no query wants once, on its own slots)"


def _cannot_read(error: Exception) -> str:
    return f"cannot read it: {type(error).__name__}: {str(error)[:160]}"
