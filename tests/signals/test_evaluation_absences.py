"""Unknown is not zero: what a cluster answer does with nodes it cannot hear. Pure tables over composed views.

A node whose agent is listed but silent, or an agent not heard from yet, makes every answer that needs
it UNAVAILABLE, naming it and since when. Its share leaves only when it is known to be gone: the pods
it held are deleted or run elsewhere (the pod directory says so), or ``minNodes`` allows answering
without it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import pytest

from gpuscaler.model.errors import InvalidMetadata, Unavailable
from gpuscaler.model.pods import PodInfo
from gpuscaler.model.samples import (
    DEVICE_FIELD,
    Attribution,
    AttributionState,
    PodRef,
    ReadError,
    ReadErrorKind,
    Snapshot,
)
from gpuscaler.query.metadata import Limits, parse_metadata
from gpuscaler.signals.evaluation import evaluate
from gpuscaler.signals.node_memo import NodeMemo
from gpuscaler.signals.outcome import Evaluation
from tests.builders import cluster, gpu_sample, gpu_trigger, silent, snapshot, source_of, unheard

LIMITS = Limits(history_seconds=600, cluster=True)


class Directory:
    """Pods by (namespace, name), as a pod watch would know them."""

    def __init__(self, *pods: PodInfo) -> None:
        self._pods = {(p.namespace, p.pod): p for p in pods}

    def lookup(self, namespace: str, pod: str) -> PodInfo | None:
        return self._pods.get((namespace, pod))

    def pods(self, namespace: str) -> list[PodInfo]:
        return [info for (space, _), info in self._pods.items() if space == namespace]

    def problem(self) -> str | None:
        return None

    def version(self, namespace: str) -> int:
        return 0

    @property
    def seen_names(self) -> None:
        return None


def node(name: str, *gpus: tuple[float, str | None]) -> Snapshot:
    """A node whose GPUs have these utilisations, each held by the named pod of namespace ml (or by none)."""
    samples = tuple(
        gpu_sample(i, util=util, node=name, uuid=f"GPU-{name}-{i}", pods=(PodRef("ml", pod, "main"),) if pod else ())
        for i, (util, pod) in enumerate(gpus)
    )
    return replace(snapshot(1, 0.0, samples, node=name), attribution=Attribution(AttributionState.OK))


BUSY = node("gpu-a", (40.0, "trainer-1"), (40.0, "trainer-2"))
OTHER = node("gpu-b", (10.0, "web-1"), (5.0, None))
TRAINERS = (
    PodInfo("ml", "trainer-1", {"app": "trainer"}, "trainer", "Deployment", node="gpu-a", holds_gpus=True),
    PodInfo("ml", "trainer-2", {"app": "trainer"}, "trainer", "Deployment", node="gpu-a", holds_gpus=True),
    PodInfo("ml", "web-1", {"app": "web"}, "web", "Deployment", node="gpu-b", holds_gpus=True),
)


def run(view: Snapshot, directory: Directory | None = None, **metadata: str) -> Evaluation:
    """Evaluate ``metadata``, from a ScaledObject in ml, over the cluster ``view`` at time 0."""
    query = gpu_trigger(parse_metadata(metadata, LIMITS, namespace="ml"))
    return evaluate(query.value, source_of(view), now=0.0, stale_after=5.0, directory=directory)


def unavailable(evaluation: Evaluation) -> str:
    """The message of the UNAVAILABLE error an evaluation must have, with no value."""
    assert isinstance(evaluation.error, Unavailable), evaluation.error
    assert evaluation.value is None
    return evaluation.error.message


def test_a_silent_node_makes_a_node_wide_answer_unavailable() -> None:
    """The busy node's agent stops: the sum over the cluster is unknown, not the idle node's 15."""
    message = unavailable(run(cluster(OTHER, absent=[silent(BUSY, seconds=12)])))
    assert "node 'gpu-a' (agent 10.0.0.9:6000)" in message
    assert "12.0s ago" in message
    assert "connection refused" in message
    assert "unknown, not 0" in message


def test_an_agent_not_heard_from_yet_makes_a_node_wide_answer_unavailable() -> None:
    """An agent discovery lists but that has sent nothing may have any GPUs: the sum is unknown."""
    message = unavailable(run(cluster(BUSY, OTHER, absent=[unheard("10.0.0.8:6000")])))
    assert "agent 10.0.0.8:6000" in message
    assert "no snapshot yet" in message


def test_min_nodes_lets_the_answer_leave_out_what_it_cannot_hear() -> None:
    """With minNodes met, the value is the heard nodes' and the evaluation names the node it left out."""
    absence = silent(BUSY)
    evaluation = run(cluster(OTHER, absent=[absence]), minNodes="1")
    assert evaluation.value == pytest.approx(15.0)
    assert evaluation.absent == (absence,)
    assert "only 1 of 2 known nodes" in unavailable(run(cluster(OTHER, absent=[absence]), minNodes="2"))


def test_a_gpu_named_by_uuid_on_a_heard_node_does_not_wait_for_others() -> None:
    """gpuUUID of a heard node's GPU answers; one the heard nodes lack may be on the silent node: UNAVAILABLE."""
    view = cluster(OTHER, absent=[silent(BUSY)])
    assert run(view, gpuUUID="GPU-gpu-b-0").value == pytest.approx(10.0)
    message = unavailable(run(view, gpuUUID="GPU-gpu-a-0"))
    assert "gpuUUID GPU-gpu-a-0 is not on any of the 1 fresh nodes" in message
    assert "node 'gpu-a'" in message
    assert isinstance(run(cluster(OTHER), gpuUUID="GPU-nope").error, InvalidMetadata)


def test_a_workload_whose_only_node_went_silent_is_unavailable_not_zero() -> None:
    """The pods' node stops sending while another node is heard: UNAVAILABLE naming the node and the pods."""
    message = unavailable(run(cluster(OTHER, absent=[silent(BUSY)]), pod="trainer-*"))
    assert "node 'gpu-a'" in message
    assert "ml/trainer-1, ml/trainer-2" in message


def test_a_silent_nodes_share_leaves_once_its_pods_are_deleted() -> None:
    """The directory no longer has the pods the silent node held: the workload is at a true 0, no error."""
    evaluation = run(cluster(OTHER, absent=[silent(BUSY)]), Directory(TRAINERS[2]), pod="trainer-*")
    assert (evaluation.error, evaluation.value) == (None, 0.0)
    by_workload = run(cluster(OTHER, absent=[silent(BUSY)]), Directory(TRAINERS[2]), workload="trainer")
    assert (by_workload.error, by_workload.value) == (None, 0.0)


def test_a_silent_nodes_share_leaves_once_its_pods_run_elsewhere() -> None:
    """A StatefulSet pod recreated under the same name on a heard node: its old share leaves, the new one counts."""
    moved = node("gpu-c", (70.0, "trainer-1"))
    directory = Directory(
        replace(TRAINERS[0], node="gpu-c"), replace(TRAINERS[1], node="gpu-c", holds_gpus=False), TRAINERS[2]
    )
    evaluation = run(cluster(OTHER, moved, absent=[silent(BUSY)]), directory, pod="trainer-*")
    assert (evaluation.error, evaluation.value) == (None, 70.0)


def test_a_pod_still_listed_on_the_silent_node_keeps_the_answer_unavailable() -> None:
    """One of the silent node's pods is deleted, the other still runs there: its share is still unknown."""
    message = unavailable(
        run(cluster(OTHER, absent=[silent(BUSY)]), Directory(TRAINERS[1], TRAINERS[2]), workload="trainer")
    )
    assert "ml/trainer-2" in message
    assert "trainer-1" not in message


def test_a_silent_node_without_the_workloads_pods_does_not_block_it() -> None:
    """Another workload's node going silent changes nothing for this one."""
    evaluation = run(cluster(BUSY, absent=[silent(OTHER)]), pod="trainer-*")
    assert (evaluation.error, evaluation.value) == (None, 80.0)


@pytest.mark.parametrize(
    ("pods", "blocked"),
    [
        pytest.param(TRAINERS, False, id="every-pod-on-a-heard-node"),
        pytest.param((*TRAINERS, PodInfo("ml", "trainer-3", {}, "trainer", node="gpu-z")), True, id="one-elsewhere"),
        pytest.param((*TRAINERS, PodInfo("ml", "trainer-3", {}, "trainer")), True, id="one-unplaced"),
        pytest.param(
            (*TRAINERS, PodInfo("ml", "trainer-3", {}, "trainer", node="cpu-1", holds_gpus=False)),
            False,
            id="one-without-gpus",
        ),
    ],
)
def test_an_unheard_agent_blocks_a_workload_only_where_its_pods_may_run(
    pods: tuple[PodInfo, ...], blocked: bool
) -> None:
    """An agent not heard from may hold any pod the directory cannot place on a heard node."""
    evaluation = run(cluster(BUSY, OTHER, absent=[unheard()]), Directory(*pods), workload="trainer")
    if blocked:
        assert "agent 10.0.0.8:6000" in unavailable(evaluation)
    else:
        assert (evaluation.error, evaluation.value) == (None, 80.0)


def test_without_a_directory_an_unheard_agent_blocks_pod_queries() -> None:
    """Without a pod directory nothing says where the pods run, so an unheard agent may hold them."""
    assert "agent 10.0.0.8:6000" in unavailable(run(cluster(BUSY, absent=[unheard()]), pod="trainer-*"))


# Unreadable is not zero: a heard node whose selected GPUs cannot be read, and the maxUnreadable tolerance.


def gpus(name: str, count: int, *, util: float = 95.0, failed: Sequence[int] = ()) -> Snapshot:
    """Node ``name`` with ``count`` GPUs at ``util``, those in ``failed`` hanging (every read times out)."""
    hung = (ReadError(DEVICE_FIELD, ReadErrorKind.TIMEOUT, "previous read has not returned (hung NVML call)"),)
    samples = tuple(
        gpu_sample(
            i, util=None if i in failed else util, node=name, uuid=f"GPU-{name}-{i}", errors=hung if i in failed else ()
        )
        for i in range(count)
    )
    return replace(snapshot(1, 0.0, samples, node=name), attribution=Attribution(AttributionState.OK))


IDLE = gpus("gpu-a", 2, util=0.0)
HUNG = gpus("gpu-b", 4, failed=range(4))


def both_ways(view: Snapshot, **metadata: str) -> Evaluation:
    """Evaluate with and without the gateway's per-node memo (its columns path); both must agree."""
    query = gpu_trigger(parse_metadata(metadata, LIMITS, namespace="ml")).value
    plain = evaluate(query, source_of(view), now=0.0, stale_after=5.0)
    memoized = evaluate(query, source_of(view), now=0.0, stale_after=5.0, memo=NodeMemo())
    assert (memoized.value, type(memoized.error), memoized.absent) == (plain.value, type(plain.error), plain.absent)
    assert (memoized.error.message if memoized.error else None) == (plain.error.message if plain.error else None)
    return plain


def test_a_heard_node_whose_gpus_all_hang_is_unknown_like_a_silent_one() -> None:
    """Busy node B's four GPUs all hang: not the idle node's 0, but UNAVAILABLE naming B and why (issue 19)."""
    message = unavailable(both_ways(cluster(IDLE, HUNG)))
    assert "1 of 2 cannot be heard or read" in message
    assert "node 'gpu-b' is heard, but none of its 4 selected GPU(s) can be read" in message
    assert "GPU 0 (GPU-gpu-b-0): timeout: previous read has not returned (hung NVML call)" in message
    assert "unknown, not 0" in message
    assert "minNodes lets the answer leave out nodes that cannot be heard or read" in message


def test_min_nodes_leaves_out_a_wholly_unreadable_node_which_counts_as_not_heard() -> None:
    """With minNodes met without it, the answer is the rest's and names B absent; B never counts as heard."""
    evaluation = both_ways(cluster(IDLE, HUNG), minNodes="1")
    assert (evaluation.error, evaluation.value, evaluation.nodes_counted) == (None, 0.0, 1)
    [absent] = evaluation.absent
    assert (absent.node, absent.heard, absent.agent) == ("gpu-b", True, "")
    assert [c.sample.gpu.uuid for c in evaluation.unread] == [f"GPU-gpu-b-{i}" for i in range(4)]
    message = unavailable(both_ways(cluster(IDLE, HUNG), minNodes="2"))
    assert "only 1 of 2 known nodes sent fresh samples with a readable GPU, and minNodes 2 needs 2" in message
    assert "only 1 of 3" in unavailable(both_ways(cluster(IDLE, HUNG, absent=[silent(OTHER)]), minNodes="2"))
    both = both_ways(cluster(IDLE, HUNG, absent=[silent(OTHER)]), minNodes="1")
    assert [(a.node, a.heard) for a in both.absent] == [("gpu-b", False), ("gpu-b", True)]


def test_one_hung_gpu_of_eight_on_one_node_is_unavailable_by_default() -> None:
    """Leaving out 1 of 8 busy GPUs scales in by 1/8: the default 5% of 8 is 0, so the answer names it instead."""
    message = unavailable(both_ways(cluster(gpus("gpu-b", 8, failed=[7]))))
    assert message.startswith("gpu_utilization cannot be read on 1 of the 8 selected GPUs")
    assert "maxUnreadable 5% (the default) lets an answer leave out 0 of them" in message
    assert "GPU 7 (GPU-gpu-b-7) on gpu-b: timeout" in message
    tolerant = both_ways(cluster(gpus("gpu-b", 8, failed=[7])), maxUnreadable="1")
    assert tolerant.error is None
    assert tolerant.value == pytest.approx(7 * 95.0)


def big_cluster(nodes: int, *, broken: int = 1) -> Snapshot:
    """``nodes`` nodes of 8 GPUs at 95%, the first ``broken`` of them with GPU 3 hung."""
    return cluster(*(gpus(f"gpu-{n:04d}", 8, failed=[3] if n < broken else ()) for n in range(nodes)))


def test_one_hung_gpu_among_two_thousand_nodes_is_left_out_and_said() -> None:
    """One broken GPU of 16,000 does not make every cluster-wide answer UNAVAILABLE: left out, and named."""
    view = big_cluster(2000)
    evaluation = both_ways(view)
    assert evaluation.error is None
    assert evaluation.value == pytest.approx((16_000 - 1) * 95.0)
    assert evaluation.absent == ()
    assert [(c.sample.node, c.sample.gpu.uuid) for c in evaluation.unread] == [("gpu-0000", "GPU-gpu-0000-3")]
    assert "maxUnreadable 0 lets an answer leave out 0" in unavailable(both_ways(view, maxUnreadable="0"))
    assert both_ways(view, maxUnreadable="1").error is None
    # 5% of 16,000 is 800: the 801st hung GPU makes the answer UNAVAILABLE.
    assert both_ways(big_cluster(2000, broken=800)).error is None
    assert "801 of the 16000 selected GPUs" in unavailable(both_ways(big_cluster(2000, broken=801)))


def test_a_node_whose_gpus_lack_the_metric_is_not_unknown() -> None:
    """NOT_SUPPORTED (MIG utilisation, no GPM) is outside the metric's domain: left out, never UNAVAILABLE."""
    unsupported = (ReadError("gpu_utilization", ReadErrorKind.NOT_SUPPORTED, "Not Supported"),)
    mig = replace(snapshot(1, 0.0, (gpu_sample(0, node="gpu-m", uuid="MIG-1", errors=unsupported),), node="gpu-m"))
    evaluation = both_ways(cluster(IDLE, gpus("gpu-b", 2, util=50.0), mig), maxUnreadable="0")
    assert (evaluation.error, evaluation.value, evaluation.absent) == (None, 100.0, ())


def test_a_workload_on_a_node_whose_gpus_all_hang_is_unknown() -> None:
    """The workload's only node is heard but its GPUs hang: UNAVAILABLE naming the node and the pods it holds."""
    hung = node("gpu-a", (0.0, "trainer-1"), (0.0, "trainer-2"))
    hung = replace(hung, samples=tuple(s._replace(gpu_utilization_percent=None) for s in hung.samples))
    message = unavailable(run(cluster(OTHER, hung), Directory(*TRAINERS), workload="trainer"))
    assert "node 'gpu-a' is heard, but none of its 2 selected GPU(s) can be read" in message
    assert "it holds ml/trainer-1, ml/trainer-2" in message
    allowed = run(cluster(OTHER, hung), Directory(*TRAINERS), workload="trainer", minNodes="1")
    assert (allowed.error, allowed.value, [a.node for a in allowed.absent]) == (None, 0.0, ["gpu-a"])
