"""Hostile transports (issue 19): floods, resets, silence and unread output on the gRPC port, cut off by the limits.

Each test starts a real agent (and, for the rapid reset, a gateway) with the limit under test set small, runs
one attack of issue 19 beside a well-behaved caller (``GoodCaller``: GetMetrics one after another on its own
grpcio channel, as KEDA polls), and checks what the limit does on the wire (GOAWAY ENHANCE_YOUR_CALM, the
close, REFUSED_STREAM, DEADLINE_EXCEEDED), that ``gpuscaler_grpc_limited_total`` counted it under its label and
the log said so, that the stream and handler-task gauges come back to 0, that resident memory comes back within
bounds, and that the good caller saw no error. bench/attacks.py runs the same attacks at full size.

The last tests pin what held in issue 19: each protocol violation gets a GOAWAY with its error code before
the close, and the server goes on serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gzip
import json
import ssl
import struct
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import grpc
import hpack
import pytest

from e2e.conftest import StartAgent
from e2e.support import attacks
from e2e.support.agent import AgentProcess
from e2e.support.attacks import (
    END_HEADERS,
    END_STREAM,
    GET_METRICS,
    HEADERS,
    IS_ACTIVE,
    SETTINGS_MAX_CONCURRENT_STREAMS,
    GoodCaller,
    RawPeer,
    frame,
    good_caller,
    header_block,
    limited,
    metric,
    metrics_body,
    open_streams,
    ping_frame,
    raw_peer,
    ref_body,
    request_frames,
    rss_mib,
    rst_stream_frame,
    settings_frame,
    silent_flood,
    until_metric,
    window_update_frame,
)
from e2e.support.certs import TlsFiles
from e2e.support.clients import GrpcioScaler
from e2e.support.control import Control
from e2e.support.keda_grpcio import KedaProto
from e2e.support.process import Process
from e2e.support.raw_h2 import PREFACE, grpc_call
from e2e.support.sizes import FULL, FULL_REASON
from gpuscaler.server.transport.limits import CALL_RESERVE

STREAMS = "gpuscaler_grpc_streams"
HANDLER_TASKS = "gpuscaler_grpc_handler_tasks"
CONNECTIONS = "gpuscaler_grpc_connections"
RPC_HANDLED = "gpuscaler_rpc_handled_total"
STREAM_IS_ACTIVE = "/externalscaler.ExternalScaler/StreamIsActive"
REFUSED_STREAM, ENHANCE_YOUR_CALM, NO_ERROR = 0x7, "ENHANCE_YOUR_CALM", "NO_ERROR"
# Resident memory after an attack against before it: loose, as the allocator keeps some of what it was given.
RSS_RATIO, RSS_SLACK_MIB = 1.3, 10.0
ROOT = Path(__file__).resolve().parents[1]
OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]
FULL_MARKS = [pytest.mark.full, pytest.mark.skipif(not FULL, reason=FULL_REASON)]


@contextlib.asynccontextmanager
async def calling(agent: AgentProcess, proto: KedaProto) -> AsyncIterator[GoodCaller]:
    """A GoodCaller on its own grpcio channel to ``agent`` (TLS if the agent serves it), for the block.

    Its own connection too: grpcio channels with the same target share one by default.
    """
    client = await GrpcioScaler.connect(agent, proto, options=OWN_CONNECTION)
    try:
        async with good_caller(client) as good:
            yield good
    finally:
        await client.close()


async def settled(metrics_port: int, good: GoodCaller | None = None, timeout: float = 15.0) -> None:
    """Wait until no stream is open and no request handler task is alive (the good caller paused meanwhile)."""
    with good.paused() if good is not None else contextlib.nullcontext():
        await until_metric(metrics_port, STREAMS, lambda v: v == 0, timeout=timeout)
        await until_metric(metrics_port, HANDLER_TASKS, lambda v: v == 0, timeout=timeout)


def logged_limits(process: AgentProcess | Process) -> set[str]:
    """The ``limit`` of every ``grpc_limited`` log line."""
    return {str(event.get("limit")) for event in process.events("grpc_limited")}


def has_settings(peer: RawPeer) -> bool:
    """The server's SETTINGS has arrived on ``peer``."""
    return bool(peer.server_settings)


def all_ended(peer: RawPeer, streams: Sequence[int]) -> bool:
    """The server has ended every one of ``streams`` on ``peer``."""
    return all(peer.ended(i) for i in streams)


def assert_rss_back(before: float, after: float) -> None:
    """Resident memory after an attack is back within RSS_RATIO (plus RSS_SLACK_MIB) of before it."""
    assert after <= before * RSS_RATIO + RSS_SLACK_MIB, f"RSS {before:.1f} MiB before, {after:.1f} MiB after"


async def scrape_value(port: int, name: str, **labels: str) -> float:
    """``metric`` without blocking the loop."""
    return await asyncio.to_thread(metric, port, name, **labels)


async def limited_now(port: int, limit: str) -> float:
    """How often ``limit`` has acted so far."""
    return await asyncio.to_thread(limited, port, limit)


async def until_limited(port: int, limit: str, at_least: float, timeout: float = 10.0) -> float:
    """Wait until ``limit`` has acted at least ``at_least`` times."""
    return await until_metric(
        port, "gpuscaler_grpc_limited_total", lambda v: v >= at_least, timeout=timeout, limit=limit
    )


# Row 2: rapid reset (CVE-2023-44487)


async def test_rapid_reset_gets_enhance_your_calm_and_leaves_nothing_behind(
    start_agent: StartAgent, keda_proto: KedaProto
) -> None:
    """2,000 HEADERS+DATA+RST_STREAM on one connection, past 20 resets/s: GOAWAY ENHANCE_YOUR_CALM, then the close."""
    agent = await start_agent("--max-resets-per-second", "20")
    port = agent.metrics_port
    async with calling(agent, keda_proto) as good:
        await settled(port, good)
        rss_before = rss_mib(agent.pid)
        async with raw_peer(agent.port) as peer:
            sent = await attacks.reset_streams(peer, 2_000, batch=50, deadline=time.monotonic() + 20)
            goaway = await peer.wait_goaway(timeout=10)
            assert goaway.error == ENHANCE_YOUR_CALM, goaway
            await peer.wait_closed(timeout=10)
            # A burst of 10 s worth (200) passes; the GOAWAY names the last stream the server took.
            assert 2 * 200 < goaway.last_stream_id < 2 * sent, (goaway, sent)
        await until_limited(port, "reset_flood", 1)
        assert "reset_flood" in logged_limits(agent)
        await good.answered(5)
        await settled(port, good)
        assert_rss_back(rss_before, rss_mib(agent.pid))
        assert await asyncio.to_thread(agent.health) == "SERVING"
    good.check()


async def test_resets_under_the_limit_leave_no_stream_behind_on_a_live_connection(
    start_agent: StartAgent, keda_proto: KedaProto
) -> None:
    """Five rounds of 50 HEADERS+DATA+RST_STREAM in one write each, under the reset limit: the connection stays,
    and after each round no stream, task or slot of the reset calls is held (a reset can come before the call's
    task has run at all, as a KEDA cancel or a 1 ms deadline does)."""
    agent = await start_agent("--max-resets-per-second", "100")
    port = agent.metrics_port
    async with calling(agent, keda_proto) as good, raw_peer(agent.port) as peer:
        with good.paused():
            for round_ in range(5):
                await attacks.reset_streams(peer, 50, batch=50, first_stream=1 + 100 * round_)
                await until_metric(port, STREAMS, lambda v: v == 0)
                await until_metric(port, HANDLER_TASKS, lambda v: v == 0)
            assert not peer.closed, peer.describe()
            assert peer.goaway is None, peer.describe()
        await peer.send(request_frames(501, header_block(GET_METRICS), metrics_body()))
        await peer.wait_for(lambda: peer.headers(501).get("grpc-status") == "0", "GetMetrics on the same connection")
        assert await limited_now(port, "reset_flood") == 0
        await good.answered(5)
    good.check()


async def test_rapid_reset_against_the_gateway(start_agent: StartAgent, keda_proto: KedaProto, tmp_path: Path) -> None:
    """The gateway's gRPC port holds the same limit: ENHANCE_YOUR_CALM, the close, its KEDA callers served."""
    agent = await start_agent()
    gateway = await asyncio.to_thread(
        attacks.gateway_process([agent.address], tmp_path, "--max-resets-per-second", "20").start
    )
    try:
        port = attacks.metrics_port_of(gateway)
        assert gateway.process is not None
        client = GrpcioScaler(
            grpc.aio.insecure_channel(f"127.0.0.1:{gateway.port}", options=OWN_CONNECTION), keda_proto
        )
        try:
            async with good_caller(client, {}) as good:
                await settled(port, good)
                rss_before = rss_mib(gateway.process.pid)
                async with raw_peer(gateway.port) as peer:
                    await attacks.reset_streams(
                        peer, 2_000, batch=50, deadline=time.monotonic() + 20, body=ref_body({})
                    )
                    goaway = await peer.wait_goaway(timeout=10)
                    assert goaway.error == ENHANCE_YOUR_CALM, goaway
                    await peer.wait_closed(timeout=10)
                await until_limited(port, "reset_flood", 1)
                assert "reset_flood" in logged_limits(gateway)
                await good.answered(5)
                await settled(port, good)
                assert_rss_back(rss_before, rss_mib(gateway.process.pid))
            good.check()
        finally:
            await client.close()
    finally:
        code = await gateway.terminate()
    assert code == 0, gateway.tail()


# Row 3: ordinary cancels from a real grpcio client


async def test_grpcio_cancels_leave_no_task_and_no_stream(start_agent: StartAgent, keda_proto: KedaProto) -> None:
    """600 cancels from grpcio (push streams after their first message, unary calls in flight), at 100/s, under
    the reset limit: the channel is never cut, and every cancelled call's task, stream and slot is gone after."""
    agent = await start_agent("--max-resets-per-second", "100")
    port = agent.metrics_port
    async with calling(agent, keda_proto) as good:
        await settled(port, good)
        rss_before = rss_mib(agent.pid)
        cancelled_before = await scrape_value(port, RPC_HANDLED, method=STREAM_IS_ACTIVE, code="CANCELLED")
        child = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "e2e.support.attacks",
            "grpcio-cancels",
            "--port",
            str(agent.port),
            "--count",
            "600",
            "--rate",
            "100",
            "--seconds",
            "60",
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            cwd=ROOT,
        )
        try:
            async with asyncio.timeout(90):
                out, err = await child.communicate()
        finally:
            if child.returncode is None:
                child.kill()
                await child.wait()
        assert child.returncode == 0, err.decode()[-3000:]
        report = json.loads(out.decode().splitlines()[-1])
        assert report["cancelled"] == 600, report
        assert report["outcome"] == {"final_call_ok": 1}, report
        # Every cancelled push stream counts as CANCELLED (KEDA going away), and none is still held.
        await until_metric(
            port, RPC_HANDLED, lambda v: v - cancelled_before == 300, method=STREAM_IS_ACTIVE, code="CANCELLED"
        )
        await settled(port, good)
        assert await scrape_value(port, "gpuscaler_rpc_in_flight", method=STREAM_IS_ACTIVE) == 0
        assert await limited_now(port, "reset_flood") == 0
        assert_rss_back(rss_before, rss_mib(agent.pid))
    good.check()


# Row 4: connections that never speak, or stop speaking


async def test_silent_connections_are_closed_after_the_handshake_timeout(
    start_agent: StartAgent, keda_proto: KedaProto
) -> None:
    """Connections that send nothing, half a preface, or the preface without SETTINGS are closed after 0.5 s."""
    agent = await start_agent("--handshake-timeout", "0.5")
    port = agent.metrics_port
    async with calling(agent, keda_proto) as good:
        results = await asyncio.gather(
            attacks.idle_connections(agent.port, 20, hold_seconds=10),
            attacks.idle_connections(agent.port, 5, hold_seconds=10, first_bytes=PREFACE[:10]),
            attacks.idle_connections(agent.port, 5, hold_seconds=10, first_bytes=PREFACE),
        )
        for result in results:
            assert result.opened in (5, 20), result.summary()
            assert result.still_open == 0, result.summary()
            assert all(0.3 < seconds < 5 for seconds in result.closed_after), result.summary()
        await until_limited(port, "handshake_timeout", 30)
        assert "handshake_timeout" in logged_limits(agent)
        await until_metric(port, CONNECTIONS, lambda v: v <= 1)  # the good caller's alone
        await good.answered(5)
    good.check()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("connections", [pytest.param(200, id="ci"), pytest.param(2_000, id="full", marks=FULL_MARKS)])
async def test_many_idle_tcp_connections_are_all_closed(
    start_agent: StartAgent, keda_proto: KedaProto, connections: int
) -> None:
    """Issue 19's 2,000 idle TCP connections from one address: each is closed (past 16 at once, right after accept
    while that address's connections yet to call are under a second old), none is kept."""
    agent = await start_agent("--handshake-timeout", "1", "--max-connections", "16")
    port = agent.metrics_port
    async with calling(agent, keda_proto) as good:
        rss_before, fds_before = rss_mib(agent.pid), attacks.open_fds(agent.pid)
        result = await attacks.idle_connections(agent.port, connections, hold_seconds=30)
        assert result.still_open == 0, result.summary()
        assert result.opened + result.refused == connections, result.summary()
        await until_limited(port, "handshake_timeout", 1)
        await until_limited(port, "max_pending_connections", 1)
        await until_metric(port, CONNECTIONS, lambda v: v <= 1)
        await good.answered(5)
        assert attacks.open_fds(agent.pid) <= fds_before + 2
        assert_rss_back(rss_before, rss_mib(agent.pid))
    good.check()


async def test_a_connection_without_streams_gets_goaway_after_the_idle_timeout(
    start_agent: StartAgent, keda_proto: KedaProto
) -> None:
    """After 1 s with no stream: GOAWAY NO_ERROR and the close. A connection holding a push stream is kept."""
    agent = await start_agent("--idle-timeout", "1")
    port = agent.metrics_port
    async with calling(agent, keda_proto) as good, raw_peer(agent.port) as holder:
        await holder.send(open_streams(1, 1, body=ref_body()))
        await holder.wait_for(lambda: holder.messages(1) == 1, "the held push stream's first message")
        # Opened after the holder's last new stream: once this one is closed as idle, so could the holder be.
        async with raw_peer(agent.port) as idle:
            goaway = await idle.wait_goaway(timeout=10)
            assert goaway.error == NO_ERROR, goaway
            await idle.wait_closed(timeout=5)
        await until_limited(port, "idle_timeout", 1)
        assert "idle_timeout" in logged_limits(agent)
        assert holder.goaway is None, holder.describe()
        assert not holder.closed, holder.describe()
        await holder.send(request_frames(3, header_block(GET_METRICS), metrics_body()))
        await holder.wait_for(lambda: holder.headers(3).get("grpc-status") == "0", "GetMetrics on the held connection")
        await good.answered(5)  # a caller with calls going never idles
    good.check()


async def test_connections_past_max_connections_are_closed_at_once(
    start_agent: StartAgent, keda_proto: KedaProto
) -> None:
    """With 16 allowed, the good caller's one open and 15 more that have each made a call, the next 5 are closed
    before any SETTINGS; once some close, a new one is served again."""
    agent = await start_agent("--max-connections", "16", "--handshake-timeout", "30", "--idle-timeout", "60")
    port = agent.metrics_port
    async with calling(agent, keda_proto) as good, contextlib.AsyncExitStack() as stack:
        await until_metric(port, CONNECTIONS, lambda v: v == 1)
        held = [await stack.enter_async_context(raw_peer(agent.port)) for _ in range(15)]
        for peer in held:  # a connection that has made a call is no longer one a newcomer may displace
            await peer.send(request_frames(1, header_block(IS_ACTIVE), ref_body()))
            await peer.wait_for(functools.partial(peer.ended, 1), "the first call's answer")
        await until_metric(port, CONNECTIONS, lambda v: v == 16)
        extra = [await stack.enter_async_context(raw_peer(agent.port, ready=False)) for _ in range(5)]
        for peer in extra:
            await peer.wait_closed(timeout=5)
            assert not peer.frames, peer.describe()
        await until_limited(port, "max_connections", 5)
        assert "max_connections" in logged_limits(agent)
        assert not any(peer.closed for peer in held)
        for peer in held[:5]:
            await peer.close()
        await until_metric(port, CONNECTIONS, lambda v: v == 11)
        async with raw_peer(agent.port) as again:
            await again.send(request_frames(1, header_block(GET_METRICS), metrics_body()))
            await again.wait_for(lambda: again.headers(1).get("grpc-status") == "0", "GetMetrics on a new connection")
        await good.answered(5)
    good.check()


async def test_tls_connections_that_never_finish_the_handshake_are_closed(
    start_agent: StartAgent, keda_proto: KedaProto, certificates: TlsFiles
) -> None:
    """On a TLS port: connections that never send a ClientHello, and ones that finish TLS but send no preface,
    are closed after the 0.5 s handshake timeout; the TLS caller is served throughout."""
    agent = await start_agent("--handshake-timeout", "0.5", tls=certificates)
    port = agent.metrics_port
    context = ssl.create_default_context(cafile=str(certificates.ca))
    async with calling(agent, keda_proto) as good:
        silent, no_preface = await asyncio.gather(
            attacks.idle_connections(agent.port, 20, hold_seconds=10),
            attacks.idle_connections(agent.port, 5, hold_seconds=10, tls=context),
        )
        for result in (silent, no_preface):
            assert result.still_open == 0, result.summary()
            assert result.closed_after, result.summary()
            assert all(seconds < 5 for seconds in result.closed_after), result.summary()
        assert no_preface.opened == 5, no_preface.summary()  # the handshake itself was served
        await until_limited(port, "handshake_timeout", 25)
        await until_metric(port, CONNECTIONS, lambda v: v <= 1)
        await good.answered(5)
    good.check()


# Row 5: streams up to the limit, and past it


async def test_the_stream_past_max_streams_is_refused_and_the_connection_stays(
    start_agent: StartAgent, keda_proto: KedaProto
) -> None:
    """64 push streams on one connection fill --max-streams 64: the 65th gets REFUSED_STREAM, on that connection
    and on another (the limit is the process's), the connection and its 64 streams stay usable, and calls
    still get in (they have places of their own)."""
    agent = await start_agent("--max-streams", "64")
    port = agent.metrics_port
    async with calling(agent, keda_proto) as good, raw_peer(agent.port) as peer:
        await peer.wait_for(lambda: bool(peer.server_settings), "the server's SETTINGS")
        assert peer.server_settings.get(SETTINGS_MAX_CONCURRENT_STREAMS) == 64 + CALL_RESERVE, peer.server_settings
        await until_metric(port, STREAMS, lambda v: v == 0)
        await peer.send(open_streams(1, 64, body=ref_body()))
        ids = range(1, 128, 2)
        await peer.wait_for(lambda: all(peer.messages(i) == 1 for i in ids), "64 first messages")
        await until_metric(port, STREAMS, lambda v: v == 64)

        await peer.send(open_streams(129, 1, body=ref_body()))
        await peer.wait_for(lambda: peer.reset_code(129) is not None, "the 65th stream's end")
        assert peer.reset_code(129) == REFUSED_STREAM, peer.describe()
        async with raw_peer(agent.port) as other:
            await other.send(open_streams(1, 1, body=ref_body()))
            await other.wait_for(lambda: other.reset_code(1) is not None, "another connection's stream end")
            assert other.reset_code(1) == REFUSED_STREAM, other.describe()
        await until_limited(port, "max_streams", 2)
        assert "max_streams" in logged_limits(agent)
        assert peer.goaway is None, peer.describe()
        assert not peer.closed, peer.describe()
        assert not any(peer.ended(i) for i in ids), peer.describe()

        # One stream ends: its slot is free again, and the others still get their pushes.
        await peer.send(rst_stream_frame(1))
        await until_metric(port, STREAMS, lambda v: v == 63)
        async with Control(agent) as control:
            await control.set(None, {"gpu_utilization": 90})
        await peer.wait_for(lambda: all(peer.messages(i) == 2 for i in ids[1:]), "63 pushes of true")
        await until_metric(port, STREAMS, lambda v: v == 63)
        await peer.send(open_streams(131, 1, body=ref_body()))
        await peer.wait_for(lambda: peer.messages(131) == 1, "a new stream in the freed slot")
        await peer.close()
        await until_metric(port, STREAMS, lambda v: v == 0)
        await good.answered(5)
        await settled(port, good)
    good.check()


@pytest.mark.parametrize(
    ("per_connection", "max_streams"),
    [pytest.param(30, 64, id="ci"), pytest.param(16_000, 10_000, id="full", marks=FULL_MARKS)],
)
@pytest.mark.timeout(600)
async def test_headers_only_streams_are_refused_past_the_limit_and_time_out(
    start_agent: StartAgent, keda_proto: KedaProto, per_connection: int, max_streams: int
) -> None:
    """3 connections of HEADERS-only streams (no request message ever): past --max-streams each is refused, the
    rest end DEADLINE_EXCEEDED after --request-timeout, and every slot, task and byte comes back."""
    agent = await start_agent("--max-streams", str(max_streams), "--request-timeout", "1")
    port = agent.metrics_port
    total = 3 * per_connection
    async with calling(agent, keda_proto) as good, contextlib.AsyncExitStack() as stack:
        rss_before = rss_mib(agent.pid)
        peers = [await stack.enter_async_context(raw_peer(agent.port)) for _ in range(3)]
        with good.paused():
            await until_metric(port, STREAMS, lambda v: v == 0)
            for peer in peers:
                for first in range(0, per_connection, 1000):
                    await peer.send(open_streams(1 + 2 * first, min(1000, per_connection - first), body=None))
            ids = [1 + 2 * i for i in range(per_connection)]
            for peer in peers:
                await peer.wait_for(functools.partial(all_ended, peer, ids), "every stream's end", timeout=120)
        refused = sum(1 for p in peers for i in ids if p.reset_code(i) == REFUSED_STREAM)
        timed_out = sum(1 for p in peers for i in ids if p.headers(i).get("grpc-status") == "4")
        assert refused + timed_out == total, (refused, timed_out)
        if total < 1000:  # all sent within the request timeout: exactly the limit is taken, the rest refused
            assert refused == total - max_streams, (refused, timed_out)
        else:  # slots freed by timeouts take later streams while they still arrive
            assert refused >= 1, (refused, timed_out)
            assert timed_out >= max_streams, (refused, timed_out)
        assert not any(p.goaway or p.closed for p in peers), [p.describe() for p in peers]
        await until_limited(port, "request_timeout", max_streams)
        await until_limited(port, "max_streams", 1)
        await good.answered(5)
        await settled(port, good, timeout=60)
        assert_rss_back(rss_before, rss_mib(agent.pid))
    good.check()


@pytest.mark.timeout(600)
@pytest.mark.full
@pytest.mark.skipif(not FULL, reason=FULL_REASON)
async def test_the_documented_stream_count_fits_and_one_more_is_refused(
    start_agent: StartAgent, keda_proto: KedaProto
) -> None:
    """Issue 19's 16,400 StreamIsActive on one connection at the default --max-streams (10,000): 10,000 served,
    the rest refused, the connection kept."""
    agent = await start_agent()
    port = agent.metrics_port
    async with raw_peer(agent.port) as peer:
        for first in range(0, 16_400, 500):
            await peer.send(open_streams(1 + 2 * first, min(500, 16_400 - first), body=ref_body()))
        ids = [1 + 2 * i for i in range(16_400)]
        await peer.wait_for(
            lambda: all(peer.messages(i) or peer.reset_code(i) for i in ids), "every stream's answer", timeout=300
        )
        assert sum(1 for i in ids if peer.messages(i)) == 10_000
        assert sum(1 for i in ids if peer.reset_code(i) == REFUSED_STREAM) == 6_400
        assert peer.goaway is None, peer.describe()
        assert not peer.closed, peer.describe()
        await until_metric(port, STREAMS, lambda v: v == 10_000)
    await settled(port, timeout=120)


# Row 6: PING and SETTINGS floods from a peer that never reads


@pytest.mark.parametrize(
    "unit",
    [pytest.param(ping_frame(), id="ping"), pytest.param(settings_frame({0x1: 4096}), id="settings")],
)
async def test_a_ping_or_settings_flood_gets_enhance_your_calm(
    start_agent: StartAgent, keda_proto: KedaProto, unit: bytes
) -> None:
    """PINGs (or SETTINGS) past 10/s from a peer that never reads: GOAWAY ENHANCE_YOUR_CALM is waiting for it,
    and the connection is closed."""
    agent = await start_agent("--max-pings-per-second", "10")
    port = agent.metrics_port
    async with calling(agent, keda_proto) as good:
        rss_before = rss_mib(agent.pid)
        flood = await asyncio.to_thread(silent_flood, agent.port, unit, count=20_000, seconds=10, batch=50)
        assert flood.closed_by_server, flood
        assert flood.goaway is not None, flood.frames[-3:]
        assert flood.goaway.error == ENHANCE_YOUR_CALM, flood.goaway
        await until_limited(port, "ping_flood", 1)
        assert "ping_flood" in logged_limits(agent)
        await good.answered(5)
        await settled(port, good)
        assert_rss_back(rss_before, rss_mib(agent.pid))
    good.check()


async def test_a_peer_that_never_reads_is_closed_after_the_write_timeout(
    start_agent: StartAgent, keda_proto: KedaProto
) -> None:
    """A PING flood that the ping limit lets through, from a peer that never reads: the ACKs pile up past the
    64 KiB write-buffer limit, the server stops reading it and closes it after the 1 s write timeout."""
    agent = await start_agent(
        "--write-buffer-limit", "65536", "--write-timeout", "1", "--max-pings-per-second", "1000000"
    )
    port = agent.metrics_port
    async with calling(agent, keda_proto) as good:
        rss_before = rss_mib(agent.pid)
        flood = await asyncio.to_thread(
            silent_flood, agent.port, ping_frame(), count=3_000_000, seconds=40, batch=200, wait_close_seconds=15
        )
        assert flood.closed_by_server, flood
        await until_limited(port, "write_stalled", 1)
        assert "write_stalled" in logged_limits(agent)
        assert await limited_now(port, "ping_flood") == 0
        await good.answered(5)
        await settled(port, good)
        assert_rss_back(rss_before, rss_mib(agent.pid))
    good.check()


async def test_a_stream_window_overflow_resets_that_stream_only(start_agent: StartAgent, keda_proto: KedaProto) -> None:
    """WINDOW_UPDATE past 2^31-1 on one stream is that stream's error (RFC 9113 6.9.1): RST_STREAM
    FLOW_CONTROL_ERROR, and the connection goes on serving."""
    agent = await start_agent()
    async with calling(agent, keda_proto) as good, raw_peer(agent.port) as peer:
        await peer.send(open_streams(1, 1, body=ref_body()))
        await peer.wait_for(lambda: peer.messages(1) == 1, "the push stream's first message")
        await peer.send(window_update_frame(1, 2**31 - 1) * 2)
        await peer.wait_for(lambda: peer.reset_code(1) is not None, "the stream's reset")
        assert peer.reset_code(1) == 0x3, peer.describe()  # FLOW_CONTROL_ERROR
        await peer.send(request_frames(3, header_block(GET_METRICS), metrics_body()))
        await peer.wait_for(lambda: peer.headers(3).get("grpc-status") == "0", "GetMetrics on the same connection")
        assert peer.goaway is None, peer.describe()
        await settled(agent.metrics_port, good)
    good.check()


# Row 10: tiny deadlines


async def test_calls_past_their_deadline_end_deadline_exceeded_never_unknown(
    start_agent: StartAgent, keda_proto: KedaProto
) -> None:
    """4,000 grpcio GetMetrics with a 1 ms deadline, 20 at a time: OK or DEADLINE_EXCEEDED on both sides, the
    server counts none as UNKNOWN or CANCELLED, and logs no error (the teardown checks)."""
    agent = await start_agent()
    port = agent.metrics_port
    async with calling(agent, keda_proto) as good:
        before = await handled_codes(port, GET_METRICS)
        channel = grpc.aio.insecure_channel(agent.address, options=OWN_CONNECTION)
        stub = keda_proto.stub(channel)
        request = keda_proto.metrics_request({"gpuIndex": "0"}, attacks.METRIC_NAME)
        client_codes: Counter[str] = Counter()

        async def caller() -> None:
            for _ in range(200):
                try:
                    await stub.GetMetrics(request, timeout=0.001)
                    client_codes["OK"] += 1
                except grpc.aio.AioRpcError as error:
                    client_codes[error.code().name] += 1

        try:
            await asyncio.gather(*(caller() for _ in range(20)))
        finally:
            await channel.close()
        assert set(client_codes) <= {"OK", "DEADLINE_EXCEEDED"}, client_codes
        with good.paused():
            await until_metric(port, "gpuscaler_rpc_in_flight", lambda v: v == 0, method=GET_METRICS)
            server = await handled_codes(port, GET_METRICS) - before
        assert set(server) <= {"OK", "DEADLINE_EXCEEDED"}, server
        assert server["DEADLINE_EXCEEDED"] >= 1, server
        await settled(port, good)
    good.check()


async def test_the_server_answers_an_expired_call_deadline_exceeded(
    start_agent: StartAgent, keda_proto: KedaProto
) -> None:
    """500 GetMetrics in one write with grpc-timeout 1 ms, from a client that never cancels: each ends with
    grpc-status OK or DEADLINE_EXCEEDED from the server itself, never UNKNOWN."""
    agent = await start_agent()
    port = agent.metrics_port
    async with calling(agent, keda_proto) as good, raw_peer(agent.port) as peer:
        block = header_block(GET_METRICS, timeout="1m")
        body = metrics_body()
        ids = range(1, 1000, 2)
        await peer.send(b"".join(request_frames(i, block, body) for i in ids))
        await peer.wait_for(lambda: all(peer.ended(i) for i in ids), "500 answers", timeout=30)
        statuses = Counter(peer.headers(i).get("grpc-status", f"reset {peer.reset_code(i)}") for i in ids)
        assert set(statuses) <= {"0", "4"}, statuses
        assert statuses["4"] >= 1, statuses
        messages = {peer.headers(i).get("grpc-message", "") for i in ids}
        assert not any("Internal Server Error" in m for m in messages), messages
        assert not peer.closed, peer.describe()
        await settled(port, good)
    good.check()


async def handled_codes(port: int, method: str) -> Counter[str]:
    """``gpuscaler_rpc_handled_total`` of ``method`` by code."""
    samples = await asyncio.to_thread(attacks.scrape, port)
    codes: Counter[str] = Counter()
    for name, labels, value in samples:
        if name == RPC_HANDLED and labels.get("method") == method:
            codes[labels["code"]] += int(value)
    return codes


# What held in issue 19: protocol violations get a GOAWAY with their code, then the close


def _hpack_bomb() -> bytes:
    """One 4 KiB header into HPACK's table, then 200 one-byte references to it: 800 KiB decoded from 4 KiB."""
    encoder = hpack.Encoder()
    request = [(":method", "POST"), (":scheme", "http"), (":path", IS_ACTIVE), (":authority", "x")]
    first = encoder.encode([*request, ("x-bomb", "b" * 4000)])
    index = 62  # the entry just added is the first of the dynamic table
    return first + bytes([0x80 | index]) * 200


def _reused_stream_id() -> bytes:
    """A call on stream 1 (the test waits for its answer), then HEADERS on stream 1 again."""
    return request_frames(1, header_block(IS_ACTIVE), ref_body())


def _lower_stream_id() -> bytes:
    return request_frames(5, header_block(IS_ACTIVE), ref_body()) + request_frames(
        3, header_block(IS_ACTIVE), ref_body()
    )


PROTOCOL_ERROR, FLOW_CONTROL_ERROR, STREAM_CLOSED = "PROTOCOL_ERROR", "FLOW_CONTROL_ERROR", "STREAM_CLOSED"
FRAME_SIZE_ERROR, COMPRESSION_ERROR = "FRAME_SIZE_ERROR", "COMPRESSION_ERROR"
VIOLATIONS = [
    pytest.param(window_update_frame(0, 0), {PROTOCOL_ERROR}, id="window-update-0-on-the-connection"),
    pytest.param(
        window_update_frame(0, 2**31 - 1) * 2, {FLOW_CONTROL_ERROR}, id="window-update-overflows-the-connection"
    ),
    pytest.param(
        attacks.continuation_flood(200, 64), {PROTOCOL_ERROR, ENHANCE_YOUR_CALM}, id="continuation-flood-small"
    ),
    pytest.param(
        attacks.continuation_flood(40, 16_000), {PROTOCOL_ERROR, ENHANCE_YOUR_CALM}, id="continuation-flood-large"
    ),
    pytest.param(
        frame(HEADERS, 1, _hpack_bomb(), END_HEADERS | END_STREAM),
        {COMPRESSION_ERROR, ENHANCE_YOUR_CALM, PROTOCOL_ERROR},
        id="hpack-bomb",
    ),
    pytest.param(
        # RFC 9113 4.3 says COMPRESSION_ERROR; h2 reports its HPACK decoding errors as PROTOCOL_ERROR.
        frame(HEADERS, 1, b"\xff\xff\xff\xff", END_HEADERS | END_STREAM),
        {COMPRESSION_ERROR, PROTOCOL_ERROR},
        id="hpack-bad-index",
    ),
    pytest.param(
        frame(HEADERS, 1, header_block(IS_ACTIVE, extra=[(f"x-pad-{i}", "p" * 64) for i in range(200)]), END_HEADERS),
        {COMPRESSION_ERROR, ENHANCE_YOUR_CALM, PROTOCOL_ERROR},
        id="oversized-header-block",
    ),
    pytest.param(_lower_stream_id(), {PROTOCOL_ERROR}, id="stream-id-lower-than-the-last"),
    pytest.param(frame(0x0, 0, b"x"), {PROTOCOL_ERROR}, id="data-on-stream-0"),
    pytest.param(frame(0x4, 0, b"abc"), {FRAME_SIZE_ERROR}, id="settings-of-3-bytes"),
]


@pytest.mark.parametrize(("attack", "codes"), VIOLATIONS)
async def test_a_protocol_violation_gets_goaway_then_the_close(
    start_agent: StartAgent, keda_proto: KedaProto, attack: bytes, codes: set[str]
) -> None:
    """The frames no client may send: GOAWAY with the RFC's code arrives before the close; others are served."""
    agent = await start_agent()
    port = agent.metrics_port
    async with calling(agent, keda_proto) as good, raw_peer(agent.port) as peer:
        await peer.send(attack)
        goaway = await peer.wait_goaway(timeout=10)
        assert goaway.error in codes, goaway
        await peer.wait_closed(timeout=5)
        await until_limited(port, "protocol_error", 1)
        await good.answered(5)
    good.check()


async def test_a_reused_stream_id_gets_goaway_then_the_close(start_agent: StartAgent, keda_proto: KedaProto) -> None:
    """HEADERS on a stream that has already ended (RFC 9113 5.1: STREAM_CLOSED, a connection error)."""
    agent = await start_agent()
    port = agent.metrics_port
    async with calling(agent, keda_proto) as good, raw_peer(agent.port) as peer:
        await peer.send(_reused_stream_id())
        await peer.wait_for(lambda: peer.headers(1).get("grpc-status") == "0", "the first call's answer")
        await peer.send(_reused_stream_id())
        goaway = await peer.wait_goaway(timeout=10)
        assert goaway.error in {STREAM_CLOSED, PROTOCOL_ERROR}, goaway
        await peer.wait_closed(timeout=5)
        await until_limited(port, "protocol_error", 1)
        await good.answered(5)
    good.check()


@pytest.mark.parametrize(
    ("inflated", "status"),
    [
        pytest.param(7 * 2**20, "12", id="7MiB-in-7KiB-unimplemented"),
        pytest.param(12 * 2**20, "8", id="12MiB-in-12KiB-over-the-limit"),
    ],
)
async def test_a_gzip_bomb_is_refused_unread(
    start_agent: StartAgent, keda_proto: KedaProto, inflated: int, status: str
) -> None:
    """A gzip request (megabytes of zeros in kilobytes) is refused without being inflated: UNIMPLEMENTED under
    the 8 KiB message limit, RESOURCE_EXHAUSTED over it; the server's memory does not grow by what it holds."""
    agent = await start_agent()
    async with calling(agent, keda_proto) as good:
        rss_before = rss_mib(agent.pid)
        bomb = gzip.compress(b"\0" * inflated, compresslevel=9)
        body = struct.pack(">?I", True, len(bomb)) + bomb
        answer = await asyncio.to_thread(grpc_call, agent.port, body, extra_headers=[("grpc-encoding", "gzip")])
        assert answer.get("grpc-status") == status, (len(bomb), answer)
        assert rss_mib(agent.pid) < rss_before + 5
        await good.answered(5)
    good.check()


@pytest.mark.parametrize("content_type", ["application/json", "text/html", "application/grpc-web", None])
async def test_a_wrong_content_type_is_refused(
    start_agent: StartAgent, keda_proto: KedaProto, content_type: str | None
) -> None:
    """A request that is not gRPC by its content-type (or has none) is answered 415, and the connection stays."""
    agent = await start_agent()
    async with calling(agent, keda_proto) as good, raw_peer(agent.port) as peer:
        fields = [
            (":method", "POST"),
            (":scheme", "http"),
            (":path", IS_ACTIVE),
            (":authority", "x"),
            ("te", "trailers"),
        ]
        if content_type is not None:
            fields.append(("content-type", content_type))
        block = bytes(hpack.Encoder().encode([hpack.NeverIndexedHeaderTuple(k, v) for k, v in fields]))
        await peer.send(request_frames(1, block, ref_body()))
        await peer.wait_for(lambda: peer.ended(1), "the answer")
        assert peer.headers(1).get(":status") == "415", peer.describe()
        await peer.send(request_frames(3, header_block(IS_ACTIVE), ref_body()))
        await peer.wait_for(lambda: peer.headers(3).get("grpc-status") == "0", "a good call on the same connection")
        await good.answered(5)
    good.check()
