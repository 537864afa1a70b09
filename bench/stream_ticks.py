"""Push streams beside the poll loop: what N StreamIsActive on one connection cost a tick, and whether the loop keeps
its deadline while they open, are held and close.

    .venv/bin/python -m bench.stream_ticks                  # 1, 1,000 and 10,000 streams: about 3 minutes on 2 cores
    .venv/bin/python -m bench.stream_ticks --counts 10000   # some of them

For each count, a fresh agent (``gpuscaler serve --collector fake --fake-gpus 8``, 0.5 s poll, default limits)
and a good caller (GetMetrics one after another on its own grpcio connection, as KEDA polls). The attacker (``python
-m e2e.support.attacks streams``, a process of its own) opens the streams at once, all with the good caller's query,
holds them ``--hold`` seconds and goes; while they are held, their query activates and deactivates (GPU 0's
utilization set to 90, then 0), so that each stream is sent two more messages. Measured:

* CPU per tick: the agent's event loop's CPU (its main thread's) over ``--window`` seconds with the good caller
  paused, divided by the ticks in it, with no stream (before the attack) and with every stream open and answered.
  Streams with equal queries share one evaluation per tick, so the two should be alike.
* The poll loop's deadline: ``poll_behind`` lines (a tick that ended after the next was due) and ``health_changed``
  to NOT_SERVING (no fresh snapshot for 2 s) in the agent's log, from the attack's start to ``--after`` seconds
  after it.
* The good caller's latency and errors before and during the attack (its paused window left out), and after.
* The agent's full collections from the attack's start to ``--after`` seconds after it (``gpuscaler_gc_pause_seconds``
  with generation 2): how many, their pauses' sum and the longest's bucket; each stops the whole event loop.
* ``gpuscaler_grpc_streams`` and ``gpuscaler_grpc_handler_tasks`` after the attack, and how soon they were 0;
  resident memory before, at the peak and at the end (it stays near its peak: docs/security.md).

Writes bench/results/stream_ticks.json (stream_ticks-N.json for a single count).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import tempfile
import time
from collections import Counter
from datetime import datetime
from pathlib import Path
from typing import Any

import grpc

from bench.common import print_table, rss_mib, summary_ms, write_result
from bench.target import python_bytecode
from e2e.support import attacks
from e2e.support.agent import CONSOLE_SCRIPT, AgentProcess
from e2e.support.clients import GrpcioScaler
from e2e.support.keda_grpcio import KedaProto, generate
from gpuscaler.server.telemetry import GC_PAUSE_BUCKETS

ROOT = Path(__file__).resolve().parents[1]
POLL_INTERVAL_SECONDS = 0.5
OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]
COUNTS = (1, 1000, 10000)
# GPU 0's utilization while the streams are held: the query activates (fake GPUs idle at 0), then deactivates.
FLIPS = (90.0, 0.0)
FLIP_EVERY_SECONDS = 2.0


def loop_cpu_seconds(pid: int) -> float:
    """CPU seconds the process's main thread (its event loop) has run, to the nanosecond (schedstat's first field):
    /proc's utime and stime count 10 ms clock ticks, as much as a few ticks of the loop take."""
    return int(Path(f"/proc/{pid}/schedstat").read_text().split()[0]) / 1e9


def cpu_ms_per_tick(pid: int, seconds: float) -> tuple[float, float]:
    """(the event loop's CPU ms per poll tick over ``seconds`` from now, the window's monotonic start)."""
    started, cpu = time.monotonic(), loop_cpu_seconds(pid)
    time.sleep(seconds)
    used = loop_cpu_seconds(pid) - cpu
    return round(1000 * used / ((time.monotonic() - started) / POLL_INTERVAL_SECONDS), 3), started


async def paused_window(good: attacks.GoodCaller, pid: int, seconds: float) -> tuple[float, float, float]:
    """CPU ms per tick with the good caller paused; (that, the window's start, its end)."""
    with good.paused():
        await asyncio.sleep(0.2)  # a call in flight finishes
        per_tick, started = await asyncio.to_thread(cpu_ms_per_tick, pid, seconds)
    return per_tick, started - 0.2, time.monotonic()


async def attacker(count: int, hold: float, port: int, pid: int, opened: asyncio.Event, report: dict[str, Any]) -> None:
    """The streams attack in its own process; ``opened`` is set once every stream has its first message (or was
    refused), and ``report`` gets its last line, and what the opening cost process ``pid``'s event loop per stream
    (the good caller's calls meanwhile included: about 1% of it)."""
    loop_cpu = loop_cpu_seconds(pid)
    command = [sys.executable, "-m", "e2e.support.attacks", "streams", "--count", str(count)]
    child = await asyncio.create_subprocess_exec(
        *command, "--seconds", str(hold), "--port", str(port), cwd=ROOT, stdout=asyncio.subprocess.PIPE
    )
    assert child.stdout is not None
    started = time.monotonic()
    async for line in child.stdout:
        state = json.loads(line)
        state = state.get("progress", state)
        if not opened.is_set() and state.get("with_a_message", 0) + state.get("refused", 0) >= count:
            report["opened_seconds"] = round(time.monotonic() - started, 2)
            report["opening_loop_cpu_us_per_stream"] = round(1e6 * (loop_cpu_seconds(pid) - loop_cpu) / count, 1)
            opened.set()
        report.update(state)
    await child.wait()


async def set_utilization(address: str, value: float) -> None:
    """GPU 0's utilization on the fake agent at ``address``, through ``gpuscaler fake set`` (it answers once a tick
    has read it)."""
    child = await asyncio.create_subprocess_exec(
        str(CONSOLE_SCRIPT),
        "fake",
        "set",
        "--address",
        address,
        "--gpu",
        "0",
        f"gpu_utilization={value:g}",
        stdout=asyncio.subprocess.DEVNULL,
    )
    await child.wait()


def full_collections(metrics_port: int) -> dict[str, float]:
    """The agent's full collections so far, from ``gpuscaler_gc_pause_seconds``: how many, their pauses' sum, and
    how many paused it under each bound ("le")."""
    got = {
        "count": attacks.metric(metrics_port, "gpuscaler_gc_pause_seconds_count", generation="2"),
        "pause_seconds": attacks.metric(metrics_port, "gpuscaler_gc_pause_seconds_sum", generation="2"),
    }
    for bound in GC_PAUSE_BUCKETS:
        got[str(bound)] = attacks.metric(
            metrics_port, "gpuscaler_gc_pause_seconds_bucket", generation="2", le=str(bound)
        )
    return got


def collections_between(before: dict[str, float], after: dict[str, float]) -> dict[str, float | None]:
    """How many full collections came between two readings, their pauses' sum, and the bound the longest was under."""
    count = after["count"] - before["count"]
    longest = next((bound for bound in GC_PAUSE_BUCKETS if after[str(bound)] - before[str(bound)] >= count), None)
    return {
        "count": int(count),
        "pause_seconds": round(after["pause_seconds"] - before["pause_seconds"], 3),
        "longest_under_seconds": longest if count else 0.0,
    }


def transport_gauges(metrics_port: int) -> tuple[float, float]:
    """(gpuscaler_grpc_streams, gpuscaler_grpc_handler_tasks) now."""
    return (
        attacks.metric(metrics_port, "gpuscaler_grpc_streams"),
        attacks.metric(metrics_port, "gpuscaler_grpc_handler_tasks"),
    )


async def measure(count: int, folder: Path, proto: KedaProto, args: argparse.Namespace) -> dict[str, Any]:
    """One count of streams on a fresh agent: baseline, open, hold, close, after."""
    agent = await asyncio.to_thread(AgentProcess.start, log_dir=folder / "logs", gpus=8, poll_interval=0.5)
    client = GrpcioScaler(grpc.aio.insecure_channel(agent.address, options=OWN_CONNECTION), proto)
    rss: list[tuple[float, float]] = []

    async def sample() -> None:
        while True:
            rss.append((time.monotonic(), rss_mib(agent.pid)))
            await asyncio.sleep(0.1)

    sampler = asyncio.create_task(sample())
    report: dict[str, Any] = {}
    paused: list[tuple[float, float]] = []
    try:
        async with attacks.good_caller(client) as good:
            start = time.monotonic()
            await asyncio.sleep(args.baseline)
            idle_per_tick, *window = await paused_window(good, agent.pid, args.window)
            paused.append((window[0], window[1]))
            collections_before = await asyncio.to_thread(full_collections, agent.metrics_port)
            attack_start = time.monotonic()
            opened = asyncio.Event()
            attacking = asyncio.create_task(attacker(count, args.hold, agent.port, agent.pid, opened, report))
            held_per_tick, flips = None, 0
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(args.hold):
                    await opened.wait()
                    await asyncio.sleep(1.0)
                    held_per_tick, *window = await paused_window(good, agent.pid, args.window)
                    paused.append((window[0], window[1]))
                    for value in FLIPS:  # every stream's state moves, and each is sent its message
                        await set_utilization(agent.address, value)
                        await asyncio.sleep(FLIP_EVERY_SECONDS)
                        flips += 1
            await attacking
            attack_end = time.monotonic()
            to_zero = None
            while time.monotonic() < attack_end + args.after:
                if to_zero is None and await asyncio.to_thread(transport_gauges, agent.metrics_port) == (0, 0):
                    to_zero = round(time.monotonic() - attack_end, 2)
                await asyncio.sleep(0.5)
            end = time.monotonic()
            with good.paused():  # its own call in flight is a handler task too
                await asyncio.sleep(0.2)
                gauges = await asyncio.to_thread(transport_gauges, agent.metrics_port)
                collections_after = await asyncio.to_thread(full_collections, agent.metrics_port)
    finally:
        sampler.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sampler
        await client.close()
        agent.expect_errors = True  # a measurement, not a test: what it logged is in the logs folder
        await agent.terminate(timeout=60)

    def calls(since: float, until: float) -> list[float]:
        return [
            seconds
            for at, seconds in good.latencies
            if since <= at < until and not any(a - 0.5 <= at < b for a, b in paused)
        ]

    def summary(since: float, until: float) -> dict[str, float]:
        chosen = calls(since, until)
        return summary_ms(chosen) if chosen else {"n": 0}

    attack_wall = time.time() - (time.monotonic() - attack_start)
    during_events = [
        e
        for e in agent.events()
        if e.get("event") in ("poll_behind", "health_changed")
        and datetime.fromisoformat(str(e["timestamp"]).replace("Z", "+00:00")).timestamp() >= attack_wall
    ]
    behind = sum(1 for e in during_events if e["event"] == "poll_behind")
    not_serving = sum(1 for e in during_events if e["event"] == "health_changed" and not e.get("serving"))
    baseline, during = summary(start, attack_start), summary(attack_start, attack_end)
    errors = Counter(f.code for at, f in good.errors if at >= start)
    slowest = sorted(((seconds, at) for at, seconds in good.latencies if at >= attack_start), reverse=True)[:5]
    return {
        "streams": count,
        "attacker": report,
        "cpu_ms_per_tick": {"no_stream": idle_per_tick, "streams_open": held_per_tick},
        "state_changes": flips,
        "poll_behind": behind,
        "health_not_serving": not_serving,
        "good_caller": {
            "baseline": baseline,
            "during": during,
            "after": summary(attack_end, end),
            "errors": dict(errors),
            "slowest_ms_at_seconds": [
                (round(1000 * seconds, 1), round(at - attack_start, 2)) for seconds, at in slowest
            ],
        },
        "attack_seconds": round(attack_end - attack_start, 2),
        # From the attack's start to 10 s after its end: each a pause of the whole event loop (docs/security.md).
        "full_collections": collections_between(collections_before, collections_after),
        "gauges_after": {"grpc_streams": gauges[0], "grpc_handler_tasks": gauges[1], "zero_after_seconds": to_zero},
        "rss_mib": {
            "before": round(max(r for at, r in rss if at < attack_start), 1),
            "peak": round(max(r for at, r in rss if at >= attack_start), 1),
            "after": round(rss[-1][1], 1),
        },
        "goals": {
            "poll_loop_deadline_held": behind == 0 and not_serving == 0,
            "good_caller_p99_at_most_3x_baseline": during.get("p99_ms", float("inf"))
            <= 3 * baseline.get("p99_ms", 0.0),
            "good_caller_no_error": not errors,
            "gauges_back_to_zero": to_zero is not None and gauges == (0, 0),
        },
    }


def show(rows: list[dict[str, Any]]) -> None:
    """One table: per count of streams, CPU per tick, the poll loop, the good caller, the gauges and memory."""
    table = []
    for row in rows:
        good, cpu = row["good_caller"], row["cpu_ms_per_tick"]
        table.append(
            (
                f"{row['streams']:,}",
                f"{row['attacker'].get('opened_seconds', '-')}",
                f"{cpu['no_stream']}/{cpu['streams_open']}",
                f"{row['poll_behind']}/{row['health_not_serving']}",
                f"{good['baseline'].get('median_ms', '-')}/{good['baseline'].get('p99_ms', '-')}",
                f"{good['during'].get('median_ms', '-')}/{good['during'].get('p99_ms', '-')}",
                ",".join(f"{k}={v}" for k, v in good["errors"].items()) or "0",
                f"{row['gauges_after']['grpc_streams']:g}/{row['gauges_after']['grpc_handler_tasks']:g}"
                f" ({row['gauges_after']['zero_after_seconds']} s)",
                f"{row['rss_mib']['before']}/{row['rss_mib']['peak']}/{row['rss_mib']['after']}",
                f"{row['full_collections']['count']} ({row['full_collections']['pause_seconds']} s,"
                f" < {row['full_collections']['longest_under_seconds']})",
            )
        )
    print_table(
        "Push streams beside the poll loop",
        [
            "streams",
            "opened in s",
            "CPU ms/tick none/open",
            "poll_behind/NOT_SERVING",
            "p50/p99 before",
            "p50/p99 during",
            "errors",
            "streams/tasks after (0 after)",
            "RSS MiB before/peak/after",
            "full collections (pauses, longest)",
        ],
        table,
    )


async def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every chosen count, one after another, each on a fresh agent."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="gpuscaler-bench-stream-ticks-") as scratch:
        folder = Path(scratch)
        proto = generate(folder / "stubs")
        for count in args.counts:
            print(f"{count:,} streams", flush=True)
            rows.append(await measure(count, folder, proto, args))
    return {
        "benchmark": "push streams beside the poll loop: CPU per tick, the loop's deadline, a good caller",
        "poll_interval_seconds": POLL_INTERVAL_SECONDS,
        "hold_seconds": args.hold,
        "rows": rows,
    }


def main(argv: list[str] | None = None) -> int:
    """Run the chosen counts (1, 1,000 and 10,000 by default), write results/stream_ticks.json, print the table."""
    parser = argparse.ArgumentParser(prog="python -m bench.stream_ticks", description=__doc__.splitlines()[0])
    parser.add_argument("--counts", type=lambda t: [int(c) for c in t.split(",")], default=list(COUNTS))
    parser.add_argument("--hold", type=float, default=30.0, help="seconds the streams are held (30)")
    parser.add_argument("--window", type=float, default=6.0, help="seconds of each CPU window (6)")
    parser.add_argument("--baseline", type=float, default=10.0, help="seconds of good caller before (10)")
    parser.add_argument("--after", type=float, default=10.0, help="seconds after the attack (10)")
    args = parser.parse_args(argv)
    python_bytecode()
    result = asyncio.run(run(args))
    name = "stream_ticks" if len(args.counts) != 1 else f"stream_ticks-{args.counts[0]}"
    path = write_result(name, result)
    show(result["rows"])
    print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
