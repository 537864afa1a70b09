"""Evaluating a query over the history: per-GPU values, the aggregate, or the error KEDA must get.

Naming GPUs by index or UUID requires every one of them. Selecting all GPUs (or pods) leaves out those
whose value cannot be read only while they are within ``maxUnreadable``, and says why; a node none of whose
selected GPUs can be read is unknown, like a silent node (``_judge_unreadable``). No readable GPU at all is
an error, never a 0, because a 0 scales in.

A query that selects pods groups the GPUs by the pods that hold them (the kubelet's assignment):
each pod reduces its GPUs with the pod aggregation, then the pods combine with the aggregation. A
selection that no pod matches is a true 0 (the workload holds no GPU: scaled to zero), but only when
every node's attribution is working; otherwise the query fails and says which node and why.
"""

from __future__ import annotations

import datetime
import fnmatch
import itertools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from itertools import repeat
from operator import attrgetter, is_not
from typing import NamedTuple, cast

from gpuscaler.model.aggregation import aggregate
from gpuscaler.model.errors import GpuscalerError, InvalidMetadata, Unavailable, Unsupported
from gpuscaler.model.gpu_metrics import METRICS, Metric
from gpuscaler.model.pods import PodDirectory, uid_key
from gpuscaler.model.samples import (
    Absence,
    AttributionState,
    Chained,
    GpuKey,
    GpuSample,
    ReadError,
    ReadErrorKind,
    Snapshot,
    Windowed,
    gpu_keys,
    metric_column,
    uuids,
)
from gpuscaler.query.query import DEFAULT_MAX_UNREADABLE, GpuSelection, PodSelection, ValueQuery
from gpuscaler.query.scale_targets import resolve as resolve_scale_target
from gpuscaler.signals.shares import Share, pod_share, share_basis
from gpuscaler.signals.source import SnapshotSource

HeldPods = tuple[tuple[str, str], ...]  # (namespace, pod) of a selection that an absent node held


class Contribution(NamedTuple):
    """One GPU's part in an evaluation: its windowed value, or why it was left out.

    In a query that selects pods, a GPU counts once for each selected pod that holds it (``pod``). A named
    tuple: a gateway makes tens of thousands a second.
    """

    sample: GpuSample
    value: float | None
    samples: int
    reason: str | None = None
    error: ReadError | None = None
    pod: tuple[str, str] | None = None  # (namespace, pod)
    share: str | None = None  # in a pod query: the whole GPU's value or the pod's own share, in words


@dataclass(frozen=True, slots=True)
class PodValue:
    """One selected pod (replica): its GPUs reduced by the pod aggregation, or why it was left out."""

    namespace: str
    pod: str
    node: str
    workload: str | None
    value: float | None
    gpus: int
    reason: str | None = None


@dataclass(frozen=True, slots=True)
class Evaluation:
    """The outcome of one query: ``value`` or ``error`` is set, never both."""

    query: ValueQuery
    contributions: Sequence[Contribution]
    value: float | None
    error: GpuscalerError | None
    snapshot: Snapshot | None
    pods: tuple[PodValue, ...] = ()
    # Nodes the value left out because minNodes allowed it (without minNodes, an absent node is an error): silent
    # or unheard ones, and heard ones none of whose selected GPUs can be read (``Absence.heard``).
    absent: tuple[Absence, ...] = ()
    # The selection as evaluated, where it differs from the query's words (scaleTargetPods resolved to a workload).
    selection: str | None = None

    def value_or_raise(self) -> float:
        if self.error is not None:
            raise self.error
        assert self.value is not None
        return self.value

    @property
    def unread(self) -> list[Contribution]:
        """The GPUs whose value could not be read: left out, or the reason for the error."""
        if isinstance(self.contributions, NodeContributions):
            return self.contributions.unread()
        return [c for c in self.contributions if c.value is None]

    @property
    def nodes(self) -> int:
        """Nodes whose GPUs went into the value."""
        if isinstance(self.contributions, NodeContributions):
            return self.contributions.nodes()
        return len({c.sample.node for c in self.contributions if c.value is not None})

    def gpu_keys(self) -> Iterable[GpuKey]:
        """Each contribution's GPU as (node, UUID); a cluster's all-GPU answer names them from its nodes' UUID
        columns, without making the records."""
        snapshot = self.snapshot
        if isinstance(self.contributions, NodeContributions) and snapshot is not None:
            return itertools.chain.from_iterable(
                zip(repeat(part.node), uuids(part.samples), strict=False) for part in snapshot.parts
            )
        return gpu_keys(c.sample for c in self.contributions)


class NodePart:
    """One node's GPUs in an all-GPU query: the readable values and the rest apart, and every contribution.

    On the common path the values come from columns of the node's samples, and the contributions (which
    hold each GPU's record) are made only when something reads them: Explain, not KEDA's polls.
    """

    __slots__ = ("_contributions", "_make", "included", "left_out")

    def __init__(
        self,
        included: tuple[float, ...],
        left_out: tuple[Contribution, ...],
        contributions: tuple[Contribution, ...] | None = None,
        make: Callable[[], tuple[Contribution, ...]] | None = None,
    ) -> None:
        self.included = included
        self.left_out = left_out
        self._contributions = contributions
        self._make = make

    @classmethod
    def of(cls, contributions: tuple[Contribution, ...]) -> NodePart:
        """The part that ``contributions`` make."""
        return cls(
            tuple(c.value for c in contributions if c.value is not None),
            tuple(c for c in contributions if c.value is None),
            contributions,
        )

    @property
    def contributions(self) -> tuple[Contribution, ...]:
        if self._contributions is None:
            assert self._make is not None
            self._contributions, self._make = self._make(), None
        return self._contributions


EMPTY_PART = NodePart((), (), ())
_CONTRIBUTIONS, _INCLUDED, _LEFT_OUT = attrgetter("contributions"), attrgetter("included"), attrgetter("left_out")
_NODE = attrgetter("node")
_MADE = attrgetter("_contributions")  # a part whose contributions were made with it (not on demand)


class NodeContributions(Chained[Contribution]):
    """A cluster evaluation's contributions, node after node, made when first read (Explain reads them)."""

    __slots__ = ()

    def __init__(self, parts: Sequence[NodePart]) -> None:
        super().__init__(parts, _CONTRIBUTIONS)

    def __len__(self) -> int:
        """Counted from each part's values and left-out GPUs, without making the contributions."""
        return sum(map(len, map(_INCLUDED, self._parts))) + sum(map(len, map(_LEFT_OUT, self._parts)))

    def unread(self) -> list[Contribution]:
        """The GPUs left out, without making the others' contributions."""
        return list(itertools.chain.from_iterable(map(_LEFT_OUT, self._parts)))

    def nodes(self) -> int:
        """Nodes (parts) with a GPU in the value."""
        return sum(map(bool, map(_INCLUDED, self._parts)))


class NodeMemo:
    """Each node's contributions to each all-GPU query, kept while the node's snapshot is the same object.

    A gateway composes the cluster many times a second, and most nodes have not sent anything new since the
    last composition: their GPUs' contributions are the ones computed then. Contributions depend only on
    the query and the node's snapshot (its readings and the windows its agent reduced), so they are reused
    exactly, and the answer is the one a fresh evaluation gives.
    """

    def __init__(self) -> None:
        self._by_query: dict[ValueQuery, dict[str, tuple[Snapshot, NodePart]]] = {}
        # Each query's last parts and what they gave: the next composition differs in the nodes that sent.
        self._previous: dict[ValueQuery, tuple[Sequence[Snapshot], list[NodePart]]] = {}

    def contributions(self, query: ValueQuery, part: Snapshot, source: SnapshotSource) -> NodePart:
        """``part``'s GPUs in ``query``; raises as ``_contribution`` does (and keeps nothing then)."""
        return self.parts(query, (part,), source)[0]

    def parts(self, query: ValueQuery, parts: Sequence[Snapshot], source: SnapshotSource) -> list[NodePart]:
        """Each of ``parts`` in ``query``, in order.

        A cluster's parts are thousands of nodes, and between two compositions only those that sent something
        differ: they are found in C (by identity against the last parts), and only they are looked at.
        """
        nodes = self._by_query.get(query)
        if nodes is None:
            nodes = self._by_query[query] = {}
        previous = self._previous.get(query)
        found: list[NodePart]
        if previous is not None and len(previous[0]) == len(parts):
            found = previous[1].copy()
            changed: Iterable[int] = itertools.compress(range(len(parts)), map(is_not, parts, previous[0]))
        else:
            found = [EMPTY_PART] * len(parts)
            changed = range(len(parts))
        for index in changed:
            part = parts[index]
            kept = nodes.get(part.node)
            if kept is None or kept[0] is not part:
                kept = nodes[part.node] = (part, _node_part(query, part, source))
            found[index] = kept[1]
        self._previous[query] = (parts, found)
        return found

    def keep_only(self, queries: Iterable[ValueQuery], parts: Sequence[Snapshot]) -> None:
        """Forget queries no longer asked, and nodes not among ``parts`` (once per composition: in C).

        Most compositions have the same nodes as the last, and a query that holds no more nodes than there
        are parts is not searched: what it keeps of a node that left goes once it holds more. Keeping it a
        while changes no answer: a node's part is reused only for the very snapshot it was made from.
        """
        wanted = set(queries)
        for query in [q for q in self._by_query if q not in wanted]:
            del self._by_query[query]
            self._previous.pop(query, None)
        listed: set[str] | None = None
        for query, by_node in self._by_query.items():
            if len(by_node) <= len(parts):
                continue
            if listed is None:
                listed = set(map(_NODE, parts))
            gone = by_node.keys() - listed
            if gone:
                self._previous.pop(query, None)
            for node in gone:
                del by_node[node]


def _node_part(query: ValueQuery, part: Snapshot, source: SnapshotSource) -> NodePart:
    if query.selection.uuids is not None:  # a few named GPUs: their records only, made at once
        return NodePart.of(tuple(_contribution(query, sample, source) for sample in _named(query.selection, part)))
    fast = _from_columns(query, part, source)
    if fast is not None:
        return fast
    return NodePart.of(tuple(_contribution(query, sample, source) for sample in part.samples))


def _from_columns(query: ValueQuery, part: Snapshot, source: SnapshotSource) -> NodePart | None:
    """The common cases made cheap: a metric now, or a reading over a window, readable on every GPU of the node.

    Its values come from the node's columns, and its contributions, made on demand, are the ones
    ``_contribution`` makes (tests/signals/test_node_memo.py compares them); None for every other case.
    """
    info = METRICS[query.metric]
    if info.rate:
        return None
    samples = part.samples
    now = metric_column(samples, query.metric)
    if None in now:
        return None
    window = query.window
    if window is None:
        values = tuple(cast(list[float], now))
        return NodePart(values, (), make=lambda: tuple(map(Contribution, samples, values, repeat(1, len(values)))))
    over, counts = source.window_column(part, window)
    if None in over:
        return None
    reduced = tuple(cast(list[float], over))
    return NodePart(reduced, (), make=lambda: tuple(map(Contribution, samples, reduced, counts)))


def evaluate(
    query: ValueQuery,
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
        return _failed(query, None, Unavailable("no sample yet: the agent has not finished its first poll"))
    age = now - snapshot.monotonic
    if age > stale_after:
        return _failed(
            query,
            snapshot,
            Unavailable(
                f"no fresh sample: the newest is {age:.1f}s old (taken {_clock(snapshot.taken_at)}), "
                f"older than {stale_after:g}s; the poll loop is stalled"
            ),
        )
    if query.pods is not None:
        return _evaluate_pods(query, query.pods, snapshot, source, directory)
    named = _named_parts(query, snapshot, source, memo)
    try:
        selected = select(query.selection, snapshot) if named is None else [c.sample for c in named]
    except InvalidMetadata as error:
        if snapshot.absent:  # the GPU may be on a node the gateway cannot hear now
            return _failed(query, snapshot, Unavailable(f"{error.message}; {_cannot_hear(snapshot.absent, snapshot)}"))
        return _failed(query, snapshot, error)
    # Named GPUs were all found on nodes that are heard; all GPUs need every node.
    silent: list[tuple[Absence, HeldPods]] = (
        [(absence, ()) for absence in snapshot.absent] if query.selection.everything else []
    )
    gate = _gate(query, snapshot, silent)
    if isinstance(gate, GpuscalerError):
        return _failed(query, snapshot, gate)

    node_parts: list[NodePart] | None = None
    try:
        contributions: Sequence[Contribution]
        if memo is not None and snapshot.cluster and query.selection.everything:
            # Concatenated in C: a big cluster's parts are thousands of nodes.
            node_parts = memo.parts(query, snapshot.parts, source)
            contributions = NodeContributions(node_parts)
            included = list(itertools.chain.from_iterable(map(_INCLUDED, node_parts)))
            left_out = list(itertools.chain.from_iterable(map(_LEFT_OUT, node_parts)))
        else:
            contributions = named if named is not None else tuple(_contribution(query, s, source) for s in selected)
            included = [c.value for c in contributions if c.value is not None]
            left_out = [c for c in contributions if c.value is None]
    except GpuscalerError as error:  # the source cannot tell the window (yet)
        return _failed(query, snapshot, error)

    failure: GpuscalerError | None = None
    if not selected:
        failure = Unavailable(_no_gpus(snapshot))
    elif left_out and not query.selection.everything:
        failure = _unreadable(query.metric, left_out)  # named GPUs must all be readable
    elif left_out:
        by_node = (
            _parts_left_out(snapshot, node_parts)
            if node_parts is not None
            else _left_out_by_node(snapshot, contributions)
        )
        judged = _judge_unreadable(query, snapshot, by_node, len(included), silent)
        if isinstance(judged, GpuscalerError):
            failure = judged
        elif judged is not None:
            gate = judged
    if failure is None and not included:
        failure = _unreadable(query.metric, left_out)
    value = None if failure is not None else aggregate(query.aggregation, included)
    return Evaluation(query, contributions, value, failure, snapshot, absent=gate)


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


def _parts_left_out(snapshot: Snapshot, node_parts: Sequence[NodePart]) -> list[NodeLeftOut]:
    """The nodes of a cluster evaluation that left something out: found in C, as most nodes leave out nothing."""
    parts = snapshot.parts
    return [
        NodeLeftOut(parts[index].node, parts[index], len(node_parts[index].included), node_parts[index].left_out)
        for index in itertools.compress(range(len(node_parts)), map(_LEFT_OUT, node_parts))
    ]


def _left_out_by_node(snapshot: Snapshot, contributions: Iterable[Contribution]) -> list[NodeLeftOut]:
    """The nodes whose contributions leave something out, in order, with how many of theirs were read."""
    readable: dict[str, int] = {}
    left: dict[str, list[Contribution]] = {}
    for contribution in contributions:
        node = contribution.sample.node
        if contribution.value is None:
            left.setdefault(node, []).append(contribution)
        else:
            readable[node] = readable.get(node, 0) + 1
    parts = {part.node: part for part in snapshot.parts} if snapshot.cluster else {}
    return [NodeLeftOut(node, parts.get(node), readable.get(node, 0), gpus) for node, gpus in left.items()]


def _judge_unreadable(
    query: ValueQuery,
    snapshot: Snapshot,
    by_node: Sequence[NodeLeftOut],
    readable: int,
    silent: Sequence[tuple[Absence, HeldPods]],
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
        if not snapshot.cluster:
            return _unreadable(query.metric, unreadable[0].left_out)
        absences = [(_unreadable_node(node, snapshot), _holding(node.left_out)) for node in unreadable]
        judged = _gate(query, snapshot, [*silent, *absences], heard=len(snapshot.nodes) - len(unreadable))
        if isinstance(judged, GpuscalerError):
            return judged
        gate = judged
    if left_out:
        total = readable + len(left_out)
        allowed = query.max_unreadable.allowed(total)
        if len(left_out) > allowed:
            return _too_many_unreadable(query, snapshot, left_out, total, allowed)
    return gate


def _unreadable_node(node: NodeLeftOut, snapshot: Snapshot) -> Absence:
    gpus = list({c.sample.gpu.uuid: c for c in node.left_out}.values())  # a GPU two selected pods hold, once
    details = "; ".join(f"GPU {c.sample.gpu.index} ({c.sample.gpu.uuid}): {c.reason}" for c in gpus[:MAX_GPUS_NAMED])
    if len(gpus) > MAX_GPUS_NAMED:
        details += f"; and {len(gpus) - MAX_GPUS_NAMED} more"
    reason = f"none of its {len(gpus)} selected GPU(s) can be read ({details})"
    since = node.part.taken_at if node.part is not None else snapshot.taken_at
    return Absence("", node.node, since, reason, last=node.part, heard=True)


def _holding(left_out: Iterable[Contribution]) -> HeldPods:
    """The selected pods whose GPUs these are (none in an all-GPU query)."""
    return tuple(sorted({c.pod for c in left_out if c.pod is not None}))


def _too_many_unreadable(
    query: ValueQuery, snapshot: Snapshot, left_out: Sequence[Contribution], total: int, allowed: int
) -> GpuscalerError:
    where = snapshot.cluster
    details = "; ".join(
        f"GPU {c.sample.gpu.index} ({c.sample.gpu.uuid}){f' on {c.sample.node}' if where else ''}: {c.reason}"
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


def _named_parts(
    query: ValueQuery, snapshot: Snapshot, source: SnapshotSource, memo: NodeMemo | None
) -> tuple[Contribution, ...] | None:
    """A cluster query's GPUs named by UUID, found node by node in ``memo``; None when there is no memo, or
    when a GPU is missing or its window unknown (``select`` and ``_contribution`` say why).

    A gateway composes thousands of nodes many times a second, and a query names a GPU or a few: only the
    nodes that sent are looked at, by their UUID column, and only the named GPUs' records are made.
    """
    named = query.selection.uuids
    if memo is None or not snapshot.cluster or named is None:
        return None
    try:
        parts = memo.parts(query, snapshot.parts, source)
    except GpuscalerError:
        return None
    # Concatenated in C: a named part's contributions are made with it, and most parts have none.
    found = tuple(itertools.chain.from_iterable(map(_MADE, parts)))
    return found if len({c.sample.gpu.uuid.lower() for c in found}) == len(named) else None


def _named(selection: GpuSelection, snapshot: Snapshot) -> list[GpuSample]:
    """The snapshot's samples whose UUID ``selection`` names, in order; found by the UUID column, so the
    other GPUs' records are not made."""
    wanted = {uuid.lower() for uuid in selection.uuids or ()}
    chosen: list[GpuSample] = []
    for node in snapshot.nodes:
        samples = node.samples
        names = uuids(samples)
        if wanted.isdisjoint(map(str.lower, names)):  # in C: most nodes hold none of them
            continue
        chosen.extend(samples[index] for index, uuid in enumerate(names) if uuid.lower() in wanted)
    return chosen


def select(selection: GpuSelection, snapshot: Snapshot) -> Sequence[GpuSample]:
    """The snapshot's samples that ``selection`` names; naming a GPU the node lacks is InvalidMetadata."""
    samples = snapshot.samples
    if selection.indices is not None:
        present = sorted({sample.gpu.index for sample in samples})
        missing = [index for index in selection.indices if index not in present]
        if missing:
            raise InvalidMetadata(
                f"gpuIndex {','.join(map(str, missing))} is not on {_where(snapshot)}; "
                f"its GPUs: {_listing(map(str, present))}"
            )
        return [sample for sample in samples if sample.gpu.index in selection.indices]
    if selection.uuids is not None:
        chosen = _named(selection, snapshot)
        present_uuids = {sample.gpu.uuid.lower() for sample in chosen}
        missing_uuids = [uuid for uuid in selection.uuids if uuid.lower() not in present_uuids]
        if missing_uuids:
            raise InvalidMetadata(
                f"gpuUUID {','.join(missing_uuids)} is not on {_where(snapshot)}; "
                f"its GPUs: {_listing(itertools.chain.from_iterable(uuids(node.samples) for node in snapshot.nodes))}"
            )
        return chosen
    return samples


MAX_ABSENCES_NAMED = 5
MAX_GPUS_NAMED = 5


def _gate(
    query: ValueQuery, snapshot: Snapshot, relevant: Sequence[tuple[Absence, HeldPods]], heard: int | None = None
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
            clause += f", and it {'holds' if absence.heard else 'held'} {_listing(f'{ns}/{name}' for ns, name in held)}"
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


def _cannot_hear(absent: Sequence[Absence], snapshot: Snapshot) -> str:
    named = "; ".join(absence.describe(snapshot.taken_at) for absence in absent[:MAX_ABSENCES_NAMED])
    more = f"; and {len(absent) - MAX_ABSENCES_NAMED} more" if len(absent) > MAX_ABSENCES_NAMED else ""
    return f"it may be on a node that cannot be heard now: {named}{more}"


def _pod_absences(
    pods: PodSelection, snapshot: Snapshot, directory: PodDirectory | None
) -> list[tuple[Absence, HeldPods]]:
    """The absent nodes that may hold GPUs of the selected pods, with the pods each is known to hold.

    A silent node's share leaves only when the pods it held are known to be gone: deleted, or running
    on another node (the pod directory says so). An agent whose node is not known may hold any pod
    the directory cannot place on a node that is heard.
    """
    relevant: list[tuple[Absence, HeldPods]] = []
    unplaced: bool | None = None
    for absence in snapshot.absent:
        if absence.last is not None:
            held = sorted(
                {
                    (ref.namespace, ref.pod)
                    for sample in absence.last.samples
                    for ref in sample.pods
                    if _pod_matches(pods, (ref.namespace, ref.pod), directory)
                    and not _gone(ref.namespace, ref.pod, absence.node, directory)
                }
            )
            if held:
                relevant.append((absence, tuple(held)))
            continue
        if unplaced is None:
            unplaced = _may_be_unplaced(pods, snapshot, directory)
        if unplaced:
            relevant.append((absence, ()))
    return relevant


def _gone(namespace: str, pod: str, node: str | None, directory: PodDirectory | None) -> bool:
    """Whether the directory knows that ``pod`` no longer runs on ``node``: deleted, or (re)placed elsewhere."""
    if directory is None or directory.problem() is not None:
        return False
    info = directory.lookup(namespace, pod)
    return info is None or (info.node is not None and info.node != node)


def _may_be_unplaced(pods: PodSelection, snapshot: Snapshot, directory: PodDirectory | None) -> bool:
    """Whether a selected pod that may hold a GPU runs somewhere the view has no snapshot of."""
    if directory is None or directory.problem() is not None:
        return True
    known = {part.node for part in snapshot.nodes} | {a.node for a in snapshot.absent if a.node is not None}
    for info in directory.pods(pods.namespace):
        if info.holds_gpus is False or not _pod_matches(pods, (info.namespace, info.pod), directory):
            continue
        if info.node is None or info.node not in known:
            return True
    return False


def _evaluate_pods(
    query: ValueQuery,
    pods: PodSelection,
    snapshot: Snapshot,
    source: SnapshotSource,
    directory: PodDirectory | None,
) -> Evaluation:
    if pods.scale_target is not None:  # scaleTargetPods: the ScaledObject's target, as a workload selection
        resolved = resolve_scale_target(pods, directory)
        if isinstance(resolved, GpuscalerError):
            return _failed(query, snapshot, resolved)
        pods = resolved
    if snapshot.cluster and not snapshot.parts:
        # A gateway that hears from no node knows nothing about the workload: not zero, not unsupported.
        return _failed(query, snapshot, Unavailable(_no_gpus(snapshot)))
    failure = _attribution_failure(pods, snapshot, directory)
    if failure is not None:
        return _failed(query, snapshot, failure)
    silent = _pod_absences(pods, snapshot, directory)
    gate = _gate(query, snapshot, silent)
    if isinstance(gate, GpuscalerError):
        return _failed(query, snapshot, gate)

    groups: dict[tuple[str, str], list[GpuSample]] = {}
    matched: dict[tuple[str, str], bool] = {}
    for sample in snapshot.samples:
        seen: set[tuple[str, str]] = set()
        for ref in sample.pods:
            key = (ref.namespace, ref.pod)
            if key in seen:
                continue  # two containers of one pod on one GPU: the GPU counts once for the pod
            seen.add(key)
            if key not in matched:
                matched[key] = _pod_matches(pods, key, directory)
            if matched[key]:
                groups.setdefault(key, []).append(sample)

    contributions: list[Contribution] = []
    values: list[PodValue] = []
    for key, samples in sorted(groups.items()):
        info = directory.lookup(*key) if directory is not None else None
        try:
            own = [
                _contribution(query, sample, source, pod=key, share=share_basis(sample, query.metric, info))
                for sample in samples
            ]
        except GpuscalerError as unknown:  # the source cannot tell the window (yet)
            return _failed(query, snapshot, unknown)
        contributions.extend(own)
        readable = [c.value for c in own if c.value is not None]
        nodes = sorted({sample.node for sample in samples})
        values.append(
            PodValue(
                namespace=key[0],
                pod=key[1],
                node=",".join(nodes),
                workload=info.workload if info is not None else None,
                value=aggregate(pods.pod_aggregation, readable) if readable else None,
                gpus=len(samples),
                reason=None if readable else f"none of its {len(samples)} GPU(s) could be read",
            )
        )

    included = [p.value for p in values if p.value is not None]
    error: GpuscalerError | None = None
    value: float | None
    if not values and not snapshot.cluster:
        # One node's agent cannot tell a workload at zero from one whose pods run on other nodes;
        # answering 0 would scale it in. Only the gateway's cluster view can say "zero".
        value, error = (
            None,
            Unsupported(
                f"no pod of {pods.describe()} holds a GPU on node {snapshot.node!r}, and a node agent sees only "
                "its own node; point scalerAddress at the gateway for workload queries"
            ),
        )
    elif not values:
        value = 0.0  # no selected pod holds a GPU on any node, and no node that cannot be heard may hold one
    else:
        value = None
        left_out = [c for c in contributions if c.value is None]
        judged = (
            _judge_unreadable(
                query, snapshot, _left_out_by_node(snapshot, contributions), len(contributions) - len(left_out), silent
            )
            if left_out
            else None
        )
        if isinstance(judged, GpuscalerError):
            error = judged
        else:
            gate = judged if judged is not None else gate
            # minNodes left out these nodes, whose selected GPUs none can be read: as if they were silent.
            gone = {absence.node for absence in gate if absence.heard}
            if included:
                value = aggregate(query.aggregation, included)
            elif all(p.node in gone for p in values):
                value = 0.0  # every selected pod is on a node minNodes lets the answer leave out
            else:
                error = _unreadable(query.metric, left_out)
    return Evaluation(
        query, tuple(contributions), value, error, snapshot, tuple(values), absent=gate, selection=pods.describe()
    )


def _attribution_failure(
    pods: PodSelection, snapshot: Snapshot, directory: PodDirectory | None
) -> GpuscalerError | None:
    for part in snapshot.nodes:
        if part.attribution.state is AttributionState.OFF:
            return Unsupported(
                f"{pods.describe()} needs to know which pods hold which GPUs, and node {part.node!r} "
                f"does not: {part.attribution.detail}"
            )
        if part.attribution.state is AttributionState.UNAVAILABLE:
            return Unavailable(
                f"{pods.describe()} needs to know which pods hold which GPUs, and node {part.node!r} "
                f"cannot tell now: {part.attribution.detail}"
            )
    if pods.needs_directory:
        if directory is None:
            return Unsupported(
                f"{pods.describe()} needs pod labels and owners, and this server has no pod directory; "
                "ask the gateway (started with --pod-directory), or select by pod name"
            )
        problem = directory.problem()
        if problem is not None:
            return Unavailable(f"{pods.describe()} needs pod labels and owners: {problem}")
    return None


def _pod_matches(pods: PodSelection, key: tuple[str, str], directory: PodDirectory | None) -> bool:
    namespace, name = key
    if namespace != pods.namespace:
        return False
    if pods.pod is not None and not fnmatch.fnmatchcase(name, pods.pod):
        return False
    if not pods.needs_directory:
        return True
    info = directory.lookup(namespace, name) if directory is not None else None
    if info is None:
        return False  # a pod the directory has not seen yet: it joins at the next evaluation
    if pods.workload is not None and info.workload != pods.workload:
        return False
    if pods.workload_kind is not None and info.workload_kind != pods.workload_kind:
        return False
    return pods.labels is None or pods.labels.matches(info.labels)


def _contribution(
    query: ValueQuery,
    sample: GpuSample,
    source: SnapshotSource,
    pod: tuple[str, str] | None = None,
    share: Share | None = None,
) -> Contribution:
    """``sample``'s GPU in the query: its latest value, or its value over the window (a rate always has one);
    raises Unavailable when the source cannot tell the window yet. ``share`` says whether a pod reads its own
    processes' share of the GPU or the whole GPU."""
    basis = share.basis if share is not None else None
    own_uid = share.pod_uid if share is not None else None
    info = METRICS[query.metric]
    latest: float | None = None
    if info.rate:  # no value in one sample: its window (at least the newest two samples) has it
        readable = getattr(sample, info.reading) is not None
    else:
        latest = sample.value(query.metric) if own_uid is None else pod_share(sample, query.metric, own_uid)
        readable = latest is not None
    if not readable:
        error = sample.error_for(query.metric)
        reason = _reason(query.metric, error)
        if error is not None and error.kind is not ReadErrorKind.NOT_SUPPORTED:
            last = "never since its agent started" if error.last_read_at is None else _clock(error.last_read_at)
            reason += f"; last read {last}"
        return Contribution(sample, None, 0, reason, error, pod, share=basis)
    window = query.window
    if window is None:
        return Contribution(sample, latest, 1, pod=pod, share=basis)
    windowed = source.windowed(sample, window)
    if own_uid is not None:
        windowed = windowed.shares.get(uid_key(own_uid), Windowed(None, 0))
    if windowed.value is None:
        reason = windowed.reason or f"no readable {query.metric.value} in {window.describe_span()}"
        return Contribution(sample, None, 0, reason, pod=pod, share=basis)
    return Contribution(sample, windowed.value, windowed.samples, pod=pod, share=basis)


def _reason(metric: Metric, error: ReadError | None) -> str:
    if error is None:
        return f"{metric.value} was not read"
    return f"{error.kind.value}: {error.detail}"


def _unreadable(metric: Metric, left_out: Sequence[Contribution]) -> GpuscalerError:
    details = "; ".join(f"GPU {c.sample.gpu.index} ({c.sample.gpu.uuid}): {c.reason}" for c in left_out)
    message = f"{metric.value} cannot be read on {details}"
    if all(c.error is not None and c.error.kind is ReadErrorKind.NOT_SUPPORTED for c in left_out):
        return Unsupported(message)
    return Unavailable(message)


def _no_gpus(snapshot: Snapshot) -> str:
    if not snapshot.cluster:
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


def _where(snapshot: Snapshot) -> str:
    if not snapshot.cluster:
        return f"node {snapshot.node!r}"
    return f"any of the {len(snapshot.parts)} fresh nodes"


def _failed(query: ValueQuery, snapshot: Snapshot | None, error: GpuscalerError) -> Evaluation:
    return Evaluation(query, (), None, error, snapshot)


def _clock(unix_seconds: float) -> str:
    return datetime.datetime.fromtimestamp(unix_seconds, datetime.UTC).isoformat(timespec="milliseconds")


MAX_LISTED = 20  # a cluster has thousands of GPUs: an error names the first few and counts the rest


def _listing(items: Iterable[str]) -> str:
    listed = list(items)
    if not listed:
        return "none"
    if len(listed) > MAX_LISTED:
        return f"{', '.join(listed[:MAX_LISTED])} and {len(listed) - MAX_LISTED} more"
    return ", ".join(listed)
