"""Fixtures for the end-to-end tests: agent processes on loopback, both clients, fake control, certificates."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest

from e2e.support.agent import AgentFailed, AgentProcess
from e2e.support.certs import TlsFiles, make_certificates
from e2e.support.clients import CLIENT_KINDS, ClientKind, ScalerClient, connect
from e2e.support.control import Control
from e2e.support.keda_grpcio import KedaProto, generate

StartAgent = Callable[..., Awaitable[AgentProcess]]

# e2e/keda builds and runs a Kubernetes control plane with KEDA (half an hour cold): only `make e2e-keda`, which sets
# GPUSCALER_E2E_KEDA=1, collects it. Ignored, not skipped, so nothing inside it can pass by being skipped.
collect_ignore = [] if os.environ.get("GPUSCALER_E2E_KEDA") == "1" else ["keda"]


@pytest.fixture(scope="session")
def keda_proto(tmp_path_factory: pytest.TempPathFactory) -> KedaProto:
    """grpcio stubs generated from protos/externalscaler.proto for this session."""
    return generate(tmp_path_factory.mktemp("grpcio-stubs"))


@pytest.fixture(scope="session")
def certificates(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    """A CA, a server and a client certificate, and an unrelated CA, made with openssl."""
    return make_certificates(tmp_path_factory.mktemp("certs"))


@pytest.fixture
async def start_agent(tmp_path: Path) -> AsyncIterator[StartAgent]:
    """Starts agent processes; at the end stops each with SIGTERM and fails unless it exits 0 without errors."""
    agents: list[AgentProcess] = []

    async def start(
        *flags: str, gpus: int = 8, poll_interval: float = 0.2, tls: TlsFiles | None = None, mtls: bool = False
    ) -> AgentProcess:
        agent = await asyncio.to_thread(
            AgentProcess.start,
            *flags,
            log_dir=tmp_path,
            gpus=gpus,
            poll_interval=poll_interval,
            tls=tls,
            mtls=mtls,
        )
        agents.append(agent)
        return agent

    yield start
    failures = []
    for agent in agents:
        try:
            await agent.terminate()
        except AgentFailed as error:
            failures.append(str(error))
    if failures:
        pytest.fail("\n\n".join(failures), pytrace=False)


@pytest.fixture
async def agent(start_agent: StartAgent) -> AgentProcess:
    """An agent with 8 idle fake GPUs polling every 0.2 s."""
    return await start_agent()


@pytest.fixture(params=CLIENT_KINDS)
def client_kind(request: pytest.FixtureRequest) -> ClientKind:
    """Each test that takes a client runs once with grpclib and once with grpcio."""
    kind: ClientKind = request.param
    return kind


@pytest.fixture
async def client(client_kind: ClientKind, agent: AgentProcess, keda_proto: KedaProto) -> AsyncIterator[ScalerClient]:
    """A client of ``agent`` of the parametrized kind, on one channel."""
    scaler = await connect(client_kind, agent, keda_proto)
    yield scaler
    await scaler.close()


@pytest.fixture
async def control(agent: AgentProcess) -> AsyncIterator[Control]:
    """FakeControl and Agent stubs for ``agent``."""
    async with Control(agent) as control:
        yield control
