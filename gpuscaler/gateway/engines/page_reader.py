"""One read of one pod's engine metrics page, within its limits: the request, the body, then the values.

Every read is bounded: a timeout, a body size, no redirects, no proxy, no compression (a small gzip can
inflate to gigabytes), and only the address the pod itself declares (``signals/engine_pods.py``). When and
how often a pod is read is the scraper's (``scraper.py``).
"""

from __future__ import annotations

import aiohttp

from gpuscaler.gateway.engines.limits import ScrapeLimits
from gpuscaler.gateway.engines.page import prefilter, read_page
from gpuscaler.model.engines import Engine, EnginePage, engine_series
from gpuscaler.signals.engine_pods import Endpoint

CHUNK_BYTES = 64 * 1024


class ScrapeFailed(Exception):
    """A page that could not be used, with the outcome /metrics counts it under."""

    def __init__(self, outcome: str, message: str) -> None:
        super().__init__(message)
        self.outcome = outcome


class PageReader:
    """Reads engine pages over one HTTP session; ``read`` raises ``ScrapeFailed``, ``page.MalformedPage``,
    ``TimeoutError`` or ``aiohttp.ClientError`` for a page it cannot use."""

    def __init__(self, limits: ScrapeLimits) -> None:
        self.limits = limits
        self._session: aiohttp.ClientSession | None = None
        self._prefilters = {engine: prefilter(engine_series(engine)) for engine in Engine}

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=self.limits.concurrency, use_dns_cache=False),
            timeout=aiohttp.ClientTimeout(total=self.limits.timeout_seconds),
            auto_decompress=False,
            trust_env=False,  # no proxy from the environment: the pod's own address, or nothing
            headers={"Accept": "text/plain;version=0.0.4", "Accept-Encoding": "identity"},
        )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def fetch(self, endpoint: Endpoint) -> bytes:
        """The page's body, or ``ScrapeFailed`` for a status, an encoding or a size that cannot be used."""
        assert self._session is not None, "start() first"
        async with self._session.get(endpoint.url, allow_redirects=False) as response:
            if response.status != 200:
                raise ScrapeFailed("status", f"HTTP {response.status} {response.reason or ''}".rstrip())
            if response.headers.get("Content-Encoding", "identity") != "identity":
                raise ScrapeFailed("malformed", f"a {response.headers['Content-Encoding']} body; it was not asked for")
            limit = self.limits.max_page_bytes
            if (response.content_length or 0) > limit:
                raise ScrapeFailed("too_large", f"a page of {response.content_length} bytes, over the {limit} allowed")
            body = bytearray()
            async for chunk in response.content.iter_chunked(CHUNK_BYTES):
                body += chunk
                if len(body) > limit:
                    raise ScrapeFailed("too_large", f"a page over the {limit} bytes allowed")
            return bytes(body)

    def parse(self, body: bytes, engine: Engine, *, at: float) -> EnginePage:
        """The values ``engine``'s signals read from ``body``; ``MalformedPage`` when it cannot be read."""
        return read_page(body, self._prefilters[engine], at=at)
