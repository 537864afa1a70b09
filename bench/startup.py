"""Time from starting ``gpuscaler serve --collector fake`` to its health check answering SERVING.

Measured from just before the process is spawned (interpreter start and imports included) to the
first SERVING answer; the health check is asked every 10 ms.
"""

from __future__ import annotations

from typing import Any

from bench.common import print_table, summary_ms
from bench.harness import Bench, Options

SPANS = ("start_to_serving", "sigterm_to_exit")


async def run(bench: Bench, options: Options) -> dict[str, Any]:
    serving, stopping = [], []
    for _ in range(options.tries):
        async with bench.agent() as agent:
            serving.append(agent.serving_after_seconds)
        stopping.append(agent.stop_seconds)
    return {
        "benchmark": "process start -> health SERVING, and SIGTERM -> exit, 8 fake GPUs",
        "start_to_serving": summary_ms(serving),
        "sigterm_to_exit": summary_ms(stopping),
    }


def show(result: dict[str, Any]) -> None:
    rows = [(name, r["n"], r["median_ms"], r["p99_ms"], r["max_ms"]) for name, r in result.items() if name in SPANS]
    print_table("Start-up and stop", ["span", "tries", "median ms", "p99 ms", "max ms"], rows)
