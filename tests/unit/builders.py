"""Hand-made samples, snapshots and histories for the pure-logic tables."""

from __future__ import annotations

from collections.abc import Sequence

from gpuscaler.history import History
from gpuscaler.samples import DEVICE_FIELD, GpuIdentity, GpuSample, PodRef, ReadError, ReadErrorKind, Snapshot

NODE = "node-a"
# Wall clock of the snapshot at monotonic 0: the values only show up in messages.
EPOCH = 1_700_000_000.0


def uuid_of(index: int) -> str:
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
        errors=errors,
        pods=pods,
    )


def failed_sample(index: int, kind: ReadErrorKind, detail: str = "fake failure") -> GpuSample:
    """A GPU whose whole device read failed, as NVML reports a lost or hung GPU."""
    return gpu_sample(index, errors=(ReadError(DEVICE_FIELD, kind, detail),))


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


def history_of(*snapshots: Snapshot, history_seconds: float = 600.0, poll_interval_seconds: float = 1.0) -> History:
    """A history holding ``snapshots`` in order."""
    history = History(history_seconds=history_seconds, poll_interval_seconds=poll_interval_seconds)
    for item in snapshots:
        history.append(item)
    return history


def series(per_tick: Sequence[Sequence[float | None]], *, interval: float = 1.0) -> History:
    """A history with one snapshot per entry, ``interval`` seconds apart from monotonic 0, of gpu_utilization."""
    return history_of(*(snapshot(i + 1, i * interval, utilizations(*values)) for i, values in enumerate(per_tick)))
