"""Push latency: from a ``fake set`` that crosses the threshold to the ``true`` at a grpcio streaming client.

Each try resets the GPU and waits for ``false``, waits a random part of a poll interval (so that the
set lands anywhere in the tick), then times from just before the FakeControl Set call to the arrival of
``true``. The wait for the next tick is most of it: expect about half a poll interval on average and
up to one, plus the agent's evaluation and the wire.
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

from bench.common import print_table, summary_ms
from bench.harness import Bench, Options
from e2e.support.control import Control

QUERY = {"gpuIndex": "0", "activationThreshold": "50"}


async def run(bench: Bench, options: Options) -> dict[str, Any]:
    """Push latency at each of ``options``' poll intervals, ``options.tries`` tries each."""
    rows = []
    for poll in options.poll_intervals:
        samples = await latencies(bench, poll, options.tries)
        rows.append({"poll_interval_seconds": poll, **summary_ms(samples)})
    return {"benchmark": "push latency: fake set crossing the threshold -> true at a grpcio stream", "rows": rows}


async def latencies(bench: Bench, poll: float, tries: int) -> list[float]:
    """``tries`` push latencies, in seconds, from one agent polling every ``poll`` seconds."""
    samples = []
    async with bench.agent(poll_interval=poll) as agent, bench.client(agent) as client, Control(agent) as control:
        stream = client.stream_is_active(QUERY)
        assert await stream.next() is False
        for _ in range(tries):
            await asyncio.sleep(random.uniform(0, poll))  # spread where in the tick the change lands
            started = time.monotonic()
            await control.set(0, {"gpu_utilization": 90})
            assert await stream.next(timeout=10) is True
            samples.append(stream.received[-1][0] - started)
            await control.set(0, {"gpu_utilization": 0})
            assert await stream.next(timeout=10) is False
        await stream.close()
    return samples


def show(result: dict[str, Any]) -> None:
    """Print the median, p99 and max latency per poll interval."""
    print_table(
        "Push latency, set -> true",
        ["poll interval", "tries", "median ms", "p99 ms", "max ms"],
        [
            (f"{r['poll_interval_seconds']:g} s", r["n"], r["median_ms"], r["p99_ms"], r["max_ms"])
            for r in result["rows"]
        ],
    )
