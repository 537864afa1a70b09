"""gpuscaler_tls_certificate_expiry_timestamp_seconds: the served certificate's notAfter, following rotations."""

from __future__ import annotations

import datetime
import os
from pathlib import Path

import trustme

from gpuscaler.tls import certificate_expiry
from tests.conftest import StartAgent
from tests.server.test_telemetry import scrape
from tests.waiting import until_result

EXPIRY = "gpuscaler_tls_certificate_expiry_timestamp_seconds"


def write_cert(ca: trustme.CA, directory: Path, not_after: datetime.datetime) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 valid until ``not_after``, as tls.crt and tls.key in ``directory``."""
    issued = ca.issue_cert("127.0.0.1", not_after=not_after)
    cert, key = directory / "tls.crt", directory / "tls.key"
    issued.private_key_pem.write_to_path(str(key))
    cert.write_bytes(b"".join(blob.bytes() for blob in issued.cert_chain_pems))
    return cert, key


def test_expiry_is_read_from_utc_and_generalized_times(tmp_path: Path) -> None:
    """notAfter before 2050 (UTCTime) and after it (GeneralizedTime) both come back as Unix seconds."""
    ca = trustme.CA()
    for when in (
        datetime.datetime(2031, 5, 6, 7, 8, 9, tzinfo=datetime.UTC),
        datetime.datetime(2061, 1, 2, 3, 4, 5, tzinfo=datetime.UTC),
    ):
        cert, _ = write_cert(ca, tmp_path, when)
        assert certificate_expiry(cert) == when.timestamp()


def test_expiry_of_a_file_that_is_no_certificate_is_none(tmp_path: Path) -> None:
    """A missing file, a file without a certificate and a truncated one read as None, never as a time."""
    path = tmp_path / "tls.crt"
    assert certificate_expiry(path) is None
    path.write_text("not a certificate\n")
    assert certificate_expiry(path) is None
    path.write_text("-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n")
    assert certificate_expiry(path) is None


async def test_agent_exports_the_served_expiry_and_follows_a_rotation(start_agent: StartAgent, tmp_path: Path) -> None:
    """With --tls-cert, /metrics has the certificate's notAfter; a rotated file moves it at the next reload."""
    ca = trustme.CA()
    first = datetime.datetime(2031, 1, 1, tzinfo=datetime.UTC)
    cert, key = write_cert(ca, tmp_path, first)
    agent = await start_agent("--tls-cert", str(cert), "--tls-key", str(key), "--tls-reload-interval", "0.1")
    [sample] = (await scrape(agent))[EXPIRY]
    assert sample.value == first.timestamp()

    renewed = datetime.datetime(2032, 6, 1, tzinfo=datetime.UTC)
    staged = tmp_path / "staged"
    staged.mkdir()
    new_cert, new_key = write_cert(ca, staged, renewed)
    os.replace(new_key, key)  # key first: a pair caught halfway keeps the old one, and the next check takes both
    os.replace(new_cert, cert)
    series = await until_result(lambda: scrape(agent), lambda s: s[EXPIRY][0].value == renewed.timestamp(), timeout=10)
    assert series[EXPIRY][0].value == renewed.timestamp()


async def test_plaintext_agent_has_no_expiry_series(start_agent: StartAgent) -> None:
    """Without TLS there is no certificate, and no series (not a 0 that would read as long expired)."""
    agent = await start_agent()
    assert EXPIRY not in await scrape(agent)
