"""The gateway process: discovery -> one subscriber per agent -> cluster view -> engine -> gRPC, and a drain.

It serves the same ExternalScaler and Agent services as an agent, over the cluster view, so KEDA's
``scalerAddress`` can name the gateway's Service. Replicas share nothing: each subscribes to every
agent, so any replica answers the same from the same data. The stop is the agent's: health turns
NOT_SERVING, push streams end with OK, calls finish, then the server closes.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import structlog
from grpclib.health.check import ServiceStatus
from grpclib.health.service import OVERALL, Health

from gpuscaler import __version__
from gpuscaler.attribution.directory import PodDirectory, StaticPodDirectory
from gpuscaler.engine import Engine
from gpuscaler.errors import ConfigError, StartupError
from gpuscaler.flags import Address
from gpuscaler.gateway.discovery import DnsAgents, EndpointsListener, FileAgents, StaticAgents
from gpuscaler.gateway.settings import POD_DIRECTORY_KUBERNETES, GatewaySettings
from gpuscaler.gateway.subscriber import AgentSubscriber, AgentTLS
from gpuscaler.gateway.view import ClusterView
from gpuscaler.server.agent_api import AgentService
from gpuscaler.server.external_scaler import ExternalScalerService
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
from gpuscaler.tls import ReloadingServerTLS, client_context

log = structlog.get_logger(__name__)

HEALTH_CHECK_SECONDS = 0.5


class Discovery(Protocol):
    async def run(self, listener: EndpointsListener) -> None: ...


@runtime_checkable
class ManagedDirectory(PodDirectory, Protocol):
    """A pod directory with a life of its own (the Kubernetes pod watch)."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


def build_directory(settings: GatewaySettings) -> PodDirectory | None:
    if settings.pod_directory is None:
        return None
    if settings.pod_directory == POD_DIRECTORY_KUBERNETES:
        from gpuscaler.attribution.kubernetes import KubernetesPodDirectory

        return KubernetesPodDirectory.in_cluster()
    try:
        return StaticPodDirectory(Path(settings.pod_directory))
    except ConfigError as error:
        raise ConfigError(f"--pod-directory: {error}") from None


def build_discovery(settings: GatewaySettings) -> Discovery:
    if settings.agents_dns is not None:
        return DnsAgents(
            settings.agents_dns.host, settings.agents_dns.port, interval_seconds=settings.resolve_interval_seconds
        )
    if settings.agents_file is not None:
        return FileAgents(settings.agents_file, interval_seconds=settings.resolve_interval_seconds)
    return StaticAgents(settings.agents)


def agent_tls(settings: GatewaySettings) -> AgentTLS | None:
    if settings.agent_tls_ca is None:
        return None
    context = client_context(
        settings.agent_tls_ca, settings.agent_tls_cert, settings.agent_tls_key, flags="--agent-tls-"
    )
    return AgentTLS(context, settings.agent_tls_server_name)


@dataclass
class Gateway:
    """A started gateway; ``stop()`` drains it. Tests run it in-process, ``gateway`` runs it as the process."""

    settings: GatewaySettings
    view: ClusterView
    engine: Engine
    server: ManyStreamsServer
    scaler: ExternalScalerService
    tracker: RpcTracker
    health: ServiceStatus
    port: int
    directory: PodDirectory | None
    tls: ReloadingServerTLS | None
    discovery: Discovery
    agent_tls: AgentTLS | None
    subscribers: dict[Address, tuple[AgentSubscriber, asyncio.Task[None]]] = field(default_factory=dict)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)

    @classmethod
    async def start(
        cls,
        settings: GatewaySettings,
        *,
        directory: PodDirectory | None = None,
        discovery: Discovery | None = None,
    ) -> Gateway:
        """Listen and start subscribing. Raises ConfigError (bad TLS files) or StartupError (a port in use)."""
        tls = (
            ReloadingServerTLS(settings.tls_cert, settings.tls_key, settings.tls_client_ca)
            if settings.tls_cert and settings.tls_key
            else None
        )
        to_agents = agent_tls(settings)
        directory = directory if directory is not None else build_directory(settings)
        view = ClusterView(history_seconds=settings.history_seconds)
        engine = Engine(view, directory=directory, cluster=True)
        view.add_listener(engine.on_snapshot)

        scaler = ExternalScalerService(engine)
        health = ServiceStatus()
        services: list[Any] = [scaler, AgentService(engine)]
        services.append(Health({scaler: [health], OVERALL: [health]}))
        server = ManyStreamsServer(services)
        tracker = RpcTracker()
        tracker.attach(server, services)
        try:
            await server.start(
                settings.listen.host, settings.listen.port, ssl=tls.listener if tls else None, reuse_address=True
            )
        except OSError as error:
            raise StartupError(f"--listen {settings.listen}: cannot listen: {error.strerror}") from None
        if isinstance(directory, ManagedDirectory):
            await directory.start()

        gateway = cls(
            settings=settings,
            view=view,
            engine=engine,
            server=server,
            scaler=scaler,
            tracker=tracker,
            health=health,
            port=bound_port(server),
            directory=directory,
            tls=tls,
            discovery=discovery or build_discovery(settings),
            agent_tls=to_agents,
        )
        health.set(False)
        gateway._tasks = [
            asyncio.create_task(view.run(), name="compose"),
            asyncio.create_task(gateway.discovery.run(gateway._on_endpoints), name="discovery"),
            asyncio.create_task(follow_health(engine, health, every_seconds=HEALTH_CHECK_SECONDS), name="health"),
        ]
        if tls is not None:
            gateway._tasks.append(
                asyncio.create_task(
                    follow_tls_files(
                        tls, every_seconds=settings.tls_reload_interval_seconds, name=str(settings.tls_cert)
                    ),
                    name="tls-reload",
                )
            )
        for task in gateway._tasks:
            task.add_done_callback(report_crash)
        log.info(
            "gateway_started",
            version=__version__,
            listen=str(settings.listen),
            port=gateway.port,
            agents=[str(agent) for agent in settings.agents] or None,
            agents_dns=str(settings.agents_dns) if settings.agents_dns else None,
            agents_file=str(settings.agents_file) if settings.agents_file else None,
            pod_directory=settings.pod_directory,
            tls=tls is not None,
            agent_tls=to_agents is not None,
        )
        return gateway

    def _on_endpoints(self, endpoints: frozenset[Address]) -> None:
        """Start a subscriber for each new agent, stop those of agents that are gone."""
        self.view.set_agents(str(endpoint) for endpoint in endpoints)
        for endpoint in [e for e in self.subscribers if e not in endpoints]:
            _, task = self.subscribers.pop(endpoint)
            task.cancel()
            log.info("agent_removed", agent=str(endpoint))
        for endpoint in sorted(endpoints - set(self.subscribers), key=str):
            subscriber = AgentSubscriber(endpoint, self.view, tls=self.agent_tls)
            task = asyncio.create_task(subscriber.run(), name=f"agent {endpoint}")
            self.subscribers[endpoint] = (subscriber, task)

    async def stop(self) -> None:
        """Drain and close; returns once everything is closed or the drain timeout has passed."""
        log.info("gateway_stopping", open_streams=self.scaler.open_streams, in_flight=self.tracker.in_flight)
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
        tasks = [*self._tasks, *(task for _, task in self.subscribers.values())]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if isinstance(self.directory, ManagedDirectory):
            await self.directory.stop()
        log.info("gateway_stopped", calls=sum(self.tracker.finished.values()))


async def run_gateway(settings: GatewaySettings) -> int:
    """Run until SIGTERM or SIGINT; the process's exit code."""
    gateway = await Gateway.start(settings)
    return await run_until_signalled(gateway.stop)
