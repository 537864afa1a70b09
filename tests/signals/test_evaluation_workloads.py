"""Workload queries: metadata keys, then per-pod reduction and the combination across replicas. Pure tables."""

from __future__ import annotations

from dataclasses import replace

import pytest

from gpuscaler.model.aggregation import Aggregation
from gpuscaler.model.errors import InvalidMetadata, Unavailable, Unsupported
from gpuscaler.model.pods import NameHistory, PodInfo
from gpuscaler.model.samples import Attribution, AttributionState, PodRef, Snapshot
from gpuscaler.query.metadata import Limits, parse_metadata
from gpuscaler.query.query import NodeQuorum
from gpuscaler.signals.evaluation import evaluate
from gpuscaler.signals.outcome import Evaluation
from tests.builders import GpuTrigger, cluster, gpu_sample, gpu_trigger, snapshot, source_of, unheard

OK = Attribution(AttributionState.OK)
LIMITS = Limits(history_seconds=600)


def parse(scaled_object_namespace: str = "ml", limits: Limits = LIMITS, **metadata: str) -> GpuTrigger:
    """Parse ``metadata`` as the gateway does for a ScaledObject in ``scaled_object_namespace``."""
    return gpu_trigger(parse_metadata(metadata, limits, namespace=scaled_object_namespace))


def parse_dict(metadata: dict[str, str]) -> GpuTrigger:
    """Parse ``metadata`` from a ScaledObject in ml, for keys given as a dict (parametrized cases)."""
    return gpu_trigger(parse_metadata(metadata, LIMITS, namespace="ml"))


class Directory:
    """A hand-written pod directory: pods by (namespace, name), which remembers no names; ``changed`` says that its
    pods did (its version moves)."""

    def __init__(self, *pods: PodInfo, problem: str | None = None) -> None:
        self._pods = {(p.namespace, p.pod): p for p in pods}
        self._problem = problem
        self._version = 0
        self.seen_names: NameHistory | None = None

    def lookup(self, namespace: str, pod: str) -> PodInfo | None:
        return self._pods.get((namespace, pod))

    def pods(self, namespace: str) -> list[PodInfo]:
        return [info for (space, _), info in self._pods.items() if space == namespace]

    def problem(self) -> str | None:
        return self._problem

    def version(self, namespace: str) -> int:
        return self._version

    def add(self, *pods: PodInfo) -> None:
        """Pods that appear (or change)."""
        self._pods.update({(p.namespace, p.pod): p for p in pods})
        self._version += 1

    def fail(self, problem: str | None) -> None:
        """The directory cannot tell from now on (``problem``), or can again (None)."""
        self._problem = problem


def pod(name: str, namespace: str = "ml", container: str = "main") -> PodRef:
    """The PodRef of pod ``name``'s ``container`` in ``namespace``."""
    return PodRef(namespace, name, container)


def node(name: str, *samples_: tuple[float, tuple[PodRef, ...]], first_index: int = 0) -> Snapshot:
    """Node ``name``'s snapshot: one GPU per (utilisation, pods holding it), with attribution OK."""
    samples = tuple(
        gpu_sample(first_index + i, util=util, pods=pods, node=name, uuid=f"GPU-{name}-{first_index + i}")
        for i, (util, pods) in enumerate(samples_)
    )
    return replace(snapshot(1, 0.0, samples, node=name), attribution=OK)


# Two nodes, a "trainer" Deployment with three replicas (one holds two GPUs), a neighbour and another tenant.
NODE_A = node("node-a", (90.0, (pod("trainer-a1"),)), (50.0, (pod("trainer-a1"),)), (30.0, (pod("web-1"),)))
NODE_B = node(
    "node-b",
    (60.0, (pod("trainer-b1"),)),
    (20.0, (pod("trainer-b2"),)),
    (100.0, (pod("miner", namespace="tenant-b"),)),
)
VIEW = cluster(NODE_A, NODE_B)
DIRECTORY = Directory(
    PodInfo("ml", "trainer-a1", {"app": "trainer", "tier": "gpu"}, "trainer", "Deployment"),
    PodInfo("ml", "trainer-b1", {"app": "trainer", "tier": "gpu"}, "trainer", "Deployment"),
    PodInfo("ml", "trainer-b2", {"app": "trainer", "tier": "gpu"}, "trainer", "Deployment"),
    PodInfo("ml", "web-1", {"app": "web"}, "web", "Deployment"),
    PodInfo("tenant-b", "miner", {"app": "trainer"}, "trainer", "Deployment"),
)


def value_of(query: GpuTrigger, view: Snapshot = VIEW, directory: Directory | None = DIRECTORY) -> float:
    """The value of ``query`` over ``view`` with ``directory``'s pods; raises if there is none."""
    return evaluate(query.value, source_of(view), now=0.0, stale_after=5.0, directory=directory).value_or_raise()


@pytest.mark.parametrize(
    ("metadata", "expected"),
    [
        # trainer-a1 = avg(90, 50) = 70, trainer-b1 = 60, trainer-b2 = 20; summed = 150.
        ({"workload": "trainer"}, 150.0),
        ({"podSelector": "app=trainer"}, 150.0),
        ({"podSelector": "app=trainer,tier=gpu", "podAggregation": "max"}, 90.0 + 60.0 + 20.0),
        ({"workload": "trainer", "aggregation": "avg"}, 50.0),
        ({"workload": "trainer", "aggregation": "max"}, 70.0),
        ({"pod": "trainer-b*"}, 80.0),
        ({"pod": "trainer-a1", "podAggregation": "sum"}, 140.0),
        ({"namespace": "ml"}, 70.0 + 30.0 + 60.0 + 20.0),
        ({"namespace": "tenant-b"}, 100.0),
        ({"workload": "web"}, 30.0),
    ],
)
def test_workload_values_match_a_hand_computation(metadata: dict[str, str], expected: float) -> None:
    """Each replica reduces its GPUs (avg by default), the replicas combine (sum by default)."""
    assert value_of(parse_dict(metadata)) == pytest.approx(expected)


def test_another_tenants_pods_never_count() -> None:
    """The same workload name in another namespace is another workload: its GPUs stay out."""
    evaluation = evaluate(
        parse(workload="trainer").value, source_of(VIEW), now=0.0, stale_after=5.0, directory=DIRECTORY
    )
    assert {(p.namespace, p.pod) for p in evaluation.pods} == {
        ("ml", "trainer-a1"),
        ("ml", "trainer-b1"),
        ("ml", "trainer-b2"),
    }
    assert evaluation.nodes_counted == 2
    assert {c.sample.gpu.uuid for c in evaluation.contributions} == {
        "GPU-node-a-0",
        "GPU-node-a-1",
        "GPU-node-b-0",
        "GPU-node-b-1",
    }


def test_a_gpu_shared_by_two_replicas_counts_for_each() -> None:
    """A time-sliced GPU held by two pods gives its whole value to each (NVML cannot split it)."""
    shared = node("node-a", (80.0, (pod("trainer-a1"), pod("trainer-b1"), pod("trainer-a1", container="side"))))
    assert value_of(parse(workload="trainer"), cluster(shared)) == pytest.approx(160.0)


def test_a_workload_with_no_pods_is_zero() -> None:
    """Scaled to zero, a workload holds no GPU: the value is 0, which is inactive, never an error."""
    assert value_of(parse(workload="overflow")) == 0.0


def test_a_replica_whose_gpus_cannot_be_read_is_unknown_not_left_out() -> None:
    """A replica none of whose GPUs can be read is not a replica at 0.

    On a node with nothing else readable in the selection, the node is unknown like a silent one: UNAVAILABLE
    naming it and the pod, unless minNodes is met without it. On a node that answers with other selected GPUs,
    the GPU counts against maxUnreadable: beyond it UNAVAILABLE, within it the replica is left out and says why.
    """
    c1, c2 = PodInfo("ml", "trainer-c1", {}, "trainer"), PodInfo("ml", "trainer-c2", {}, "trainer")
    directory = Directory(*DIRECTORY._pods.values(), c1, c2)

    def run(view: Snapshot, **metadata: str) -> Evaluation:
        query = parse_dict({"workload": "trainer", **metadata}).value
        return evaluate(query, source_of(view), now=0.0, stale_after=5.0, directory=directory)

    def unreadable_first(part: Snapshot) -> Snapshot:
        first = part.samples[0]._replace(gpu_utilization_percent=None)
        return replace(part, samples=(first, *part.samples[1:]))

    broken = unreadable_first(node("node-c", (0.0, (pod("trainer-c1"),))))
    blocked = run(cluster(NODE_A, NODE_B, broken))
    assert isinstance(blocked.error, Unavailable)
    assert "node 'node-c' is heard, but none of its 1 selected GPU(s) can be read" in blocked.error.message
    assert "it holds ml/trainer-c1" in blocked.error.message
    allowed = run(cluster(NODE_A, NODE_B, broken), minNodes="2")
    assert allowed.value == pytest.approx(150.0)
    assert [(a.node, a.heard) for a in allowed.absent] == [("node-c", True)]
    assert isinstance(run(cluster(NODE_A, NODE_B, broken), minNodes="3").error, Unavailable)

    beside = unreadable_first(node("node-c", (0.0, (pod("trainer-c1"),)), (40.0, (pod("trainer-c2"),))))
    strict = run(cluster(NODE_A, NODE_B, beside))
    assert isinstance(strict.error, Unavailable)
    assert "cannot be read on 1 of the 6 selected GPUs" in strict.error.message
    tolerant = run(cluster(NODE_A, NODE_B, beside), maxUnreadable="1")
    assert tolerant.value == pytest.approx(190.0)
    [left_out] = [p for p in tolerant.pods if p.value is None]
    assert left_out.pod == "trainer-c1"
    assert "could be read" in (left_out.reason or "")

    alone = evaluate(parse(pod="trainer-c1").value, source_of(cluster(broken)), now=0.0, stale_after=5.0)
    assert isinstance(alone.error, Unavailable)


def test_attribution_off_on_any_node_is_failed_precondition_naming_it() -> None:
    """A node without attribution makes pod queries FAILED_PRECONDITION, naming the node and the reason."""
    off = replace(NODE_B, attribution=Attribution(AttributionState.OFF, "no kubelet socket at '/x'"))
    evaluation = evaluate(
        parse(workload="trainer").value, source_of(cluster(NODE_A, off)), now=0.0, stale_after=5.0, directory=DIRECTORY
    )
    assert isinstance(evaluation.error, Unsupported)
    assert "'node-b'" in evaluation.error.message
    assert "no kubelet socket" in evaluation.error.message


def test_attribution_unavailable_is_unavailable() -> None:
    """A node whose kubelet does not answer makes pod queries UNAVAILABLE (KEDA retries, then falls back)."""
    failing = replace(NODE_A, attribution=Attribution(AttributionState.UNAVAILABLE, "List failed"))
    evaluation = evaluate(parse(pod="trainer-*").value, source_of(cluster(failing)), now=0.0, stale_after=5.0)
    assert isinstance(evaluation.error, Unavailable)


def test_labels_and_owners_need_a_ready_directory() -> None:
    """workload/podSelector without a directory is FAILED_PRECONDITION; an unsynced one is UNAVAILABLE."""
    none = evaluate(parse(workload="trainer").value, source_of(VIEW), now=0.0, stale_after=5.0)
    assert isinstance(none.error, Unsupported)
    unsynced = evaluate(
        parse(podSelector="app=x").value,
        source_of(VIEW),
        now=0.0,
        stale_after=5.0,
        directory=Directory(problem="the pod watch has not synced yet"),
    )
    assert isinstance(unsynced.error, Unavailable)
    assert "not synced" in unsynced.error.message
    # A pod-name glob needs no directory.
    assert value_of(parse(pod="trainer-b*"), directory=None) == pytest.approx(80.0)


@pytest.mark.parametrize(
    ("min_nodes", "expected", "fails"),
    [
        ("2", 2, False),
        ("3", 2, True),
        ("3", 3, True),
        ("50%", 4, False),
        ("51%", 4, True),
        ("100%", 2, False),
    ],
)
def test_min_nodes_turns_too_little_data_into_unavailable(min_nodes: str, expected: int, fails: bool) -> None:
    """minNodes counts the nodes with fresh samples against a count or a share of the known ones, heard or not."""
    view = cluster(NODE_A, NODE_B, absent=[unheard(f"10.0.0.{i}:6000") for i in range(expected - 2)])
    evaluation = evaluate(parse(minNodes=min_nodes).value, source_of(view), now=0.0, stale_after=5.0)
    if fails:
        assert isinstance(evaluation.error, Unavailable)
        assert f"only 2 of {max(expected, 2)} known nodes" in evaluation.error.message
    else:
        assert evaluation.error is None


def test_without_a_selector_the_query_reads_every_node() -> None:
    """A node-wide query at the gateway reads every fresh node's GPUs (the agent issue's meaning, cluster-wide)."""
    assert value_of(parse()) == pytest.approx(90 + 50 + 30 + 60 + 20 + 100)


@pytest.mark.parametrize(
    ("metadata", "complaint"),
    [
        ({"pod": "Trainer_1"}, "pod 'Trainer_1' is not allowed"),
        ({"workload": "a/b"}, "workload 'a/b' is not allowed"),
        ({"namespace": "ML"}, "namespace 'ML' is not allowed"),
        ({"podSelector": "app in (x"}, "podSelector 'app in (x' has a '(' without its ')'"),
        ({"podAggregation": "avg"}, "podAggregation is set, but no pods are selected"),
        ({"podAggregation": "mode", "pod": "x"}, "podAggregation 'mode' is not allowed"),
        ({"workload": "x", "gpuUUID": "GPU-1"}, "keys 'gpuUUID' and 'workload' are both set"),
        ({"minNodes": "0"}, "minNodes '0' is out of range"),
        ({"minNodes": "0%"}, "minNodes '0%' is out of range"),
        ({"minNodes": "two"}, "minNodes 'two' is not allowed"),
        ({"minNodes": "x%"}, "minNodes 'x%' is not a number"),
    ],
)
def test_bad_workload_metadata_is_refused_naming_the_key(metadata: dict[str, str], complaint: str) -> None:
    """Every new key is checked and the message names it and the value."""
    with pytest.raises(InvalidMetadata) as raised:
        parse_dict(metadata)
    assert complaint in raised.value.message


def test_the_namespace_defaults_to_the_scaled_objects() -> None:
    """Without namespace, a pod selector reads the ScaledObject's namespace; without either it is refused."""
    selection = parse("team-a", workload="trainer").value.pods
    assert selection is not None
    assert selection.namespace == "team-a"
    assert selection.pod_aggregation is Aggregation.AVG
    with pytest.raises(InvalidMetadata, match="namespace is not set"):
        parse("", workload="trainer")


def test_gpu_index_is_refused_at_the_gateway() -> None:
    """gpuIndex means one node's GPU; at the gateway it is INVALID_ARGUMENT pointing to gpuUUID."""
    with pytest.raises(InvalidMetadata, match="gpuUUID"):
        parse(limits=Limits(history_seconds=600, cluster=True), gpuIndex="0")
    assert parse(limits=Limits(history_seconds=600, cluster=True), gpuUUID="GPU-node-a-0").value.selection.uuids


def test_equal_selections_share_a_metric_name_and_different_ones_do_not() -> None:
    """The default metric name tells pod queries apart, so two triggers of one ScaledObject do not collide."""
    assert parse(workload="a").metric_name == parse(workload="a").metric_name
    assert parse(workload="a").metric_name != parse(workload="b").metric_name
    assert parse(workload="a").metric_name != parse().metric_name
    assert parse(minNodes="2").value.min_nodes == NodeQuorum(count=2)


def test_a_gateway_hearing_from_no_node_is_unavailable_for_pod_queries() -> None:
    """With every known node stale, a workload query is UNAVAILABLE (KEDA's fallback), not a zero."""
    empty = cluster(absent=[unheard(f"10.0.0.{i}:6000") for i in range(3)])
    evaluation = evaluate(parse(workload="trainer").value, source_of(empty), now=0.0, stale_after=5.0)
    assert isinstance(evaluation.error, Unavailable)
    assert "0 of 3 known agents" in evaluation.error.message
