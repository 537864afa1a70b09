"""The node agent process: collector -> poll loop -> history -> engine -> gRPC, and an orderly stop.

On SIGTERM or SIGINT: health turns NOT_SERVING, every push stream ends with status OK (KEDA then
reconnects after 2 s instead of backing off towards 60 s), calls in flight finish, then the server
closes, all within ``--drain-timeout``.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import structlog
from grpclib.health.check import ServiceStatus
from grpclib.health.service import OVERALL, Health

from gpuscaler import __version__
from gpuscaler.attribution.podresources import PodResourcesWatcher
from gpuscaler.collectors.base import Collector
from gpuscaler.collectors.fake import FakeCollector
from gpuscaler.collectors.nvml import NvmlCollector
from gpuscaler.collectors.scenario import load_scenario
from gpuscaler.engine import Engine
from gpuscaler.errors import StartupError
from gpuscaler.exposition import MetricsServer
from gpuscaler.history import History
from gpuscaler.poller import Poller
from gpuscaler.server.agent_api import AgentService
from gpuscaler.server.external_scaler import ExternalScalerService
from gpuscaler.server.fake_control import FakeControlService
from gpuscaler.server.grpc_server import ManyStreamsServer
from gpuscaler.server.lifecycle import (
    bound_port,
    drain,
    follow_health,
    follow_tls_files,
    report_crash,
    run_until_signalled,
)
from gpuscaler.server.rpc_tracking import RpcTracker
from gpuscaler.settings import ServeSettings
from gpuscaler.telemetry import Telemetry
from gpuscaler.tls import ReloadingServerTLS

log = structlog.get_logger(__name__)


def build_collector(settings: ServeSettings) -> Collector:
    """The collector ``--collector`` names."""
    if settings.collector == "fake":
        scenario = (
            load_scenario(settings.fake_scenario, gpu_count=settings.fake_gpus) if settings.fake_scenario else None
        )
        return FakeCollector(node=settings.node_name, gpu_count=settings.fake_gpus, scenario=scenario)
    return NvmlCollector(node=settings.node_name)


@dataclass
class Agent:
    """A started agent; ``stop()`` drains it. Tests run it in-process, ``serve`` runs it as the process."""

    settings: ServeSettings
    collector: Collector
    engine: Engine
    poller: Poller
    server: ManyStreamsServer
    scaler: ExternalScalerService
    tracker: RpcTracker
    health: ServiceStatus
    telemetry: Telemetry
    metrics: MetricsServer | None
    tls: ReloadingServerTLS | None
    port: int
    pod_resources: PodResourcesWatcher | None = None
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)

    @classmethod
    async def start(cls, settings: ServeSettings, collector: Collector) -> Agent:
        """Open the collector, take the first sample, and listen.

        Raises CollectorUnavailable (no NVML), ConfigError (bad TLS files) or StartupError (a port in use).
        """
        tls = (
            ReloadingServerTLS(settings.tls_cert, settings.tls_key, settings.tls_client_ca)
            if settings.tls_cert and settings.tls_key
            else None
        )
        history = History(
            history_seconds=settings.history_seconds, poll_interval_seconds=settings.poll_interval_seconds
        )
        telemetry = Telemetry(history, clock=asyncio.get_running_loop().time)
        if isinstance(collector, NvmlCollector):
            collector.on_call = telemetry.observe_nvml_call
        await asyncio.to_thread(collector.open)

        engine = Engine(history)
        history.add_listener(engine.on_snapshot)
        engine.on_transition.append(telemetry.observe_transition)
        engine.on_partial.append(telemetry.observe_partial)
        telemetry.distinct_queries.set_function(lambda: engine.distinct_stream_queries)
        pod_resources = (
            PodResourcesWatcher(settings.pod_resources_socket, interval_seconds=settings.pod_resources_interval_seconds)
            if settings.pod_resources_socket is not None
            else None
        )
        poller = Poller(
            collector,
            history,
            poll_interval_seconds=settings.poll_interval_seconds,
            on_tick=telemetry.observe_tick,
            attributor=pod_resources,
        )
        await poller.start()
        if pod_resources is not None:
            await pod_resources.refresh()  # the first snapshot already says which pods hold the GPUs
        await poller.tick()  # listen only once there is a sample to answer from

        scaler = ExternalScalerService(engine)
        health = ServiceStatus()
        services: list[Any] = [scaler, AgentService(engine)]
        if isinstance(collector, FakeCollector):
            services.append(FakeControlService(collector))
        services.append(Health({scaler: [health], OVERALL: [health]}))
        server = ManyStreamsServer(services)
        tracker = RpcTracker()
        tracker.attach(server, services)
        tracker.add_observers(telemetry.observe_rpc_started, telemetry.observe_rpc)
        try:
            await server.start(
                settings.listen.host, settings.listen.port, ssl=tls.listener if tls else None, reuse_address=True
            )
        except OSError as error:
            raise StartupError(f"--listen {settings.listen}: cannot listen: {error.strerror}") from None
        metrics = (
            MetricsServer(telemetry.registry, settings.metrics_listen, healthy=lambda: health.__status__() is True)
            if settings.metrics_listen
            else None
        )
        if metrics is not None:
            try:
                await metrics.start()
            except StartupError:
                server.close()
                await server.wait_closed()
                raise

        agent = cls(
            settings=settings,
            collector=collector,
            engine=engine,
            poller=poller,
            server=server,
            scaler=scaler,
            tracker=tracker,
            health=health,
            telemetry=telemetry,
            metrics=metrics,
            tls=tls,
            port=bound_port(server),
            pod_resources=pod_resources,
        )
        health.set(engine.healthy())
        agent._tasks = [
            asyncio.create_task(poller.run(), name="poll-loop"),
            asyncio.create_task(
                follow_health(engine, health, every_seconds=settings.poll_interval_seconds), name="health"
            ),
        ]
        if tls is not None:
            agent._tasks.append(
                asyncio.create_task(
                    follow_tls_files(
                        tls, every_seconds=settings.tls_reload_interval_seconds, name=str(settings.tls_cert)
                    ),
                    name="tls-reload",
                )
            )
        if pod_resources is not None:
            agent._tasks.append(asyncio.create_task(pod_resources.run(), name="pod-resources"))
        for task in agent._tasks:
            task.add_done_callback(report_crash)
        log.info(
            "agent_started",
            version=__version__,
            listen=str(settings.listen),
            port=agent.port,
            metrics_port=metrics.port if metrics else None,
            collector=settings.collector,
            gpus=len(poller.devices),
            poll_interval_seconds=settings.poll_interval_seconds,
            tls=tls is not None,
            mtls=settings.tls_client_ca is not None,
            attribution=pod_resources.state.state.value if pod_resources else "off",
        )
        return agent

    async def stop(self) -> None:
        """Drain and close; returns once everything is closed or the drain timeout has passed."""
        log.info("agent_stopping", open_streams=self.scaler.open_streams, in_flight=self.tracker.in_flight)
        for task in self._tasks:
            if task.get_name() == "health":
                task.cancel()
        await drain(
            server=self.server,
            engine=self.engine,
            tracker=self.tracker,
            health=self.health,
            drain_seconds=self.settings.drain_timeout_seconds,
        )
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.metrics is not None:
            await self.metrics.stop()
        await asyncio.to_thread(self.collector.close)
        log.info("agent_stopped", calls=sum(self.tracker.finished.values()))


async def serve(settings: ServeSettings) -> int:
    """Run until SIGTERM or SIGINT; the process's exit code."""
    agent = await Agent.start(settings, build_collector(settings))
    return await run_until_signalled(agent.stop)
