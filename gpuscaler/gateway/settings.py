"""The gateway's settings: one frozen object from flags and ``GPUSCALER_*`` variables, checked once at start.

``--listen``, the TLS flags, the log flags and ``--drain-timeout`` mean what they mean for ``serve``.
Each error names the flag (and the variable, when the value came from one) and what is allowed.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from gpuscaler.durations import parse_duration
from gpuscaler.errors import ConfigError
from gpuscaler.flags import (
    DEFAULT_DRAIN_TIMEOUT_SECONDS,
    DEFAULT_LISTEN,
    DEFAULT_METRICS_LISTEN,
    DEFAULT_TLS_RELOAD_INTERVAL_SECONDS,
    Address,
    add_flags,
    checked_log_options,
    flag_error,
    optional_path,
    paired,
    parse_address,
    parse_seconds,
    server_tls_files,
)
from gpuscaler.gateway.discovery import DEFAULT_RESOLVE_INTERVAL_SECONDS, read_agents_file
from gpuscaler.logs import LOG_LEVELS, LogFormat

DEFAULT_GATEWAY_HISTORY = "2m"
POD_DIRECTORY_KUBERNETES = "kubernetes"


@dataclass(frozen=True, slots=True)
class GatewaySettings:
    listen: Address
    agents: tuple[Address, ...]
    agents_dns: Address | None
    agents_file: Path | None
    resolve_interval_seconds: float
    history_seconds: float
    pod_directory: str | None  # "kubernetes", a path to a static file, or None
    agent_tls_ca: Path | None
    agent_tls_cert: Path | None
    agent_tls_key: Path | None
    agent_tls_server_name: str | None
    tls_cert: Path | None
    tls_key: Path | None
    tls_client_ca: Path | None
    tls_reload_interval_seconds: float
    log_format: LogFormat
    log_level: str
    drain_timeout_seconds: float
    metrics_listen: Address | None = None


# flag -> (environment variable, default, help)
GATEWAY_FLAGS: Mapping[str, tuple[str, str | None, str]] = {
    "--listen": ("LISTEN", DEFAULT_LISTEN, "HOST:PORT for gRPC (ExternalScaler, Agent, Health); KEDA's scalerAddress"),
    "--agents": ("AGENTS", None, "a static list of agents, HOST:PORT,HOST:PORT (compose, tests)"),
    "--agents-dns": (
        "AGENTS_DNS",
        None,
        "NAME:PORT of the agents' headless Service; every address NAME resolves to is an agent",
    ),
    "--agents-file": (
        "AGENTS_FILE",
        None,
        "a file of agents, one HOST:PORT per line ('#' starts a comment), re-read when it changes",
    ),
    "--resolve-interval": (
        "RESOLVE_INTERVAL",
        str(DEFAULT_RESOLVE_INTERVAL_SECONDS),
        "seconds between DNS lookups of --agents-dns (and checks of --agents-file), 0.5 to 300",
    ),
    "--history": ("HISTORY", DEFAULT_GATEWAY_HISTORY, "how much of each node's history to keep for windows"),
    "--pod-directory": (
        "POD_DIRECTORY",
        None,
        "where pod labels and owners come from: kubernetes (a pod watch), or a static YAML file; "
        "needed by workload and podSelector queries",
    ),
    "--agent-tls-ca": ("AGENT_TLS_CA", None, "PEM CA bundle to verify agents that serve TLS; turns TLS to agents on"),
    "--agent-tls-cert": ("AGENT_TLS_CERT", None, "PEM client certificate for agents that require mTLS"),
    "--agent-tls-key": ("AGENT_TLS_KEY", None, "PEM private key of --agent-tls-cert"),
    "--agent-tls-server-name": (
        "AGENT_TLS_SERVER_NAME",
        None,
        "name to verify in the agents' certificates (they are dialled by IP)",
    ),
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
}


def add_gateway_flags(parser: argparse.ArgumentParser, environ: Mapping[str, str]) -> None:
    add_flags(parser, GATEWAY_FLAGS, environ)


def gateway_settings_from_args(args: argparse.Namespace, environ: Mapping[str, str]) -> GatewaySettings:
    """Check every value; ConfigError names the first bad one."""

    fail = flag_error(GATEWAY_FLAGS, environ)

    def refusal(flag: str, value: str) -> Callable[[str], ConfigError]:
        return lambda allowed: fail(flag, value, allowed)

    listen = parse_address(args.listen, refusal("--listen", args.listen))

    agents: tuple[Address, ...] = ()
    if args.agents:
        items = [item.strip() for item in args.agents.split(",")]
        if any(not item for item in items):
            raise fail("--agents", args.agents, "has an empty entry; use HOST:PORT,HOST:PORT")
        agents = tuple(dict.fromkeys(parse_address(item, refusal("--agents", args.agents)) for item in items))
        if any(agent.port == 0 for agent in agents):
            raise fail("--agents", args.agents, "every agent needs its port (not 0)")
    agents_dns = None
    if args.agents_dns:
        agents_dns = parse_address(args.agents_dns, refusal("--agents-dns", args.agents_dns))
        if agents_dns.port == 0:
            raise fail("--agents-dns", args.agents_dns, "give the agents' gRPC port, e.g. gpuscaler-agents:6000")
    agents_file = optional_path(args.agents_file)
    if agents_file is not None:
        try:
            read_agents_file(agents_file)
        except ConfigError as error:
            raise fail("--agents-file", args.agents_file, str(error)) from None
    given = [
        flag
        for flag, value in (("--agents", agents), ("--agents-dns", agents_dns), ("--agents-file", agents_file))
        if value
    ]
    if len(given) > 1:
        raise ConfigError(
            f"{' and '.join(given)} are both set; use one: the DNS name in a cluster, a list or file elsewhere"
        )
    if not given:
        raise ConfigError(
            "no agents: set --agents-dns NAME:PORT (a headless Service), --agents HOST:PORT,... or --agents-file PATH"
        )

    resolve = parse_seconds(args.resolve_interval, refusal("--resolve-interval", args.resolve_interval))
    if not 0.5 <= resolve <= 300:
        raise fail("--resolve-interval", args.resolve_interval, "must be between 0.5 and 300 seconds")

    try:
        history = parse_duration(args.history)
    except ValueError as error:
        raise fail("--history", args.history, str(error)) from None
    if not 1 <= history <= 24 * 3600:
        raise fail("--history", args.history, "must be between 1s and 24h")

    pod_directory = args.pod_directory or None
    if pod_directory not in (None, POD_DIRECTORY_KUBERNETES) and not Path(pod_directory).is_file():
        raise fail("--pod-directory", args.pod_directory, "use 'kubernetes', or the path of a static YAML file")

    agent_ca, agent_cert, agent_key = (
        optional_path(args.agent_tls_ca),
        optional_path(args.agent_tls_cert),
        optional_path(args.agent_tls_key),
    )
    paired(agent_cert, agent_key, "--agent-tls-cert", "--agent-tls-key")
    if agent_cert is not None and agent_ca is None:
        raise ConfigError("--agent-tls-cert needs --agent-tls-ca (the CA that signed the agents' certificates)")

    cert, key, client_ca = server_tls_files(args)
    reload_interval = parse_seconds(
        args.tls_reload_interval, refusal("--tls-reload-interval", args.tls_reload_interval)
    )
    if not 0.1 <= reload_interval <= 3600:
        raise fail("--tls-reload-interval", args.tls_reload_interval, "must be between 0.1 and 3600 seconds")

    log_format = checked_log_options(args, fail)
    drain = parse_seconds(args.drain_timeout, refusal("--drain-timeout", args.drain_timeout))
    if not 0 < drain <= 300:
        raise fail("--drain-timeout", args.drain_timeout, "must be between 0 and 300 seconds")

    metrics_listen = None
    if args.metrics_listen and args.metrics_listen != "0":
        metrics_listen = parse_address(args.metrics_listen, refusal("--metrics-listen", args.metrics_listen))

    return GatewaySettings(
        listen=listen,
        agents=agents,
        agents_dns=agents_dns,
        agents_file=agents_file,
        resolve_interval_seconds=resolve,
        history_seconds=history,
        pod_directory=pod_directory,
        agent_tls_ca=agent_ca,
        agent_tls_cert=agent_cert,
        agent_tls_key=agent_key,
        agent_tls_server_name=args.agent_tls_server_name or None,
        tls_cert=cert,
        tls_key=key,
        tls_client_ca=client_ca,
        tls_reload_interval_seconds=reload_interval,
        log_format=log_format,
        log_level=args.log_level,
        drain_timeout_seconds=drain,
        metrics_listen=metrics_listen,
    )
