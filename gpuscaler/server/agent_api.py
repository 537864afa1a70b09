"""The agent's own API (``gpuscaler.v1.Agent``): snapshots for the gateway, explanations for ``query``."""

from __future__ import annotations

from collections.abc import AsyncIterator

from gpuscaler.energy import idle_energy
from gpuscaler.engine import Engine
from gpuscaler.errors import Unavailable
from gpuscaler.generated.gpuscaler import v1 as pb
from gpuscaler.samples import Snapshot
from gpuscaler.server.status import grpc_errors, status_for
from gpuscaler.wire import explanation_to_wire, snapshot_to_wire


class AgentService(pb.AgentBase):
    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    def _wire(self, snapshot: Snapshot) -> pb.Snapshot:
        return snapshot_to_wire(snapshot, poll_interval_seconds=self._engine.source.interval_seconds)

    async def get_snapshot(self, message: pb.GetSnapshotRequest) -> pb.Snapshot:
        async with grpc_errors("GetSnapshot"):
            latest = self._engine.source.latest
            if latest is None:
                raise Unavailable("no sample yet: the agent has not finished its first poll")
        return self._wire(latest)

    async def watch_snapshots(self, message: pb.WatchSnapshotsRequest) -> AsyncIterator[pb.Snapshot]:
        sequence = 0
        while True:
            snapshot = await self._engine.source.wait_newer(sequence)
            if self._engine.closing:
                return  # ends the stream with OK; the gateway reconnects
            sequence = snapshot.sequence
            yield self._wire(snapshot)

    async def explain(self, message: pb.ExplainRequest) -> pb.Explanation:
        async with grpc_errors("Explain"):
            query = self._engine.parse(message.scaler_metadata, message.namespace, message.name)
        evaluation = self._engine.evaluate(query.value)
        active = evaluation.value is not None and self._engine.is_active(query)
        code = status_for(evaluation.error).name if evaluation.error is not None else ""
        idle = idle_energy(
            self._engine.source, (c.sample for c in evaluation.contributions), query.value.window_seconds
        )
        return explanation_to_wire(
            query, evaluation, active=active, now=self._engine.now(), error_code=code, idle_energy=idle
        )
