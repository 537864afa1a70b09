"""The turn budget: every turn of every connection takes in at most --turn-calls calls, alone or beside others."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import h2.events
import pytest

from gpuscaler.server.transport.h2 import BoundedH2Connection
from tests.conftest import StartAgent
from tests.server.transport.test_limits import EMPTY_REF, IS_ACTIVE, _Peer
from tests.server.transport.test_many_streams import request_headers


def _record_turns(monkeypatch: pytest.MonkeyPatch) -> dict[BoundedH2Connection, list[int]]:
    """The calls each connection took in at each of its turns, in order."""
    turns: dict[BoundedH2Connection, list[int]] = defaultdict(list)
    receive_turn = BoundedH2Connection.receive_turn

    def recorded(self: BoundedH2Connection, *args: Any, **kwargs: Any) -> Any:
        events, more = receive_turn(self, *args, **kwargs)
        turns[self].append(sum(isinstance(event, h2.events.RequestReceived) for event in events))
        return events, more

    monkeypatch.setattr(BoundedH2Connection, "receive_turn", recorded)
    return turns


def _flood(peer: _Peer, calls: int) -> None:
    """``calls`` IsActive calls in one write."""
    for stream_id in range(1, 2 * calls, 2):
        peer.h2.send_headers(stream_id, request_headers(IS_ACTIVE))
        peer.h2.send_data(stream_id, EMPTY_REF, end_stream=True)
    peer.send()


def _ended(peer: _Peer) -> int:
    return sum(isinstance(event, h2.events.StreamEnded) for event in peer.events)


async def test_a_flood_beside_single_calls_is_taken_in_turn_calls_a_turn(
    start_agent: StartAgent, monkeypatch: pytest.MonkeyPatch
) -> None:
    """200 calls in one write on one connection, with single calls on another meanwhile (KEDA's other component),
    are taken in at most --turn-calls a turn: no connection gets a larger turn for having the loop to itself."""
    turns = _record_turns(monkeypatch)
    agent = await start_agent("--turn-calls", "2")
    busy, side = await _Peer.connect(agent.port), await _Peer.connect(agent.port)
    try:
        _flood(busy, 200)
        side.call(1)  # read while the flood's frames wait for their turns
        await side.read_until(lambda: _ended(side) == 1)
        await busy.read_until(lambda: _ended(busy) == 200)
        side.call(3)  # and once the flood is over
        await side.read_until(lambda: _ended(side) == 2)
    finally:
        busy.close()
        side.close()
    [flooded] = [taken for taken in turns.values() if sum(taken) == 200]
    assert len(flooded) >= 100
    assert max(flooded) == 2


async def test_two_floods_at_once_are_each_taken_in_turn_calls_a_turn(
    start_agent: StartAgent, monkeypatch: pytest.MonkeyPatch
) -> None:
    """200 calls in one write on each of two connections are each taken in at most --turn-calls a turn, and
    every call is answered."""
    turns = _record_turns(monkeypatch)
    agent = await start_agent("--turn-calls", "2")
    first, second = await _Peer.connect(agent.port), await _Peer.connect(agent.port)
    try:
        _flood(first, 200)
        _flood(second, 200)
        await first.read_until(lambda: _ended(first) == 200)
        await second.read_until(lambda: _ended(second) == 200)
    finally:
        first.close()
        second.close()
    flooded = [taken for taken in turns.values() if sum(taken) == 200]
    assert len(flooded) == 2
    assert all(max(taken) == 2 for taken in flooded)
