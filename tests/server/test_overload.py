"""Counting and logging what the listeners refuse, and asyncio's accept loop out of file descriptors."""

from __future__ import annotations

import asyncio
import errno
import socket
from asyncio import constants as asyncio_constants
from typing import Any

import pytest

from gpuscaler.server import overload
from gpuscaler.server.overload import LimitCounts, LimitsActed, LogEvery, quiet_accept_errors
from tests.waiting import until


def logged(capfd: pytest.CaptureFixture[str], event: str) -> list[str]:
    """The lines of stderr since the last call that carry ``event``."""
    return [line for line in capfd.readouterr().err.splitlines() if event in line]


def test_log_every_logs_once_per_interval_with_the_count(capfd: pytest.CaptureFixture[str]) -> None:
    """The first time logs at once; a thousand more within the interval are one line at the next time after it."""
    now = 100.0
    log_every = LogEvery("test_limited", clock=lambda: now, limit="x")
    assert log_every(peer="a")
    assert [log_every(peer="b") for _ in range(1000)] == [False] * 1000
    [first] = logged(capfd, "test_limited")
    assert "times_since_last_line=1" in first
    now += overload.LOG_EVERY_SECONDS
    assert log_every(peer="c")
    [second] = logged(capfd, "test_limited")
    assert "times_since_last_line=1001" in second
    assert "limit=x" in second
    assert "peer=c" in second


def test_limits_acted_counts_each_act_tells_observers_and_logs_each_limit_once_per_interval(
    capfd: pytest.CaptureFixture[str],
) -> None:
    """Every act is counted under its limit and told to the observers; each limit has its own line per interval."""
    acted = LimitsActed("test_acted", ("a", "b"), clock=lambda: 100.0)
    heard: list[str] = []
    acted.observers.append(heard.append)
    for _ in range(3):
        acted("a", peer="p")
    acted("b", peer="q")
    assert (acted.counts["a"], acted.counts["b"], heard) == (3, 1, ["a", "a", "a", "b"])
    lines = logged(capfd, "test_acted")
    assert [("limit=a" in line, "limit=b" in line) for line in lines] == [(True, False), (False, True)]


def test_limit_counts_export_every_limit_from_zero() -> None:
    """Every limit and every listener's resource errno is a series before anything has happened."""
    counts = LimitCounts()
    counts.http_limited("header_deadline")
    counts.accept_failed("grpc", OSError(errno.EMFILE, "Too many open files"))
    families = {family.name: family for family in counts.collect()}
    limited = {sample.labels["limit"]: sample.value for sample in families["gpuscaler_http_limited"].samples}
    assert limited == {limit: (1.0 if limit == "header_deadline" else 0.0) for limit in overload.HTTP_LIMITS}
    failed = {
        (sample.labels["listener"], sample.labels["errno"]): sample.value
        for sample in families["gpuscaler_accept_errors"].samples
    }
    assert len(failed) == len(overload.LISTENERS) * len(overload.RESOURCE_ERRNOS)
    assert failed[("grpc", "EMFILE")] == 1.0
    assert sum(failed.values()) == 1.0


class ExhaustedListener(socket.socket):
    """A listening socket whose accept() fails with EMFILE while ``failing`` is set, as out of descriptors."""

    def __init__(self) -> None:
        super().__init__(socket.AF_INET, socket.SOCK_STREAM)
        self.failing = True
        self.failures = 0

    def accept(self) -> tuple[socket.socket, Any]:
        if self.failing:
            self.failures += 1
            raise OSError(errno.EMFILE, "Too many open files")
        return super().accept()


class Accepted(asyncio.Protocol):
    """Records each connection asyncio's server took."""

    made: list[asyncio.BaseTransport]

    def __init__(self, made: list[asyncio.BaseTransport]) -> None:
        self.made = made

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.made.append(transport)


async def test_asyncio_out_of_descriptors_is_one_retry_a_second_and_one_line(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """Under the guard, asyncio's server fails one accept() per retry (not one per backlog slot, each scheduling
    its own retry), counts each, logs one line and no traceback, and takes the waiting connection once it can."""
    monkeypatch.setattr(asyncio_constants, "ACCEPT_RETRY_DELAY", 0.05)
    loop = asyncio.get_running_loop()
    counts = LimitCounts()
    made: list[asyncio.BaseTransport] = []
    listener = ExhaustedListener()
    listener.bind(("127.0.0.1", 0))
    with quiet_accept_errors(loop, counts=counts):
        server = await loop.create_server(lambda: Accepted(made), sock=listener, backlog=100)
        try:
            with socket.create_connection(listener.getsockname(), timeout=10):
                await until(lambda: listener.failures >= 6)
                # Six retries' time: unguarded, asyncio 3.11 fails 100 accepts at the first wake-up alone.
                assert listener.failures <= 8
                assert counts.accept_errors[("grpc", "EMFILE")] == listener.failures
                listener.failing = False
                await until(lambda: len(made) == 1)
                for transport in made:
                    transport.close()
        finally:
            server.close()
            await server.wait_closed()
    lines = capfd.readouterr().err.splitlines()
    assert len([line for line in lines if "accept_failed" in line]) == 1, lines
    assert not [line for line in lines if "Traceback" in line or "out of system resource" in line]


async def test_other_loop_errors_reach_the_handler_before() -> None:
    """The guard takes only accept() out of a resource; other errors (an accept that failed otherwise, too) go to
    the handler that was set, which is back in place afterwards, and so is the loop's accept loop."""
    loop = asyncio.get_running_loop()
    seen: list[dict[str, Any]] = []

    def handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        seen.append(context)

    loop.set_exception_handler(handler)
    try:
        with quiet_accept_errors(loop, counts=LimitCounts()):
            assert "_accept_connection" in vars(loop)
            loop.call_exception_handler({"message": "something else broke"})
            loop.call_exception_handler(
                {"message": overload.ASYNCIO_ACCEPT_FAILED, "exception": OSError(errno.EPERM, "not permitted")}
            )
            loop.call_exception_handler(
                {"message": overload.ASYNCIO_ACCEPT_FAILED, "exception": OSError(errno.EMFILE, "Too many open files")}
            )
        assert [context["message"] for context in seen] == ["something else broke", overload.ASYNCIO_ACCEPT_FAILED]
        assert loop.get_exception_handler() is handler
        assert "_accept_connection" not in vars(loop)
    finally:
        loop.set_exception_handler(None)
