"""Conversions between the domain types and the ``gpuscaler.v1`` messages the servers send and read.

A snapshot has one encoding: each GPU's readings packed in ``Snapshot.readings`` and each window's values in
``packed_values``, since a gateway reads thousands of snapshots a second and most queries read one reading of
every GPU, one slice of an array. The gateway reads snapshots elsewhere, with the protobuf runtime's C decoder
(``gateway/decoding.py``: hundreds of times faster than betterproto2, and kept out of the agent);
``tests/server/test_wire.py`` holds ``snapshot_to_wire`` and that decoder to being each other's inverse.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from operator import attrgetter
from typing import TYPE_CHECKING

from gpuscaler.generated.gpuscaler import v1 as pb
from gpuscaler.model.aggregation import WindowFunction
from gpuscaler.model.gpu_metrics import METRICS, READING_FIELDS, Metric
from gpuscaler.model.samples import Attribution, AttributionState, GpuSample, ProcessUsage, ReadErrorKind, Snapshot
from gpuscaler.model.windows import Windowed, WindowKey, WindowValues
from gpuscaler.query.query import CombinedQuery, EngineQuery, GpuQuery, Query, ValueSpec
from gpuscaler.signals.empty_selection import EmptySelection
from gpuscaler.signals.energy import IdleEnergy
from gpuscaler.signals.outcome import Contribution, Evaluation, PodValue

if TYPE_CHECKING:  # the protobuf runtime loads only where snapshots are decoded (gateway/decoding.py)
    from gpuscaler.generated.pb2.gpuscaler.v1 import agent_pb2

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
    return pb.Attribution(
        state=_ATTRIBUTION_TO_WIRE[attribution.state],
        detail=attribution.detail,
        unplaced=[
            pb.UnplacedDevice(
                pod=pb.PodRef(namespace=u.pod.namespace, pod=u.pod.pod, container=u.pod.container),
                device=u.device,
                kind=_KIND_TO_WIRE[u.kind],
                detail=u.detail,
            )
            for u in attribution.unplaced
        ],
    )


def sample_to_wire(sample: GpuSample) -> pb.GpuSample:
    """One GPU's sample as the message, but its readings: ``snapshot_to_wire`` packs those."""
    return pb.GpuSample(
        index=sample.gpu.index,
        uuid=sample.gpu.uuid,
        name=sample.gpu.name,
        mig_parent_uuid=sample.gpu.mig_parent_uuid or "",
        node=sample.node,
        errors=[
            pb.ReadError(
                field=e.field, kind=_KIND_TO_WIRE[e.kind], detail=e.detail, last_read_unix_seconds=e.last_read_at
            )
            for e in sample.errors
        ],
        pods=[pb.PodRef(namespace=p.namespace, pod=p.pod, container=p.container) for p in sample.pods],
        processes=[_process_to_wire(p) for p in sample.processes or ()],
        processes_read=sample.processes is not None,
    )


def packed_readings(sample: GpuSample) -> list[float]:
    """The sample's readings in ``READING_FIELDS`` order, NaN where unread: its share of ``Snapshot.readings``."""
    return [math.nan if (value := getattr(sample, name)) is None else float(value) for name in READING_FIELDS]


def _process_to_wire(process: ProcessUsage) -> pb.ProcessUsage:
    return pb.ProcessUsage(
        pid=process.pid,
        pod_uid=process.pod_uid,
        container_id=process.container_id,
        sm_percent=process.sm_percent,
        memory_utilization_percent=process.memory_utilization_percent,
        memory_used_bytes=process.memory_used_bytes,
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
        readings=[value for sample in snapshot.samples for value in packed_readings(sample)],
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
    zero_allowed = METRICS[metric].default_window_seconds == 0  # a rate between the newest two samples
    if not math.isfinite(spec.seconds) or spec.seconds < 0 or (spec.seconds == 0 and not zero_allowed):
        raise ValueError(f"window seconds {spec.seconds!r} must be a finite number above 0 (0 only for a rate)")
    return WindowKey(metric, spec.seconds, function)


def _window_to_wire(key: WindowKey, values: WindowValues, snapshot: Snapshot) -> pb.WindowedValues:
    if values.problem is not None:
        return pb.WindowedValues(window=window_key_to_wire(key), problem=values.problem)
    missing = Windowed(None, 0)
    per_gpu = [values.by_uuid.get(sample.gpu.uuid, missing) for sample in snapshot.samples]
    details = (
        [
            pb.WindowedValue(
                reason=w.reason or "",
                shares=[
                    pb.PodWindowedValue(
                        pod_uid=uid,
                        value=share.value,
                        samples=share.sample_count,
                        covered_seconds=share.covered_seconds,
                    )
                    for uid, share in w.shares.items()
                ],
            )
            for w in per_gpu
        ]
        if any(w.reason or w.shares for w in per_gpu)
        else []
    )
    covered = (  # sent only for one window length after the agent starts, or after a GPU was unreadable
        [key.seconds if w.covered_seconds is None else w.covered_seconds for w in per_gpu]
        if any(w.covered_seconds is not None for w in per_gpu)
        else []
    )
    return pb.WindowedValues(
        window=window_key_to_wire(key),
        packed_values=[math.nan if w.value is None else w.value for w in per_gpu],
        packed_samples=[w.sample_count for w in per_gpu],
        details=details,
        packed_covered_seconds=covered,
    )


# GPU rows one Explanation lists. A 2,000-node gateway's all-GPU answer has 16,000: made and encoded in full
# they held its event loop (every push and poll) for 0.8 s; 256 rows take a few milliseconds.
MAX_EXPLAINED_GPUS = 256


def explained_gpus(evaluation: Evaluation, limit: int = MAX_EXPLAINED_GPUS) -> tuple[list[Contribution], int]:
    """The GPU rows an explanation lists, and how many it leaves unlisted: all of them up to ``limit``; past
    it, the GPUs left out of the value first (what a reader looks for), then the first that went in, in order.

    Only the rows listed are made: a cluster's other GPUs stay columns.
    """
    contributions = evaluation.contributions
    total = len(contributions)
    if total <= limit:
        return list(contributions), 0
    rows = evaluation.unread[:limit]
    included = (c for c in contributions if c.value is not None)
    rows += itertools.islice(included, limit - len(rows))
    return rows, total - len(rows)


def explanation_to_wire(
    query: Query,
    evaluation: Evaluation,
    *,
    active: bool,
    now: float,
    error_code: str,
    idle_energy: IdleEnergy | None = None,
    empty_selection: EmptySelection | None = None,
) -> pb.Explanation:
    """``error_code`` is the gRPC status name KEDA gets for ``evaluation.error`` (the server's table says which)."""
    snapshot = evaluation.snapshot
    value = query.value
    rows, omitted = explained_gpus(evaluation)
    # Windows that are filling: from each node's list of them, without making the other GPUs' records.
    filling = evaluation.filling_windows()
    least = min(filling, key=_COVERED) if filling else None
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
        metric=value.name,
        profile=query.profile or "",
        aggregation="max" if isinstance(value, CombinedQuery) else value.aggregation.value,
        window_seconds=value.window_seconds or 0.0,
        window_function=value.window_function.value if isinstance(value, GpuQuery) else "",
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
                samples=c.sample_count,
                reason=c.reason or "",
                namespace=c.pod[0] if c.pod else "",
                pod=c.pod[1] if c.pod else "",
                share=c.share or "",
                covered_seconds=c.covered_seconds if c.value is not None else None,
            )
            for c in rows
        ],
        gpus_omitted=omitted,
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
                age_seconds=p.age_seconds,
                signal=signal,
                covered_seconds=p.covered_seconds,
            )
            for signal, p in _pod_rows(value, evaluation)
        ],
        pod_aggregation=value.pods.pod_aggregation.value if isinstance(value, GpuQuery) and value.pods else "",
        selection=_selection(query, evaluation),
        value=evaluation.value,
        active=active,
        error_code=error_code,
        error_message=evaluation.error.message if evaluation.error else "",
        snapshot_age_seconds=max(0.0, now - snapshot.monotonic) if snapshot else 0.0,
        snapshot_sequence=snapshot.sequence if snapshot else 0,
        nodes=evaluation.nodes_counted,
        nodes_expected=snapshot.known_nodes if snapshot else 0,
        absent=[
            pb.AbsentNode(agent=a.agent, node=a.node or "", since_unix_seconds=a.since, reason=a.reason)
            for a in evaluation.absent
        ],
        idle_energy=idle,
        signals=_signal_parts(value, evaluation),
        empty_selection=empty_selection_to_wire(empty_selection) if empty_selection is not None else None,
        least_covered_seconds=least.covered_seconds if least is not None else None,
        gpus_filling=len(filling),
        least_covered_node=least.sample.node if least is not None else "",
    )


_COVERED = attrgetter("covered_seconds")


def empty_selection_to_wire(finding: EmptySelection) -> pb.EmptySelection:
    """A selection that matched no pod, what its name was seen as, and the names it may have meant."""
    return pb.EmptySelection(
        selection=finding.selection,
        namespace=finding.namespace,
        workload=finding.workload or "",
        seen=finding.seen.value,
        seen_as=list(finding.seen_as),
        namespace_pods=finding.namespace_pods,
        did_you_mean=list(finding.did_you_mean),
        seen_in_namespaces=list(finding.seen_in_namespaces),
        namespace_did_you_mean=list(finding.namespace_did_you_mean),
        did_you_mean_elsewhere=list(finding.did_you_mean_elsewhere),
        message=finding.describe(),
    )


def _pod_rows(value: ValueSpec, evaluation: Evaluation) -> list[tuple[str, PodValue]]:
    """Each pod row with the signal it belongs to: a combined query's, signal by signal."""
    if not isinstance(value, CombinedQuery):
        return [("", pod) for pod in evaluation.pods]
    return [
        (part.query.name, pod) for part, own in zip(value.signals, evaluation.parts, strict=True) for pod in own.pods
    ]


def _signal_parts(value: ValueSpec, evaluation: Evaluation) -> list[pb.SignalPart]:
    if not isinstance(value, CombinedQuery):
        return []
    return [
        pb.SignalPart(
            metric=part.query.name,
            target=part.target,
            value=own.value,
            replicas=own.value / part.target if own.value is not None else None,
            error_message=own.error.message if own.error else "",
        )
        for part, own in zip(value.signals, evaluation.parts, strict=True)
    ]


def _selection(query: Query, evaluation: Evaluation) -> str:
    """What the answer read: scaleTargetPods as the workload it resolved to, else the query's own selection."""
    pods = query.value.pods if isinstance(query.value, GpuQuery | EngineQuery) else None
    if pods is not None and pods.scale_target is not None and evaluation.selection:
        return evaluation.selection
    return query.value.describe_selection()
