"""CoalescingTransport: what one turn writes goes out as one write, held over a few turns while more answers come."""

from __future__ import annotations

import asyncio
from typing import cast

from gpuscaler.server.transport.h2 import HOLD_BYTES, HOLD_TURNS, CoalescingTransport


class Recorded:
    """A transport that records each write."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.writes.append(data)

    def close(self) -> None:
        self.closed = True


def coalescing() -> tuple[CoalescingTransport, Recorded]:
    """A CoalescingTransport over a recording transport, and the recording."""
    recorded = Recorded()
    return CoalescingTransport(cast(asyncio.Transport, recorded)), recorded


async def turns(count: int) -> None:
    """Let ``count`` iterations of the event loop run."""
    for _ in range(count):
        await asyncio.sleep(0)  # one iteration of the event loop


async def test_what_one_turn_writes_goes_out_as_one_write_at_its_end() -> None:
    """Writes in one turn are joined and sent once, in order, when the turn ends."""
    transport, recorded = coalescing()
    transport.write(b"headers")
    transport.write(b"data")
    assert recorded.writes == []
    await turns(1)
    assert recorded.writes == [b"headersdata"]


async def test_answers_are_held_over_turns_while_holding_and_sent_together() -> None:
    """While holding, answers written in several turns go out in one write after HOLD_TURNS turns."""
    transport, recorded = coalescing()
    transport.holding = True
    for turn in range(HOLD_TURNS):
        transport.write(bytes([turn]))
        await turns(1)
        assert recorded.writes == []
    await turns(1)
    assert recorded.writes == [bytes(range(HOLD_TURNS))]


async def test_held_answers_go_out_at_the_turn_after_holding_ends() -> None:
    """Once the connection's turns run out, what was held goes out at the end of the next turn."""
    transport, recorded = coalescing()
    transport.holding = True
    transport.write(b"a")
    await turns(2)
    transport.holding = False
    assert recorded.writes == []
    await turns(1)
    assert recorded.writes == [b"a"]


async def test_held_answers_go_out_at_once_past_hold_bytes() -> None:
    """A hold of HOLD_BYTES or more is not held over another turn."""
    transport, recorded = coalescing()
    transport.holding = True
    transport.write(b"x" * HOLD_BYTES)
    await turns(1)
    assert recorded.writes == [b"x" * HOLD_BYTES]


async def test_close_sends_what_is_held_first() -> None:
    """Closing writes what was held before the socket closes, holding or not."""
    transport, recorded = coalescing()
    transport.holding = True
    transport.write(b"goaway")
    transport.close()
    assert recorded.writes == [b"goaway"]
    assert recorded.closed
