"""The real KEDA and HPA scale a Deployment of 4-GPU pods off the chart's gateway to the replica count the documented
rule gives, for AverageValue and for Value.

The rule (docs/hpa.md): a pod-selected trigger answers the sum over the selected pods of each pod's value, a pod's
value being its GPUs reduced by ``podAggregation`` (default ``avg``); the HPA then asks for ceil(value / target)
replicas with AverageValue and ceil(ready pods x value / target) with Value, keeping the current count while the
ratio is within its 10% tolerance, clamped to minReplicaCount..maxReplicaCount. The node offers 8 GPUs, so two 4-GPU
pods run and any more stay Pending, holding no GPU: they add nothing to the value and are not ready pods.

The first pod's four GPUs read 90, 70, 50 and 30% (its value is 60); every other GPU reads 0. The expected count is
computed here from that rule alone and lies strictly between the bounds, so neither clamp can produce it; a sum over
GPUs (240) or the pod's busiest GPU (90) would ask for more.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest

from e2e.keda.control_plane import Json, namespace
from e2e.keda.scenario import ReplicaHistory, scaled_object
from e2e.node.chart import Release, fake_set, held, metric_value, uuid_index, wait_counted, wait_scaled_object_ready
from e2e.node.cluster import Deadline, NodeCluster, gpu_deployment, in_thread
from e2e.node.conftest import FAKE_GPUS, record
from gpuscaler.client.hpa import MetricType

GPUS_PER_POD = 4
# The first pod's GPUs; the others' read 0.
FIRST_POD_GPUS = (90.0, 70.0, 50.0, 30.0)
TARGET = 40.0
TOLERANCE = 0.1  # the HPA's default --horizontal-pod-autoscaler-tolerance
SETTLE_SECONDS = 10.0
STEP_TIMEOUT_SECONDS = 180.0


@dataclass(frozen=True)
class Case:
    """One ScaledObject on the 4-GPU Deployment."""

    metric_type: MetricType
    maximum: int
    minimum: int = 1


CASES = [
    pytest.param(Case(MetricType.AVERAGE_VALUE, maximum=4), id="AverageValue"),
    pytest.param(Case(MetricType.VALUE, maximum=5), id="Value"),
]


def documented_steps(case: Case, pods: list[list[float]], fits: int, start: int = 1) -> list[int]:
    """The replica counts the documented rule passes through from ``start`` until it settles: ``pods[i]`` are the
    GPU readings of the i-th pod to start, and only the first ``fits`` pods run (the rest are Pending)."""
    steps = [start]
    while True:
        replicas = steps[-1]
        running = min(replicas, fits)
        value = sum(sum(gpus) / len(gpus) for gpus in pods[:running])  # podAggregation avg, summed over pods
        if case.metric_type is MetricType.AVERAGE_VALUE:
            ratio = value / (TARGET * replicas)
            proposal = math.ceil(value / TARGET)
        else:
            ratio = value / TARGET
            proposal = math.ceil(ratio * running)  # the HPA multiplies by the ready pods
        desired = replicas if abs(ratio - 1.0) <= TOLERANCE else proposal
        desired = max(case.minimum, min(case.maximum, desired))
        if desired == replicas:
            return steps
        steps.append(desired)


def test_the_documented_steps_follow_the_rule() -> None:
    """The hand computation: AverageValue settles at ceil(60 / 40) = 2; Value goes 1 -> ceil(1 x 1.5) = 2 -> ceil(2 x
    1.5) = 3, the third pod Pending, and stays (two ready pods, the same value)."""
    pods = [list(FIRST_POD_GPUS), [0.0] * 4, [0.0] * 4]
    assert documented_steps(Case(MetricType.AVERAGE_VALUE, maximum=4), pods, fits=2) == [1, 2]
    assert documented_steps(Case(MetricType.VALUE, maximum=5), pods, fits=2) == [1, 2, 3]


@pytest.mark.parametrize("case", CASES)
async def test_the_hpa_scales_four_gpu_pods_as_the_docs_compute(installed: Release, case: Case) -> None:
    """One pod of 4 GPUs at 90/70/50/30%, every other GPU idle: the gateway answers 60 (the pod's average), and KEDA
    and the HPA move the Deployment through exactly the documented steps and hold the last, which is strictly between
    minReplicaCount and maxReplicaCount; the HPA's desiredReplicas says the same."""
    cluster = installed.cluster
    ns, app = "multi-gpu", f"four-gpu-{case.metric_type.value.lower()}"
    fits = FAKE_GPUS // GPUS_PER_POD
    pods = [list(FIRST_POD_GPUS)] + [[0.0] * GPUS_PER_POD] * case.maximum
    steps = documented_steps(case, pods, fits)
    expected = steps[-1]
    assert case.minimum < expected < case.maximum, f"{case}: {steps} would prove only a clamp"

    deployment = gpu_deployment(app, ns, replicas=1, gpus=GPUS_PER_POD)
    address = await in_thread(installed.service_address)
    metadata = {"scalerAddress": address, "workload": app, "metric": "gpu_utilization", "targetValue": f"{TARGET:g}"}
    asked = {**metadata, "namespace": ns}
    manifest = scaled_object(
        app,
        trigger="external",
        metadata=metadata,
        metric_type=case.metric_type,
        min_replicas=case.minimum,
        max_replicas=case.maximum,
    )
    manifest["metadata"]["namespace"] = ns
    await in_thread(cluster.apply, namespace(ns))
    try:
        agent = await in_thread(installed.agent_address)
        await fake_set(agent, "all", gpu_utilization=0)
        await in_thread(cluster.apply, deployment)
        history = ReplicaHistory(cluster.plane, ns, app)
        first = await in_thread(cluster.wait_running, ns, f"app={app}", 1)
        gpus = await held(cluster, ns, app, first)
        assert len(gpus) == GPUS_PER_POD, f"the first pod holds {gpus}"
        for uuid, reading in zip(sorted(gpus), FIRST_POD_GPUS, strict=True):
            await fake_set(agent, uuid_index(uuid), gpu_utilization=reading)
        answer, _ = await wait_counted(cluster, address, asked, gpus)
        value = metric_value(answer)
        assert value == pytest.approx(sum(FIRST_POD_GPUS) / GPUS_PER_POD), answer["get_metrics"]

        await in_thread(cluster.apply, manifest)
        await in_thread(wait_scaled_object_ready, cluster, ns, app)
        # Any count off the documented path ends the wait at once, so a different arithmetic fails fast.
        await history.wait_for(
            lambda replicas: replicas == expected or replicas not in steps, STEP_TIMEOUT_SECONDS, f"{expected}"
        )
        assert history.steps == steps, f"the HPA went {history.describe()}, the rule {steps}"
        await history.hold(expected, SETTLE_SECONDS)
        hpa = await in_thread(_hpa, cluster, ns, app)
        assert hpa["status"]["desiredReplicas"] == expected, hpa["status"]

        # The pods beyond what fits are Pending and hold nothing; the value is still the running pods' sum.
        running = await in_thread(_wait_pods, cluster, ns, app, expected, min(expected, fits))
        answer, counted = await wait_counted(cluster, address, asked, (ns, app))
        assert len(counted) == running * GPUS_PER_POD, counted
        assert metric_value(answer) == pytest.approx(value), answer["get_metrics"]
        line = (
            f"4-GPU pods ({case.metric_type.value}, target {TARGET:g}, min {case.minimum}, max {case.maximum}): "
            f"value {metric_value(answer):g} (GPUs {'/'.join(f'{g:g}' for g in FIRST_POD_GPUS)} in one pod, "
            f"the rest 0); replicas by the docs' rule {' -> '.join(map(str, steps))}, by the real HPA "
            f"{history.describe()} (desiredReplicas {hpa['status']['desiredReplicas']}), {running} running, "
            f"{expected - running} Pending"
        )
        print(line)
        record(line)
        history.stop()
    finally:
        await in_thread(cluster.delete, manifest)
        await in_thread(cluster.wait_gone, manifest)
        await in_thread(cluster.delete, deployment)
        await in_thread(cluster.wait_running, ns, f"app={app}", 0)


def _hpa(cluster: NodeCluster, ns: str, name: str) -> Json:
    found = cluster.kube.get(f"/apis/autoscaling/v2/namespaces/{ns}/horizontalpodautoscalers/keda-hpa-{name}")
    assert found is not None, f"KEDA made no HPA for {name}"
    return found


def _wait_pods(cluster: NodeCluster, ns: str, app: str, total: int, running: int) -> int:
    """Waits until Deployment ``app`` has ``total`` pods of which ``running`` are Running and Ready; returns that."""
    selector = f"app={app}"
    Deadline(f"{total} pods of {app}, {running} running", STEP_TIMEOUT_SECONDS).until(
        lambda: (len(cluster.pods(ns, selector)), len(cluster.running_pods(ns, selector))),
        lambda found: found == (total, running),
        cluster.check_alive,
    )
    return running
