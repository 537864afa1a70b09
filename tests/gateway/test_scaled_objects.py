"""The ScaledObject watch against a fake Kubernetes API server: list, watch events, 410 relist, a missing CRD."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web
from kubernetes_asyncio import client

from gpuscaler.gateway.pod_directory import ManagedDirectory
from gpuscaler.gateway.pod_watch import KubernetesPodDirectory
from gpuscaler.gateway.scaled_objects import KubernetesDirectory, KubernetesScaledObjects, scale_target
from gpuscaler.pods import ScaleTarget, ScaleTargets
from tests.waiting import until

PATH = "/apis/keda.sh/v1alpha1/scaledobjects"


def scaled_object(namespace: str, name: str, target: dict[str, str]) -> dict[str, Any]:
    """A ScaledObject as the API server lists it, scaling ``target`` (its scaleTargetRef), with no triggers."""
    return {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": {"namespace": namespace, "name": name, "resourceVersion": "1"},
        "spec": {"scaleTargetRef": target, "triggers": []},
    }


class FakeKedaApi:
    """Serves the ScaledObject list and watch (and an empty pod list), or 404 while KEDA's CRD is missing."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self.events: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        self.crd_installed = True
        self.lists = 0
        self.watches: list[str] = []
        self.runner: web.AppRunner | None = None
        self.port = 0
        self.closing = asyncio.Event()

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get(PATH, self.scaled_objects)
        app.router.add_get("/api/v1/pods", self.pods)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    async def stop(self) -> None:
        self.events.put_nowait(None)
        self.closing.set()
        if self.runner is not None:
            await self.runner.cleanup()

    async def pods(self, request: web.Request) -> web.StreamResponse:
        if request.query.get("watch", "").lower() == "true":
            response = web.StreamResponse()
            await response.prepare(request)
            await self.closing.wait()  # a pod watch without news, until the server stops
            return response
        return web.json_response({"kind": "PodList", "metadata": {"resourceVersion": "1"}, "items": []})

    async def scaled_objects(self, request: web.Request) -> web.StreamResponse:
        if not self.crd_installed:
            return web.json_response({"kind": "Status", "code": 404, "reason": "NotFound"}, status=404)
        if request.query.get("watch", "").lower() != "true":
            self.lists += 1
            return web.json_response(
                {"kind": "ScaledObjectList", "metadata": {"resourceVersion": str(10 * self.lists)}, "items": self.items}
            )
        self.watches.append(request.query.get("resourceVersion", ""))
        response = web.StreamResponse()
        await response.prepare(request)
        while (event := await self.events.get()) is not None:
            await response.write((json.dumps(event) + "\n").encode())
        await response.write_eof()
        return response


@pytest.fixture
async def api() -> AsyncIterator[FakeKedaApi]:
    """A fake API server on a loopback port."""
    server = FakeKedaApi()
    await server.start()
    yield server
    await server.stop()


@pytest.fixture
async def watched(api: FakeKedaApi) -> AsyncIterator[KubernetesScaledObjects]:
    """A ScaledObject watch on the fake API server."""
    configuration = client.Configuration(host=f"http://127.0.0.1:{api.port}")
    scaled_objects = KubernetesScaledObjects(lambda: client.ApiClient(configuration))
    yield scaled_objects
    await scaled_objects.stop()


def test_a_scaled_object_gives_its_target_with_kedas_defaults() -> None:
    """kind defaults to Deployment and apiVersion to apps/v1, as KEDA's; without a target name there is none."""
    assert scale_target(scaled_object("ml", "so", {"name": "web"})) == ScaleTarget("ml", "so", "Deployment", "web")
    assert scale_target(scaled_object("ml", "so", {"name": "db", "kind": "StatefulSet"})) == ScaleTarget(
        "ml", "so", "StatefulSet", "db"
    )
    assert scale_target(scaled_object("ml", "so", {})) is None


async def test_list_then_watch_keeps_each_scaled_objects_target(
    api: FakeKedaApi, watched: KubernetesScaledObjects
) -> None:
    """Listed ScaledObjects answer at once; ADDED, MODIFIED and DELETED follow; the watch resumes from the list."""
    api.items = [scaled_object("ml", "trainer", {"name": "trainer"})]
    assert watched.scale_targets_problem() is not None  # not listed yet: scaleTargetPods must not read "no pods"
    await watched.start()
    await until(lambda: watched.scale_targets_problem() is None)
    assert watched.scale_target("ml", "trainer") == ScaleTarget("ml", "trainer", "Deployment", "trainer")

    api.events.put_nowait({"type": "ADDED", "object": scaled_object("ml", "db", {"name": "db", "kind": "StatefulSet"})})
    await until(lambda: watched.scale_target("ml", "db") is not None)
    api.events.put_nowait({"type": "MODIFIED", "object": scaled_object("ml", "trainer", {"name": "trainer-v2"})})
    await until(lambda: (t := watched.scale_target("ml", "trainer")) is not None and t.name == "trainer-v2")
    api.events.put_nowait({"type": "DELETED", "object": scaled_object("ml", "db", {"name": "db"})})
    await until(lambda: watched.scale_target("ml", "db") is None)
    assert api.watches[0] == "10"


async def test_a_410_relists(api: FakeKedaApi, watched: KubernetesScaledObjects) -> None:
    """An expired resourceVersion makes the watch list again, picking up what it missed."""
    await watched.start()
    await until(lambda: api.lists == 1 and len(api.watches) == 1)
    api.items = [scaled_object("ml", "late", {"name": "late"})]
    api.events.put_nowait(
        {"type": "ERROR", "object": {"kind": "Status", "code": 410, "reason": "Expired", "message": "too old"}}
    )
    api.events.put_nowait(None)
    await until(lambda: watched.scale_target("ml", "late") is not None)
    assert api.lists >= 2


async def test_without_kedas_crd_the_problem_says_so_until_it_is_installed(
    api: FakeKedaApi, watched: KubernetesScaledObjects
) -> None:
    """A 404 (no ScaledObject CRD) is a problem naming the CRD; once it is installed the watch lists it."""
    api.crd_installed = False
    await watched.start()
    await until(lambda: "scaledobjects.keda.sh/v1alpha1) is not installed" in (watched.scale_targets_problem() or ""))
    api.crd_installed = True
    api.items = [scaled_object("ml", "trainer", {"name": "trainer"})]
    await until(lambda: watched.scale_target("ml", "trainer") is not None, timeout=10)


async def test_the_gateways_kubernetes_directory_is_both_watches(api: FakeKedaApi) -> None:
    """KubernetesDirectory answers pod lookups and scale targets, and starts and stops both watches."""
    configuration = client.Configuration(host=f"http://127.0.0.1:{api.port}")
    pods = KubernetesPodDirectory(lambda: client.ApiClient(configuration))
    directory = KubernetesDirectory(pods, KubernetesScaledObjects(pods.api_client_factory))
    known: object = directory
    assert isinstance(known, ScaleTargets)
    assert isinstance(known, ManagedDirectory)  # started and stopped with the gateway
    api.items = [scaled_object("ml", "trainer", {"name": "trainer"})]
    await directory.start()
    try:
        await until(lambda: directory.problem() is None and directory.scale_targets_problem() is None)
        assert directory.scale_target("ml", "trainer") is not None
        assert directory.lookup("ml", "nobody") is None
    finally:
        await directory.stop()
