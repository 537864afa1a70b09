"""An in-process agent reading a fake kubelet: pods on the wire, pod queries over KEDA's protocol."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from grpclib.client import Channel
from grpclib.const import Status
from grpclib.exceptions import GRPCError

from gpuscaler.agent.collectors.fake import FakeCollector
from gpuscaler.agent.process import Agent
from gpuscaler.generated import externalscaler as keda
from gpuscaler.generated.gpuscaler import v1 as pb
from gpuscaler.model.gpu_metrics import Metric
from tests.conftest import StartAgent
from tests.fakes.fake_kubelet import Assignment, FakeKubelet, short_socket_path
from tests.waiting import until_result


@pytest.fixture
async def kubelet() -> AsyncIterator[FakeKubelet]:
    """A fake kubelet: trainer-0 holds GPUs 0 and 1, trainer-1 GPU 2, another tenant GPU 3."""
    fake = await FakeKubelet(short_socket_path()).start()
    fake.assign(
        [
            Assignment("ml", "trainer-0", ("GPU-fake-test-node-0", "GPU-fake-test-node-1")),
            Assignment("ml", "trainer-1", ("GPU-fake-test-node-2",)),
            Assignment("other-tenant", "miner", ("GPU-fake-test-node-3",)),
        ]
    )
    yield fake
    await fake.stop()


def set_utilization(agent: Agent, values: list[float]) -> None:
    """Set the agent's fake GPUs' utilisation: GPU ``i`` to ``values[i]``."""
    collector = agent.collector
    assert isinstance(collector, FakeCollector)
    for index, value in enumerate(values):
        collector.set_values(index, {Metric.GPU_UTILIZATION: value})


def ref(namespace: str = "ml", **metadata: str) -> keda.ScaledObjectRef:
    """A ScaledObjectRef for trainer in ``namespace``, with ``metadata`` as its trigger's."""
    return keda.ScaledObjectRef(name="trainer", namespace=namespace, scaler_metadata=metadata)


async def metric_value(channel: Channel, scaled: keda.ScaledObjectRef) -> float:
    """The value KEDA would get for ``scaled``: GetMetricSpec, then GetMetrics with the metric name it gave."""
    stub = keda.ExternalScalerStub(channel)
    spec = await stub.get_metric_spec(scaled)
    answer = await stub.get_metrics(
        keda.GetMetricsRequest(scaled_object_ref=scaled, metric_name=spec.metric_specs[0].metric_name)
    )
    return answer.metric_values[0].metric_value_float


async def test_snapshots_carry_the_pods_and_the_state(start_agent: StartAgent, kubelet: FakeKubelet) -> None:
    """WatchSnapshots sends every GPU's pods and attribution OK, from the first snapshot on."""
    agent = await start_agent("--poll-interval", "0.1", "--pod-resources-socket", str(kubelet.socket_path))
    channel = Channel("127.0.0.1", agent.port)
    try:
        snapshot = await pb.AgentStub(channel).get_snapshot(pb.GetSnapshotRequest())
    finally:
        channel.close()
    assert snapshot.attribution is not None
    assert snapshot.attribution.state is pb.AttributionState.OK
    assert [[(p.namespace, p.pod) for p in gpu.pods] for gpu in snapshot.gpus] == [
        [("ml", "trainer-0")],
        [("ml", "trainer-0")],
        [("ml", "trainer-1")],
        [("other-tenant", "miner")],
    ]


async def test_a_pod_query_reads_only_that_namespaces_pods(start_agent: StartAgent, kubelet: FakeKubelet) -> None:
    """pod=trainer-* in the ScaledObject's namespace: avg per pod, summed; the other tenant's GPU is not read."""
    agent = await start_agent("--poll-interval", "0.1", "--pod-resources-socket", str(kubelet.socket_path))
    set_utilization(agent, [90, 50, 40, 100])
    channel = Channel("127.0.0.1", agent.port)
    try:
        # trainer-0: avg(90, 50) = 70; trainer-1: 40; sum = 110. The miner's 100 is another tenant's.
        value = await until_result(
            lambda: metric_value(channel, ref(pod="trainer-*")), lambda v: v == pytest.approx(110.0)
        )
        assert value == pytest.approx(110.0)
        with pytest.raises(GRPCError) as raised:  # nothing of that tenant here; a node cannot say "zero"
            await metric_value(channel, ref(namespace="other-tenant", pod="trainer-*"))
        assert raised.value.status is Status.FAILED_PRECONDITION
    finally:
        channel.close()


async def test_a_workload_with_no_pods_on_this_node_is_refused_not_zero(
    start_agent: StartAgent, kubelet: FakeKubelet
) -> None:
    """With no matching pod on its node, an agent refuses with FAILED_PRECONDITION: its pods may run elsewhere."""
    agent = await start_agent("--poll-interval", "0.1", "--pod-resources-socket", str(kubelet.socket_path))
    set_utilization(agent, [90, 90, 90, 90])
    channel = Channel("127.0.0.1", agent.port)
    try:
        scaled = ref(pod="overflow-*")
        for call in (metric_value(channel, scaled), keda.ExternalScalerStub(channel).is_active(scaled)):
            with pytest.raises(GRPCError) as raised:
                await call
            assert raised.value.status is Status.FAILED_PRECONDITION
            assert "gateway" in (raised.value.message or "")
    finally:
        channel.close()


async def test_pod_queries_fail_with_failed_precondition_when_attribution_is_off(start_agent: StartAgent) -> None:
    """With --pod-resources-socket empty, a pod query is FAILED_PRECONDITION saying attribution is off."""
    agent = await start_agent("--pod-resources-socket", "")
    channel = Channel("127.0.0.1", agent.port)
    try:
        with pytest.raises(GRPCError) as raised:
            await keda.ExternalScalerStub(channel).is_active(ref(pod="trainer-*"))
        assert raised.value.status is Status.FAILED_PRECONDITION
        assert "attribution is off" in (raised.value.message or "")
        # A node-wide query does not need attribution and still answers.
        assert (await keda.ExternalScalerStub(channel).is_active(ref())).result in (True, False)
    finally:
        channel.close()


async def test_pod_queries_name_the_missing_socket(start_agent: StartAgent) -> None:
    """With the socket absent, a pod query is FAILED_PRECONDITION naming the path it looked at."""
    missing = short_socket_path()
    agent = await start_agent("--pod-resources-socket", str(missing))
    channel = Channel("127.0.0.1", agent.port)
    try:
        with pytest.raises(GRPCError) as raised:
            await keda.ExternalScalerStub(channel).is_active(ref(workload="trainer"))
        assert raised.value.status is Status.FAILED_PRECONDITION
        assert str(missing) in (raised.value.message or "")
    finally:
        channel.close()


async def test_workload_queries_on_an_agent_need_a_directory(start_agent: StartAgent, kubelet: FakeKubelet) -> None:
    """workload= needs pod owners, which only a gateway's pod directory knows: FAILED_PRECONDITION says so."""
    agent = await start_agent("--pod-resources-socket", str(kubelet.socket_path))
    channel = Channel("127.0.0.1", agent.port)
    try:
        with pytest.raises(GRPCError) as raised:
            await keda.ExternalScalerStub(channel).is_active(ref(workload="trainer"))
        assert raised.value.status is Status.FAILED_PRECONDITION
        assert "--pod-directory" in (raised.value.message or "")
    finally:
        channel.close()
