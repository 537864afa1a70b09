"""The agent's cost at rest: CPU seconds per minute and resident memory with 8 fake GPUs and open streams.

Nothing changes during the measurement (no transitions, no unary calls), so what is left is the poll
loop, one evaluation per distinct streamed query per tick, and the memory each stream holds. Streams
are "shared" (all the same query: one evaluation per tick) or "distinct" (no two share an evaluation).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from bench.common import cpu_seconds, print_table, rss_mib
from bench.harness import SHARED_QUERY, Bench, Options, close_streams, distinct_queries, open_streams
from bench.target import OURS_NAME, client, running

CASES = ((0, "none"), (100, "shared"), (100, "distinct"), (10_000, "shared"), (10_000, "distinct"))
POLL_SECONDS = 0.5
SETTLE_SECONDS = 3.0


async def run(bench: Bench, options: Options, *, at_rest_only: bool = False) -> dict[str, Any]:
    """Every case for our agent; only the case without streams for another server, or when ``at_rest_only``."""
    target = options.target
    if not target.startable:
        raise ValueError("idle needs a server it starts (--command), to read its /proc figures")
    # The stream cases use our metadata keys; another server is measured at rest only.
    cases = CASES if target.name == OURS_NAME and not at_rest_only else CASES[:1]
    rows = []
    for count, kind in cases:
        async with running(target, bench.folder) as server, client(server, bench.proto) as scaler:
            assert server.pid is not None
            queries = [SHARED_QUERY] * count if kind == "shared" else distinct_queries(count)
            streams = await open_streams(scaler, queries)
            await asyncio.sleep(SETTLE_SECONDS)
            cpu_before, started = cpu_seconds(server.pid), time.monotonic()
            await asyncio.sleep(options.idle_seconds)
            cpu_used, elapsed = cpu_seconds(server.pid) - cpu_before, time.monotonic() - started
            rows.append(
                {
                    "streams": count,
                    "queries": kind,
                    "distinct_queries": len({tuple(sorted(q.items())) for q in queries}),
                    "cpu_seconds_per_minute": round(cpu_used / elapsed * 60, 2),
                    "rss_mib": round(rss_mib(server.pid), 1),
                    "measured_seconds": round(elapsed, 1),
                }
            )
            await close_streams(streams)
    result: dict[str, Any] = {"benchmark": "idle server, 8 fake GPUs, poll 0.5 s", "target": target.name, "rows": rows}
    if len(rows) == len(CASES):
        result["derived"] = derive(rows)
    return result


def derive(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Cost per stream (shared query) and per distinct query, from the 0 and 10,000 cases."""
    by_case = {(r["streams"], r["queries"]): r for r in rows}
    base, shared, distinct = by_case[(0, "none")], by_case[(10_000, "shared")], by_case[(10_000, "distinct")]
    return {
        "cpu_ms_per_minute_per_stream": round(
            (shared["cpu_seconds_per_minute"] - base["cpu_seconds_per_minute"]) * 1000 / 10_000, 3
        ),
        "cpu_ms_per_minute_per_distinct_query": round(
            (distinct["cpu_seconds_per_minute"] - shared["cpu_seconds_per_minute"]) * 1000 / 9_999, 3
        ),
        "rss_kib_per_stream": round((shared["rss_mib"] - base["rss_mib"]) * 1024 / 10_000, 2),
        "rss_kib_per_distinct_query": round((distinct["rss_mib"] - shared["rss_mib"]) * 1024 / 9_999, 2),
    }


def show(result: dict[str, Any]) -> None:
    """Print each case's CPU seconds per minute and memory, then the cost per stream and per query if derived."""
    print_table(
        f"Idle server, 8 fake GPUs ({result['target']})",
        ["streams", "queries", "CPU s/min", "RSS MiB"],
        [(r["streams"], r["queries"], r["cpu_seconds_per_minute"], r["rss_mib"]) for r in result["rows"]],
    )
    if "derived" in result:
        print_table("Idle cost per stream and per distinct query", ["figure", "value"], list(result["derived"].items()))
