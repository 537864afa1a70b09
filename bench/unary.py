"""GetMetrics latency and throughput at 1, 10 and 50 concurrent callers, with 0, 1,000 and 10,000 open streams.

The callers and the streams share ONE grpcio channel, as KEDA's calls and push streams share one
connection. Each caller sends its next call when the previous one answered, for ``--seconds``. The
metric name comes from GetMetricSpec, as KEDA asks it, so any ExternalScaler server can be measured.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from typing import Any

from bench.common import print_table, summary_ms
from bench.harness import Bench, Options, close_streams, silent_streams, start_streams
from bench.target import client, running
from e2e.support.clients import GrpcioScaler, Metadata, RpcFailure

# A stream still silent after this long is counted and the calls are measured anyway: the streams
# are open on the connection, which is what the figure is about.
FIRST_MESSAGE_SECONDS = 120.0


def stream_queries(count: int) -> list[Metadata]:
    """Push streams as many ScaledObjects would open them: keys the prior art knows too."""
    return [{"gpuIndex": str(i % 8), "activationThreshold": str(50 + i % 100 // 8)} for i in range(count)]


async def run(bench: Bench, options: Options) -> dict[str, Any]:
    """GetMetrics latency and calls per second for each number of open streams and of concurrent callers."""
    target = options.target
    rows = []
    for stream_count in options.streams:
        async with running(target, bench.folder) as server, client(server, bench.proto) as scaler:
            [spec] = await scaler.get_metric_spec(target.query)
            opened = time.monotonic()
            streams = start_streams(scaler, stream_queries(stream_count))
            silent = await silent_streams(streams, FIRST_MESSAGE_SECONDS)
            open_seconds = time.monotonic() - opened
            for callers in options.callers:
                latencies: list[float] = []
                errors: Counter[str] = Counter()
                started = time.monotonic()
                deadline = started + options.seconds
                await asyncio.gather(
                    *(
                        call_until(scaler, target.query, spec.metric_name, deadline, latencies, errors)
                        for _ in range(callers)
                    )
                )
                elapsed = time.monotonic() - started
                rows.append(
                    {
                        "open_streams": stream_count,
                        "streams_opened_in_seconds": round(open_seconds, 2),
                        "streams_without_first_message": silent,
                        "callers": callers,
                        "calls_per_second": round(len(latencies) / elapsed, 1),
                        **(summary_ms(latencies) if latencies else {"n": 0}),
                        "errors": dict(errors),
                    }
                )
            await close_streams(streams)
    return {
        "benchmark": "GetMetrics on one grpcio channel shared with open StreamIsActive streams",
        "target": target.name,
        "query": target.query,
        "rows": rows,
    }


async def call_until(
    scaler: GrpcioScaler,
    query: Metadata,
    metric_name: str,
    deadline: float,
    latencies: list[float],
    errors: Counter[str],
) -> None:
    """One caller: GetMetrics, then the next as soon as it answered, until ``deadline``.

    A call that fails counts in ``errors`` by its status, not in ``latencies`` or calls/s.
    """
    while time.monotonic() < deadline:
        started = time.monotonic()
        try:
            await scaler.get_metrics(query, metric_name)
        except RpcFailure as failure:
            errors[failure.code] += 1
            continue
        latencies.append(time.monotonic() - started)


def row(result: dict[str, Any], open_streams: int, callers: int) -> dict[str, Any]:
    """The row for ``open_streams`` and ``callers``."""
    for candidate in result["rows"]:
        if candidate["open_streams"] == open_streams and candidate["callers"] == callers:
            return dict(candidate)
    raise KeyError(f"no row for {open_streams} streams and {callers} callers")


def show(result: dict[str, Any]) -> None:
    """Print calls per second and latency for each number of open streams and of callers."""
    print_table(
        f"GetMetrics, one channel ({result['target']})",
        ["open streams", "callers", "calls/s", "median ms", "p99 ms", "max ms"],
        [
            (r["open_streams"], r["callers"], r["calls_per_second"], r["median_ms"], r["p99_ms"], r["max_ms"])
            for r in result["rows"]
        ],
    )
