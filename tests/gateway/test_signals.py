"""GPM, energy and per-pod shares (time-sliced or DRA-shared GPUs) through every path: fake NVML -> agent -> wire ->
gateway -> KEDA and `query`."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from grpclib.client import Channel
from grpclib.const import Status
from grpclib.exceptions import GRPCError
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from gpuscaler.agent.attribution.processes import ProcReader
from gpuscaler.agent.collectors.nvml import NvmlCollector
from gpuscaler.agent.process import Agent
from gpuscaler.client.explain import collect
from gpuscaler.client.render import idle_energy_line
from gpuscaler.gateway.process import Gateway
from gpuscaler.generated.gpuscaler import v1 as pb
from tests.conftest import serve_settings
from tests.fakes.fake_kubelet import Assignment, DraAssignment, FakeKubelet, short_socket_path
from tests.fakes.fake_nvml import FakeDevice, FakeNvml, FakeProcess
from tests.gateway.calls import explain, value, view_has
from tests.gateway.conftest import gateway_settings
from tests.waiting import until_result

UID_A = "1b4e2a3c-1111-2222-3333-444455556666"
UID_B = "9f8e7d6c-aaaa-bbbb-cccc-ddddeeeeffff"

StartPair = Callable[..., Coroutine[Any, Any, tuple[Agent, Gateway]]]


@pytest.fixture
async def start_pair(tmp_path: Path) -> AsyncIterator[StartPair]:
    """Starts one agent over fake NVML (processes read from a fixture /proc) and a gateway over it."""
    started: list[tuple[Agent, Gateway, FakeKubelet]] = []

    async def start(
        nvml: FakeNvml, *assignments: Assignment | DraAssignment, pods: str = "", processes: bool = True
    ) -> tuple[Agent, Gateway]:
        kubelet = await FakeKubelet(short_socket_path()).start()
        kubelet.assign(list(assignments))
        proc = tmp_path / "proc"
        for pid, uid in ((101, UID_A), (201, UID_B)):
            (proc / str(pid)).mkdir(parents=True)
            (proc / str(pid) / "cgroup").write_text(f"0::/kubepods/burstable/pod{uid}/{'c' * 64}\n")
        settings = replace(
            serve_settings(
                *("--collector", "nvml", "--poll-interval", "0.1", "--drain-timeout", "0.5"),
                *("--pod-resources-socket", str(kubelet.socket_path), "--processes", str(processes).lower()),
            ),
            pod_resources_interval_seconds=0.1,
            proc_root=proc,
        )
        reader = ProcReader(settings.proc_root) if processes else None
        collector = NvmlCollector(node="node-a", nvml=nvml, processes=reader)
        agent = await Agent.start(settings, collector)
        directory = tmp_path / "pods.yaml"
        directory.write_text(pods or "pods: []\n")
        flags = ["--agents", f"127.0.0.1:{agent.port}", "--drain-timeout", "0.5", "--pod-directory", str(directory)]
        gateway = await Gateway.start(gateway_settings(*flags))
        started.append((agent, gateway, kubelet))
        await view_has(gateway, 1)
        return agent, gateway

    yield start
    for agent, gateway, kubelet in started:
        await gateway.stop()
        await agent.stop()
        await kubelet.stop()


@pytest.mark.parametrize(
    ("metric", "expected"),
    [
        pytest.param("sm_active", 71.0, id="sm_active"),
        pytest.param("sm_occupancy", 44.5, id="sm_occupancy"),
        pytest.param("tensor_active", 25.0, id="tensor_active"),
        pytest.param("dram_bandwidth", 96.0, id="dram_bandwidth"),
    ],
)
async def test_gpm_metrics_reach_keda_through_the_gateway(start_pair: StartPair, metric: str, expected: float) -> None:
    """Each GPM metric, read on the node, is what the gateway answers KEDA and `query`: the sum over two GPUs."""
    _, gateway = await start_pair(FakeNvml([FakeDevice("GPU-0"), FakeDevice("GPU-1")]))

    async def answer() -> float:
        return await value(gateway, metric=metric)

    assert await until_result(answer, lambda v: v == pytest.approx(expected)) == pytest.approx(expected)
    channel = Channel("127.0.0.1", gateway.port)
    try:
        report = await collect(channel, {"metric": metric}, stream_wait_seconds=0.5)
    finally:
        channel.close()
    assert report.get_metrics.fields["metricValues"][0]["metricValueFloat"] == pytest.approx(expected)
    assert report.explanation is not None
    assert sorted(g["value"] for g in report.explanation["gpus"]) == [pytest.approx(expected / 2)] * 2


async def test_power_average_is_the_energy_counters_rate_at_the_gateway(start_pair: StartPair) -> None:
    """power_average over a window is the energy counter's increase per second, summed over GPUs (300 W + 450 W)."""
    nvml = FakeNvml([FakeDevice("GPU-0", watts=300.0), FakeDevice("GPU-1", watts=450.0)])
    _, gateway = await start_pair(nvml)

    async def answer() -> float | None:
        try:
            return await value(gateway, metric="power_average", window="1s")
        except GRPCError as error:  # UNAVAILABLE until the window holds two readings: never a made-up 0
            if error.status is not Status.UNAVAILABLE:
                raise
            return None

    watts = await until_result(answer, lambda v: v is not None and v == pytest.approx(750.0, rel=0.05))
    assert watts == pytest.approx(750.0, rel=0.05)


async def test_power_average_without_a_window_is_the_rate_between_the_newest_two_samples(start_pair: StartPair) -> None:
    """Without ``window`` the gateway asks its agent for the rate between the node's newest two samples."""
    _, gateway = await start_pair(FakeNvml([FakeDevice("GPU-0", watts=300.0)]))

    async def answer() -> float | None:
        try:
            return await value(gateway, metric="power_average")
        except GRPCError as error:  # UNAVAILABLE until the agent has sent the rate: never a made-up 0
            if error.status is not Status.UNAVAILABLE:
                raise
            return None

    watts = await until_result(answer, lambda v: v is not None and v == pytest.approx(300.0, rel=0.05))
    assert watts == pytest.approx(300.0, rel=0.05)


SHARED_PODS = (
    "pods:\n"
    f"  - {{namespace: ml, pod: vllm-a, workload: vllm, uid: {UID_A}}}\n"
    f"  - {{namespace: ml, pod: vllm-b, workload: vllm, uid: {UID_B}}}\n"
)


async def test_a_window_over_a_shared_gpu_reads_each_pods_own_share(start_pair: StartPair) -> None:
    """Over a window the agent reduces each pod's own share too: the gateway keeps no history to do it."""
    device = FakeDevice(
        "GPU-shared", gpu_percent=90, processes=[FakeProcess(101, live=(30, 10)), FakeProcess(201, live=(50, 20))]
    )
    _, gateway = await start_pair(
        FakeNvml([device]),
        Assignment("ml", "vllm-a", ("GPU-shared::0",)),
        Assignment("ml", "vllm-b", ("GPU-shared::1",)),
        pods=SHARED_PODS,
    )

    async def explained() -> pb.Explanation | None:
        try:
            # KEDA's call asks the agents for the window, as Explain would.
            await value(gateway, workload="vllm", window="2s", windowFunction="max")
            return await explain(gateway, workload="vllm", window="2s", windowFunction="max")
        except GRPCError as error:
            if error.status is not Status.UNAVAILABLE:
                raise
            return None

    def both_pods(explanation: pb.Explanation | None) -> bool:
        return explanation is not None and {(g.pod, g.value) for g in explanation.gpus} == {
            ("vllm-a", 30.0),
            ("vllm-b", 50.0),
        }

    explanation = await until_result(explained, both_pods)
    assert explanation is not None
    assert explanation.value == pytest.approx(80.0)
    assert all(g.samples > 1 for g in explanation.gpus)  # reduced over the window, not one tick
    assert all(g.share.startswith("own share") for g in explanation.gpus)


# The ways two pods come to hold one GPU, each counted alike. The GPU's minor number (3) is not its index (0), so a DRA
# name placed by index would leave it unplaced.
SHARINGS = [
    pytest.param(
        (Assignment("ml", "vllm-a", ("GPU-shared::0",)), Assignment("ml", "vllm-b", ("GPU-shared::1",))),
        id="time-sliced-replicas",
    ),
    pytest.param(
        (
            DraAssignment("ml", "vllm-a", (("gpu.nvidia.com", "gpu-3"),), claim="shared-gpu"),
            DraAssignment("ml", "vllm-b", (("gpu.nvidia.com", "gpu-3"),), claim="shared-gpu"),
        ),
        id="one-dra-claim",
    ),
    pytest.param(
        (
            DraAssignment("ml", "vllm-a", (("gpu.nvidia.com", "gpu-3"),), claim="vllm-a-gpu", share_id="5c3f-a"),
            DraAssignment("ml", "vllm-b", (("gpu.nvidia.com", "gpu-3"),), claim="vllm-b-gpu", share_id="5c3f-b"),
        ),
        id="dra-share-ids",
    ),
]


def shared_gpu() -> FakeNvml:
    """One GPU (index 0, minor number 3), 90% busy: vllm-a's process 30% of it, vllm-b's 50%."""
    processes = [FakeProcess(101, live=(30, 10)), FakeProcess(201, live=(50, 20))]
    return FakeNvml([FakeDevice("GPU-shared", gpu_percent=90, minor=3, processes=processes)])


@pytest.mark.parametrize("holders", SHARINGS)
async def test_pods_sharing_a_gpu_each_count_their_own_share_and_query_says_so(
    start_pair: StartPair, holders: tuple[Assignment | DraAssignment, ...]
) -> None:
    """Two pods on one GPU, as time-sliced replicas, through one DRA claim, or by DRA share ids: each counts its own
    process (30 and 50), `gpuscaler query` names the basis."""
    _, gateway = await start_pair(shared_gpu(), *holders, pods=SHARED_PODS)

    async def answer() -> float:
        return await value(gateway, workload="vllm")

    assert await until_result(answer, lambda v: v == pytest.approx(80.0)) == pytest.approx(80.0)  # not 90 + 90
    explanation: pb.Explanation = await explain(gateway, workload="vllm")
    assert {(g.pod, g.value) for g in explanation.gpus} == {("vllm-a", 30.0), ("vllm-b", 50.0)}
    assert all(g.share.startswith("own share: 1 of its 2 processes") for g in explanation.gpus)

    channel = Channel("127.0.0.1", gateway.port)
    try:
        report = await collect(channel, {"workload": "vllm", "namespace": "ml"}, stream_wait_seconds=0.5)
    finally:
        channel.close()
    assert report.explanation is not None
    assert {g["share"] for g in report.explanation["gpus"]} == {
        "own share: 1 of its 2 processes, on a GPU shared by 2 pods"
    }


@pytest.mark.parametrize("holders", SHARINGS)
async def test_without_process_reads_each_pod_sharing_a_gpu_counts_it_whole(
    start_pair: StartPair, holders: tuple[Assignment | DraAssignment, ...]
) -> None:
    """The same sharings with --processes false: each pod counts the whole GPU (90 + 90), and says it is shared."""
    _, gateway = await start_pair(shared_gpu(), *holders, pods=SHARED_PODS, processes=False)

    async def answer() -> float:
        return await value(gateway, workload="vllm")

    assert await until_result(answer, lambda v: v == pytest.approx(180.0)) == pytest.approx(180.0)
    explanation: pb.Explanation = await explain(gateway, workload="vllm")
    assert {(g.pod, g.value) for g in explanation.gpus} == {("vllm-a", 90.0), ("vllm-b", 90.0)}
    assert {g.share for g in explanation.gpus} == {
        "whole GPU, shared by 2 pods: the agent reads no processes (--processes)"
    }


async def scrape(port: int | None) -> dict[str, list[Sample]]:
    """Every sample the /metrics on ``port`` serves, by series name."""
    assert port is not None
    async with aiohttp.ClientSession() as session, session.get(f"http://127.0.0.1:{port}/metrics") as response:
        text = await response.text()
    found: dict[str, list[Sample]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found.setdefault(sample.name, []).append(sample)
    return found


async def test_energy_while_idle_reaches_metrics_and_query(start_pair: StartPair) -> None:
    """An idle 100 W GPU's energy counts on the agent's /metrics (GPU, pod), the gateway's (workload) and in `query`."""
    idle = FakeDevice("GPU-idle", gpu_percent=0, watts=100.0)
    busy = FakeDevice("GPU-busy", gpu_percent=80, watts=400.0)
    agent, gateway = await start_pair(
        FakeNvml([idle, busy]),
        Assignment("ml", "vllm-a", ("GPU-idle",)),
        Assignment("ml", "web-1", ("GPU-busy",)),
        pods="pods:\n  - {namespace: ml, pod: vllm-a, workload: vllm}\n  - {namespace: ml, pod: web-1, workload: web}",
    )
    assert agent.frontend.metrics is not None
    assert gateway.frontend.metrics is not None

    async def joules(port: int | None, series: str, label: str) -> dict[str, float]:
        return {s.labels[label]: s.value for s in (await scrape(port)).get(series, [])}

    agent_port, gateway_port = agent.frontend.metrics.port, gateway.frontend.metrics.port

    async def agent_gpus() -> dict[str, float]:
        return await joules(agent_port, "gpuscaler_gpu_idle_energy_joules_total", "uuid")

    found = await until_result(agent_gpus, lambda v: v.get("GPU-idle", 0.0) > 10.0)
    assert found["GPU-busy"] == 0.0
    pods = await joules(agent_port, "gpuscaler_pod_idle_energy_joules_total", "pod")
    assert pods["vllm-a"] > 0.0
    assert pods.get("web-1", 0.0) == 0.0

    async def workloads() -> dict[str, float]:
        return await joules(gateway_port, "gpuscaler_workload_idle_energy_joules_total", "workload")

    by_workload = await until_result(workloads, lambda v: v.get("vllm", 0.0) > 10.0)
    assert by_workload.get("web", 0.0) == 0.0

    channel = Channel("127.0.0.1", gateway.port)
    try:

        async def report_line() -> str:
            report = await collect(channel, {"workload": "vllm", "namespace": "ml"}, stream_wait_seconds=0.5)
            return idle_energy_line(report)

        line = await until_result(report_line, lambda text: "100% of the energy" in text)
    finally:
        channel.close()
    assert line.startswith("Energy while idle: ")
    assert "on 1 GPU(s)" in line
