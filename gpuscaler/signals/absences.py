"""Unknown is not zero: what an answer does with nodes it cannot hear and GPUs it cannot read."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from typing import NamedTuple

from gpuscaler.model.errors import GpuscalerError, Unavailable
from gpuscaler.model.samples import (
    Absence,
    ReadErrorKind,
    Snapshot,
)
from gpuscaler.query.query import DEFAULT_MAX_UNREADABLE, GpuQuery, PodSelection
from gpuscaler.signals.gpu_values import listing, unreadable_error
from gpuscaler.signals.outcome import PART_LEFT_OUT, Contribution, HeldPods, NodePart

MAX_ABSENCES_NAMED = 5


MAX_GPUS_NAMED = 5


class NodeLeftOut(NamedTuple):
    """One node's GPUs (or pods' GPUs) that an evaluation could not read, and how many it could."""

    node: str
    part: Snapshot | None  # the node's snapshot in a cluster view
    readable: int
    left_out: Sequence[Contribution]


def _unknown(contribution: Contribution) -> bool:
    """Whether a GPU left out has a value that is unknown now (lost, hung, not read, nothing in its window),
    rather than none at all: a GPU that does not support the metric is outside its domain, and never counts."""
    error = contribution.error
    return contribution.value is None and (error is None or error.kind is not ReadErrorKind.NOT_SUPPORTED)


def parts_left_out(snapshot: Snapshot, node_parts: Sequence[NodePart]) -> list[NodeLeftOut]:
    """The nodes of a cluster evaluation that left something out: found in C, as most nodes leave out nothing."""
    parts = snapshot.parts
    return [
        NodeLeftOut(parts[index].node, parts[index], len(node_parts[index].included), node_parts[index].left_out)
        for index in itertools.compress(range(len(node_parts)), map(PART_LEFT_OUT, node_parts))
    ]


def left_out_by_node(snapshot: Snapshot, contributions: Iterable[Contribution], *, cluster: bool) -> list[NodeLeftOut]:
    """The nodes whose contributions leave something out, in order, with how many of theirs were read.

    ``cluster``, here and below: the snapshot is a gateway's view (``SnapshotSource.cluster``)."""
    readable: dict[str, int] = {}
    left: dict[str, list[Contribution]] = {}
    for contribution in contributions:
        node = contribution.sample.node
        if contribution.value is None:
            left.setdefault(node, []).append(contribution)
        else:
            readable[node] = readable.get(node, 0) + 1
    parts = {part.node: part for part in snapshot.parts} if cluster else {}
    return [NodeLeftOut(node, parts.get(node), readable.get(node, 0), gpus) for node, gpus in left.items()]


def judge_unreadable(
    query: GpuQuery,
    snapshot: Snapshot,
    by_node: Sequence[NodeLeftOut],
    readable: int,
    silent: Sequence[tuple[Absence, HeldPods]],
    *,
    cluster: bool,
) -> tuple[Absence, ...] | GpuscalerError | None:
    """Unreadable is not zero: what an answer does with selected GPUs it cannot read now. One rule, agent and gateway:

    - a node none of whose selected GPUs can be read is unknown, like a silent node: the answer is UNAVAILABLE
      naming it, unless ``minNodes`` is met without it (it counts as not heard); on an agent, that node is all
      there is, so the answer is UNAVAILABLE;
    - unknown GPUs on nodes that answer with others are left out while they are within ``maxUnreadable`` of the
      GPUs the answer would count; beyond it the answer is UNAVAILABLE naming them.

    GPUs that do not support the metric are left out and counted in neither. Returns the absences the value
    may leave out (when it leaves out a node), the error KEDA must get instead, or None: nothing changes.
    """
    unreadable: list[NodeLeftOut] = []
    left_out: list[Contribution] = []
    for node in by_node:
        unknown = [c for c in node.left_out if _unknown(c)]
        if not unknown:
            continue
        if node.readable == 0:
            unreadable.append(node)
        else:
            left_out.extend(unknown)
    gate: tuple[Absence, ...] | None = None
    if unreadable:
        if not cluster:
            return unreadable_error(query.metric, unreadable[0].left_out)
        absences = [(_unreadable_node(node, snapshot), _holding(node.left_out)) for node in unreadable]
        judged = absences_allowed(query, snapshot, [*silent, *absences], heard=len(snapshot.nodes) - len(unreadable))
        if isinstance(judged, GpuscalerError):
            return judged
        gate = judged
    if left_out:
        total = readable + len(left_out)
        allowed = query.max_unreadable.allowed(total)
        if len(left_out) > allowed:
            return _too_many_unreadable(query, left_out, total, allowed, cluster=cluster)
    return gate


def _unreadable_node(node: NodeLeftOut, snapshot: Snapshot) -> Absence:
    gpus = list({c.sample.gpu.uuid: c for c in node.left_out}.values())  # a GPU two selected pods hold, once
    details = "; ".join(f"{c.sample.gpu.describe()}: {c.reason}" for c in gpus[:MAX_GPUS_NAMED])
    if len(gpus) > MAX_GPUS_NAMED:
        details += f"; and {len(gpus) - MAX_GPUS_NAMED} more"
    reason = f"none of its {len(gpus)} selected GPU(s) can be read ({details})"
    since = node.part.taken_at if node.part is not None else snapshot.taken_at
    return Absence("", node.node, since, reason, last=node.part, heard=True)


def _holding(left_out: Iterable[Contribution]) -> HeldPods:
    """The selected pods whose GPUs these are (none in an all-GPU query)."""
    return tuple(sorted({c.pod for c in left_out if c.pod is not None}))


def _too_many_unreadable(
    query: GpuQuery, left_out: Sequence[Contribution], total: int, allowed: int, *, cluster: bool
) -> GpuscalerError:
    details = "; ".join(
        f"{c.sample.gpu.describe()}{f' on {c.sample.node}' if cluster else ''}: {c.reason}"
        for c in left_out[:MAX_GPUS_NAMED]
    )
    if len(left_out) > MAX_GPUS_NAMED:
        details += f"; and {len(left_out) - MAX_GPUS_NAMED} more"
    tolerance = query.max_unreadable.describe()
    if query.max_unreadable == DEFAULT_MAX_UNREADABLE:
        tolerance += " (the default)"
    return Unavailable(
        f"{query.metric.value} cannot be read on {len(left_out)} of the {total} selected GPUs, and maxUnreadable "
        f"{tolerance} lets an answer leave out {allowed} of them: {details}. Their share is unknown, not 0, and "
        "leaving it out could scale the workload in; maxUnreadable sets how many may be left out"
    )


def absences_allowed(
    query: GpuQuery, snapshot: Snapshot, relevant: Sequence[tuple[Absence, HeldPods]], heard: int | None = None
) -> tuple[Absence, ...] | GpuscalerError:
    """The absences the value may leave out, or the error KEDA must get instead.

    Unknown is not zero: a node the answer needs and cannot hear (or read) makes the answer UNAVAILABLE, unless
    ``minNodes`` says how many heard nodes are enough; then those are left out (and named in Explain).
    ``heard`` is how many nodes count as heard, when some fresh ones have nothing readable.
    """
    if query.min_nodes is not None:
        fresh = len(snapshot.nodes) if heard is None else heard
        known = snapshot.known_nodes
        required = query.min_nodes.required(known)
        if fresh < required:
            readable = "" if heard is None else " with a readable GPU"
            return Unavailable(
                f"only {fresh} of {known} known nodes sent fresh samples{readable}, and minNodes "
                f"{query.min_nodes.describe()} needs {required}; answering from too little data could scale "
                "the workload in"
            )
        return tuple(absence for absence, _ in relevant)
    if not relevant:
        return ()
    return Unavailable(_unknown_share(relevant, snapshot, query.pods))


def _unknown_share(relevant: Sequence[tuple[Absence, HeldPods]], snapshot: Snapshot, pods: PodSelection | None) -> str:
    clauses = []
    for absence, held in relevant[:MAX_ABSENCES_NAMED]:
        clause = absence.describe(snapshot.taken_at)
        if held:
            clause += f", and it {'holds' if absence.heard else 'held'} {listing(f'{ns}/{name}' for ns, name in held)}"
        clauses.append(clause)
    if len(relevant) > MAX_ABSENCES_NAMED:
        clauses.append(f"and {len(relevant) - MAX_ABSENCES_NAMED} more")
    read = any(absence.heard for absence, _ in relevant)
    hear = "hear or read" if read else "hear"
    again = "heard and read again" if read else "heard again"
    if pods is None:
        scope = (
            f"the value needs every node's GPUs, and {len(relevant)} of {snapshot.known_nodes} cannot be "
            f"{'heard or read' if read else 'heard'}"
        )
        until = f"until it is {again} or its agent leaves discovery (the node is removed)"
    else:
        scope = f"{pods.describe()} may hold GPUs the gateway cannot {hear}"
        until = f"until the node is {again}, the pods are deleted, or its agent leaves discovery"
    return (
        f"{scope}: {'; '.join(clauses)}. That share is unknown, not 0, {until}; minNodes lets the answer "
        f"leave out nodes that cannot be {'heard or read' if read else 'heard'}"
    )


def cannot_hear(absent: Sequence[Absence], snapshot: Snapshot) -> str:
    """Why a GPU named by UUID may be missing: the nodes that cannot be heard now, the first few."""
    named = "; ".join(absence.describe(snapshot.taken_at) for absence in absent[:MAX_ABSENCES_NAMED])
    more = f"; and {len(absent) - MAX_ABSENCES_NAMED} more" if len(absent) > MAX_ABSENCES_NAMED else ""
    return f"it may be on a node that cannot be heard now: {named}{more}"


def no_gpus(snapshot: Snapshot, *, cluster: bool) -> str:
    """Why there are no GPUs to read: the node reports none, or which agents sent nothing fresh."""
    if not cluster:
        return f"node {snapshot.node!r} reports no GPUs"
    message = (
        f"no GPUs to read: {len(snapshot.parts)} of {snapshot.known_nodes} known agents sent a fresh snapshot "
        "with GPUs in it"
    )
    if snapshot.absent:
        message += "; not heard: " + "; ".join(
            a.describe(snapshot.taken_at) for a in snapshot.absent[:MAX_ABSENCES_NAMED]
        )
    return message
