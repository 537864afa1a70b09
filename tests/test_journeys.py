"""Every ScaledObject the README, docs/ and the chart's examples show describes a journey that can happen.

Two rules, both about what a reader would copy:

- A workload at zero replicas holds no GPU, so a trigger that reads only its own pods' GPUs reads a true 0 there
  and can never wake it. A ScaledObject that may go to zero (``minReplicaCount`` 0, KEDA's default) needs a trigger
  whose signal exists at zero: another workload's GPUs, a pool's, or a trigger of another kind.
- The README's objects and the chart's examples select their workload's pods: without a selector a trigger reads
  every GPU of the cluster, other tenants' included (the prior art's leak).
"""

from __future__ import annotations

from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpuscaler.query.keys import POD_NAME_KEYS, SELECTOR_KEYS
from tests.test_docs import EXAMPLES, EXTERNAL_TRIGGERS, ROOT, YAML_SOURCES, YamlSource

POD_SELECTION = (*POD_NAME_KEYS, "scaleTargetPods")


def scaled_objects(source: YamlSource) -> list[dict[str, Any]]:
    """The ScaledObjects among the source's YAML documents."""
    return [d for d in yaml.safe_load_all(source.text) if isinstance(d, dict) and d.get("kind") == "ScaledObject"]


def reads_only_its_own_pods(scaled_object: dict[str, Any], trigger: dict[str, Any]) -> bool:
    """Whether an external trigger's value comes from the GPUs of the ScaledObject's own target's pods only."""
    metadata = trigger.get("metadata", {})
    target = scaled_object["spec"]["scaleTargetRef"]["name"]
    own_namespace = scaled_object["metadata"].get("namespace", "default")
    if metadata.get("namespace", own_namespace) != own_namespace:
        return False
    if metadata.get("scaleTargetPods") == "true" and not any(key in metadata for key in SELECTOR_KEYS):
        return True
    if metadata.get("workload") == target:
        return True
    return "pod" in metadata and fnmatchcase(f"{target}-7c9d8-x2x4p", metadata["pod"])


def cannot_wake(scaled_object: dict[str, Any]) -> str | None:
    """Why the ScaledObject, once at zero, could never scale up again; None when it can (or never reaches zero)."""
    spec = scaled_object["spec"]
    if int(spec.get("minReplicaCount", 0)) >= 1:
        return None
    triggers = spec["triggers"]
    if any(t["type"] not in EXTERNAL_TRIGGERS or not reads_only_its_own_pods(scaled_object, t) for t in triggers):
        return None
    return (
        f"{scaled_object['metadata']['name']}: minReplicaCount {spec.get('minReplicaCount', '0 (KEDA default)')}, but "
        f"every trigger reads only {spec['scaleTargetRef']['name']}'s own pods, which hold no GPU at zero"
    )


CASES = [
    pytest.param(source, document, id=f"{source.id}:{document['metadata']['name']}")
    for source in YAML_SOURCES
    for document in scaled_objects(source)
]


@pytest.mark.parametrize(("source", "scaled_object"), CASES)
def test_a_scaled_object_that_may_reach_zero_can_wake(source: YamlSource, scaled_object: dict[str, Any]) -> None:
    """No documented ScaledObject goes to zero on its own GPUs only, where it would stay for good."""
    assert cannot_wake(scaled_object) is None


def _shown_to_copy(case: Any) -> bool:
    path: Path = case.values[0].path
    return path == ROOT / "README.md" or EXAMPLES in path.parents


@pytest.mark.parametrize(("source", "scaled_object"), [case for case in CASES if _shown_to_copy(case)])
def test_the_readme_and_every_chart_example_select_their_workload(
    source: YamlSource, scaled_object: dict[str, Any]
) -> None:
    """Each external trigger the README and the chart's examples show selects pods, so none reads other tenants'
    GPUs."""
    for trigger in scaled_object["spec"]["triggers"]:
        if trigger["type"] in EXTERNAL_TRIGGERS:
            assert any(key in trigger["metadata"] for key in POD_SELECTION), (source.id, trigger["metadata"])


def test_the_readme_shows_a_workload_on_its_own_gpus_and_one_that_wakes_from_zero() -> None:
    """The README's headline objects are the two shapes: its own GPUs at one replica or more, and a wake from zero."""
    readme = [source for source in YAML_SOURCES if source.path == ROOT / "README.md"]
    objects = [document for source in readme for document in scaled_objects(source)]
    own = [o for o in objects if all(reads_only_its_own_pods(o, t) for t in o["spec"]["triggers"])]
    from_zero = [o for o in objects if int(o["spec"].get("minReplicaCount", 0)) == 0]
    assert own
    assert all(int(o["spec"]["minReplicaCount"]) >= 1 for o in own)
    assert from_zero
    assert all(cannot_wake(o) is None for o in from_zero)
    assert any(t["type"] == "external-push" for o in from_zero for t in o["spec"]["triggers"])


def _scaled_object(minimum: int | None, **metadata: str) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "scaleTargetRef": {"name": "trainer"},
        "triggers": [{"type": "external", "metadata": {"scalerAddress": "x:6000", **metadata}}],
    }
    if minimum is not None:
        spec["minReplicaCount"] = minimum
    return {"kind": "ScaledObject", "metadata": {"name": "trainer", "namespace": "ml"}, "spec": spec}


@pytest.mark.parametrize(
    ("scaled_object", "stuck"),
    [
        (_scaled_object(0, workload="trainer"), True),
        (_scaled_object(None, workload="trainer"), True),
        (_scaled_object(None, scaleTargetPods="true"), True),
        (_scaled_object(0, pod="trainer-*"), True),
        (_scaled_object(1, workload="trainer"), False),
        (_scaled_object(0, workload="primary"), False),
        (_scaled_object(0, workload="trainer", namespace="other"), False),
        (_scaled_object(0, scaleTargetPods="true", workload="primary"), False),
        (_scaled_object(0), False),
    ],
)
def test_the_wake_rule_tells_a_stuck_object_from_one_that_wakes(scaled_object: dict[str, Any], stuck: bool) -> None:
    """The check above can fail: its own pods at zero are stuck; another workload, a pool or one replica are not."""
    assert (cannot_wake(scaled_object) is not None) is stuck
