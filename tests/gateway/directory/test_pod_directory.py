"""Pod directories: a pod's owner workload, and the static file for places without a Kubernetes API."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gpuscaler.gateway.directory.pod_file import StaticPodDirectory, parse_static_pods
from gpuscaler.gateway.directory.pod_watch import owner_workload, pod_info
from gpuscaler.model.errors import ConfigError


@pytest.mark.parametrize(
    ("kind", "name", "labels", "expected"),
    [
        ("ReplicaSet", "trainer-7c9d8b5f4", {"pod-template-hash": "7c9d8b5f4"}, ("Deployment", "trainer")),
        ("ReplicaSet", "my-app-v2-5d4f", {"pod-template-hash": "5d4f"}, ("Deployment", "my-app-v2")),
        ("ReplicaSet", "standalone", {}, ("ReplicaSet", "standalone")),
        ("ReplicaSet", "other-abc", {"pod-template-hash": "xyz"}, ("ReplicaSet", "other-abc")),
        ("StatefulSet", "db", {}, ("StatefulSet", "db")),
        ("Job", "batch-1", {}, ("Job", "batch-1")),
        (None, None, {}, (None, None)),
    ],
)
def test_owner_workload(
    kind: str | None, name: str | None, labels: dict[str, str], expected: tuple[str | None, str | None]
) -> None:
    """A ReplicaSet named <deployment>-<pod-template-hash> means its Deployment; other owners are themselves."""
    assert owner_workload(kind, name, labels) == expected


def test_static_file_round_trip(tmp_path: Path) -> None:
    """Entries give labels and the workload; lookups by namespace and pod name."""
    path = tmp_path / "pods.yaml"
    path.write_text(
        "pods:\n"
        "  - {namespace: ml, pod: trainer-0, labels: {app: trainer}, workload: trainer, workloadKind: Deployment,\n"
        "     uid: 1b4e2a3c-1111-2222-3333-444455556666}\n"
        "  - {namespace: ml, pod: loose}\n"
    )
    directory = StaticPodDirectory(path)
    info = directory.lookup("ml", "trainer-0")
    assert info is not None
    assert (info.labels, info.workload, info.workload_kind) == ({"app": "trainer"}, "trainer", "Deployment")
    assert info.uid == "1b4e2a3c-1111-2222-3333-444455556666"
    loose = directory.lookup("ml", "loose")
    assert loose is not None
    assert loose.workload is None
    assert directory.lookup("other", "trainer-0") is None
    assert directory.problem() is None


def test_the_pod_watch_keeps_each_pods_uid() -> None:
    """A pod from the API keeps metadata.uid, which ties its processes' cgroups to it on a shared GPU."""
    info = pod_info({"metadata": {"namespace": "ml", "name": "vllm-0", "uid": "1b4e2a3c-1111-2222-3333-444455556666"}})
    assert info is not None
    assert info.uid == "1b4e2a3c-1111-2222-3333-444455556666"
    bare = pod_info({"metadata": {"namespace": "ml", "name": "vllm-1"}})
    assert bare is not None
    assert bare.uid is None


def test_static_file_is_reread_when_it_changes(tmp_path: Path) -> None:
    """A rewritten file is picked up at the next lookup after the reload check."""
    path = tmp_path / "pods.yaml"
    path.write_text("pods: [{namespace: ml, pod: a}]\n")
    directory = StaticPodDirectory(path)
    path.write_text("pods: [{namespace: ml, pod: b}]\n")
    os.utime(path, (1, 1))  # a different mtime even on a coarse clock
    directory.reload_now()
    assert directory.lookup("ml", "b") is not None
    assert directory.lookup("ml", "a") is None


def test_a_broken_rewrite_keeps_the_pods_it_had(tmp_path: Path) -> None:
    """A half-written file is logged and ignored, so workloads do not suddenly read as empty."""
    path = tmp_path / "pods.yaml"
    path.write_text("pods: [{namespace: ml, pod: a}]\n")
    directory = StaticPodDirectory(path)
    path.write_text("pods: [{namespace: ml")
    os.utime(path, (1, 1))
    directory.reload_now()
    assert directory.lookup("ml", "a") is not None


def test_a_missing_file_is_a_problem_after_start(tmp_path: Path) -> None:
    """Deleting the file makes the directory report a problem instead of answering from nothing."""
    path = tmp_path / "pods.yaml"
    path.write_text("pods: []\n")
    directory = StaticPodDirectory(path)
    path.unlink()
    directory.reload_now()
    assert "cannot be read" in (directory.problem() or "")


@pytest.mark.parametrize(
    ("text", "complaint"),
    [
        ("[1, 2]", "expected a mapping with a 'pods' list"),
        ("pod: []", "unknown top-level keys ['pod']"),
        ("pods: [{namespace: ml}]", "pods[1]: pod is missing"),
        ("pods: [{namespace: ml, pod: a, owner: x}]", "pods[1]: unknown keys ['owner']"),
        ("pods: [{namespace: ml, pod: a, labels: [x]}]", "labels must be a mapping"),
        ("pods: [{namespace: ml, pod: a, workload: 3}]", "workload must be a string"),
        ("pods: [{namespace: ml, pod: a, uid: 7}]", "uid must be a string"),
        ("pods: [{", "not YAML"),
    ],
)
def test_static_file_errors_name_the_entry(text: str, complaint: str) -> None:
    """A bad file is a ConfigError naming the entry and the field."""
    with pytest.raises(ConfigError, match=complaint.replace("[", r"\[").replace("]", r"\]")):
        parse_static_pods(text, source="pods.yaml")


def test_a_missing_file_at_start_is_a_config_error(tmp_path: Path) -> None:
    """Starting with a path that does not exist fails at once, naming the file."""
    with pytest.raises(ConfigError, match=r"pods\.yaml"):
        StaticPodDirectory(tmp_path / "pods.yaml")
