"""Hand-made samples, snapshots and histories for the pure-logic tables, and snapshot messages read as a gateway
reads them."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Hashable, Iterable, Iterator, Sequence
from typing import Protocol, cast

from gpuscaler.agent.history import History
from gpuscaler.gateway.decoding import SnapshotDecoder
from gpuscaler.generated.gpuscaler import v1 as pb
from gpuscaler.generated.pb2.gpuscaler.v1 import agent_pb2
from gpuscaler.model.columns import WindowColumn
from gpuscaler.model.samples import (
    DEVICE_FIELD,
    Absence,
    GpuIdentity,
    GpuSample,
    PodRef,
    ProcessUsage,
    ReadError,
    ReadErrorKind,
    Snapshot,
)
from gpuscaler.model.windows import Windowed, WindowKey
from gpuscaler.query.query import ActivationRule, GpuQuery, Query
from gpuscaler.signals.source import Announcer, SnapshotListener, window_column

NODE = "node-a"
# Wall clock of the snapshot at monotonic 0: the values only show up in messages.
EPOCH = 1_700_000_000.0


def uuid_of(index: int) -> str:
    """The UUID a built sample's GPU gets from its index unless one is given."""
    return f"GPU-{index:08x}-test"


def gpu_sample(
    index: int,
    *,
    util: float | None = None,
    mem_util: float | None = None,
    used: int | None = None,
    total: int | None = None,
    temperature: float | None = None,
    power: float | None = None,
    limit: float | None = None,
    errors: tuple[ReadError, ...] = (),
    pods: tuple[PodRef, ...] = (),
    uuid: str | None = None,
    mig_parent: str | None = None,
    node: str = NODE,
    sm_active: float | None = None,
    sm_occupancy: float | None = None,
    tensor_active: float | None = None,
    dram_bandwidth: float | None = None,
    energy: float | None = None,
    processes: tuple[ProcessUsage, ...] | None = None,
    pcie_tx: float | None = None,
    pcie_rx: float | None = None,
    nvlink_tx: float | None = None,
    nvlink_rx: float | None = None,
) -> GpuSample:
    """A sample of GPU ``index``; every value not given is absent."""
    return GpuSample(
        gpu=GpuIdentity(index=index, uuid=uuid or uuid_of(index), name="Test GPU", mig_parent_uuid=mig_parent),
        node=node,
        gpu_utilization_percent=util,
        memory_utilization_percent=mem_util,
        memory_used_bytes=used,
        memory_total_bytes=total,
        temperature_celsius=temperature,
        power_draw_watts=power,
        power_limit_watts=limit,
        sm_active_percent=sm_active,
        sm_occupancy_percent=sm_occupancy,
        tensor_active_percent=tensor_active,
        dram_bandwidth_percent=dram_bandwidth,
        energy_joules=energy,
        pcie_tx_megabytes_per_second=pcie_tx,
        pcie_rx_megabytes_per_second=pcie_rx,
        nvlink_tx_megabytes_per_second=nvlink_tx,
        nvlink_rx_megabytes_per_second=nvlink_rx,
        errors=errors,
        pods=pods,
        processes=processes,
    )


def failed_sample(
    index: int, kind: ReadErrorKind, detail: str = "fake failure", *, last_read_at: float | None = None
) -> GpuSample:
    """A GPU whose whole device read failed, as NVML reports a lost or hung GPU; its agent last read it at
    ``last_read_at`` seconds after EPOCH (None: never since it started)."""
    stamp = None if last_read_at is None else EPOCH + last_read_at
    return gpu_sample(index, errors=(ReadError(DEVICE_FIELD, kind, detail, stamp),))


def unsupported_sample(index: int) -> GpuSample:
    """A GPU that supports none of the fields (every field NOT_SUPPORTED, none device-wide)."""
    fields = (
        "gpu_utilization",
        "memory_utilization",
        "memory_used_bytes",
        "memory_total_bytes",
        "temperature",
        "power_draw_watts",
        "power_limit_watts",
    )
    return gpu_sample(index, errors=tuple(ReadError(f, ReadErrorKind.NOT_SUPPORTED, "Not Supported") for f in fields))


def utilizations(*values: float | None) -> tuple[GpuSample, ...]:
    """One sample per GPU (indices 0, 1, ...) with these gpu_utilization values."""
    return tuple(gpu_sample(index, util=value) for index, value in enumerate(values))


def snapshot(sequence: int, at: float, samples: tuple[GpuSample, ...], *, node: str = NODE) -> Snapshot:
    """The snapshot of tick ``sequence`` taken at monotonic ``at`` seconds."""
    return Snapshot(sequence=sequence, taken_at=EPOCH + at, monotonic=at, node=node, samples=samples)


def decoded(message: pb.Snapshot, decoder: SnapshotDecoder | None = None, *, monotonic: float = 0.0) -> Snapshot:
    """A snapshot message (an agent's, or ``snapshot_to_wire``'s) as a gateway reads it: its bytes, parsed by the C
    runtime, decoded by ``decoder``; ``monotonic`` is the reader's clock."""
    return (decoder or SnapshotDecoder()).decode(agent_pb2.Snapshot.FromString(bytes(message)), monotonic=monotonic)


def history_of(*snapshots: Snapshot, history_seconds: float = 600.0, poll_interval_seconds: float = 1.0) -> History:
    """A history holding ``snapshots`` in order."""
    history = History(history_seconds=history_seconds, poll_interval_seconds=poll_interval_seconds)
    for item in snapshots:
        history.append(item)
    return history


def series(per_tick: Sequence[Sequence[float | None]], *, interval: float = 1.0) -> History:
    """A history with one snapshot per entry, ``interval`` seconds apart from monotonic 0, of gpu_utilization."""
    return history_of(*(snapshot(i + 1, i * interval, utilizations(*values)) for i, values in enumerate(per_tick)))


def cluster(*parts: Snapshot, absent: Sequence[Absence] = (), at: float = 0.0) -> Snapshot:
    """A gateway's composed view of these fresh node snapshots and these absent ones, at monotonic ``at``."""
    return Snapshot(
        sequence=1,
        taken_at=EPOCH + at,
        monotonic=at,
        node="cluster",
        samples=tuple(sample for part in parts for sample in part.samples),
        parts=parts,
        absent=tuple(absent),
        cluster=True,
    )


def silent(last: Snapshot, *, seconds: float = 12.0, agent: str = "10.0.0.9:6000") -> Absence:
    """``last``'s node, silent for ``seconds``: its agent is listed but sends nothing."""
    return Absence(agent, last.node, EPOCH - seconds, f"silent for {seconds:g}s (connection refused)", last=last)


def unheard(agent: str = "10.0.0.8:6000") -> Absence:
    """A listed agent that has sent nothing since the gateway started: its node is not known."""
    return Absence(agent, None, EPOCH - 30.0, "no snapshot yet (connection refused)")


class ClusterSource:
    """A fixed composed view over per-node histories: the ``SnapshotSource`` a gateway would be."""

    cluster = True

    def __init__(self, view: Snapshot, *histories: History, history_seconds: float = 600.0) -> None:
        self.view = view
        self._histories = {history.latest.node: history for history in histories if history.latest is not None}
        self._announcer = Announcer()
        self.history_seconds = history_seconds
        self.interval_seconds = 0.5
        self.stale_after = 2.0

    @property
    def latest(self) -> Snapshot:
        return self.view

    def windowed(self, sample: GpuSample, window: WindowKey) -> Windowed:
        history = self._histories.get(sample.node)
        return history.windowed(sample, window) if history is not None else Windowed(None, 0)

    def window_column(self, part: Snapshot, window: WindowKey) -> WindowColumn:
        return window_column(self.windowed, part, window)

    def request(self, windows: Iterable[WindowKey]) -> None:
        pass

    async def prepare(self, windows: Sequence[WindowKey]) -> None:
        return None

    @contextlib.asynccontextmanager
    async def windows_for_read(
        self, windows: Sequence[WindowKey], *, time_left: float | None = None
    ) -> AsyncIterator[None]:
        yield  # each node's history answers every window, as its agent would

    def for_read(self) -> ClusterSource:
        return self  # it keeps nothing per read

    def newest_first(self, node: str) -> Iterator[Snapshot]:
        history = self._histories.get(node)
        return history.newest_first(node) if history is not None else iter(())

    def add_listener(self, listener: SnapshotListener) -> None:
        self._announcer.add_listener(listener)

    async def wait_newer(self, sequence: int) -> Snapshot:
        return self.view


def source_of(view: Snapshot) -> History | ClusterSource:
    """The source a node snapshot or a composed view is read from: windows are each node's own snapshots."""
    if not view.cluster:
        return history_of(view)
    return ClusterSource(view, *(history_of(part) for part in view.parts))


class GpuTrigger(Protocol):
    """A ``Query`` on a GPU metric: what most tests parse, with its value narrowed to a ``GpuQuery``."""

    @property
    def value(self) -> GpuQuery: ...
    @property
    def activation(self) -> ActivationRule: ...
    @property
    def target(self) -> float: ...
    @property
    def metric_name(self) -> str: ...
    @property
    def profile(self) -> str | None: ...
    @property
    def activation_key(self) -> Hashable: ...


def gpu_trigger(query: Query) -> GpuTrigger:
    """``query``, checked to be on a GPU metric (not an engine signal nor a combined one)."""
    assert isinstance(query.value, GpuQuery), query.value
    return cast(GpuTrigger, query)
