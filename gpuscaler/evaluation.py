"""Evaluating a query over the history: per-GPU values, the aggregate, or the error KEDA must get.

Selecting all GPUs leaves out those whose value cannot be read (and says why); naming GPUs by index or
UUID requires every one of them. No readable GPU at all is an error, never a 0, because a 0 scales in.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from gpuscaler.aggregation import aggregate, reduce_window
from gpuscaler.errors import GpuscalerError, InvalidMetadata, Unavailable, Unsupported
from gpuscaler.history import History
from gpuscaler.query import GpuSelection, ValueQuery
from gpuscaler.samples import GpuSample, Metric, ReadError, ReadErrorKind, Snapshot


@dataclass(frozen=True, slots=True)
class Contribution:
    """One GPU's part in an evaluation: its windowed value, or why it was left out."""

    sample: GpuSample
    value: float | None
    samples: int
    reason: str | None = None
    error: ReadError | None = None


@dataclass(frozen=True, slots=True)
class Evaluation:
    """The outcome of one query: ``value`` or ``error`` is set, never both."""

    query: ValueQuery
    contributions: tuple[Contribution, ...]
    value: float | None
    error: GpuscalerError | None
    snapshot: Snapshot | None

    def value_or_raise(self) -> float:
        if self.error is not None:
            raise self.error
        assert self.value is not None
        return self.value


def evaluate(query: ValueQuery, history: History, *, now: float, stale_after: float) -> Evaluation:
    """Evaluate ``query`` over ``history`` as of the monotonic time ``now``."""
    snapshot = history.latest
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
    try:
        selected = select(query.selection, snapshot)
    except InvalidMetadata as error:
        return _failed(query, snapshot, error)

    window = history.window(query.window_seconds) if query.window_seconds is not None else [snapshot]
    contributions = tuple(_contribution(query, sample, window, history) for sample in selected)
    included = [c.value for c in contributions if c.value is not None]
    left_out = [c for c in contributions if c.value is None]

    failure: GpuscalerError | None = None
    if not selected:
        failure = Unavailable(f"node {snapshot.node!r} reports no GPUs")
    elif left_out and (not included or not query.selection.everything):
        failure = _unreadable(query.metric, left_out)
    value = None if failure is not None else aggregate(query.aggregation, included)
    return Evaluation(query, contributions, value, failure, snapshot)


def select(selection: GpuSelection, snapshot: Snapshot) -> list[GpuSample]:
    """The snapshot's samples that ``selection`` names; naming a GPU the node lacks is InvalidMetadata."""
    samples = list(snapshot.samples)
    if selection.indices is not None:
        present = sorted({sample.gpu.index for sample in samples})
        missing = [index for index in selection.indices if index not in present]
        if missing:
            raise InvalidMetadata(
                f"gpuIndex {','.join(map(str, missing))} is not on node {snapshot.node!r}; "
                f"it has {_listing(map(str, present))}"
            )
        return [sample for sample in samples if sample.gpu.index in selection.indices]
    if selection.uuids is not None:
        wanted = {uuid.lower() for uuid in selection.uuids}
        present_uuids = {sample.gpu.uuid.lower() for sample in samples}
        missing_uuids = [uuid for uuid in selection.uuids if uuid.lower() not in present_uuids]
        if missing_uuids:
            raise InvalidMetadata(
                f"gpuUUID {','.join(missing_uuids)} is not on node {snapshot.node!r}; "
                f"it has {_listing(sample.gpu.uuid for sample in samples)}"
            )
        return [sample for sample in samples if sample.gpu.uuid.lower() in wanted]
    return samples


def _contribution(query: ValueQuery, sample: GpuSample, window: Sequence[Snapshot], history: History) -> Contribution:
    if sample.value(query.metric) is None:
        error = sample.error_for(query.metric)
        reason = _reason(query.metric, error)
        if error is not None and error.kind is not ReadErrorKind.NOT_SUPPORTED:
            reason += f"; last read {_last_read(history, sample.gpu.uuid, query.metric)}"
        return Contribution(sample, None, 0, reason, error)
    values = [
        value
        for snapshot in window
        for other in snapshot.samples
        if other.gpu.uuid == sample.gpu.uuid and (value := other.value(query.metric)) is not None
    ]
    return Contribution(sample, reduce_window(query.window_function, values), len(values))


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


def _last_read(history: History, uuid: str, metric: Metric) -> str:
    for snapshot in history.newest_first():
        for sample in snapshot.samples:
            if sample.gpu.uuid == uuid and sample.value(metric) is not None:
                return _clock(snapshot.taken_at)
    return "never, within the history"


def _failed(query: ValueQuery, snapshot: Snapshot | None, error: GpuscalerError) -> Evaluation:
    return Evaluation(query, (), None, error, snapshot)


def _clock(unix_seconds: float) -> str:
    return datetime.datetime.fromtimestamp(unix_seconds, datetime.UTC).isoformat(timespec="milliseconds")


def _listing(items: Iterable[str]) -> str:
    listed = list(items)
    return ", ".join(listed) if listed else "none"
