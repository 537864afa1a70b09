"""The engine scraper on its own: reads at the interval asked, shares its slots between namespaces, backs off a
failing pod without making it look fresh, and survives its bugs."""

from __future__ import annotations

import asyncio
import itertools

import pytest
import structlog

from gpuscaler.gateway.engines import page_reader as page_reader_module
from gpuscaler.gateway.engines.limits import ScrapeLimits
from gpuscaler.gateway.engines.page_reader import PageBody, PageReader, ScrapeFailed
from gpuscaler.gateway.engines.scraper import EngineScraper, namespace_share, once_slots
from gpuscaler.gateway.engines.wanted import BACKOFF_MAX_SECONDS, FORGET_AFTER_SECONDS, backoff_seconds
from gpuscaler.model.engines import Engine, EnginePage
from gpuscaler.signals.engines.pods import Endpoint
from tests.fakes.fake_engine import FakeEngine
from tests.waiting import until

POD = ("ml", "llm-0")
ENDPOINT = Endpoint("127.0.0.1", 9, "/metrics")  # never dialled: the fake reader answers
# Fake time moves in steps that binary floats hold exactly, so that the gaps compare exactly.
STEP_SECONDS = 1 / 64


class FakeClock:
    """Time that moves only when the test moves it."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class FakeReader(PageReader):
    """Answers each read at once, with a page or a 503 as ``failing`` says, and notes when each read began."""

    def __init__(self, clock: FakeClock) -> None:
        super().__init__(ScrapeLimits())
        self.clock = clock
        self.failing = False
        self.began: list[float] = []

    async def fetch(self, endpoint: Endpoint, **_: object) -> PageBody:
        self.began.append(self.clock())
        if self.failing:
            raise ScrapeFailed("status", "HTTP 503 Service Unavailable")
        return []

    async def parse(self, body: PageBody, engine: Engine, *, at: float) -> EnginePage:
        return EnginePage(at=at, values={})


async def run_until(scraper: EngineScraper, clock: FakeClock, reader: FakeReader, end: float) -> None:
    """Move fake time to ``end`` a step at a time, letting each read that falls due start and land."""
    await until(lambda: scraper.reading == 0)  # a first read, queued when the pod was wanted
    while clock.now < end:
        clock.now += STEP_SECONDS
        scraper.tick()
        await until(lambda: scraper.reading == 0)


def gaps(times: list[float]) -> list[float]:
    """The time between each read and the next."""
    return [later - earlier for earlier, later in itertools.pairwise(times)]


async def test_a_bug_while_reading_leaves_the_pod_unread_and_the_reads_going(monkeypatch: pytest.MonkeyPatch) -> None:
    """An exception nobody expected makes the pod's newest scrape an error naming it; the next read works."""
    engine = await FakeEngine(Engine.TGI, {"waiting": 2}).start()
    scraper = EngineScraper()
    await scraper.start()
    try:
        endpoint = Endpoint("127.0.0.1", engine.port, "/metrics")
        real = page_reader_module.read_page

        def broken(*args: object, **kwargs: object) -> object:
            raise RuntimeError("a bug")

        monkeypatch.setattr(page_reader_module, "read_page", broken)
        scraper.want(POD, Engine.TGI, endpoint, 0.25)
        await scraper.first_reads([POD], within_seconds=10)
        scrape = scraper.scrape(POD)
        assert scrape is not None
        assert scrape.error == "cannot read it: RuntimeError: a bug"
        assert scraper.results == {"error": 1}
        monkeypatch.setattr(page_reader_module, "read_page", real)
        await until(lambda: (s := scraper.scrape(POD)) is not None and s.error is None)
        assert scraper.pods()[POD].page is not None
    finally:
        await scraper.stop()
        await engine.stop()


async def test_a_pod_is_read_at_the_shortest_interval_any_query_asks() -> None:
    """Asked at 10 s and at 0.25 s, the pod is read about every 0.25 s."""
    engine = await FakeEngine(Engine.TGI, {"waiting": 2}).start()
    scraper = EngineScraper()
    await scraper.start()
    try:
        endpoint = Endpoint("127.0.0.1", engine.port, "/metrics")
        scraper.want(POD, Engine.TGI, endpoint, 10.0)
        await scraper.first_reads([POD], within_seconds=10)
        scraper.want(POD, Engine.TGI, endpoint, 0.25)
        await until(lambda: engine.requests >= 4, timeout=5)
    finally:
        await scraper.stop()
        await engine.stop()


async def test_an_interval_no_longer_asked_for_stops_setting_the_pace() -> None:
    """A pod asked at 1 s once and at 10 s ever since is read every second until the 1 s ask is
    FORGET_AFTER_SECONDS old, then every 10 s: the shortest interval asked lately, not the shortest ever."""
    clock = FakeClock()
    reader = FakeReader(clock)
    scraper = EngineScraper(clock=clock, reader=reader)
    await scraper.start()
    try:
        scraper.want(POD, Engine.TGI, ENDPOINT, 1.0)
        end = FORGET_AFTER_SECONDS + 60.0
        while clock.now < end:
            scraper.want(POD, Engine.TGI, ENDPOINT, 10.0)  # a poll every 30 s, as KEDA's
            await run_until(scraper, clock, reader, clock.now + 30.0)
        read = list(zip(reader.began, gaps(reader.began), strict=False))
        early = [gap for at, gap in read if at < FORGET_AFTER_SECONDS]
        late = [gap for at, gap in read if at > FORGET_AFTER_SECONDS + 1]
        assert set(early) == {1.0}
        assert len(late) >= 3
        assert set(late) == {10.0}
    finally:
        await scraper.stop()


async def test_a_failing_pod_is_next_read_after_the_back_off_its_last_read_earned() -> None:
    """Read every 0.25 s and failing from its first read, a pod's reads are as far apart as backoff_seconds says
    for the failures so far, each gap decided by the read before it, as its backoff line says."""
    clock = FakeClock()
    reader = FakeReader(clock)
    reader.failing = True
    scraper = EngineScraper(clock=clock, reader=reader)
    await scraper.start()
    try:
        with structlog.testing.capture_logs() as logs:
            scraper.want(POD, Engine.TGI, ENDPOINT, 0.25)
            await run_until(scraper, clock, reader, 8.0)
        expected = [backoff_seconds(0.25, failures) for failures in range(1, len(reader.began))]
        assert len(reader.began) >= 5
        assert gaps(reader.began) == expected
        said = [line["next_in_seconds"] for line in logs if line["event"] == "engine_limited"]
        assert said[0] == expected[1]  # after the second failure, the gap that came next
    finally:
        await scraper.stop()


async def test_reading_a_scrape_wants_nothing() -> None:
    """Looking a pod up neither starts reading it nor keeps it read: only ``want`` does."""
    engine = await FakeEngine(Engine.TGI, {"waiting": 2}).start()
    scraper = EngineScraper()
    await scraper.start()
    try:
        assert scraper.scrape(POD) is None
        await scraper.first_reads([POD], within_seconds=1)  # not wanted: nothing to wait for
        assert (scraper.pods(), engine.requests, scraper.results) == ({}, 0, {})
    finally:
        await scraper.stop()
        await engine.stop()


async def test_one_namespaces_silent_pods_leave_slots_for_another_namespace() -> None:
    """Eight pods of one namespace that never answer take at most its share of four slots: another namespace's pod,
    wanted after them, is read at once, while theirs still wait for their timeout; its first read is all a query
    on it waits for."""
    silent = await FakeEngine(Engine.TGI, mode="hang").start()
    healthy = await FakeEngine(Engine.TGI, {"waiting": 3}).start()
    scraper = EngineScraper(ScrapeLimits(timeout_seconds=20.0, concurrency=4))
    await scraper.start()
    try:
        dead = [("bad", f"silent-{index}") for index in range(8)]
        for pod in dead:
            scraper.want(pod, Engine.TGI, Endpoint("127.0.0.1", silent.port, "/metrics"), 1.0)
        await until(lambda: silent.requests == namespace_share(4))
        scraper.want(("good", "llm-0"), Engine.TGI, Endpoint("127.0.0.1", healthy.port, "/metrics"), 1.0)
        await scraper.first_reads([("good", "llm-0")], within_seconds=15)
        scrape = scraper.scrape(("good", "llm-0"))
        assert scrape is not None
        assert (scrape.error, scrape.page is not None) == (None, True)
        assert all(scraper.scrape(pod) is None for pod in dead)  # none of theirs has landed: no timeout was waited
        assert silent.requests == namespace_share(4)
        assert scraper.limited["namespace_share"] >= 1
    finally:
        await scraper.stop()
        await silent.stop()
        await healthy.stop()


async def test_a_wait_for_first_reads_ends_at_its_deadline_and_is_counted() -> None:
    """A pod that does not answer within the time given is left unread (unknown), and the wait counts as limited."""
    silent = await FakeEngine(Engine.TGI, mode="hang").start()
    scraper = EngineScraper(ScrapeLimits(timeout_seconds=20.0))
    await scraper.start()
    try:
        scraper.want(POD, Engine.TGI, Endpoint("127.0.0.1", silent.port, "/metrics"), 1.0)
        await scraper.first_reads([POD], within_seconds=0.05)
        assert scraper.scrape(POD) is None
        assert scraper.limited["first_read_wait"] == 1
    finally:
        await scraper.stop()
        await silent.stop()


async def test_a_one_shot_read_reads_a_pod_no_one_wants_once_and_keeps_nothing() -> None:
    """A read path's read of a pod no query wants reads it once and returns its page; the pod is not wanted after,
    and a pod that is wanted is left out (its own scrape is the answer), with no read of its own."""
    engine = await FakeEngine(Engine.TGI, {"waiting": 2}).start()
    kept = await FakeEngine(Engine.TGI, {"waiting": 5}).start()
    scraper = EngineScraper()
    await scraper.start()
    try:
        endpoint = Endpoint("127.0.0.1", engine.port, "/metrics")
        kept_endpoint = Endpoint("127.0.0.1", kept.port, "/metrics")
        scraper.want(("ml", "kept"), Engine.TGI, kept_endpoint, 10.0)
        await scraper.first_reads([("ml", "kept")], within_seconds=10)
        read = await scraper.read_once(
            [(POD, Engine.TGI, endpoint), (("ml", "kept"), Engine.TGI, kept_endpoint)], within_seconds=10
        )
        assert list(read) == [POD]
        assert (read[POD].error, read[POD].page is not None) == (None, True)
        assert (engine.requests, kept.requests) == (1, 1)
        assert set(scraper.pods()) == {("ml", "kept")}
        assert scraper.scrape(POD) is None
    finally:
        await scraper.stop()
        await engine.stop()
        await kept.stop()


async def test_one_shot_reads_take_their_own_slots_and_end_at_the_deadline() -> None:
    """Three one-shot reads of a silent engine hold one slot of their own (a quarter of four) and end at the
    caller's deadline, each saying so, counted; meanwhile a wanted pod is read at once on the scraper's slots."""
    silent = await FakeEngine(Engine.TGI, mode="hang").start()
    healthy = await FakeEngine(Engine.TGI, {"waiting": 3}).start()
    scraper = EngineScraper(ScrapeLimits(timeout_seconds=20.0, concurrency=4))
    await scraper.start()
    try:
        endpoint = Endpoint("127.0.0.1", silent.port, "/metrics")
        reads = [(("bad", f"silent-{index}"), Engine.TGI, endpoint) for index in range(3)]
        once = asyncio.get_running_loop().create_task(scraper.read_once(reads, within_seconds=1.0))
        await until(lambda: silent.requests == once_slots(4))
        scraper.want(("good", "llm-0"), Engine.TGI, Endpoint("127.0.0.1", healthy.port, "/metrics"), 1.0)
        await scraper.first_reads([("good", "llm-0")], within_seconds=15)
        scrape = scraper.scrape(("good", "llm-0"))
        assert scrape is not None
        assert scrape.page is not None
        read = await once
        assert all("not read within the call's deadline" in str(r.error) for r in read.values())
        assert len(read) == 3
        assert silent.requests == once_slots(4)
        assert scraper.limited["first_read_wait"] == 1
        assert set(scraper.pods()) == {("good", "llm-0")}
    finally:
        await scraper.stop()
        await silent.stop()
        await healthy.stop()


@pytest.mark.parametrize(
    ("interval", "failures", "expected"),
    [
        (1.0, 0, 1.0),
        (1.0, 1, 1.0),
        (1.0, 2, 2.0),
        (1.0, 4, 8.0),
        (1.0, 9, BACKOFF_MAX_SECONDS),
        (0.25, 3, 1.0),
        (60.0, 5, 60.0),
    ],
)
def test_a_failing_pod_is_read_less_often_up_to_a_bound(interval: float, failures: int, expected: float) -> None:
    """Each failure in a row doubles the wait for the next read, up to BACKOFF_MAX_SECONDS or the interval."""
    assert backoff_seconds(interval, failures) == expected


async def test_a_backed_off_pod_stays_unknown_and_is_read_again_when_it_answers() -> None:
    """A pod answering 503 is backed off; its scrape keeps its error (never an older page), and it recovers."""
    engine = await FakeEngine(Engine.TGI, {"waiting": 2}).start()
    scraper = EngineScraper()
    await scraper.start()
    try:
        endpoint = Endpoint("127.0.0.1", engine.port, "/metrics")
        scraper.want(POD, Engine.TGI, endpoint, 0.1)
        await scraper.first_reads([POD], within_seconds=10)
        engine.mode = "status"
        await until(lambda: scraper.limited["backoff"] >= 1, timeout=10)
        scrape = scraper.scrape(POD)
        assert scrape is not None
        assert (scrape.error, scrape.page is not None) == ("HTTP 503 Service Unavailable", True)
        engine.mode = "ok"
        await until(lambda: (s := scraper.scrape(POD)) is not None and s.error is None, timeout=10)
    finally:
        await scraper.stop()
        await engine.stop()


async def test_a_pod_no_longer_wanted_wakes_whoever_waits_for_it() -> None:
    """Stopping the scraper (or forgetting a pod) ends every wait for a first read: nothing waits for ever."""
    silent = await FakeEngine(Engine.TGI, mode="hang").start()
    scraper = EngineScraper(ScrapeLimits(timeout_seconds=20.0))
    await scraper.start()
    try:
        scraper.want(POD, Engine.TGI, Endpoint("127.0.0.1", silent.port, "/metrics"), 1.0)
        waiting = asyncio.get_running_loop().create_task(scraper.first_reads([POD], within_seconds=30))
        await until(lambda: silent.requests == 1)
        await scraper.stop()
        await asyncio.wait_for(waiting, timeout=5)
    finally:
        await scraper.stop()
        await silent.stop()
