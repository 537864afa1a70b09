"""The gateway's Prometheus series: the shared server series, every agent it subscribes to, and its cluster view.

Per-agent and per-node series are read from the view at scrape time, so an agent that leaves discovery
takes its series with it. Label values are agent addresses and node names: one series each per agent.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping

from prometheus_client import Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gpuscaler.gateway.engines import telemetry as engine_telemetry
from gpuscaler.gateway.engines.scraper import EngineScraper
from gpuscaler.gateway.idle_energy import WorkloadIdleEnergy
from gpuscaler.gateway.subscriber import AgentSubscriber
from gpuscaler.gateway.view import ClusterView
from gpuscaler.model.pods import PodDirectory
from gpuscaler.model.samples import GpuKey
from gpuscaler.server.telemetry import ServerTelemetry
from gpuscaler.signals.empty_selection_record import EmptySelectionRecord
from gpuscaler.signals.energy import IdleEnergy
from gpuscaler.signals.evaluator import Evaluator

AGENT_STATES = ("heard", "silent", "unheard", "refused", "replaced")
COMPOSE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)

Subscribers = Callable[[], Mapping[str, AgentSubscriber]]  # by agent address
PodCounts = Callable[[], tuple[int, int, int] | None]  # (pods, lists, watch events) of a pod watch, or None


class _ViewCollector(Collector):
    def __init__(self, view: ClusterView, subscribers: Subscribers, pods: PodCounts) -> None:
        self._view = view
        self._subscribers = subscribers
        self._pods = pods

    def collect(self) -> Iterator[Metric]:
        states = self._view.agent_states()
        subscribers = self._subscribers()
        by_state = GaugeMetricFamily(
            "gpuscaler_gateway_agents",
            "Listed agents by state: heard (fresh), silent (its node's snapshots stopped), unheard (none yet), "
            "refused (it claims another live agent's node), replaced (another address reports its node).",
            labels=["state"],
        )
        for name in AGENT_STATES:
            by_state.add_metric([name], sum(1 for s in states if s.state == name))
        yield by_state

        heard = GaugeMetricFamily(
            "gpuscaler_gateway_agent_heard",
            "1 while the agent's node sends fresh snapshots, 0 while the gateway cannot hear it.",
            labels=["agent", "node"],
        )
        age = GaugeMetricFamily(
            "gpuscaler_gateway_node_snapshot_age_seconds",
            "Age of the node's newest snapshot on the gateway's clock: the lag a node's answers have.",
            labels=["agent", "node"],
        )
        snapshots = CounterMetricFamily(
            "gpuscaler_gateway_agent_snapshots",
            "Snapshots received from the agent since the gateway started.",
            labels=["agent", "node"],
        )
        connects = CounterMetricFamily(
            "gpuscaler_gateway_agent_connects",
            "Connections the gateway opened to the agent (reconnects included).",
            labels=["agent"],
        )
        for state in states:
            heard.add_metric([state.agent, state.node], 1.0 if state.state in ("heard", "replaced") else 0.0)
            if state.age is not None:
                age.add_metric([state.agent, state.node], state.age)
            subscriber = subscribers.get(state.agent)
            if subscriber is not None:
                snapshots.add_metric([state.agent, state.node], subscriber.received)
                connects.add_metric([state.agent], subscriber.connects)
        yield from (heard, age, snapshots, connects)

        latest = self._view.latest
        gpus = GaugeMetricFamily("gpuscaler_gateway_gpus", "GPUs in the newest cluster view (heard nodes only).")
        gpus.add_metric([], len(latest.samples) if latest is not None else 0)
        yield gpus
        asks = self._view.asks
        windows = GaugeMetricFamily(
            "gpuscaler_gateway_windows",
            "Windows the gateway asks every agent for, by who asks: keda (until idle), read (only while it reads).",
            labels=["asked_by"],
        )
        windows.add_metric(["keda"], len(asks.windows) - asks.one_shot)
        windows.add_metric(["read"], asks.one_shot)
        refused = CounterMetricFamily(
            "gpuscaler_gateway_read_windows_refused",
            "Reads answered UNAVAILABLE: another read's one-shot window ask held the one turn past their deadline, "
            "or reads in flight held all READ_WINDOWS_RESERVE one-shot windows.",
        )
        refused.add_metric([], asks.refused)
        yield from (windows, refused)
        pods = self._pods()
        if pods is not None:
            count, lists, events = pods
            pod_family = GaugeMetricFamily("gpuscaler_gateway_pods", "Pods the pod directory knows.")
            pod_family.add_metric([], count)
            list_family = CounterMetricFamily("gpuscaler_gateway_pod_watch_lists", "Full pod lists from the API.")
            list_family.add_metric([], lists)
            event_family = CounterMetricFamily("gpuscaler_gateway_pod_watch_events", "Pod watch events applied.")
            event_family.add_metric([], events)
            yield from (pod_family, list_family, event_family)


class _EmptySelectionCollector(Collector):
    """Each ScaledObject's trigger KEDA is answered 0 for because its selection matches no pod, as the evaluator's
    ``EmptySelectionRecord`` keeps them (how many, and for how long: ``signals/empty_selection_record.py``)."""

    def __init__(self) -> None:
        self.record: EmptySelectionRecord | None = None

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            "gpuscaler_gateway_selection_empty",
            "1 for each ScaledObject's trigger whose selection matches no pod (KEDA gets 0); seen: whether a pod's "
            "owner or a scaleTargetRef in its namespace carried the workload name since the gateway started "
            "(yes, no, or unknown for a pod glob or podSelector).",
            labels=["namespace", "scaled_object", "metric_name", "seen"],
        )
        for (namespace, scaled_object, metric_name), finding in self.record.findings() if self.record else ():
            family.add_metric([namespace, scaled_object, metric_name, finding.seen.value], 1.0)
        yield family
        unrecorded = CounterMetricFamily(
            "gpuscaler_gateway_selection_empty_unrecorded",
            "KEDA's answers of 0 for a selection that matched no GPU-holding pod, for a ScaledObject's trigger not "
            "recorded (nor logged) because the record of such triggers was full of ones KEDA still asks for.",
        )
        unrecorded.add_metric([], self.record.unrecorded if self.record else 0)
        yield unrecorded


class GatewayTelemetry(ServerTelemetry):
    """The gateway's registry."""

    def __init__(
        self,
        view: ClusterView,
        subscribers: Subscribers,
        pods: PodCounts,
        directory: PodDirectory | None = None,
        engines: EngineScraper | None = None,
    ) -> None:
        """``pods()`` gives (pods, lists, watch events) of a Kubernetes pod directory, or None without one."""
        super().__init__()
        self.registry.register(_ViewCollector(view, subscribers, pods))
        if engines is not None:
            engine_telemetry.register(engines, self.registry)
        self.idle_energy = WorkloadIdleEnergy(view, directory)
        view.add_listener(self.idle_energy.on_snapshot)
        self.registry.register(self.idle_energy)
        self.compose_seconds = Histogram(
            "gpuscaler_gateway_compose_duration_seconds",
            "Time one composition of the cluster view took, the open streams' re-evaluation included.",
            buckets=COMPOSE_BUCKETS,
            registry=self.registry,
        )
        view.on_compose = self.compose_seconds.observe
        self.empty_selections = _EmptySelectionCollector()
        self.registry.register(self.empty_selections)

    def watch(self, evaluator: Evaluator) -> None:
        """The shared series, and the ScaledObjects whose selection matches no pod."""
        super().watch(evaluator)
        self.empty_selections.record = evaluator.empty_selections

    def idle_energy_of(self, gpus: Iterable[GpuKey], window_seconds: float | None) -> IdleEnergy | None:
        """Since this gateway first saw each GPU, whatever the window: the gateway keeps no history."""
        return self.idle_energy.counter.summary(gpus)
