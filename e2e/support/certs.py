"""Throw-away certificates for the TLS tests, made with the ``openssl`` command: a CA, a server, a client.

A second, unrelated CA signs nothing the agent trusts; clients that verify with it must be refused.
"""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

SERVER_NAME = "localhost"
_KEY = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """PEM files: ``ca`` signed the server and client certificates; ``other_ca`` signed neither."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    other_ca: Path

    @property
    def grpcio_options(self) -> list[tuple[str, Any]]:
        """grpcio channel options: verify the name KEDA would dial (a Service's DNS name), not the IP."""
        return [("grpc.ssl_target_name_override", SERVER_NAME)]


def make_certificates(directory: Path) -> TlsFiles:
    """Create a CA, a server certificate for ``localhost`` and 127.0.0.1, a client certificate, and a stray CA."""
    directory.mkdir(parents=True, exist_ok=True)
    ca_key, ca = directory / "ca.key", directory / "ca.crt"
    other_key, other = directory / "other-ca.key", directory / "other-ca.crt"
    _self_signed_ca(ca_key, ca, "gpuscaler e2e CA")
    _self_signed_ca(other_key, other, "unrelated CA")
    server_cert, server_key = directory / "server.crt", directory / "server.key"
    _signed(
        directory,
        server_key,
        server_cert,
        ca,
        ca_key,
        subject=SERVER_NAME,
        extensions=f"subjectAltName=DNS:{SERVER_NAME},IP:127.0.0.1\nextendedKeyUsage=serverAuth\n",
    )
    client_cert, client_key = directory / "client.crt", directory / "client.key"
    _signed(
        directory,
        client_key,
        client_cert,
        ca,
        ca_key,
        subject="keda-operator",
        extensions="extendedKeyUsage=clientAuth\n",
    )
    return TlsFiles(ca, server_cert, server_key, client_cert, client_key, other)


def make_server_certificate(
    files: TlsFiles, directory: Path, name: str, *, more_names: Sequence[str] = (), client_auth: bool = False
) -> tuple[Path, Path]:
    """A server certificate and key for the DNS name ``name``, signed by ``files.ca`` (whose key lies beside it).

    ``more_names`` are further subjectAltName entries as openssl writes them (``DNS:x``, ``IP:10.96.0.1``);
    ``client_auth`` lets the certificate authenticate a client too (an agent that a gateway dials with mTLS).
    """
    directory.mkdir(parents=True, exist_ok=True)
    cert, key = directory / "tls.crt", directory / "tls.key"
    names = ",".join([f"DNS:{name}", *more_names])
    usage = "serverAuth,clientAuth" if client_auth else "serverAuth"
    _signed(
        directory,
        key,
        cert,
        files.ca,
        files.ca.with_name("ca.key"),
        subject=name,
        extensions=f"subjectAltName={names}\nextendedKeyUsage={usage}\n",
    )
    return cert, key


def grpcio_credentials(files: TlsFiles, *, client_cert: bool, ca: Path | None = None) -> Any:
    """grpcio channel credentials trusting ``ca`` (default ``files.ca``), with the client certificate if asked."""
    root = (ca or files.ca).read_bytes()
    if not client_cert:
        return grpc.ssl_channel_credentials(root_certificates=root)
    return grpc.ssl_channel_credentials(
        root_certificates=root,
        private_key=files.client_key.read_bytes(),
        certificate_chain=files.client_cert.read_bytes(),
    )


def _self_signed_ca(key: Path, cert: Path, name: str) -> None:
    _openssl(
        "req",
        "-x509",
        *_KEY,
        "-keyout",
        str(key),
        "-out",
        str(cert),
        "-days",
        "2",
        "-subj",
        f"/CN={name}",
        "-addext",
        "basicConstraints=critical,CA:TRUE",
        "-addext",
        "keyUsage=critical,keyCertSign,cRLSign",
    )


def _signed(directory: Path, key: Path, cert: Path, ca: Path, ca_key: Path, *, subject: str, extensions: str) -> None:
    request = directory / f"{cert.stem}.csr"
    extension_file = directory / f"{cert.stem}.ext"
    extension_file.write_text(extensions, encoding="utf-8")
    _openssl("req", "-new", *_KEY, "-keyout", str(key), "-out", str(request), "-subj", f"/CN={subject}")
    _openssl(
        "x509",
        "-req",
        "-in",
        str(request),
        "-CA",
        str(ca),
        "-CAkey",
        str(ca_key),
        "-CAcreateserial",
        "-out",
        str(cert),
        "-days",
        "2",
        "-extfile",
        str(extension_file),
    )


def _openssl(*args: str) -> None:
    result = subprocess.run(["openssl", *args], capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"openssl {args[0]} failed ({result.returncode}): {result.stderr.strip()}")
