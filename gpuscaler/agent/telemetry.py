"""The agent's Prometheus series: the shared server series, every GPU reading, idle energy, NVML, the poll loop and
the kubelet's pod attribution.

GPU series are built from the newest snapshot at scrape time (a custom collector), so the series of a
GPU that vanished disappear with it, and a value that could not be read is no series, never a 0.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Protocol

from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gpuscaler.agent.history import History
from gpuscaler.model.gpu_metrics import READINGS
from gpuscaler.model.samples import DEVICE_FIELD, GpuKey, GpuSample, ReadErrorKind, UnplacedDevice
from gpuscaler.server.telemetry import ServerTelemetry
from gpuscaler.signals.energy import IdleEnergy, IdleEnergyCounter, idle_energy, pods_of
from gpuscaler.signals.source import SnapshotSource

NVML_LATENCY_BUCKETS = (0.00001, 0.00005, 0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0)
_GPU_LABELS = ("node", "gpu", "uuid", "model_name", "mig_parent_uuid")


class _GpuCollector(Collector):
    def __init__(self, source: SnapshotSource, clock: Callable[[], float]) -> None:
        self._source = source
        self._clock = clock

    def collect(self) -> Iterator[Metric]:
        latest = self._source.latest
        families: dict[str, GaugeMetricFamily | CounterMetricFamily] = {
            r.series: (CounterMetricFamily if r.counter else GaugeMetricFamily)(r.series, r.help, labels=_GPU_LABELS)
            for r in READINGS
        }
        up = GaugeMetricFamily(
            "gpuscaler_gpu_up",
            "1 when the GPU's last read succeeded, 0 when the whole device failed.",
            labels=_GPU_LABELS,
        )
        age = GaugeMetricFamily("gpuscaler_sample_age_seconds", "Age of the newest snapshot.")
        if latest is not None:
            age.add_metric([], max(0.0, self._clock() - latest.monotonic))
            for sample in latest.samples:
                labels = _labels(sample)
                up.add_metric(labels, 0.0 if any(e.field == DEVICE_FIELD for e in sample.errors) else 1.0)
                for reading in READINGS:
                    value = getattr(sample, reading.field)
                    if value is not None:
                        families[reading.series].add_metric(labels, float(value) * reading.scale)
        yield up
        yield from families.values()
        yield age


class _IdleEnergyCollector(Collector):
    """Energy while idle since the agent started, per GPU and per pod that holds it (``energy.py`` defines it)."""

    def __init__(self, counter: IdleEnergyCounter) -> None:
        self._counter = counter

    def collect(self) -> Iterator[Metric]:
        gpus = CounterMetricFamily(
            "gpuscaler_gpu_idle_energy_joules",
            "Energy the GPU used in poll intervals that closed with gpu_utilization 0, since the agent started.",
            labels=_GPU_LABELS,
        )
        for sample, joules in self._counter.gpu_totals():
            gpus.add_metric(_labels(sample), joules)
        pods = CounterMetricFamily(
            "gpuscaler_pod_idle_energy_joules",
            "Energy while idle of the GPUs the kubelet assigned to the pod (each in full), since the agent started.",
            labels=["namespace", "pod"],
        )
        for (namespace, pod), total in sorted(self._counter.by_owner.items()):
            pods.add_metric([namespace, pod], total.idle_joules)
        yield gpus
        yield pods


class AttributionReads(Protocol):
    """What the kubelet's PodResources reader says of its reads (``attribution/podresources.py``)."""

    @property
    def last_read_ok(self) -> bool | None: ...

    @property
    def last_success_unix(self) -> float | None: ...

    @property
    def unplaced_now(self) -> Sequence[UnplacedDevice] | None: ...


class _AttributionCollector(Collector):
    """Whether the kubelet's PodResources answered, as every input that can fail says it: up, and when last."""

    def __init__(self, reads: AttributionReads) -> None:
        self._reads = reads

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily(
            "gpuscaler_attribution_up",
            "1 when the agent's last read of the kubelet's PodResources worked, 0 when it failed or found no socket.",
        )
        last = GaugeMetricFamily(
            "gpuscaler_attribution_last_success_timestamp_seconds",
            "Unix time of the agent's last good read of the kubelet's PodResources.",
        )
        unplaced = GaugeMetricFamily(
            "gpuscaler_attribution_unplaced_devices",
            "Devices the kubelet assigned to containers that no GPU the agent enumerates carries, at the last tick, "
            "by the kind of their absence (other: the pod's share is unknown; not_supported: a GPU passed to a VM).",
            labels=["kind"],
        )
        ok, when = self._reads.last_read_ok, self._reads.last_success_unix
        if ok is not None:  # not read yet: no series, as a reading not made is never 0
            up.add_metric([], 1.0 if ok else 0.0)
        if when is not None:
            last.add_metric([], when)
        devices = self._reads.unplaced_now
        if devices is not None:  # nothing placed yet, or the kubelet's assignments are not known: no series
            for kind in (ReadErrorKind.OTHER, ReadErrorKind.NOT_SUPPORTED):
                unplaced.add_metric([kind.value], float(sum(1 for device in devices if device.kind is kind)))
        yield up
        yield last
        yield unplaced


def _labels(sample: GpuSample) -> list[str]:
    return [sample.node, str(sample.gpu.index), sample.gpu.uuid, sample.gpu.name, sample.gpu.mig_parent_uuid or ""]


class AgentTelemetry(ServerTelemetry):
    """The agent's registry: the shared series, every GPU reading, NVML calls, the poll loop and attribution."""

    def __init__(self, source: History, *, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        registry = self.registry
        registry.register(_GpuCollector(source, clock))
        self._history = source
        self.idle_energy = IdleEnergyCounter(pods_of)
        source.add_listener(self.idle_energy.observe)
        registry.register(_IdleEnergyCollector(self.idle_energy))
        self.nvml_call_seconds = Histogram(
            "gpuscaler_nvml_call_duration_seconds",
            "Duration of NVML calls, by call.",
            ["call"],
            buckets=NVML_LATENCY_BUCKETS,
            registry=registry,
        )
        self.nvml_errors = Counter(
            "gpuscaler_nvml_errors_total",
            "NVML calls that failed, by call and NVML return code.",
            ["call", "code"],
            registry=registry,
        )
        self.poll_seconds = Histogram(
            "gpuscaler_poll_duration_seconds", "Time one poll tick took to read every GPU.", registry=registry
        )
        self.poll_lag = Gauge(
            "gpuscaler_poll_lag_seconds", "How late the last poll tick started against its schedule.", registry=registry
        )

    def watch_attribution(self, reads: AttributionReads) -> None:
        """Export the kubelet reader's up and last-success series; an agent with attribution off has neither."""
        self.registry.register(_AttributionCollector(reads))

    def idle_energy_of(self, gpus: Iterable[GpuKey], window_seconds: float | None) -> IdleEnergy | None:
        return idle_energy(self._history, gpus, window_seconds)

    def observe_nvml_call(self, call: str, seconds: float, error_code: int | None) -> None:
        self.nvml_call_seconds.labels(call).observe(seconds)
        if error_code is not None:
            self.nvml_errors.labels(call, str(error_code)).inc()

    def observe_tick(self, seconds: float, lag: float) -> None:
        self.poll_seconds.observe(seconds)
        self.poll_lag.set(lag)
