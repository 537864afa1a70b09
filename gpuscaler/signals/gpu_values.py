"""One GPU's value in a query: now, over a window or as a pod's share, or why it has none; and which GPUs a
selection names."""

from __future__ import annotations

import datetime
import itertools
from collections.abc import Iterable, Sequence

from gpuscaler.model.columns import uuids
from gpuscaler.model.errors import GpuscalerError, InvalidMetadata, Unavailable, Unsupported
from gpuscaler.model.gpu_metrics import METRICS, Metric
from gpuscaler.model.pods import uid_key
from gpuscaler.model.samples import GpuSample, ReadError, ReadErrorKind, Snapshot
from gpuscaler.model.windows import Windowed
from gpuscaler.query.query import GpuQuery, GpuSelection
from gpuscaler.signals.outcome import Contribution
from gpuscaler.signals.shares import Share, pod_share
from gpuscaler.signals.source import SnapshotSource


def contribution_of(
    query: GpuQuery,
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
    if not info.in_one_sample:  # a rate: its window (at least the newest two samples) has it
        readable = getattr(sample, info.reading) is not None
    else:
        latest = sample.value(query.metric) if own_uid is None else pod_share(sample, query.metric, own_uid)
        readable = latest is not None
    if not readable:
        error = sample.error_for(query.metric)
        reason = _reason(query.metric, error)
        if error is not None and error.kind is not ReadErrorKind.NOT_SUPPORTED and not sample.gpu.unplaced:
            last = "never since its agent started" if error.last_read_at is None else utc_clock(error.last_read_at)
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
    # A window that covers less than its length still answers (docs/metadata.md, windows that are filling):
    # its readings are real, and an error here would make KEDA keep or fall back on every agent restart.
    return Contribution(
        sample, windowed.value, windowed.sample_count, pod=pod, share=basis, covered_seconds=windowed.covered_seconds
    )


def _reason(metric: Metric, error: ReadError | None) -> str:
    if error is None:
        return f"{metric.value} was not read"
    return f"{error.kind.value}: {error.detail}"


def unreadable_error(metric: Metric, left_out: Sequence[Contribution]) -> GpuscalerError:
    """The error for GPUs that must be read and cannot: Unsupported when none supports the metric."""
    details = "; ".join(f"{c.sample.gpu.describe()}: {c.reason}" for c in left_out)
    message = f"{metric.value} cannot be read on {details}"
    if all(c.error is not None and c.error.kind is ReadErrorKind.NOT_SUPPORTED for c in left_out):
        return Unsupported(message)
    return Unavailable(message)


def named_samples(selection: GpuSelection, snapshot: Snapshot) -> list[GpuSample]:
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


def select(selection: GpuSelection, snapshot: Snapshot, *, cluster: bool) -> Sequence[GpuSample]:
    """The snapshot's samples that ``selection`` names; naming a GPU the node lacks is InvalidMetadata."""
    samples = snapshot.samples
    if selection.indices is not None:
        present = sorted({sample.gpu.index for sample in samples})
        missing = [index for index in selection.indices if index not in present]
        if missing:
            raise InvalidMetadata(
                f"gpuIndex {','.join(map(str, missing))} is not on {_where(snapshot, cluster)}; "
                f"its GPUs: {listing(map(str, present))}"
            )
        return [sample for sample in samples if sample.gpu.index in selection.indices]
    if selection.uuids is not None:
        chosen = named_samples(selection, snapshot)
        present_uuids = {sample.gpu.uuid.lower() for sample in chosen}
        missing_uuids = [uuid for uuid in selection.uuids if uuid.lower() not in present_uuids]
        if missing_uuids:
            raise InvalidMetadata(
                f"gpuUUID {','.join(missing_uuids)} is not on {_where(snapshot, cluster)}; "
                f"its GPUs: {listing(itertools.chain.from_iterable(uuids(node.samples) for node in snapshot.nodes))}"
            )
        return chosen
    return samples


def _where(snapshot: Snapshot, cluster: bool) -> str:
    if not cluster:
        return f"node {snapshot.node!r}"
    return f"any of the {len(snapshot.parts)} fresh nodes"


def utc_clock(unix_seconds: float) -> str:
    """A Unix time as an error message shows it: UTC, to the millisecond."""
    return datetime.datetime.fromtimestamp(unix_seconds, datetime.UTC).isoformat(timespec="milliseconds")


MAX_LISTED = 20  # a cluster has thousands of GPUs: an error names the first few and counts the rest


def listing(items: Iterable[str]) -> str:
    """Items comma-separated, the first MAX_LISTED of them and a count of the rest."""
    listed = list(items)
    if not listed:
        return "none"
    if len(listed) > MAX_LISTED:
        return f"{', '.join(listed[:MAX_LISTED])} and {len(listed) - MAX_LISTED} more"
    return ", ".join(listed)
