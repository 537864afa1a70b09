"""Conversions between the domain types and the ``gpuscaler.v1`` messages, both ways.

The gateway rebuilds samples from the agents' snapshot streams with ``snapshot_from_wire``, so the two
directions must stay each other's inverse (a test checks the round trip).
"""

from __future__ import annotations

from gpuscaler.energy import IdleEnergy
from gpuscaler.evaluation import Evaluation
from gpuscaler.generated.gpuscaler import v1 as pb
from gpuscaler.query import Query
from gpuscaler.samples import (
    Attribution,
    AttributionState,
    GpuIdentity,
    GpuSample,
    PodRef,
    ProcessUsage,
    ReadError,
    ReadErrorKind,
    Snapshot,
)

_KIND_TO_WIRE = {
    ReadErrorKind.NOT_SUPPORTED: pb.ReadErrorKind.NOT_SUPPORTED,
    ReadErrorKind.GPU_LOST: pb.ReadErrorKind.GPU_LOST,
    ReadErrorKind.TIMEOUT: pb.ReadErrorKind.TIMEOUT,
    ReadErrorKind.OTHER: pb.ReadErrorKind.OTHER,
}
_KIND_FROM_WIRE = {wire: kind for kind, wire in _KIND_TO_WIRE.items()}
_ATTRIBUTION_TO_WIRE = {
    AttributionState.OFF: pb.AttributionState.OFF,
    AttributionState.UNAVAILABLE: pb.AttributionState.UNAVAILABLE,
    AttributionState.OK: pb.AttributionState.OK,
}
_ATTRIBUTION_FROM_WIRE = {wire: state for state, wire in _ATTRIBUTION_TO_WIRE.items()}


def attribution_to_wire(attribution: Attribution) -> pb.Attribution:
    return pb.Attribution(state=_ATTRIBUTION_TO_WIRE[attribution.state], detail=attribution.detail)


def attribution_from_wire(message: pb.Attribution | None, node: str) -> Attribution:
    """An agent that sends no attribution (older than it) has none: OFF, saying so."""
    state = _ATTRIBUTION_FROM_WIRE.get(message.state) if message is not None else None
    if message is None or state is None:
        return Attribution(AttributionState.OFF, f"the agent on {node!r} sends no pod attribution (upgrade it)")
    return Attribution(state, message.detail)


def sample_to_wire(sample: GpuSample) -> pb.GpuSample:
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


def _process_from_wire(message: pb.ProcessUsage) -> ProcessUsage:
    return ProcessUsage(
        pid=message.pid,
        pod_uid=message.pod_uid,
        container_id=message.container_id,
        sm_percent=message.sm_percent,
        memory_utilization_percent=message.memory_utilization_percent,
        memory_used_bytes=message.memory_used_bytes,
    )


def sample_from_wire(message: pb.GpuSample) -> GpuSample:
    return GpuSample(
        gpu=GpuIdentity(
            index=message.index,
            uuid=message.uuid,
            name=message.name,
            mig_parent_uuid=message.mig_parent_uuid or None,
        ),
        node=message.node,
        gpu_utilization_percent=message.gpu_utilization_percent,
        memory_utilization_percent=message.memory_utilization_percent,
        memory_used_bytes=message.memory_used_bytes,
        memory_total_bytes=message.memory_total_bytes,
        temperature_celsius=message.temperature_celsius,
        power_draw_watts=message.power_draw_watts,
        power_limit_watts=message.power_limit_watts,
        errors=tuple(
            ReadError(e.field, _KIND_FROM_WIRE.get(e.kind, ReadErrorKind.OTHER), e.detail) for e in message.errors
        ),
        pods=tuple(PodRef(p.namespace, p.pod, p.container) for p in message.pods),
        sm_active_percent=message.sm_active_percent,
        sm_occupancy_percent=message.sm_occupancy_percent,
        tensor_active_percent=message.tensor_active_percent,
        dram_bandwidth_percent=message.dram_bandwidth_percent,
        energy_joules=message.energy_joules,
        # An agent older than per-process reads sends neither: not read, which is not "no processes".
        processes=tuple(_process_from_wire(p) for p in message.processes) if message.processes_read else None,
    )


def snapshot_to_wire(snapshot: Snapshot, *, poll_interval_seconds: float) -> pb.Snapshot:
    return pb.Snapshot(
        node=snapshot.node,
        sequence=snapshot.sequence,
        taken_at_unix_seconds=snapshot.taken_at,
        poll_interval_seconds=poll_interval_seconds,
        gpus=[sample_to_wire(sample) for sample in snapshot.samples],
        attribution=attribution_to_wire(snapshot.attribution),
    )


def snapshot_from_wire(message: pb.Snapshot, *, monotonic: float) -> Snapshot:
    """The domain snapshot; ``monotonic`` is the receiver's clock at arrival (clocks differ between hosts)."""
    return Snapshot(
        sequence=message.sequence,
        taken_at=message.taken_at_unix_seconds,
        monotonic=monotonic,
        node=message.node,
        samples=tuple(sample_from_wire(sample) for sample in message.gpus),
        attribution=attribution_from_wire(message.attribution, message.node),
    )


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
