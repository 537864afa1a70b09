"""Push streams beside the poll loop (issue 31, row 5): thousands of StreamIsActive on one connection, opened at
once, moved by a change of state and dropped at once, cost the poll loop no tick.

The agent polls every 0.1 s, so a turn of its event loop that holds it 0.1 s makes a tick late (``poll_behind``).
Before, the connection's close cancelled every stream in one callback and ran every cleanup in the next turn, and a
change of state woke every stream in one turn: 5,000 streams held the loop past a tick. Here each of those is done a
slice a turn. Ticks are judged by the agent's own rule (``poll_behind``: a tick that ends past the next one's
start, with how many it missed) from the moment every stream has its first message on: while thousands open, the
cycle collector's full collections (docs/security.md) can hold the loop near 0.1 s on a busy machine, before as
after. Through the change of state and the close one missed tick is allowed, a moment of a busy machine (a full
collection that comes then, rare now that `serve` makes them wait for 100 middle-generation ones); before, the
close alone missed 2 ticks in every run at load 0.6 (a full collection walking the closed streams' cycles among
them, which a stream no longer leaves). bench/stream_ticks.py measures 10,000 streams, CPU per tick and a good
caller's latency beside them.
"""

from __future__ import annotations

import time
from collections import Counter
from datetime import datetime

import grpc

from e2e.conftest import StartAgent
from e2e.support import attacks
from e2e.support.attacks import DATA, good_caller, open_streams, raw_peer, ref_body
from e2e.support.clients import GrpcioScaler
from e2e.support.control import Control
from e2e.support.keda_grpcio import KedaProto

STREAMS = 5000
POLL_INTERVAL_SECONDS = 0.1
OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]
# Ticks a change of state of every stream, and their close, may make the poll loop miss: a moment of a busy machine.
MISSED_TICKS_ALLOWED = 1


def logged_at(event: dict[str, object]) -> float:
    """When the agent logged ``event``, in Unix seconds."""
    return datetime.fromisoformat(str(event["timestamp"]).replace("Z", "+00:00")).timestamp()


def messages_per_stream(peer: attacks.RawPeer) -> Counter[int]:
    """Messages the agent sent on each stream so far (one DATA frame with a payload each)."""
    return Counter(f.stream_id for f in peer.frames if f.kind == DATA and f.payload)


async def test_thousands_of_push_streams_cost_the_poll_loop_no_tick(
    start_agent: StartAgent, keda_proto: KedaProto
) -> None:
    """5,000 StreamIsActive on one connection, opened at once, each sent its state, then its new state when the
    query activates, then dropped at once: once they are open at most one tick is missed, health stays SERVING
    throughout, a good caller beside them is answered every time, and the agent's stream and task gauges are back
    to 0 after."""
    agent = await start_agent(poll_interval=POLL_INTERVAL_SECONDS)
    client = GrpcioScaler(grpc.aio.insecure_channel(agent.address, options=OWN_CONNECTION), keda_proto)
    try:
        async with good_caller(client) as good, Control(agent) as control:
            async with raw_peer(agent.port) as peer:
                for first in range(0, STREAMS, 500):
                    await peer.send(open_streams(1 + 2 * first, 500, body=ref_body()))
                await peer.wait_for(lambda: len(messages_per_stream(peer)) == STREAMS, "every stream's state", 60)
                opened = time.time()
                await control.set(0, {"gpu_utilization": 90.0})  # the query activates: every stream is sent True
                await peer.wait_for(lambda: min(messages_per_stream(peer).values()) == 2, "every new state", 60)
                assert set(messages_per_stream(peer).values()) == {2}, "a stream was sent a state twice"
            # The connection is gone: its streams end a slice a turn, while ticks and the good caller go on.
            for gauge in ("gpuscaler_grpc_streams", "gpuscaler_grpc_handler_tasks"):
                await attacks.until_metric(agent.metrics_port, gauge, lambda value: value == 0, timeout=30)
            await good.answered(3)
    finally:
        await client.close()
    late = [(e["missed_ticks"], e["lag_seconds"]) for e in agent.events("poll_behind") if logged_at(e) >= opened]
    missed = sum(int(ticks) for ticks, _ in late)
    assert missed <= MISSED_TICKS_ALLOWED, (
        f"{missed} ticks missed once the streams were open, {MISSED_TICKS_ALLOWED} allowed (missed ticks, "
        f"seconds late): {late}"
    )
    assert [e for e in agent.events("health_changed") if not e.get("serving")] == []
    good.check()
