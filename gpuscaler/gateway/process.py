"""The gateway process: discovery -> one subscriber per agent -> cluster view -> engine -> gRPC, and a drain.

It serves the same ExternalScaler and Agent services as an agent, over the cluster view, so KEDA's
``scalerAddress`` can name the gateway's Service. Replicas share nothing: each subscribes to every
agent, so any replica answers the same from the same data. The stop is the agent's: health turns
NOT_SERVING, push streams end with OK, calls finish, then the server closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
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
from gpuscaler.gateway.discovery import DnsAgents, EndpointsListener, StaticAgents
from gpuscaler.gateway.settings import POD_DIRECTORY_KUBERNETES, GatewaySettings
from gpuscaler.gateway.subscriber import AgentSubscriber, AgentTLS
from gpuscaler.gateway.view import ClusterHistory
from gpuscaler.server.agent_api import AgentService
from gpuscaler.server.external_scaler import ExternalScalerService
from gpuscaler.server.grpc_server import ManyStreamsServer
from gpuscaler.server.rpc_tracking import RpcTracker
from gpuscaler.settings import Address
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
    return StaticAgents(settings.agents)


def agent_tls(settings: GatewaySettings) -> AgentTLS | None:
    if settings.agent_tls_ca is None:
        return None
    try:
        context = client_context(settings.agent_tls_ca, settings.agent_tls_cert, settings.agent_tls_key)
    except ConfigError as error:
        raise ConfigError(str(error).replace("--tls-", "--agent-tls-")) from None
    return AgentTLS(context, settings.agent_tls_server_name)


@dataclass
class Gateway:
    """A started gateway; ``stop()`` drains it. Tests run it in-process, ``gateway`` runs it as the process."""

    settings: GatewaySettings
    view: ClusterHistory
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
        view = ClusterHistory(history_seconds=settings.history_seconds)
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
            port=_bound_port(server),
            directory=directory,
            tls=tls,
            discovery=discovery or build_discovery(settings),
            agent_tls=to_agents,
        )
        health.set(False)
        gateway._tasks = [
            asyncio.create_task(view.run(), name="compose"),
            asyncio.create_task(gateway.discovery.run(gateway._on_endpoints), name="discovery"),
            asyncio.create_task(gateway._watch_health(), name="health"),
        ]
        if tls is not None:
            gateway._tasks.append(asyncio.create_task(gateway._watch_tls(tls), name="tls-reload"))
        log.info(
            "gateway_started",
            version=__version__,
            listen=str(settings.listen),
            port=gateway.port,
            agents=[str(agent) for agent in settings.agents] or None,
            agents_dns=str(settings.agents_dns) if settings.agents_dns else None,
            pod_directory=settings.pod_directory,
            tls=tls is not None,
            agent_tls=to_agents is not None,
        )
        return gateway

    def _on_endpoints(self, endpoints: frozenset[Address]) -> None:
        """Start a subscriber for each new agent, stop those of agents that are gone."""
        self.view.expected_nodes = len(endpoints)
        for endpoint in [e for e in self.subscribers if e not in endpoints]:
            _, task = self.subscribers.pop(endpoint)
            task.cancel()
            log.info("agent_removed", agent=str(endpoint))
        for endpoint in sorted(endpoints - set(self.subscribers), key=str):
            subscriber = AgentSubscriber(endpoint, self.view, tls=self.agent_tls)
            task = asyncio.create_task(subscriber.run(), name=f"agent {endpoint}")
            self.subscribers[endpoint] = (subscriber, task)

    async def _watch_health(self) -> None:
        """SERVING while the view holds at least one node's readable GPUs."""
        previous: bool | None = None
        while True:
            healthy = self.engine.healthy()
            if healthy != previous:
                (log.info if healthy else log.warning)("health_changed", serving=healthy)
                previous = healthy
            self.health.set(healthy)
            await asyncio.sleep(HEALTH_CHECK_SECONDS)

    async def _watch_tls(self, tls: ReloadingServerTLS) -> None:
        while True:
            await asyncio.sleep(self.settings.tls_reload_interval_seconds)
            try:
                if tls.reload_if_changed():
                    log.info("tls_reloaded", cert=str(self.settings.tls_cert))
            except ConfigError as error:
                log.error("tls_reload_failed", error=str(error))

    async def stop(self) -> None:
        """Drain and close; returns once everything is closed or the drain timeout has passed."""
        drain = self.settings.drain_timeout_seconds
        log.info("gateway_stopping", open_streams=self.scaler.open_streams, in_flight=self.tracker.in_flight)
        for task in self._tasks:
            if task.get_name() == "health":
                task.cancel()
        self.health.set(False)
        self.engine.close_streams()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(drain * 0.8):
                await self.tracker.wait_idle()
        self.server.close()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(max(drain * 0.2, 0.1)):
                await self.server.wait_closed()
        tasks = [*self._tasks, *(task for _, task in self.subscribers.values())]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if isinstance(self.directory, ManagedDirectory):
            await self.directory.stop()
        log.info("gateway_stopped", calls=sum(self.tracker.finished.values()))


def _bound_port(server: ManyStreamsServer) -> int:
    listener = server._server  # grpclib keeps the asyncio server private
    sockets = listener.sockets if isinstance(listener, asyncio.Server) else ()
    return int(sockets[0].getsockname()[1]) if sockets else 0


async def run_gateway(settings: GatewaySettings) -> int:
    """Run until SIGTERM or SIGINT; the process's exit code."""
    gateway = await Gateway.start(settings)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    await stop.wait()
    await gateway.stop()
    return 0
