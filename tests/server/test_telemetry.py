"""Prometheus /metrics, scraped over HTTP and parsed with the Prometheus client's own parser."""

from __future__ import annotations

import gc
from collections.abc import AsyncIterator

import aiohttp
import pytest
from grpclib.client import Channel
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from gpuscaler.agent.collectors.fake import Failure, FakeCollector
from gpuscaler.agent.collectors.nvml import NvmlCollector
from gpuscaler.agent.process import Agent
from gpuscaler.generated.externalscaler import ExternalScalerStub, GetMetricsRequest, ScaledObjectRef
from gpuscaler.model.gpu_metrics import Metric
from gpuscaler.server.telemetry import ServerTelemetry
from tests.conftest import StartAgent, serve_settings
from tests.fakes.fake_nvml import NOT_SUPPORTED, FakeDevice, FakeNvml
from tests.server.test_external_scaler import next_tick
from tests.waiting import until, until_result


async def scrape(agent: Agent) -> dict[str, list[Sample]]:
    """Every sample on the agent's /metrics, by series name; the scrape must answer 200."""
    assert agent.frontend.metrics is not None
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"http://127.0.0.1:{agent.frontend.metrics.port}/metrics") as response,
    ):
        assert response.status == 200
        text = await response.text()
    series: dict[str, list[Sample]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            series.setdefault(sample.name, []).append(sample)
    return series


@pytest.fixture
async def nvml_agent() -> AsyncIterator[tuple[Agent, FakeNvml]]:
    """An agent whose NVML collector reads two fake NVML GPUs, one without power readings."""
    nvml = FakeNvml(
        [
            FakeDevice("GPU-one", power_mw=123_456),
            FakeDevice("GPU-two", errors={"nvmlDeviceGetPowerUsage": NOT_SUPPORTED}),
        ]
    )
    agent = await Agent.start(serve_settings("--poll-interval", "0.1"), NvmlCollector(node="node-a", nvml=nvml))
    yield agent, nvml
    await agent.stop()


async def test_gpu_series_have_labels_and_base_units(nvml_agent: tuple[Agent, FakeNvml]) -> None:
    """Each GPU value is a series in base units with node, gpu, uuid and model labels; absent stays absent."""
    agent, _ = nvml_agent
    series = await scrape(agent)

    [utilisation] = [s for s in series["gpuscaler_gpu_utilization_ratio"] if s.labels["uuid"] == "GPU-one"]
    assert utilisation.labels == {
        "node": "node-a",
        "gpu": "0",
        "uuid": "GPU-one",
        "model_name": "NVIDIA H100 80GB HBM3",
        "mig_parent_uuid": "",
    }
    assert utilisation.value == pytest.approx(0.40)
    assert {s.labels["uuid"]: s.value for s in series["gpuscaler_gpu_power_draw_watts"]} == {"GPU-one": 123.456}
    assert {s.labels["uuid"] for s in series["gpuscaler_gpu_memory_used_bytes"]} == {"GPU-one", "GPU-two"}
    assert series["gpuscaler_gpu_memory_used_bytes"][0].value == 40 * 1024**3
    assert {s.value for s in series["gpuscaler_gpu_temperature_celsius"]} == {55.0}
    assert {s.value for s in series["gpuscaler_gpu_up"]} == {1.0}
    assert 0 <= series["gpuscaler_sample_age_seconds"][0].value < 2


async def test_energy_is_a_counter_and_gpm_values_are_ratios(nvml_agent: tuple[Agent, FakeNvml]) -> None:
    """The energy counter is a Prometheus counter in joules; GPM metrics are 0-1 ratios and NVLink traffic bytes a
    second once two ticks are in."""
    agent, _ = nvml_agent
    await next_tick(agent)
    assert agent.frontend.metrics is not None
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"http://127.0.0.1:{agent.frontend.metrics.port}/metrics") as response,
    ):
        families = {family.name: family for family in text_string_to_metric_families(await response.text())}
    energy = families["gpuscaler_gpu_energy_joules"]
    assert energy.type == "counter"
    assert {s.labels["uuid"]: s.value for s in energy.samples if s.name.endswith("_total")} == {
        "GPU-one": 123_456.789,
        "GPU-two": 123_456.789,
    }
    assert {s.value for s in families["gpuscaler_gpu_sm_active_ratio"].samples} == {0.355}
    assert {s.value for s in families["gpuscaler_gpu_dram_bandwidth_ratio"].samples} == {0.48}
    # GPM's 50000 MiB/s of NVLink TX, in bytes a second.
    assert [s.value for s in families["gpuscaler_gpu_nvlink_tx_bytes_per_second"].samples] == pytest.approx(
        [50000 * 1024**2] * 2
    )


async def test_nvml_calls_are_timed_and_errors_counted(nvml_agent: tuple[Agent, FakeNvml]) -> None:
    """NVML call durations are a histogram by call; failures count by call and NVML return code."""
    agent, _ = nvml_agent
    series = await scrape(agent)
    counts = {s.labels["call"]: s.value for s in series["gpuscaler_nvml_call_duration_seconds_count"]}
    assert counts["nvmlDeviceGetUtilizationRates"] >= 2
    errors = {(s.labels["call"], s.labels["code"]): s.value for s in series["gpuscaler_nvml_errors_total"]}
    assert errors[("nvmlDeviceGetPowerUsage", "3")] >= 1
    assert ("nvmlDeviceGetUtilizationRates", "3") not in errors


async def test_vanished_gpu_series_disappear(nvml_agent: tuple[Agent, FakeNvml]) -> None:
    """A GPU NVML no longer lists loses every series once the agent enumerates again."""
    agent, nvml = nvml_agent
    nvml.devices.pop(1)
    await agent.poller.rediscover()
    await next_tick(agent)
    series = await scrape(agent)
    for name in ("gpuscaler_gpu_up", "gpuscaler_gpu_memory_used_bytes", "gpuscaler_gpu_utilization_ratio"):
        assert {s.labels["uuid"] for s in series[name]} == {"GPU-one"}, name


async def test_agent_series_count_rpcs_streams_and_transitions(start_agent: StartAgent) -> None:
    """RPCs count by method and code, open streams and distinct queries are gauges, transitions count."""
    agent = await start_agent("--poll-interval", "0.1")
    collector = agent.collector
    assert isinstance(collector, FakeCollector)
    channel = Channel("127.0.0.1", agent.port)
    stub = ExternalScalerStub(channel)
    ref = ScaledObjectRef(name="a", namespace="b", scaler_metadata={"gpuIndex": "0"})
    await stub.get_metrics(GetMetricsRequest(scaled_object_ref=ref, metric_name="gpuscaler-gpu_utilization-sum-gpu0"))
    stream = stub.stream_is_active(ref)
    first = await anext(aiter(stream))
    assert first.result is False
    collector.set_values(0, {Metric.GPU_UTILIZATION: 90.0})
    second = await anext(aiter(stream))
    assert second.result is True

    series = await scrape(agent)
    handled = {(s.labels["method"], s.labels["code"]): s.value for s in series["gpuscaler_rpc_handled_total"]}
    assert handled[("/externalscaler.ExternalScaler/GetMetrics", "OK")] == 1
    in_flight = {s.labels["method"]: s.value for s in series["gpuscaler_rpc_in_flight"]}
    assert in_flight["/externalscaler.ExternalScaler/StreamIsActive"] == 1
    assert series["gpuscaler_stream_distinct_queries"][0].value == 1
    transitions = {s.labels["direction"]: s.value for s in series["gpuscaler_activation_transitions_total"]}
    assert transitions["activate"] >= 1
    assert series["gpuscaler_rpc_duration_seconds_count"][0].value >= 1
    assert series["gpuscaler_poll_duration_seconds_count"][0].value >= 1
    assert "gpuscaler_poll_lag_seconds" in series

    await stream.aclose()  # type: ignore[attr-defined]
    channel.close()
    await until(lambda: agent.frontend.tracker.in_flight == 0)
    series = await scrape(agent)
    codes = {s.labels["code"] for s in series["gpuscaler_rpc_handled_total"] if "StreamIsActive" in s.labels["method"]}
    assert codes == {"CANCELLED"}  # KEDA hanging up is not an error


async def test_lost_fake_gpu_reads_down(start_agent: StartAgent) -> None:
    """A GPU whose reads fail is gpuscaler_gpu_up 0 and has no value series, instead of zeros."""
    agent = await start_agent("--poll-interval", "0.1")
    assert isinstance(agent.collector, FakeCollector)
    agent.collector.fail(1, Failure.LOST)
    await next_tick(agent)
    series = await scrape(agent)
    up = {s.labels["gpu"]: s.value for s in series["gpuscaler_gpu_up"]}
    assert up == {"0": 1.0, "1": 0.0, "2": 1.0, "3": 1.0}
    assert "GPU-fake-test-node-1" not in {s.labels["uuid"] for s in series["gpuscaler_gpu_temperature_celsius"]}


async def test_an_answer_without_a_lost_gpu_is_counted_and_logged_once(
    start_agent: StartAgent, capfd: pytest.CaptureFixture[str]
) -> None:
    """An all-GPU answer that leaves out a lost GPU (within maxUnreadable) counts in gpuscaler_partial_answers_total,
    logged on change."""
    agent = await start_agent("--poll-interval", "0.1")
    assert isinstance(agent.collector, FakeCollector)
    agent.collector.fail(2, Failure.LOST)
    await next_tick(agent)
    channel = Channel("127.0.0.1", agent.port)
    stub = ExternalScalerStub(channel)
    ref = ScaledObjectRef(name="a", namespace="b", scaler_metadata={"maxUnreadable": "1"})
    try:
        for _ in range(3):
            await stub.get_metrics(
                GetMetricsRequest(scaled_object_ref=ref, metric_name="gpuscaler-gpu_utilization-sum")
            )
    finally:
        channel.close()
    series = await scrape(agent)
    partial = {s.labels["left_out"]: s.value for s in series["gpuscaler_partial_answers_total"]}
    assert partial == {"gpus": 3.0, "nodes": 0.0}
    logged = [line for line in capfd.readouterr().err.splitlines() if "answer_leaves_out" in line]
    assert len(logged) == 1
    assert "GPU 2 (GPU-fake-test-node-2)" in logged[0]


async def test_healthz_follows_the_grpc_health(start_agent: StartAgent) -> None:
    """/healthz is 200 while samples are fresh and 503 once every GPU's reads hang, like gRPC health."""
    agent = await start_agent("--poll-interval", "0.1")
    assert agent.frontend.metrics is not None
    assert isinstance(agent.collector, FakeCollector)
    url = f"http://127.0.0.1:{agent.frontend.metrics.port}/healthz"

    async def status() -> int:
        async with aiohttp.ClientSession() as session, session.get(url) as response:
            return response.status

    assert await status() == 200
    for index in range(4):
        agent.collector.fail(index, Failure.TIMEOUT)
    await until_result(status, lambda code: code == 503)
    agent.collector.heal(None)
    await until_result(status, lambda code: code == 200)


def test_garbage_collections_are_timed_by_generation() -> None:
    """A full collection is one more in gpuscaler_gc_pause_seconds{generation="2"}, with its seconds, in every
    registry (the collector is the process's); the buckets are cumulative up to the count."""
    first, second = ServerTelemetry().registry, ServerTelemetry().registry
    labels = {"generation": "2"}
    before = first.get_sample_value("gpuscaler_gc_pause_seconds_count", labels)
    seconds_before = first.get_sample_value("gpuscaler_gc_pause_seconds_sum", labels)
    assert before is not None
    assert seconds_before is not None
    gc.collect()
    count = first.get_sample_value("gpuscaler_gc_pause_seconds_count", labels)
    assert count is not None
    assert count >= before + 1
    assert second.get_sample_value("gpuscaler_gc_pause_seconds_count", labels) == count
    assert (first.get_sample_value("gpuscaler_gc_pause_seconds_sum", labels) or 0.0) > seconds_before
    bounds = ("0.001", "0.01", "0.1", "1.0", "+Inf")
    bucket = "gpuscaler_gc_pause_seconds_bucket"
    cumulative = [first.get_sample_value(bucket, {**labels, "le": le}) or 0.0 for le in bounds]
    assert cumulative == sorted(cumulative)
    assert cumulative[-1] == count
