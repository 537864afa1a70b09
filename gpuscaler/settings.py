"""The agent's settings: one frozen object from flags and ``GPUSCALER_*`` variables, checked once at start.

Each error names the flag (and the variable, when the value came from one) and what is allowed.
"""

from __future__ import annotations

import argparse
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from gpuscaler.durations import parse_duration
from gpuscaler.flags import (
    DEFAULT_DRAIN_TIMEOUT_SECONDS,
    DEFAULT_LISTEN,
    DEFAULT_METRICS_LISTEN,
    DEFAULT_TLS_RELOAD_INTERVAL_SECONDS,
    ENV_PREFIX,
    Address,
    add_flags,
    checked_log_options,
    flag_error,
    optional_path,
    parse_address,
    parse_seconds,
    server_tls_files,
)
from gpuscaler.logs import LOG_LEVELS, LogFormat
from gpuscaler.poller import (
    DEFAULT_POLL_INTERVAL_SECONDS,
    MAX_POLL_INTERVAL_SECONDS,
    MIN_POLL_INTERVAL_SECONDS,
)

DEFAULT_HISTORY = "10m"
DEFAULT_FAKE_GPUS = 4
DEFAULT_POD_RESOURCES_SOCKET = "/var/lib/kubelet/pod-resources/kubelet.sock"
DEFAULT_POD_RESOURCES_INTERVAL_SECONDS = 1.0
MAX_FAKE_GPUS = 1024

Collector = Literal["nvml", "fake"]


@dataclass(frozen=True, slots=True)
class ServeSettings:
    collector: Collector
    listen: Address
    poll_interval_seconds: float
    history_seconds: float
    fake_gpus: int
    fake_scenario: Path | None
    tls_cert: Path | None
    tls_key: Path | None
    tls_client_ca: Path | None
    log_format: LogFormat
    log_level: str
    drain_timeout_seconds: float
    node_name: str
    metrics_listen: Address | None = None
    tls_reload_interval_seconds: float = DEFAULT_TLS_RELOAD_INTERVAL_SECONDS
    pod_resources_socket: Path | None = None
    # Not a flag: a kubelet List is cheap, and one second is "within one refresh" for every use we know.
    pod_resources_interval_seconds: float = DEFAULT_POD_RESOURCES_INTERVAL_SECONDS


# flag -> (environment variable, default, help)
SERVE_FLAGS: Mapping[str, tuple[str, str | None, str]] = {
    "--collector": ("COLLECTOR", "nvml", "where samples come from: nvml (the GPUs) or fake"),
    "--listen": ("LISTEN", DEFAULT_LISTEN, "HOST:PORT for gRPC (ExternalScaler, Agent, Health)"),
    "--poll-interval": (
        "POLL_INTERVAL",
        str(DEFAULT_POLL_INTERVAL_SECONDS),
        f"seconds between samples, {MIN_POLL_INTERVAL_SECONDS:g} to {MAX_POLL_INTERVAL_SECONDS:g}",
    ),
    "--history": ("HISTORY", DEFAULT_HISTORY, "how much history to keep for windows, e.g. 10m"),
    "--fake-gpus": ("FAKE_GPUS", str(DEFAULT_FAKE_GPUS), "number of fake GPUs (with --collector fake)"),
    "--fake-scenario": ("FAKE_SCENARIO", None, "YAML or JSON file of fake GPU values (see docs)"),
    "--tls-cert": ("TLS_CERT", None, "PEM server certificate; turns TLS on"),
    "--tls-key": ("TLS_KEY", None, "PEM private key of --tls-cert"),
    "--tls-client-ca": ("TLS_CLIENT_CA", None, "PEM CA bundle; clients must present a certificate it signed"),
    "--log-format": ("LOG_FORMAT", None, "json or console (default: console on a terminal, else json)"),
    "--log-level": ("LOG_LEVEL", "info", "one of " + ", ".join(LOG_LEVELS)),
    "--metrics-listen": (
        "METRICS_LISTEN",
        DEFAULT_METRICS_LISTEN,
        "HOST:PORT for Prometheus /metrics; empty turns it off",
    ),
    "--tls-reload-interval": (
        "TLS_RELOAD_INTERVAL",
        str(DEFAULT_TLS_RELOAD_INTERVAL_SECONDS),
        "seconds between checks of the TLS files for a rotated certificate",
    ),
    "--pod-resources-socket": (
        "POD_RESOURCES_SOCKET",
        DEFAULT_POD_RESOURCES_SOCKET,
        "the kubelet's PodResources socket, for which pods hold which GPUs; empty turns attribution off",
    ),
    "--drain-timeout": (
        "DRAIN_TIMEOUT",
        str(DEFAULT_DRAIN_TIMEOUT_SECONDS),
        "seconds to end streams and finish calls on SIGTERM before exiting",
    ),
}


def env_name(flag: str) -> str:
    return ENV_PREFIX + SERVE_FLAGS[flag][0]


def add_serve_flags(parser: argparse.ArgumentParser, environ: Mapping[str, str]) -> None:
    add_flags(parser, SERVE_FLAGS, environ)


def settings_from_args(args: argparse.Namespace, environ: Mapping[str, str]) -> ServeSettings:
    """Check every value; ConfigError names the first bad one."""
    fail = flag_error(SERVE_FLAGS, environ)

    collector = args.collector
    if collector not in ("nvml", "fake"):
        raise fail("--collector", collector, "use nvml or fake")

    listen = parse_address(args.listen, lambda allowed: fail("--listen", args.listen, allowed))

    poll = parse_seconds(args.poll_interval, lambda allowed: fail("--poll-interval", args.poll_interval, allowed))
    if not MIN_POLL_INTERVAL_SECONDS <= poll <= MAX_POLL_INTERVAL_SECONDS:
        raise fail(
            "--poll-interval",
            args.poll_interval,
            f"must be between {MIN_POLL_INTERVAL_SECONDS:g} and {MAX_POLL_INTERVAL_SECONDS:g} seconds",
        )

    try:
        history = parse_duration(args.history)
    except ValueError as error:
        raise fail("--history", args.history, str(error)) from None
    if history < poll or history > 24 * 3600:
        raise fail("--history", args.history, f"must be between one poll interval ({poll:g}s) and 24h")

    try:
        fake_gpus = int(args.fake_gpus)
    except ValueError:
        raise fail("--fake-gpus", args.fake_gpus, "must be a whole number") from None
    if not 0 <= fake_gpus <= MAX_FAKE_GPUS:
        raise fail("--fake-gpus", args.fake_gpus, f"must be between 0 and {MAX_FAKE_GPUS}")
    if args.fake_scenario and collector != "fake":
        raise fail("--fake-scenario", args.fake_scenario, "needs --collector fake")

    cert, key, client_ca = server_tls_files(args)

    log_format = checked_log_options(args, fail)

    drain = parse_seconds(args.drain_timeout, lambda allowed: fail("--drain-timeout", args.drain_timeout, allowed))
    if not 0 < drain <= 300:
        raise fail("--drain-timeout", args.drain_timeout, "must be above 0 and at most 300 seconds")

    metrics_listen = None
    if args.metrics_listen and args.metrics_listen != "0":
        metrics_listen = parse_address(
            args.metrics_listen, lambda allowed: fail("--metrics-listen", args.metrics_listen, allowed)
        )
    reload_interval = parse_seconds(
        args.tls_reload_interval, lambda allowed: fail("--tls-reload-interval", args.tls_reload_interval, allowed)
    )
    if not 0.1 <= reload_interval <= 3600:
        raise fail("--tls-reload-interval", args.tls_reload_interval, "must be between 0.1 and 3600 seconds")

    return ServeSettings(
        collector=collector,
        listen=listen,
        poll_interval_seconds=poll,
        history_seconds=history,
        fake_gpus=fake_gpus,
        fake_scenario=optional_path(args.fake_scenario),
        tls_cert=cert,
        tls_key=key,
        tls_client_ca=client_ca,
        log_format=log_format,
        log_level=args.log_level,
        drain_timeout_seconds=drain,
        # The chart sets NODE_NAME from spec.nodeName. Without it, the host name still tells two machines
        # apart, where a shared constant made a gateway merge their GPUs into one node.
        node_name=environ.get("NODE_NAME") or socket.gethostname(),
        metrics_listen=metrics_listen,
        tls_reload_interval_seconds=reload_interval,
        pod_resources_socket=optional_path(args.pod_resources_socket),
    )
