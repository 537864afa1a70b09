"""A ``workload:`` query through the gateway scales the Deployment whose pods hold the GPUs, and only those GPUs.

The Deployment's pods are the real ones its ReplicaSet created in the API server; the gateway's static pod directory
lists them with their labels and owner, and a fake kubelet tells the agent which of them holds which GPU. Another
workload in the namespace and a same-named workload in another namespace hold busier GPUs that must not count.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from e2e.keda.scenario import Scenario, directory_entry, expected_replicas, scaled_object
from gpuscaler.client.hpa import MetricType
from tests.fakes.fake_kubelet import Assignment

TARGET = 60.0
TRAINER_UTILIZATION = 90.0
OTHERS_UTILIZATION = 100.0


async def test_a_workload_query_counts_only_that_deployments_gpus(scenario: Scenario, tmp_path: Path) -> None:
    """trainer's two pods at 90% on one GPU each: ceil(180 / 60) = 3 replicas, whatever the other tenants do."""
    history = await scenario.deployment("trainer", replicas=2)
    await scenario.deployment("infer", replicas=1)
    trainers = await scenario.wait_pods("trainer", 2)
    (infer,) = await scenario.wait_pods("infer", 1)
    other_namespace = f"{scenario.namespace}-b"
    pods_file = tmp_path / "pods.yaml"
    entries = [directory_entry(pod, "trainer") for pod in trainers] + [directory_entry(infer, "infer")]
    entries.append(
        {"namespace": other_namespace, "pod": "trainer-x", "labels": {"app": "trainer"}, "workload": "trainer"}
    )
    pods_file.write_text(yaml.safe_dump({"pods": entries}))

    kubelet = await scenario.kubelet()
    holders = [(pod["metadata"]["namespace"], pod["metadata"]["name"]) for pod in [*trainers, infer]]
    holders.append((other_namespace, "trainer-x"))
    kubelet.assign([Assignment(ns, pod, (f"GPU-fake-node-1-{index}",)) for index, (ns, pod) in enumerate(holders)])
    agent = await scenario.agent("node-1", gpus=4, kubelet=kubelet)
    gateway = await scenario.gateway([agent], pod_directory=pods_file)
    for gpu, utilization in enumerate([TRAINER_UTILIZATION] * 2 + [OTHERS_UTILIZATION] * 2):
        await scenario.fake_set(agent, gpu, gpu_utilization=utilization)

    metadata = {"scalerAddress": f"127.0.0.1:{gateway.port}", "workload": "trainer", "targetValue": f"{TARGET:g}"}
    # gpuscaler query sends no ScaledObject, so it names the namespace KEDA's ScaledObject implies.
    value = await scenario.wait_value(gateway, {**metadata, "namespace": scenario.namespace}, 2 * TRAINER_UTILIZATION)
    expected = expected_replicas(MetricType.AVERAGE_VALUE, value=value, target=TARGET, current=2, maximum=10)
    await scenario.apply(scaled_object("trainer", trigger="external-push", metadata=metadata, min_replicas=1))
    await scenario.wait_ready("trainer")
    await history.wait_equal(expected, 60)
    # The new pod holds no GPU, so the value and the count stay; counting other tenants' GPUs would go to 5 or 7.
    await history.hold(expected, 5)
    scenario.record(f"workload trainer (value {value:g}, target {TARGET:g}): {history.describe()}")
