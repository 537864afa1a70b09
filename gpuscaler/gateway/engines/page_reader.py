"""One read of one pod's engine metrics page, within its limits: the request, the body, then the values.

Every read is bounded: a timeout, a body size, no redirects, no proxy, no compression (a small gzip can
inflate to gigabytes), and only the address the pod itself declares (``signals/engines/pods.py``). When and
how often a pod is read is the scraper's (``scraper.py``).

Memory: a read holds its body as the chunks that arrived, never joined or copied, and stops at the first
byte past ``--engine-max-page-bytes`` (at once where Content-Length says more); ``parse`` lets each chunk go
as the prefilter has read it. The most all reads hold at once is ``--engine-scrape-concurrency`` x
``--engine-max-page-bytes``: 32 x 4 MiB = 128 MiB with the defaults. Freed, those chunks stay in the C
allocator's free lists, among the small objects allocated meanwhile: 80 endless pages left the gateway 43-69 MiB
above where it started 10 s after they were gone. So a second after reads that held a megabyte or more end
(``TRIM_AFTER_SECONDS``), glibc's ``malloc_trim`` hands the free pages back (under 1 ms); where the C library has
none (musl), nothing is done.

CPU: parsing runs on the event loop, in turns. The prefilter takes at most ``FEED_BYTES`` of a chunk a turn (aiohttp
may join reads into a larger one) and refuses the page past ``--engine-max-label-sets``, or at a kept line over
``page.MAX_LINE_BYTES``, before the parser sees a line (``page.py``); the parser then takes ``page.PARSE_BATCH_BYTES``
of text a turn, and one page is parsed at a time, so one turn of the loop spends at most a few milliseconds on
pages however many are read, whatever their lines' lengths. Not a worker thread: the parser is Python and holds
the GIL, so the loop would wait up to a switch interval (5 ms) for it after every system call it makes, a
send, a receive, an epoll, and a call takes several; nor a process: each page would be copied to it, and the
gateway's memory doubled for a second interpreter. Bounded turns on the loop cost the same CPU and keep the
waits to one batch.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

import aiohttp

from gpuscaler.gateway.engines.limits import ScrapeLimits
from gpuscaler.gateway.engines.page import (
    Pools,
    Prefilter,
    TooManyLabelSets,
    add_values,
    batches,
    page_of,
    prefilter,
)
from gpuscaler.model.engines import Engine, EnginePage, engine_series, series_bounds, series_labels
from gpuscaler.signals.engines.pods import Endpoint
from gpuscaler.signals.engines.source import PodKey

PageBody = list[bytes]  # the chunks of a page as they arrived
# What one turn of the event loop takes in from one page's socket. asyncio's own is 256 KiB, and reading it costs
# about 0.35 ms (the copy out of the kernel, aiohttp's pass over it): 32 pages arriving at once made 10 ms turns.
READ_BYTES = 64 * 1024
# What the prefilter scans in one turn: a chunk's copy and a memchr per wanted name, well under a millisecond.
FEED_BYTES = READ_BYTES
BIG_READ_BYTES = 1024 * 1024
TRIM_AFTER_SECONDS = 1.0


def _malloc_trim() -> Callable[[], object] | None:
    """glibc's ``malloc_trim(0)``, or None where the C library has no such call."""
    with contextlib.suppress(OSError, AttributeError, TypeError):
        trim = ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim
        trim.argtypes = [ctypes.c_size_t]
        return lambda: trim(0)
    return None


MALLOC_TRIM = _malloc_trim()


# What the EPP answers a bearer token it does not accept: 401 or 403 from its authorizer, 500 when the API server's
# TokenReview rejected the token (controller-runtime v0.23.3's metrics filter, filters.go:86-90).
REFUSED_TOKEN_STATUSES = (401, 403, 500)


@dataclass(frozen=True, slots=True)
class Withheld:
    """An EPP read sent no token: ``reason`` (a metric label) and ``why`` (what a 401 or 403 from it says)."""

    reason: str
    why: str


# The bearer token for an EPP pod's read: the token when the pod is the endpoint picker of an InferencePool of a
# trusted namespace, Withheld when it is not (it is sent none); raises ScrapeFailed when it is one and no token
# can be had (epp_token.py).
class Authorize(Protocol):
    """``ask`` False: a read path's read, which asks the API for nothing and counts nothing."""

    def __call__(self, pod: PodKey, endpoint: Endpoint, *, ask: bool = True) -> Awaitable[str | Withheld]: ...

    def refused(self, token: str) -> None:
        """The EPP refused ``token``: ask for another instead of sending it again."""


NOT_A_PICKER = (
    "the pod is not the endpoint picker an InferencePool's endpointPickerRef names, so it is sent no token "
    "(docs/engines.md)"
)


class ScrapeFailed(Exception):
    """A page that could not be used, with the outcome /metrics counts it under."""

    def __init__(self, outcome: str, message: str) -> None:
        super().__init__(message)
        self.outcome = outcome


class PageReader:
    """Reads engine pages over one HTTP session; ``read`` raises ``ScrapeFailed``, ``page.MalformedPage``,
    ``TimeoutError`` or ``aiohttp.ClientError`` for a page it cannot use."""

    def __init__(self, limits: ScrapeLimits, *, authorize: Authorize | None = None) -> None:
        """``authorize``: who gets the EPP's bearer token (``--epp-metrics-token-service-account``); None: nobody."""
        self.limits = limits
        self.authorize = authorize
        self._session: aiohttp.ClientSession | None = None
        self._prefilters = {
            engine: prefilter(engine_series(engine), series_bounds(engine), series_labels(engine)) for engine in Engine
        }
        self._parsing = asyncio.Lock()  # one page parsed at a time: a loop turn runs one batch of one page
        self._trim: asyncio.TimerHandle | None = None

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=self.limits.concurrency, use_dns_cache=False),
            timeout=aiohttp.ClientTimeout(total=self.limits.timeout_seconds),
            auto_decompress=False,
            trust_env=False,  # no proxy from the environment: the pod's own address, or nothing
            headers={"Accept": "text/plain;version=0.0.4", "Accept-Encoding": "identity"},
        )

    async def close(self) -> None:
        if self._trim is not None:
            self._trim.cancel()
        if self._session is not None:
            await self._session.close()

    async def fetch(
        self, endpoint: Endpoint, *, pod: PodKey | None = None, engine: Engine | None = None, ask: bool = True
    ) -> PageBody:
        """The page's body as its chunks, or ``ScrapeFailed`` for a status, an encoding or a size that cannot be
        used; an oversized page is refused at its Content-Length, or at its first byte past the limit. ``ask``
        False (a read path): no token is asked for and nothing counted (``Authorize``)."""
        assert self._session is not None, "start() first"
        # The EPP's /metrics asks for a bearer token by default (--metrics-endpoint-auth). Only an EPP read of a pod
        # ``authorize`` says an InferencePool's endpointPickerRef names carries one; any other read carries none,
        # whatever its selection, labels or annotations say (docs/engines.md).
        token, why = None, "no token is sent"
        if self.authorize is not None and engine is Engine.EPP and pod is not None:
            granted = await self.authorize(pod, endpoint, ask=ask)
            if isinstance(granted, Withheld):
                why = granted.why
            else:
                token = granted
        headers = {"Authorization": f"Bearer {token}"} if token is not None else None
        async with self._session.get(endpoint.url, allow_redirects=False, headers=headers) as response:
            _smaller_reads(response)
            if response.status != 200:
                status = f"HTTP {response.status} {response.reason or ''}".rstrip()
                if engine is Engine.EPP and token is None and response.status in (401, 403):
                    status += f": {why}"
                elif engine is Engine.EPP and token is not None and response.status in REFUSED_TOKEN_STATUSES:
                    # A token the API server's TokenReview rejects (expired, its bound pod gone) comes back as a 500
                    # from the EPP (controller-runtime's filter), not a 401: either way, ask for another.
                    assert self.authorize is not None
                    self.authorize.refused(token)
                    status += ": the EPP refused the token sent; a new one is asked for"
                raise ScrapeFailed("status", status)
            if response.headers.get("Content-Encoding", "identity") != "identity":
                raise ScrapeFailed("malformed", f"a {response.headers['Content-Encoding']} body; it was not asked for")
            limit = self.limits.max_page_bytes
            if (response.content_length or 0) > limit:
                raise ScrapeFailed("too_large", f"a page of {response.content_length} bytes, over the {limit} allowed")
            body: PageBody = []
            size = 0
            try:
                async for chunk in response.content.iter_any():
                    size += len(chunk)
                    if size > limit:
                        raise ScrapeFailed("too_large", f"a page over the {limit} bytes allowed")
                    body.append(chunk)
            finally:
                if size >= BIG_READ_BYTES:
                    self._trim_soon()
            return body

    def _trim_soon(self) -> None:
        """Hand freed memory back to the system TRIM_AFTER_SECONDS from now, unless that is already due."""
        if MALLOC_TRIM is not None and self._trim is None:
            self._trim = asyncio.get_running_loop().call_later(TRIM_AFTER_SECONDS, self._trimmed)

    def _trimmed(self) -> None:
        self._trim = None
        assert MALLOC_TRIM is not None
        MALLOC_TRIM()

    async def parse(self, body: PageBody, engine: Engine, *, at: float) -> EnginePage:
        """The values ``engine``'s signals read from ``body``, which it empties; ``MalformedPage`` when it cannot
        be read, ``ScrapeFailed`` (too_many_label_sets) past ``--engine-max-label-sets``."""
        async with self._parsing:
            return await read_page(body, self._prefilters[engine], at=at, max_label_sets=self.limits.max_label_sets)


def _smaller_reads(response: aiohttp.ClientResponse) -> None:
    """Take in at most READ_BYTES of the page's socket a turn. ``max_size`` is the selector transport's own
    attribute (CPython's asyncio reads ``self.max_size`` on each read); another loop's transport is left alone."""
    connection = response.connection
    transport = connection.transport if connection is not None else None
    if transport is not None and isinstance(getattr(transport, "max_size", None), int):
        transport.max_size = READ_BYTES  # type: ignore[attr-defined]


async def read_page(body: PageBody, wanted: Prefilter, *, at: float, max_label_sets: int) -> EnginePage:
    """``page.read_whole_page`` in turns of the event loop: up to ``FEED_BYTES`` of a chunk, then one batch of
    lines, a turn."""
    page = wanted.filter(max_label_sets)
    chunks = deque(body)
    body.clear()
    try:
        while chunks:
            chunk = chunks.popleft()  # and let it go once read
            for start in range(0, len(chunk), FEED_BYTES):
                page.feed(chunk[start : start + FEED_BYTES])
                await asyncio.sleep(0)
    except TooManyLabelSets as error:
        raise ScrapeFailed("too_many_label_sets", str(error)) from None
    finally:
        chunks.clear()
    values: dict[str, float] = {}
    counts: dict[str, int] = {}
    pools: Pools = {}
    for text in batches(page.finish()):
        add_values(text, values, counts, wanted, pools)
        await asyncio.sleep(0)
    return page_of(values, counts, at=at, pools=pools)
