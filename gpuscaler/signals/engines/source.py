"""Where engine signals are read from: the gateway's scraper of the selected pods' metrics pages.

Interest and reading are apart. A pod is read only while some query asks for it (``want``: a query KEDA prepares,
a push stream while it is open), at the interval that query asks, with one scrape per pod shared by every query.
Evaluating reads the newest scrape (``scrape``) and changes nothing; a read path (Explain, a preview) reads a pod
no query wants once for its own answer (``read_once``) and keeps nothing. A node agent has no source: engine queries
need the gateway.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Protocol

from gpuscaler.model.engines import Engine, PodScrape
from gpuscaler.signals.engines.pods import Endpoint

PodKey = tuple[str, str]  # (namespace, pod)


class EngineSource(Protocol):
    """The newest scrape of each pod some query wants read."""

    @property
    def timeout_seconds(self) -> float:
        """How long one scrape may take."""

    @property
    def min_interval_seconds(self) -> float:
        """The shortest ``scrapeInterval`` a query may ask (``--engine-min-scrape-interval``)."""

    @property
    def generation(self) -> int:
        """Moves whenever what ``scrape`` answers for any pod may have changed (a read landed, a pod was forgotten):
        an evaluation made at one generation holds until the next, as a GPU one does until the next snapshot."""

    @property
    def max_pods(self) -> int:
        """The most pods one selection may read (``--engine-max-pods-per-selection``)."""

    def want(self, pod: PodKey, engine: Engine, endpoint: Endpoint, interval_seconds: float) -> None:
        """Keep ``pod`` read at least every ``interval_seconds`` while it is asked for."""

    def scrape(self, pod: PodKey) -> PodScrape | None:
        """The newest scrape of ``pod``, or None when it is not read; changes nothing."""

    async def first_reads(self, pods: Collection[PodKey], within_seconds: float) -> None:
        """Return once each of ``pods`` never read has had its first try, or after ``within_seconds``."""

    async def read_once(
        self, reads: Sequence[tuple[PodKey, Engine, Endpoint]], within_seconds: float
    ) -> Mapping[PodKey, PodScrape]:
        """For one read path's answer (Explain, a preview), each of ``reads`` that no query wants read once, within
        ``within_seconds``; nothing is kept or wanted. Pods already wanted are left out: their scrape is the answer."""

    def note_limited(self, limit: str, **detail: object) -> None:
        """Count (and log, at a bounded rate) that a limit on reading engine pages acted."""

    def add_listener(self, listener: Callable[[], None]) -> None:
        """Call ``listener`` after scrapes land (at most once per turn of the event loop)."""


def stale_after(interval_seconds: float, timeout_seconds: float) -> float:
    """A page older than this is no answer: two scrapes missed, and the third's time to answer."""
    return 2 * interval_seconds + timeout_seconds
