"""Profiles over fake NVML GPUs: -gpm profiles read SM activity where GPM exists and refuse clearly where not;
distributed-training reads NVLink traffic with or without GPM, and refuses a GPU without NVLink."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import pytest

from gpuscaler.agent.collectors.nvml import NvmlCollector
from gpuscaler.agent.process import Agent
from gpuscaler.model.errors import Unavailable, Unsupported
from gpuscaler.model.gpu_metrics import METRICS, READINGS, Metric
from gpuscaler.model.samples import ReadErrorKind
from gpuscaler.query.profiles import DEFAULT_METRIC, GPM_SUFFIX, PROFILES
from gpuscaler.signals.outcome import Evaluation
from tests.conftest import serve_settings
from tests.fakes.fake_nvml import FakeDevice, FakeNvml
from tests.waiting import until

StartNvmlAgent = Callable[..., Coroutine[Any, Any, Agent]]
# The profiles on the duty cycle, each with a -gpm twin; the others read one metric on every GPU that has it.
PLAIN = sorted(name for name, profile in PROFILES.items() if profile.metric is DEFAULT_METRIC)


def hopper(uuid: str) -> FakeDevice:
    """A Hopper GPU (GPM supported), 97% busy."""
    return FakeDevice(uuid, name="NVIDIA H100 80GB HBM3", gpu_percent=97)


def ampere(uuid: str) -> FakeDevice:
    """An Ampere GPU, 97% busy, without GPM (which needs Hopper or newer)."""
    return FakeDevice(uuid, name="NVIDIA A100-SXM4-80GB", gpu_percent=97, gpm_supported=False)


@pytest.fixture
async def start_nvml_agent() -> AsyncIterator[StartNvmlAgent]:
    """Starts agents over fake NVML GPUs, polling every 0.1 s, past their first GPM tick; stops them at the end."""
    agents: list[Agent] = []

    async def start(*devices: FakeDevice) -> Agent:
        collector = NvmlCollector(node="node-a", nvml=FakeNvml(list(devices)))
        agent = await Agent.start(serve_settings("--poll-interval", "0.1"), collector)
        agents.append(agent)
        await until(lambda: (latest := agent.evaluator.source.latest) is not None and latest.sequence >= 2)
        return agent

    yield start
    for agent in agents:
        await agent.stop()


async def settled(agent: Agent, **metadata: str) -> Evaluation:
    """The query's evaluation once it is not UNAVAILABLE: a read that timed out on a busy machine passes."""
    query = agent.evaluator.parse(metadata)
    async with asyncio.timeout(10):
        while True:
            evaluation = agent.evaluator.evaluate(query.value)
            transient = [
                c
                for c in evaluation.contributions
                if c.error is not None and c.error.kind is not ReadErrorKind.NOT_SUPPORTED
            ]
            if not isinstance(evaluation.error, Unavailable) and not transient:
                return evaluation
            latest = agent.evaluator.source.latest
            await agent.evaluator.source.wait_newer(latest.sequence if latest is not None else 0)


async def value(agent: Agent, **metadata: str) -> float:
    """The query's value on ``agent`` once it has settled (see ``settled``)."""
    return (await settled(agent, **metadata)).value_or_raise()


def test_a_profile_without_a_twin_reads_its_metric_with_or_without_gpm() -> None:
    """A profile that is neither on the duty cycle nor a -gpm twin scales on a reading that GPUs without GPM give."""
    readings = {reading.field: reading for reading in READINGS}
    untwinned = [name for name in PROFILES if name not in PLAIN and not name.endswith(GPM_SUFFIX)]
    assert untwinned == ["distributed-training"]
    for name in untwinned:
        reading = readings[METRICS[PROFILES[name].metric].reading]
        assert reading.gpm_metric is None or reading.fallback is not None, name


def test_every_plain_profile_has_a_gpm_twin_with_its_shape() -> None:
    """Each -gpm profile keeps its plain twin's aggregation, window and hysteresis, and scales on sm_active."""
    assert sorted(name.removesuffix(GPM_SUFFIX) for name in PROFILES if name.endswith(GPM_SUFFIX)) == PLAIN
    for name in PLAIN:
        plain, gpm = PROFILES[name], PROFILES[name + GPM_SUFFIX]
        assert plain.metric is Metric.GPU_UTILIZATION
        assert gpm.metric is Metric.SM_ACTIVE
        assert (gpm.aggregation, gpm.window_seconds, gpm.window_function) == (
            plain.aggregation,
            plain.window_seconds,
            plain.window_function,
        )
        assert (gpm.activation_threshold, gpm.deactivation_threshold) == (
            plain.activation_threshold,
            plain.deactivation_threshold,
        )


@pytest.mark.parametrize("name", PLAIN)
async def test_on_hopper_the_gpm_profile_reads_sm_activity_not_the_duty_cycle(
    start_nvml_agent: StartNvmlAgent, name: str
) -> None:
    """On a GPU with GPM the -gpm profile answers with sm_active (35.5), where the duty cycle reads 97."""
    agent = await start_nvml_agent(hopper("GPU-h100"))
    assert await value(agent, profile=name + GPM_SUFFIX) == pytest.approx(35.5)
    assert await value(agent, profile=name) == pytest.approx(97.0)


@pytest.mark.parametrize("name", PLAIN)
async def test_before_hopper_the_gpm_profile_fails_naming_the_plain_one(
    start_nvml_agent: StartNvmlAgent, name: str
) -> None:
    """Without GPM the -gpm profile is FAILED_PRECONDITION saying what to use; the plain profile still answers."""
    agent = await start_nvml_agent(ampere("GPU-a100"))
    with pytest.raises(Unsupported) as raised:
        await value(agent, profile=name + GPM_SUFFIX)
    message = raised.value.message
    assert "sm_active cannot be read on GPU 0 (GPU-a100)" in message
    assert "GPM is not supported" in message
    assert "use a profile without -gpm" in message
    assert await value(agent, profile=name) == pytest.approx(97.0)


async def test_on_a_mixed_node_the_gpm_profile_leaves_out_the_older_gpu_and_says_so(
    start_nvml_agent: StartNvmlAgent,
) -> None:
    """An all-GPU -gpm query answers from the GPUs that have GPM and names the one it left out, never as 0."""
    agent = await start_nvml_agent(hopper("GPU-h100"), ampere("GPU-a100"))
    evaluation = await settled(agent, profile="vllm-inference-gpm")
    assert evaluation.value_or_raise() == pytest.approx(35.5)
    left_out = [c for c in evaluation.contributions if c.value is None]
    assert [c.sample.gpu.uuid for c in left_out] == ["GPU-a100"]
    assert "GPM is not supported" in (left_out[0].reason or "")
    assert await value(agent, profile="vllm-inference") == pytest.approx(194.0)


def nvlink_ampere(uuid: str) -> FakeDevice:
    """An A100 SXM: NVLink, no GPM; its NVLink counters do not move unless a test moves them."""
    return FakeDevice(uuid, name="NVIDIA A100-SXM4-80GB", gpm_supported=False)


async def test_distributed_training_reads_nvlink_from_gpm_and_from_the_older_counters(
    start_nvml_agent: StartNvmlAgent,
) -> None:
    """On Hopper the profile sums GPM's NVLink TX (50000 MiB/s = 52428.8 MB/s); an A100's counters add their rate."""
    agent = await start_nvml_agent(hopper("GPU-h100"), nvlink_ampere("GPU-a100"))
    evaluation = await settled(agent, profile="distributed-training")
    assert evaluation.value_or_raise() == pytest.approx(52428.8)
    assert {c.sample.gpu.uuid: c.value for c in evaluation.contributions} == {
        "GPU-h100": pytest.approx(52428.8),
        "GPU-a100": 0.0,
    }


async def test_distributed_training_on_gpus_without_nvlink_says_so(start_nvml_agent: StartNvmlAgent) -> None:
    """On PCIe cards without NVLink the profile is FAILED_PRECONDITION saying the GPU has no NVLink, never 0."""
    agent = await start_nvml_agent(FakeDevice("GPU-pcie", name="NVIDIA H100 PCIe", nvlink=False))
    with pytest.raises(Unsupported) as raised:
        await value(agent, profile="distributed-training")
    assert "nvlink_tx cannot be read on GPU 0 (GPU-pcie)" in raised.value.message
    assert "this GPU has no NVLink" in raised.value.message
