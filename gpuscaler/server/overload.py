"""What the listeners do when pushed past a limit: count it, log it at a bounded rate, and never spin on accept().

``LimitCounts`` is the process's count of each time a limit of the metrics and health endpoint acted
(``gpuscaler_http_limited_total{limit}``) and of each accept() that failed for want of a resource
(``gpuscaler_accept_errors_total{listener,errno}``); both servers' registries export it. ``LogEvery`` logs
such an event at most once per ``LOG_EVERY_SECONDS``, with how often it happened since its last line, so an
attack cannot flood the log either.

``quiet_accept_errors`` does the same for asyncio's own listener, the gRPC port. There asyncio reports every
accept() that fails with EMFILE through the loop's exception handler, a traceback each; and before CPython
gh-151615 it goes on calling accept() for the rest of its backlog after the first failure, scheduling one
retry per failure, so the retries multiply every second: 7,299 failed accepts and 1,400 timers pending after
12 s out of descriptors, on Python 3.11 (the agent under ``prlimit --nofile=1024`` logged 41,437 tracebacks in
18 s). The guard counts and rate-limits that one message, hands every other to the handler before it, and ends
asyncio's accept loop at the first resource error: one failure, one retry a second.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from typing import Any, ClassVar

import structlog
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

log = structlog.get_logger(__name__)

# accept() errors that mean "not now" rather than "this connection": the process or the system is out of
# descriptors or memory. The listener stays readable, so accepting again at once fails again at once.
RESOURCE_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
# The label values of gpuscaler_http_limited_total, one per limit of the metrics and health endpoint.
HTTP_LIMITS = (
    "connections",
    "peer_connections",
    "displaced",
    "header_deadline",
    "idle_timeout",
    "request_bytes",
    "answer_timeout",
    "threads",
)
LISTENERS = ("grpc", "metrics")
LOG_EVERY_SECONDS = 10.0
# The message asyncio's accept loop gives the exception handler (selector_events.py), and its retry delay.
ASYNCIO_ACCEPT_FAILED = "socket.accept() out of system resource"
ASYNCIO_RETRY_SECONDS = 1.0

Handler = Callable[[asyncio.AbstractEventLoop, dict[str, Any]], object]


def errno_name(error: OSError) -> str:
    """``EMFILE`` for an OSError with that errno."""
    return errno.errorcode.get(error.errno or 0, str(error.errno))


class LimitCounts(Collector):
    """Each time a limit acted, by limit, and each accept() that failed for want of a resource; thread-safe."""

    _process: ClassVar[LimitCounts | None] = None

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.http: Counter[str] = Counter(dict.fromkeys(HTTP_LIMITS, 0))
        self.accept_errors: Counter[tuple[str, str]] = Counter(
            {(listener, errno.errorcode[number]): 0 for listener in LISTENERS for number in sorted(RESOURCE_ERRNOS)}
        )

    @classmethod
    def of_process(cls) -> LimitCounts:
        """The process's counts, which every registry of the process exports."""
        if cls._process is None:
            cls._process = cls()
        return cls._process

    def http_limited(self, limit: str) -> None:
        with self._lock:
            self.http[limit] += 1

    def accept_failed(self, listener: str, error: OSError) -> None:
        with self._lock:
            self.accept_errors[(listener, errno_name(error))] += 1

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            http, accept_errors = sorted(self.http.items()), sorted(self.accept_errors.items())
        limited = CounterMetricFamily(
            "gpuscaler_http_limited",
            "Times a limit of the metrics and health endpoint acted (docs/security.md), by limit.",
            labels=["limit"],
        )
        for limit, count in http:
            limited.add_metric([limit], count)
        yield limited
        failed = CounterMetricFamily(
            "gpuscaler_accept_errors",
            "accept() calls that failed for want of a resource (EMFILE: the process is out of file descriptors), "
            "by listener and errno; accepting pauses and retries.",
            labels=["listener", "errno"],
        )
        for (listener, name), count in accept_errors:
            failed.add_metric([listener, name], count)
        yield failed


class LogEvery:
    """A warning (or ``level``) ``event`` at most once per ``LOG_EVERY_SECONDS``, with how often it happened since
    the last line.

    The first time logs at once; later times within the interval are only counted, into the next line. Thread-safe:
    the metrics endpoint's connection threads call it as well as the loop.
    """

    def __init__(
        self, event: str, *, clock: Callable[[], float] = time.monotonic, level: str = "warning", **fixed: object
    ) -> None:
        self._event = event
        self._level = level
        self._fixed = fixed
        self._clock = clock
        self._lock = threading.Lock()
        self._last: float | None = None
        self._since = 0

    def __call__(self, **fields: object) -> bool:
        """Count one more; log if the interval since the last line has passed. Whether it logged."""
        with self._lock:
            self._since += 1
            now = self._clock()
            if self._last is not None and now - self._last < LOG_EVERY_SECONDS:
                return False
            since, self._since, self._last = self._since, 0, now
        getattr(log, self._level)(self._event, **self._fixed, **fields, times_since_last_line=since)
        return True


class LimitsActed:
    """Each time one of ``limits`` acted: counted by limit (``counts``, which /metrics reads), told to
    ``observers``, and logged as ``event`` with ``limit=`` at most once per LOG_EVERY_SECONDS per limit."""

    def __init__(self, event: str, limits: Iterable[str], *, clock: Callable[[], float] = time.monotonic) -> None:
        self.counts: Counter[str] = Counter()  # a limit that never acted reads 0
        self.observers: list[Callable[[str], None]] = []
        self._logs = {limit: LogEvery(event, clock=clock, limit=limit) for limit in limits}

    def __call__(self, limit: str, **detail: object) -> None:
        self.counts[limit] += 1
        for observer in self.observers:
            observer(limit)
        self._logs[limit](**detail)


@contextlib.contextmanager
def quiet_accept_errors(
    loop: asyncio.AbstractEventLoop, *, counts: LimitCounts | None = None, listener: str = "grpc"
) -> Iterator[None]:
    """While inside: asyncio's accept() failures for want of a resource count and log once per interval.

    Every other loop error goes to the handler that was set before (or asyncio's default) as it did.
    """
    counts = counts if counts is not None else LimitCounts.of_process()
    logged = LogEvery("accept_failed", listener=listener)
    previous = loop.get_exception_handler()

    def handle(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        error = context.get("exception")
        if (
            context.get("message") == ASYNCIO_ACCEPT_FAILED
            and isinstance(error, OSError)
            and error.errno in RESOURCE_ERRNOS
        ):
            counts.accept_failed(listener, error)
            logged(
                errno=errno_name(error),
                retry_seconds=ASYNCIO_RETRY_SECONDS,
                detail="cannot take a new connection (out of file descriptors or memory); accepting again later",
            )
            return
        if previous is not None:
            previous(loop, context)
        else:
            loop.default_exception_handler(context)

    loop.set_exception_handler(handle)
    restore = _one_retry_per_failure(loop)
    try:
        yield
    finally:
        restore()
        loop.set_exception_handler(previous)


class _UntilResourceError:
    """A listening socket as one run of asyncio's accept loop sees it: after one accept() fails for want of a
    resource, the rest say "nothing waiting", so that run schedules one retry instead of one per backlog slot."""

    def __init__(self, listener: Any) -> None:
        self.listener = listener
        self._failed = False

    def accept(self) -> Any:
        if self._failed:
            raise BlockingIOError(errno.EAGAIN, "accepting paused after a resource error")
        try:
            return self.listener.accept()
        except OSError as error:
            if error.errno in RESOURCE_ERRNOS:
                self._failed = True
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self.listener, name)


def _one_retry_per_failure(loop: asyncio.AbstractEventLoop) -> Callable[[], None]:
    """Wrap the selector loop's accept loop (CPython gh-151615); a no-op on other loops. The undo."""
    original = getattr(loop, "_accept_connection", None)
    if not isinstance(loop, asyncio.selector_events.BaseSelectorEventLoop) or original is None:
        return lambda: None

    def accept_connection(protocol_factory: Any, sock: Any, *args: Any, **kwargs: Any) -> None:
        # asyncio passes the socket it was given on to the retry it schedules, so a retry brings back our wrapper.
        listener = sock.listener if isinstance(sock, _UntilResourceError) else sock
        original(protocol_factory, _UntilResourceError(listener), *args, **kwargs)

    setattr(loop, "_accept_connection", accept_connection)  # noqa: B010 - a private attribute, out of mypy's view

    def restore() -> None:
        if vars(loop).get("_accept_connection") is accept_connection:
            delattr(loop, "_accept_connection")

    return restore
