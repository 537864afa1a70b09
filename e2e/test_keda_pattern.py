"""KEDA's own call pattern, and the replica counts an HPA would compute from the answers.

Every pollingInterval KEDA calls GetMetricSpec, then GetMetrics with the spec's name (the HPA's
``s0-`` prefix stripped), then IsActive, over one connection. The HPA arithmetic here is written out
from kubernetes' replica_calculator.go, independently of ``gpuscaler.client.hpa``.
"""

from __future__ import annotations

import math

import pytest

from e2e.conftest import StartAgent
from e2e.support.clients import ClientKind, Metadata, ScalerClient, connect
from e2e.support.control import Control
from e2e.support.keda_grpcio import KedaProto

HPA_TOLERANCE = 0.1
# What KEDA forwards besides the trigger's own keys.
KEDA_OWN_KEYS = {"scalerAddress": "gpuscaler.gpuscaler.svc:6000"}


def average_value_replicas(value: float, target: float, current: int) -> int:
    """AverageValue: desired = ceil(value / target), unless usage is within 10% of the target."""
    ratio = value / (target * current)
    return current if abs(ratio - 1) <= HPA_TOLERANCE else math.ceil(value / target)


def value_replicas(value: float, target: float, current: int) -> int:
    """Value: desired = ceil(current * value / target), unless usage is within 10% of the target."""
    ratio = value / target
    return current if abs(ratio - 1) <= HPA_TOLERANCE else math.ceil(current * ratio)


async def keda_round(client: ScalerClient, metadata: Metadata) -> tuple[float, int, float, int, bool]:
    """One polling round as KEDA makes it: (target float, target int, value float, value int, active)."""
    [spec] = await client.get_metric_spec(metadata)
    [value] = await client.get_metrics(metadata, spec.metric_name)
    active = await client.is_active(metadata)
    return spec.target_size_float, spec.target_size, value.metric_value_float, value.metric_value, active


# utilization on every GPU -> replicas an HPA computes with one replica per GPU now, for 1, 4 and 8 GPUs.
AVERAGE_VALUE_REPLICAS = {90.0: (2, 6, 11), 33.3: (1, 2, 4), 70.0: (1, 4, 8), 0.0: (0, 0, 0)}  # sum, target 70
VALUE_REPLICAS = {90.0: (2, 6, 12), 33.3: (1, 3, 5), 70.0: (2, 5, 10), 0.0: (0, 0, 0)}  # avg, target 60


@pytest.mark.parametrize("gpus", [1, 4, 8])
@pytest.mark.parametrize("kind", ["grpclib", "grpcio"])
async def test_keda_rounds_give_the_hpa_its_replicas(
    start_agent: StartAgent, keda_proto: KedaProto, gpus: int, kind: ClientKind
) -> None:
    """Rounds of spec, metrics, active give ceil(sum/target) for AverageValue and ceil(n*avg/target) for Value."""
    agent = await start_agent(gpus=gpus)
    client = await connect(kind, agent, keda_proto)
    column = (1, 4, 8).index(gpus)
    try:
        async with Control(agent) as control:
            average_value = {**KEDA_OWN_KEYS, "metric": "gpu_utilization", "targetValue": "70"}
            value = {**KEDA_OWN_KEYS, "metric": "gpu_utilization", "aggregation": "avg", "targetValue": "60"}
            for utilization in (90.0, 33.3, 70.0, 0.0):
                await control.set_and_wait(None, {"gpu_utilization": utilization})
                for _ in range(2):  # KEDA repeats the round every pollingInterval; the answers must not drift
                    target, target_int, total, total_int, active = await keda_round(client, average_value)
                    assert (target, target_int) == (70.0, 70)
                    assert total == pytest.approx(gpus * utilization)
                    assert total_int == math.floor(gpus * utilization + 0.5)  # KEDA before 2.17 reads the int
                    assert active is (utilization > 5)
                    replicas = average_value_replicas(total, target, current=gpus)
                    assert replicas == AVERAGE_VALUE_REPLICAS[utilization][column], utilization

                    target, target_int, mean, mean_int, _ = await keda_round(client, value)
                    assert (target, target_int) == (60.0, 60)
                    assert mean == pytest.approx(utilization)
                    assert mean_int == math.floor(utilization + 0.5)
                    assert value_replicas(mean, target, current=gpus) == VALUE_REPLICAS[utilization][column]
    finally:
        await client.close()


@pytest.mark.parametrize(("gpus", "replicas"), [(1, 2), (4, 6), (8, 11)])
async def test_sum_scales_past_the_max_cap(
    start_agent: StartAgent, keda_proto: KedaProto, gpus: int, replicas: int
) -> None:
    """At 90% on every GPU the default sum asks for ceil(90n/70) replicas; the prior art's max is stuck at 2."""
    agent = await start_agent(gpus=gpus)
    client = await connect("grpcio", agent, keda_proto)
    try:
        async with Control(agent) as control:
            await control.set_and_wait(None, {"gpu_utilization": 90})
        total = await client.metric_value({})
        assert average_value_replicas(total, 70, current=1) == replicas
        highest = await client.metric_value({"aggregation": "max", "targetValue": "80"})
        assert average_value_replicas(highest, 80, current=1) == 2
    finally:
        await client.close()


async def test_keda_sample_scaler_replica_counts(start_agent: StartAgent, keda_proto: KedaProto) -> None:
    """KEDA's e2e numbers hold: 10 on target 10 -> 1, 20 -> 2, 22.222 on 6.111 -> 4 (KEDA caps it at 3), 0 -> off."""
    agent = await start_agent(gpus=1)
    client = await connect("grpcio", agent, keda_proto)
    try:
        async with Control(agent) as control:
            for value, target, replicas in ((10.0, "10", 1), (20.0, "10", 2), (22.222, "6.111", 4)):
                await control.set_and_wait(0, {"gpu_utilization": value})
                metadata = {"targetValue": target}
                [spec] = await client.get_metric_spec(metadata)
                total = await client.metric_value(metadata)
                assert total == pytest.approx(value)
                assert average_value_replicas(total, spec.target_size_float, current=1) == replicas
            await control.set_and_wait(0, {"gpu_utilization": 0})
            assert await client.is_active({"targetValue": "10"}) is False
            assert await client.metric_value({"targetValue": "10"}) == 0
    finally:
        await client.close()
