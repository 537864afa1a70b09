"""Fixtures for the gateway tests: in-process agents with their own node names and fake kubelets, and gateways."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest

from gpuscaler.agent.collectors.fake import FakeCollector
from gpuscaler.agent.process import Agent
from gpuscaler.cli import build_parser
from gpuscaler.gateway.process import Gateway
from gpuscaler.gateway.settings import GatewaySettings, gateway_settings_from_args
from gpuscaler.model.gpu_metrics import Metric
from gpuscaler.model.pods import PodDirectory
from tests.conftest import serve_settings
from tests.fakes.fake_kubelet import FakeKubelet, short_socket_path


@dataclass
class Node:
    """One in-process agent with its fake GPUs and its fake kubelet."""

    name: str
    agent: Agent
    kubelet: FakeKubelet
    port: int
    stopped: bool = False

    async def stop(self) -> None:
        """Stop the agent (drained, streams ended OK); the fixture then leaves it alone."""
        if not self.stopped:
            self.stopped = True
            await self.agent.stop()

    @property
    def collector(self) -> FakeCollector:
        assert isinstance(self.agent.collector, FakeCollector)
        return self.agent.collector

    def set(self, *values: float) -> None:
        for index, value in enumerate(values):
            self.collector.set_values(index, {Metric.GPU_UTILIZATION: value})

    def uuid(self, index: int) -> str:
        return f"GPU-fake-{self.name}-{index}"


StartNode = Callable[..., Coroutine[Any, Any, Node]]
StartGateway = Callable[..., Coroutine[Any, Any, Gateway]]


def gateway_settings(*flags: str) -> GatewaySettings:
    """Settings as `gpuscaler gateway --listen 127.0.0.1:0 FLAGS...` would build them."""
    environ: dict[str, str] = {}
    args = build_parser(environ).parse_args(
        ["gateway", "--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0", "--log-format", "json", *flags]
    )
    return gateway_settings_from_args(args, environ)


@pytest.fixture
async def start_node() -> AsyncIterator[StartNode]:
    """Starts agents named node-N (0.1 s polls, kubelet read every 0.1 s) and stops them all at the end."""
    nodes: list[Node] = []
    kubelets: list[FakeKubelet] = []

    async def start(name: str, *, gpus: int = 2, port: int = 0, kubelet: FakeKubelet | None = None) -> Node:
        if kubelet is None:
            kubelet = await FakeKubelet(short_socket_path()).start()
            kubelets.append(kubelet)
        settings = replace(
            serve_settings(
                "--poll-interval",
                "0.1",
                "--fake-gpus",
                str(gpus),
                "--pod-resources-socket",
                str(kubelet.socket_path),
                "--listen",
                f"127.0.0.1:{port}",
                "--drain-timeout",
                "0.5",
            ),
            pod_resources_interval_seconds=0.1,
        )
        agent = await Agent.start(settings, FakeCollector(node=name, gpu_count=gpus))
        node = Node(name, agent, kubelet, agent.port)
        nodes.append(node)
        return node

    yield start
    for node in nodes:
        await node.stop()
    for kubelet in kubelets:
        await kubelet.stop()


@pytest.fixture
async def start_gateway() -> AsyncIterator[StartGateway]:
    """Starts in-process gateways over the given nodes and stops them all at the end."""
    gateways: list[Gateway] = []

    async def start(
        *nodes: Node,
        directory: PodDirectory | None = None,
        pod_directory: Path | None = None,
        flags: tuple[str, ...] = (),
    ) -> Gateway:
        flags = (
            "--agents",
            ",".join(f"127.0.0.1:{node.port}" for node in nodes),
            "--drain-timeout",
            "0.5",
            *flags,
        )
        if pod_directory is not None:
            flags += ("--pod-directory", str(pod_directory))
        gateway = await Gateway.start(gateway_settings(*flags), directory=directory)
        gateways.append(gateway)
        return gateway

    yield start
    for gateway in gateways:
        await gateway.stop()
