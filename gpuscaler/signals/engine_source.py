"""Where engine signals are read from: the gateway's scraper of the selected pods' metrics pages.

Scraping is lazy: a pod is read only while some query asks for it (``want``), at the interval that query asks,
with one scrape per pod shared by every query. A node agent has no source: engine queries need the gateway.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from gpuscaler.model.engines import Engine, PodScrape
from gpuscaler.signals.engine_pods import Endpoint

PodKey = tuple[str, str]  # (namespace, pod)


class EngineSource(Protocol):
    """The newest scrape of each pod some query wants read."""

    @property
    def timeout_seconds(self) -> float:
        """How long one scrape may take."""

    def want(self, pod: PodKey, engine: Engine, endpoint: Endpoint, interval_seconds: float) -> PodScrape | None:
        """Keep ``pod`` read at least every ``interval_seconds`` while it is asked for; its newest scrape."""

    async def settle(self) -> None:
        """Return once every wanted pod that has never been read has had its first try (each is time-bound)."""

    def add_listener(self, listener: Callable[[], None]) -> None:
        """Call ``listener`` after scrapes land (at most once per turn of the event loop)."""


def stale_after(interval_seconds: float, timeout_seconds: float) -> float:
    """A page older than this is no answer: two scrapes missed, and the third's time to answer."""
    return 2 * interval_seconds + timeout_seconds
