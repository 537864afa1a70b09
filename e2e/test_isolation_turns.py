"""Fair turns on the loop (issue 31, row 6): one peer's flood of calls costs that peer, not every other caller.

Each test starts an agent with small limits, floods it from one loopback address (127.0.0.2) in one of row 6's
three ways, and keeps a well-behaved caller (GetMetrics one after another on its own grpcio channel, as KEDA
polls) beside it: calls that claim a 100 ms deadline and are reset at once (the fixed 100 ms slack once excused
every one), resets 100 to a connection with a reconnect after each (a budget per connection started full every
time), and plain calls that are never reset (nothing to cut off: the turn budget reorders them). Each checks what
the limit does on the wire, that ``gpuscaler_grpc_limited_total`` counted it and the log said so (for the turn
budget, which refuses nothing, ``gpuscaler_grpc_turns_deferred_total`` and an info line), and that the good caller
was answered without error; the last checks that many calls on one connection, as KEDA sends, are all answered
and that no limit acted on them. bench/attacks.py runs the three floods at full size and compares the good
caller's latency.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import AsyncIterator

import grpc

from e2e.conftest import StartAgent
from e2e.support import attacks
from e2e.support.agent import AgentProcess
from e2e.support.attacks import GOOD_QUERY, METRIC_NAME, GoodCaller, good_caller, limited, raw_peer
from e2e.support.clients import GrpcioScaler
from e2e.support.keda_grpcio import KedaProto

ATTACKER = "127.0.0.2"  # another host, as far as the agent can tell
OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]
RESETS = ("--max-resets-per-second", "20")  # bursts of 200
ENHANCE_YOUR_CALM = "ENHANCE_YOUR_CALM"


@contextlib.asynccontextmanager
async def calling(agent: AgentProcess, proto: KedaProto) -> AsyncIterator[GoodCaller]:
    """A GoodCaller on its own grpcio channel and connection to ``agent``, for the block."""
    client = await GrpcioScaler.connect(agent, proto, options=OWN_CONNECTION)
    try:
        async with good_caller(client) as good:
            yield good
    finally:
        await client.close()


async def acted(agent: AgentProcess, limit: str) -> float:
    """How often ``limit`` has acted so far."""
    return await asyncio.to_thread(limited, agent.metrics_port, limit)


async def deferred(agent: AgentProcess) -> float:
    """How many reads have had part of their frames left for a later turn so far."""
    return await asyncio.to_thread(attacks.metric, agent.metrics_port, "gpuscaler_grpc_turns_deferred_total")


def logged_limits(agent: AgentProcess) -> set[str]:
    """The ``limit`` of every ``grpc_limited`` log line."""
    return {str(event.get("limit")) for event in agent.events("grpc_limited")}


async def test_resets_claiming_a_short_deadline_count_as_rapid(start_agent: StartAgent, keda_proto: KedaProto) -> None:
    """HEADERS, DATA and RST_STREAM on one connection, each call claiming grpc-timeout 100m: reset before it
    lived most of that deadline, each counts as a rapid reset, so the connection gets GOAWAY ENHANCE_YOUR_CALM
    after the burst; the good caller is answered throughout."""
    agent = await start_agent(*RESETS)
    async with calling(agent, keda_proto) as good, raw_peer(agent.port, source=ATTACKER) as peer:
        await attacks.reset_streams(peer, 2_000, batch=50, timeout="100m", deadline=time.monotonic() + 20)
        goaway = await peer.wait_goaway(timeout=10)
        assert goaway.error == ENHANCE_YOUR_CALM, goaway
        assert await acted(agent, "reset_flood") == 1
        assert "reset_flood" in logged_limits(agent)
        await good.answered(5)
    good.check()


async def test_reconnecting_does_not_refill_the_reset_budget(start_agent: StartAgent, keda_proto: KedaProto) -> None:
    """Rapid resets 100 to a connection, each followed by a new connection from the same address: the budget
    (bursts of 200) is the address's, so a later connection is cut off with ENHANCE_YOUR_CALM, and every one
    after it soon after it starts; the good caller is answered throughout."""
    agent = await start_agent(*RESETS)
    async with calling(agent, keda_proto) as good:
        result = await attacks.rapid_reset(agent.port, 600, batch=50, per_connection=100, seconds=15, source=ATTACKER)
        # With a budget per connection, 100 resets each would never reach a burst of 200.
        assert result.goaways[ENHANCE_YOUR_CALM] >= 1, result
        assert await acted(agent, "reset_flood") >= 1
        assert "reset_flood" in logged_limits(agent)
        await good.answered(5)
    good.check()


async def test_a_flood_of_plain_calls_takes_its_turns(start_agent: StartAgent, keda_proto: KedaProto) -> None:
    """3,000 GetMetrics pipelined on one connection, 1,000 in flight, never reset: nothing to cut off, so the
    turn budget (--turn-calls 4) defers them and counts it at info, no limit acts, every flood call is answered,
    none refused, and the good caller is answered while the flood is still going."""
    agent = await start_agent("--turn-calls", "4")
    async with calling(agent, keda_proto) as good, raw_peer(agent.port, source=ATTACKER) as peer:
        answered_before = len(good.latencies)
        flood = await attacks.call_flood(peer, 3_000, in_flight=1_000, seconds=60)
        assert (flood.answered, flood.refused, flood.goaway) == (3_000, 0, None), flood
        assert len(good.latencies) > answered_before, "the good caller got no answer during the flood"
        assert await deferred(agent) >= 1
        assert agent.events("grpc_turn_deferred"), "no grpc_turn_deferred line"
        assert all(event.get("level") == "info" for event in agent.events("grpc_turn_deferred"))
        assert logged_limits(agent) == set()
        await good.answered(5)
    good.check()


async def test_many_calls_on_one_connection_are_all_answered(start_agent: StartAgent, keda_proto: KedaProto) -> None:
    """1,000 GetMetrics and IsActive at once on one grpcio channel, as KEDA sends every ScaledObject's polls on
    one connection, under a small turn budget (--turn-calls 4): the budget acts, and every call is answered OK."""
    agent = await start_agent("--turn-calls", "4")
    channel = grpc.aio.insecure_channel(agent.address, options=OWN_CONNECTION)
    stub = keda_proto.stub(channel)
    codes: Counter[str] = Counter()

    async def one(index: int) -> None:
        try:
            if index % 2:
                await stub.IsActive(keda_proto.ref(GOOD_QUERY, name=f"so-{index}"), timeout=30)
            else:
                await stub.GetMetrics(keda_proto.metrics_request(GOOD_QUERY, METRIC_NAME), timeout=30)
            codes["OK"] += 1
        except grpc.aio.AioRpcError as error:
            codes[error.code().name] += 1

    try:
        await stub.IsActive(keda_proto.ref(GOOD_QUERY), timeout=10)  # connected
        await asyncio.gather(*(one(index) for index in range(1_000)))
    finally:
        await channel.close()
    assert codes == {"OK": 1_000}, codes
    assert await deferred(agent) >= 1
    assert logged_limits(agent) == set()  # KEDA's own traffic is not shown as limited
