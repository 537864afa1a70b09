"""The names a directory remembers: pods' owners and scaleTargetRefs by namespace, capped, through every directory."""

from __future__ import annotations

from pathlib import Path

from kubernetes_asyncio import client

from gpuscaler.gateway.directory.kubernetes import KubernetesDirectory
from gpuscaler.gateway.directory.names import SeenNames
from gpuscaler.gateway.directory.pod_file import StaticPodDirectory
from gpuscaler.gateway.directory.pod_watch import KubernetesPodDirectory
from gpuscaler.gateway.directory.scaled_objects import KubernetesScaledObjects
from gpuscaler.model.pods import POD_OWNER, SCALE_TARGET_REF, PodInfo, ScaleTarget
from tests.gateway.directory.test_pod_watch import pod
from tests.gateway.directory.test_scaled_objects import FakeKedaApi, scaled_object
from tests.waiting import until


def test_a_name_remembers_what_carried_it() -> None:
    """A pod's owner and a ScaledObject's scaleTargetRef each mark the name; pods without an owner add none."""
    seen = SeenNames()
    seen.saw_pod(PodInfo("ml", "trainer-a", workload="trainer"))
    seen.saw_scale_target(ScaleTarget("ml", "trainer-so", "Deployment", "trainer"))
    seen.saw_scale_target(ScaleTarget("ml", "sleeper-so", "Deployment", "sleeper"))
    seen.saw_pod(PodInfo("batch", "loose"))
    seen.saw_pod(PodInfo("batch", "trainer-0", workload="trainer"))
    assert seen.carriers("ml", "trainer") == {POD_OWNER, SCALE_TARGET_REF}
    assert seen.carriers("ml", "sleeper") == {SCALE_TARGET_REF}
    assert seen.carriers("ml", "nobody") == frozenset()
    assert sorted(seen.workload_names("ml")) == ["sleeper", "trainer"]
    assert sorted(seen.namespaces_with("trainer")) == ["batch", "ml"]
    assert sorted(seen.workload_names_anywhere()) == ["sleeper", "trainer"]
    assert sorted(seen.namespaces()) == ["batch", "ml"]


def test_past_the_cap_the_name_seen_longest_ago_goes_first() -> None:
    """At the cap, a new name pushes out the one least recently seen; seeing a name again keeps it young."""
    seen = SeenNames(limit=2)
    seen.saw_pod(PodInfo("a", "p", workload="old"))
    seen.saw_pod(PodInfo("b", "p", workload="kept"))
    seen.saw_pod(PodInfo("a", "q", workload="old"))  # seen again: now the youngest
    seen.saw_pod(PodInfo("c", "p", workload="new"))
    assert (seen.carriers("b", "kept"), list(seen.workload_names("b")), list(seen.namespaces_with("kept"))) == (
        frozenset(),
        [],
        [],
    )
    assert sorted(seen.workload_names_anywhere()) == ["new", "old"]
    assert list(seen.namespaces()) == ["a", "c"]


def test_a_namespace_s_version_moves_only_when_what_its_names_say_changes() -> None:
    """A new name, a new carrier or a forgotten name moves it; the same name seen again (a pod's restart) does not."""
    seen = SeenNames(limit=2)
    assert seen.version("ml") == 0
    seen.saw_pod(PodInfo("ml", "trainer-a", workload="trainer"))
    first = seen.version("ml")
    seen.saw_pod(PodInfo("ml", "trainer-b", workload="trainer"))
    assert seen.version("ml") == first
    seen.saw_scale_target(ScaleTarget("ml", "trainer-so", "Deployment", "trainer"))
    carried = seen.version("ml")
    assert carried != first
    seen.saw_pod(PodInfo("batch", "job-a", workload="job"))
    assert seen.version("ml") == carried  # another namespace's name
    seen.saw_pod(PodInfo("batch", "job-b", workload="job-2"))  # pushes trainer out: ml has no names left
    assert seen.carriers("ml", "trainer") == frozenset()
    assert seen.version("ml") == 0


def test_the_static_directory_remembers_the_names_of_earlier_versions(tmp_path: Path) -> None:
    """A workload the file no longer lists is still a name its namespace carried."""
    path = tmp_path / "pods.yaml"
    path.write_text(
        "pods:\n  - {namespace: ml, pod: trainer-a, workload: trainer}\n"
        "scaledObjects:\n  - {namespace: ml, name: so, scaleTargetRef: {name: sleeper}}\n"
    )
    directory = StaticPodDirectory(path)
    path.write_text("pods:\n  - {namespace: ml, pod: web-1, workload: web}\n")
    directory.reload_now()
    assert [info.pod for info in directory.pods("ml")] == ["web-1"]
    assert sorted(directory.seen_names.workload_names("ml")) == ["sleeper", "trainer", "web"]


async def test_the_kubernetes_directory_remembers_deleted_pods_owners_and_scale_targets() -> None:
    """Through the pod and ScaledObject watches: a listed pod's owner stays a seen name after the pod is deleted."""
    api = FakeKedaApi()
    await api.start()
    configuration = client.Configuration(host=f"http://127.0.0.1:{api.port}")
    seen = SeenNames()
    pods = KubernetesPodDirectory(lambda: client.ApiClient(configuration), seen=seen)
    directory = KubernetesDirectory(pods, KubernetesScaledObjects(pods.api_client_factory, seen=seen), seen)
    api.items = [scaled_object("ml", "so", {"name": "sleeper"})]
    listed_pods = api.collections[1]
    listed_pods.items = [pod("ml", "trainer-7c9d-a", {"pod-template-hash": "7c9d"}, ("ReplicaSet", "trainer-7c9d"))]
    await directory.start()
    try:
        await until(lambda: directory.problem() is None and directory.scale_targets_problem() is None)
        listed = directory.version("ml")
        listed_pods.events.put_nowait({"type": "DELETED", "object": pod("ml", "trainer-7c9d-a", {})})
        await until(lambda: directory.lookup("ml", "trainer-7c9d-a") is None)
        assert directory.version("ml") != listed  # its pods changed
        assert directory.pods("ml") == []
        names = directory.seen_names
        assert names.carriers("ml", "sleeper") == {SCALE_TARGET_REF}
        assert names.carriers("ml", "trainer") == {POD_OWNER}
        assert list(names.namespaces()) == ["ml"]
    finally:
        await directory.stop()
        await api.stop()
