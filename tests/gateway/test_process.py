"""The gateway in-process over real sockets: agents with fake GPUs and fake kubelets, KEDA's calls to the gateway."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from grpclib.client import Channel
from grpclib.const import Status
from grpclib.exceptions import GRPCError

from gpuscaler.flags import Address
from gpuscaler.gateway.discovery import EndpointsListener
from gpuscaler.gateway.process import Gateway
from gpuscaler.generated.gpuscaler import v1 as pb
from tests.fakes.fake_kubelet import Assignment
from tests.gateway.calls import explain, pushed, ref, value, view_has
from tests.gateway.conftest import StartGateway, StartNode, gateway_settings
from tests.server.test_agent_api import first_snapshot
from tests.waiting import until, until_result


async def test_a_node_wide_query_reads_every_node(start_node: StartNode, start_gateway: StartGateway) -> None:
    """Without a selector, the gateway sums every node's GPUs and the explanation counts the nodes."""
    a, b = await start_node("node-a"), await start_node("node-b")
    a.set(10, 20)
    b.set(30, 40)
    gateway = await start_gateway(a, b)
    await view_has(gateway, 2)
    assert await until_result(lambda: value(gateway), lambda v: v == pytest.approx(100.0)) == pytest.approx(100.0)
    explanation = await explain(gateway)
    assert (explanation.nodes, explanation.nodes_expected, len(explanation.gpus)) == (2, 2, 4)


async def test_workload_values_across_nodes(start_node: StartNode, start_gateway: StartGateway, tmp_path: Path) -> None:
    """A Deployment's replicas on two nodes: avg per pod, summed; another tenant's pod is left out."""
    a, b = await start_node("node-a"), await start_node("node-b")
    a.kubelet.assign([Assignment("ml", "trainer-x-1", (a.uuid(0), a.uuid(1)))])
    b.kubelet.assign([Assignment("ml", "trainer-x-2", (b.uuid(0),)), Assignment("other", "miner", (b.uuid(1),))])
    a.set(90, 50)
    b.set(40, 100)
    directory = tmp_path / "pods.yaml"
    directory.write_text(
        "pods:\n"
        "  - {namespace: ml, pod: trainer-x-1, labels: {app: trainer}, workload: trainer}\n"
        "  - {namespace: ml, pod: trainer-x-2, labels: {app: trainer}, workload: trainer}\n"
        "  - {namespace: other, pod: miner, labels: {app: trainer}, workload: trainer}\n"
    )
    gateway = await start_gateway(a, b, pod_directory=directory)
    await view_has(gateway, 2)
    # trainer-x-1: avg(90, 50) = 70; trainer-x-2: 40; sum 110. "miner" is the same name in another namespace.
    for metadata in ({"workload": "trainer"}, {"podSelector": "app=trainer"}, {"pod": "trainer-x-*"}):

        async def answer(metadata: dict[str, str] = metadata) -> float:
            return await value(gateway, **metadata)

        assert await until_result(answer, lambda v: v == pytest.approx(110.0)) == pytest.approx(110.0)
    explanation = await explain(gateway, workload="trainer")
    assert sorted((p.pod, p.node, p.gpus) for p in explanation.pods) == [
        ("trainer-x-1", "node-a", 2),
        ("trainer-x-2", "node-b", 1),
    ]


async def test_a_silent_agent_is_unknown_not_zero_and_comes_back(
    start_node: StartNode, start_gateway: StartGateway
) -> None:
    """A stopped agent that is still listed makes the sum UNAVAILABLE naming its node; restarted, it is back."""
    a, b = await start_node("node-a"), await start_node("node-b")
    a.set(10, 10)
    b.set(20, 20)
    gateway = await start_gateway(a, b)
    await view_has(gateway, 2)
    port = b.port
    await b.stop()
    await view_has(gateway, 1)  # the bound is max(3 x 0.1 s, 2 s): within the 10 s wait
    with pytest.raises(GRPCError) as raised:
        await value(gateway)
    assert raised.value.status is Status.UNAVAILABLE
    assert "node 'node-b'" in (raised.value.message or "")
    assert "unknown, not 0" in (raised.value.message or "")
    assert await value(gateway, minNodes="1") == pytest.approx(20.0)  # asked for: answer from what is heard
    explanation = await explain(gateway, minNodes="1")
    assert [absent.node for absent in explanation.absent] == ["node-b"]

    again = await start_node("node-b", port=port, kubelet=b.kubelet)
    again.set(20, 20)
    await view_has(gateway, 2)
    assert await until_result(lambda: value(gateway), lambda v: v == pytest.approx(60.0)) == pytest.approx(60.0)


async def test_a_workload_whose_only_node_stops_is_unavailable_not_zero(
    start_node: StartNode, start_gateway: StartGateway
) -> None:
    """The workload's only node stops sending while another is heard: UNAVAILABLE naming it, not 0.0."""
    a, b = await start_node("node-a"), await start_node("node-b")
    b.kubelet.assign([Assignment("ml", "web-1", (b.uuid(0),))])
    b.set(70, 0)
    gateway = await start_gateway(a, b)
    await view_has(gateway, 2)
    assert await until_result(lambda: value(gateway, pod="web-*"), lambda v: v == 70.0) == 70.0
    await b.stop()
    await view_has(gateway, 1)
    with pytest.raises(GRPCError) as raised:
        await value(gateway, pod="web-*")
    assert raised.value.status is Status.UNAVAILABLE
    assert "node 'node-b'" in (raised.value.message or "")
    assert "ml/web-1" in (raised.value.message or "")


async def test_two_agents_claiming_one_node_are_refused(start_node: StartNode, start_gateway: StartGateway) -> None:
    """A second live agent with the first one's node name is refused and named; the sum is not a merge of both."""
    a, twin = await start_node("node-a"), await start_node("node-a")
    a.set(10, 10)
    twin.set(30, 30)
    gateway = await start_gateway(a, twin)

    async def refusal() -> str:
        try:
            await value(gateway)
        except GRPCError as error:
            return error.message or ""
        return ""

    message = await until_result(refusal, lambda m: "reports node 'node-a'" in m)
    assert "two agents need two node names" in message
    # Whichever spoke first is the node; never 80, the two merged.
    assert await until_result(lambda: value(gateway, minNodes="1"), lambda v: v in (20.0, 60.0)) in (20.0, 60.0)
    assert await value(gateway, minNodes="1") in (20.0, 60.0)


async def test_a_windowed_query_at_the_gateway_reads_what_the_agents_reduced(
    start_node: StartNode, start_gateway: StartGateway
) -> None:
    """A window is reduced by each agent over its own history; the gateway sums them and keeps no history."""
    a, b = await start_node("node-a"), await start_node("node-b")
    a.set(10, 20)
    b.set(30, 40)
    gateway = await start_gateway(a, b)
    await view_has(gateway, 2)
    window = {"window": "2s", "windowFunction": "max"}
    assert await until_result(lambda: value(gateway, **window), lambda v: v == pytest.approx(100.0)) == 100.0
    a.set(90, 20)
    assert await until_result(lambda: value(gateway, **window), lambda v: v == pytest.approx(180.0)) == 180.0
    a.set(10, 20)  # the max over 2 s still holds the 90 for a while: the agent's history, not the gateway's
    assert await value(gateway, **window) == pytest.approx(180.0)
    assert len(gateway.view.windows) == 1
    assert all(len(list(gateway.view.newest_first(node))) == 1 for node in ("node-a", "node-b"))


async def test_push_through_the_gateway(start_node: StartNode, start_gateway: StartGateway) -> None:
    """StreamIsActive at the gateway sends the state at once, then each transition an agent reports."""
    a = await start_node("node-a")
    gateway = await start_gateway(a)
    await view_has(gateway, 1)
    async with pushed(gateway, ref(activationThreshold="50")) as seen:
        await until(lambda: seen == [False])
        a.set(80, 0)
        await until(lambda: seen == [False, True])
        a.set(0, 0)
        await until(lambda: seen == [False, True, False])


async def test_a_gateway_refuses_the_node_snapshot_calls_and_names_what_to_call(
    start_node: StartNode, start_gateway: StartGateway
) -> None:
    """GetSnapshot and WatchSnapshots at a gateway are UNIMPLEMENTED, pointing at the agents and Explain."""
    a = await start_node("node-a")
    gateway = await start_gateway(a)
    await view_has(gateway, 1)
    channel = Channel("127.0.0.1", gateway.port)
    try:
        agent_api = pb.AgentStub(channel)
        with pytest.raises(GRPCError) as got:
            await agent_api.get_snapshot(pb.GetSnapshotRequest(), timeout=5)
        with pytest.raises(GRPCError) as watched:
            await first_snapshot(channel, pb.WatchSnapshotsRequest())
    finally:
        channel.close()
    for raised, rpc in ((got, "GetSnapshot"), (watched, "WatchSnapshots")):
        assert raised.value.status is Status.UNIMPLEMENTED
        assert f"call {rpc} at an agent" in str(raised.value.message)
        assert "Explain" in str(raised.value.message)
    assert (await explain(gateway)).nodes == 1  # the Agent service's Explain still answers


async def test_gpu_index_is_invalid_at_the_gateway(start_node: StartNode, start_gateway: StartGateway) -> None:
    """gpuIndex is INVALID_ARGUMENT at the gateway; gpuUUID selects one GPU of the cluster."""
    a, b = await start_node("node-a"), await start_node("node-b")
    b.set(0, 33)
    gateway = await start_gateway(a, b)
    await view_has(gateway, 2)
    with pytest.raises(GRPCError) as raised:
        await value(gateway, gpuIndex="0")
    assert raised.value.status is Status.INVALID_ARGUMENT
    got = await until_result(lambda: value(gateway, gpuUUID=b.uuid(1)), lambda v: v == pytest.approx(33.0))
    assert got == pytest.approx(33.0)


async def test_a_workload_scaling_out_changes_the_answer(start_node: StartNode, start_gateway: StartGateway) -> None:
    """When the kubelet assigns GPUs to new replicas, the workload's value follows within one refresh."""
    a = await start_node("node-a", gpus=3)
    a.set(50, 50, 50)
    a.kubelet.assign([Assignment("ml", "web-1", (a.uuid(0),))])
    gateway = await start_gateway(a)
    await view_has(gateway, 1)
    assert await until_result(lambda: value(gateway, pod="web-*"), lambda v: v == 50.0) == 50.0
    a.kubelet.assign([Assignment("ml", f"web-{i}", (a.uuid(i),)) for i in range(3)])
    assert await until_result(lambda: value(gateway, pod="web-*"), lambda v: v == 150.0) == 150.0


async def test_health_follows_the_view(start_node: StartNode, start_gateway: StartGateway) -> None:
    """The gateway is NOT_SERVING until an agent's GPUs are in the view, and again once none are."""
    a = await start_node("node-a")
    gateway = await start_gateway(a)
    await until(lambda: gateway.frontend.serving, timeout=10)
    await a.stop()
    await until(lambda: not gateway.frontend.serving, timeout=10)


class ListedAgents:
    """A discovery whose answer the test changes, as DNS records change."""

    def __init__(self) -> None:
        self.changes: asyncio.Queue[frozenset[Address]] = asyncio.Queue()

    async def run(self, listener: EndpointsListener) -> None:
        while True:
            listener(await self.changes.get())


async def test_agents_that_discovery_drops_or_adds_are_unsubscribed_or_subscribed(start_node: StartNode) -> None:
    """A new record starts a subscriber; a removed one stops it, and the known-node count follows."""
    a, b = await start_node("node-a"), await start_node("node-b")
    discovery = ListedAgents()
    gateway = await Gateway.start(gateway_settings("--agents", "127.0.0.1:1"), discovery=discovery)
    try:
        both = frozenset({Address("127.0.0.1", a.port), Address("127.0.0.1", b.port)})
        discovery.changes.put_nowait(both)
        await view_has(gateway, 2)
        discovery.changes.put_nowait(frozenset({Address("127.0.0.1", a.port)}))
        await until(lambda: set(gateway.subscribers) == {Address("127.0.0.1", a.port)})
        assert gateway.view.agents == 1
        await until(lambda: set(gateway.view.node_names) == {"node-a"})
    finally:
        await gateway.stop()


async def test_an_agent_removed_from_the_agents_file_leaves_every_answer(start_node: StartNode, tmp_path: Path) -> None:
    """Rewriting --agents-file without a silent agent is its node leaving on purpose: the sum is the others'."""
    a, b = await start_node("node-a"), await start_node("node-b")
    a.set(10, 10)
    b.set(20, 20)
    listed = tmp_path / "agents.txt"
    listed.write_text(f"127.0.0.1:{a.port}\n127.0.0.1:{b.port}\n")
    gateway = await Gateway.start(gateway_settings("--agents-file", str(listed), "--resolve-interval", "0.5"))
    try:
        await view_has(gateway, 2)
        assert await until_result(lambda: value(gateway), lambda v: v == pytest.approx(60.0)) == pytest.approx(60.0)
        await b.stop()

        async def answer() -> float | str:
            try:
                return await value(gateway)
            except GRPCError as error:
                return error.status.name

        assert await until_result(answer, lambda got: got == "UNAVAILABLE", timeout=10) == "UNAVAILABLE"
        listed.write_text(f"127.0.0.1:{a.port}\n")
        assert await until_result(answer, lambda got: got == pytest.approx(20.0), timeout=10) == pytest.approx(20.0)
    finally:
        await gateway.stop()


async def test_an_agent_whose_name_does_not_resolve_is_unavailable_saying_so_in_words(start_node: StartNode) -> None:
    """An agent listed by a name DNS does not know (a stopped container's, under compose) makes the sum UNAVAILABLE,
    and the reason says which name could not be resolved, in words, not as a Python exception's repr."""
    a = await start_node("node-a")
    gateway = await Gateway.start(gateway_settings("--agents", f"127.0.0.1:{a.port},gpu-node-b.invalid:6000"))
    try:
        await view_has(gateway, 1)

        async def reason() -> str:
            try:
                await value(gateway)
            except GRPCError as error:
                return error.message or ""
            return ""

        message = await until_result(reason, lambda text: "cannot resolve" in text, timeout=30)
        assert "cannot resolve gpu-node-b.invalid: " in message, message
        assert "(DNS)" in message, message
        assert "gaierror" not in message, message
    finally:
        await gateway.stop()


async def test_dns_discovery_resolves_a_name() -> None:
    """--agents-dns resolves the name with the loop's resolver, on the given port."""
    from gpuscaler.gateway.discovery import DnsAgents

    found = await DnsAgents("127.0.0.1", 6000).resolve()
    assert found == frozenset({Address("127.0.0.1", 6000)})


async def test_gpuscaler_query_explains_a_pod_query_in_the_namespace_it_asks_for(
    start_node: StartNode, start_gateway: StartGateway
) -> None:
    """`gpuscaler query pod=...` sends the same namespace to Explain as to KEDA's calls, so both agree."""
    from gpuscaler.client.explain import collect

    a = await start_node("node-a")
    a.kubelet.assign([Assignment("default", "web-1", (a.uuid(0),))])
    a.set(40, 0)
    gateway = await start_gateway(a)
    await view_has(gateway, 1)
    channel = Channel("127.0.0.1", gateway.port)
    try:

        async def report_value() -> float:
            report = await collect(channel, {"pod": "web-*"}, stream_wait_seconds=0.5)
            return (
                float(report.get_metrics.fields["metricValues"][0]["metricValueFloat"]) if report.get_metrics.ok else -1
            )

        await until_result(report_value, lambda v: v == pytest.approx(40.0))
        report = await collect(channel, {"pod": "web-*"}, stream_wait_seconds=0.5)
        assert report.explanation is not None
        assert [p["pod"] for p in report.explanation["pods"]] == ["web-1"]
    finally:
        channel.close()
