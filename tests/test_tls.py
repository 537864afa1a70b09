"""TLS, mTLS and certificate rotation with open streams, in-process over loopback."""

from __future__ import annotations

import asyncio
import os
import ssl
from pathlib import Path

import pytest
import trustme
from grpclib.client import Channel
from grpclib.exceptions import StreamTerminatedError

from gpuscaler.agent.collectors.fake import FakeCollector
from gpuscaler.agent.process import Agent
from gpuscaler.generated.externalscaler import ExternalScalerStub, ScaledObjectRef
from gpuscaler.model.gpu_metrics import Metric
from gpuscaler.tls import client_context
from tests.conftest import StartAgent
from tests.waiting import until

REF = ScaledObjectRef(name="app", namespace="ml", scaler_metadata={"gpuIndex": "0", "activationThreshold": "50"})


def write_pair(cert: trustme.LeafCert, directory: Path, name: str) -> tuple[Path, Path]:
    """Write ``cert``'s chain and key as PEM files ``name``.crt and ``name``.key in ``directory``."""
    chain, key = directory / f"{name}.crt", directory / f"{name}.key"
    cert.private_key_pem.write_to_path(str(key))
    chain.write_bytes(b"".join(blob.bytes() for blob in cert.cert_chain_pems))
    return chain, key


def ca_file(ca: trustme.CA, directory: Path, name: str) -> Path:
    """Write ``ca``'s certificate as ``name``.pem in ``directory``: the bundle a peer verifies with."""
    path = directory / f"{name}.pem"
    ca.cert_pem.write_to_path(str(path))
    return path


def channel(agent: Agent, context: ssl.SSLContext) -> Channel:
    """A channel to the agent over TLS with the client ``context``."""
    return Channel("127.0.0.1", agent.port, ssl=context)


async def test_tls_serves_clients_that_trust_the_ca(start_agent: StartAgent, tmp_path: Path) -> None:
    """With --tls-cert/--tls-key, a client trusting the CA is answered and one trusting another CA is refused."""
    ca, stranger = trustme.CA(), trustme.CA()
    cert, key = write_pair(ca.issue_cert("127.0.0.1", "localhost"), tmp_path, "server")
    agent = await start_agent("--tls-cert", str(cert), "--tls-key", str(key))

    trusted = channel(agent, client_context(ca_file(ca, tmp_path, "ca"), None, None))
    assert (await ExternalScalerStub(trusted).is_active(REF)).result is False
    trusted.close()

    untrusting = channel(agent, client_context(ca_file(stranger, tmp_path, "stranger"), None, None))
    with pytest.raises(ssl.SSLCertVerificationError):
        await ExternalScalerStub(untrusting).is_active(REF)
    untrusting.close()


async def test_mtls_refuses_clients_without_a_certificate(start_agent: StartAgent, tmp_path: Path) -> None:
    """With --tls-client-ca, a client presenting a certificate from that CA is answered; one without is refused."""
    server_ca, client_ca = trustme.CA(), trustme.CA()
    cert, key = write_pair(server_ca.issue_cert("127.0.0.1"), tmp_path, "server")
    agent = await start_agent(
        "--tls-cert", str(cert), "--tls-key", str(key), "--tls-client-ca", str(ca_file(client_ca, tmp_path, "clients"))
    )
    trust = ca_file(server_ca, tmp_path, "ca")
    client_cert, client_key = write_pair(client_ca.issue_cert("keda"), tmp_path, "client")

    with_cert = channel(agent, client_context(trust, client_cert, client_key))
    assert (await ExternalScalerStub(with_cert).is_active(REF)).result is False
    with_cert.close()

    without_cert = channel(agent, client_context(trust, None, None))
    # TLS 1.3 finishes the client's side of the handshake first; the server then drops the connection.
    with pytest.raises((ssl.SSLError, ConnectionError, StreamTerminatedError)):
        await asyncio.wait_for(ExternalScalerStub(without_cert).is_active(REF), timeout=5)
    without_cert.close()


async def test_rotation_keeps_open_streams_and_serves_the_new_certificate(
    start_agent: StartAgent, tmp_path: Path
) -> None:
    """Rewriting the certificate files switches new handshakes to the new one; a stream opened before lives on."""
    old_ca, new_ca = trustme.CA(), trustme.CA()
    live = tmp_path / "live"
    live.mkdir()
    cert, key = write_pair(old_ca.issue_cert("127.0.0.1"), live, "tls")
    agent = await start_agent("--tls-cert", str(cert), "--tls-key", str(key), "--tls-reload-interval", "0.1")
    assert agent.frontend.tls is not None
    assert isinstance(agent.collector, FakeCollector)
    old_trust, new_trust = ca_file(old_ca, tmp_path, "old"), ca_file(new_ca, tmp_path, "new")

    before = channel(agent, client_context(old_trust, None, None))
    received: list[bool] = []

    async def hold() -> None:
        async for message in ExternalScalerStub(before).stream_is_active(REF):
            received.append(message.result)

    holder = asyncio.create_task(hold())
    try:
        await until(lambda: received == [False])
        serving = agent.frontend.tls.current

        # Like cert-manager: new files beside the old, then an atomic rename over them.
        staged_cert, staged_key = write_pair(new_ca.issue_cert("127.0.0.1"), tmp_path, "staged")
        os.replace(staged_key, key)
        os.replace(staged_cert, cert)
        await until(lambda: agent.frontend.tls is not None and agent.frontend.tls.current is not serving)

        after = channel(agent, client_context(new_trust, None, None))
        assert (await ExternalScalerStub(after).is_active(REF)).result is False
        after.close()
        stale = channel(agent, client_context(old_trust, None, None))
        with pytest.raises(ssl.SSLCertVerificationError):
            await ExternalScalerStub(stale).is_active(REF)
        stale.close()

        agent.collector.set_values(0, {Metric.GPU_UTILIZATION: 90.0})
        await until(lambda: received == [False, True])  # the stream from before the rotation still delivers
    finally:
        holder.cancel()
        await asyncio.gather(holder, return_exceptions=True)
        before.close()


async def test_half_rotated_files_keep_the_old_certificate(start_agent: StartAgent, tmp_path: Path) -> None:
    """A new certificate beside the old key fails to load and the old context keeps serving."""
    ca = trustme.CA()
    cert, key = write_pair(ca.issue_cert("127.0.0.1"), tmp_path, "tls")
    agent = await start_agent("--tls-cert", str(cert), "--tls-key", str(key), "--tls-reload-interval", "0.1")
    assert agent.frontend.tls is not None
    serving = agent.frontend.tls.current
    other_cert, _ = write_pair(ca.issue_cert("127.0.0.1"), tmp_path, "other")
    os.replace(other_cert, cert)  # the key has not been rotated yet
    await asyncio.sleep(0.5)
    assert agent.frontend.tls.current is serving
    trusted = channel(agent, client_context(ca_file(ca, tmp_path, "ca"), None, None))
    assert (await ExternalScalerStub(trusted).is_active(REF)).result is False
    trusted.close()
