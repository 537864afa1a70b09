"""TLS and mTLS as KEDA uses them (``caCert``, ``tlsClientCert``/``tlsClientKey``), with grpcio and grpclib.

A client that trusts the wrong CA, speaks plaintext to a TLS port, or lacks a certificate under mTLS
must be refused at the handshake, before any RPC runs.
"""

from __future__ import annotations

import grpc
import pytest

from e2e.conftest import StartAgent
from e2e.support.certs import TlsFiles, grpcio_credentials
from e2e.support.clients import GrpcioScaler, GrpclibScaler, RpcFailure
from e2e.support.keda_grpcio import KedaProto

METADATA = {"gpuIndex": "0"}


def grpcio_is_active(
    address: str, proto: KedaProto, credentials: object | None, options: list[tuple[str, object]]
) -> bool:
    """One IsActive over a fresh synchronous grpcio channel (plaintext when ``credentials`` is None)."""
    channel = (
        grpc.insecure_channel(address)
        if credentials is None
        else grpc.secure_channel(address, credentials, options=options)
    )
    try:
        return bool(proto.stub(channel).IsActive(proto.ref(METADATA), timeout=5).result)
    finally:
        channel.close()


async def test_tls_with_the_right_ca(start_agent: StartAgent, keda_proto: KedaProto, certificates: TlsFiles) -> None:
    """Server TLS: grpcio and grpclib clients that trust the CA get answers, and health is SERVING over TLS."""
    agent = await start_agent(tls=certificates)
    grpcio_client = await GrpcioScaler.connect(agent, keda_proto)
    grpclib_client = await GrpclibScaler.connect(agent)
    try:
        assert await grpcio_client.is_active(METADATA) is False
        assert await grpclib_client.is_active(METADATA) is False
        stream = grpcio_client.stream_is_active(METADATA)
        assert await stream.next() is False
        await stream.close()
    finally:
        await grpcio_client.close()
        await grpclib_client.close()
    assert agent.health() == "SERVING"


async def test_tls_refuses_the_wrong_ca_and_plaintext(
    start_agent: StartAgent, keda_proto: KedaProto, certificates: TlsFiles
) -> None:
    """A client trusting another CA, and a plaintext client, get UNAVAILABLE; the agent keeps serving."""
    agent = await start_agent(tls=certificates)
    wrong = grpcio_credentials(certificates, client_cert=False, ca=certificates.other_ca)
    for credentials in (wrong, None):
        with pytest.raises(grpc.RpcError) as raised:
            grpcio_is_active(agent.address, keda_proto, credentials, certificates.grpcio_options)
        assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
    right = grpcio_credentials(certificates, client_cert=False)
    assert grpcio_is_active(agent.address, keda_proto, right, certificates.grpcio_options) is False


async def test_mtls_needs_a_client_certificate(
    start_agent: StartAgent, keda_proto: KedaProto, certificates: TlsFiles
) -> None:
    """mTLS: with the client certificate calls answer; without one grpcio and grpclib are refused."""
    agent = await start_agent(tls=certificates, mtls=True)
    with_cert = grpcio_credentials(certificates, client_cert=True)
    assert grpcio_is_active(agent.address, keda_proto, with_cert, certificates.grpcio_options) is False

    without = grpcio_credentials(certificates, client_cert=False)
    with pytest.raises(grpc.RpcError) as raised:
        grpcio_is_active(agent.address, keda_proto, without, certificates.grpcio_options)
    assert raised.value.code() == grpc.StatusCode.UNAVAILABLE

    grpclib_without = await GrpclibScaler.connect(agent, client_cert=False)
    try:
        with pytest.raises(RpcFailure) as refused:
            await grpclib_without.is_active(METADATA, timeout=5)
        assert refused.value.code == "UNAVAILABLE"
    finally:
        await grpclib_without.close()

    grpcio_with = await GrpcioScaler.connect(agent, keda_proto)
    try:
        assert await grpcio_with.is_active(METADATA) is False
    finally:
        await grpcio_with.close()
    assert agent.health() == "SERVING"
