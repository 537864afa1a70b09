"""Per-pod shares of a shared GPU: each pod's own processes at the gateway, the whole GPU where that cannot be known."""

from __future__ import annotations

from dataclasses import replace

import pytest

from gpuscaler.model.pods import PodInfo
from gpuscaler.model.samples import (
    PROCESSES_FIELD,
    Attribution,
    AttributionState,
    GpuSample,
    PodRef,
    ProcessUsage,
    ReadError,
    ReadErrorKind,
)
from gpuscaler.query.metadata import Limits, parse_metadata
from gpuscaler.signals.evaluation import evaluate
from gpuscaler.signals.outcome import Evaluation
from tests.builders import ClusterSource, cluster, gpu_sample, gpu_trigger, history_of, snapshot
from tests.signals.test_evaluation_workloads import Directory

UID_A = "1b4e2a3c-1111-2222-3333-444455556666"
UID_B = "9f8e7d6c-aaaa-bbbb-cccc-ddddeeeeffff"
GIB = 1024**3
OK = Attribution(AttributionState.OK)
DIRECTORY = Directory(
    PodInfo("ml", "vllm-a", workload="vllm", workload_kind="Deployment", uid=UID_A),
    PodInfo("ml", "vllm-b", workload="vllm", workload_kind="Deployment", uid=UID_B),
    PodInfo("ml", "solo", workload="solo", workload_kind="Deployment", uid="0" * 8 + "-0000-0000-0000-" + "0" * 12),
)
SHARED_PODS = (PodRef("ml", "vllm-a", "server"), PodRef("ml", "vllm-b", "server"))
PROCESSES = (
    # Pod A: two processes; pod B: one; a host daemon; one that exited before its cgroup was read.
    ProcessUsage(101, UID_A.replace("-", "_"), "a" * 64, 30.0, 10.0, 20 * GIB),
    ProcessUsage(102, UID_A, "a" * 64, 5.0, 2.0, 4 * GIB),
    ProcessUsage(201, UID_B, "b" * 64, 50.0, 30.0, 40 * GIB),
    ProcessUsage(301, "", None, 0.0, 0.0, 1 * GIB),
)


def shared(
    util: float = 92.0, processes: tuple[ProcessUsage, ...] | None = PROCESSES, errors: tuple[ReadError, ...] = ()
) -> GpuSample:
    """A time-sliced GPU held by vllm-a and vllm-b, 92% busy in all, 80 GiB."""
    return gpu_sample(
        0, util=util, mem_util=45.0, used=65 * GIB, total=80 * GIB, pods=SHARED_PODS, processes=processes, errors=errors
    )


def node_view(*ticks: tuple[GpuSample, ...]) -> ClusterSource:
    """A gateway's view of one node whose history holds ``ticks``, one second apart."""
    snapshots = [replace(snapshot(i + 1, float(i), samples), attribution=OK) for i, samples in enumerate(ticks)]
    return ClusterSource(cluster(snapshots[-1], at=float(len(ticks) - 1)), history_of(*snapshots))


def run(metadata: dict[str, str], *ticks: tuple[GpuSample, ...], directory: Directory | None = DIRECTORY) -> Evaluation:
    """Evaluate ``metadata``, from a ScaledObject in ml, over a node whose history holds ``ticks``."""
    source = node_view(*ticks)
    query = gpu_trigger(parse_metadata(metadata, Limits(history_seconds=600, cluster=True), namespace="ml"))
    return evaluate(query.value, source, now=source.latest.monotonic, stale_after=5.0, directory=directory)


def pods_of(evaluation: Evaluation) -> dict[str, float | None]:
    """Each selected pod's value, by pod name (None: a pod left out, with its reason)."""
    return {p.pod: p.value for p in evaluation.pods}


@pytest.mark.parametrize(
    ("metric", "a", "b"),
    [
        pytest.param("gpu_utilization", 35.0, 50.0, id="sm-time"),
        pytest.param("memory_utilization", 12.0, 30.0, id="memory-controller-time"),
        pytest.param("memory_used_percent", 30.0, 50.0, id="vram-of-the-whole"),
    ],
)
def test_each_pod_counts_its_own_processes_on_a_shared_gpu(metric: str, a: float, b: float) -> None:
    """Pods sharing a GPU each read the sum over their own processes, not the whole GPU's value twice."""
    evaluation = run({"workload": "vllm", "metric": metric}, (shared(),))
    assert pods_of(evaluation) == {"vllm-a": pytest.approx(a), "vllm-b": pytest.approx(b)}
    assert evaluation.value_or_raise() == pytest.approx(a + b)
    for contribution in evaluation.contributions:
        assert contribution.share is not None
        assert contribution.share.startswith("own share:")
        assert "shared by 2 pods" in contribution.share


def test_without_shares_the_gpu_counted_twice() -> None:
    """The same GPU without per-process reads counts in full for both pods (92 + 92), and says why."""
    evaluation = run({"workload": "vllm"}, (shared(processes=None),))
    assert pods_of(evaluation) == {"vllm-a": 92.0, "vllm-b": 92.0}
    assert all("the agent reads no processes (--processes)" in (c.share or "") for c in evaluation.contributions)


def test_a_pod_with_no_process_on_the_gpu_reads_zero_it_has_a_known_share() -> None:
    """A pod that holds the GPU and runs nothing on it has a true 0 share: NVML listed every process there."""
    only_b = tuple(p for p in PROCESSES if p.pid == 201)
    evaluation = run({"workload": "vllm"}, (shared(processes=only_b),))
    assert pods_of(evaluation) == {"vllm-a": 0.0, "vllm-b": 50.0}


@pytest.mark.parametrize(
    ("directory", "fragment"),
    [
        pytest.param(None, "does not know the pod's UID", id="agent-without-directory"),
        pytest.param(
            Directory(PodInfo("ml", "vllm-a", workload="vllm"), PodInfo("ml", "vllm-b", workload="vllm")),
            "does not know the pod's UID",
            id="directory-without-uids",
        ),
    ],
)
def test_without_the_pods_uid_the_whole_gpu_counts_and_says_why(directory: Directory | None, fragment: str) -> None:
    """Per-process figures need the pod's UID to be tied to it; without it a pod reads the whole GPU, and says why."""
    evaluation = run({"pod": "vllm-*"}, (shared(),), directory=directory)
    assert pods_of(evaluation) == {"vllm-a": 92.0, "vllm-b": 92.0}
    assert all(fragment in (c.share or "") for c in evaluation.contributions)


def test_unreadable_processes_fall_back_to_the_whole_gpu_with_the_agents_reason() -> None:
    """When the agent could not read processes (no host PIDs), the reason it gave is what Explain shows."""
    error = ReadError(PROCESSES_FIELD, ReadErrorKind.NOT_SUPPORTED, "none of the 4 processes ... hostPID")
    evaluation = run({"workload": "vllm"}, (shared(processes=None, errors=(error,)),))
    assert pods_of(evaluation) == {"vllm-a": 92.0, "vllm-b": 92.0}
    assert all("hostPID" in (c.share or "") for c in evaluation.contributions)


def test_without_per_process_utilisation_the_whole_gpu_counts() -> None:
    """Processes with memory but no utilisation figures give no SM share: the whole GPU, not a made-up 0."""
    blind = tuple(p._replace(sm_percent=None) for p in PROCESSES)
    evaluation = run({"workload": "vllm"}, (shared(processes=blind),))
    assert pods_of(evaluation) == {"vllm-a": 92.0, "vllm-b": 92.0}
    assert all("no per-process gpu_utilization" in (c.share or "") for c in evaluation.contributions)
    memory = run({"workload": "vllm", "metric": "memory_used_percent"}, (shared(processes=blind),))
    assert pods_of(memory) == {"vllm-a": pytest.approx(30.0), "vllm-b": pytest.approx(50.0)}


def test_metrics_without_per_process_figures_count_the_whole_gpu() -> None:
    """Temperature, power and GPM have no per-process figures: each pod reads the GPU's, and Explain says so."""
    sample = shared()._replace(temperature_celsius=70.0)
    evaluation = run({"workload": "vllm", "metric": "temperature"}, (sample,))
    assert pods_of(evaluation) == {"vllm-a": 70.0, "vllm-b": 70.0}
    assert all("NVML has no per-process temperature" in (c.share or "") for c in evaluation.contributions)


def test_a_gpu_one_pod_holds_counts_in_full_as_before() -> None:
    """A GPU held by one pod is its whole GPU: the device's value, not the sum of its processes."""
    solo = gpu_sample(0, util=80.0, pods=(PodRef("ml", "solo", "main"),), processes=PROCESSES)
    evaluation = run({"workload": "solo"}, (solo,))
    assert pods_of(evaluation) == {"solo": 80.0}
    assert evaluation.contributions[0].share == "whole GPU (this pod holds it alone)"


def test_a_window_averages_the_pods_own_share_and_skips_ticks_without_figures() -> None:
    """Over a window each tick's own share counts; a tick without per-process figures is left out, not 0."""
    busy = tuple(p._replace(sm_percent=p.sm_percent * 2) if p.sm_percent else p for p in PROCESSES)
    evaluation = run(
        {"workload": "vllm", "window": "10s"}, (shared(),), (shared(processes=None),), (shared(processes=busy),)
    )
    assert pods_of(evaluation) == {"vllm-a": pytest.approx((35.0 + 70.0) / 2), "vllm-b": pytest.approx(75.0)}
    assert [c.sample_count for c in evaluation.contributions] == [2, 2]
