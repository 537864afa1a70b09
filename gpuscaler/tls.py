"""TLS contexts for the server and for our own clients. gRPC needs ALPN ``h2`` or grpc-go refuses."""

from __future__ import annotations

import ssl
from pathlib import Path

from gpuscaler.errors import ConfigError


def server_context(cert: Path, key: Path, client_ca: Path | None) -> ssl.SSLContext:
    """Server TLS; with ``client_ca`` every client must present a certificate it signed (mTLS)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.set_alpn_protocols(["h2"])
    _load_chain(context, cert, key, "--tls-cert", "--tls-key")
    if client_ca is not None:
        _load_ca(context, client_ca, "--tls-client-ca")
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def client_context(ca: Path | None, cert: Path | None, key: Path | None) -> ssl.SSLContext:
    """Client TLS: verify the server with ``ca`` (system roots without it), present ``cert`` for mTLS."""
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
    context.set_alpn_protocols(["h2"])
    if ca is not None:
        _load_ca(context, ca, "--tls-ca")
    if (cert is None) != (key is None):
        raise ConfigError("--tls-cert and --tls-key go together; give both or neither")
    if cert is not None and key is not None:
        _load_chain(context, cert, key, "--tls-cert", "--tls-key")
    return context


def _load_chain(context: ssl.SSLContext, cert: Path, key: Path, cert_flag: str, key_flag: str) -> None:
    try:
        context.load_cert_chain(cert, key)
    except FileNotFoundError as error:
        flag = cert_flag if Path(str(error.filename)) == cert else key_flag
        raise ConfigError(f"{flag} {str(error.filename)!r}: no such file") from None
    except (ssl.SSLError, OSError) as error:
        raise ConfigError(
            f"{cert_flag} {str(cert)!r} / {key_flag} {str(key)!r}: not a matching PEM pair: {error}"
        ) from None


def _load_ca(context: ssl.SSLContext, ca: Path, flag: str) -> None:
    try:
        context.load_verify_locations(cafile=ca)
    except FileNotFoundError:
        raise ConfigError(f"{flag} {str(ca)!r}: no such file") from None
    except (ssl.SSLError, OSError) as error:
        raise ConfigError(f"{flag} {str(ca)!r}: not a PEM CA bundle: {error}") from None
