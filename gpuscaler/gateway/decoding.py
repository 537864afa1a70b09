"""Agent snapshots as the gateway reads them: protobuf messages (the C runtime) to domain snapshots, cheaply.

A gateway decodes thousands of node snapshots a second, so this reads the messages with the C protobuf runtime
rather than the generated dataclasses the servers use, reuses what does not change between ticks, and decodes a
snapshot's windows only when a query reads them. Only the gateway imports it: the agent starts smaller without
the protobuf runtime.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any, overload

from gpuscaler.generated.gpuscaler import v1 as pb
from gpuscaler.generated.pb2.gpuscaler.v1 import agent_pb2
from gpuscaler.model.columns import LazySamples, WindowColumn, WindowColumns
from gpuscaler.model.gpu_metrics import READING_FIELDS
from gpuscaler.model.samples import (
    Attribution,
    AttributionState,
    GpuIdentity,
    GpuSample,
    PodRef,
    ProcessUsage,
    ReadError,
    ReadErrorKind,
    Snapshot,
    UnplacedDevice,
)
from gpuscaler.model.windows import EMPTY_SHARES, Windowed, WindowKey, WindowValues
from gpuscaler.server.wire import window_key_from_wire, window_key_to_wire


def _process_from_pb2(message: agent_pb2.ProcessUsage) -> ProcessUsage:
    def optional(name: str) -> Any:
        return getattr(message, name) if message.HasField(name) else None

    return ProcessUsage(
        message.pid,
        optional("pod_uid"),
        optional("container_id"),
        optional("sm_percent"),
        optional("memory_utilization_percent"),
        optional("memory_used_bytes"),
    )


_KIND_FROM_PB2 = {
    agent_pb2.READ_ERROR_KIND_NOT_SUPPORTED: ReadErrorKind.NOT_SUPPORTED,
    agent_pb2.READ_ERROR_KIND_GPU_LOST: ReadErrorKind.GPU_LOST,
    agent_pb2.READ_ERROR_KIND_TIMEOUT: ReadErrorKind.TIMEOUT,
    agent_pb2.READ_ERROR_KIND_OTHER: ReadErrorKind.OTHER,
}
_ATTRIBUTION_FROM_PB2 = {
    agent_pb2.ATTRIBUTION_STATE_OFF: AttributionState.OFF,
    agent_pb2.ATTRIBUTION_STATE_UNAVAILABLE: AttributionState.UNAVAILABLE,
    agent_pb2.ATTRIBUTION_STATE_OK: AttributionState.OK,
}


def _attribution(state: AttributionState, message: agent_pb2.Attribution) -> Attribution:
    """The node's attribution, with the devices its pods hold that it could not place (a kind this version does
    not know reads as OTHER: unknown, never left out)."""
    if not message.unplaced:
        return Attribution(state, message.detail)
    unplaced = tuple(
        UnplacedDevice(
            PodRef(device.pod.namespace, device.pod.pod, device.pod.container),
            device.device,
            _KIND_FROM_PB2.get(device.kind, ReadErrorKind.OTHER),
            device.detail,
        )
        for device in message.unplaced
    )
    return Attribution(state, message.detail, unplaced)


def _windowed(
    value: float, samples: int, detail: agent_pb2.WindowedValue | None, covered: float | None = None
) -> Windowed:
    """One GPU's value over a window from the packed arrays (NaN: unset), with the seconds it covers where less
    than the window, and, where there is one, its detail."""
    known = None if value != value else value
    if detail is None:
        return Windowed(known, samples, covered_seconds=covered)
    shares = (
        {
            share.pod_uid: Windowed(
                share.value if share.HasField("value") else None,
                share.samples,
                covered_seconds=share.covered_seconds if share.HasField("covered_seconds") else None,
            )
            for share in detail.shares
        }
        if detail.shares
        else EMPTY_SHARES
    )
    return Windowed(known, samples, detail.reason or None, shares, covered)


def _covered(window: agent_pb2.WindowedValues) -> list[float | None] | None:
    """Each GPU's seconds covered where less than the window, None where whole; None when every GPU's is (an
    empty array: most windows, and every window of an agent older than the field)."""
    if not window.packed_covered_seconds:
        return None
    whole = window.window.seconds
    return [None if seconds >= whole else seconds for seconds in window.packed_covered_seconds]


# The readings counted in bytes: integers in a sample, doubles in the packed array (exact below 2**53).
_BYTES_POSITIONS = tuple(position for position, name in enumerate(READING_FIELDS) if name.endswith("_bytes"))


class _WireWindows(WindowColumns):
    """A snapshot's windows, each decoded when first read.

    Every window a gateway's queries use arrives with every snapshot, but a polled query reads it once per
    KEDA poll (30 s by default) while snapshots arrive every agent poll: most are never read.
    """

    def __init__(self, by_key: dict[WindowKey, agent_pb2.WindowedValues], samples: LazySamples) -> None:
        self._wire = by_key
        self._samples = samples
        self._decoded: dict[WindowKey, WindowValues] = {}

    def __getitem__(self, key: WindowKey) -> WindowValues:
        values = self._decoded.get(key)
        if values is None:
            values = self._decoded[key] = self._decode(self._wire[key])
        return values

    def _decode(self, window: agent_pb2.WindowedValues) -> WindowValues:
        if not self._fits(window):
            return WindowValues({}, window.problem or self._mismatch(window))
        gpus = len(window.packed_values)
        details: Sequence[agent_pb2.WindowedValue | None] = window.details or [None] * gpus
        covered: Sequence[float | None] = _covered(window) or [None] * gpus
        return WindowValues(
            {
                uuid: _windowed(value, count, detail, seconds)
                for uuid, value, count, detail, seconds in zip(
                    self._samples.uuids(), window.packed_values, window.packed_samples, details, covered, strict=True
                )
            }
        )

    def column(self, key: WindowKey) -> WindowColumn | None:
        """Each GPU's value over window ``key`` (None where unset), its sample count and coverage, in order,
        straight from the packed arrays; None where the agent could not reduce it (``self[key]`` says why)."""
        window = self._wire.get(key)
        if window is None or not self._fits(window):
            return None
        values = [None if value != value else value for value in window.packed_values]
        return values, list(window.packed_samples), _covered(window)

    def _fits(self, window: agent_pb2.WindowedValues) -> bool:
        """Whether the agent reduced the window, with one value, count (and detail and coverage, if any) per GPU."""
        gpus = len(self._samples)
        if window.problem or not len(window.packed_values) == len(window.packed_samples) == gpus:
            return False
        return len(window.details) in (0, gpus) and len(window.packed_covered_seconds) in (0, gpus)

    def _mismatch(self, window: agent_pb2.WindowedValues) -> str:
        return (
            f"{len(window.packed_values)} values, {len(window.packed_samples)} sample counts, "
            f"{len(window.details)} details and {len(window.packed_covered_seconds)} covered seconds for "
            f"{len(self._samples)} GPUs"
        )

    def get(self, key: WindowKey, default: WindowValues | None = None) -> WindowValues | None:  # type: ignore[override]
        """As ``Mapping.get``, without its exception round trip: the view asks once per GPU per composition."""
        values = self._decoded.get(key)
        if values is None:
            wire = self._wire.get(key)
            if wire is None:
                return default
            values = self._decoded[key] = self._decode(wire)
        return values

    def __contains__(self, key: object) -> bool:
        return key in self._wire

    def __iter__(self) -> Iterator[WindowKey]:
        return iter(self._wire)

    def __len__(self) -> int:
        return len(self._wire)


_POSITIONS = {name: position for position, name in enumerate(READING_FIELDS)}


class _WireSamples(LazySamples):
    """A node snapshot's GPUs as they arrived: a GPU's record is made when it is read, columns come off the wire.

    Evaluating a query of one metric over a node, or counting its energy, reads a column of the packed
    readings; Explain, a pod query or a named GPU reads records, each made once.
    """

    __slots__ = ("_all", "_decoder", "_gpus", "_packed", "_records", "_unread", "_uuids")

    def __init__(
        self,
        gpus: Sequence[agent_pb2.GpuSample],
        packed: Sequence[float],
        decoder: SnapshotDecoder,
        unread: tuple[ReadError, ...] = (),
    ) -> None:
        self._gpus = gpus
        self._unread = unread  # an older agent's: why the readings it does not have are absent
        self._packed = packed  # Snapshot.readings: every GPU's readings, GPU after GPU (``decode`` checked)
        self._decoder = decoder
        self._records: list[GpuSample | None] = [None] * len(gpus)
        self._all: tuple[GpuSample, ...] | None = None
        self._uuids: list[str] | None = None

    def __len__(self) -> int:
        return len(self._records)

    @overload
    def __getitem__(self, index: int) -> GpuSample: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[GpuSample]: ...

    def __getitem__(self, index: int | slice) -> GpuSample | Sequence[GpuSample]:
        if isinstance(index, slice):
            return self.records()[index]
        record = self._records[index]
        if record is None:
            width = len(READING_FIELDS)
            start = (index % len(self._records)) * width
            row = self._packed[start : start + width]
            record = self._records[index] = self._decoder.sample(self._gpus[index], row, self._unread)
        return record

    def __iter__(self) -> Iterator[GpuSample]:
        return iter(self.records())

    def records(self) -> tuple[GpuSample, ...]:
        """Every GPU's record, made once."""
        if self._all is None:
            self._all = tuple(self[index] for index in range(len(self._records)))
        return self._all

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Sequence) and not isinstance(other, str):
            return self.records() == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.records())

    def __repr__(self) -> str:
        return repr(self.records())

    def column(self, reading: str) -> list[float | None]:
        values = self._packed[_POSITIONS[reading] :: len(READING_FIELDS)]  # one C slice
        return [None if value != value else value for value in values]  # NaN: absent

    def uuids(self) -> list[str]:
        if self._uuids is None:
            self._uuids = [gpu.uuid for gpu in self._gpus]
        return self._uuids


class MalformedSnapshot(ValueError):
    """A snapshot no agent of any version sends: readings that do not fit its GPUs, no attribution state, a window
    the gateway cannot name."""


# Agent and gateway are one image, but a rolling upgrade mixes versions: another version's readings are read in
# this gateway's layout (below), and only what no version sends is refused, naming the likely cause.
_ANOTHER_VERSION = "(is the agent another version of gpuscaler than the gateway?)"


# Snapshot.readings began with 12 readings per GPU, and every later version appends (agent.proto): an agent of
# another version sends a prefix of ours, or ours and more. A rolling upgrade mixes versions for minutes.
FIRST_READINGS = 12


def _readings_of_another_version(message: agent_pb2.Snapshot) -> tuple[list[float], int]:
    """An older or newer agent's readings in this gateway's layout, and how many each GPU had: the ones it does not
    read NaN (``SnapshotDecoder.sample`` says why), the ones this gateway does not know dropped; MalformedSnapshot
    when no version packs them so."""
    gpus, ours = len(message.gpus), len(READING_FIELDS)
    theirs, left = divmod(len(message.readings), gpus) if gpus else (0, len(message.readings))
    if left or theirs < FIRST_READINGS:
        raise MalformedSnapshot(
            f"the snapshot of node {message.node!r} has {len(message.readings)} readings for {gpus} GPUs; each GPU "
            f"has {ours} here, and at least {FIRST_READINGS} in any version {_ANOTHER_VERSION}"
        )
    unread = [float("nan")] * max(0, ours - theirs)
    packed: list[float] = []
    for index in range(gpus):
        packed += message.readings[index * theirs : index * theirs + min(theirs, ours)]
        packed += unread
    return packed, theirs


class SnapshotDecoder:
    """One agent's snapshot stream, from protobuf messages to domain snapshots, cheaply.

    A node's GPUs and its pods' assignments rarely change between ticks, so their objects are kept and
    reused; only the readings are new each time.
    """

    def __init__(self) -> None:
        self._identities: dict[tuple[int, str], GpuIdentity] = {}
        self._pods: dict[tuple[tuple[str, str, str], ...], tuple[PodRef, ...]] = {}
        self._window_keys: dict[tuple[str, float, str], WindowKey] = {}
        self._unread_by_version: dict[tuple[str, int], tuple[ReadError, ...]] = {}

    def decode(self, message: agent_pb2.Snapshot, *, monotonic: float) -> Snapshot:
        """The domain snapshot; ``monotonic`` is the receiver's clock at arrival (clocks differ between hosts)."""
        node = message.node
        packed: Sequence[float] = message.readings
        unread: tuple[ReadError, ...] = ()
        if len(packed) != len(READING_FIELDS) * len(message.gpus):
            packed, theirs = _readings_of_another_version(message)
            unread = self._unread(node, theirs)
        state = _ATTRIBUTION_FROM_PB2.get(message.attribution.state)
        if state is None:
            raise MalformedSnapshot(f"the snapshot of node {node!r} has no pod attribution state {_ANOTHER_VERSION}")
        samples = _WireSamples(message.gpus, packed, self, unread)
        return Snapshot(
            sequence=message.sequence,
            taken_at=message.taken_at_unix_seconds,
            monotonic=monotonic,
            node=node,
            samples=samples,
            attribution=_attribution(state, message.attribution),
            windows=self._windows(message, samples) if message.windows else {},
        )

    def _windows(self, message: agent_pb2.Snapshot, samples: LazySamples) -> _WireWindows:
        by_key = {}
        for window in message.windows:
            spec = window.window
            named = (spec.metric, spec.seconds, spec.function)
            key = self._window_keys.get(named)
            if key is None:
                if len(self._window_keys) > 256:  # windows asked for come and go; a handful are in use
                    self._window_keys.clear()
                try:
                    key = self._window_keys[named] = window_key_from_wire(spec)
                except ValueError as error:
                    raise MalformedSnapshot(
                        f"the snapshot of node {message.node!r} names a window this gateway cannot read: {error} "
                        f"{_ANOTHER_VERSION}"
                    ) from None
            by_key[key] = window
        return _WireWindows(by_key, samples)

    def _unread(self, node: str, theirs: int) -> tuple[ReadError, ...]:
        """Why each reading an older agent, with ``theirs`` readings a GPU, leaves NaN is absent: made once."""
        key = (node, theirs)
        errors = self._unread_by_version.get(key)
        if errors is None:
            # Unknown, not unsupported: the GPU may well have it, and a sum must not shrink while nodes upgrade
            # (an unsupported reading leaves its GPU out of an answer; an unknown one makes the answer
            # UNAVAILABLE, or partial within maxUnreadable).
            errors = self._unread_by_version[key] = tuple(
                ReadError(
                    name,
                    ReadErrorKind.OTHER,
                    f"the agent on node {node!r} is an older gpuscaler, which does not read {name}; it will once "
                    "it is upgraded",
                )
                for name in READING_FIELDS[theirs:]
            )
        return errors

    def sample(
        self, gpu: agent_pb2.GpuSample, packed: Sequence[float], unread: tuple[ReadError, ...] = ()
    ) -> GpuSample:
        """One GPU's record; ``packed`` is its readings in order (NaN: absent), ``unread`` why an older agent's
        missing readings are."""
        key = (gpu.index, gpu.uuid)  # a UUID's name and MIG parent are its own for life
        identity = self._identities.get(key)
        if identity is None:
            identity = self._identities[key] = GpuIdentity(gpu.index, gpu.uuid, gpu.name, gpu.mig_parent_uuid or None)
        values: list[Any] = list(packed)
        total = sum(values)  # NaN when a reading is NaN (absent), or on infinities: then look at each
        readings: list[float | int | None] = (
            values if total == total else [None if value != value else value for value in values]
        )
        for position in _BYTES_POSITIONS:
            if (value := readings[position]) is not None:
                readings[position] = int(value)
        errors = (
            tuple(
                ReadError(
                    e.field,
                    _KIND_FROM_PB2.get(e.kind, ReadErrorKind.OTHER),
                    e.detail,
                    e.last_read_unix_seconds if e.HasField("last_read_unix_seconds") else None,
                )
                for e in gpu.errors
            )
            if gpu.errors
            else ()
        ) + unread
        # Not read (the agent does not read processes, or could not) is not "no processes".
        processes = tuple(_process_from_pb2(p) for p in gpu.processes) if gpu.processes_read else None
        # By position: GpuSample's fields are (gpu, node, the readings in READINGS' order, errors, pods,
        # processes), which tests/server/test_wire.py holds to; a named tuple built from a tuple is the cheapest
        # record Python makes.
        return GpuSample._make((identity, gpu.node, *readings, errors, self._pod_refs(gpu), processes))

    def _pod_refs(self, gpu: agent_pb2.GpuSample) -> tuple[PodRef, ...]:
        if not gpu.pods:
            return ()
        key = tuple((p.namespace, p.pod, p.container) for p in gpu.pods)
        pods = self._pods.get(key)
        if pods is None:
            if len(self._pods) > 4096:  # pods come and go; keep the cache to what a node holds now
                self._pods.clear()
            pods = self._pods[key] = tuple(PodRef(*ref) for ref in key)
        return pods


def watch_request(windows: Iterable[WindowKey]) -> agent_pb2.WatchSnapshotsRequest:
    """The WatchSnapshots request that asks an agent for ``windows``, as the C runtime's message (the subscriber's
    stream speaks it); built by the servers' one conversion, once per stream."""
    request = pb.WatchSnapshotsRequest(windows=[window_key_to_wire(window) for window in windows])
    decoded: agent_pb2.WatchSnapshotsRequest = agent_pb2.WatchSnapshotsRequest.FromString(bytes(request))
    return decoded
