"""The node agent process: collector -> poll loop -> history -> evaluator -> gRPC, and an orderly stop.

On SIGTERM or SIGINT: health turns NOT_SERVING, every push stream ends with status OK (KEDA then
reconnects after 2 s instead of backing off towards 60 s), calls in flight finish, then the server
closes, all within ``--drain-timeout``.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import structlog

from gpuscaler import __version__
from gpuscaler.agent.attribution.podresources import PodResourcesWatcher
from gpuscaler.agent.attribution.processes import ProcReader
from gpuscaler.agent.collectors.base import Collector
from gpuscaler.agent.collectors.fake import FakeCollector
from gpuscaler.agent.collectors.nvml import NvmlCollector
from gpuscaler.agent.collectors.scenario import load_scenario
from gpuscaler.agent.fake_control import FakeControlService
from gpuscaler.agent.history import History
from gpuscaler.agent.poller import Poller
from gpuscaler.agent.settings import ServeSettings
from gpuscaler.agent.telemetry import AgentTelemetry
from gpuscaler.server.frontend import Frontend, cancel_all, run_in_background, run_until_signalled
from gpuscaler.server.overload import quiet_accept_errors
from gpuscaler.signals.evaluator import Evaluator

log = structlog.get_logger(__name__)


def build_collector(settings: ServeSettings) -> Collector:
    """The collector ``--collector`` names."""
    if settings.collector == "fake":
        scenario = (
            load_scenario(settings.fake_scenario, gpu_count=settings.fake_gpus) if settings.fake_scenario else None
        )
        return FakeCollector(node=settings.node_name, gpu_count=settings.fake_gpus, scenario=scenario)
    processes = ProcReader(settings.proc_root) if settings.processes else None
    return NvmlCollector(node=settings.node_name, processes=processes)


@dataclass
class Agent:
    """A started agent; ``stop()`` drains it. Tests run it in-process, ``serve`` runs it as the process."""

    settings: ServeSettings
    collector: Collector
    evaluator: Evaluator
    poller: Poller
    frontend: Frontend
    telemetry: AgentTelemetry
    pod_resources: PodResourcesWatcher | None = None
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)

    @property
    def port(self) -> int:
        return self.frontend.port

    @classmethod
    async def start(cls, settings: ServeSettings, collector: Collector) -> Agent:
        """Open the collector, take the first sample, and listen.

        Raises CollectorUnavailable (no NVML), ConfigError (bad TLS files) or StartupError (a port in use).
        """
        history = History(
            history_seconds=settings.history_seconds, poll_interval_seconds=settings.poll_interval_seconds
        )
        telemetry = AgentTelemetry(history, clock=asyncio.get_running_loop().time)
        if isinstance(collector, NvmlCollector):
            collector.on_call = telemetry.observe_nvml_call
        await asyncio.to_thread(collector.open)

        evaluator = Evaluator(history)
        history.add_listener(evaluator.on_snapshot)
        pod_resources = (
            PodResourcesWatcher(
                settings.pod_resources_socket,
                interval_seconds=settings.pod_resources_interval_seconds,
                dra_drivers=settings.dra_drivers,
            )
            if settings.pod_resources_socket is not None
            else None
        )
        if pod_resources is not None:
            telemetry.watch_attribution(pod_resources)
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

        frontend = await Frontend.start(
            settings.server,
            evaluator,
            telemetry,
            health_every_seconds=settings.poll_interval_seconds,
            extra_services=[FakeControlService(collector, history)] if isinstance(collector, FakeCollector) else [],
        )

        agent = cls(settings, collector, evaluator, poller, frontend, telemetry, pod_resources)
        agent._tasks.append(run_in_background(poller.run(), name="poll-loop"))
        if pod_resources is not None:
            agent._tasks.append(run_in_background(pod_resources.run(), name="pod-resources"))
        log.info(
            "agent_started",
            version=__version__,
            listen=str(settings.server.listen),
            port=agent.port,
            metrics_port=frontend.metrics.port if frontend.metrics else None,
            collector=settings.collector,
            gpus=len(poller.devices),
            poll_interval_seconds=settings.poll_interval_seconds,
            tls=frontend.tls is not None,
            mtls=settings.server.tls_client_ca is not None,
            attribution=pod_resources.state.state.value if pod_resources else "off",
            processes=settings.processes,
        )
        return agent

    async def stop(self) -> None:
        """Drain and close; returns once everything is closed or the drain timeout has passed."""
        tracker = self.frontend.tracker
        log.info("agent_stopping", open_streams=self.frontend.scaler.open_streams, in_flight=tracker.in_flight)
        await self.frontend.stop()
        await cancel_all(self._tasks)
        await asyncio.to_thread(self.collector.close)
        log.info("agent_stopped", calls=sum(tracker.finished.values()))


async def serve(settings: ServeSettings) -> int:
    """Run until SIGTERM or SIGINT; the process's exit code."""
    with quiet_accept_errors(asyncio.get_running_loop()):
        agent = await Agent.start(settings, build_collector(settings))
        return await run_until_signalled(agent.stop)
