"""Shutdown: on SIGTERM every push stream ends with status OK, calls in flight finish, and the process exits 0.

KEDA reconnects a stream that ended OK after 2 s; one that broke backs off towards 60 s.
"""

from __future__ import annotations

import asyncio
import signal
import socket
import time
import urllib.request
from collections.abc import Callable

import h2.config
import h2.connection
from prometheus_client.parser import text_string_to_metric_families

from e2e.conftest import StartAgent
from e2e.support.agent import AgentProcess
from e2e.support.clients import GrpcioScaler, RpcFailure
from e2e.support.keda_grpcio import KedaProto
from e2e.support.raw_h2 import IS_ACTIVE

STREAMS = 1_000
DISTINCT_QUERIES = 20
EXIT_WITHIN_SECONDS = 5.0


async def test_sigterm_with_a_thousand_streams(start_agent: StartAgent, keda_proto: KedaProto) -> None:
    """1,000 open streams all end OK, unary calls sent before SIGTERM all answer, and exit 0 comes within 5 s."""
    agent = await start_agent(poll_interval=0.5)
    client = await GrpcioScaler.connect(agent, keda_proto)
    try:
        streams = [
            client.stream_is_active({"gpuIndex": str(i % 8), "activationThreshold": str(10 + i % DISTINCT_QUERIES)})
            for i in range(STREAMS)
        ]
        assert await asyncio.gather(*(stream.next(timeout=60) for stream in streams)) == [False] * STREAMS

        outcomes: list[tuple[float, str]] = []
        stop_load = asyncio.Event()

        async def load() -> None:
            while not stop_load.is_set():
                started = time.monotonic()
                try:
                    await client.get_metrics({"gpuIndex": "0"}, "gpuscaler-gpu_utilization-sum-gpu0")
                    outcomes.append((started, "OK"))
                except RpcFailure as error:
                    outcomes.append((started, error.code))

        callers = [asyncio.create_task(load()) for _ in range(10)]
        try:
            await asyncio.sleep(0.3)
            signalled = time.monotonic()
            exit_seconds = await agent.terminate(timeout=30)  # raises unless the exit code is 0
        finally:
            stop_load.set()
            await asyncio.gather(*callers)

        assert exit_seconds < EXIT_WITHIN_SECONDS
        endings = await asyncio.gather(*(stream.ended(timeout=10) for stream in streams))
        assert {code for code, _ in endings} == {"OK"}
        before = [code for started, code in outcomes if started < signalled]
        assert before, "no unary call ran before SIGTERM"
        assert set(before) == {"OK"}
        stopped = agent.events("agent_stopping")
        assert stopped, agent.log_tail()
        assert stopped[0]["open_streams"] == STREAMS
    finally:
        await client.close()


def hold_a_call_open(port: int) -> socket.socket:
    """A request whose HEADERS came but whose message never will: a call in flight that the drain waits for."""
    connection = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
    connection.initiate_connection()
    connection.send_headers(
        1,
        [
            (":method", "POST"),
            (":scheme", "http"),
            (":path", IS_ACTIVE),
            (":authority", f"127.0.0.1:{port}"),
            ("content-type", "application/grpc"),
            ("te", "trailers"),
        ],
    )
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    sock.sendall(connection.data_to_send())
    return sock


async def test_a_second_interrupt_ends_the_drain_at_once(start_agent: StartAgent) -> None:
    """Ctrl-C starts the drain; a second Ctrl-C while it waits for a call ends the process at once, exit 130."""
    agent = await start_agent("--drain-timeout", "60")
    held = hold_a_call_open(agent.port)
    try:
        await until_logged(agent, "the held call in flight", lambda: in_flight(agent, IS_ACTIVE) == 1)
        agent.process.send_signal(signal.SIGINT)
        await until_logged(agent, "agent_stopping", lambda: agent.events("agent_stopping"))
        assert agent.events("agent_stopping")[0]["in_flight"] == 1
        assert agent.process.poll() is None, "the drain should be waiting for the held call"
        second = time.monotonic()
        agent.process.send_signal(signal.SIGINT)
        async with asyncio.timeout(EXIT_WITHIN_SECONDS):
            while agent.process.poll() is None:
                await asyncio.sleep(0.02)
        assert time.monotonic() - second < EXIT_WITHIN_SECONDS
        assert agent.process.returncode == 128 + signal.SIGINT
        assert agent.events("stop_forced"), agent.log_tail()
        agent.expected_exit_code = 128 + signal.SIGINT
    finally:
        held.close()


def in_flight(agent: AgentProcess, method: str) -> float:
    """The agent's gpuscaler_rpc_in_flight for ``method``, scraped from its /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{agent.metrics_port}/metrics", timeout=2) as response:
        text = response.read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "gpuscaler_rpc_in_flight" and sample.labels.get("method") == method:
                return float(sample.value)
    return 0.0


async def until_logged(agent: AgentProcess, what: str, found: Callable[[], object], timeout: float = 20.0) -> None:
    """Wait until ``found()`` is truthy (an event in the agent's log); fail naming ``what`` otherwise."""
    deadline = time.monotonic() + timeout
    while not found():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not seen within {timeout:g}s:\n{agent.log_tail()}")
        await asyncio.sleep(0.02)
