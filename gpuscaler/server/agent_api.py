"""The agent's own API (``gpuscaler.v1.Agent``): snapshots for the gateway, explanations for ``query``.

A gateway keeps no history: with each snapshot, the agent sends the windows the gateway asked for, each
GPU reduced over the agent's own ring buffer. Two gateway replicas asking for the same window share one
reduction per tick. A gateway serves the same service for Explain, and refuses the snapshot calls: its cluster
snapshot belongs to no node.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterable, Sequence

import grpclib.const
import grpclib.server

from gpuscaler.generated.gpuscaler import v1 as pb
from gpuscaler.model.durations import format_duration
from gpuscaler.model.errors import InvalidRequest, NotServed, Unavailable
from gpuscaler.model.samples import GpuKey, Snapshot
from gpuscaler.model.windows import MAX_WINDOWS, READ_WINDOWS_RESERVE, WindowKey, WindowValues
from gpuscaler.server.status import grpc_errors, status_for, time_left_of
from gpuscaler.server.wire import explanation_to_wire, snapshot_to_wire, window_key_from_wire
from gpuscaler.signals.energy import IdleEnergy
from gpuscaler.signals.evaluator import Evaluator
from gpuscaler.signals.per_snapshot import PerSnapshot

# A gateway's composed snapshot is no node's: answering it as one would hand a client a made-up node.
NO_NODE_SNAPSHOT = (
    "this is a gateway, which serves no node snapshot: call {rpc} at an agent (the gateway's --agents), "
    "or Explain here for what the gateway answers"
)

# Energy while idle of some GPUs over a window (seconds; None: all the server knows), for Explain.
IdleEnergyOf = Callable[[Iterable[GpuKey], float | None], IdleEnergy | None]


class AgentService(pb.AgentBase):
    """The Agent service over an evaluator: the latest snapshot, streams with the windows asked for, Explain."""

    def __init__(self, evaluator: Evaluator, idle_energy_of: IdleEnergyOf | None = None) -> None:
        self._evaluator = evaluator
        self._idle_energy_of = idle_energy_of or (lambda gpus, window_seconds: None)
        self._reduced = PerSnapshot[WindowKey, WindowValues]()
        self._bare = PerSnapshot[None, pb.Snapshot]()  # the newest snapshot's message without windows

    def _wire(self, snapshot: Snapshot, windows: Sequence[WindowKey] = ()) -> pb.Snapshot:
        if not windows:
            # One message per snapshot whoever asks, never changed once made: the server's codec encodes it once
            # (REUSED_ANSWERS), so a flood of GetSnapshot costs a lookup per call, not an encoding of every GPU.
            bare = self._bare.at(snapshot.sequence)
            message = bare.get(None)
            if message is None:
                message = bare[None] = self._to_wire(snapshot, {})
            return message
        return self._to_wire(snapshot, {window: self._reduce(snapshot, window) for window in windows})

    def _to_wire(self, snapshot: Snapshot, windows: dict[WindowKey, WindowValues]) -> pb.Snapshot:
        return snapshot_to_wire(
            snapshot, poll_interval_seconds=self._evaluator.source.interval_seconds, windows=windows
        )

    def _reduce(self, snapshot: Snapshot, window: WindowKey) -> WindowValues:
        """``window`` for every GPU of ``snapshot``, once per snapshot whoever asks."""
        reduced = self._reduced.at(snapshot.sequence)
        done = reduced.get(window)
        if done is None:
            source = self._evaluator.source
            if window.seconds > source.history_seconds:
                done = WindowValues(
                    {},
                    f"{window.describe()} is longer than this agent's --history of "
                    f"{format_duration(source.history_seconds)}",
                )
            else:
                done = WindowValues({sample.gpu.uuid: source.windowed(sample, window) for sample in snapshot.samples})
            reduced[window] = done
        return done

    def _refuse_at_a_gateway(self, rpc: str) -> None:
        if self._evaluator.source.cluster:
            raise NotServed(NO_NODE_SNAPSHOT.format(rpc=rpc))

    async def get_snapshot(self, message: pb.GetSnapshotRequest) -> pb.Snapshot:
        async with grpc_errors("GetSnapshot"):
            self._refuse_at_a_gateway("GetSnapshot")
            latest = self._evaluator.source.latest
            if latest is None:
                raise Unavailable("no sample yet: the agent has not finished its first poll")
        return self._wire(latest)

    async def watch_snapshots(self, message: pb.WatchSnapshotsRequest) -> AsyncIterator[pb.Snapshot]:
        async with grpc_errors("WatchSnapshots"):
            self._refuse_at_a_gateway("WatchSnapshots")
            # A gateway asks for KEDA's MAX_WINDOWS and, while reads last, READ_WINDOWS_RESERVE one-shot ones.
            served = MAX_WINDOWS + READ_WINDOWS_RESERVE
            if len(message.windows) > served:
                raise InvalidRequest(f"windows: {len(message.windows)} asked for; at most {served} are served")
            try:
                windows = list(dict.fromkeys(window_key_from_wire(spec) for spec in message.windows))
            except ValueError as error:
                raise InvalidRequest(str(error)) from None
        sequence = 0
        while True:
            snapshot = await self._evaluator.source.wait_newer(sequence)
            if self._evaluator.closing:
                return  # ends the stream with OK; the gateway reconnects
            sequence = snapshot.sequence
            yield self._wire(snapshot, windows)

    def __mapping__(self) -> dict[str, grpclib.const.Handler]:
        """The generated handlers' paths, Explain's served by one that reads the call's deadline."""
        mapping = super().__mapping__()
        explain = "/gpuscaler.v1.Agent/Explain"
        return mapping | {explain: mapping[explain]._replace(func=self._serve_explain)}

    async def _serve_explain(self, stream: grpclib.server.Stream[pb.ExplainRequest, pb.Explanation]) -> None:
        request = await stream.recv_message()
        assert request is not None
        await stream.send_message(await self.explain(request, time_left=time_left_of(stream)))

    async def explain(self, message: pb.ExplainRequest, *, time_left: float | None = None) -> pb.Explanation:
        """What KEDA would be answered for ``message``'s query now, and why, changing nothing; waited for within
        ``time_left`` (seconds of the caller's deadline; None: none set)."""
        async with grpc_errors("Explain"):
            query = self._evaluator.parse(message.scaler_metadata, message.namespace, message.name)
            # A read: no engine pod wanted (a pod no one wants is read once for this answer), and at a gateway a
            # window no KEDA call uses is asked of the agents only while it lasts, all within the deadline.
            evaluation = await self._evaluator.read(query, time_left=time_left)
        # A read: what IsActive would answer now, without moving the state KEDA's calls keep.
        active = evaluation.value is not None and self._evaluator.would_be_active(query, evaluation.value)
        code = status_for(evaluation.error).name if evaluation.error is not None else ""
        idle = self._idle_energy_of(evaluation.gpu_keys(), query.value.window_seconds)
        return explanation_to_wire(
            query,
            evaluation,
            active=active,
            now=self._evaluator.now(),
            error_code=code,
            idle_energy=idle,
            empty_selection=self._evaluator.empty_selection(evaluation),
        )
