"""The pod watch against a fake Kubernetes API server (aiohttp on loopback): list, watch events, 410 relist."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes_asyncio import client

from gpuscaler.gateway.directory.pod_watch import KubernetesPodDirectory
from gpuscaler.model.errors import ConfigError
from tests.fakes.fake_kube_api import FakeCollection, FakeKubeApi
from tests.waiting import until


def pod(namespace: str, name: str, labels: dict[str, str], owner: tuple[str, str] | None = None) -> dict[str, Any]:
    """A pod as the API server lists it: labels, a resourceVersion, and its controller (kind, name) if given."""
    metadata: dict[str, Any] = {"namespace": namespace, "name": name, "labels": labels, "resourceVersion": "1"}
    if owner is not None:
        metadata["ownerReferences"] = [{"kind": owner[0], "name": owner[1], "controller": True}]
    return {"metadata": metadata}


class FakeApiServer(FakeKubeApi):
    """Serves GET /api/v1/pods as a list, and with watch=true as a stream of the events put in ``events``."""

    def __init__(self) -> None:
        self.pods = FakeCollection("/api/v1/pods", "PodList")
        super().__init__(self.pods)
        self.events, self.watches = self.pods.events, self.pods.watches

    @property
    def items(self) -> list[dict[str, Any]]:
        """What a list returns."""
        return self.pods.items

    @items.setter
    def items(self, items: list[dict[str, Any]]) -> None:
        self.pods.items = items

    @property
    def lists(self) -> int:
        """Lists served so far."""
        return self.pods.lists


def _labels(directory: KubernetesPodDirectory, namespace: str, name: str) -> dict[str, str]:
    info = directory.lookup(namespace, name)
    return dict(info.labels) if info is not None else {}


@pytest.fixture
async def api() -> AsyncIterator[FakeApiServer]:
    """A fake API server on a loopback port."""
    server = FakeApiServer()
    await server.start()
    yield server
    await server.stop()


@pytest.fixture
async def directory(api: FakeApiServer) -> AsyncIterator[KubernetesPodDirectory]:
    """A pod directory watching the fake API server."""
    configuration = client.Configuration(host=f"http://127.0.0.1:{api.port}")
    watched = KubernetesPodDirectory(lambda: client.ApiClient(configuration))
    yield watched
    await watched.stop()


async def test_list_then_watch_keeps_pods_and_owners(api: FakeApiServer, directory: KubernetesPodDirectory) -> None:
    """Listed pods answer at once; ADDED, MODIFIED and DELETED events follow; Deployments come from ReplicaSets."""
    api.items = [
        pod("ml", "trainer-7c9d-a", {"app": "trainer", "pod-template-hash": "7c9d"}, ("ReplicaSet", "trainer-7c9d"))
    ]
    assert directory.problem() is not None  # not listed yet: workload queries must not read "no pods"
    await directory.start()
    await until(lambda: directory.problem() is None)
    info = directory.lookup("ml", "trainer-7c9d-a")
    assert info is not None
    assert (info.workload_kind, info.workload) == ("Deployment", "trainer")

    api.events.put_nowait({"type": "ADDED", "object": pod("ml", "db-0", {"app": "db"}, ("StatefulSet", "db"))})
    await until(lambda: directory.lookup("ml", "db-0") is not None)
    api.events.put_nowait({"type": "MODIFIED", "object": pod("ml", "db-0", {"app": "db", "tier": "x"})})
    await until(lambda: _labels(directory, "ml", "db-0").get("tier") == "x")
    api.events.put_nowait({"type": "DELETED", "object": pod("ml", "trainer-7c9d-a", {})})
    await until(lambda: directory.lookup("ml", "trainer-7c9d-a") is None)
    assert api.watches[0] == "10"  # the watch resumed from the list's resourceVersion


async def test_a_410_relists(api: FakeApiServer, directory: KubernetesPodDirectory) -> None:
    """An expired resourceVersion (410 Gone) makes the directory list again, picking up what it missed."""
    await directory.start()
    await until(lambda: api.lists == 1 and len(api.watches) == 1)
    api.items = [pod("ml", "late", {})]
    api.events.put_nowait(
        {"type": "ERROR", "object": {"kind": "Status", "code": 410, "reason": "Expired", "message": "too old"}}
    )
    api.events.put_nowait(None)
    await until(lambda: directory.lookup("ml", "late") is not None)
    assert api.lists >= 2


async def test_an_unreachable_api_is_a_problem_until_it_answers() -> None:
    """Before the first list arrives, the problem names the failure; workload queries then fail UNAVAILABLE."""
    configuration = client.Configuration(host="http://127.0.0.1:9")  # discard port: nothing listens
    directory = KubernetesPodDirectory(lambda: client.ApiClient(configuration))
    await directory.start()
    try:
        await until(lambda: "has not listed" in (directory.problem() or "") and "Error" in (directory.problem() or ""))
    finally:
        await directory.stop()


async def test_a_refused_list_is_a_problem_not_an_empty_cluster(
    api: FakeApiServer, directory: KubernetesPodDirectory
) -> None:
    """A list the API refuses (403: RBAC) leaves the directory unsynced: workload queries fail, never read 0."""
    api.pods.refused = (403, "Forbidden")
    await directory.start()
    await until(lambda: api.lists >= 2)  # retried, and still not synced
    assert "has not listed the pods yet: HTTP 403" in (directory.problem() or "")
    api.pods.refused = None
    api.items = [pod("ml", "trainer-0", {"app": "trainer"})]
    await until(lambda: directory.problem() is None and directory.lookup("ml", "trainer-0") is not None, timeout=10)


async def test_outside_a_cluster_it_watches_the_api_server_kubeconfig_names(
    api: FakeApiServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No service account here: KUBECONFIG's cluster and user are used, as kubectl would use them."""
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "fake", "cluster": {"server": f"http://127.0.0.1:{api.port}"}}],
                "users": [{"name": "tester", "user": {"token": "not-checked"}}],
                "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "tester"}}],
                "current-context": "fake",
            }
        )
    )
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    api.items = [pod("ml", "trainer-7c9d-a", {"app": "trainer"})]
    directory = await KubernetesPodDirectory.connect()
    try:
        await directory.start()
        await until(lambda: directory.problem() is None)
        assert _labels(directory, "ml", "trainer-7c9d-a") == {"app": "trainer"}
    finally:
        await directory.stop()


async def test_outside_a_cluster_without_kubeconfig_it_says_what_to_set(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Neither a service account nor KUBECONFIG: a ConfigError naming both ways out; a KUBECONFIG that cannot be
    read is named."""
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.delenv("KUBECONFIG", raising=False)
    with pytest.raises(ConfigError, match="set KUBECONFIG or give a static pod directory file"):
        await KubernetesPodDirectory.connect()
    missing = tmp_path / "nowhere"
    monkeypatch.setenv("KUBECONFIG", str(missing))
    with pytest.raises(ConfigError, match=f"KUBECONFIG '{missing}'"):
        await KubernetesPodDirectory.connect()
