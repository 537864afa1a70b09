"""What a push stream costs the event loop besides its message: wake-ups in turns, log lines within a budget."""

from __future__ import annotations

import asyncio

import structlog

from gpuscaler.server.push_streams import QueuedEvent, StreamLines
from gpuscaler.server.transport import sliced_work
from tests.waiting import until


async def test_a_change_wakes_push_streams_a_slice_a_turn() -> None:
    """Setting many streams' events sets none in that turn, then PER_SLICE of them in each turn after, oldest first."""
    events = [QueuedEvent() for _ in range(2 * sliced_work.PER_SLICE + 5)]
    for event in events:
        event.set()
        event.set()  # twice: still one wake-up
    assert not any(event.is_set() for event in events)
    seen = []
    while not all(event.is_set() for event in events):
        await asyncio.sleep(0)  # one turn
        seen.append(sum(event.is_set() for event in events))
    assert seen == [sliced_work.PER_SLICE, 2 * sliced_work.PER_SLICE, len(events)]
    assert [event.is_set() for event in events] == [True] * len(events)


async def test_a_waiting_stream_wakes_and_can_wait_again() -> None:
    """A stream's wait returns once its queued set has its turn; cleared, the next set wakes it again."""
    event = QueuedEvent()
    waiter = asyncio.create_task(event.wait())
    event.set()
    await asyncio.wait_for(waiter, 5)
    event.clear()
    again = asyncio.create_task(event.wait())
    await asyncio.sleep(0)
    assert not again.done()
    event.set()
    await asyncio.wait_for(again, 5)


async def test_stream_lines_log_up_to_the_budget_then_one_line_counts_the_rest() -> None:
    """Past the budget no line is logged per stream; at the interval's end one line says how many were left out."""
    lines = StreamLines("stream_opened", budget=3, every_seconds=0.2)
    with structlog.testing.capture_logs() as logged:
        for index in range(10):
            lines(scaled_object=f"ml/app-{index}")
        opened = [entry for entry in logged if entry["event"] == "stream_opened"]
        assert [entry["scaled_object"] for entry in opened] == ["ml/app-0", "ml/app-1", "ml/app-2"]
        await until(lambda: any(entry["event"] == "stream_lines_left_out" for entry in logged))
        [left_out] = [entry for entry in logged if entry["event"] == "stream_lines_left_out"]
        assert (left_out["line"], left_out["left_out"], left_out["budget"]) == ("stream_opened", 7, 3)
        assert lines.left_out == 0


async def test_each_interval_has_its_own_budget() -> None:
    """Once the interval has passed, lines are logged again, after the count of those left out before."""
    now = 100.0
    lines = StreamLines("stream_closed", budget=1, every_seconds=10.0, clock=lambda: now)
    with structlog.testing.capture_logs() as logged:
        lines(scaled_object="ml/a")
        lines(scaled_object="ml/b")
        now += 10.0
        lines(scaled_object="ml/c")
    assert [(entry["event"], entry.get("scaled_object", entry.get("left_out"))) for entry in logged] == [
        ("stream_closed", "ml/a"),
        ("stream_lines_left_out", 1),
        ("stream_closed", "ml/c"),
    ]
