"""The longest the agent's event loop is held by one accepted request, for each kind of costly request.

The event loop is shared by the poll loop and every RPC, so whatever one request does on it in one go
delays every other caller and the next sample. This bench runs an agent in-process (8 fake GPUs polled
every 0.5 s, a 10-minute history already full, so windows read 1,200 snapshots) next to a probe task
that asks to wake every millisecond and records how late it wakes. A client in another process sends
each kind of request ``--requests`` times, one after the other; the probe's largest delay while a kind
runs is the worst stall that kind caused. ``idle`` sends nothing: its figure is the noise floor (the
scheduler, the poll ticks). Requests over the size limits are refused before they are read; they are
measured too, to show that refusing costs nothing.

    .venv/bin/python -m bench.stall [--requests 20] [--under-load]

``--under-load`` runs two busy processes beside it, as a shared CI machine would. Writes
``bench/results/stall.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

from bench.common import print_table, summary_ms, write_result
from e2e.support.raw_h2 import grpc_call, grpc_frame
from gpuscaler.agent.collectors.fake import FakeCollector
from gpuscaler.agent.history import History
from gpuscaler.agent.process import Agent
from gpuscaler.generated import externalscaler as keda
from gpuscaler.generated.gpuscaler import v1 as pb
from gpuscaler.model.samples import Snapshot
from gpuscaler.query.metadata import Limits, parse_metadata
from gpuscaler.server.transport.calls import MAX_RECEIVE_MESSAGE_BYTES
from gpuscaler.server.transport.h2 import MAX_HEADER_LIST_BYTES
from tests.conftest import serve_settings
from tests.load import busy_processes

GPUS = 8
POLL_SECONDS = 0.5
HISTORY = "10m"
PROBE_SECONDS = 0.001
IS_ACTIVE = "/externalscaler.ExternalScaler/IsActive"
GET_METRICS = "/externalscaler.ExternalScaler/GetMetrics"
EXPLAIN = "/gpuscaler.v1.Agent/Explain"
GET_SNAPSHOT = "/gpuscaler.v1.Agent/GetSnapshot"

Request = tuple[str, bytes, list[tuple[str, str]]]  # path, body, extra headers


def _ref(metadata: dict[str, str]) -> keda.ScaledObjectRef:
    return keda.ScaledObjectRef(name="app", namespace="ml", scaler_metadata=metadata)


def _tiny_keys(limit: int) -> dict[str, str]:
    """As many five-digit keys with empty values as fit in ``limit``: the costliest bytes to decode."""
    overhead = len(bytes(_ref({})))
    entry = len(bytes(keda.ScaledObjectRef(scaler_metadata={"fffff": ""})))
    return {f"{i:05x}": "" for i in range((limit - overhead) // entry)}


def _heaviest_query(number: int) -> dict[str, str]:
    """A valid query that misses the evaluation cache every time: a 10-minute window, p99, a fresh window length."""
    return {"window": f"{600 - number % 60}s", "windowFunction": "max", "aggregation": "p99"}


def requests(kind: str, number: int) -> Request:
    """The ``number``-th request of ``kind``."""
    if kind == "tiny-keys-at-the-limit":
        return IS_ACTIVE, grpc_frame(bytes(_ref(_tiny_keys(MAX_RECEIVE_MESSAGE_BYTES)))), []
    if kind == "long-value-at-the-limit":
        size = MAX_RECEIVE_MESSAGE_BYTES - len(bytes(_ref({"targetValue": ""}))) - 8
        return IS_ACTIVE, grpc_frame(bytes(_ref({"targetValue": "9" * size}))), []
    if kind == "headers-at-the-limit":
        headers = [(f"x-pad-{i:04d}", "p" * 8) for i in range(MAX_HEADER_LIST_BYTES // 60)]
        return IS_ACTIVE, grpc_frame(bytes(_ref({}))), headers
    if kind == "windowed-get-metrics":
        ref = _ref(_heaviest_query(number))
        name = parse_metadata(ref.scaler_metadata, Limits(history_seconds=600.0)).metric_name
        return GET_METRICS, grpc_frame(bytes(keda.GetMetricsRequest(scaled_object_ref=ref, metric_name=name))), []
    if kind == "windowed-explain":
        message = pb.ExplainRequest(scaler_metadata=_heaviest_query(number), name="app", namespace="ml")
        return EXPLAIN, grpc_frame(bytes(message)), []
    if kind == "get-snapshot":
        return GET_SNAPSHOT, grpc_frame(bytes(pb.GetSnapshotRequest())), []
    if kind == "refused-1-mib":  # declares 1 MiB; the prefix alone gets it refused, so the rest need not come
        return IS_ACTIVE, grpc_frame(b"\x00" * 1024, length=2**20), []
    raise ValueError(kind)


KINDS = (
    "idle",
    "tiny-keys-at-the-limit",
    "long-value-at-the-limit",
    "headers-at-the-limit",
    "windowed-get-metrics",
    "windowed-explain",
    "get-snapshot",
    "refused-1-mib",
)


def client(port: int, kind: str, count: int) -> None:
    """The other process: send ``count`` requests of ``kind``, one after the other, and print their statuses."""
    statuses = []
    for number in range(count):
        path, body, headers = requests(kind, number)
        answer = grpc_call(port, body, path=path, extra_headers=headers, timeout=30)
        statuses.append(answer.get("grpc-status", "closed"))
    print(json.dumps(statuses))


class CallbackClock:
    """Times every event-loop callback (asyncio's Handle._run) in CPU seconds of the loop's thread.

    A callback's CPU time is the stall our code causes, whatever else the machine runs; the probe's wall-clock
    delays add the scheduler's share on a busy machine.
    """

    def __init__(self) -> None:
        self.longest: list[float] = [0.0]
        self._original: Callable[[asyncio.Handle], None] | None = None

    def __enter__(self) -> CallbackClock:
        original = asyncio.Handle._run
        longest = self.longest

        def timed(handle: asyncio.Handle) -> None:
            started = time.thread_time()
            try:
                original(handle)
            finally:
                longest[0] = max(longest[0], time.thread_time() - started)

        self._original = original
        asyncio.Handle._run = timed  # type: ignore[method-assign,assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._original is not None
        asyncio.Handle._run = self._original  # type: ignore[method-assign,assignment]

    def take(self) -> float:
        """The longest callback since the last ``take``, in seconds."""
        longest, self.longest[0] = self.longest[0], 0.0
        return longest


class GcClock:
    """Times the garbage collector's passes: a full collection walks every object, the history's included."""

    def __init__(self) -> None:
        self.longest: dict[int, float] = {}
        self._started = 0.0

    def __enter__(self) -> GcClock:
        gc.callbacks.append(self._observe)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._observe)

    def _observe(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        generation = info["generation"]
        self.longest[generation] = max(self.longest.get(generation, 0.0), time.perf_counter() - self._started)


class Probe:
    """Asks to wake every PROBE_SECONDS and keeps how late each wake-up was."""

    def __init__(self) -> None:
        self.delays: list[float] = []

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            asked = loop.time()
            await asyncio.sleep(PROBE_SECONDS)
            self.delays.append(loop.time() - asked - PROBE_SECONDS)

    @contextlib.contextmanager
    def window(self) -> Iterator[list[float]]:
        """The delays recorded inside the ``with`` block."""
        start = len(self.delays)
        measured: list[float] = []
        try:
            yield measured
        finally:
            measured.extend(self.delays[start:])


def _fill_history(agent: Agent) -> None:
    """Ten minutes of snapshots before the newest, so that a window reads as many samples as it ever will."""
    history = agent.evaluator.source
    assert isinstance(history, History)
    latest = history.latest
    assert latest is not None
    needed = int(agent.settings.history_seconds / POLL_SECONDS)
    for back in range(needed, 0, -1):
        history.append(_shifted(latest, back))
    history.append(latest)


def _shifted(latest: Snapshot, back: int) -> Snapshot:
    return replace(latest, sequence=latest.sequence - back, monotonic=latest.monotonic - back * POLL_SECONDS)


async def measure(count: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Send each kind of request ``count`` times to an in-process agent: each kind's stall, and the GC's pauses."""
    settings = serve_settings(
        "--fake-gpus", str(GPUS), "--poll-interval", str(POLL_SECONDS), "--history", HISTORY, "--metrics-listen", ""
    )
    agent = await Agent.start(settings, FakeCollector(node="bench-node", gpu_count=GPUS))
    probe = Probe()
    probing = asyncio.create_task(probe.run())
    rows = []
    try:
        _fill_history(agent)
        with CallbackClock() as callbacks, GcClock() as collections:
            for kind in KINDS:
                callbacks.take()
                with probe.window() as delays:
                    if kind == "idle":
                        await asyncio.sleep(count * 0.05)
                        statuses: list[str] = []
                    else:
                        statuses = await asyncio.to_thread(_run_client, agent.port, kind, count)
                rows.append(
                    {
                        "kind": kind,
                        "statuses": sorted(set(statuses)),
                        "longest_callback_cpu_ms": round(1000 * callbacks.take(), 2),
                        "probe_delays": summary_ms(delays),
                    }
                )
            garbage = {
                "longest_pass_ms_by_generation": {
                    str(generation): round(1000 * seconds, 2)
                    for generation, seconds in sorted(collections.longest.items())
                },
                "forced_full_collection_ms": _full_collection_ms(),
                "objects": len(gc.get_objects()),
            }
    finally:
        probing.cancel()
        await asyncio.gather(probing, return_exceptions=True)
        await agent.stop()
    return rows, garbage


def _full_collection_ms() -> float:
    started = time.perf_counter()
    gc.collect()
    return round(1000 * (time.perf_counter() - started), 2)


def _run_client(port: int, kind: str, count: int) -> list[str]:
    done = subprocess.run(
        [sys.executable, "-m", "bench.stall", "--client", str(port), kind, str(count)],
        check=True,
        capture_output=True,
        text=True,
    )
    statuses: list[str] = json.loads(done.stdout)
    return statuses


def main(argv: list[str] | None = None) -> int:
    """Measure and write the result; with the hidden ``--client``, be the process that sends the requests."""
    parser = argparse.ArgumentParser(prog="python -m bench.stall", description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20, help="requests of each kind (20)")
    parser.add_argument("--under-load", action="store_true", help="two busy processes run beside it")
    parser.add_argument("--client", nargs=3, metavar=("PORT", "KIND", "COUNT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.client:
        port, kind, count = args.client
        client(int(port), kind, int(count))
        return 0

    import gpuscaler.logs

    gpuscaler.logs.configure(log_format="json", level="warning")
    started = time.monotonic()
    with busy_processes(2) if args.under_load else contextlib.nullcontext():
        rows, garbage = asyncio.run(measure(args.requests))
    worst = max(rows[1:], key=lambda row: row["longest_callback_cpu_ms"])
    result = {
        "benchmark": "the longest event-loop stall each kind of accepted request causes (probe wake-up delay)",
        "under_load": args.under_load,
        "requests_per_kind": args.requests,
        "limits": {"message_bytes": MAX_RECEIVE_MESSAGE_BYTES, "header_list_bytes": MAX_HEADER_LIST_BYTES},
        "rows": rows,
        "garbage_collection": garbage,
        "worst": {
            "kind": worst["kind"],
            "longest_callback_cpu_ms": worst["longest_callback_cpu_ms"],
            "probe_max_ms": worst["probe_delays"]["max_ms"],
        },
        "bench_seconds": round(time.monotonic() - started, 1),
    }
    path = write_result("stall-under-load" if args.under_load else "stall", result)
    show(result)
    print("garbage collection:", json.dumps(garbage))
    print(f"wrote {path.parent.name}/{path.name}")
    return 0


def show(result: dict[str, Any]) -> None:
    """Print each kind's statuses, its longest callback and the probe's delays."""
    print_table(
        "Event-loop stall per kind of request" + (" (two busy processes beside it)" if result["under_load"] else ""),
        ["kind", "statuses", "longest callback CPU ms", "probe median ms", "probe p99 ms", "probe max ms"],
        [
            (
                row["kind"],
                ",".join(row["statuses"]) or "-",
                row["longest_callback_cpu_ms"],
                row["probe_delays"]["median_ms"],
                row["probe_delays"]["p99_ms"],
                row["probe_delays"]["max_ms"],
            )
            for row in result["rows"]
        ],
    )


if __name__ == "__main__":
    sys.exit(main())
