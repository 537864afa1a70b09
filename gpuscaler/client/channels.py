"""Our own grpclib client: channels (plain, TLS, mTLS) for the CLI and the tests."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from grpclib.client import Channel
from grpclib.config import Configuration

from gpuscaler.flags import Address, parse_address
from gpuscaler.model.errors import ConfigError
from gpuscaler.tls import client_context


@dataclass(frozen=True, slots=True)
class ClientOptions:
    """Where a client command connects, and its TLS files: TLS is on when a CA or a client certificate is given."""

    address: Address
    tls_ca: Path | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None
    server_name: str | None = None

    @property
    def tls(self) -> bool:
        return self.tls_ca is not None or self.tls_cert is not None


def client_address(text: str) -> Address:
    """The ``--address`` value as an Address; ConfigError naming the flag when it is not HOST:PORT."""
    return parse_address(text, lambda allowed: ConfigError(f"--address {text!r}: {allowed}"))


@contextlib.asynccontextmanager
async def open_channel(options: ClientOptions) -> AsyncIterator[Channel]:
    """A channel to ``options.address``, over TLS when the options ask for it, closed on leaving."""
    ssl = client_context(options.tls_ca, options.tls_cert, options.tls_key) if options.tls else None
    config = Configuration(ssl_target_name_override=options.server_name) if options.server_name else None
    channel = Channel(options.address.host, options.address.port, ssl=ssl, config=config)
    try:
        yield channel
    finally:
        channel.close()
