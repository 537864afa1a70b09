"""``gpuscaler.v1.FakeControl``: set values and inject NVML failures on the fake collector, live."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

from gpuscaler.agent.collectors.fake import Failure, FakeCollector
from gpuscaler.agent.collectors.scenario import parse_value
from gpuscaler.generated.gpuscaler import v1 as pb
from gpuscaler.model.errors import ConfigError, InvalidRequest
from gpuscaler.server.status import grpc_errors
from gpuscaler.signals.source import SnapshotSource

# How many poll intervals a change waits at most for the tick that reads it (a stalled poll loop answers anyway).
APPLIED_WAIT_INTERVALS = 4

_FAILURES = {
    pb.FakeFailure.LOST: Failure.LOST,
    pb.FakeFailure.NOT_SUPPORTED: Failure.NOT_SUPPORTED,
    pb.FakeFailure.TIMEOUT: Failure.TIMEOUT,
}
_FAILURES_TO_WIRE = {failure: wire for wire, failure in _FAILURES.items()}


class FakeControlService(pb.FakeControlBase):
    """Each change answers once a tick that started after it is in ``source``: a query right after sees it."""

    def __init__(self, collector: FakeCollector, source: SnapshotSource) -> None:
        self._collector = collector
        self._source = source

    async def _read_by_a_tick(self) -> None:
        applied = asyncio.get_running_loop().time()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(APPLIED_WAIT_INTERVALS * self._source.interval_seconds):
                latest = self._source.latest
                while latest is None or latest.monotonic < applied:
                    latest = await self._source.wait_newer(latest.sequence if latest is not None else 0)

    def _state(self) -> pb.FakeGpus:
        return pb.FakeGpus(
            gpus=[
                pb.FakeGpuState(
                    index=gpu.index,
                    uuid=gpu.uuid,
                    values={metric.value: value for metric, value in values.items()},
                    failure=_FAILURES_TO_WIRE[failure] if failure else pb.FakeFailure.UNSPECIFIED,
                )
                for gpu, values, failure in self._collector.state()
            ]
        )

    def _index(self, selector: pb.GpuSelector | None) -> int | None:
        if selector is None or (selector.index is None and not selector.all):
            raise InvalidRequest("gpu is missing; give an index or all")
        return None if selector.all else selector.index

    async def set(self, message: pb.SetRequest) -> pb.FakeGpus:
        async with grpc_errors("Set"):
            index = self._index(message.gpu)
            try:
                # The wire carries doubles: say '150', as the user typed it, not '150.0'.
                values = dict(
                    parse_value(name, str(value).removesuffix(".0")) for name, value in message.values.items()
                )
            except ConfigError as error:
                raise InvalidRequest(str(error)) from None
            if not values:
                raise InvalidRequest("values is empty; give METRIC=VALUE pairs")
            self._apply(lambda: self._collector.set_values(index, values))
        await self._read_by_a_tick()
        return self._state()

    async def fail(self, message: pb.FailRequest) -> pb.FakeGpus:
        async with grpc_errors("Fail"):
            failure = _FAILURES.get(message.failure)
            if failure is None:
                allowed = ", ".join(f.value for f in Failure)
                raise InvalidRequest(f"failure is missing; use one of: {allowed}")
            self._apply(lambda: self._collector.fail(message.index, failure))
        await self._read_by_a_tick()
        return self._state()

    async def heal(self, message: pb.HealRequest) -> pb.FakeGpus:
        async with grpc_errors("Heal"):
            index = self._index(message.gpu)
            self._apply(lambda: self._collector.heal(index))
        await self._read_by_a_tick()
        return self._state()

    @staticmethod
    def _apply(change: Callable[[], None]) -> None:
        try:
            change()
        except IndexError as error:
            raise InvalidRequest(str(error)) from None
