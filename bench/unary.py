"""GetMetrics latency and throughput at 1, 10 and 50 concurrent callers, with 0, 1,000 and 10,000 open streams.

The callers and the streams share ONE grpcio channel, as KEDA's calls and push streams share one
connection. Each caller sends its next call when the previous one answered, for ``--seconds``.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from bench.common import print_table, summary_ms
from bench.harness import Bench, Options, close_streams, open_streams
from e2e.support.clients import GrpcioScaler

STREAM_COUNTS = (0, 1_000, 10_000)
CALLERS = (1, 10, 50)
QUERY = {"gpuIndex": "0"}
METRIC_NAME = "gpuscaler-gpu_utilization-sum-gpu0"


async def run(bench: Bench, options: Options) -> dict[str, Any]:
    rows = []
    for stream_count in STREAM_COUNTS:
        async with bench.agent() as agent, bench.client(agent) as client:
            queries = [
                {"gpuIndex": str(i % 8), "activationThreshold": str(50 + i % 100 // 8)} for i in range(stream_count)
            ]
            opened = time.monotonic()
            streams = await open_streams(client, queries)
            open_seconds = time.monotonic() - opened
            for callers in CALLERS:
                latencies: list[float] = []
                started = time.monotonic()
                deadline = started + options.seconds
                await asyncio.gather(*(call_until(client, deadline, latencies) for _ in range(callers)))
                elapsed = time.monotonic() - started
                rows.append(
                    {
                        "open_streams": stream_count,
                        "streams_opened_in_seconds": round(open_seconds, 2),
                        "callers": callers,
                        "calls_per_second": round(len(latencies) / elapsed, 1),
                        **summary_ms(latencies),
                    }
                )
            await close_streams(streams)
    return {"benchmark": "GetMetrics on one grpcio channel shared with open StreamIsActive streams", "rows": rows}


async def call_until(client: GrpcioScaler, deadline: float, latencies: list[float]) -> None:
    """One caller: GetMetrics, then the next as soon as it answered, until ``deadline``."""
    while time.monotonic() < deadline:
        started = time.monotonic()
        await client.get_metrics(QUERY, METRIC_NAME)
        latencies.append(time.monotonic() - started)


def show(result: dict[str, Any]) -> None:
    print_table(
        "GetMetrics, one channel",
        ["open streams", "callers", "calls/s", "median ms", "p99 ms", "max ms"],
        [
            (r["open_streams"], r["callers"], r["calls_per_second"], r["median_ms"], r["p99_ms"], r["max_ms"])
            for r in result["rows"]
        ],
    )
