"""Shutdown: on SIGTERM every push stream ends with status OK, calls in flight finish, and the process exits 0.

KEDA reconnects a stream that ended OK after 2 s; one that broke backs off towards 60 s.
"""

from __future__ import annotations

import asyncio
import time

from e2e.conftest import StartAgent
from e2e.support.clients import GrpcioScaler, RpcFailure
from e2e.support.keda_grpcio import KedaProto

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
