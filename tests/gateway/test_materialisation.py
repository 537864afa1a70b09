"""A gateway makes a GPU's record only where something must read it: every consumer at 200 nodes, counted.

The gateway keeps its agents' snapshots as they arrived and reads most answers from columns (docs/gateway.md,
"Columns, not records"). Answers stay right whether or not a consumer iterates every GPU instead, so the
equivalence tests cannot see it; this test counts the records made while KEDA's calls (push, polls), Explain,
health and a /metrics scrape run against 200 nodes of 8 GPUs, one of them lost on the last node.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections import Counter
from collections.abc import AsyncIterator, Sequence

import aiohttp
import pytest
from grpclib.client import Channel
from grpclib.const import Cardinality
from prometheus_client.parser import text_string_to_metric_families

from gpuscaler.gateway.decoding import SnapshotDecoder
from gpuscaler.gateway.process import Gateway
from gpuscaler.generated import externalscaler as keda
from gpuscaler.generated.gpuscaler import v1 as pb
from gpuscaler.generated.pb2.gpuscaler.v1 import agent_pb2
from gpuscaler.model.aggregation import WindowFunction
from gpuscaler.model.gpu_metrics import Metric
from gpuscaler.model.samples import GpuSample, ReadError, ReadErrorKind, Snapshot
from gpuscaler.model.windows import Windowed, WindowKey, WindowValues
from gpuscaler.server.wire import MAX_EXPLAINED_GPUS, snapshot_to_wire
from tests.builders import decoded, failed_sample, gpu_sample
from tests.gateway.conftest import gateway_settings

NODES, GPUS = 200, 8
LAST = f"node-{NODES - 1:03d}"
# An all-GPU query with the one lost GPU inside maxUnreadable's default (5% of 1,600): a partial answer.
METADATA = {"metric": "gpu_utilization", "aggregation": "sum"}
# Polls do not wait for silence: the nodes stay fresh for the whole test however busy the machine is.
POLL_INTERVAL_SECONDS = 600.0


class NoDiscovery:
    """Lists no agents: the test gives the view its nodes itself, as their subscribers would."""

    async def run(self, listener: object) -> None:
        await asyncio.Event().wait()


@pytest.fixture
async def gateway() -> AsyncIterator[Gateway]:
    """An in-process gateway with no agents of its own; stopped at the end."""
    started = await Gateway.start(
        gateway_settings("--agents", "127.0.0.1:1", "--drain-timeout", "0.5"), discovery=NoDiscovery()
    )
    yield started
    await started.stop()


def node_snapshot(name: str) -> Snapshot:
    """``name``'s tick: 8 busy GPUs; on the last node GPU 7 is lost (no reading, so no column value)."""
    samples = []
    for index in range(GPUS):
        if name == LAST and index == GPUS - 1:
            lost = failed_sample(index, ReadErrorKind.GPU_LOST)
            sample = lost._replace(node=name, gpu=dataclasses.replace(lost.gpu, uuid=f"GPU-{name}-{index}"))
        else:
            sample = gpu_sample(index, util=50.0, node=name, uuid=f"GPU-{name}-{index}")
        samples.append(sample)
    return Snapshot(sequence=1, taken_at=1.0e9, monotonic=0.0, node=name, samples=tuple(samples))


class Counting(SnapshotDecoder):
    """The gateway's decoder, counting the GPU records it makes, by node."""

    def __init__(self, made: Counter[str]) -> None:
        super().__init__()
        self._made = made

    def sample(
        self, gpu: agent_pb2.GpuSample, packed: Sequence[float], unread: tuple[ReadError, ...] = ()
    ) -> GpuSample:
        self._made[gpu.node] += 1
        return super().sample(gpu, packed, unread)


def feed(gateway: Gateway, made: Counter[str]) -> None:
    """Every node's snapshot over the wire and decoded, into the view, as each agent's subscriber puts it."""
    names = [f"node-{n:03d}" for n in range(NODES)]
    gateway.view.set_agents(names)
    now = asyncio.get_running_loop().time()
    for name in names:
        message = snapshot_to_wire(node_snapshot(name), poll_interval_seconds=POLL_INTERVAL_SECONDS)
        received = decoded(message, Counting(made), monotonic=now)
        gateway.view.update(name, received, poll_interval_seconds=POLL_INTERVAL_SECONDS)
    gateway.view.compose()


async def test_every_consumer_makes_records_only_for_what_it_must_read(gateway: Gateway) -> None:
    """KEDA's push stream and polls, the health checks and a /metrics scrape make only the lost GPU's node's
    records (its GPUs have no column to read); Explain adds the rows it lists, never the other 1,300 GPUs."""
    made: Counter[str] = Counter()
    feed(gateway, made)
    assert not made  # decoding makes none
    scaled = keda.ScaledObjectRef(name="trainer", namespace="ml", scaler_metadata=METADATA)
    channel = Channel("127.0.0.1", gateway.port)
    try:
        scaler = keda.ExternalScalerStub(channel)
        path = "/externalscaler.ExternalScaler/StreamIsActive"
        async with channel.request(path, Cardinality.UNARY_STREAM, keda.ScaledObjectRef, keda.IsActiveResponse) as push:
            await push.send_message(scaled, end=True)
            assert (await push.recv_message()) == keda.IsActiveResponse(result=True)
            gateway.view.compose()  # a composition re-evaluates the open stream's query
            assert (await scaler.is_active(scaled)).result
            spec = await scaler.get_metric_spec(scaled)
            request = keda.GetMetricsRequest(scaled_object_ref=scaled, metric_name=spec.metric_specs[0].metric_name)
            for _ in range(3):  # KEDA's polls, within one composition and across two
                answer = await scaler.get_metrics(request)
                assert answer.metric_values[0].metric_value_float == 50.0 * (NODES * GPUS - 1)
                gateway.view.compose()
            assert gateway.evaluator.healthy()
            await push.cancel()
        assert gateway.frontend.metrics is not None
        async with aiohttp.ClientSession() as session:
            url = f"http://127.0.0.1:{gateway.frontend.metrics.port}/metrics"
            async with session.get(url) as response:
                scraped = await response.text()
        partial = {
            sample.labels["left_out"]: sample.value
            for family in text_string_to_metric_families(scraped)
            for sample in family.samples
            if sample.name == "gpuscaler_partial_answers_total"
        }
        assert partial == {"gpus": 4.0, "nodes": 0.0}  # IsActive and the three polls, each seen as partial

        # The lost GPU's node has no column to read: its records, once (kept while its snapshot is the same). Health
        # reads records until it finds a readable GPU: the first node's. No other node's.
        assert made == {LAST: GPUS, "node-000": GPUS}, f"records made on {len(made)} nodes: {sorted(made)[:5]}..."
        before_explain = sum(made.values())

        explanation = await pb.AgentStub(channel).explain(pb.ExplainRequest(scaler_metadata=METADATA))
    finally:
        channel.close()
    assert len(explanation.gpus) + explanation.gpus_omitted == NODES * GPUS
    listed = len(explanation.gpus)
    assert listed == MAX_EXPLAINED_GPUS
    # The rows it lists (the lost GPU first, then the first nodes' GPUs, whole nodes at a time), no more.
    assert sum(made.values()) - before_explain <= listed + GPUS
    assert len(made) <= listed // GPUS + 2


async def test_windows_that_are_filling_cost_keda_no_records_and_explain_names_them(gateway: Gateway) -> None:
    """A windowed query's polls read every node's window as a column, a node whose agent restarted a few seconds
    ago included (a rollout of every node at once must not turn the gateway back to records); Explain makes that
    node's records, which say how much of the window they cover, and names it."""
    window = WindowKey(Metric.GPU_UTILIZATION, 60.0, WindowFunction.AVG)
    restarted = "node-150"  # beyond the rows Explain lists: found all the same
    names = [f"node-{n:03d}" for n in range(NODES)]
    gateway.view.set_agents(names)
    gateway.view.request([window])
    made: Counter[str] = Counter()
    now = asyncio.get_running_loop().time()
    for name in names:
        tick = node_snapshot(name)
        whole = Windowed(50.0, 120) if name != restarted else Windowed(50.0, 6, covered_seconds=3.0)
        values = {
            s.gpu.uuid: whole if s.gpu_utilization_percent is not None else Windowed(None, 0) for s in tick.samples
        }
        message = snapshot_to_wire(
            tick, poll_interval_seconds=POLL_INTERVAL_SECONDS, windows={window: WindowValues(values)}
        )
        received = decoded(message, Counting(made), monotonic=now)
        gateway.view.update(name, received, poll_interval_seconds=POLL_INTERVAL_SECONDS)
    gateway.view.compose()
    metadata = {**METADATA, "window": "60s"}
    scaled = keda.ScaledObjectRef(name="trainer", namespace="ml", scaler_metadata=metadata)
    channel = Channel("127.0.0.1", gateway.port)
    try:
        scaler = keda.ExternalScalerStub(channel)
        spec = await scaler.get_metric_spec(scaled)
        request = keda.GetMetricsRequest(scaled_object_ref=scaled, metric_name=spec.metric_specs[0].metric_name)
        for _ in range(2):
            answer = await scaler.get_metrics(request)
            assert answer.metric_values[0].metric_value_float == 50.0 * (NODES * GPUS - 1)
        assert made == {LAST: GPUS}  # the lost GPU's node only: it has no column to read
        explanation = await pb.AgentStub(channel).explain(pb.ExplainRequest(scaler_metadata=metadata))
    finally:
        channel.close()
    assert (explanation.least_covered_seconds, explanation.gpus_filling) == (3.0, GPUS)
    assert explanation.least_covered_node == restarted
    assert made[restarted] == GPUS
