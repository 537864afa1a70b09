"""Gateways and agents as real processes on loopback: three agents with fake GPUs and fake kubelets, two gateways.

The fake kubelets are real gRPC servers on unix sockets in this test's process; the agents read them the way
they read the kubelet. Each agent gets its own NODE_NAME, so its fake GPUs are GPU-fake-<node>-<index>.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import pytest
from grpclib.client import Channel
from grpclib.exceptions import GRPCError

from e2e.support.process import Process, environment
from gpuscaler.generated import externalscaler as keda
from gpuscaler.generated.gpuscaler import v1 as pb
from tests.fakes.fake_kubelet import Assignment, FakeKubelet, short_socket_path

CONSOLE_SCRIPT = Path(sys.executable).with_name("gpuscaler")
POLL_SECONDS = 0.2
GPUS = 2
# An agent polling every 0.2 s leaves the view max(3 x 0.2, 2) = 2 s after its last snapshot.
STALE_BOUND_SECONDS = 2.0
# The agent reads the kubelet every second (not a flag: see ServeSettings).
KUBELET_REFRESH_SECONDS = 1.0


@dataclass
class Cluster:
    """Three nodes (agent + fake kubelet each) and two gateways over them."""

    directory: Path
    kubelets: dict[str, FakeKubelet] = field(default_factory=dict)
    agents: dict[str, Process] = field(default_factory=dict)
    gateways: list[Process] = field(default_factory=list)

    def agent(self, node: str, port: int = 0) -> Process:
        return Process(
            [
                str(CONSOLE_SCRIPT),
                "serve",
                "--collector",
                "fake",
                "--fake-gpus",
                str(GPUS),
                "--poll-interval",
                str(POLL_SECONDS),
                "--listen",
                f"127.0.0.1:{port}",
                "--metrics-listen",
                "",
                "--pod-resources-socket",
                str(self.kubelets[node].socket_path),
                "--log-format",
                "json",
            ],
            self.directory / f"agent-{node}-{time.monotonic_ns()}.log",
            environment(node),
            "agent_started",
        )

    def gateway(self, index: int, pods: Path) -> Process:
        agents = ",".join(f"127.0.0.1:{agent.port}" for agent in self.agents.values())
        return Process(
            [
                str(CONSOLE_SCRIPT),
                "gateway",
                "--listen",
                "127.0.0.1:0",
                "--agents",
                agents,
                "--pod-directory",
                str(pods),
                "--log-format",
                "json",
                "--drain-timeout",
                "1",
            ],
            self.directory / f"gateway-{index}.log",
            environment(),
            "gateway_started",
        )

    async def set(self, node: str, *values: float) -> None:
        channel = Channel("127.0.0.1", self.agents[node].port)
        try:
            stub = pb.FakeControlStub(channel)
            for index, value in enumerate(values):
                request = pb.SetRequest(gpu=pb.GpuSelector(index=index), values={"gpu_utilization": value})
                await stub.set(request, timeout=10)
        finally:
            channel.close()


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


async def answer(gateway: Process, **metadata: str) -> float:
    """GetMetricSpec then GetMetrics, as KEDA calls them, with a ScaledObject in namespace ml."""
    channel = Channel("127.0.0.1", gateway.port)
    try:
        stub = keda.ExternalScalerStub(channel)
        ref = keda.ScaledObjectRef(name="so", namespace="ml", scaler_metadata=metadata)
        spec = await stub.get_metric_spec(ref, timeout=5)
        request = keda.GetMetricsRequest(scaled_object_ref=ref, metric_name=spec.metric_specs[0].metric_name)
        return (await stub.get_metrics(request, timeout=5)).metric_values[0].metric_value_float
    finally:
        channel.close()


async def explain(gateway: Process, **metadata: str) -> pb.Explanation:
    channel = Channel("127.0.0.1", gateway.port)
    try:
        return await pb.AgentStub(channel).explain(
            pb.ExplainRequest(scaler_metadata=metadata, namespace="ml"), timeout=5
        )
    finally:
        channel.close()


async def eventually(call: Callable[[], Awaitable[object]], accept: Callable[[object], bool], timeout: float) -> float:
    """Seconds until ``accept(await call())``; fails with the last result after ``timeout``."""
    started = time.monotonic()
    last: object = None
    while time.monotonic() - started < timeout:
        try:
            last = await call()
        except GRPCError as error:
            last = error
        if accept(last):
            return time.monotonic() - started
        await asyncio.sleep(0.05)
    raise AssertionError(f"not accepted within {timeout:g}s; last: {last!r}")


def _equals(expected: float, got: object) -> bool:
    return isinstance(got, float) and got == pytest.approx(expected)


def assign(cluster: Cluster, node: str, assignments: Sequence[Assignment]) -> None:
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


async def test_a_killed_agent_leaves_within_the_bound_and_comes_back(cluster: Cluster) -> None:
    """SIGKILL an agent: both gateways drop its GPUs within the staleness bound; restarted, it is back."""
    for node in NODES:
        await cluster.set(node, 10, 10)
    for gateway in cluster.gateways:
        await eventually(partial(answer, gateway), lambda got: got == pytest.approx(60.0), timeout=15)

    victim = cluster.agents["node-3"]
    port = victim.port
    victim.kill()
    killed = time.monotonic()
    for gateway in cluster.gateways:
        await eventually(partial(answer, gateway), lambda got: got == pytest.approx(40.0), timeout=15)
    gone_after = time.monotonic() - killed
    assert gone_after < STALE_BOUND_SECONDS + 3.0  # the bound, plus a compose tick and this loop's slack
    refused = await eventually(
        lambda: answer(cluster.gateways[0], minNodes="3"), lambda got: isinstance(got, GRPCError), timeout=5
    )
    assert refused >= 0

    restarted = cluster.agent("node-3", port=port)
    cluster.agents["node-3"] = await asyncio.to_thread(restarted.start)
    await cluster.set("node-3", 10, 10)
    for gateway in cluster.gateways:
        await eventually(partial(answer, gateway), lambda got: got == pytest.approx(60.0), timeout=15)
    assert not any(g.process is not None and g.process.poll() is not None for g in cluster.gateways)


async def test_a_workload_scaling_from_one_to_three_pods_changes_the_answer_within_one_refresh(
    cluster: Cluster,
) -> None:
    """When the kubelets assign GPUs to two more replicas, the workload's value follows within one refresh."""
    for node in NODES:
        await cluster.set(node, 50, 0)
    assign(cluster, "node-1", [Assignment("ml", "trainer-5d8f-a", (uuid("node-1", 0),))])
    for gateway in cluster.gateways:
        await eventually(
            partial(answer, gateway, workload="trainer"), lambda got: got == pytest.approx(50.0), timeout=15
        )

    assign(cluster, "node-2", [Assignment("ml", "trainer-5d8f-b", (uuid("node-2", 0),))])
    assign(cluster, "node-3", [Assignment("ml", "trainer-5d8f-c", (uuid("node-3", 0),))])
    took = await eventually(
        lambda: answer(cluster.gateways[1], workload="trainer"), lambda got: got == pytest.approx(150.0), timeout=15
    )
    # One kubelet refresh (1 s), one poll (0.2 s), the gateway's coalescing (0.02 s), and slack for a busy box.
    assert took < KUBELET_REFRESH_SECONDS + POLL_SECONDS + 2.0
