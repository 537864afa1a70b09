"""Every case of the prior art's eleven e2e tests, against the real process, with both clients.

The prior art starts a server per case with mock devices; here one agent per test runs four fake GPUs
with fixed values from a scenario file, and cases pick their devices with ``gpuIndex``. Where our
defaults differ from the prior art's (sum, not max; target 70, not 80) the case states ours.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from grpclib.health.v1.health_grpc import HealthStub
from grpclib.health.v1.health_pb2 import HealthCheckRequest, HealthCheckResponse

from e2e.conftest import StartAgent
from e2e.support.agent import AgentProcess
from e2e.support.clients import GrpclibScaler, Metadata, RpcFailure, ScalerClient, refusal
from e2e.support.control import Control, write_scenario

GPUS: dict[int, dict[str, float]] = {
    0: {
        "gpu_utilization": 75,
        "memory_utilization": 70,
        "memory_used_percent": 75,
        "temperature": 72,
        "power_draw": 250,
    },
    1: {
        "gpu_utilization": 5,
        "memory_utilization": 10,
        "memory_used_percent": 1.25,
        "temperature": 41,
        "power_draw": 90,
    },
    2: {
        "gpu_utilization": 90,
        "memory_utilization": 80,
        "memory_used_percent": 85,
        "temperature": 65,
        "power_draw": 300,
    },
    3: {
        "gpu_utilization": 40,
        "memory_utilization": 20,
        "memory_used_percent": 50,
        "temperature": 55,
        "power_draw": 200,
    },
}
POWER_LIMIT_WATTS = 400.0
UTILIZATION = [GPUS[i]["gpu_utilization"] for i in range(4)]  # 75, 5, 90, 40


@pytest.fixture
async def agent(start_agent: StartAgent, tmp_path: Path) -> AgentProcess:
    """Four fake GPUs with fixed, different values from the first tick on."""
    scenario = write_scenario(tmp_path / "gpus.json", GPUS, power_limit_watts=POWER_LIMIT_WATTS)
    return await start_agent("--fake-scenario", str(scenario), gpus=4)


async def health_status(client: ScalerClient, agent: AgentProcess) -> str:
    """The overall health status, asked through the client's own library."""
    if isinstance(client, GrpclibScaler):
        response = await HealthStub(client.channel).Check(HealthCheckRequest(), timeout=5)
        assert response is not None
        return str(HealthCheckResponse.ServingStatus.Name(response.status))
    return agent.health()


async def test_health_is_serving(client: ScalerClient, agent: AgentProcess) -> None:
    """grpc.health.v1 Check reports SERVING once the agent has sampled its GPUs."""
    assert await health_status(client, agent) == "SERVING"


@pytest.mark.parametrize(
    ("metadata", "active"),
    [
        pytest.param({"gpuIndex": "0"}, True, id="above-default-activation"),
        pytest.param({"gpuIndex": "1", "activationThreshold": "10"}, False, id="below-activation"),
        pytest.param({"gpuIndex": "1", "activationThreshold": "4.9"}, True, id="just-above-activation"),
        pytest.param({"gpuIndex": "1", "activationThreshold": "5"}, False, id="equal-is-not-above"),
        pytest.param({"profile": "vllm-inference", "gpuIndex": "0"}, True, id="profile"),
        pytest.param({"gpuIndex": "1,2", "aggregation": "max", "activationThreshold": "50"}, True, id="multi-gpu-max"),
        pytest.param({"gpuIndex": "1,2", "aggregation": "min", "activationThreshold": "50"}, False, id="multi-gpu-min"),
        pytest.param({"activationThreshold": "209"}, True, id="all-gpus-sum"),
        pytest.param({"activationThreshold": "210"}, False, id="all-gpus-sum-equal"),
    ],
)
async def test_is_active(client: ScalerClient, metadata: Metadata, active: bool) -> None:
    """IsActive is true exactly when the aggregated value is above activationThreshold."""
    assert await client.is_active(metadata) is active


@pytest.mark.parametrize(
    ("metadata", "name", "target"),
    [
        pytest.param({}, "gpuscaler-gpu_utilization-sum", 70.0, id="defaults"),
        pytest.param({"profile": "vllm-inference"}, "gpuscaler-gpu_utilization-sum-avg30s", 70.0, id="profile"),
        pytest.param({"profile": "training"}, "gpuscaler-gpu_utilization-sum-avg2m", 90.0, id="profile-training"),
        pytest.param({"targetValue": "60"}, "gpuscaler-gpu_utilization-sum", 60.0, id="targetValue"),
        pytest.param({"targetValue": "60.4", "metricName": "my-gpus"}, "my-gpus", 60.4, id="targetValue-float"),
        pytest.param({"metric": "temperature"}, "gpuscaler-temperature-max", 80.0, id="metric-defaults"),
        # The largest target KEDA can hold as int64 thousandths; above it is refused (test_metadata.py).
        pytest.param({"targetValue": "9e15"}, "gpuscaler-gpu_utilization-sum", 9e15, id="target-at-kedas-bound"),
    ],
)
async def test_get_metric_spec(client: ScalerClient, metadata: Metadata, name: str, target: float) -> None:
    """GetMetricSpec names the metric and sets the target in both the float and the int field."""
    [spec] = await client.get_metric_spec(metadata)
    assert spec.metric_name == name
    assert spec.target_size_float == pytest.approx(target)
    assert spec.target_size == min(math.floor(target + 0.5), 2**63 - 1)  # int64 on the wire


@pytest.mark.parametrize(
    ("metadata", "value"),
    [
        pytest.param({"gpuIndex": "0"}, 75.0, id="gpu_utilization"),
        pytest.param({"gpuIndex": "0", "metric": "memory_utilization"}, 70.0, id="memory_utilization"),
        pytest.param({"gpuIndex": "0", "metricType": "memory_used_percent"}, 75.0, id="memory_used_percent"),
        pytest.param({"gpuIndex": "0", "metricType": "temperature"}, 72.0, id="temperature"),
        pytest.param({"gpuIndex": "0", "metricType": "power_draw"}, 250.0, id="power_draw"),
        pytest.param({"gpuIndex": "0", "metric": "power_percent"}, 62.5, id="power_percent"),
        pytest.param({"gpuIndex": "2"}, 90.0, id="gpuIndex"),
        pytest.param({"gpuIndex": "0,2"}, 165.0, id="gpuIndex-list"),
        pytest.param({"aggregation": "avg"}, sum(UTILIZATION) / 4, id="avg"),
        pytest.param({"aggregation": "min"}, 5.0, id="min"),
        pytest.param({"aggregation": "max"}, 90.0, id="max"),
        pytest.param({"aggregation": "sum"}, float(sum(UTILIZATION)), id="sum"),
        pytest.param({}, float(sum(UTILIZATION)), id="default-is-sum"),
        pytest.param({"metric": "temperature"}, 72.0, id="temperature-default-is-max"),
        pytest.param({"aggregation": "median"}, 57.5, id="median"),
    ],
)
async def test_get_metrics(client: ScalerClient, metadata: Metadata, value: float) -> None:
    """GetMetrics, called with the name GetMetricSpec gave, returns the selected metric, aggregated."""
    [spec] = await client.get_metric_spec(metadata)
    [answer] = await client.get_metrics(metadata, spec.metric_name)
    assert answer.metric_name == spec.metric_name
    assert answer.metric_value_float == pytest.approx(value)
    assert answer.metric_value == math.floor(value + 0.5)  # the int field rounds half up: 62.5 -> 63


async def test_scale_out_then_in(client: ScalerClient, control: Control) -> None:
    """Busy GPUs give active and a value above target; idle GPUs then give inactive and a value below it."""
    metadata = {"aggregation": "max", "activationThreshold": "10", "targetValue": "80"}
    await control.set_and_wait(None, {"gpu_utilization": 95})
    assert await client.is_active(metadata) is True
    assert await client.metric_value(metadata) > 80

    await control.set_and_wait(None, {"gpu_utilization": 4})
    assert await client.is_active(metadata) is False
    assert await client.metric_value(metadata) < 80


@pytest.mark.parametrize(
    ("profile", "target"),
    [("vllm-inference", 70.0), ("triton-inference", 75.0), ("training", 90.0), ("batch", 85.0)],
)
async def test_profile_through_every_rpc(client: ScalerClient, profile: str, target: float) -> None:
    """Each profile answers all four RPCs: one spec, one value (the windowed sum), active, and a first push."""
    metadata = {"profile": profile}
    [spec] = await client.get_metric_spec(metadata)
    assert spec.target_size_float == target
    [value] = await client.get_metrics(metadata, spec.metric_name)
    assert value.metric_value_float == pytest.approx(sum(UTILIZATION))  # constant values: any window's avg or max
    assert await client.is_active(metadata) is True
    stream = client.stream_is_active(metadata)
    try:
        assert await stream.next(timeout=5) is True
    finally:
        await stream.close()


@pytest.mark.parametrize(
    ("metadata", "names"),
    [
        pytest.param({"profile": "doesnt-exist"}, ["profile", "'doesnt-exist'", "vllm-inference"], id="profile"),
        pytest.param({"targetValue": "abc"}, ["targetValue", "'abc'"], id="targetValue-text"),
        pytest.param({"targetValue": "0"}, ["targetValue", ">= 0.001"], id="targetValue-zero"),
        pytest.param({"targetValue": "NaN"}, ["targetValue", "finite"], id="targetValue-nan"),
        pytest.param({"activationThreshold": "-1"}, ["activationThreshold", ">= 0"], id="activation-negative"),
        pytest.param({"gpuIndex": "xyz"}, ["gpuIndex", "'xyz'"], id="gpuIndex-text"),
        pytest.param({"aggregation": "mean"}, ["aggregation", "'mean'", "avg"], id="aggregation"),
        pytest.param({"activationTreshold": "5"}, ["activationTreshold", "activationThreshold"], id="typo"),
        pytest.param({"window": "5 parsecs"}, ["window", "'5 parsecs'"], id="window"),
        pytest.param({"metric": "fan_speed"}, ["metric", "'fan_speed'", "gpu_utilization"], id="metric"),
    ],
)
async def test_bad_metadata(client: ScalerClient, metadata: Metadata, names: list[str]) -> None:
    """Every RPC refuses bad metadata with INVALID_ARGUMENT and a message naming the key and the value."""
    refusals = {
        "IsActive": await refusal(client.is_active(metadata)),
        "GetMetricSpec": await refusal(client.get_metric_spec(metadata)),
        "GetMetrics": await refusal(client.get_metrics(metadata, "gpuscaler-gpu_utilization-sum")),
    }
    for rpc, refused in refusals.items():
        assert refused.code == "INVALID_ARGUMENT", (rpc, refused)
        for name in names:
            assert name in refused.message, (rpc, refused.message)

    stream = client.stream_is_active(metadata)
    with pytest.raises(RpcFailure) as raised:
        await stream.next(timeout=5)
    assert raised.value.code == "INVALID_ARGUMENT"
    assert all(name in raised.value.message for name in names), raised.value.message


async def test_stream_is_active_sends_the_state(client: ScalerClient) -> None:
    """StreamIsActive's first message is the current state: true over busy GPUs, false over an idle one."""
    busy = client.stream_is_active({"gpuIndex": "0"})
    idle = client.stream_is_active({"gpuIndex": "1", "activationThreshold": "10"})
    try:
        assert await busy.next(timeout=5) is True
        assert await idle.next(timeout=5) is False
    finally:
        await busy.close()
        await idle.close()


async def test_gpu_index_out_of_range(client: ScalerClient) -> None:
    """GetMetrics and IsActive refuse a gpuIndex the node lacks with INVALID_ARGUMENT, naming it and those present."""
    metadata = {"gpuIndex": "99"}
    [spec] = await client.get_metric_spec(metadata)  # the spec needs no GPU: it names what will be read
    for refused in (
        await refusal(client.get_metrics(metadata, spec.metric_name)),
        await refusal(client.is_active(metadata)),
    ):
        assert refused.code == "INVALID_ARGUMENT", refused
        assert "gpuIndex 99" in refused.message
        assert "0, 1, 2, 3" in refused.message


async def test_stream_over_gpu_index_out_of_range_is_refused(client: ScalerClient) -> None:
    """StreamIsActive with a gpuIndex the node lacks ends with INVALID_ARGUMENT naming the index, as IsActive does."""
    stream = client.stream_is_active({"gpuIndex": "99"})
    try:
        with pytest.raises(RpcFailure) as raised:
            await stream.next(timeout=3)
        assert raised.value.code == "INVALID_ARGUMENT"
        assert "gpuIndex 99" in raised.value.message
    finally:
        await stream.close()
