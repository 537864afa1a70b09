"""The Prometheus /metrics endpoint and /healthz, served by aiohttp on the agent's own event loop.

/healthz answers 200 while samples are fresh and 503 otherwise, the same as the gRPC health service:
the kubelet's native gRPC probe speaks plaintext only, so with TLS on the gRPC port the chart probes here.

Bounded: requests have a 1 KiB body limit and idle keep-alive connections close after a few seconds.
A scrape only formats the newest snapshot and the counters, so it runs on the loop without blocking it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from aiohttp import web
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

from gpuscaler.errors import StartupError
from gpuscaler.flags import Address

KEEPALIVE_TIMEOUT_SECONDS = 5.0


class MetricsServer:
    """Serves ``registry`` at ``/metrics``; ``start`` binds, ``stop`` closes every connection."""

    def __init__(
        self, registry: CollectorRegistry, address: Address, *, healthy: Callable[[], bool] | None = None
    ) -> None:
        self._registry = registry
        self._address = address
        self._healthy = healthy
        app = web.Application(client_max_size=1024)
        app.router.add_get("/metrics", self._metrics)
        if healthy is not None:
            app.router.add_get("/healthz", self._health)
        app.router.add_get("/", self._index)
        self._runner = web.AppRunner(
            app,
            access_log=None,
            handle_signals=False,
            keepalive_timeout=KEEPALIVE_TIMEOUT_SECONDS,
            shutdown_timeout=1.0,
        )
        self.port = 0

    async def start(self) -> None:
        await self._runner.setup()
        site = web.TCPSite(self._runner, self._address.host, self._address.port)
        try:
            await site.start()
        except OSError as error:
            await self._runner.cleanup()
            raise StartupError(f"--metrics-listen {self._address}: cannot listen: {error.strerror}") from None
        server = site._server  # aiohttp keeps the asyncio server private; we need the bound port
        if isinstance(server, asyncio.Server) and server.sockets:
            self.port = int(server.sockets[0].getsockname()[1])

    async def stop(self) -> None:
        await self._runner.cleanup()

    async def _metrics(self, request: web.Request) -> web.Response:
        encoder, content_type = choose_encoder(request.headers.get("Accept", ""))
        return web.Response(body=encoder(self._registry), headers={"Content-Type": content_type})

    async def _health(self, request: web.Request) -> web.Response:
        assert self._healthy is not None
        if self._healthy():
            return web.Response(text="SERVING\n")
        return web.Response(status=503, text="NOT_SERVING: no fresh sample of any GPU\n")

    async def _index(self, request: web.Request) -> web.Response:
        return web.Response(text="gpuscaler: metrics at /metrics, health at /healthz\n")
