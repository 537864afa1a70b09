"""What reading engine pages may cost: the ``--engine-*`` flags' values, with no HTTP client imported.

Kept apart from the reader so that the settings, and ``serve`` through them, do not import aiohttp.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpuscaler.query.engine_keys import DEFAULT_MIN_SCRAPE_SECONDS


@dataclass(frozen=True, slots=True)
class ScrapeLimits:
    """What one scrape may cost (``--engine-scrape-*`` flags)."""

    timeout_seconds: float = 2.0
    max_page_bytes: int = 4 * 1024 * 1024
    concurrency: int = 32
    # What one query may ask (``--engine-min-scrape-interval``, ``--engine-max-pods-per-selection``): together they
    # bound the reads one selection causes, at most ``max_pods / min_interval_seconds`` a second.
    min_interval_seconds: float = DEFAULT_MIN_SCRAPE_SECONDS
    max_pods: int = 500
    # Label sets one page may give each series the signals read (``--engine-max-label-sets``): bounds the parse.
    max_label_sets: int = 8192


DEFAULT_SCRAPE_LIMITS = ScrapeLimits()
