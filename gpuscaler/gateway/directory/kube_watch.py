"""One Kubernetes collection kept in memory from a list, then a watch (kubernetes-asyncio): pods, ScaledObjects.

The watch resumes from the last resourceVersion; a 410 Gone (history compacted) relists. A failed call waits
0.5 s, doubling to 30 s, and the wait resets when a call succeeds. Until the first list has arrived, and while
the API has not answered for longer than ``stale_after_seconds``, ``problem()`` says why, so the queries that
need the collection fail (UNAVAILABLE) instead of reading it as empty.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import aiohttp
import structlog
from kubernetes_asyncio import client, watch
from kubernetes_asyncio.client.exceptions import ApiException

from gpuscaler.gateway.directory.by_namespace import ByNamespace

log = structlog.get_logger(__name__)

WATCH_TIMEOUT_SECONDS = 300  # the API server ends each watch after this; we resume from where it was
INITIAL_BACKOFF_SECONDS = 0.5
MAX_BACKOFF_SECONDS = 30.0
DEFAULT_STALE_AFTER_SECONDS = 60.0

Item = TypeVar("Item")


@dataclass(frozen=True)
class Collection(Generic[Item]):
    """What to list and watch, and how to read it."""

    name: str  # "pod watch": the problems name it
    items: str  # "pods": for "has not listed the pods yet"
    event_prefix: str  # "pod_watch": of the log events (pod_watch_synced, pod_watch_failed, ...)
    lister: Callable[[client.ApiClient], tuple[Callable[..., Any], tuple[Any, ...]]]  # the list call and its args
    parse: Callable[[dict[str, Any]], Item | None]  # an object as the API sends it; None: not one we can use
    key: Callable[[Item], Hashable]  # holds the namespace: an object never moves to another
    namespace: Callable[[Item], str]
    describe: Callable[[ApiException], str] = lambda error: f"HTTP {error.status} {error.reason}"


class ListWatch(Generic[Item]):
    """Every object of one collection, by its key; a task lists, then watches, until stopped."""

    def __init__(
        self,
        collection: Collection[Item],
        api_client_factory: Callable[[], client.ApiClient],
        *,
        stale_after_seconds: float = DEFAULT_STALE_AFTER_SECONDS,
        on_item: Callable[[Item], None] | None = None,
    ) -> None:
        """``on_item`` is told of every object listed, added or modified (not deleted): the names remembered."""
        self.collection = collection
        self._on_item = on_item
        self.factory = api_client_factory
        self.items: ByNamespace[Item] = ByNamespace(collection.namespace)
        self.lists = 0
        self.events = 0
        self._event = collection.event_prefix
        self._synced = False
        self._last_contact: float | None = None
        self._stale_after = stale_after_seconds
        self._error: str | None = None
        self._task: asyncio.Task[None] | None = None
        self._api: client.ApiClient | None = None

    def problem(self) -> str | None:
        """Why the collection cannot be trusted now, or None."""
        what = self.collection
        if not self._synced:
            detail = f": {self._error}" if self._error else ""
            return f"the {what.name} has not listed the {what.items} yet{detail}"
        now = asyncio.get_running_loop().time()
        if self._error and self._last_contact is not None and now - self._last_contact > self._stale_after:
            silent = now - self._last_contact
            return f"the Kubernetes API has not answered the {what.name} for {silent:.0f}s: {self._error}"
        return None

    async def start(self) -> None:
        """Start listing and watching in the background."""
        self._task = asyncio.create_task(self._run(), name=self.collection.name.replace(" ", "-"))

    async def stop(self) -> None:
        """Stop the watch and close the API client."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._api is not None:
            await self._api.close()
            self._api = None

    async def _run(self) -> None:
        backoff = INITIAL_BACKOFF_SECONDS
        resource_version: str | None = None
        while True:
            try:
                if self._api is None:
                    self._api = self.factory()
                call, args = self.collection.lister(self._api)
                if resource_version is None:
                    resource_version = await self._list(call, args)
                resource_version = await self._watch(call, args, resource_version)
                backoff = INITIAL_BACKOFF_SECONDS
            except ApiException as error:
                if error.status == 410:
                    log.info(f"{self._event}_expired", detail=str(error.reason))
                    resource_version = None  # the history moved on: list again
                    continue
                self._failed(self.collection.describe(error), backoff)
            except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as error:
                self._failed(repr(error), backoff)
            except Exception as error:  # noqa: BLE001 - a malformed answer must not end the watch for good
                self._failed(f"unexpected answer: {error!r}", backoff)
            else:
                continue
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, MAX_BACKOFF_SECONDS)

    def _failed(self, detail: str, backoff: float) -> None:
        if self._error != detail:
            log.warning(f"{self._event}_failed", error=detail, retry_in=backoff)
        self._error = detail

    async def _list(self, call: Callable[..., Any], args: tuple[Any, ...]) -> str:
        # The raw answer: plain dicts, without building a model object per field.
        response: Any = await call(*args, _preload_content=False)
        try:
            # A raw answer is not checked for us: a 403 (RBAC), a 404 (a CRD not installed) or a 500 would
            # otherwise read as an empty collection, and every workload as scaled to zero.
            if response.status >= 300:
                raise ApiException(status=response.status, reason=response.reason)
            document = await response.json()
        finally:
            response.release()
        items: dict[Hashable, Item] = {}
        for raw in document.get("items") or []:
            item = self.collection.parse(raw)
            if item is not None:
                items[self.collection.key(item)] = item
                if self._on_item is not None:
                    self._on_item(item)
        self.items.replace(items.items())
        self._contact()
        self.lists += 1
        if not self._synced:
            log.info(f"{self._event}_synced", items=len(items))
        self._synced = True
        return str((document.get("metadata") or {}).get("resourceVersion") or "")

    async def _watch(self, call: Callable[..., Any], args: tuple[Any, ...], resource_version: str) -> str:
        """Apply events until the server ends the watch; the resourceVersion to resume from."""
        stream = watch.Watch(return_type="object")
        async with stream:
            async for event in stream.stream(
                call,
                *args,
                resource_version=resource_version,
                allow_watch_bookmarks=True,
                timeout_seconds=WATCH_TIMEOUT_SECONDS,
            ):
                self._contact()
                item = self.collection.parse(event.get("raw_object") or {})
                if item is None:
                    continue
                self.events += 1
                kind = event.get("type")
                if kind == "DELETED":
                    self.items.drop(self.collection.key(item))
                elif kind in ("ADDED", "MODIFIED"):
                    self.items.put(self.collection.key(item), item)
                    if self._on_item is not None:
                        self._on_item(item)
        return str(stream.resource_version or resource_version)

    def _contact(self) -> None:
        self._last_contact = asyncio.get_running_loop().time()
        self._error = None
