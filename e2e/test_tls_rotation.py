"""Certificate rotation on a running agent, the way cert-manager rotates a mounted Secret.

A grpcio push stream (KEDA's client family) opened on the old certificate must keep delivering after
the files change, while every new handshake gets the new certificate.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import shutil
import socket
import ssl
from pathlib import Path

import pytest

from e2e.conftest import StartAgent
from e2e.support.certs import make_certificates
from e2e.support.clients import GrpcioScaler, RpcFailure
from e2e.support.control import Control
from e2e.support.keda_grpcio import KedaProto
from tests.waiting import until

METADATA = {"gpuIndex": "0", "activationThreshold": "50"}


async def test_rotation_keeps_open_streams_and_serves_the_new_certificate(
    start_agent: StartAgent, keda_proto: KedaProto, tmp_path: Path
) -> None:
    """After the files change, new clients need the new CA, and a stream opened before still delivers."""
    old, new = make_certificates(tmp_path / "old"), make_certificates(tmp_path / "new")
    # The kubelet's layout for a Secret volume: files are links through `..data`, itself a link to a
    # timestamped folder; an update writes a new folder and renames a new `..data` link over the old.
    live = tmp_path / "live"
    live.mkdir()
    for version, files in (("v1", old), ("v2", new)):
        (live / version).mkdir()
        shutil.copy(files.server_cert, live / version / "tls.crt")
        shutil.copy(files.server_key, live / version / "tls.key")
    (live / "..data").symlink_to("v1")
    for name in ("tls.crt", "tls.key"):
        (live / name).symlink_to(f"..data/{name}")
    mounted = dataclasses.replace(old, server_cert=live / "tls.crt", server_key=live / "tls.key")
    agent = await start_agent("--tls-reload-interval", "0.2", tls=mounted)

    before = await GrpcioScaler.connect(agent, keda_proto)
    stream = before.stream_is_active(METADATA)
    async with Control(agent) as control:  # its connection, too, was made on the old certificate
        try:
            assert await stream.next() is False
            await control.snapshot()  # grpclib connects on first use: do it on the old certificate

            (live / "..data_tmp").symlink_to("v2")
            os.replace(live / "..data_tmp", live / "..data")  # certificate and key change in one step
            await until(lambda: bool(agent.events("tls_reloaded")), timeout=10)

            agent.tls = dataclasses.replace(mounted, ca=new.ca)
            after = await GrpcioScaler.connect(agent, keda_proto)
            assert await after.is_active(METADATA) is False
            await after.close()

            agent.tls = mounted
            stale = await GrpcioScaler.connect(agent, keda_proto)
            with pytest.raises(RpcFailure) as refused:
                await stale.is_active(METADATA, timeout=5)
            assert refused.value.code == "UNAVAILABLE"
            await stale.close()

            await control.set(0, {"gpu_utilization": 90.0})
            assert await stream.next() is True  # the stream from before the rotation lives on
        finally:
            await stream.close()
            await before.close()
    assert not agent.events("tls_reload_failed")


@pytest.mark.parametrize("version", [ssl.TLSVersion.TLSv1_2, ssl.TLSVersion.TLSv1_3])
async def test_a_session_from_before_a_client_ca_rotation_does_not_resume(
    start_agent: StartAgent, tmp_path: Path, version: ssl.TLSVersion
) -> None:
    """Sessions resume while the CA stays; once it changes, the old CA's client gets no session back, nor in."""
    first, second = make_certificates(tmp_path / "first"), make_certificates(tmp_path / "second")
    client_ca = tmp_path / "client-ca.crt"
    shutil.copy(first.ca, client_ca)
    # The later --tls-client-ca wins: the live file, which starts as the same CA the readiness check uses.
    agent = await start_agent("--tls-reload-interval", "0.2", "--tls-client-ca", str(client_ca), tls=first, mtls=True)
    client = ssl.create_default_context(cafile=first.ca)
    client.load_cert_chain(first.client_cert, first.client_key)
    client.set_alpn_protocols(["h2"])
    client.minimum_version = client.maximum_version = version

    made = await asyncio.to_thread(_handshake, client, agent.port, None)
    assert made.accepted
    again = await asyncio.to_thread(_handshake, client, agent.port, made.session)
    assert again.accepted
    assert again.resumed, "the test must see a resumption before the rotation, or it proves nothing after"

    shutil.copy(second.ca, tmp_path / "next-ca.crt")
    os.replace(tmp_path / "next-ca.crt", client_ca)
    await until(lambda: bool(agent.events("tls_reloaded")), timeout=10)
    for session in (made.session, again.session):
        after = await asyncio.to_thread(_handshake, client, agent.port, session)
        assert not after.resumed
        assert not after.accepted


@dataclasses.dataclass(frozen=True)
class _Handshake:
    session: ssl.SSLSession | None
    resumed: bool
    accepted: bool  # the server answered the HTTP/2 preface: this client is in


def _handshake(context: ssl.SSLContext, port: int, session: ssl.SSLSession | None) -> _Handshake:
    """One TLS connection offering ``session``; whether it resumed and whether the server let the client in."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
        try:
            tls = context.wrap_socket(raw, server_hostname="localhost", session=session)
        except (ssl.SSLError, OSError):
            return _Handshake(None, False, False)
        with tls:
            resumed = bool(tls.session_reused)
            try:
                tls.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00")
                accepted = bool(tls.recv(4096))  # the server's SETTINGS; a refused client certificate is an alert
            except (ssl.SSLError, OSError):
                accepted = False
            # TLS 1.3 tickets arrive after the handshake: ask for the session once data has been read.
            return _Handshake(tls.session if accepted else None, resumed, accepted)
