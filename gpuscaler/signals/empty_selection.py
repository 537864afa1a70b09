"""The finding, pure, for a pod selection that matches no pod: a workload at zero replicas, or a name nothing carries.

Both read 0, and must (KEDA scales a workload at zero from it; an error would apply its fallback). What differs
is whether the workload name was carried in the namespace since the gateway started, by a pod's owner or a
ScaledObject's scaleTargetRef (the directory's ``seen_names``), and the names it may have meant: workload
names in the namespace close to it, the namespaces where that name was seen, and, when the namespace has no
pods, the namespace names close to it. A pod glob or a podSelector names no workload: its finding says only
that it matches nothing. Making a finding reads the directory and changes nothing; the record of KEDA's
ScaledObjects that such findings are about, with its log and series, is ``empty_selection_record.py``.
"""

from __future__ import annotations

import difflib
import itertools
from collections.abc import Collection, Iterable
from dataclasses import dataclass, replace
from enum import StrEnum

from gpuscaler.model.pods import POD_OWNER, NameHistory, PodDirectory, PodInfo
from gpuscaler.query.query import CombinedQuery, PodSelection
from gpuscaler.signals.outcome import Evaluation

# difflib's ratio: "trainr" is 0.92 of "trainer", "mll" 0.8 of "ml"; unrelated names of similar length stay below.
CLOSE_RATIO = 0.6
SUGGESTIONS = 3
# Names compared with one asked for: each comparison costs tens of microseconds on the event loop, and a gateway
# remembers up to 20,000 names, so past this many only the likeliest are compared (``_close``).
MAX_COMPARED = 100


class Seen(StrEnum):
    """Whether a pod's owner or a scaleTargetRef in the namespace carried the workload name since the start."""

    YES = "yes"
    NO = "no"
    UNKNOWN = "unknown"  # the selection names no workload, or the directory remembers no names


@dataclass(frozen=True, slots=True)
class EmptySelection:
    """What a selection that matched no pod was, and what it may have meant to be."""

    selection: str  # the selection, in words
    namespace: str
    workload: str | None  # the workload name asked for; None for a pod glob or a podSelector
    seen: Seen
    seen_as: tuple[str, ...]  # what carried the name: POD_OWNER, SCALE_TARGET_REF
    namespace_pods: int  # pods the namespace has now
    did_you_mean: tuple[str, ...]  # workload names (or, for a pod glob, "<workload>-*") in the namespace
    seen_in_namespaces: tuple[str, ...]  # other namespaces where that workload name was carried
    namespace_did_you_mean: tuple[str, ...]  # namespace names close to the namespace, when it has no pods
    # Without a close name in the namespace: close workload names in other namespaces, as "namespace/name".
    did_you_mean_elsewhere: tuple[str, ...] = ()

    def describe(self) -> str:
        """The finding in words, as Explain and the log give it."""
        said = [
            f"{self.selection[:1].upper()}{self.selection[1:]}: none matches, so KEDA gets 0, as for a workload "
            "at zero replicas."
        ]
        if self.namespace_pods == 0:
            near = (
                f"; did you mean namespace {_either(self.namespace_did_you_mean)}?"
                if self.namespace_did_you_mean
                else "."
            )
            said.append(f"Namespace {self.namespace} has no pods{near}")
        if self.workload is not None:
            said += self._workload_words(self.workload)
        elif self.did_you_mean:
            said.append(f"Did you mean pod {_either(self.did_you_mean)}?")
        return " ".join(said)

    def _workload_words(self, workload: str) -> list[str]:
        where = f"namespace {self.namespace}"
        if self.seen is Seen.YES:
            carried = " and ".join(
                "a pod's owner" if carrier == POD_OWNER else "a ScaledObject's scaleTargetRef"
                for carrier in self.seen_as
            )
            return [
                f"{carried[:1].upper()}{carried[1:]} in {where} named {workload} since the gateway started: "
                "at zero replicas?"
            ]
        said = [
            f"Nothing in {where} has carried the name {workload} since the gateway started (no pod's owner, no "
            "ScaledObject's scaleTargetRef), so a ScaledObject with this trigger never scales up."
            if self.seen is Seen.NO
            else f"Whether anything in {where} carried the name {workload} is not known here."
        ]
        if self.did_you_mean:
            said.append(f"Did you mean workload {_either(self.did_you_mean)}?")
        elif self.did_you_mean_elsewhere:
            said.append(f"Did you mean {_either(self.did_you_mean_elsewhere)} (namespace/workload)?")
        if self.seen_in_namespaces:
            said.append(
                f"Workload {workload} is in namespace {_either(self.seen_in_namespaces)}: "
                f"give namespace={self.seen_in_namespaces[0]}."
            )
        return said


def unmatched_of(evaluation: Evaluation) -> PodSelection | None:
    """The selection an answer of 0 matched no GPU-holding (or, for engine signals, no) pod of; for a combined query
    that answered 0, its first such signal's."""
    if evaluation.unmatched is not None or not isinstance(evaluation.query, CombinedQuery) or evaluation.value != 0:
        return evaluation.unmatched
    return next((part.unmatched for part in evaluation.parts if part.unmatched is not None), None)


def find_empty(
    selection: PodSelection | None, directory: PodDirectory | None, *, suggest: bool = True
) -> EmptySelection | None:
    """The finding for ``selection`` (resolved: no scaleTargetPods) if it matches no pod the directory knows; None
    when a pod matches (it may hold no GPU yet), or when the directory cannot tell now (``problem()``).
    ``suggest=False`` leaves out the names it may have meant, which read more of what the directory remembers."""
    if selection is None or directory is None or directory.problem() is not None:
        return None
    namespace = selection.namespace
    pods = list(directory.pods(namespace))
    if any(selection.selects(info) for info in pods):
        return None
    names = directory.seen_names
    workload = selection.workload
    seen = Seen.UNKNOWN
    seen_as: tuple[str, ...] = ()
    if workload is not None and names is not None:
        carriers = names.carriers(namespace, workload)
        carriers |= {POD_OWNER} if any(info.workload == workload for info in pods) else frozenset()
        seen, seen_as = (Seen.YES, tuple(sorted(carriers))) if carriers else (Seen.NO, ())
    finding = EmptySelection(
        selection=selection.describe(),
        namespace=namespace,
        workload=workload,
        seen=seen,
        seen_as=seen_as,
        namespace_pods=len(pods),
        did_you_mean=(),
        seen_in_namespaces=(),
        namespace_did_you_mean=(),
    )
    return _with_suggestions(finding, selection, pods, names) if suggest else finding


def _with_suggestions(
    finding: EmptySelection, selection: PodSelection, pods: list[PodInfo], names: NameHistory | None
) -> EmptySelection:
    namespace, workload = selection.namespace, selection.workload
    here = {info.workload for info in pods if info.workload}
    if names is not None:
        here.update(names.workload_names(namespace))
    did_you_mean: tuple[str, ...] = ()
    seen_in: tuple[str, ...] = ()
    elsewhere: tuple[str, ...] = ()
    if workload is not None:
        did_you_mean = _close(workload, here - {workload})
        if names is not None:
            seen_in = tuple(sorted(set(names.namespaces_with(workload)) - {namespace}))
            if not did_you_mean:
                elsewhere = _close_elsewhere(workload, namespace, names)
    elif selection.pod is not None and selection.labels is None:
        # A pod's name is its workload's and a suffix: the globs a workload's pods match are the ones to suggest.
        did_you_mean = _close(selection.pod, {f"{name}-*" for name in here} - {selection.pod})
    namespaces = _close(namespace, set(names.namespaces()) - {namespace}) if not pods and names is not None else ()
    return replace(
        finding,
        did_you_mean=did_you_mean,
        seen_in_namespaces=seen_in,
        namespace_did_you_mean=namespaces,
        did_you_mean_elsewhere=elsewhere,
    )


def _close_elsewhere(workload: str, namespace: str, names: NameHistory) -> tuple[str, ...]:
    """Workload names close to ``workload`` carried in other namespaces, as "namespace/name"."""
    close = (
        f"{space}/{name}"
        for name in _close(workload, names.workload_names_anywhere())
        if name != workload
        for space in sorted(names.namespaces_with(name))
        if space != namespace
    )
    return tuple(itertools.islice(close, SUGGESTIONS))


def _close(word: str, candidates: Collection[str]) -> tuple[str, ...]:
    """The closest few of ``candidates``. Past ``MAX_COMPARED`` of them, only names with the word's first letter and
    a length within 3 of its own are compared, the first ``MAX_COMPARED`` of those: a typo seldom starts a name."""
    if len(candidates) > MAX_COMPARED:
        first, shortest, longest = word[:1], len(word) - 3, len(word) + 3
        likely = [name for name in candidates if name[:1] == first and shortest <= len(name) <= longest]
        candidates = likely[:MAX_COMPARED]
    return tuple(difflib.get_close_matches(word, candidates, n=SUGGESTIONS, cutoff=CLOSE_RATIO))


def _either(names: Iterable[str]) -> str:
    return " or ".join(names)
