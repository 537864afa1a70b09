"""A Kubernetes API on a loopback port for list-and-watch clients (the gateway's pod and ScaledObject watches)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from aiohttp import web


class FakeCollection:
    """One collection at one path: ``items`` for a list, ``events`` (None ends it) for a watch.

    While ``refused`` holds an HTTP status and reason, lists and watches get that Status instead (a 403 from
    missing RBAC, a 404 while a CRD is not installed).
    """

    def __init__(self, path: str, list_kind: str) -> None:
        self.path = path
        self.list_kind = list_kind
        self.items: list[dict[str, Any]] = []
        self.events: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        self.refused: tuple[int, str] | None = None
        self.lists = 0
        self.watches: list[str] = []

    async def handle(self, request: web.Request) -> web.StreamResponse:
        """A list, or with ``watch=true`` a stream of the events put in ``events``."""
        listing = request.query.get("watch", "").lower() != "true"
        if listing:
            self.lists += 1  # refused ones too: a test waits for the retries
        if self.refused is not None:
            code, reason = self.refused
            return web.json_response({"kind": "Status", "code": code, "reason": reason}, status=code)
        if listing:
            listed = {
                "kind": self.list_kind,
                "metadata": {"resourceVersion": str(10 * self.lists)},
                "items": self.items,
            }
            return web.json_response(listed)
        self.watches.append(request.query.get("resourceVersion", ""))
        response = web.StreamResponse()
        await response.prepare(request)
        while (event := await self.events.get()) is not None:
            await response.write((json.dumps(event) + "\n").encode())
        await response.write_eof()
        return response


class FakeKubeApi:
    """Serves its collections on an ephemeral loopback port until stopped."""

    def __init__(self, *collections: FakeCollection) -> None:
        self.collections = collections
        self.runner: web.AppRunner | None = None
        self.port = 0

    async def start(self) -> None:
        """Listen on 127.0.0.1; ``port`` is the port it got."""
        app = web.Application()
        for collection in self.collections:
            app.router.add_get(collection.path, collection.handle)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    async def stop(self) -> None:
        """End every open watch, then stop serving."""
        for collection in self.collections:
            collection.events.put_nowait(None)
        if self.runner is not None:
            await self.runner.cleanup()
