"""Objects by key and by namespace: a namespace's objects are a look-up, and its version moves with them alone."""

from __future__ import annotations

from collections.abc import Callable

from gpuscaler.gateway.directory.by_namespace import ByNamespace
from gpuscaler.model.pods import PodInfo


def pods() -> ByNamespace[PodInfo]:
    """An empty index of pods by (namespace, name)."""
    return ByNamespace(lambda info: info.namespace)


def test_a_namespace_holds_its_own_objects_only() -> None:
    """Put, replace and drop keep each namespace's objects; a namespace without any reads empty."""
    index = pods()
    index.put(("ml", "a"), PodInfo("ml", "a"))
    index.put(("ml", "b"), PodInfo("ml", "b"))
    index.put(("web", "c"), PodInfo("web", "c"))
    index.put(("ml", "a"), PodInfo("ml", "a", workload="trainer"))
    index.drop(("ml", "b"))
    index.drop(("ml", "nothing"))
    assert index.in_namespace("ml") == [PodInfo("ml", "a", workload="trainer")]
    assert [info.pod for info in index.in_namespace("web")] == ["c"]
    assert index.in_namespace("none") == []
    assert (len(index), index.get(("web", "c"))) == (2, PodInfo("web", "c"))


def test_a_namespace_s_version_moves_when_its_objects_change_and_never_comes_back() -> None:
    """A change elsewhere leaves it; a change there, a drop or a new list moves it to a value it never had."""
    index = pods()
    index.put(("ml", "a"), PodInfo("ml", "a"))
    index.put(("web", "c"), PodInfo("web", "c"))
    versions = [index.version("ml")]
    index.put(("web", "d"), PodInfo("web", "d"))
    assert index.version("ml") == versions[-1]
    changes: list[Callable[[], None]] = [
        lambda: index.put(("ml", "b"), PodInfo("ml", "b")),
        lambda: index.put(("ml", "b"), PodInfo("ml", "b", ready=False)),
        lambda: index.drop(("ml", "b")),
        lambda: index.replace([(("ml", "a"), PodInfo("ml", "a"))]),
    ]
    for change in changes:
        change()
        assert index.version("ml") not in versions
        versions.append(index.version("ml"))
    index.drop(("ml", "a"))
    assert (index.version("ml"), index.in_namespace("ml")) == (0, [])  # no objects: as if never seen
    assert index.version("web") == 0  # the new list had none there
