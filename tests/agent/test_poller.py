"""The poll loop: one snapshot per tick, and a hung read costs only that GPU's sample."""

from __future__ import annotations

import asyncio
import time

from gpuscaler.agent.collectors.fake import Failure, FakeCollector
from gpuscaler.agent.history import History
from gpuscaler.agent.poller import Poller
from gpuscaler.model.gpu_metrics import Metric
from gpuscaler.model.samples import DEVICE_FIELD, ReadErrorKind, Snapshot


async def started_poller(collector: FakeCollector, interval: float = 0.1) -> tuple[Poller, History]:
    """A started poller over ``collector``, every ``interval`` seconds, into a new 60 s history."""
    history = History(history_seconds=60, poll_interval_seconds=interval)
    poller = Poller(collector, history, poll_interval_seconds=interval)
    await poller.start()
    return poller, history


async def test_tick_appends_one_snapshot_with_every_gpu() -> None:
    """Each tick appends a snapshot with one sample per GPU and a rising sequence."""
    collector = FakeCollector(node="n", gpu_count=3)
    poller, history = await started_poller(collector)
    first = await poller.tick()
    second = await poller.tick()

    assert [s.gpu.index for s in first.samples] == [0, 1, 2]
    assert (first.sequence, second.sequence) == (1, 2)
    assert history.latest is second
    assert len(history) == 2


async def test_hung_read_marks_only_that_gpu_missing() -> None:
    """A read that hangs makes that GPU's sample a TIMEOUT; the tick still ends on time with the others."""
    collector = FakeCollector(node="n", gpu_count=3)
    collector.set_values(None, {Metric.GPU_UTILIZATION: 50.0})
    poller, _ = await started_poller(collector)
    collector.fail(1, Failure.TIMEOUT)
    try:
        started = time.perf_counter()
        snapshot = await poller.tick()
        elapsed = time.perf_counter() - started

        hung = snapshot.samples[1]
        assert [(e.field, e.kind) for e in hung.errors] == [(DEVICE_FIELD, ReadErrorKind.TIMEOUT)]
        assert snapshot.samples[0].value(Metric.GPU_UTILIZATION) == 50.0
        assert snapshot.samples[2].value(Metric.GPU_UTILIZATION) == 50.0
        assert elapsed < 1.0  # the read timeout is 0.08 s; the hung read would block for 60 s

        again = await poller.tick()
        assert "previous read has not returned" in again.samples[1].errors[0].detail
    finally:
        collector.heal(None)


async def test_gpu_comes_back_after_heal() -> None:
    """Once a hung read returns and the GPU is healed, the next ticks read it again."""
    collector = FakeCollector(node="n", gpu_count=2)
    poller, _ = await started_poller(collector)
    collector.fail(0, Failure.TIMEOUT)
    await poller.tick()
    collector.heal(0)
    await asyncio.sleep(0.05)  # let the released thread finish its read
    snapshot = await poller.tick()
    assert snapshot.samples[0].value(Metric.TEMPERATURE) == 30.0


async def test_listener_errors_do_not_stop_sampling() -> None:
    """A failing snapshot listener is logged; later listeners still run and the tick completes."""
    collector = FakeCollector(node="n", gpu_count=1)
    seen: list[int] = []

    def broken(snapshot: Snapshot) -> None:
        raise RuntimeError("listener bug")

    history = History(history_seconds=60, poll_interval_seconds=0.1)
    history.add_listener(broken)
    history.add_listener(lambda s: seen.append(s.sequence))
    poller = Poller(collector, history, poll_interval_seconds=0.1)
    await poller.start()
    await poller.tick()
    assert seen == [1]


async def test_run_keeps_ticking_on_schedule() -> None:
    """run() produces about one snapshot per interval until cancelled."""
    collector = FakeCollector(node="n", gpu_count=1)
    poller, history = await started_poller(collector, interval=0.05)
    task = asyncio.create_task(poller.run())
    await asyncio.sleep(0.6)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert 5 <= len(history) <= 14
