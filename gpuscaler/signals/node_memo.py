"""A gateway's evaluations, node by node: each node's part kept while its snapshot is the same object."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from itertools import repeat
from operator import attrgetter, is_not
from typing import cast

from gpuscaler.model.columns import metric_column
from gpuscaler.model.gpu_metrics import METRICS
from gpuscaler.model.samples import Snapshot
from gpuscaler.query.query import GpuQuery
from gpuscaler.signals.gpu_values import contribution_of, named_samples
from gpuscaler.signals.outcome import EMPTY_PART, Contribution, NodePart
from gpuscaler.signals.source import SnapshotSource

_NODE = attrgetter("node")


class NodeMemo:
    """Each node's contributions to each all-GPU query, kept while the node's snapshot is the same object.

    A gateway composes the cluster many times a second, and most nodes have not sent anything new since the
    last composition: their GPUs' contributions are the ones computed then. Contributions depend only on
    the query and the node's snapshot (its readings and the windows its agent reduced), so they are reused
    exactly, and the answer is the one a fresh evaluation gives.

    The evaluator keeps the queries the last composition evaluated (``keep_only``): the open push streams'
    every time. A polled query comes back a KEDA poll later (30 s by default), when every node has sent anew
    and no part kept for it could be reused, so it is evaluated afresh and nothing is held for it meanwhile.
    """

    def __init__(self, *, keeps: bool = True) -> None:
        """``keeps``: False for ``for_read``'s view, which keeps nothing it makes."""
        self._by_query: dict[GpuQuery, dict[str, tuple[Snapshot, NodePart]]] = {}
        # Each query's last parts and what they gave: the next composition differs in the nodes that sent.
        self._previous: dict[GpuQuery, tuple[Sequence[Snapshot], list[NodePart]]] = {}
        self._keeps = keeps

    def for_read(self) -> NodeMemo:
        """This memo as a read path uses it (Explain, a preview): the parts kept are reused, and what it makes
        is its own answer's only, never kept, so a read changes neither what is kept nor which queries are."""
        view = NodeMemo(keeps=False)
        view._by_query, view._previous = self._by_query, self._previous
        return view

    def kept(self) -> dict[GpuQuery, frozenset[str]]:
        """The queries kept, each with the nodes whose parts are kept (a copy: to compare, not to change)."""
        return {query: frozenset(nodes) for query, nodes in self._by_query.items()}

    def parts(self, query: GpuQuery, parts: Sequence[Snapshot], source: SnapshotSource) -> list[NodePart]:
        """Each of ``parts`` in ``query``, in order.

        A cluster's parts are thousands of nodes, and between two compositions only those that sent something
        differ: they are found in C (by identity against the last parts), and only they are looked at.
        """
        keeps = self._keeps
        nodes = self._by_query.get(query)
        if nodes is None:
            nodes = {}
            if keeps:
                self._by_query[query] = nodes
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
                kept = (part, node_part(query, part, source))
                if keeps:
                    nodes[part.node] = kept
            found[index] = kept[1]
        if keeps:
            self._previous[query] = (parts, found)
        return found

    def keep_only(self, queries: Iterable[GpuQuery], parts: Sequence[Snapshot]) -> None:
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


def node_part(query: GpuQuery, part: Snapshot, source: SnapshotSource) -> NodePart:
    """``part``'s GPUs in ``query``: named ones' records, else its columns where they serve, else every record."""
    if query.selection.uuids is not None:  # a few named GPUs: their records only, made at once
        named = named_samples(query.selection, part)
        return NodePart.of(tuple(contribution_of(query, sample, source) for sample in named))
    fast = _from_columns(query, part, source)
    if fast is not None:
        return fast
    return NodePart.of(tuple(contribution_of(query, sample, source) for sample in part.samples))


def _from_columns(query: GpuQuery, part: Snapshot, source: SnapshotSource) -> NodePart | None:
    """The common cases made cheap: a metric now, or a reading over a window, readable on every GPU of the node.

    Its values come from the node's columns, and its contributions, made on demand, are the ones
    ``contribution_of`` makes (tests/signals/test_node_memo.py compares them); None for every other case.
    """
    if not METRICS[query.metric].in_one_sample:
        return None
    samples = part.samples
    now = metric_column(samples, query.metric)
    if None in now:
        return None
    window = query.window
    if window is None:
        values = tuple(cast(list[float], now))
        return NodePart(values, (), make=lambda: tuple(map(Contribution, samples, values, repeat(1, len(values)))))
    over, counts, covered = source.window_column(part, window)
    if None in over:
        return None
    reduced = tuple(cast(list[float], over))
    if covered is None:
        return NodePart(reduced, (), make=lambda: tuple(map(Contribution, samples, reduced, counts)))
    # Windows still filling (an agent that restarted): the same values, and the records that say how much each
    # covers made only when read (Explain), not for KEDA's polls, as in a rollout of every node at once.
    return NodePart(
        reduced,
        (),
        make=lambda: tuple(
            Contribution(sample, value, count, covered_seconds=seconds)
            for sample, value, count, seconds in zip(samples, reduced, counts, covered, strict=True)
        ),
        filling=None,
    )
