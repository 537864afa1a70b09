"""What the agent and the gateway do alike while running and stopping: health, TLS reloads, the drain.

The drain is KEDA's protocol for a clean stop: NOT_SERVING first, then every push stream ends with
status OK (KEDA reconnects after 2 s, not after a backoff of up to 60 s), calls in flight finish, and
only then does the server close; all within ``drain_seconds``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import Awaitable, Callable

import structlog
from grpclib.health.check import ServiceStatus

from gpuscaler.engine import Engine
from gpuscaler.errors import ConfigError
from gpuscaler.server.grpc_server import ManyStreamsServer
from gpuscaler.server.rpc_tracking import RpcTracker
from gpuscaler.tls import ReloadingServerTLS

log = structlog.get_logger(__name__)


async def follow_health(engine: Engine, health: ServiceStatus, *, every_seconds: float) -> None:
    """Keep ``health`` at ``engine.healthy()``, so it turns NOT_SERVING even when samples stop coming."""
    previous: bool | None = health.__status__()
    while True:
        healthy = engine.healthy()
        if healthy != previous:
            (log.info if healthy else log.warning)("health_changed", serving=healthy)
            previous = healthy
        health.set(healthy)
        await asyncio.sleep(every_seconds)


async def follow_tls_files(tls: ReloadingServerTLS, *, every_seconds: float, name: str) -> None:
    """Reload rotated TLS files; a half-rotated pair is logged and retried while the old one keeps serving."""
    while True:
        await asyncio.sleep(every_seconds)
        try:
            if tls.reload_if_changed():
                log.info("tls_reloaded", cert=name)
        except ConfigError as error:
            log.error("tls_reload_failed", error=str(error))


async def drain(
    *,
    server: ManyStreamsServer,
    engine: Engine,
    tracker: RpcTracker,
    health: ServiceStatus,
    drain_seconds: float,
) -> None:
    """NOT_SERVING, end every stream OK, let calls finish (80% of the time), then close the server."""
    health.set(False)
    engine.close_streams()
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(drain_seconds * 0.8):
            await tracker.wait_idle()
    if tracker.in_flight:
        log.warning("drain_incomplete", in_flight=tracker.in_flight)
    server.close()
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(max(drain_seconds * 0.2, 0.1)):
            await server.wait_closed()


def bound_port(server: ManyStreamsServer) -> int:
    """The port the server listens on (the one the OS chose for port 0)."""
    listener = server._server  # grpclib keeps the asyncio server private
    sockets = listener.sockets if isinstance(listener, asyncio.Server) else ()
    return int(sockets[0].getsockname()[1]) if sockets else 0


def report_crash(task: asyncio.Task[None]) -> None:
    """A background task that ends by itself is a bug; say so, or health would turn NOT_SERVING unexplained."""
    if task.cancelled():
        return
    log.critical("task_crashed", task=task.get_name(), error=repr(task.exception()), exc_info=task.exception())


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


async def run_until_signalled(stop: Callable[[], Awaitable[None]]) -> int:
    """Wait for SIGTERM or SIGINT, then ``stop()``; the process's exit code.

    A second signal during the drain ends the process at once with 128 + its number, as most servers do:
    whoever presses Ctrl-C twice has decided not to wait.
    """
    signalled = asyncio.Event()
    loop = asyncio.get_running_loop()

    def first(signum: signal.Signals) -> None:
        for again in STOP_SIGNALS:
            loop.add_signal_handler(again, _exit_now, again)
        signalled.set()

    for signum in STOP_SIGNALS:
        loop.add_signal_handler(signum, first, signum)
    await signalled.wait()
    await stop()
    return 0


def _exit_now(signum: signal.Signals) -> None:
    log.warning("stop_forced", signal=signum.name, detail="a second signal during the drain; exiting without it")
    sys.stdout.flush()
    sys.stderr.flush()
    # Not SystemExit: asyncio.run would then wait for the worker threads, and a hung NVML read never returns.
    os._exit(128 + signum)
