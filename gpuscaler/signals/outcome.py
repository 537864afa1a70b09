"""What an evaluation answers: each GPU's part, each pod's, the value or the error KEDA must get.

A cluster's all-GPU answer keeps its contributions node by node (``NodeContributions``), made only when read;
any other answer lists them (``ListedContributions``). Both answer the same questions without making records:
which GPUs went unread, how many nodes went in, and which GPUs were read.

An evaluation's value is always a finite number: one that is not (a sum, a rate or a combination that ran past
the largest float) becomes an UNAVAILABLE error as it is made, so no answer carries infinity to KEDA.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import repeat
from operator import attrgetter
from typing import NamedTuple, Protocol

from gpuscaler.model.columns import Chained, uuids
from gpuscaler.model.errors import GpuscalerError, Unavailable
from gpuscaler.model.samples import Absence, GpuKey, GpuSample, ReadError, Snapshot, gpu_keys
from gpuscaler.query.query import PodSelection, ValueSpec

HeldPods = tuple[tuple[str, str], ...]  # (namespace, pod) of a selection that an absent node held


class Contribution(NamedTuple):
    """One GPU's part in an evaluation: its windowed value, or why it was left out.

    In a query that selects pods, a GPU counts once for each selected pod that holds it (``pod``). A named
    tuple: a gateway makes tens of thousands a second.
    """

    sample: GpuSample
    value: float | None
    sample_count: int
    reason: str | None = None
    error: ReadError | None = None
    pod: tuple[str, str] | None = None  # (namespace, pod)
    share: str | None = None  # in a pod query: the whole GPU's value or the pod's own share, in words
    # Seconds of its window its readings cover, where less than all of it (a restarted agent); None: all of it.
    covered_seconds: float | None = None


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
    age_seconds: float | None = None  # engine signals: how old the pod's newest metrics page is
    covered_seconds: float | None = None  # the least its counted GPUs' windows cover, where less than all


class Contributions(Protocol):
    """An evaluation's contributions, GPU after GPU, and what is asked of them without reading them all."""

    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[Contribution]: ...
    def __getitem__(self, index: int) -> Contribution: ...

    def unread(self) -> list[Contribution]:
        """The GPUs whose value could not be read."""
        ...

    def nodes_counted(self) -> int:
        """Nodes with a GPU in the value."""
        ...

    def gpu_keys(self, snapshot: Snapshot | None) -> Iterable[GpuKey]:
        """Each contribution's GPU as (node, UUID), in order."""
        ...

    def filling_windows(self) -> list[Contribution]:
        """The GPUs in the value whose windows are filling: their readings cover less than the window
        (``covered_seconds``)."""
        ...


class ListedContributions(tuple[Contribution, ...]):
    """Contributions made as the answer was: an agent's, a pod query's, named GPUs'."""

    __slots__ = ()

    def unread(self) -> list[Contribution]:
        return [c for c in self if c.value is None]

    def nodes_counted(self) -> int:
        return len({c.sample.node for c in self if c.value is not None})

    def gpu_keys(self, snapshot: Snapshot | None) -> Iterable[GpuKey]:
        return gpu_keys(c.sample for c in self)

    def filling_windows(self) -> list[Contribution]:
        return filling_windows(self)


@dataclass(frozen=True, slots=True)
class Evaluation:
    """The outcome of one query: ``value`` or ``error`` is set, never both."""

    query: ValueSpec
    contributions: Contributions
    value: float | None
    error: GpuscalerError | None
    snapshot: Snapshot | None
    pods: tuple[PodValue, ...] = ()
    # Nodes the value left out because minNodes allowed it (without minNodes, an absent node is an error): silent
    # or unheard ones, and heard ones none of whose selected GPUs can be read (``Absence.heard``).
    absent: tuple[Absence, ...] = ()
    # The selection as evaluated, where it differs from the query's words (scaleTargetPods resolved to a workload).
    selection: str | None = None
    # A combined query's signals, each evaluated on its own, in the query's order.
    parts: tuple[Evaluation, ...] = ()
    # An answer of 0 because no pod of this selection (resolved: scaleTargetPods as its workload) holds a GPU, or for
    # an engine signal because none is selected: a workload at zero, or a selection of nothing (empty_selection.py).
    unmatched: PodSelection | None = None

    def __post_init__(self) -> None:
        if self.value is not None and not math.isfinite(self.value):
            # Where a source can give a value past the float range, its own check names it (engines/values.py);
            # this is the last line, for any that has none.
            error = Unavailable(f"the value is {self.value}, not a number: a sum or a rate of the inputs overflowed")
            object.__setattr__(self, "value", None)
            object.__setattr__(self, "error", error)

    def value_or_raise(self) -> float:
        if self.error is not None:
            raise self.error
        assert self.value is not None
        return self.value

    @property
    def unread(self) -> list[Contribution]:
        """The GPUs whose value could not be read: left out, or the reason for the error."""
        return self.contributions.unread()

    @property
    def nodes_counted(self) -> int:
        """Nodes whose GPUs went into the value."""
        return self.contributions.nodes_counted()

    def gpu_keys(self) -> Iterable[GpuKey]:
        """Each contribution's GPU as (node, UUID); a cluster's all-GPU answer names them from its nodes' UUID
        columns, without making the records."""
        return self.contributions.gpu_keys(self.snapshot)

    def filling_windows(self) -> list[Contribution]:
        """The GPUs in the value whose windows are filling, a combined query's too."""
        return [*self.contributions.filling_windows(), *(c for part in self.parts for c in part.filling_windows())]


class NodePart:
    """One node's GPUs in an all-GPU query: the readable values and the rest apart, and every contribution.

    On the common path the values come from columns of the node's samples, and the contributions (which
    hold each GPU's record) are made only when something reads them: Explain, not KEDA's polls.
    """

    __slots__ = ("_contributions", "_filling", "_make", "included", "left_out")

    def __init__(
        self,
        included: tuple[float, ...],
        left_out: tuple[Contribution, ...],
        contributions: tuple[Contribution, ...] | None = None,
        make: Callable[[], tuple[Contribution, ...]] | None = None,
        filling: tuple[Contribution, ...] | None = (),
    ) -> None:
        self.included = included
        self.left_out = left_out
        self._filling = filling  # None: found among the contributions when first read
        self._contributions = contributions
        self._make = make

    @classmethod
    def of(cls, contributions: tuple[Contribution, ...]) -> NodePart:
        """The part that ``contributions`` make."""
        return cls(
            tuple(c.value for c in contributions if c.value is not None),
            tuple(c for c in contributions if c.value is None),
            contributions,
            filling=tuple(filling_windows(contributions)),
        )

    @property
    def contributions(self) -> tuple[Contribution, ...]:
        if self._contributions is None:
            assert self._make is not None
            self._contributions, self._make = self._make(), None
        return self._contributions

    @property
    def filling(self) -> tuple[Contribution, ...]:
        """Its GPUs in the value whose windows are filling (``filling_windows``)."""
        if self._filling is None:
            self._filling = tuple(filling_windows(self.contributions))
        return self._filling


EMPTY_PART = NodePart((), (), ())


# A part's fields, read in C by code that maps them over thousands of nodes.
PART_CONTRIBUTIONS, PART_INCLUDED = attrgetter("contributions"), attrgetter("included")
PART_LEFT_OUT, PART_FILLING = attrgetter("left_out"), attrgetter("filling")


class NodeContributions(Chained[Contribution]):
    """A cluster evaluation's contributions, node after node, made when first read (Explain reads them)."""

    __slots__ = ()

    def __init__(self, parts: Sequence[NodePart]) -> None:
        super().__init__(parts, PART_CONTRIBUTIONS)

    def __len__(self) -> int:
        """Counted from each part's values and left-out GPUs, without making the contributions."""
        return sum(map(len, map(PART_INCLUDED, self._parts))) + sum(map(len, map(PART_LEFT_OUT, self._parts)))

    def unread(self) -> list[Contribution]:
        """The GPUs left out, without making the others' contributions."""
        return list(itertools.chain.from_iterable(map(PART_LEFT_OUT, self._parts)))

    def nodes_counted(self) -> int:
        """Nodes (parts) with a GPU in the value."""
        return sum(map(bool, map(PART_INCLUDED, self._parts)))

    def filling_windows(self) -> list[Contribution]:
        """From each part's own list, without making the others' contributions."""
        return list(itertools.chain.from_iterable(map(PART_FILLING, self._parts)))

    def gpu_keys(self, snapshot: Snapshot | None) -> Iterable[GpuKey]:
        """From the nodes' UUID columns, without making the records."""
        assert snapshot is not None
        return itertools.chain.from_iterable(
            zip(repeat(part.node), uuids(part.samples), strict=False) for part in snapshot.parts
        )


def filling_windows(contributions: Iterable[Contribution]) -> list[Contribution]:
    """The contributions in the value whose windows are filling: their readings cover less than the window."""
    return [c for c in contributions if c.covered_seconds is not None and c.value is not None]


def failed(query: ValueSpec, snapshot: Snapshot | None, error: GpuscalerError) -> Evaluation:
    """The evaluation that answers ``error``, with no contributions."""
    return Evaluation(query, ListedContributions(()), None, error, snapshot)
