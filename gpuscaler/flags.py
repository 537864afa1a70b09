"""Flags and ``GPUSCALER_*`` variables, as every command reads them: addresses, seconds, paths, TLS files, logs.

A flag table maps each flag to its variable (without the prefix), its default and its help; ``add_flags``
makes argparse flags of it, and every error names the flag (and the variable, when the value came from one)
and what is allowed. ``SERVER_FLAGS`` are the flags both servers (``serve`` and ``gateway``) share, read
into one ``ServerFlags``; its ``ConnectionLimits`` are what one gRPC peer may hold or send (docs/security.md).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from gpuscaler.logs import LOG_LEVELS, LogFormat, default_format
from gpuscaler.model.durations import DurationError, parse_duration
from gpuscaler.model.errors import ConfigError

ENV_PREFIX = "GPUSCALER_"
DEFAULT_LISTEN = "0.0.0.0:6000"
DEFAULT_DRAIN_TIMEOUT_SECONDS = 5.0
DEFAULT_TLS_RELOAD_INTERVAL_SECONDS = 10.0
DEFAULT_METRICS_LISTEN = "0.0.0.0:9402"
Refusal = Callable[[str], ConfigError]  # builds the error for a bad value, given what is allowed
FlagTable = Mapping[str, tuple[str, str | None, str]]  # flag -> (variable without prefix, default, help)


class Fail(Protocol):
    """Builds the error for ``flag``'s bad ``value``: ``--flag 'value': allowed``, or with ``reads_on``,
    ``--flag 'value' allowed``, for a reason that reads on from the value (``has no unit; write '600s'``)."""

    def __call__(self, flag: str, value: object, allowed: str, *, reads_on: bool = False) -> ConfigError: ...


@dataclass(frozen=True, slots=True)
class Address:
    """A HOST:PORT to listen on or dial."""

    host: str
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    """What one gRPC peer may hold or send before the server cuts it off; docs/security.md says why each default.

    The defaults fit KEDA, which sends every ScaledObject's calls and push streams over one connection per
    operator and metrics adapter, inside the chart's memory limit.
    """

    handshake_timeout_seconds: float = 10.0
    idle_timeout_seconds: float = 300.0
    max_connections: int = 256
    max_connections_per_peer: int = 32
    max_pending_connections: int = 64
    first_request_timeout_seconds: float = 5.0
    max_streams: int = 10_000
    request_timeout_seconds: float = 10.0
    max_resets_per_second: int = 100
    max_pings_per_second: int = 10
    write_buffer_limit_bytes: int = 1024 * 1024
    write_timeout_seconds: float = 30.0
    turn_calls: int = 2
    turn_bytes: int = 4 * 1024
    max_deadline_resets_per_second: int = 1000


DEFAULT_LIMITS = ConnectionLimits()


@dataclass(frozen=True, slots=True)
class ServerFlags:
    """What both servers read alike: where to listen, TLS and its reloads, /metrics, logs, and the drain."""

    listen: Address
    tls_cert: Path | None
    tls_key: Path | None
    tls_client_ca: Path | None
    tls_reload_interval_seconds: float
    metrics_listen: Address | None
    log_format: LogFormat
    log_level: str
    drain_timeout_seconds: float
    limits: ConnectionLimits = DEFAULT_LIMITS


SERVER_FLAGS: FlagTable = {
    "--listen": ("LISTEN", DEFAULT_LISTEN, "HOST:PORT for gRPC (ExternalScaler, Agent, Health)"),
    "--tls-cert": ("TLS_CERT", None, "PEM server certificate; turns TLS on"),
    "--tls-key": ("TLS_KEY", None, "PEM private key of --tls-cert"),
    "--tls-client-ca": ("TLS_CLIENT_CA", None, "PEM CA bundle; clients must present a certificate it signed"),
    "--tls-reload-interval": (
        "TLS_RELOAD_INTERVAL",
        str(DEFAULT_TLS_RELOAD_INTERVAL_SECONDS),
        "seconds between checks of the TLS files for a rotated certificate",
    ),
    "--metrics-listen": (
        "METRICS_LISTEN",
        DEFAULT_METRICS_LISTEN,
        "HOST:PORT for Prometheus /metrics and /healthz; empty turns it off",
    ),
    "--log-format": ("LOG_FORMAT", None, "json or console (default: console on a terminal, else json)"),
    "--log-level": ("LOG_LEVEL", "info", "one of " + ", ".join(LOG_LEVELS)),
    "--drain-timeout": (
        "DRAIN_TIMEOUT",
        str(DEFAULT_DRAIN_TIMEOUT_SECONDS),
        "seconds to end streams and finish calls on SIGTERM before exiting",
    ),
    "--handshake-timeout": (
        "HANDSHAKE_TIMEOUT",
        f"{DEFAULT_LIMITS.handshake_timeout_seconds:g}",
        "seconds a new connection has for its TLS handshake and HTTP/2 preface",
    ),
    "--idle-timeout": (
        "IDLE_TIMEOUT",
        f"{DEFAULT_LIMITS.idle_timeout_seconds:g}",
        "seconds a connection may hold no stream before it is sent GOAWAY and closed",
    ),
    "--max-connections": ("MAX_CONNECTIONS", str(DEFAULT_LIMITS.max_connections), "gRPC connections open at once"),
    "--max-connections-per-peer": (
        "MAX_CONNECTIONS_PER_PEER",
        str(DEFAULT_LIMITS.max_connections_per_peer),
        "gRPC connections open at once from one IP address",
    ),
    "--max-pending-connections": (
        "MAX_PENDING_CONNECTIONS",
        str(DEFAULT_LIMITS.max_pending_connections),
        "connections that have not yet sent a call (TLS handshake, preface, first request) held at once; "
        "past it a newcomer displaces the oldest such connection of its own address (refused while that one is "
        "under 1 s old) or, from an address holding none, of the address holding the most",
    ),
    "--first-request-timeout": (
        "FIRST_REQUEST_TIMEOUT",
        f"{DEFAULT_LIMITS.first_request_timeout_seconds:g}",
        "seconds a connection has after its HTTP/2 preface to start its first call",
    ),
    "--max-streams": (
        "MAX_STREAMS",
        str(DEFAULT_LIMITS.max_streams),
        "streams open at once over all connections; past it a new stream is refused (REFUSED_STREAM)",
    ),
    "--request-timeout": (
        "REQUEST_TIMEOUT",
        f"{DEFAULT_LIMITS.request_timeout_seconds:g}",
        "seconds a call's request message has to arrive after its headers",
    ),
    "--max-resets-per-second": (
        "MAX_RESETS_PER_SECOND",
        str(DEFAULT_LIMITS.max_resets_per_second),
        "streams a peer may reset per second (bursts of 10 s worth); more is GOAWAY ENHANCE_YOUR_CALM",
    ),
    "--max-pings-per-second": (
        "MAX_PINGS_PER_SECOND",
        str(DEFAULT_LIMITS.max_pings_per_second),
        "PING and SETTINGS frames a peer may send per second (bursts of 10 s worth, 2 more per call); "
        "more is GOAWAY ENHANCE_YOUR_CALM",
    ),
    "--write-buffer-limit": (
        "WRITE_BUFFER_LIMIT",
        str(DEFAULT_LIMITS.write_buffer_limit_bytes),
        "bytes of unsent output toward a peer past which its connection is not read until it drains",
    ),
    "--write-timeout": (
        "WRITE_TIMEOUT",
        f"{DEFAULT_LIMITS.write_timeout_seconds:g}",
        "seconds a connection's output may stay past --write-buffer-limit before it is closed",
    ),
    "--turn-calls": (
        "TURN_CALLS",
        str(DEFAULT_LIMITS.turn_calls),
        "calls one connection may start per turn of the event loop; the rest wait for its next turn",
    ),
    "--turn-bytes": (
        "TURN_BYTES",
        str(DEFAULT_LIMITS.turn_bytes),
        "bytes of one connection's input taken in per turn of the event loop; the rest wait for its next turn",
    ),
    "--max-deadline-resets-per-second": (
        "MAX_DEADLINE_RESETS_PER_SECOND",
        str(DEFAULT_LIMITS.max_deadline_resets_per_second),
        "resets of calls near their deadline one peer address may send per second (bursts of 10 s worth); "
        "more is GOAWAY ENHANCE_YOUR_CALM",
    ),
}


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


def flag_error(flags: FlagTable, environ: Mapping[str, str]) -> Fail:
    """Builds ConfigErrors naming the flag, and the variable when the bad value came from it."""

    def fail(flag: str, value: object, allowed: str, *, reads_on: bool = False) -> ConfigError:
        variable = ENV_PREFIX + flags[flag][0]
        source = f" (from {variable})" if environ.get(variable) == value else ""
        return ConfigError(f"{flag}{source} {value!r}{' ' if reads_on else ': '}{allowed}")

    return fail


def server_flags(args: argparse.Namespace, fail: Fail) -> ServerFlags:
    """The shared flags, each checked; ConfigError names the first bad one."""
    cert, key, client_ca = optional_path(args.tls_cert), optional_path(args.tls_key), optional_path(args.tls_client_ca)
    paired(cert, key, "--tls-cert", "--tls-key")
    if client_ca is not None and cert is None:
        raise ConfigError("--tls-client-ca needs --tls-cert and --tls-key (mTLS is TLS plus client certificates)")
    log_format = args.log_format or default_format()
    if log_format not in ("json", "console"):
        raise fail("--log-format", log_format, "use json or console")
    if args.log_level not in LOG_LEVELS:
        raise fail("--log-level", args.log_level, "use one of " + ", ".join(LOG_LEVELS))
    metrics = args.metrics_listen
    return ServerFlags(
        listen=address_flag(args.listen, "--listen", fail),
        tls_cert=cert,
        tls_key=key,
        tls_client_ca=client_ca,
        tls_reload_interval_seconds=seconds_flag(args.tls_reload_interval, "--tls-reload-interval", fail, 0.1, 3600),
        metrics_listen=address_flag(metrics, "--metrics-listen", fail) if metrics and metrics != "0" else None,
        log_format=log_format,
        log_level=args.log_level,
        drain_timeout_seconds=seconds_flag(args.drain_timeout, "--drain-timeout", fail, 0, 300, above=True),
        limits=connection_limits(args, fail),
    )


def connection_limits(args: argparse.Namespace, fail: Fail) -> ConnectionLimits:
    """The flags of ``ConnectionLimits``, each checked."""
    return ConnectionLimits(
        handshake_timeout_seconds=seconds_flag(args.handshake_timeout, "--handshake-timeout", fail, 0, 600, above=True),
        idle_timeout_seconds=seconds_flag(args.idle_timeout, "--idle-timeout", fail, 0, 86_400, above=True),
        max_connections=count_flag(args.max_connections, "--max-connections", fail, 1, 100_000),
        max_connections_per_peer=count_flag(
            args.max_connections_per_peer, "--max-connections-per-peer", fail, 1, 100_000
        ),
        max_pending_connections=count_flag(args.max_pending_connections, "--max-pending-connections", fail, 1, 100_000),
        first_request_timeout_seconds=seconds_flag(
            args.first_request_timeout, "--first-request-timeout", fail, 0, 600, above=True
        ),
        max_streams=count_flag(args.max_streams, "--max-streams", fail, 1, 1_000_000),
        request_timeout_seconds=seconds_flag(args.request_timeout, "--request-timeout", fail, 0, 600, above=True),
        max_resets_per_second=count_flag(args.max_resets_per_second, "--max-resets-per-second", fail, 1, 1_000_000),
        max_pings_per_second=count_flag(args.max_pings_per_second, "--max-pings-per-second", fail, 1, 1_000_000),
        write_buffer_limit_bytes=count_flag(
            args.write_buffer_limit, "--write-buffer-limit", fail, 64 * 1024, 1024 * 1024 * 1024
        ),
        write_timeout_seconds=seconds_flag(args.write_timeout, "--write-timeout", fail, 0, 3600, above=True),
        turn_calls=count_flag(args.turn_calls, "--turn-calls", fail, 1, 100_000),
        turn_bytes=count_flag(args.turn_bytes, "--turn-bytes", fail, 1024, 16 * 1024 * 1024),
        max_deadline_resets_per_second=count_flag(
            args.max_deadline_resets_per_second, "--max-deadline-resets-per-second", fail, 1, 1_000_000
        ),
    )


def parse_address(text: str, error: Refusal) -> Address:
    """``HOST:PORT`` or ``[IPv6]:PORT``; ``error(allowed)`` builds the exception to raise."""
    host, sep, port_text = text.rpartition(":")
    if not sep or not host:
        raise error("use HOST:PORT, e.g. 0.0.0.0:6000 or [::]:6000")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise error("the port must be a number from 0 to 65535")
    return Address(host, int(port_text))


def address_flag(text: str, flag: str, fail: Fail) -> Address:
    """``flag``'s HOST:PORT."""
    return parse_address(text, lambda allowed: fail(flag, text, allowed))


def count_flag(text: str, flag: str, fail: Fail, low: int, high: int) -> int:
    """``flag``'s whole number, from ``low`` to ``high``."""
    stripped = text.strip().replace("_", "")
    if not stripped.isdigit() or not low <= int(stripped) <= high:
        raise fail(flag, text, f"must be a whole number from {low:,} to {high:,}")
    return int(stripped)


def parse_seconds(text: str, error: Refusal) -> float:
    """A finite number of seconds; ``error(allowed)`` builds the exception to raise."""
    try:
        value = float(text)
    except ValueError:
        raise error("must be a number of seconds") from None
    if not math.isfinite(value):
        raise error("must be a finite number of seconds")
    return value


def seconds_flag(text: str, flag: str, fail: Fail, low: float, high: float, *, above: bool = False) -> float:
    """``flag``'s number of seconds, between ``low`` (excluded when ``above``) and ``high``."""
    value = parse_seconds(text, lambda allowed: fail(flag, text, allowed))
    if value > high or value < low or (above and value == low):
        bound = "above" if above else "between"
        raise fail(flag, text, f"must be {bound} {low:g} and {'at most ' if above else ''}{high:g} seconds")
    return value


def duration_flag(text: str, flag: str, fail: Fail, low: float, high: float, allowed: str) -> float:
    """``flag``'s duration (``30s``, ``10m``), between ``low`` and ``high`` seconds; ``allowed`` says so in words."""
    try:
        value = parse_duration(text)
    except DurationError as error:
        raise fail(flag, text, error.problem, reads_on=True) from None
    if not low <= value <= high:
        raise fail(flag, text, allowed)
    return value


def optional_path(text: str | None) -> Path | None:
    """A path, or None for an unset or empty flag (an empty variable turns a path off)."""
    return Path(text) if text else None


def paired(cert: Path | None, key: Path | None, cert_flag: str, key_flag: str) -> None:
    """A certificate and its key: both or neither, or ConfigError naming the two flags."""
    if (cert is None) != (key is None):
        raise ConfigError(f"{cert_flag} and {key_flag} go together; give both or neither")
