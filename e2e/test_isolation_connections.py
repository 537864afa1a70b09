"""Connections are shared fairly (issue 31, rows 4 and 9): strangers that hold connections without using them
cannot lock out KEDA, the kubelet's probe or the gateway.

Row 4: connections to the gRPC port that send nothing, part of a preface, a preface only, or (on an mTLS port)
no ClientHello, from 8 loopback addresses, each reopened as soon as the server closes it, fill the pool
(``--max-connections 16``). Fresh callers, each on a connection of its own as after a restart, must all get in:
KEDA's GetMetrics, the kubelet's probe (gRPC health, or /healthz beside a TLS port) and a gateway started during
the attack. Row 9: slow /healthz clients from many addresses, each reopened when closed, against the metrics
port's 64 places; every probe from the kubelet's address is answered. Loopback addresses 127.0.0.2 and up
stand for other hosts (``e2e/support/hogs.py``). bench/attacks.py runs row 4 at full size (256 connections).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import grpc
import pytest

from e2e.conftest import StartAgent
from e2e.support import attacks, hogs
from e2e.support.agent import AgentProcess
from e2e.support.attacks import GOOD_QUERY, RawPeer, good_caller, limited, raw_peer, settings_frame
from e2e.support.certs import TlsFiles
from e2e.support.clients import GrpcioScaler, RpcFailure, grpc_probe, http_probe
from e2e.support.keda_grpcio import KedaProto
from e2e.support.raw_h2 import PREFACE

OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]
HOG_SOURCES = hogs.sources(8)
HOGS = 24  # 3 per address: more than the pool of 16, fewer than any per-address cap
POOL = ("--max-connections", "16", "--handshake-timeout", "60")  # strangers are not closed by a timeout here
FRESH_CALLERS = 8
PROBES = 5
CALL_TIMEOUT_SECONDS = 5.0
SLOW_SOURCES = hogs.sources(64)
SLOW_CLIENTS = 256  # 4 per address, against 64 places: addresses enough to take the 8 kept for new ones too


async def until_full(metrics_port: int, connections: int = 16) -> None:
    """Wait until the gRPC port holds ``connections`` connections."""
    await attacks.until_metric(metrics_port, "gpuscaler_grpc_connections", lambda v: v >= connections, timeout=20)


async def keda_admitted(agent: AgentProcess, proto: KedaProto, attempts: int = FRESH_CALLERS) -> int:
    """Of ``attempts`` fresh KEDA-like callers (each its own channel and connection, one GetMetrics), how many
    were answered."""
    admitted = 0
    for _ in range(attempts):
        client = await GrpcioScaler.connect(agent, proto, options=OWN_CONNECTION)
        try:
            await client.get_metrics(dict(GOOD_QUERY), attacks.METRIC_NAME, timeout=CALL_TIMEOUT_SECONDS)
            admitted += 1
        except RpcFailure:
            pass
        finally:
            await client.close()
    return admitted


async def admitted(check: Callable[[], Awaitable[bool]], attempts: int = PROBES) -> int:
    """How many of ``attempts`` runs of ``check`` (one after another) succeeded."""
    return sum([await check() for _ in range(attempts)])


async def gateway_subscribes(agent: AgentProcess, proto: KedaProto, log_dir: Path) -> bool:
    """Whether a gateway started now, dialling ``agent``, gets its snapshots and answers KEDA."""
    gateway = await asyncio.to_thread(attacks.gateway_process([agent.address], log_dir).start)
    try:
        client = GrpcioScaler(grpc.aio.insecure_channel(f"127.0.0.1:{gateway.port}", options=OWN_CONNECTION), proto)
        try:
            async with good_caller(client, {}, warm_seconds=15.0) as good:
                await good.answered(2)
            return True
        except RpcFailure:
            return False
        finally:
            await client.close()
    finally:
        code = await gateway.terminate()
        assert code == 0, gateway.tail()


def logged_limits(agent: AgentProcess) -> set[str]:
    """The ``limit`` of every ``grpc_limited`` log line."""
    return {str(event.get("limit")) for event in agent.events("grpc_limited")}


# Row 4: connections that hold a place without using it


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "first_bytes",
    [
        pytest.param(b"", id="nothing"),
        pytest.param(PREFACE[:10], id="partial_preface"),
        pytest.param(PREFACE + settings_frame(), id="preface_only"),
    ],
)
async def test_strangers_holding_every_connection_do_not_lock_out_keda_the_probe_or_the_gateway(
    start_agent: StartAgent, keda_proto: KedaProto, tmp_path: Path, first_bytes: bytes
) -> None:
    """With 24 silent connections from 8 addresses reopened as they close, every fresh KEDA caller, every gRPC
    health probe and a gateway started meanwhile get in; the strangers give way (limit=displaced)."""
    agent = await start_agent(*POOL)
    port = agent.metrics_port
    client = await GrpcioScaler.connect(agent, keda_proto, options=OWN_CONNECTION)
    try:
        async with (
            good_caller(client) as good,
            hogs.Hogs(agent.port, HOGS, HOG_SOURCES, first_bytes=first_bytes) as strangers,
        ):
            await until_full(port)
            keda = await keda_admitted(agent, keda_proto)
            probes = await admitted(lambda: asyncio.to_thread(grpc_probe, agent.address, timeout=CALL_TIMEOUT_SECONDS))
            subscribed = await gateway_subscribes(agent, keda_proto, tmp_path)
            assert (keda, probes, subscribed) == (FRESH_CALLERS, PROBES, True), f"{strangers.opens} strangers opened"
            await good.answered(3)
        good.check()
    finally:
        await client.close()
    assert await asyncio.to_thread(limited, port, "displaced") >= 1  # a fresh caller may find a place just freed
    assert "displaced" in logged_limits(agent)


@pytest.mark.timeout(120)
async def test_sockets_that_never_send_a_client_hello_do_not_lock_out_mtls_callers(
    start_agent: StartAgent, keda_proto: KedaProto, certificates: TlsFiles
) -> None:
    """On an mTLS port, 24 TCP connections that never start TLS, reopened as they close, leave every fresh mTLS
    caller and every /healthz probe answered."""
    agent = await start_agent(*POOL, tls=certificates, mtls=True)
    port = agent.metrics_port
    async with hogs.Hogs(agent.port, HOGS, HOG_SOURCES):
        await until_full(port)
        keda = await keda_admitted(agent, keda_proto)
        probes = await admitted(lambda: asyncio.to_thread(http_probe, port))
    assert (keda, probes) == (FRESH_CALLERS, PROBES)
    assert await asyncio.to_thread(limited, port, "displaced") >= 1


async def test_a_preface_without_a_call_is_closed_long_before_the_idle_timeout(start_agent: StartAgent) -> None:
    """A connection that sends its preface and no call gets GOAWAY NO_ERROR after the first-request timeout
    (1 s here), long before the 300 s idle timeout (the bound is loose: a busy machine delays the sweep)."""
    agent = await start_agent("--first-request-timeout", "1")
    started = time.monotonic()
    async with raw_peer(agent.port) as peer:
        goaway = await peer.wait_goaway(timeout=60)
        assert goaway.error == "NO_ERROR", goaway
        await peer.wait_closed(timeout=10)
    assert time.monotonic() - started < 60.0  # a fifth of the idle timeout
    assert await asyncio.to_thread(limited, agent.metrics_port, "first_request_timeout") == 1


def answered_or_closed(peer: RawPeer) -> bool:
    """The server has answered ``peer``'s first call, or closed it."""
    return peer.ended(1) or peer.closed


async def test_one_address_cannot_take_the_whole_pool_even_with_calls(
    start_agent: StartAgent, keda_proto: KedaProto
) -> None:
    """40 connections from one address, one after another, each making a call: 32 (the per-address cap) are kept
    and the rest refused (limit=max_connections_per_peer), so a fresh KEDA caller from another address still gets in."""
    agent = await start_agent("--max-connections", "40", "--idle-timeout", "60")
    async with contextlib.AsyncExitStack() as stack:
        peers: list[RawPeer] = []
        for _ in range(40):
            peer = await stack.enter_async_context(raw_peer(agent.port, ready=False, source="127.0.0.2"))
            await peer.send(attacks.request_frames(1, attacks.header_block(attacks.IS_ACTIVE), attacks.ref_body()))
            peers.append(peer)
            await peer.wait_for(functools.partial(answered_or_closed, peer), "an answer or the close")
        kept = [peer for peer in peers if peer.ended(1) and not peer.closed]
        assert len(kept) == 32, f"{len(kept)} of 40 kept"
        keda = await keda_admitted(agent, keda_proto, attempts=3)
        assert keda == 3
    assert await asyncio.to_thread(limited, agent.metrics_port, "max_connections_per_peer") == 8


# Row 9: slow /healthz clients from many addresses


@contextlib.asynccontextmanager
async def slowloris(agent: AgentProcess) -> AsyncIterator[hogs.SlowLoris]:
    """Row 9's attack: 256 slow clients from 64 addresses, once the metrics port is full (its first
    ``http_limited`` line: a newcomer found the places it may take all taken)."""
    async with hogs.SlowLoris(agent.metrics_port, SLOW_CLIENTS, SLOW_SOURCES) as attack:
        async with asyncio.timeout(20):
            while not await asyncio.to_thread(agent.events, "http_limited"):
                await asyncio.sleep(0.05)
        yield attack


@pytest.mark.timeout(120)
async def test_the_kubelets_probe_is_answered_under_a_slowloris_from_many_addresses(start_agent: StartAgent) -> None:
    """256 slow header senders from 64 addresses, reopened as they close, hold more than the metrics port's 64
    places; every /healthz probe from the kubelet's address, and a scrape from a fresh address, is answered."""
    agent = await start_agent(gpus=1)
    port = agent.metrics_port
    async with slowloris(agent) as attack:
        probes = [await asyncio.to_thread(http_probe, port) for _ in range(2 * PROBES)]
        scrape = await asyncio.to_thread(http_probe, port, source="127.0.2.1")
        assert (sum(probes), scrape) == (2 * PROBES, True), f"{attack.opens} slow connections opened"
    displaced = await asyncio.to_thread(attacks.metric, port, "gpuscaler_http_limited_total", limit="displaced")
    assert displaced >= 1
    assert "displaced" in {str(event.get("limit")) for event in agent.events("http_limited")}
