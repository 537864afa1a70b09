"""TLS contexts for the server and for our own clients. gRPC needs ALPN ``h2`` or grpc-go refuses."""

from __future__ import annotations

import calendar
import ssl
import time
from pathlib import Path

from gpuscaler.flags import paired
from gpuscaler.model.errors import ConfigError


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


def client_context(ca: Path | None, cert: Path | None, key: Path | None, *, flags: str = "--tls-") -> ssl.SSLContext:
    """Client TLS: verify the server with ``ca`` (system roots without it), present ``cert`` for mTLS.

    ``flags`` is the prefix of the flags the files came from (``--agent-tls-`` for the gateway), for errors.
    """
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
    context.set_alpn_protocols(["h2"])
    if ca is not None:
        _load_ca(context, ca, f"{flags}ca")
    paired(cert, key, f"{flags}cert", f"{flags}key")
    if cert is not None and key is not None:
        _load_chain(context, cert, key, f"{flags}cert", f"{flags}key")
    return context


def _load_chain(context: ssl.SSLContext, cert: Path, key: Path, cert_flag: str, key_flag: str) -> None:
    try:
        context.load_cert_chain(cert, key)
    except FileNotFoundError:
        # ssl leaves error.filename None, so find the missing one ourselves.
        flag, missing = (cert_flag, cert) if not cert.exists() else (key_flag, key)
        raise ConfigError(f"{flag} {str(missing)!r}: no such file") from None
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


def certificate_expiry(path: Path) -> float | None:
    """The notAfter of the first certificate in the PEM file ``path``, in Unix seconds; None if unreadable.

    The standard library reads certificates only off a verified peer, so this reads the one field it needs
    from the DER: Certificate -> TBSCertificate -> validity -> notAfter (RFC 5280, 4.1).
    """
    try:
        text = path.read_text(encoding="ascii")
        begin = text.index("-----BEGIN CERTIFICATE-----")
        end = text.index("-----END CERTIFICATE-----", begin) + len("-----END CERTIFICATE-----")
        der = ssl.PEM_cert_to_DER_cert(text[begin:end])
        _, tbs_start, tbs_stop = _der_element(der, _der_element(der, 0)[1])
        fields = _der_children(der, tbs_start, tbs_stop)
        if fields and fields[0][0] == 0xA0:  # the optional [0] version
            fields = fields[1:]
        _, validity_start, validity_end = fields[3]  # serialNumber, signature, issuer, validity
        _, (tag, start, stop) = _der_children(der, validity_start, validity_end)
        return _der_time(tag, der[start:stop].decode("ascii"))
    except (OSError, UnicodeDecodeError, ValueError, IndexError):
        return None


def _der_element(der: bytes, offset: int) -> tuple[int, int, int]:
    """(tag, offset of its content, offset past its content) of the DER element at ``offset``."""
    tag, length = der[offset], der[offset + 1]
    start = offset + 2
    if length & 0x80:
        count = length & 0x7F
        length = int.from_bytes(der[start : start + count], "big")
        start += count
    if start + length > len(der):
        raise ValueError("DER element runs past the end")
    return tag, start, start + length


def _der_children(der: bytes, start: int, stop: int) -> list[tuple[int, int, int]]:
    """The elements between ``start`` and ``stop``: a constructed element's content."""
    children = []
    while start < stop:
        element = _der_element(der, start)
        children.append(element)
        start = element[2]
    return children


def _der_time(tag: int, text: str) -> float:
    """UTCTime (YYMMDDHHMMSSZ, years 1950-2049) or GeneralizedTime (YYYYMMDDHHMMSSZ), both UTC, as RFC 5280 says."""
    if tag == 0x17:
        year = int(text[:2])
        text = f"{19 if year >= 50 else 20}{text}"
    elif tag != 0x18:
        raise ValueError(f"not a DER time: tag {tag:#x}")
    return float(calendar.timegm(time.strptime(text, "%Y%m%d%H%M%SZ")))


FileStamp = tuple[int, int, int] | None  # (mtime ns, size, inode) of the file a path resolves to


class ReloadingServerTLS:
    """A server TLS context whose certificate, key and client CA follow their files.

    cert-manager rotates a mounted Secret by swapping a symlink; ``reload_if_changed`` notices the new
    files and builds a fresh context, and every later handshake uses it (``context`` is what the server
    asks at each handshake). A session ticket or cached session belongs to the context that made it, so
    after a rotation no session from before it resumes: a client the new CA did not sign cannot get back
    in. Connections already open keep the session they negotiated, so streams survive. A bad new file is
    logged by the caller and the old context stays in use.
    """

    def __init__(self, cert: Path, key: Path, client_ca: Path | None) -> None:
        self._files = (cert, key, client_ca)
        self._stamps = self._stamp_all()
        self.current = server_context(cert, key, client_ca)
        self.expiry = certificate_expiry(cert)  # of the certificate ``current`` serves, for /metrics

    def context(self) -> ssl.SSLContext:
        """The context for a handshake starting now."""
        return self.current

    def _stamp_all(self) -> tuple[FileStamp, ...]:
        stamps: list[FileStamp] = []
        for path in self._files:
            if path is None:
                stamps.append(None)
                continue
            try:
                info = path.stat()
            except OSError:
                stamps.append(None)
            else:
                stamps.append((info.st_mtime_ns, info.st_size, info.st_ino))
        return tuple(stamps)

    def reload_if_changed(self) -> bool:
        """Swap in a context built from the files if any changed; raises ConfigError if they are bad."""
        stamps = self._stamp_all()
        if stamps == self._stamps:
            return False
        cert, key, client_ca = self._files
        assert cert is not None
        assert key is not None
        context = server_context(cert, key, client_ca)
        self._stamps = stamps
        self.current = context
        self.expiry = certificate_expiry(cert)
        return True
