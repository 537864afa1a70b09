"""Agents and gateways as real processes on loopback, with fake GPUs and fake kubelets, for the e2e tests.

The fake kubelets are real gRPC servers on unix sockets in the test's process; the agents read them the way
they read the kubelet. Each agent gets its own NODE_NAME, so its fake GPUs are GPU-fake-<node>-<index>. The
gateways find the agents in an agents file, so a test removes an agent from discovery by rewriting it.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from grpclib.client import Channel
from grpclib.exceptions import GRPCError

from e2e.support.process import Process, environment
from gpuscaler.generated import externalscaler as keda
from gpuscaler.generated.gpuscaler import v1 as pb
from tests.fakes.fake_kubelet import FakeKubelet

CONSOLE_SCRIPT = Path(sys.executable).with_name("gpuscaler")
POLL_SECONDS = 0.2
GPUS = 2


@dataclass
class Cluster:
    """Nodes (agent + fake kubelet each) and gateways over them."""

    directory: Path
    kubelets: dict[str, FakeKubelet] = field(default_factory=dict)
    agents: dict[str, Process] = field(default_factory=dict)
    gateways: list[Process] = field(default_factory=list)

    def agent(self, node: str, port: int = 0, *flags: str) -> Process:
        """An agent process for ``node`` (not started), on ``port`` (0: any), with extra ``flags``."""
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
                *flags,
            ],
            self.directory / f"agent-{node}-{time.monotonic_ns()}.log",
            environment(node),
            "agent_started",
        )

    @property
    def agents_file(self) -> Path:
        return self.directory / "agents.txt"

    def list_agents(self, *nodes: str) -> None:
        """Rewrite the gateways' agents file to list these nodes' agents (all of them when none are given)."""
        listed = nodes or tuple(self.agents)
        text = "".join(f"127.0.0.1:{self.agents[node].port}  # {node}\n" for node in listed)
        partial = self.agents_file.with_suffix(".tmp")
        partial.write_text(text)
        partial.replace(self.agents_file)  # whole or not at all, as a config-map update is

    def gateway(self, index: int, pods: Path, *flags: str) -> Process:
        if not self.agents_file.exists():
            self.list_agents()
        return Process(
            [
                str(CONSOLE_SCRIPT),
                "gateway",
                "--listen",
                "127.0.0.1:0",
                "--metrics-listen",
                "127.0.0.1:0",
                "--agents-file",
                str(self.agents_file),
                "--resolve-interval",
                "0.5",
                "--pod-directory",
                str(pods),
                *flags,
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
    """The gateway's Explain for ``metadata`` from namespace ml: the nodes, GPUs and pods behind the value."""
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


class Pushes:
    """Every StreamIsActive message one scaler pushes for one query, read in the background."""

    def __init__(self, scaler: Process, **metadata: str) -> None:
        self.seen: list[bool] = []
        self._channel = Channel("127.0.0.1", scaler.port)
        ref = keda.ScaledObjectRef(name="so", namespace="ml", scaler_metadata=metadata)
        self._stream = keda.ExternalScalerStub(self._channel).stream_is_active(ref)
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        async for message in self._stream:
            self.seen.append(message.result)

    async def pushed(self) -> list[bool]:
        """What has arrived so far, as a call for ``eventually`` to repeat."""
        return self.seen

    async def close(self) -> None:
        self._reader.cancel()
        await asyncio.gather(self._reader, return_exceptions=True)
        self._channel.close()


async def is_active(scaler: Process, **metadata: str) -> bool:
    """The scaler's IsActive answer for ``metadata`` from a ScaledObject in namespace ml."""
    channel = Channel("127.0.0.1", scaler.port)
    try:
        ref = keda.ScaledObjectRef(name="so", namespace="ml", scaler_metadata=metadata)
        return (await keda.ExternalScalerStub(channel).is_active(ref, timeout=5)).result
    finally:
        channel.close()
