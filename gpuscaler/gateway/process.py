"""The gateway process: discovery -> one subscriber per agent -> cluster view -> evaluator -> gRPC, and a drain.

It serves the same ExternalScaler as an agent, and the Agent service's Explain, over the cluster view, so KEDA's
``scalerAddress`` and ``gpuscaler query`` can name the gateway's Service; a node's snapshot is an agent's alone.
Replicas share nothing: each subscribes to every agent, so any replica answers the same from the same data. The
stop is the agent's: health turns NOT_SERVING, push streams end with OK, calls finish, then the server closes.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Protocol

import structlog

from gpuscaler import __version__
from gpuscaler.flags import Address
from gpuscaler.gateway.directory.pod_file import ManagedDirectory, StaticPodDirectory
from gpuscaler.gateway.discovery import DnsAgents, EndpointsListener, FileAgents, StaticAgents
from gpuscaler.gateway.engines.page_reader import PageReader
from gpuscaler.gateway.engines.scraper import EngineScraper
from gpuscaler.gateway.settings import POD_DIRECTORY_KUBERNETES, GatewaySettings
from gpuscaler.gateway.subscriber import AgentSubscriber, AgentTLS
from gpuscaler.gateway.telemetry import GatewayTelemetry
from gpuscaler.gateway.view import ClusterView
from gpuscaler.model.errors import ConfigError
from gpuscaler.model.pods import PodDirectory
from gpuscaler.server.frontend import Frontend, cancel_all, run_in_background, run_until_signalled
from gpuscaler.server.overload import quiet_accept_errors
from gpuscaler.signals.evaluator import Evaluator
from gpuscaler.tls import client_context

log = structlog.get_logger(__name__)

HEALTH_CHECK_SECONDS = 0.5


class Discovery(Protocol):
    """Where the gateway learns its agents: ``run`` gives ``listener`` every new set of addresses until cancelled."""

    async def run(self, listener: EndpointsListener) -> None: ...


async def build_directory(settings: GatewaySettings) -> PodDirectory | None:
    """The pod directory ``--pod-directory`` names: none, the Kubernetes API (in the cluster, or KUBECONFIG's), or
    a YAML file."""
    if settings.pod_directory is None:
        return None
    if settings.pod_directory == POD_DIRECTORY_KUBERNETES:
        from gpuscaler.gateway.directory.kubernetes import KubernetesDirectory

        return await KubernetesDirectory.connect()
    try:
        return StaticPodDirectory(Path(settings.pod_directory))
    except ConfigError as error:
        raise ConfigError(f"--pod-directory: {error}") from None


def _page_reader(settings: GatewaySettings, directory: PodDirectory | None) -> PageReader:
    """The engine page reader; with ``--epp-metrics-token-service-account``, one that sends the EPP pods an
    InferencePool of one of ``--epp-namespaces`` names, and no other pod, that ServiceAccount's token."""
    account = settings.epp_metrics_token_service_account
    from gpuscaler.gateway.directory.kubernetes import KubernetesDirectory

    if account is None or not isinstance(directory, KubernetesDirectory):
        return PageReader(settings.engine_scrapes)
    from gpuscaler.gateway.directory.endpoint_pickers import EndpointPickers
    from gpuscaler.gateway.engines.epp_token import EppCredentials, EppToken, bound_to, token_requester

    factory = directory.pod_watch.api_client_factory
    pickers = EndpointPickers(factory, settings.epp_namespaces)
    directory.also_watch(pickers)
    bound_pod = bound_to(settings.own_pod, account[0])
    timeout = settings.engine_scrapes.timeout_seconds  # the EPP read that waits for the token is a scrape
    token = EppToken(token_requester(factory, *account, bound_pod=bound_pod, timeout_seconds=timeout))
    credentials = EppCredentials(token, directory, pickers, settings.epp_namespaces)
    return PageReader(settings.engine_scrapes, authorize=credentials)


def build_discovery(settings: GatewaySettings) -> Discovery:
    """The one source of agents the settings name: a DNS name, a file of addresses, or the fixed ``--agents`` list."""
    if settings.agents_dns is not None:
        return DnsAgents(
            settings.agents_dns.host, settings.agents_dns.port, interval_seconds=settings.resolve_interval_seconds
        )
    if settings.agents_file is not None:
        return FileAgents(settings.agents_file, interval_seconds=settings.resolve_interval_seconds)
    return StaticAgents(settings.agents)


def agent_tls(settings: GatewaySettings) -> AgentTLS | None:
    """TLS to the agents from the ``--agent-tls-*`` flags; None (plaintext) when no CA is given."""
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
    evaluator: Evaluator
    frontend: Frontend
    telemetry: GatewayTelemetry
    directory: PodDirectory | None
    discovery: Discovery
    agent_tls: AgentTLS | None
    engines: EngineScraper
    subscribers: dict[Address, tuple[AgentSubscriber, asyncio.Task[None]]] = field(default_factory=dict)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)

    @property
    def port(self) -> int:
        return self.frontend.port

    @classmethod
    async def start(
        cls,
        settings: GatewaySettings,
        *,
        directory: PodDirectory | None = None,
        discovery: Discovery | None = None,
    ) -> Gateway:
        """Listen and start subscribing. Raises ConfigError (bad TLS files) or StartupError (a port in use)."""
        to_agents = agent_tls(settings)
        directory = directory if directory is not None else await build_directory(settings)
        view = ClusterView(history_seconds=settings.history_seconds)
        engines = EngineScraper(settings.engine_scrapes, reader=_page_reader(settings, directory))
        evaluator = Evaluator(view, directory=directory, engines=engines)
        view.add_listener(evaluator.on_snapshot)
        subscribers: dict[Address, tuple[AgentSubscriber, asyncio.Task[None]]] = {}
        telemetry = GatewayTelemetry(
            view,
            lambda: {str(endpoint): subscriber for endpoint, (subscriber, _) in subscribers.items()},
            partial(_pod_counts, directory),
            directory,
            engines,
        )
        frontend = await Frontend.start(
            settings.server, evaluator, telemetry, health_every_seconds=HEALTH_CHECK_SECONDS
        )
        if isinstance(directory, ManagedDirectory):
            await directory.start()
        await engines.start()

        gateway = cls(
            settings=settings,
            view=view,
            evaluator=evaluator,
            frontend=frontend,
            telemetry=telemetry,
            directory=directory,
            discovery=discovery or build_discovery(settings),
            agent_tls=to_agents,
            subscribers=subscribers,
            engines=engines,
        )
        gateway._tasks = [
            run_in_background(view.run(), name="compose"),
            run_in_background(gateway.discovery.run(gateway._on_endpoints), name="discovery"),
        ]
        log.info(
            "gateway_started",
            version=__version__,
            listen=str(settings.server.listen),
            port=gateway.port,
            metrics_port=frontend.metrics.port if frontend.metrics else None,
            agents=[str(agent) for agent in settings.agents] or None,
            agents_dns=str(settings.agents_dns) if settings.agents_dns else None,
            agents_file=str(settings.agents_file) if settings.agents_file else None,
            pod_directory=settings.pod_directory,
            tls=frontend.tls is not None,
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
            task = run_in_background(subscriber.run(), name=f"agent {endpoint}")
            self.subscribers[endpoint] = (subscriber, task)

    async def stop(self) -> None:
        """Drain and close; returns once everything is closed or the drain timeout has passed."""
        tracker = self.frontend.tracker
        log.info("gateway_stopping", open_streams=self.frontend.scaler.open_streams, in_flight=tracker.in_flight)
        await self.frontend.stop()
        await cancel_all([*self._tasks, *(task for _, task in self.subscribers.values())])
        await self.engines.stop()
        if isinstance(self.directory, ManagedDirectory):
            await self.directory.stop()
        log.info("gateway_stopped", calls=sum(tracker.finished.values()))


def _pod_counts(directory: PodDirectory | None) -> tuple[int, int, int] | None:
    from gpuscaler.gateway.directory.kubernetes import KubernetesDirectory
    from gpuscaler.gateway.directory.pod_watch import KubernetesPodDirectory

    if isinstance(directory, KubernetesDirectory):
        directory = directory.pod_watch
    if not isinstance(directory, KubernetesPodDirectory):
        return None
    return len(directory), directory.lists, directory.events


async def run_gateway(settings: GatewaySettings) -> int:
    """Run until SIGTERM or SIGINT; the process's exit code."""
    with quiet_accept_errors(asyncio.get_running_loop()):
        gateway = await Gateway.start(settings)
        return await run_until_signalled(gateway.stop)
