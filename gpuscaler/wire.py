"""Conversions between the domain types and the ``gpuscaler.v1`` messages, both ways.

The gateway rebuilds samples from the agents' snapshot streams, so the two directions must stay each other's
inverse (a test checks the round trip). Messages are betterproto2's everywhere but one place: the gateway
decodes the snapshot streams with the protobuf runtime's C decoder (``SnapshotDecoder``), hundreds of times
faster for a message that arrives thousands of times a second; the wire format is the same.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import Any

from gpuscaler.aggregation import WindowFunction
from gpuscaler.energy import IdleEnergy
from gpuscaler.evaluation import Evaluation
from gpuscaler.generated.gpuscaler import v1 as pb
from gpuscaler.generated.pb2.gpuscaler.v1 import agent_pb2
from gpuscaler.gpu_metrics import METRICS, READING_FIELDS, Metric
from gpuscaler.query import Query
from gpuscaler.samples import (
    EMPTY_SHARES,
    Attribution,
    AttributionState,
    GpuIdentity,
    GpuSample,
    PodRef,
    ProcessUsage,
    ReadError,
    ReadErrorKind,
    Snapshot,
    Windowed,
    WindowKey,
    WindowValues,
)

_KIND_TO_WIRE = {
    ReadErrorKind.NOT_SUPPORTED: pb.ReadErrorKind.NOT_SUPPORTED,
    ReadErrorKind.GPU_LOST: pb.ReadErrorKind.GPU_LOST,
    ReadErrorKind.TIMEOUT: pb.ReadErrorKind.TIMEOUT,
    ReadErrorKind.OTHER: pb.ReadErrorKind.OTHER,
}
_ATTRIBUTION_TO_WIRE = {
    AttributionState.OFF: pb.AttributionState.OFF,
    AttributionState.UNAVAILABLE: pb.AttributionState.UNAVAILABLE,
    AttributionState.OK: pb.AttributionState.OK,
}


def attribution_to_wire(attribution: Attribution) -> pb.Attribution:
    """A node's attribution state, and why it is not OK, as the message."""
    return pb.Attribution(state=_ATTRIBUTION_TO_WIRE[attribution.state], detail=attribution.detail)


def sample_to_wire(sample: GpuSample) -> pb.GpuSample:
    """One GPU's sample as the message: unread values left unset, and the readings also packed in order (NaN unread)."""
    return pb.GpuSample(
        index=sample.gpu.index,
        uuid=sample.gpu.uuid,
        name=sample.gpu.name,
        mig_parent_uuid=sample.gpu.mig_parent_uuid or "",
        node=sample.node,
        gpu_utilization_percent=sample.gpu_utilization_percent,
        memory_utilization_percent=sample.memory_utilization_percent,
        memory_used_bytes=sample.memory_used_bytes,
        memory_total_bytes=sample.memory_total_bytes,
        temperature_celsius=sample.temperature_celsius,
        power_draw_watts=sample.power_draw_watts,
        power_limit_watts=sample.power_limit_watts,
        errors=[pb.ReadError(field=e.field, kind=_KIND_TO_WIRE[e.kind], detail=e.detail) for e in sample.errors],
        pods=[pb.PodRef(namespace=p.namespace, pod=p.pod, container=p.container) for p in sample.pods],
        sm_active_percent=sample.sm_active_percent,
        sm_occupancy_percent=sample.sm_occupancy_percent,
        tensor_active_percent=sample.tensor_active_percent,
        dram_bandwidth_percent=sample.dram_bandwidth_percent,
        energy_joules=sample.energy_joules,
        processes=[_process_to_wire(p) for p in sample.processes or ()],
        processes_read=sample.processes is not None,
        readings=[_NAN if (value := getattr(sample, name)) is None else float(value) for name in READING_FIELDS],
    )


def _process_to_wire(process: ProcessUsage) -> pb.ProcessUsage:
    return pb.ProcessUsage(
        pid=process.pid,
        pod_uid=process.pod_uid,
        container_id=process.container_id,
        sm_percent=process.sm_percent,
        memory_utilization_percent=process.memory_utilization_percent,
        memory_used_bytes=process.memory_used_bytes,
    )


def _process_from_pb2(message: agent_pb2.ProcessUsage) -> ProcessUsage:
    def optional(name: str) -> Any:
        return getattr(message, name) if message.HasField(name) else None

    return ProcessUsage(
        message.pid,
        optional("pod_uid"),
        optional("container_id"),
        optional("sm_percent"),
        optional("memory_utilization_percent"),
        optional("memory_used_bytes"),
    )


def snapshot_to_wire(
    snapshot: Snapshot, *, poll_interval_seconds: float, windows: Mapping[WindowKey, WindowValues] | None = None
) -> pb.Snapshot:
    """The message; ``windows`` are the windows a subscriber asked for, reduced for this snapshot."""
    return pb.Snapshot(
        node=snapshot.node,
        sequence=snapshot.sequence,
        taken_at_unix_seconds=snapshot.taken_at,
        poll_interval_seconds=poll_interval_seconds,
        gpus=[sample_to_wire(sample) for sample in snapshot.samples],
        attribution=attribution_to_wire(snapshot.attribution),
        windows=[_window_to_wire(key, values, snapshot) for key, values in (windows or {}).items()],
    )


def window_key_to_wire(key: WindowKey) -> pb.WindowSpec:
    """A window as the WindowSpec a subscriber sends to ask an agent for it."""
    return pb.WindowSpec(metric=key.metric.value, seconds=key.seconds, function=key.function.value)


def window_key_from_wire(spec: pb.WindowSpec | agent_pb2.WindowSpec) -> WindowKey:
    """The window a message names; ValueError naming the field when it names no metric or function we have."""
    try:
        metric = Metric(spec.metric)
    except ValueError:
        raise ValueError(f"window metric {spec.metric!r} is not a metric") from None
    try:
        function = WindowFunction(spec.function)
    except ValueError:
        raise ValueError(f"window function {spec.function!r} is not one of avg, max, min, last") from None
    if not math.isfinite(spec.seconds) or spec.seconds < 0 or (spec.seconds == 0 and not METRICS[metric].rate):
        raise ValueError(f"window seconds {spec.seconds!r} must be a finite number above 0 (0 only for a rate)")
    return WindowKey(metric, spec.seconds, function)


def _window_to_wire(key: WindowKey, values: WindowValues, snapshot: Snapshot) -> pb.WindowedValues:
    if values.problem is not None:
        return pb.WindowedValues(window=window_key_to_wire(key), problem=values.problem)
    missing = Windowed(None, 0)
    per_gpu = [values.by_uuid.get(sample.gpu.uuid, missing) for sample in snapshot.samples]
    return pb.WindowedValues(
        window=window_key_to_wire(key),
        values=[
            pb.WindowedValue(
                value=w.value,
                samples=w.samples,
                reason=w.reason or "",
                shares=[
                    pb.PodWindowedValue(pod_uid=uid, value=share.value, samples=share.samples)
                    for uid, share in w.shares.items()
                ],
            )
            for w in per_gpu
        ],
    )


_KIND_FROM_PB2 = {
    agent_pb2.READ_ERROR_KIND_NOT_SUPPORTED: ReadErrorKind.NOT_SUPPORTED,
    agent_pb2.READ_ERROR_KIND_GPU_LOST: ReadErrorKind.GPU_LOST,
    agent_pb2.READ_ERROR_KIND_TIMEOUT: ReadErrorKind.TIMEOUT,
    agent_pb2.READ_ERROR_KIND_OTHER: ReadErrorKind.OTHER,
}
_ATTRIBUTION_FROM_PB2 = {
    agent_pb2.ATTRIBUTION_STATE_OFF: AttributionState.OFF,
    agent_pb2.ATTRIBUTION_STATE_UNAVAILABLE: AttributionState.UNAVAILABLE,
    agent_pb2.ATTRIBUTION_STATE_OK: AttributionState.OK,
}


def _windowed_from_pb2(value: agent_pb2.WindowedValue) -> Windowed:
    shares = (
        {
            share.pod_uid: Windowed(share.value if share.HasField("value") else None, share.samples)
            for share in value.shares
        }
        if value.shares
        else EMPTY_SHARES
    )
    return Windowed(value.value if value.HasField("value") else None, value.samples, value.reason or None, shares)


_NAN = math.nan
# The readings counted in bytes: integers in a sample, doubles in the packed array (exact below 2**53).
_BYTES_POSITIONS = tuple(position for position, name in enumerate(READING_FIELDS) if name.endswith("_bytes"))


class _WireWindows(Mapping[WindowKey, WindowValues]):
    """A snapshot's windows, each decoded when first read.

    Every window a gateway's queries use arrives with every snapshot, but a polled query reads it once per
    KEDA poll (30 s by default) while snapshots arrive every agent poll: most are never read.
    """

    def __init__(self, by_key: dict[WindowKey, agent_pb2.WindowedValues], samples: tuple[GpuSample, ...]) -> None:
        self._wire = by_key
        self._samples = samples
        self._decoded: dict[WindowKey, WindowValues] = {}

    def __getitem__(self, key: WindowKey) -> WindowValues:
        values = self._decoded.get(key)
        if values is None:
            values = self._decoded[key] = self._decode(self._wire[key])
        return values

    def _decode(self, window: agent_pb2.WindowedValues) -> WindowValues:
        samples = self._samples
        if window.problem or len(window.values) != len(samples):
            return WindowValues({}, window.problem or f"{len(window.values)} values for {len(samples)} GPUs")
        return WindowValues(
            {sample.gpu.uuid: _windowed_from_pb2(value) for sample, value in zip(samples, window.values, strict=True)}
        )

    def __contains__(self, key: object) -> bool:
        return key in self._wire

    def __iter__(self) -> Iterator[WindowKey]:
        return iter(self._wire)

    def __len__(self) -> int:
        return len(self._wire)


class SnapshotDecoder:
    """One agent's snapshot stream, from protobuf messages to domain snapshots, cheaply.

    A node's GPUs and its pods' assignments rarely change between ticks, so their objects are kept and
    reused; only the readings are new each time.
    """

    def __init__(self) -> None:
        self._identities: dict[tuple[int, str], GpuIdentity] = {}
        self._pods: dict[tuple[tuple[str, str, str], ...], tuple[PodRef, ...]] = {}
        self._window_keys: dict[tuple[str, float, str], WindowKey | None] = {}

    def decode(self, message: agent_pb2.Snapshot, *, monotonic: float) -> Snapshot:
        """The domain snapshot; ``monotonic`` is the receiver's clock at arrival (clocks differ between hosts)."""
        node = message.node
        if message.HasField("attribution") and message.attribution.state in _ATTRIBUTION_FROM_PB2:
            attribution = Attribution(_ATTRIBUTION_FROM_PB2[message.attribution.state], message.attribution.detail)
        else:  # an agent older than attribution sends none: it has none
            attribution = Attribution(
                AttributionState.OFF, f"the agent on {node!r} sends no pod attribution (upgrade it)"
            )
        samples = tuple(self._sample(gpu) for gpu in message.gpus)
        return Snapshot(
            sequence=message.sequence,
            taken_at=message.taken_at_unix_seconds,
            monotonic=monotonic,
            node=node,
            samples=samples,
            attribution=attribution,
            windows=self._windows(message, samples) if message.windows else {},
        )

    def _windows(self, message: agent_pb2.Snapshot, samples: tuple[GpuSample, ...]) -> _WireWindows:
        by_key = {}
        for window in message.windows:
            spec = window.window
            named = (spec.metric, spec.seconds, spec.function)
            if named not in self._window_keys:
                if len(self._window_keys) > 256:  # windows asked for come and go; a handful are in use
                    self._window_keys.clear()
                try:
                    self._window_keys[named] = window_key_from_wire(spec)
                except ValueError:  # a window from a newer agent that this gateway cannot name: not asked for by it
                    self._window_keys[named] = None
            key = self._window_keys[named]
            if key is not None:
                by_key[key] = window
        return _WireWindows(by_key, samples)

    def _sample(self, gpu: agent_pb2.GpuSample) -> GpuSample:
        key = (gpu.index, gpu.uuid)  # a UUID's name and MIG parent are its own for life
        identity = self._identities.get(key)
        if identity is None:
            identity = self._identities[key] = GpuIdentity(gpu.index, gpu.uuid, gpu.name, gpu.mig_parent_uuid or None)
        packed = gpu.readings
        if len(packed) == len(READING_FIELDS):
            readings: list[float | int | None] = [None if value != value else value for value in packed]  # NaN: absent
            for position in _BYTES_POSITIONS:
                if (value := readings[position]) is not None:
                    readings[position] = int(value)
        else:  # an agent that sends only the fields (older, or another implementation)
            readings = [getattr(gpu, name) if gpu.HasField(name) else None for name in READING_FIELDS]
        errors = (
            tuple(ReadError(e.field, _KIND_FROM_PB2.get(e.kind, ReadErrorKind.OTHER), e.detail) for e in gpu.errors)
            if gpu.errors
            else ()
        )
        # An agent older than per-process reads sends neither: not read, which is not "no processes".
        processes = tuple(_process_from_pb2(p) for p in gpu.processes) if gpu.processes_read else None
        # By position: GpuSample's fields are (gpu, node, the readings in READINGS' order, errors, pods,
        # processes), which tests/test_wire.py holds to; a named tuple built from a tuple is the cheapest
        # record Python makes.
        return GpuSample._make((identity, gpu.node, *readings, errors, self._pod_refs(gpu), processes))

    def _pod_refs(self, gpu: agent_pb2.GpuSample) -> tuple[PodRef, ...]:
        if not gpu.pods:
            return ()
        key = tuple((p.namespace, p.pod, p.container) for p in gpu.pods)
        pods = self._pods.get(key)
        if pods is None:
            if len(self._pods) > 4096:  # pods come and go; keep the cache to what a node holds now
                self._pods.clear()
            pods = self._pods[key] = tuple(PodRef(*ref) for ref in key)
        return pods


def explanation_to_wire(
    query: Query,
    evaluation: Evaluation,
    *,
    active: bool,
    now: float,
    error_code: str,
    idle_energy: IdleEnergy | None = None,
) -> pb.Explanation:
    """``error_code`` is the gRPC status name KEDA gets for ``evaluation.error`` (the server's table says which)."""
    snapshot = evaluation.snapshot
    value = query.value
    idle = (
        pb.IdleEnergy(
            idle_joules=idle_energy.idle_joules,
            busy_joules=idle_energy.busy_joules,
            seconds=idle_energy.seconds,
            unknown_seconds=idle_energy.unknown_seconds,
            gpus=idle_energy.gpus,
        )
        if idle_energy is not None and idle_energy.gpus
        else None
    )
    return pb.Explanation(
        metric_name=query.metric_name,
        metric=value.metric.value,
        profile=query.profile or "",
        aggregation=value.aggregation.value,
        window_seconds=value.window_seconds or 0.0,
        window_function=value.window_function.value,
        target=query.target,
        activation_threshold=query.activation.activation_threshold,
        deactivation_threshold=query.activation.deactivation_threshold,
        gpus=[
            pb.GpuContribution(
                index=c.sample.gpu.index,
                uuid=c.sample.gpu.uuid,
                node=c.sample.node,
                included=c.value is not None,
                value=c.value,
                samples=c.samples,
                reason=c.reason or "",
                namespace=c.pod[0] if c.pod else "",
                pod=c.pod[1] if c.pod else "",
                share=c.share or "",
            )
            for c in evaluation.contributions
        ],
        pods=[
            pb.PodContribution(
                namespace=p.namespace,
                pod=p.pod,
                workload=p.workload or "",
                node=p.node,
                included=p.value is not None,
                value=p.value,
                gpus=p.gpus,
                reason=p.reason or "",
            )
            for p in evaluation.pods
        ],
        pod_aggregation=value.pods.pod_aggregation.value if value.pods else "",
        selection=_selection(query, evaluation),
        value=evaluation.value,
        active=active,
        error_code=error_code,
        error_message=evaluation.error.message if evaluation.error else "",
        snapshot_age_seconds=max(0.0, now - snapshot.monotonic) if snapshot else 0.0,
        snapshot_sequence=snapshot.sequence if snapshot else 0,
        nodes=evaluation.nodes,
        nodes_expected=snapshot.known_nodes if snapshot else 0,
        absent=[
            pb.AbsentNode(agent=a.agent, node=a.node or "", since_unix_seconds=a.since, reason=a.reason)
            for a in evaluation.absent
        ],
        idle_energy=idle,
    )


def _selection(query: Query, evaluation: Evaluation) -> str:
    """What the answer read: scaleTargetPods as the workload it resolved to, else the query's own selection."""
    pods = query.value.pods
    if pods is not None and pods.scale_target is not None and evaluation.selection:
        return evaluation.selection
    return query.value.describe_selection()
