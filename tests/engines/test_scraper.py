"""The engine scraper on its own: reads at the interval asked, forgets nothing it is asked for, survives its bugs."""

from __future__ import annotations

import pytest

from gpuscaler.gateway.engines import page_reader as page_reader_module
from gpuscaler.gateway.engines.page import read_page
from gpuscaler.gateway.engines.scraper import EngineScraper
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
        real = read_page

        def broken(*args: object, **kwargs: object) -> object:
            raise RuntimeError("a bug")

        monkeypatch.setattr(page_reader_module, "read_page", broken)
        scraper.want(POD, Engine.TGI, endpoint, 0.25)
        await scraper.settle()
        scrape = scraper.want(POD, Engine.TGI, endpoint, 0.25)
        assert scrape is not None
        assert scrape.error == "cannot read it: RuntimeError: a bug"
        assert scraper.results == {"error": 1}
        monkeypatch.setattr(page_reader_module, "read_page", real)
        await until(lambda: (s := scraper.want(POD, Engine.TGI, endpoint, 0.25)) is not None and s.error is None)
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
        await scraper.settle()
        scraper.want(POD, Engine.TGI, endpoint, 0.25)
        await until(lambda: engine.requests >= 4, timeout=5)
    finally:
        await scraper.stop()
        await engine.stop()
