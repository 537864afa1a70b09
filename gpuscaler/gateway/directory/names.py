"""The names the directory has seen since the gateway started: namespaces, and the workload names that owned a pod or
that a ScaledObject's scaleTargetRef named in each, at most ``MAX_SEEN_NAMES`` of each, the oldest seen forgotten first.

A selection that matches no pod reads 0, whether its workload is at zero replicas or its name is a typo; whether
the name was ever carried in its namespace tells the two apart (``signals/empty_selection.py``). Remembering
costs a few dictionary entries per name, kept by namespace and by name so that each question is a look-up, and a
name seen again moves to the young end: only names no pod or ScaledObject has carried for a long time (and many
newer ones since) are forgotten.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection

from gpuscaler.model.pods import POD_OWNER, SCALE_TARGET_REF, PodInfo, ScaleTarget

# Of workload names over all namespaces, and of namespaces: a few hundred bytes an entry, so a few MB at most.
MAX_SEEN_NAMES = 20_000
_CARRIED_BY = {
    carriers: frozenset(carriers) for carriers in ((POD_OWNER,), (SCALE_TARGET_REF,), (POD_OWNER, SCALE_TARGET_REF))
}
_NONE: frozenset[str] = frozenset()


class SeenNames:
    """Workload names by (namespace, name) with what carried them, and namespaces; each capped at ``limit``.

    The gateway's ``NameHistory`` (``model/pods.py``). A namespace's ``version`` moves when a workload name there is
    added, gains a carrier or is forgotten (the part of a directory's version that is about names). Runs on the event
    loop thread only.
    """

    def __init__(self, limit: int = MAX_SEEN_NAMES) -> None:
        self._limit = limit
        self._workloads: OrderedDict[tuple[str, str], frozenset[str]] = OrderedDict()
        self._by_namespace: dict[str, dict[str, None]] = {}
        self._by_name: dict[str, dict[str, None]] = {}
        self._namespaces: OrderedDict[str, None] = OrderedDict()
        # The number of the last change to a namespace's workload names, counted over all namespaces: it never comes
        # back to a value it had. Kept for the namespaces that have names, so it is capped with them.
        self._versions: dict[str, int] = {}
        self._changes = 0

    def saw_pod(self, info: PodInfo) -> None:
        """A pod the directory listed or was told of: its namespace, and its owner's name."""
        self._namespace(info.namespace)
        if info.workload:
            self._workload(info.namespace, info.workload, POD_OWNER)

    def saw_scale_target(self, target: ScaleTarget) -> None:
        """A ScaledObject the directory listed or was told of: its namespace, and the name its scaleTargetRef gives."""
        self._namespace(target.namespace)
        self._workload(target.namespace, target.name, SCALE_TARGET_REF)

    def carriers(self, namespace: str, name: str) -> frozenset[str]:
        return self._workloads.get((namespace, name), _NONE)

    def workload_names(self, namespace: str) -> Collection[str]:
        return self._by_namespace.get(namespace, {}).keys()

    def namespaces_with(self, name: str) -> Collection[str]:
        return self._by_name.get(name, {}).keys()

    def workload_names_anywhere(self) -> Collection[str]:
        return self._by_name.keys()

    def namespaces(self) -> Collection[str]:
        return self._namespaces.keys()

    def version(self, namespace: str) -> int:
        """Moves whenever ``carriers`` could answer differently for a name in ``namespace``; 0 for one without names."""
        return self._versions.get(namespace, 0)

    def _namespace(self, namespace: str) -> None:
        names = self._namespaces
        if namespace in names:
            names.move_to_end(namespace)
            return
        names[namespace] = None
        if len(names) > self._limit:
            names.popitem(last=False)

    def _workload(self, namespace: str, name: str, carrier: str) -> None:
        key = (namespace, name)
        workloads = self._workloads
        carriers = workloads.get(key)
        if carriers is not None:
            workloads.move_to_end(key)
            if carrier not in carriers:
                workloads[key] = _CARRIED_BY[(POD_OWNER, SCALE_TARGET_REF)]
                self._changed(namespace)
            return
        workloads[key] = _CARRIED_BY[(carrier,)]
        self._by_namespace.setdefault(namespace, {})[name] = None
        self._by_name.setdefault(name, {})[namespace] = None
        self._changed(namespace)
        if len(workloads) > self._limit:
            (old_namespace, old_name), _ = workloads.popitem(last=False)
            _drop(self._by_namespace, old_namespace, old_name)
            _drop(self._by_name, old_name, old_namespace)
            if old_namespace in self._by_namespace:
                self._changed(old_namespace)
            else:
                del self._versions[old_namespace]

    def _changed(self, namespace: str) -> None:
        self._changes += 1
        self._versions[namespace] = self._changes


def _drop(index: dict[str, dict[str, None]], outer: str, inner: str) -> None:
    entries = index[outer]
    del entries[inner]
    if not entries:
        del index[outer]
