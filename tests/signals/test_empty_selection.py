"""A selection that matches no pod: which answers say so, and what its names were seen as and may have meant."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from types import SimpleNamespace
from typing import cast

import pytest

from gpuscaler.model.aggregation import Aggregation
from gpuscaler.model.engines import EngineMetric
from gpuscaler.model.pods import POD_OWNER, SCALE_TARGET_REF, PodInfo
from gpuscaler.model.samples import Snapshot
from gpuscaler.query.query import CombinedQuery, EngineQuery, PodSelection, SignalTarget, SingleQuery
from gpuscaler.signals.combined import evaluate_combined
from gpuscaler.signals.empty_selection import MAX_COMPARED, EmptySelection, Seen, find_empty, unmatched_of
from gpuscaler.signals.engines.evaluation import evaluate_engine
from gpuscaler.signals.engines.source import EngineSource
from gpuscaler.signals.evaluation import evaluate
from gpuscaler.signals.outcome import Evaluation
from tests.builders import source_of
from tests.signals.test_evaluation_workloads import DIRECTORY, NODE_A, VIEW, Directory, parse, parse_dict


class Remembering(Directory):
    """A hand-written directory that also remembers names (``seen_names``), as the gateway's do: its pods' owners,
    and the (namespace, name) -> carriers given."""

    def __init__(self, *pods: PodInfo, seen: Mapping[tuple[str, str], frozenset[str]], problem: str | None = None):
        super().__init__(*pods, problem=problem)
        names = dict(seen)
        for info in pods:
            if info.workload:
                names[(info.namespace, info.workload)] = frozenset({POD_OWNER})
        self.seen_names = Names(names)


class Names:
    """A ``NameHistory`` over a fixed table of (namespace, name) -> carriers."""

    def __init__(self, seen: Mapping[tuple[str, str], frozenset[str]]) -> None:
        self._seen = seen

    def carriers(self, namespace: str, name: str) -> frozenset[str]:
        return self._seen.get((namespace, name), frozenset())

    def workload_names(self, namespace: str) -> Collection[str]:
        return {name for space, name in self._seen if space == namespace}

    def namespaces_with(self, name: str) -> Collection[str]:
        return {space for space, named in self._seen if named == name}

    def workload_names_anywhere(self) -> Collection[str]:
        return {name for _, name in self._seen}

    def namespaces(self) -> Collection[str]:
        return {space for space, _ in self._seen}


# The trainer and web pods of ml; a sleeper Deployment at zero that a ScaledObject scales; a retired workload whose
# last pod was deleted; and a vllm workload in the team-b namespace.
NAMES = Remembering(
    PodInfo("ml", "trainer-a1", {"app": "trainer"}, "trainer", "Deployment"),
    PodInfo("ml", "web-1", {"app": "web"}, "web", "Deployment"),
    PodInfo("team-b", "vllm-0", {"app": "vllm"}, "vllm", "Deployment"),
    seen={("ml", "sleeper"): frozenset({SCALE_TARGET_REF}), ("ml", "retired"): frozenset({POD_OWNER})},
)


def found(
    namespace: str = "ml", directory: Directory = NAMES, *, workload: str | None = None, pod: str | None = None
) -> EmptySelection:
    """The finding for the selection of ``workload`` or ``pod`` in ``namespace``; fails if there is none."""
    finding = find_empty(PodSelection(namespace=namespace, workload=workload, pod=pod), directory)
    assert finding is not None
    return finding


def test_a_selection_that_matches_a_pod_has_no_finding_even_if_it_holds_no_gpu() -> None:
    """A pod that matches (Pending, or on no GPU yet) is not a selection of nothing."""
    assert find_empty(PodSelection(namespace="ml", workload="web"), NAMES) is None
    assert find_empty(PodSelection(namespace="ml", pod="trainer-*"), NAMES) is None


def test_without_a_directory_or_while_it_cannot_answer_nothing_is_said() -> None:
    """No directory, or one with a problem, cannot tell an empty selection: no finding rather than a wrong one."""
    selection = PodSelection(namespace="ml", workload="trainr")
    assert find_empty(selection, None) is None
    assert find_empty(selection, Remembering(seen={}, problem="the pod watch has not listed the pods yet")) is None


def test_a_misspelt_workload_was_never_seen_and_the_close_name_is_suggested() -> None:
    """workload=trainr in ml: nothing carried the name; did you mean trainer."""
    finding = found(workload="trainr")
    assert (finding.seen, finding.seen_as, finding.did_you_mean) == (Seen.NO, (), ("trainer",))
    assert finding.namespace_pods == 2
    assert finding.describe() == (
        "Pods in namespace ml, workload trainr: none matches, so KEDA gets 0, as for a workload at zero replicas. "
        "Nothing in namespace ml has carried the name trainr since the gateway started (no pod's owner, no "
        "ScaledObject's scaleTargetRef), so a ScaledObject with this trigger never scales up. "
        "Did you mean workload trainer?"
    )


@pytest.mark.parametrize(
    ("workload", "seen_as", "words"),
    [
        ("sleeper", (SCALE_TARGET_REF,), "A ScaledObject's scaleTargetRef in namespace ml named sleeper"),
        ("retired", (POD_OWNER,), "A pod's owner in namespace ml named retired"),
    ],
)
def test_a_workload_at_zero_was_seen_and_says_by_what(workload: str, seen_as: tuple[str, ...], words: str) -> None:
    """A name a ScaledObject's scaleTargetRef gives, or a deleted pod's owner had, reads as a workload at zero."""
    finding = found(workload=workload)
    assert (finding.seen, finding.seen_as) == (Seen.YES, seen_as)
    assert f"{words} since the gateway started: at zero replicas?" in finding.describe()


def test_a_misspelt_namespace_suggests_the_close_namespace_and_where_the_workload_is() -> None:
    """namespace=mll workload=trainer: mll has no pods; did you mean ml, where trainer is."""
    finding = found(namespace="mll", workload="trainer")
    assert (finding.namespace_pods, finding.namespace_did_you_mean, finding.seen_in_namespaces) == (0, ("ml",), ("ml",))
    assert finding.seen is Seen.NO
    assert "Namespace mll has no pods; did you mean namespace ml?" in finding.describe()
    assert "Workload trainer is in namespace ml: give namespace=ml." in finding.describe()


def test_without_a_namespace_a_misspelt_workload_is_found_in_other_namespaces() -> None:
    """workload=trainr asked in default (a ScaledObject's namespace): the close name elsewhere, as namespace/name."""
    finding = found(namespace="default", workload="trainr")
    assert (finding.did_you_mean, finding.did_you_mean_elsewhere) == ((), ("ml/trainer",))
    assert "Did you mean ml/trainer (namespace/workload)?" in finding.describe()


def test_a_pod_glob_suggests_the_glob_of_a_close_workload_and_names_no_workload() -> None:
    """pod=trainr-*: no workload name to have seen; did you mean trainer-*."""
    finding = found(pod="trainr-*")
    assert (finding.workload, finding.seen, finding.did_you_mean) == (None, Seen.UNKNOWN, ("trainer-*",))
    assert finding.describe().endswith("Did you mean pod trainer-*?")


def test_a_directory_that_remembers_no_names_cannot_say_whether_one_was_seen() -> None:
    """Without a NameHistory the finding is still made, from the pods there are now; seen is unknown."""
    finding = found(workload="trainr", directory=DIRECTORY)
    assert (finding.seen, finding.did_you_mean) == (Seen.UNKNOWN, ("trainer",))


def test_only_the_clusters_zero_for_no_gpu_holding_pod_is_unmatched() -> None:
    """The gateway's 0 for a selection whose pods hold no GPU carries the resolved selection; an answer with pods,
    an error, and a node agent's refusal carry none."""

    def unmatched(view: Snapshot, **metadata: str) -> PodSelection | None:
        query = parse_dict(metadata).value
        return unmatched_of(evaluate(query, source_of(view), now=0.0, stale_after=5.0, directory=DIRECTORY))

    assert unmatched(VIEW, workload="trainr") == PodSelection(namespace="ml", workload="trainr")
    assert unmatched(VIEW, workload="trainer") is None
    assert unmatched(NODE_A, workload="trainr") is None  # an agent's refusal: it cannot tell zero


def test_an_engine_signal_over_no_pod_is_unmatched_and_so_is_a_combined_query_that_answers_0() -> None:
    """An engine signal whose selection matches no pod is a 0 to look into, alone or in a combined query that
    answers 0; beside a signal whose pods ask for replicas, the answer is not 0 and there is nothing to say."""
    nobody = PodSelection(namespace="ml", workload="trainr")
    # No pod is selected, so none is read.
    engines = cast("EngineSource", SimpleNamespace(timeout_seconds=1.0, max_pods=10))

    def evaluate_single(single: SingleQuery) -> Evaluation:
        if isinstance(single, EngineQuery):
            return evaluate_engine(single, engines, DIRECTORY, None, now=0.0)
        return evaluate(single, source_of(VIEW), now=0.0, stale_after=5.0, directory=DIRECTORY)

    queue = EngineQuery(EngineMetric.VLLM_QUEUE, nobody, Aggregation.SUM)
    alone = evaluate_single(queue)
    assert (alone.value, unmatched_of(alone)) == (0.0, nobody)
    both = CombinedQuery((SignalTarget(parse(workload="trainr").value, 70.0), SignalTarget(queue, 8.0)))
    assert unmatched_of(evaluate_combined(both, evaluate_single)) == nobody
    beside = CombinedQuery((SignalTarget(parse(workload="trainer").value, 70.0), SignalTarget(queue, 8.0)))
    assert unmatched_of(evaluate_combined(beside, evaluate_single)) is None


def test_among_twenty_thousand_remembered_names_the_close_one_is_still_found() -> None:
    """Past MAX_COMPARED names only the likely ones are compared (first letter, length): trainer is one of them."""
    crowd = {(f"team-{n % 50}", f"service-{n}"): frozenset({POD_OWNER}) for n in range(20_000)}
    directory = Remembering(seen={**crowd, ("ml", "trainer"): frozenset({POD_OWNER})})
    assert directory.seen_names is not None
    assert len(directory.seen_names.workload_names_anywhere()) > MAX_COMPARED
    assert found(namespace="default", directory=directory, workload="trainr").did_you_mean_elsewhere == ("ml/trainer",)
