"""scaleTargetPods: opt-in selection of a ScaledObject's own scale target; an explicit selector always wins."""

from __future__ import annotations

from dataclasses import replace

import pytest

from gpuscaler.model.errors import InvalidMetadata, Unavailable, Unsupported
from gpuscaler.model.pods import PodInfo, ScaleTarget
from gpuscaler.model.samples import Attribution, AttributionState, PodRef, Snapshot
from gpuscaler.query.metadata import Limits, parse_metadata
from gpuscaler.signals.evaluation import evaluate
from gpuscaler.signals.outcome import Evaluation
from tests.builders import GpuTrigger, cluster, gpu_sample, gpu_trigger, snapshot, source_of
from tests.signals.test_evaluation_workloads import Directory

CLUSTER = Limits(history_seconds=600, cluster=True)
OK = Attribution(AttributionState.OK)


class Targets(Directory):
    """A pod directory that also knows ScaledObjects, as the gateway's watch (or static file) does."""

    def __init__(self, *pods: PodInfo, targets: tuple[ScaleTarget, ...] = (), targets_problem: str | None = None):
        super().__init__(*pods)
        self._targets = {(t.namespace, t.scaled_object): t for t in targets}
        self._targets_problem = targets_problem

    def scale_target(self, namespace: str, scaled_object: str) -> ScaleTarget | None:
        return self._targets.get((namespace, scaled_object))

    def scale_targets_problem(self) -> str | None:
        return self._targets_problem


def parse(name: str = "trainer-so", **metadata: str) -> GpuTrigger:
    """Parse ``metadata`` as the gateway does for ScaledObject ``name`` in namespace ml."""
    return gpu_trigger(parse_metadata(metadata, CLUSTER, namespace="ml", name=name))


# Node A: the Deployment "trainer" (two replicas) and a StatefulSet also named "trainer"; another tenant's pod.
VIEW = cluster(
    replace(
        snapshot(
            1,
            0.0,
            tuple(
                gpu_sample(i, util=util, pods=(PodRef(namespace, pod, "main"),), uuid=f"GPU-{i}")
                for i, (util, namespace, pod) in enumerate(
                    [
                        (70.0, "ml", "trainer-7c9d-a"),
                        (30.0, "ml", "trainer-7c9d-b"),
                        (90.0, "ml", "trainer-0"),
                        (50.0, "other", "x"),
                    ]
                )
            ),
        ),
        attribution=OK,
    )
)
PODS = (
    PodInfo("ml", "trainer-7c9d-a", workload="trainer", workload_kind="Deployment"),
    PodInfo("ml", "trainer-7c9d-b", workload="trainer", workload_kind="Deployment"),
    PodInfo("ml", "trainer-0", workload="trainer", workload_kind="StatefulSet"),
    PodInfo("other", "x", workload="trainer", workload_kind="Deployment"),
)
TRAINER = ScaleTarget("ml", "trainer-so", "Deployment", "trainer")


def run(query: GpuTrigger, directory: Directory | None, view: Snapshot = VIEW) -> Evaluation:
    """Evaluate ``query`` over ``view`` at time 0, with ``directory`` as the gateway's pod directory."""
    return evaluate(query.value, source_of(view), now=0.0, stale_after=5.0, directory=directory)


def test_scale_target_pods_selects_the_scaled_objects_target_and_says_so() -> None:
    """With scaleTargetPods the gateway reads the ScaledObject's Deployment's pods, not the same-named StatefulSet."""
    evaluation = run(parse(scaleTargetPods="true"), Targets(*PODS, targets=(TRAINER,)))
    assert evaluation.value_or_raise() == 100.0
    assert sorted(p.pod for p in evaluation.pods) == ["trainer-7c9d-a", "trainer-7c9d-b"]
    assert evaluation.selection == (
        "pods in namespace ml, workload Deployment/trainer: the scaleTargetRef of ScaledObject ml/trainer-so "
        "(scaleTargetPods)"
    )


def test_without_the_key_a_query_keeps_meaning_every_gpu() -> None:
    """No selector and no scaleTargetPods is still every GPU of the cluster, as before."""
    query = parse()
    assert query.value.pods is None
    assert run(query, Targets(*PODS, targets=(TRAINER,))).value_or_raise() == 240.0
    assert parse(scaleTargetPods="false").value.pods is None


@pytest.mark.parametrize(
    ("metadata", "expected", "selection"),
    [
        pytest.param({"workload": "trainer"}, 190.0, "pods in namespace ml, workload trainer", id="workload"),
        pytest.param({"pod": "trainer-0"}, 90.0, "pods in namespace ml, pod trainer-0", id="pod"),
        pytest.param({"gpuUUID": "GPU-3"}, 50.0, "gpuUUID GPU-3", id="gpu"),
    ],
)
def test_an_explicit_selector_wins_and_says_scale_target_pods_is_not_used(
    metadata: dict[str, str], expected: float, selection: str
) -> None:
    """scaleTargetPods beside pod, workload, podSelector, namespace or a GPU key: the explicit one answers."""
    query = parse(scaleTargetPods="true", **metadata)
    assert run(query, Targets(*PODS, targets=(TRAINER,))).value_or_raise() == expected
    assert query.value.describe_selection() == selection + " (an explicit selector: scaleTargetPods is not used)"


def test_the_query_names_its_scaled_object_in_its_metric_name() -> None:
    """Two ScaledObjects with the same metadata ask for different pods, so their default metric names differ."""
    assert parse("a", scaleTargetPods="true").metric_name != parse("b", scaleTargetPods="true").metric_name


@pytest.mark.parametrize(
    ("directory", "error", "fragment"),
    [
        pytest.param(None, Unsupported, "this server does not read ScaledObjects", id="agent"),
        pytest.param(Directory(*PODS), Unsupported, "point scalerAddress at the gateway", id="static-without-targets"),
        pytest.param(
            Targets(*PODS, targets_problem="the ScaledObject watch has not listed the ScaledObjects yet"),
            Unavailable,
            "has not listed the ScaledObjects yet",
            id="not-synced",
        ),
        pytest.param(Targets(*PODS), Unavailable, "knows no ScaledObject ml/trainer-so", id="unknown-scaled-object"),
        pytest.param(
            Targets(*PODS, targets=(replace(TRAINER, kind="Rollout", api_version="argoproj.io/v1alpha1"),)),
            Unsupported,
            "scales Rollout trainer (argoproj.io/v1alpha1)",
            id="kind-without-known-pods",
        ),
    ],
)
def test_an_unresolvable_target_is_an_error_never_zero(
    directory: Directory | None, error: type[Exception], fragment: str
) -> None:
    """No ScaledObject reader, no sync, no such ScaledObject or a kind of unknown pods: an error KEDA sees, not 0."""
    evaluation = run(parse(scaleTargetPods="true"), directory)
    assert isinstance(evaluation.error, error)
    assert fragment in evaluation.error.message
    assert evaluation.value is None


def test_a_target_scaled_to_zero_reads_zero_at_the_gateway() -> None:
    """A Deployment with no pods holds no GPU: at the gateway that is a true 0, as for workload."""
    directory = Targets(*PODS, targets=(ScaleTarget("ml", "idle-so", "Deployment", "idle"),))
    assert run(parse("idle-so", scaleTargetPods="true"), directory).value_or_raise() == 0.0


@pytest.mark.parametrize(
    ("metadata", "name", "fragment"),
    [
        pytest.param({"scaleTargetPods": "yes"}, "so", "scaleTargetPods 'yes' is not allowed; use 'true' or 'false'"),
        pytest.param({"scaleTargetPods": "true"}, "", "this request names no ScaledObject"),
        pytest.param({"podAggregation": "max"}, "so", "podAggregation is set, but no pods are selected"),
    ],
)
def test_bad_metadata_names_the_key(metadata: dict[str, str], name: str, fragment: str) -> None:
    """A bad value, or scaleTargetPods without a ScaledObject name, is INVALID_ARGUMENT saying what to do."""
    with pytest.raises(InvalidMetadata) as raised:
        parse(name, **metadata)
    assert fragment in raised.value.message


def test_pod_aggregation_applies_to_the_scale_targets_pods() -> None:
    """podAggregation goes with scaleTargetPods as with any pod selection."""
    query = parse(scaleTargetPods="true", podAggregation="max")
    assert query.value.pods is not None
    assert query.value.pods.pod_aggregation.value == "max"
