"""Scale: thousands of push streams on ONE grpcio channel, as KEDA multiplexes them, while unary calls answer.

h2 announces 100 concurrent streams per connection unless the server raises it; past that limit every
further call from KEDA would queue behind the open streams. CI opens 2,000; ``make e2e-full`` 10,000.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from e2e.conftest import StartAgent
from e2e.support.clients import ActiveStream, GrpcioScaler
from e2e.support.control import Control
from e2e.support.keda_grpcio import KedaProto
from e2e.support.sizes import FULL, FULL_REASON, SCALE_STREAMS_CI, SCALE_STREAMS_FULL

DISTINCT_QUERIES = 100
UNARY_CALLS = 50


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "streams",
    [
        pytest.param(SCALE_STREAMS_CI, id="ci"),
        pytest.param(
            SCALE_STREAMS_FULL, id="full", marks=[pytest.mark.full, pytest.mark.skipif(not FULL, reason=FULL_REASON)]
        ),
    ],
)
async def test_many_streams_on_one_channel_while_unary_calls_answer(
    start_agent: StartAgent, keda_proto: KedaProto, streams: int
) -> None:
    """All streams get their first message, GetMetrics keeps answering on the same channel, a flip reaches all."""
    agent = await start_agent(poll_interval=0.5)
    client = await GrpcioScaler.connect(agent, keda_proto)
    all_streams: list[ActiveStream] = []
    try:
        started = time.monotonic()
        for i in range(streams):  # DISTINCT_QUERIES queries: (GPU, threshold) pairs over 8 GPUs and 50, 51, ...
            query = i % DISTINCT_QUERIES
            metadata = {"gpuIndex": str(query % 8), "activationThreshold": str(50 + query // 8)}
            all_streams.append(client.stream_is_active(metadata, name=f"app-{i}"))
        first = await asyncio.gather(*(stream.next(timeout=300) for stream in all_streams))
        assert first == [False] * streams
        open_seconds = time.monotonic() - started

        answered = []
        for _ in range(UNARY_CALLS):
            call_started = time.monotonic()
            [value] = await client.get_metrics({"gpuIndex": "0"}, "gpuscaler-gpu_utilization-sum-gpu0", timeout=10)
            answered.append(time.monotonic() - call_started)
            assert value.metric_value_float == 0
        assert len(answered) == UNARY_CALLS

        async with Control(agent) as control:
            await control.set(None, {"gpu_utilization": 90})
        flipped = await asyncio.gather(*(stream.next(timeout=120) for stream in all_streams))
        assert flipped == [True] * streams
        assert all(len(stream.received) == 2 for stream in all_streams)
        print(  # the figures for the note, shown with `pytest -s`
            f"\n{streams} streams open in {open_seconds:.1f}s; GetMetrics median "
            f"{sorted(answered)[len(answered) // 2] * 1000:.1f} ms, max {max(answered) * 1000:.1f} ms"
        )
    finally:
        await asyncio.gather(*(stream.close() for stream in all_streams))
        await client.close()
