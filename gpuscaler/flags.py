"""Flags and ``GPUSCALER_*`` variables, as every command reads them: addresses, seconds, paths, TLS files, logs.

A flag table maps each flag to its variable (without the prefix), its default and its help; ``add_flags``
makes argparse flags of it, and every error names the flag (and the variable, when the value came from one)
and what is allowed.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from gpuscaler.errors import ConfigError
from gpuscaler.logs import LOG_LEVELS, LogFormat, default_format

ENV_PREFIX = "GPUSCALER_"
# Defaults both servers (the agent and the gateway) share.
DEFAULT_LISTEN = "0.0.0.0:6000"
DEFAULT_DRAIN_TIMEOUT_SECONDS = 5.0
DEFAULT_TLS_RELOAD_INTERVAL_SECONDS = 10.0
DEFAULT_METRICS_LISTEN = "0.0.0.0:9402"
Refusal = Callable[[str], ConfigError]  # builds the error for a bad value, given what is allowed
FlagTable = Mapping[str, tuple[str, str | None, str]]  # flag -> (variable without prefix, default, help)


@dataclass(frozen=True, slots=True)
class Address:
    """A HOST:PORT to listen on or dial."""

    host: str
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def add_flags(parser: argparse.ArgumentParser, flags: FlagTable, environ: Mapping[str, str]) -> None:
    """Each flag of ``flags``, defaulting to its GPUSCALER_* variable, then to its own default."""
    for flag, (env, default, help_text) in flags.items():
        variable = ENV_PREFIX + env
        parser.add_argument(
            flag,
            dest=flag[2:].replace("-", "_"),
            default=environ.get(variable, default),
            metavar=flag[2:].replace("-", "_").upper(),
            help=f"{help_text} [env {variable}]" + (f" (default {default})" if default else ""),
        )


def flag_error(flags: FlagTable, environ: Mapping[str, str]) -> Callable[[str, object, str], ConfigError]:
    """Builds ConfigErrors naming the flag, and the variable when the bad value came from it."""

    def fail(flag: str, value: object, allowed: str) -> ConfigError:
        variable = ENV_PREFIX + flags[flag][0]
        source = f" (from {variable})" if environ.get(variable) == value else ""
        return ConfigError(f"{flag}{source} {value!r}: {allowed}")

    return fail


def parse_address(text: str, error: Refusal) -> Address:
    """``HOST:PORT`` or ``[IPv6]:PORT``; ``error(allowed)`` builds the exception to raise."""
    host, sep, port_text = text.rpartition(":")
    if not sep or not host:
        raise error("use HOST:PORT, e.g. 0.0.0.0:6000 or [::]:6000")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise error("the port must be a number from 0 to 65535")
    return Address(host, int(port_text))


def server_tls_files(args: argparse.Namespace) -> tuple[Path | None, Path | None, Path | None]:
    """--tls-cert, --tls-key and --tls-client-ca, checked to make sense together (shared with the gateway)."""
    cert, key, client_ca = (
        optional_path(args.tls_cert),
        optional_path(args.tls_key),
        optional_path(args.tls_client_ca),
    )
    paired(cert, key, "--tls-cert", "--tls-key")
    if client_ca is not None and cert is None:
        raise ConfigError("--tls-client-ca needs --tls-cert and --tls-key (mTLS is TLS plus client certificates)")
    return cert, key, client_ca


def checked_log_options(args: argparse.Namespace, fail: Callable[[str, object, str], ConfigError]) -> LogFormat:
    """The log format (console on a terminal by default), after checking --log-format and --log-level."""
    log_format = args.log_format or default_format()
    if log_format not in ("json", "console"):
        raise fail("--log-format", log_format, "use json or console")
    if args.log_level not in LOG_LEVELS:
        raise fail("--log-level", args.log_level, "use one of " + ", ".join(LOG_LEVELS))
    return log_format


def parse_seconds(text: str, error: Refusal) -> float:
    """A finite number of seconds; ``error(allowed)`` builds the exception to raise."""
    try:
        value = float(text)
    except ValueError:
        raise error("must be a number of seconds") from None
    if not math.isfinite(value):
        raise error("must be a finite number of seconds")
    return value


def optional_path(text: str | None) -> Path | None:
    """A path, or None for an unset or empty flag (an empty variable turns a path off)."""
    return Path(text) if text else None


def paired(cert: Path | None, key: Path | None, cert_flag: str, key_flag: str) -> None:
    """A certificate and its key: both or neither, or ConfigError naming the two flags."""
    if (cert is None) != (key is None):
        raise ConfigError(f"{cert_flag} and {key_flag} go together; give both or neither")
