"""The front both processes compose: the gRPC server, health, TLS that follows its files, /metrics, the drain.

An agent and a gateway differ in where their snapshots come from; what they show KEDA is the same:
ExternalScaler, the Agent API and gRPC health on one listener, health that follows ``evaluator.healthy()``,
per-RPC accounting, /metrics and /healthz on another, and KEDA's protocol for a clean stop. The drain:
NOT_SERVING first, then every push stream ends with status OK (KEDA reconnects after 2 s, not after a
backoff of up to 60 s), calls in flight finish, and only then does the server close; all within
``--drain-timeout``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import structlog
from grpclib.health.check import ServiceStatus

from gpuscaler.flags import ServerFlags
from gpuscaler.model.errors import ConfigError, StartupError
from gpuscaler.server.agent_api import AgentService
from gpuscaler.server.exposition import MetricsServer
from gpuscaler.server.external_scaler import ExternalScalerService
from gpuscaler.server.health import HealthService, service_names
from gpuscaler.server.rpc_tracking import RpcTracker
from gpuscaler.server.telemetry import ServerTelemetry
from gpuscaler.server.transport.server import ManyStreamsServer
from gpuscaler.signals.evaluator import Evaluator
from gpuscaler.tls import ReloadingServerTLS

log = structlog.get_logger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


@dataclass
class Frontend:
    """A listening server over one evaluator; ``stop()`` drains it."""

    flags: ServerFlags
    evaluator: Evaluator
    server: ManyStreamsServer
    scaler: ExternalScalerService
    tracker: RpcTracker
    health: ServiceStatus
    tls: ReloadingServerTLS | None
    metrics: MetricsServer | None
    port: int
    _health_task: asyncio.Task[None] | None = None
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)

    @classmethod
    async def start(
        cls,
        flags: ServerFlags,
        evaluator: Evaluator,
        telemetry: ServerTelemetry,
        *,
        health_every_seconds: float,
        extra_services: Sequence[Any] = (),
    ) -> Frontend:
        """Listen, with health as the evaluator says now. ConfigError: bad TLS files; StartupError: a port in use."""
        tls = (
            ReloadingServerTLS(flags.tls_cert, flags.tls_key, flags.tls_client_ca)
            if flags.tls_cert and flags.tls_key
            else None
        )
        scaler = ExternalScalerService(evaluator, telemetry.scaler_answers)
        health = ServiceStatus()
        health.set(evaluator.healthy())
        services: list[Any] = [scaler, AgentService(evaluator, telemetry.idle_energy_of), *extra_services]
        services.append(HealthService(health, service_names([scaler])))
        server = ManyStreamsServer(services, flags.limits, tls=tls.context if tls else None)
        tracker = RpcTracker()
        tracker.attach(server, services)
        tracker.add_observers(telemetry.observe_rpc_started, telemetry.observe_rpc)
        server.on_expired.append(tracker.count_expired)
        telemetry.watch(evaluator)
        telemetry.watch_transport(server)
        if tls is not None:
            telemetry.watch_tls(tls)
        try:
            # TLS, when on, is not the listener's: the protocol does each handshake with the context of then.
            await server.start(flags.listen.host, flags.listen.port, reuse_address=True)
        except OSError as error:
            raise StartupError(f"--listen {flags.listen}: cannot listen: {error.strerror}") from None
        front = cls(flags, evaluator, server, scaler, tracker, health, tls, None, _bound_port(server))
        if flags.metrics_listen is not None:
            metrics = MetricsServer(telemetry.registry, flags.metrics_listen, healthy=lambda: front.serving)
            try:
                await metrics.start()
            except StartupError:
                server.close()
                await server.wait_closed()
                raise
            front.metrics = metrics
        front._health_task = run_in_background(
            follow_health(evaluator, health, every_seconds=health_every_seconds), name="health"
        )
        front._tasks.append(front._health_task)
        if tls is not None:
            front._tasks.append(
                run_in_background(
                    follow_tls_files(tls, every_seconds=flags.tls_reload_interval_seconds, name=str(flags.tls_cert)),
                    name="tls-reload",
                )
            )
        return front

    @property
    def serving(self) -> bool:
        return self.health.__status__() is True

    async def stop(self) -> None:
        """NOT_SERVING, end every stream OK, let calls finish (80% of the time), then close the server."""
        if self._health_task is not None:
            self._health_task.cancel()  # it would turn health back on while we drain
        self.health.set(False)
        self.evaluator.close_streams()
        drain_seconds = self.flags.drain_timeout_seconds
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(drain_seconds * 0.8):
                await self.tracker.wait_idle()
        if self.tracker.in_flight:
            log.warning("drain_incomplete", in_flight=self.tracker.in_flight)
        self.server.close()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(max(drain_seconds * 0.2, 0.1)):
                await self.server.wait_closed()
        await cancel_all(self._tasks)
        if self.metrics is not None:
            await self.metrics.stop()


async def follow_health(evaluator: Evaluator, health: ServiceStatus, *, every_seconds: float) -> None:
    """Keep ``health`` at ``evaluator.healthy()``, so it turns NOT_SERVING even when samples stop coming."""
    previous: bool | None = health.__status__()
    while True:
        healthy = evaluator.healthy()
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


def run_in_background(work: Awaitable[None], *, name: str) -> asyncio.Task[None]:
    """A task that runs until cancelled; ending by itself is a bug, and is logged as one."""

    async def run() -> None:
        await work

    task = asyncio.create_task(run(), name=name)
    task.add_done_callback(_report_crash)
    return task


async def cancel_all(tasks: Sequence[asyncio.Task[Any]]) -> None:
    """Cancel ``tasks`` and wait until each has ended."""
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def _report_crash(task: asyncio.Task[None]) -> None:
    # A background task that ends by itself is a bug; say so, or health would turn NOT_SERVING unexplained.
    if task.cancelled():
        return
    log.critical("task_crashed", task=task.get_name(), error=repr(task.exception()), exc_info=task.exception())


def _bound_port(server: ManyStreamsServer) -> int:
    listener = server._server  # grpclib keeps the asyncio server private; we need the port the OS chose for 0
    sockets = listener.sockets if isinstance(listener, asyncio.Server) else ()
    return int(sockets[0].getsockname()[1]) if sockets else 0


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
