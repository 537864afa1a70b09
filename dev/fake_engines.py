"""Fake vLLM engines for the dev stack: one metrics page per pod, whose queue rises and falls.

The gateway reads engine signals from each selected pod's own metrics port (docs/engines.md); in the dev stack the
pods of dev/pods.yaml that run vLLM say ``ip: 127.0.0.1`` and a ``prometheus.io/port``, and this program serves a
page on each of those ports. compose.yaml runs it in the gateway's network namespace, so the gateway's loopback is
this program's, and publishes the pages on the host; ``make dev`` runs both on the host's.

Each page carries the series vLLM's V1 engine exports for the signals (``vllm:num_requests_waiting``,
``vllm:num_requests_running``, ``vllm:kv_cache_usage_perc``, labelled by ``model_name`` and ``engine``), written by
prometheus_client. The waiting queue follows a sine wave from 0 to ``--peak`` over ``--period`` seconds, each port's
a little later than the one before, so ``gpuscaler query profile=vllm-queue workload=vllm`` asks for more replicas
and fewer while the stack runs.

Usage: ``python dev/fake_engines.py --listen 127.0.0.1:8101 --listen 127.0.0.1:8102``: one page per address.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import signal
import sys
import time

from aiohttp import web
from prometheus_client import CollectorRegistry, Gauge
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
BATCH_SLOTS = 16  # requests one replica runs at once; the rest wait


class FakeVllm:
    """One pod's vLLM page; ``phase`` (0-1) shifts its wave against the others'."""

    def __init__(self, phase: float, period_seconds: float, peak: float, started: float) -> None:
        self._phase = phase
        self._period = period_seconds
        self._peak = peak
        self._started = started
        self.registry = CollectorRegistry(auto_describe=True)
        labels = ["model_name", "engine"]
        self._waiting = Gauge(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed.", labels, registry=self.registry
        )
        self._running = Gauge(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            labels,
            registry=self.registry,
        )
        self._kv_cache = Gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", labels, registry=self.registry
        )

    def update(self, now: float) -> None:
        """Sets the gauges to the wave's value at ``now`` (monotonic seconds)."""
        turn = (now - self._started) / self._period + self._phase
        demand = self._peak * (1 - math.cos(2 * math.pi * turn)) / 2  # requests in the pod: 0 .. peak
        running = min(demand, BATCH_SLOTS)
        labels = (MODEL, "0")
        self._waiting.labels(*labels).set(round(demand - running))
        self._running.labels(*labels).set(round(running))
        self._kv_cache.labels(*labels).set(round(running / BATCH_SLOTS * 0.9, 3))

    async def page(self, _request: web.Request) -> web.Response:
        self.update(time.monotonic())
        return web.Response(body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})


def _address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"--listen {text!r}: HOST:PORT, the port from 1 to 65535")
    return host, int(port)


async def serve(addresses: list[tuple[str, int]], period_seconds: float, peak: float) -> None:
    """Serves one page per address until SIGINT or SIGTERM."""
    started = time.monotonic()
    runners = []
    for position, (host, port) in enumerate(addresses):
        engine = FakeVllm(position / (2 * len(addresses)), period_seconds, peak, started)
        app = web.Application()
        app.router.add_get("/metrics", engine.page)
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        await runner.setup()
        await web.TCPSite(runner, host, port).start()
        runners.append(runner)
    listening = ",".join(f"{host}:{port}" for host, port in addresses)
    print(f"fake_engines_started pages={listening} period_seconds={period_seconds:g} peak={peak:g}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    await stop.wait()
    for runner in runners:
        await runner.cleanup()


def main() -> None:
    """Parses the flags and serves until stopped."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--listen", type=_address, action="append", required=True, help="HOST:PORT of one pod's page; repeat it"
    )
    parser.add_argument("--period", type=float, default=300.0, help="seconds of one rise and fall of the queue")
    parser.add_argument("--peak", type=float, default=40.0, help="requests in each pod at the top of the wave")
    args = parser.parse_args()
    if args.period <= 0 or args.peak < 0:
        sys.exit(f"--period {args.period:g} must be above 0 and --peak {args.peak:g} at least 0")
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(args.listen, args.period, args.peak))


if __name__ == "__main__":
    main()
