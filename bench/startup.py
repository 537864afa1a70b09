"""Time from starting the server (our agent by default) to its health check answering SERVING, and its stop.

Measured from just before the process is spawned (interpreter start and imports included) to the
first SERVING answer; the health check is asked every 10 ms. Then SIGTERM, with no open streams, to
the process's exit.
"""

from __future__ import annotations

from typing import Any

from bench.common import print_table, summary_ms
from bench.harness import Bench, Options
from bench.target import running

SPANS = ("start_to_serving", "sigterm_to_exit")


async def run(bench: Bench, options: Options) -> dict[str, Any]:
    """``options.tries`` starts and stops of the target server: spawn to SERVING, and SIGTERM to exit."""
    target = options.target
    if not target.startable:
        raise ValueError("startup needs a server it starts (--command)")
    serving, stopping, exit_codes = [], [], set()
    for _ in range(options.tries):
        async with running(target, bench.folder) as server:
            assert server.serving_after_seconds is not None
            serving.append(server.serving_after_seconds)
        assert server.stop_seconds is not None
        stopping.append(server.stop_seconds)
        exit_codes.add(server.exit_code)
    return {
        "benchmark": "process start -> health SERVING, and SIGTERM -> exit, 8 fake GPUs",
        "target": target.name,
        "start_to_serving": summary_ms(serving),
        "sigterm_to_exit": summary_ms(stopping),
        "exit_codes": sorted(code for code in exit_codes if code is not None),
    }


def show(result: dict[str, Any]) -> None:
    """Print the median, p99 and max of both spans."""
    rows = [(name, r["n"], r["median_ms"], r["p99_ms"], r["max_ms"]) for name, r in result.items() if name in SPANS]
    print_table(f"Start-up and stop ({result['target']})", ["span", "tries", "median ms", "p99 ms", "max ms"], rows)
