"""Evaluating a query over a snapshot source: per-GPU values, the aggregate, or the error KEDA must get.

Naming GPUs by index or UUID requires every one of them. Selecting all GPUs leaves out those whose value
cannot be read only while they are within ``maxUnreadable``, and says why; a node none of whose selected GPUs
can be read is unknown, like a silent node (``absences.judge_unreadable``). No readable GPU at all is an error,
never a 0, because a 0 scales in. A query that selects pods is ``pod_evaluation``'s.
"""

from __future__ import annotations

import itertools

from gpuscaler.model.aggregation import aggregate
from gpuscaler.model.errors import GpuscalerError, InvalidMetadata, Unavailable
from gpuscaler.model.pods import PodDirectory
from gpuscaler.model.samples import (
    Absence,
    Snapshot,
)
from gpuscaler.query.query import GpuQuery
from gpuscaler.signals.absences import (
    absences_allowed,
    cannot_hear,
    judge_unreadable,
    left_out_by_node,
    no_gpus,
    parts_left_out,
)
from gpuscaler.signals.gpu_values import contribution_of, select, unreadable_error, utc_clock
from gpuscaler.signals.node_memo import NodeMemo
from gpuscaler.signals.outcome import (
    PART_CONTRIBUTIONS,
    PART_INCLUDED,
    PART_LEFT_OUT,
    Contribution,
    Contributions,
    Evaluation,
    HeldPods,
    ListedContributions,
    NodeContributions,
    NodePart,
    failed,
)
from gpuscaler.signals.pod_evaluation import evaluate_pods
from gpuscaler.signals.source import SnapshotSource


def evaluate(
    query: GpuQuery,
    source: SnapshotSource,
    *,
    now: float,
    stale_after: float,
    directory: PodDirectory | None = None,
    memo: NodeMemo | None = None,
) -> Evaluation:
    """Evaluate ``query`` over ``source`` as of the monotonic time ``now``; ``memo`` keeps nodes' parts."""
    snapshot = source.latest
    if snapshot is None:
        return failed(query, None, Unavailable("no sample yet: the agent has not finished its first poll"))
    cluster = source.cluster
    age = now - snapshot.monotonic
    if age > stale_after:
        # A gateway composes its cluster snapshot on a timer of its own event loop, whatever its agents do (a
        # silent agent is an absence in it): an old one means that loop was kept busy. An agent's is its poll's.
        why = "the gateway's event loop was too busy to compose a newer one" if cluster else "the poll loop is stalled"
        return failed(
            query,
            snapshot,
            Unavailable(
                f"no fresh sample: the newest is {age:.1f}s old (taken {utc_clock(snapshot.taken_at)}), "
                f"older than {stale_after:g}s; {why}"
            ),
        )
    if query.pods is not None:
        return evaluate_pods(query, query.pods, snapshot, source, directory)
    named = _named_parts(query, snapshot, source, memo)
    try:
        selected = select(query.selection, snapshot, cluster=cluster) if named is None else [c.sample for c in named]
    except InvalidMetadata as error:
        if snapshot.absent:  # the GPU may be on a node the gateway cannot hear now
            return failed(query, snapshot, Unavailable(f"{error.message}; {cannot_hear(snapshot.absent, snapshot)}"))
        return failed(query, snapshot, error)
    # Named GPUs were all found on nodes that are heard; all GPUs need every node.
    silent: list[tuple[Absence, HeldPods]] = (
        [(absence, ()) for absence in snapshot.absent] if query.selection.everything else []
    )
    gate = absences_allowed(query, snapshot, silent)
    if isinstance(gate, GpuscalerError):
        return failed(query, snapshot, gate)

    node_parts: list[NodePart] | None = None
    try:
        contributions: Contributions
        if memo is not None and cluster and query.selection.everything:
            # Concatenated in C: a big cluster's parts are thousands of nodes.
            node_parts = memo.parts(query, snapshot.parts, source)
            contributions = NodeContributions(node_parts)
            included = list(itertools.chain.from_iterable(map(PART_INCLUDED, node_parts)))
            left_out = list(itertools.chain.from_iterable(map(PART_LEFT_OUT, node_parts)))
        else:
            contributions = ListedContributions(
                named if named is not None else (contribution_of(query, s, source) for s in selected)
            )
            included = [c.value for c in contributions if c.value is not None]
            left_out = [c for c in contributions if c.value is None]
    except GpuscalerError as error:  # the source cannot tell the window (yet)
        return failed(query, snapshot, error)

    failure: GpuscalerError | None = None
    if not selected:
        failure = Unavailable(no_gpus(snapshot, cluster=cluster))
    elif left_out and not query.selection.everything:
        failure = unreadable_error(query.metric, left_out)  # named GPUs must all be readable
    elif left_out:
        by_node = (
            parts_left_out(snapshot, node_parts)
            if node_parts is not None
            else left_out_by_node(snapshot, contributions, cluster=cluster)
        )
        judged = judge_unreadable(query, snapshot, by_node, len(included), silent, cluster=cluster)
        if isinstance(judged, GpuscalerError):
            failure = judged
        elif judged is not None:
            gate = judged
    if failure is None and not included:
        failure = unreadable_error(query.metric, left_out)
    value = None if failure is not None else aggregate(query.aggregation, included)
    return Evaluation(query, contributions, value, failure, snapshot, absent=gate)


def _named_parts(
    query: GpuQuery, snapshot: Snapshot, source: SnapshotSource, memo: NodeMemo | None
) -> tuple[Contribution, ...] | None:
    """A cluster query's GPUs named by UUID, found node by node in ``memo``; None when there is no memo, or
    when a GPU is missing or its window unknown (``select`` and ``contribution_of`` say why).

    A gateway composes thousands of nodes many times a second, and a query names a GPU or a few: only the
    nodes that sent are looked at, by their UUID column, and only the named GPUs' records are made.
    """
    named = query.selection.uuids
    if memo is None or not source.cluster or named is None:
        return None
    try:
        parts = memo.parts(query, snapshot.parts, source)
    except GpuscalerError:
        return None
    # Concatenated in C: a named part's contributions are made with it, and most parts have none.
    found = tuple(itertools.chain.from_iterable(map(PART_CONTRIBUTIONS, parts)))
    return found if len({c.sample.gpu.uuid.lower() for c in found}) == len(named) else None
