"""Objects kept by key and by namespace, each namespace with a version that moves whenever its objects change.

A workload query reads one namespace's pods at every evaluation, and a cluster may hold tens of thousands of pods:
kept by namespace, that read is a look-up and a copy of that namespace's pods, not a pass over the cluster's. The
version lets a reader that looked into a namespace skip looking again while nothing there changed
(``signals/empty_selection_record.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Iterator
from typing import Generic, TypeVar

Item = TypeVar("Item")


class ByNamespace(Generic[Item]):
    """Objects by key, and by namespace; an object's namespace is part of its key (it never moves).

    A namespace's version is the number of the last change to its objects, counted over all namespaces, so it never
    comes back to a value it had; 0 for a namespace with no objects. Runs on the event loop thread only.
    """

    def __init__(self, namespace_of: Callable[[Item], str]) -> None:
        self._namespace_of = namespace_of
        self._items: dict[Hashable, Item] = {}
        self._by_namespace: dict[str, dict[Hashable, Item]] = {}
        self._versions: dict[str, int] = {}
        self._changes = 0

    def get(self, key: Hashable) -> Item | None:
        return self._items.get(key)

    def in_namespace(self, namespace: str) -> list[Item]:
        """The namespace's objects, as a list of its own (the caller may keep it while objects change)."""
        return list(self._by_namespace.get(namespace, {}).values())

    def version(self, namespace: str) -> int:
        return self._versions.get(namespace, 0)

    def values(self) -> Iterator[Item]:
        return iter(self._items.values())

    def __len__(self) -> int:
        return len(self._items)

    def put(self, key: Hashable, item: Item) -> None:
        """Add or replace the object under ``key``."""
        self._items[key] = item
        namespace = self._namespace_of(item)
        self._by_namespace.setdefault(namespace, {})[key] = item
        self._touch(namespace)

    def drop(self, key: Hashable) -> None:
        """Remove the object under ``key``, if there is one."""
        item = self._items.pop(key, None)
        if item is None:
            return
        namespace = self._namespace_of(item)
        kept = self._by_namespace[namespace]
        del kept[key]
        if kept:
            self._touch(namespace)
        else:
            del self._by_namespace[namespace]
            del self._versions[namespace]

    def replace(self, items: Iterable[tuple[Hashable, Item]]) -> None:
        """All objects at once, by key (a new list): every namespace's version moves."""
        self._items = dict(items)
        self._by_namespace = {}
        for key, item in self._items.items():
            self._by_namespace.setdefault(self._namespace_of(item), {})[key] = item
        self._changes += 1
        self._versions = dict.fromkeys(self._by_namespace, self._changes)

    def _touch(self, namespace: str) -> None:
        self._changes += 1
        self._versions[namespace] = self._changes
