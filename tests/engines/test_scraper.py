"""The engine scraper on its own: reads at the interval asked, shares its slots between namespaces, backs off a
failing pod without making it look fresh, and survives its bugs."""

from __future__ import annotations

import asyncio

import pytest

from gpuscaler.gateway.engines import page_reader as page_reader_module
from gpuscaler.gateway.engines.limits import ScrapeLimits
from gpuscaler.gateway.engines.scraper import BACKOFF_MAX_SECONDS, EngineScraper, backoff_seconds, namespace_share
from gpuscaler.model.engines import Engine
from gpuscaler.signals.engine_pods import Endpoint
from tests.fakes.fake_engine import FakeEngine
from tests.waiting import until

POD = ("ml", "llm-0")


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
