"""The ScaledObject watch against a fake Kubernetes API server: list, watch events, 410 relist, a missing CRD."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
from kubernetes_asyncio import client

from gpuscaler.gateway.directory.kubernetes import KubernetesDirectory
from gpuscaler.gateway.directory.pod_file import ManagedDirectory
from gpuscaler.gateway.directory.pod_watch import KubernetesPodDirectory
from gpuscaler.gateway.directory.scaled_objects import KubernetesScaledObjects, scale_target
from gpuscaler.model.pods import ScaleTarget, ScaleTargets
from tests.fakes.fake_kube_api import FakeCollection, FakeKubeApi
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


class FakeKedaApi(FakeKubeApi):
    """Serves the ScaledObject list and watch (and a pod list without news), or 404 while KEDA's CRD is missing."""

    def __init__(self) -> None:
        self.scaled = FakeCollection(PATH, "ScaledObjectList")
        super().__init__(self.scaled, FakeCollection("/api/v1/pods", "PodList"))
        self.events, self.watches = self.scaled.events, self.scaled.watches

    @property
    def items(self) -> list[dict[str, Any]]:
        """What a list returns."""
        return self.scaled.items

    @items.setter
    def items(self, items: list[dict[str, Any]]) -> None:
        self.scaled.items = items

    @property
    def lists(self) -> int:
        """ScaledObject lists served so far."""
        return self.scaled.lists

    @property
    def crd_installed(self) -> bool:
        """Whether the ScaledObject collection answers (else 404, as without KEDA's CRD)."""
        return self.scaled.refused is None

    @crd_installed.setter
    def crd_installed(self, installed: bool) -> None:
        self.scaled.refused = None if installed else (404, "NotFound")


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
