"""The agent's settings: one frozen object from flags and ``GPUSCALER_*`` variables, checked once at start.

Each error names the flag (and the variable, when the value came from one) and what is allowed.
"""

from __future__ import annotations

import argparse
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from gpuscaler.agent.attribution.devices import DEFAULT_DRA_DRIVERS
from gpuscaler.agent.attribution.processes import DEFAULT_PROC_ROOT
from gpuscaler.agent.poller import (
    DEFAULT_POLL_INTERVAL_SECONDS,
    MAX_POLL_INTERVAL_SECONDS,
    MIN_POLL_INTERVAL_SECONDS,
)
from gpuscaler.flags import (
    ENV_PREFIX,
    SERVER_FLAGS,
    Fail,
    FlagTable,
    ServerFlags,
    add_flags,
    duration_flag,
    flag_error,
    optional_path,
    seconds_flag,
    server_flags,
)

DEFAULT_HISTORY = "10m"
DEFAULT_FAKE_GPUS = 4
DEFAULT_POD_RESOURCES_SOCKET = "/var/lib/kubelet/pod-resources/kubelet.sock"
DEFAULT_POD_RESOURCES_INTERVAL_SECONDS = 1.0
MAX_FAKE_GPUS = 1024
# A DRA driver's name is a DNS subdomain (resource.k8s.io's rule for DeviceClass and ResourceSlice driver names).
_DRIVER_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
MAX_DRIVER_NAME = 63

Collector = Literal["nvml", "fake"]


@dataclass(frozen=True, slots=True)
class ServeSettings:
    """Everything ``gpuscaler serve`` was told."""

    collector: Collector
    server: ServerFlags
    poll_interval_seconds: float
    history_seconds: float
    fake_gpus: int
    fake_scenario: Path | None
    node_name: str
    pod_resources_socket: Path | None = None
    # Not a flag: a kubelet List is cheap, and one second is "within one refresh" for every use we know.
    pod_resources_interval_seconds: float = DEFAULT_POD_RESOURCES_INTERVAL_SECONDS
    processes: bool = False
    # Not a flag: in the host's PID namespace the container's /proc is the host's. Tests point it at a fixture tree.
    proc_root: Path = DEFAULT_PROC_ROOT
    dra_drivers: tuple[str, ...] = DEFAULT_DRA_DRIVERS


SERVE_FLAGS: FlagTable = {
    "--collector": ("COLLECTOR", "nvml", "where samples come from: nvml (the GPUs) or fake"),
    "--poll-interval": (
        "POLL_INTERVAL",
        str(DEFAULT_POLL_INTERVAL_SECONDS),
        f"seconds between samples, {MIN_POLL_INTERVAL_SECONDS:g} to {MAX_POLL_INTERVAL_SECONDS:g}",
    ),
    "--history": ("HISTORY", DEFAULT_HISTORY, "how much history to keep for windows, e.g. 10m"),
    "--fake-gpus": ("FAKE_GPUS", str(DEFAULT_FAKE_GPUS), "number of fake GPUs (with --collector fake)"),
    "--fake-scenario": ("FAKE_SCENARIO", None, "YAML or JSON file of fake GPU values (see docs)"),
    "--pod-resources-socket": (
        "POD_RESOURCES_SOCKET",
        DEFAULT_POD_RESOURCES_SOCKET,
        "the kubelet's PodResources socket, for which pods hold which GPUs; empty turns attribution off",
    ),
    "--dra-drivers": (
        "DRA_DRIVERS",
        ",".join(DEFAULT_DRA_DRIVERS),
        "comma-separated DRA drivers whose claimed devices are GPUs to attribute (their names as NVIDIA's driver "
        "gives them, or NVML UUIDs); empty reads no DRA claim",
    ),
    "--processes": (
        "PROCESSES",
        "false",
        "true reads each GPU's processes (utilisation, memory, pod) so that pods sharing a GPU each get their own "
        "share; needs the host's PID namespace (the chart's agent.processes.enabled)",
    ),
    **SERVER_FLAGS,
}


def env_name(flag: str) -> str:
    """The environment variable (GPUSCALER_*) that sets a ``serve`` flag."""
    return ENV_PREFIX + SERVE_FLAGS[flag][0]


def add_serve_flags(parser: argparse.ArgumentParser, environ: Mapping[str, str]) -> None:
    """Add the ``serve`` command's flags to ``parser``, each defaulting to its GPUSCALER_* variable in ``environ``."""
    add_flags(parser, SERVE_FLAGS, environ)


def settings_from_args(args: argparse.Namespace, environ: Mapping[str, str]) -> ServeSettings:
    """Check every value; ConfigError names the first bad one."""
    fail = flag_error(SERVE_FLAGS, environ)

    collector = args.collector
    if collector not in ("nvml", "fake"):
        raise fail("--collector", collector, "use nvml or fake")
    server = server_flags(args, fail)
    poll = seconds_flag(
        args.poll_interval, "--poll-interval", fail, MIN_POLL_INTERVAL_SECONDS, MAX_POLL_INTERVAL_SECONDS
    )
    history = duration_flag(
        args.history, "--history", fail, poll, 24 * 3600, f"must be between one poll interval ({poll:g}s) and 24h"
    )
    try:
        fake_gpus = int(args.fake_gpus)
    except ValueError:
        raise fail("--fake-gpus", args.fake_gpus, "must be a whole number") from None
    if not 0 <= fake_gpus <= MAX_FAKE_GPUS:
        raise fail("--fake-gpus", args.fake_gpus, f"must be between 0 and {MAX_FAKE_GPUS}")
    if args.fake_scenario and collector != "fake":
        raise fail("--fake-scenario", args.fake_scenario, "needs --collector fake")
    processes = _boolean(args.processes, "--processes", fail)
    if processes and collector != "nvml":
        raise fail("--processes", args.processes, "needs --collector nvml: fake GPUs run no processes")

    return ServeSettings(
        collector=collector,
        server=server,
        poll_interval_seconds=poll,
        history_seconds=history,
        fake_gpus=fake_gpus,
        fake_scenario=optional_path(args.fake_scenario),
        # The chart sets NODE_NAME from spec.nodeName. Without it, the host name still tells two machines
        # apart, where a shared constant made a gateway merge their GPUs into one node.
        node_name=environ.get("NODE_NAME") or socket.gethostname(),
        pod_resources_socket=optional_path(args.pod_resources_socket),
        processes=processes,
        dra_drivers=_dra_drivers(args.dra_drivers, fail),
    )


def _dra_drivers(text: str, fail: Fail) -> tuple[str, ...]:
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    for name in names:
        if len(name) > MAX_DRIVER_NAME or not _DRIVER_NAME.match(name):
            raise fail(
                "--dra-drivers",
                text,
                f"{name!r} is not a DRA driver name (a lower-case DNS subdomain of at most {MAX_DRIVER_NAME} "
                "characters, e.g. gpu.nvidia.com)",
            )
    return names


def _boolean(text: str, flag: str, fail: Fail) -> bool:
    value = text.strip().lower()
    if value not in ("true", "false"):
        raise fail(flag, text, "use true or false")
    return value == "true"
