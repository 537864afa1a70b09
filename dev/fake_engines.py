"""Fake inference engines: metrics pages whose queues rise and fall (the dev stack), or follow what a test sets (a pod).

The gateway reads engine signals from each selected pod's own metrics port (docs/engines.md). Two modes:

- ``--listen HOST:PORT`` (repeat it): the dev stack's fake vLLM engines, one page per address. The pods of
  dev/pods.yaml that run vLLM say ``ip: 127.0.0.1`` and a ``prometheus.io/port``, and this program serves a page on
  each of those ports. compose.yaml runs it in the gateway's network namespace, so the gateway's loopback is this
  program's, and publishes the pages on the host; ``make dev`` runs both on the host's. Each page's requests follow a
  sine wave from 0 to ``--peak`` over ``--period`` seconds, each port's a little later than the one before, so
  ``gpuscaler query profile=vllm-queue workload=vllm`` asks for more replicas and fewer while the stack runs.
- ``--engine ENGINE --port PORT`` (repeat --port): one pod's engine, in place of the engine container of a chart
  example (charts/gpuscaler/examples/engines/; ``make e2e-node`` runs it from the gpuscaler image). Every port given
  (the ports the container declares) serves the engine's metrics page and its health paths, which the example's
  readinessProbe asks, on ``--host`` (default: every address, so the pod's IP). The pod holds ``--requests`` requests
  until ``PUT /fake/requests`` (body: a number) sets another count: how a test makes the queue rise.

The requests a pod holds become the series each engine exports for the signals, under its own names and labels,
written by prometheus_client (which spells a counter ``<name>_total``; the gateway reads that and Triton's own
spelling alike): BATCH_SLOTS of them run and the rest wait; the KV cache is KV_CACHE_FULL used when every slot runs;
a running request takes SECONDS_PER_REQUEST, so Triton finishes ``running / SECONDS_PER_REQUEST`` requests a second,
and each waited ``waiting / that rate`` seconds in the queue (Little's law).

Usage: ``python dev/fake_engines.py --listen 127.0.0.1:8101 --listen 127.0.0.1:8102``: one vLLM page per address;
``python dev/fake_engines.py --engine triton --port 8000 --port 8002``: one Triton pod.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import signal
import sys
import time
from dataclasses import dataclass, field

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from gpuscaler.model.engines import Engine

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
BATCH_SLOTS = 16  # requests one replica runs at once; the rest wait
KV_CACHE_FULL = 0.9  # the share of the KV cache in use while every slot runs
SECONDS_PER_REQUEST = 0.2  # how long one running request takes: a full batch finishes 80 a second
REQUESTS_PATH = "/fake/requests"


@dataclass(frozen=True)
class EnginePage:
    """What one engine's page carries: its labels, a gauge per quantity, and Triton's two counters."""

    labels: dict[str, str]
    # (series, help, quantity): quantity is "waiting", "running" or "cache" (a 0-1 share).
    gauges: tuple[tuple[str, str, str], ...]
    # Triton: the requests that finished, and the microseconds they waited in the queue, as counters.
    finished: str | None = None
    queued_us: str | None = None
    # The engine's health paths, which readiness probes ask.
    health: tuple[str, ...] = ("/health",)


PAGES = {
    Engine.VLLM: EnginePage(
        {"model_name": MODEL, "engine": "0"},
        (
            ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", "waiting"),
            ("vllm:num_requests_running", "Number of requests in model execution batches.", "running"),
            ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", "cache"),
        ),
    ),
    Engine.TRITON: EnginePage(
        {"model": "llama", "version": "1"},
        (("nv_inference_pending_request_count", "Instantaneous number of pending requests.", "waiting"),),
        finished="nv_inference_request_success",
        queued_us="nv_inference_queue_duration_us",
        health=("/v2/health/ready", "/v2/health/live"),
    ),
    Engine.SGLANG: EnginePage(
        {"model_name": MODEL},
        (
            ("sglang:num_queue_reqs", "The number of requests in the waiting queue.", "waiting"),
            ("sglang:num_running_reqs", "The number of running requests.", "running"),
            ("sglang:token_usage", "The token usage.", "cache"),
        ),
        health=("/health", "/health_generate"),
    ),
    Engine.TGI: EnginePage(
        {},
        (
            ("tgi_queue_size", "Current queue size.", "waiting"),
            ("tgi_batch_current_size", "Current batch size.", "running"),
        ),
    ),
}


@dataclass
class FakeEngine:
    """One pod's engine: its page, computed from the requests the pod holds."""

    engine: Engine
    requests: float = 0.0
    registry: CollectorRegistry = field(default_factory=lambda: CollectorRegistry(auto_describe=True))
    _gauges: list[tuple[Gauge, str]] = field(default_factory=list)
    _counters: tuple[Counter, Counter] | None = None
    _counted_until: float | None = None  # monotonic: the counters hold what finished up to then

    def __post_init__(self) -> None:
        page = PAGES[self.engine]
        names = list(page.labels)
        for series, text, quantity in page.gauges:
            gauge = Gauge(series, text, names, registry=self.registry)
            self._gauges.append((gauge.labels(**page.labels) if names else gauge, quantity))
        if page.finished and page.queued_us:
            finished = Counter(page.finished, "Requests that finished.", names, registry=self.registry)
            queued = Counter(page.queued_us, "Microseconds they waited in the queue.", names, registry=self.registry)
            self._counters = (finished.labels(**page.labels), queued.labels(**page.labels))

    @property
    def running(self) -> float:
        return min(self.requests, BATCH_SLOTS)

    @property
    def waiting(self) -> float:
        return self.requests - self.running

    def set_requests(self, requests: float, now: float) -> None:
        """Counts what finished up to ``now`` (monotonic) at the old count, then holds ``requests``."""
        self._count(now)
        self.requests = requests

    def page(self, now: float) -> bytes:
        """The metrics page at ``now`` (monotonic)."""
        self._count(now)
        quantities = {
            "waiting": self.waiting,
            "running": self.running,
            "cache": round(self.running / BATCH_SLOTS * KV_CACHE_FULL, 3),
        }
        for gauge, quantity in self._gauges:
            gauge.set(quantities[quantity])
        return generate_latest(self.registry)

    def _count(self, now: float) -> None:
        if self._counters is not None and self._counted_until is not None and self.running > 0:
            rate = self.running / SECONDS_PER_REQUEST
            finished = rate * (now - self._counted_until)
            self._counters[0].inc(finished)
            self._counters[1].inc(finished * self.waiting / rate * 1e6)
        self._counted_until = now


@dataclass(frozen=True)
class Wave:
    """A dev-stack pod's requests: from 0 to ``peak`` and back over ``period_seconds``, ``phase`` (0-1) of a turn
    later than a wave that starts at ``started``."""

    phase: float
    period_seconds: float
    peak: float
    started: float

    def requests(self, now: float) -> float:
        turn = (now - self.started) / self.period_seconds + self.phase
        return round(self.peak * (1 - math.cos(2 * math.pi * turn)) / 2)


def _address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"--listen {text!r}: HOST:PORT, the port from 1 to 65535")
    return host, int(port)


def _port(text: str) -> int:
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise argparse.ArgumentTypeError(f"--port {text!r}: a port from 1 to 65535")
    return int(text)


def _page_response(engine: FakeEngine) -> web.Response:
    body = engine.page(time.monotonic())
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


# dev/fake_kubelet.py has its own: make e2e-node runs this file alone, from a ConfigMap in the image, so it imports
# nothing from dev/.
class CannotListen(Exception):
    """An address a page cannot be served on: ``main`` says so in one line (the dev stack adds how to move), not in a
    traceback."""


async def _listen(runner: web.AppRunner, host: str, port: int) -> None:
    try:
        await web.TCPSite(runner, host, port).start()
    except OSError as error:  # asyncio's message repeats the address as a tuple: say it once, as HOST:PORT
        reason = os.strerror(error.errno).lower() if error.errno else str(error)
        raise CannotListen(f"cannot listen on {host}:{port}: {reason}") from None


async def _until_stopped() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    await stop.wait()


async def serve(addresses: list[tuple[str, int]], period_seconds: float, peak: float) -> None:
    """Serves one vLLM page per address until SIGINT or SIGTERM."""
    started = time.monotonic()
    runners = []
    for position, (host, port) in enumerate(addresses):
        engine = FakeEngine(Engine.VLLM)
        wave = Wave(position / (2 * len(addresses)), period_seconds, peak, started)

        async def page(_request: web.Request, engine: FakeEngine = engine, wave: Wave = wave) -> web.Response:
            now = time.monotonic()
            engine.set_requests(wave.requests(now), now)
            return _page_response(engine)

        app = web.Application()
        app.router.add_get("/metrics", page)
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        await runner.setup()
        await _listen(runner, host, port)
        runners.append(runner)
    listening = ",".join(f"{host}:{port}" for host, port in addresses)
    print(f"fake_engines_started pages={listening} period_seconds={period_seconds:g} peak={peak:g}", flush=True)
    await _until_stopped()
    for runner in runners:
        await runner.cleanup()


def pod_app(engine: FakeEngine) -> web.Application:
    """One pod's engine: its metrics page, its health paths, and ``PUT /fake/requests`` to set its requests."""

    async def page(_request: web.Request) -> web.Response:
        return _page_response(engine)

    async def healthy(_request: web.Request) -> web.Response:
        return web.Response()

    async def set_requests(request: web.Request) -> web.Response:
        text = await request.text()
        try:
            requests = float(text)
        except ValueError:
            requests = math.nan
        if not math.isfinite(requests) or requests < 0:
            raise web.HTTPBadRequest(text=f"{REQUESTS_PATH}: body {text!r} is not a number of requests of 0 or more\n")
        engine.set_requests(requests, time.monotonic())
        print(f"fake_engine_requests requests={requests:g}", flush=True)
        return web.Response(status=204)

    app = web.Application()
    app.router.add_get("/metrics", page)
    for path in PAGES[engine.engine].health:
        app.router.add_get(path, healthy)
    app.router.add_put(REQUESTS_PATH, set_requests)
    return app


async def serve_pod(engine: FakeEngine, host: str, ports: list[int]) -> None:
    """Serves one pod's engine on every port until SIGINT or SIGTERM."""
    runner = web.AppRunner(pod_app(engine), access_log=None, shutdown_timeout=0.5)
    await runner.setup()
    for port in ports:
        await _listen(runner, host, port)
    listening = ",".join(f"{host}:{port}" for port in ports)
    print(f"fake_engine_started engine={engine.engine} listening={listening} requests={engine.requests:g}", flush=True)
    await _until_stopped()
    await runner.cleanup()


def main() -> None:
    """Parses the flags and serves until stopped."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--listen", type=_address, action="append", help="HOST:PORT of one dev-stack pod's vLLM page")
    parser.add_argument("--period", type=float, default=300.0, help="seconds of one rise and fall of the queue")
    parser.add_argument("--peak", type=float, default=40.0, help="requests in each pod at the top of the wave")
    # Model servers only: the EPP holds no requests of its own to make a page of (tests/fakes/fake_engine.py has its).
    parser.add_argument("--engine", choices=[engine.value for engine in PAGES], help="one pod's engine, on --port")
    parser.add_argument("--port", type=_port, action="append", help="a port the pod's engine serves on; repeat it")
    parser.add_argument("--host", default="0.0.0.0", help="the address the pod's engine serves on (default: all)")
    parser.add_argument("--requests", type=float, default=0.0, help="requests the pod holds until a test sets more")
    args = parser.parse_args()
    if bool(args.listen) == bool(args.engine):
        parser.error("give either --listen HOST:PORT (the dev stack's vLLM pages) or --engine ENGINE --port PORT")
    if bool(args.engine) != bool(args.port):
        parser.error(f"--engine {args.engine} needs --port: each port the engine container declares")
    if args.period <= 0 or args.peak < 0 or args.requests < 0:
        parser.error(
            f"--period {args.period:g} must be above 0, and --peak {args.peak:g} and --requests "
            f"{args.requests:g} at least 0"
        )
    try:
        with contextlib.suppress(KeyboardInterrupt):
            if args.engine:
                asyncio.run(serve_pod(FakeEngine(Engine(args.engine), args.requests), args.host, args.port))
            else:
                asyncio.run(serve(args.listen, args.period, args.peak))
    except CannotListen as error:
        sys.exit(f"fake engines: {error}")


if __name__ == "__main__":
    main()
