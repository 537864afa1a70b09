"""The gateway's settings: one frozen object from flags and ``GPUSCALER_*`` variables, checked once at start.

``--listen``, the TLS flags, ``--metrics-listen``, the log flags and ``--drain-timeout`` mean what they mean
for ``serve`` (``flags.SERVER_FLAGS``). Each error names the flag (and the variable, when the value came from
one) and what is allowed.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from gpuscaler.flags import (
    SERVER_FLAGS,
    Address,
    FlagTable,
    ServerFlags,
    add_flags,
    address_flag,
    count_flag,
    duration_flag,
    flag_error,
    optional_path,
    paired,
    parse_address,
    seconds_flag,
    server_flags,
)
from gpuscaler.gateway.discovery import DEFAULT_RESOLVE_INTERVAL_SECONDS, read_agents_file
from gpuscaler.gateway.engines.limits import DEFAULT_SCRAPE_LIMITS, ScrapeLimits
from gpuscaler.model.durations import format_duration
from gpuscaler.model.errors import ConfigError

DEFAULT_GATEWAY_HISTORY = "2m"
POD_DIRECTORY_KUBERNETES = "kubernetes"


@dataclass(frozen=True, slots=True)
class GatewaySettings:
    """Everything ``gpuscaler gateway`` was told."""

    server: ServerFlags
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
    engine_scrapes: ScrapeLimits = DEFAULT_SCRAPE_LIMITS
    # (namespace, name) of the ServiceAccount whose short-lived token the EPP pods alone receive; None: no token.
    epp_metrics_token_service_account: tuple[str, str] | None = None
    # The namespaces whose InferencePools are trusted to name who receives that token; empty: none.
    epp_namespaces: tuple[str, ...] = ()
    # (namespace, name, uid) of the gateway's own pod, from the downward API (the chart sets POD_NAMESPACE, POD_NAME
    # and POD_UID): the EPP's token is bound to it, so it dies with the pod; None outside a cluster.
    own_pod: tuple[str, str, str] | None = None


GATEWAY_FLAGS: FlagTable = {
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
    "--history": ("HISTORY", DEFAULT_GATEWAY_HISTORY, "the longest window a query may ask for (each agent reduces it)"),
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
    "--engine-scrape-timeout": (
        "ENGINE_SCRAPE_TIMEOUT",
        str(DEFAULT_SCRAPE_LIMITS.timeout_seconds),
        "seconds one read of a pod's engine metrics page may take, 0.1 to 30",
    ),
    "--engine-max-page-bytes": (
        "ENGINE_MAX_PAGE_BYTES",
        str(DEFAULT_SCRAPE_LIMITS.max_page_bytes),
        "the largest engine metrics page read; a larger one is an error for that pod (64 KiB to 64 MiB)",
    ),
    "--engine-scrape-concurrency": (
        "ENGINE_SCRAPE_CONCURRENCY",
        str(DEFAULT_SCRAPE_LIMITS.concurrency),
        "engine metrics pages read at once, 1 to 1024",
    ),
    "--engine-min-scrape-interval": (
        "ENGINE_MIN_SCRAPE_INTERVAL",
        format_duration(DEFAULT_SCRAPE_LIMITS.min_interval_seconds),
        "the shortest scrapeInterval a query may ask, 100ms to 1m; a shorter one is refused",
    ),
    "--engine-max-pods-per-selection": (
        "ENGINE_MAX_PODS_PER_SELECTION",
        str(DEFAULT_SCRAPE_LIMITS.max_pods),
        "the most Ready pods one engine query may read, 1 to 100000; a larger selection is refused",
    ),
    "--engine-max-label-sets": (
        "ENGINE_MAX_LABEL_SETS",
        str(DEFAULT_SCRAPE_LIMITS.max_label_sets),
        "the most label sets an engine page may give one series the signals read, 16 to 1000000; more is an error "
        "for that pod",
    ),
    "--epp-metrics-token-service-account": (
        "EPP_METRICS_TOKEN_SERVICE_ACCOUNT",
        None,
        "NAMESPACE/NAME of a ServiceAccount allowed only 'get' on /metrics: its short-lived token is sent to the "
        "pods of the EPP an InferencePool's endpointPickerRef names, and to no other pod (off when unset)",
    ),
    "--epp-namespaces": (
        "EPP_NAMESPACES",
        None,
        "NS1,NS2: the namespaces whose InferencePools may name the pods that receive the EPP's token (needed with "
        "--epp-metrics-token-service-account); an InferencePool elsewhere gets its EPP read without one",
    ),
    **SERVER_FLAGS,
}

# A Kubernetes object name (RFC 1123 subdomain), as ServiceAccounts are named.
_OBJECT_NAME = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?")
# A namespace's name (RFC 1123 label).
_NAMESPACE = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")


def add_gateway_flags(parser: argparse.ArgumentParser, environ: Mapping[str, str]) -> None:
    """Add the ``gateway`` command's flags to ``parser``, each defaulting to its GPUSCALER_* variable in ``environ``."""
    add_flags(parser, GATEWAY_FLAGS, environ)


def gateway_settings_from_args(args: argparse.Namespace, environ: Mapping[str, str]) -> GatewaySettings:
    """Check every value; ConfigError names the first bad one."""
    fail = flag_error(GATEWAY_FLAGS, environ)
    server = server_flags(args, fail)

    agents: tuple[Address, ...] = ()
    if args.agents:
        items = [item.strip() for item in args.agents.split(",")]
        if any(not item for item in items):
            raise fail("--agents", args.agents, "has an empty entry; use HOST:PORT,HOST:PORT")
        agents = tuple(dict.fromkeys(parse_address(item, lambda a: fail("--agents", args.agents, a)) for item in items))
        if any(agent.port == 0 for agent in agents):
            raise fail("--agents", args.agents, "every agent needs its port (not 0)")
    agents_dns = None
    if args.agents_dns:
        agents_dns = address_flag(args.agents_dns, "--agents-dns", fail)
        if agents_dns.port == 0:
            raise fail("--agents-dns", args.agents_dns, "give the agents' gRPC port, e.g. gpuscaler-agents:6000")
    agents_file = optional_path(args.agents_file)
    if agents_file is not None:
        try:
            read_agents_file(agents_file)
        except ConfigError as error:
            raise fail("--agents-file", args.agents_file, str(error)) from None
    sources = (("--agents", agents), ("--agents-dns", agents_dns), ("--agents-file", agents_file))
    given = [flag for flag, value in sources if value]
    if len(given) > 1:
        raise ConfigError(
            f"{' and '.join(given)} are both set; use one: the DNS name in a cluster, a list or a file elsewhere"
        )
    if not given:
        raise ConfigError(
            "no agents: set --agents-dns NAME:PORT (a headless Service), --agents HOST:PORT,... or --agents-file PATH"
        )

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

    epp_token_account = None
    if args.epp_metrics_token_service_account:
        namespace, _, name = args.epp_metrics_token_service_account.partition("/")
        if not (_NAMESPACE.fullmatch(namespace) and _OBJECT_NAME.fullmatch(name)):
            raise fail(
                "--epp-metrics-token-service-account",
                args.epp_metrics_token_service_account,
                "use NAMESPACE/NAME of a ServiceAccount, e.g. gpuscaler/gpuscaler-epp-metrics",
            )
        if pod_directory != POD_DIRECTORY_KUBERNETES:
            raise ConfigError(
                "--epp-metrics-token-service-account needs --pod-directory kubernetes: the token goes only to pods "
                "the Kubernetes API says an InferencePool's endpointPickerRef names"
            )
        epp_token_account = (namespace, name)
    epp_namespaces: tuple[str, ...] = ()
    if args.epp_namespaces:
        items = [item.strip() for item in args.epp_namespaces.split(",")]
        bad = next((item for item in items if not _NAMESPACE.fullmatch(item)), None)
        if bad is not None:
            raise fail(
                "--epp-namespaces",
                args.epp_namespaces,
                f"{bad!r} is not a namespace name; use NS1,NS2 (lowercase letters, digits and '-', at most 63)",
            )
        epp_namespaces = tuple(dict.fromkeys(items))
        if epp_token_account is None:
            raise ConfigError(
                "--epp-namespaces needs --epp-metrics-token-service-account: it says whose InferencePools may "
                "name the pods that receive that token"
            )
    elif epp_token_account is not None:
        raise ConfigError(
            "--epp-metrics-token-service-account needs --epp-namespaces NS1,NS2: the namespaces whose InferencePools "
            "are trusted to name the pods that receive the token (anyone who can create an InferencePool, a Service "
            "and a pod elsewhere could otherwise aim it at their own pod)"
        )

    return GatewaySettings(
        server=server,
        agents=agents,
        agents_dns=agents_dns,
        agents_file=agents_file,
        resolve_interval_seconds=seconds_flag(args.resolve_interval, "--resolve-interval", fail, 0.5, 300),
        history_seconds=duration_flag(args.history, "--history", fail, 1, 24 * 3600, "must be between 1s and 24h"),
        pod_directory=pod_directory,
        agent_tls_ca=agent_ca,
        agent_tls_cert=agent_cert,
        agent_tls_key=agent_key,
        agent_tls_server_name=args.agent_tls_server_name or None,
        engine_scrapes=ScrapeLimits(
            timeout_seconds=seconds_flag(args.engine_scrape_timeout, "--engine-scrape-timeout", fail, 0.1, 30),
            max_page_bytes=count_flag(
                args.engine_max_page_bytes, "--engine-max-page-bytes", fail, 64 * 1024, 64 * 1024 * 1024
            ),
            concurrency=count_flag(args.engine_scrape_concurrency, "--engine-scrape-concurrency", fail, 1, 1024),
            min_interval_seconds=duration_flag(
                args.engine_min_scrape_interval,
                "--engine-min-scrape-interval",
                fail,
                0.1,
                60,
                "must be between 100ms and 1m",
            ),
            max_pods=count_flag(
                args.engine_max_pods_per_selection, "--engine-max-pods-per-selection", fail, 1, 100_000
            ),
            max_label_sets=count_flag(args.engine_max_label_sets, "--engine-max-label-sets", fail, 16, 1_000_000),
        ),
        epp_metrics_token_service_account=epp_token_account,
        epp_namespaces=epp_namespaces,
        own_pod=_own_pod(environ),
    )


def _own_pod(environ: Mapping[str, str]) -> tuple[str, str, str] | None:
    """The gateway's pod (namespace, name, uid) from the downward API's variables; None unless all three are set."""
    own = (environ.get("POD_NAMESPACE", ""), environ.get("POD_NAME", ""), environ.get("POD_UID", ""))
    return (own[0], own[1], own[2]) if all(own) else None
