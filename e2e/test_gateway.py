"""Gateways and agents as real processes on loopback: three agents with fake GPUs and fake kubelets, two gateways.

Unknown is not zero: a busy node's agent that dies makes both gateways answer UNAVAILABLE naming it, and
push nothing; its share leaves only when its pods are deleted or its agent leaves discovery.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator, Callable, Sequence
from functools import partial
from pathlib import Path

import pytest
from grpclib.const import Status
from grpclib.exceptions import GRPCError

from e2e.support.cluster import Cluster, Pushes, answer, eventually, explain, is_active
from e2e.support.process import Process
from tests.fakes.fake_kubelet import Assignment, FakeKubelet, short_socket_path

NODES = ("node-1", "node-2", "node-3")
PODS = """
pods:
  - {namespace: ml, pod: trainer-5d8f-a, labels: {app: trainer}, workload: trainer, workloadKind: Deployment}
  - {namespace: ml, pod: trainer-5d8f-b, labels: {app: trainer}, workload: trainer, workloadKind: Deployment}
  - {namespace: ml, pod: trainer-5d8f-c, labels: {app: trainer}, workload: trainer, workloadKind: Deployment}
  - {namespace: ml, pod: infer-0, labels: {app: infer}, workload: infer, workloadKind: StatefulSet}
  - {namespace: tenant-b, pod: trainer-x, labels: {app: trainer}, workload: trainer}
"""


def uuid(node: str, index: int) -> str:
    """The UUID of fake GPU ``index`` of the agent on ``node``."""
    return f"GPU-fake-{node}-{index}"


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    """Fake kubelets, three agent processes, two gateway processes; all stopped at the end."""
    built = Cluster(tmp_path)
    pods = tmp_path / "pods.yaml"
    pods.write_text(PODS)
    try:
        for node in NODES:
            built.kubelets[node] = await FakeKubelet(short_socket_path()).start()
        starts = [built.agent(node) for node in NODES]
        started = await asyncio.gather(*(asyncio.to_thread(p.start) for p in starts))
        for node, process in zip(NODES, started, strict=True):
            built.agents[node] = process
        built.gateways = list(
            await asyncio.gather(*(asyncio.to_thread(built.gateway(i, pods).start) for i in range(2)))
        )
        yield built
    finally:
        codes = [await process.terminate() for process in [*built.gateways, *built.agents.values()]]
        for kubelet in built.kubelets.values():
            await kubelet.stop()
    assert all(code in (0, -signal.SIGKILL) for code in codes), codes


def _equals(expected: float, got: object) -> bool:
    return isinstance(got, float) and got == pytest.approx(expected)


def assign(cluster: Cluster, node: str, assignments: Sequence[Assignment]) -> None:
    """Tell ``node``'s fake kubelet which pods hold which of its GPUs."""
    cluster.kubelets[node].assign(assignments)


async def test_both_gateways_give_the_same_hand_computed_answers(cluster: Cluster) -> None:
    """Workload, label, pod-glob and node-wide queries match a hand computation, on both gateways alike."""
    assign(cluster, "node-1", [Assignment("ml", "trainer-5d8f-a", (uuid("node-1", 0), uuid("node-1", 1)))])
    assign(
        cluster,
        "node-2",
        [Assignment("ml", "trainer-5d8f-b", (uuid("node-2", 0),)), Assignment("ml", "infer-0", (uuid("node-2", 1),))],
    )
    assign(cluster, "node-3", [Assignment("tenant-b", "trainer-x", (uuid("node-3", 0),))])
    await cluster.set("node-1", 80, 40)
    await cluster.set("node-2", 30, 90)
    await cluster.set("node-3", 100, 10)

    # trainer: a = avg(80, 40) = 60, b = 30 -> 90 (tenant-b's trainer-x is another namespace's workload).
    expected = {
        (("workload", "trainer"),): 90.0,
        (("podSelector", "app in (trainer)"),): 90.0,
        (("workload", "trainer"), ("aggregation", "max")): 60.0,
        (("pod", "infer-*"),): 90.0,
        (("namespace", "tenant-b"),): 100.0,
        (("metric", "gpu_utilization"),): 80 + 40 + 30 + 90 + 100 + 10,
        (("workload", "overflow"),): 0.0,
    }
    for items, value in expected.items():
        metadata = dict(items)
        for gateway in cluster.gateways:

            async def ask(gateway: Process = gateway, metadata: dict[str, str] = metadata) -> float:
                return await answer(gateway, **metadata)

            await eventually(ask, partial(_equals, value), timeout=15)
    first, second = [await answer(g, workload="trainer", aggregation="p90") for g in cluster.gateways]
    assert first == second
    explanation = await explain(cluster.gateways[0], workload="trainer")
    assert (explanation.nodes, explanation.nodes_expected) == (2, 3)
    assert sorted(p.pod for p in explanation.pods) == ["trainer-5d8f-a", "trainer-5d8f-b"]


def names_node(node: str) -> Callable[[object], bool]:
    """Accepts UNAVAILABLE naming ``node``: unknown, not zero."""

    def accept(got: object) -> bool:
        unavailable = isinstance(got, GRPCError) and got.status is Status.UNAVAILABLE
        return unavailable and f"node {node!r}" in str(getattr(got, "message", ""))

    return accept


async def test_a_killed_busy_agent_is_unknown_on_both_gateways_until_it_is_gone_on_purpose(
    cluster: Cluster, tmp_path: Path
) -> None:
    """Kill the busy node's agent: UNAVAILABLE naming it, no false pushed; back on restart; gone once its pods are."""
    assign(cluster, "node-1", [Assignment("ml", "trainer-5d8f-a", (uuid("node-1", 0), uuid("node-1", 1)))])
    await cluster.set("node-1", 40, 40)
    queries = (
        {"activationThreshold": "10"},
        {"workload": "trainer", "podAggregation": "sum", "activationThreshold": "10"},
    )
    for gateway in cluster.gateways:
        for metadata in queries:
            await eventually(partial(answer, gateway, **metadata), partial(_equals, 80.0), timeout=15)
    pushes = [Pushes(gateway, **metadata) for gateway in cluster.gateways for metadata in queries]
    try:
        for push in pushes:
            await eventually(push.pushed, lambda seen: seen == [True], timeout=15)

        port = cluster.agents["node-1"].port
        cluster.agents["node-1"].kill()
        for gateway in cluster.gateways:
            for metadata in queries:
                await eventually(partial(answer, gateway, **metadata), names_node("node-1"), timeout=15)
                await eventually(partial(is_active, gateway, **metadata), names_node("node-1"), timeout=5)
        # Several compositions later, still nothing but the first true was pushed.
        await eventually(partial(answer, cluster.gateways[0]), names_node("node-1"), timeout=5)
        assert [push.seen for push in pushes] == [[True]] * len(pushes)

        cluster.agents["node-1"] = await asyncio.to_thread(cluster.agent("node-1", port=port).start)
        await cluster.set("node-1", 40, 40)
        for gateway in cluster.gateways:
            for metadata in queries:
                await eventually(partial(answer, gateway, **metadata), partial(_equals, 80.0), timeout=15)

        # Its pods deleted while the node is silent: the workload's share leaves, without an error.
        cluster.agents["node-1"].kill()
        for gateway in cluster.gateways:
            await eventually(partial(answer, gateway, workload="trainer"), names_node("node-1"), timeout=15)
        (tmp_path / "pods.yaml").write_text(PODS.replace("trainer-5d8f-a", "trainer-5d8f-z"))
        for gateway in cluster.gateways:
            await eventually(partial(answer, gateway, workload="trainer"), partial(_equals, 0.0), timeout=15)
            await eventually(partial(answer, gateway), names_node("node-1"), timeout=5)  # the node is still listed

        # Its agent removed from discovery: the node's share leaves every answer.
        cluster.list_agents("node-2", "node-3")
        for gateway in cluster.gateways:
            await eventually(partial(answer, gateway), partial(_equals, 0.0), timeout=15)
        assert [push.seen[0] for push in pushes] == [True] * len(pushes)
        assert all(False not in push.seen[: push.seen.index(True) + 1] for push in pushes)
    finally:
        for push in pushes:
            await push.close()
    assert not any(g.process is not None and g.process.poll() is not None for g in cluster.gateways)


async def test_a_workload_scaling_from_one_to_three_pods_changes_the_answer_within_one_refresh(
    cluster: Cluster,
) -> None:
    """When the kubelets assign GPUs to two more replicas, the workload's value follows on both gateways."""
    for node in NODES:
        await cluster.set(node, 50, 0)
    assign(cluster, "node-1", [Assignment("ml", "trainer-5d8f-a", (uuid("node-1", 0),))])
    for gateway in cluster.gateways:
        await eventually(
            partial(answer, gateway, workload="trainer"), lambda got: got == pytest.approx(50.0), timeout=15
        )

    assign(cluster, "node-2", [Assignment("ml", "trainer-5d8f-b", (uuid("node-2", 0),))])
    assign(cluster, "node-3", [Assignment("ml", "trainer-5d8f-c", (uuid("node-3", 0),))])
    for gateway in cluster.gateways:
        await eventually(
            partial(answer, gateway, workload="trainer"), lambda got: got == pytest.approx(150.0), timeout=15
        )
