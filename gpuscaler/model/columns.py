"""A gateway's fast path: a node's samples and windows read across its GPUs as columns, records made only when read.

A gateway receives thousands of node snapshots a second, and most queries read one number of each GPU. The
decoder (``gateway/decoding.py``) implements ``LazySamples`` and ``WindowColumns`` over the messages as they
arrived; the signals read them through ``column``, ``uuids`` and ``metric_column``, which take any sequence of
samples (an agent's are records), so the code is the same on a node and for the cluster. ``Chained`` reads
thousands of nodes' sequences as one without joining them.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from itertools import chain
from operator import attrgetter
from typing import Any, TypeVar, overload

from gpuscaler.model.gpu_metrics import METRICS, Metric
from gpuscaler.model.samples import GpuSample, percent_of
from gpuscaler.model.windows import WindowKey, WindowValues

T = TypeVar("T")


class LazySamples(Sequence[GpuSample]):
    """A node's samples as they arrived, each made into a ``GpuSample`` only when it is read.

    A gateway receives thousands of node snapshots a second, and most queries read one number of each GPU:
    ``column`` reads that number across the node's GPUs without making the records.
    """

    __slots__ = ()

    @abstractmethod
    def column(self, reading: str) -> list[float | None]:
        """Each GPU's ``reading`` (a ``GpuSample`` field), in order; None where absent.

        Byte counts may come as floats of the same value: every use of a reading is arithmetic on it.
        """

    @abstractmethod
    def uuids(self) -> list[str]:
        """Each GPU's UUID, in order."""


class Chained(Sequence[T]):
    """The sequences ``of`` gives for each of ``parts``, read as one, in order, each asked for only when read.

    A gateway chains thousands of nodes' samples into its cluster snapshot, and thousands of nodes'
    contributions into an evaluation, many times a second; most of them are never read, and a reader that
    stops early (``any``) reads only the first parts. Indexing makes the whole once.
    """

    __slots__ = ("_all", "_length", "_of", "_parts")

    def __init__(self, parts: Sequence[Any], of: Callable[[Any], Sequence[T]]) -> None:
        self._parts = parts
        self._of = of
        self._all: tuple[T, ...] | None = None
        self._length: int | None = None

    def __len__(self) -> int:
        if self._length is None:
            self._length = len(self._all) if self._all is not None else sum(map(len, map(self._of, self._parts)))
        return self._length

    def __bool__(self) -> bool:
        """Whether any part has something: the first non-empty part answers, not a count of them all."""
        if self._length is not None:
            return self._length > 0
        return any(map(len, map(self._of, self._parts)))

    @overload
    def __getitem__(self, index: int) -> T: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[T]: ...

    def __getitem__(self, index: int | slice) -> T | Sequence[T]:
        if self._all is None:
            self._all = tuple(self)
        return self._all[index]

    def __iter__(self) -> Iterator[T]:
        if self._all is not None:
            return iter(self._all)
        return chain.from_iterable(map(self._of, self._parts))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Sequence) and not isinstance(other, str):
            return tuple(self) == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self))


def column(samples: Sequence[GpuSample], reading: str) -> Sequence[float | None]:
    """Each sample's ``reading``, in order, without making the records of lazy samples."""
    if isinstance(samples, LazySamples):
        return samples.column(reading)
    return list(map(attrgetter(reading), samples))


def uuids(samples: Sequence[GpuSample]) -> list[str]:
    """Each sample's GPU UUID, in order, without making the records of lazy samples."""
    if isinstance(samples, LazySamples):
        return samples.uuids()
    return [sample.gpu.uuid for sample in samples]


def metric_column(samples: Sequence[GpuSample], metric: Metric) -> list[float | None]:
    """``[sample.value(metric) for sample in samples]``, without making the records of lazy samples."""
    info = METRICS[metric]
    if not info.in_one_sample:
        return [None] * len(samples)
    values = column(samples, info.reading)
    if info.of is None:
        return [None if value is None else float(value) for value in values]
    return list(map(percent_of, values, column(samples, info.of)))


# A window across a node's GPUs, in order: each value (None where unset), sample count, and seconds covered where
# less than the window (``Windowed.covered_seconds``); that list is None when every GPU's window is whole.
WindowColumn = tuple[list[float | None], list[int], list[float | None] | None]


class WindowColumns(Mapping[WindowKey, WindowValues]):
    """A node snapshot's windows as they arrived from its agent, each readable across the node's GPUs at once."""

    __slots__ = ()

    @abstractmethod
    def column(self, key: WindowKey) -> WindowColumn | None:
        """Each GPU's value over ``key``, sample count and coverage, in order (``WindowColumn``); None where
        this cannot tell them so (then read ``self[key]``)."""
