"""compose.yaml's project under ``docker compose``, on the private podman's socket, with every port moved.

Each published port of compose.yaml is ``${GPUSCALER_DEV_<SERVICE>_<PORT NAME>_PORT:-default}``; the suite sets
every variable to a port free here, so the stack runs beside anything on the defaults, as a second stack would.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "compose.yaml"
PORT_VARIABLE = re.compile(r"\$\{(?P<name>GPUSCALER_DEV_\w+_PORT):-(?P<default>\d+)\}")


@dataclass(frozen=True)
class Port:
    """One published port: its service, its name in compose.yaml, its variable and its default."""

    service: str
    name: str
    variable: str
    default: int


def published_ports() -> list[Port]:
    """compose.yaml's published ports, with the variable and default of each."""
    services: dict[str, Any] = yaml.safe_load(COMPOSE_FILE.read_text())["services"]
    ports = []
    for service, spec in services.items():
        for port in spec.get("ports", []):
            match = PORT_VARIABLE.fullmatch(port["published"])
            if match is None:
                raise ValueError(f"compose.yaml: {service}'s {port['name']} is published on {port['published']!r}")
            ports.append(Port(service, port["name"], match["name"], int(match["default"])))
    return ports


def free_ports(count: int) -> list[int]:
    """``count`` distinct loopback ports nobody listens on now (each held open until all are chosen)."""
    with ExitStack() as held:
        sockets = [held.enter_context(socket.socket()) for _ in range(count)]
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [int(sock.getsockname()[1]) for sock in sockets]


@dataclass(frozen=True)
class Project:
    """``docker compose -p NAME`` for compose.yaml against ``docker_host``, each port at ``moved[port]``."""

    compose: Path
    docker_host: str
    name: str
    moved: dict[Port, int]
    config: Path  # DOCKER_CONFIG: no Docker client setting of this machine applies

    def environment(self) -> dict[str, str]:
        """This machine's environment without its own port variables, plus the project's."""
        environment = {key: value for key, value in os.environ.items() if not key.startswith("GPUSCALER_DEV_")}
        environment |= {port.variable: str(value) for port, value in self.moved.items()}
        return environment | {"DOCKER_HOST": self.docker_host, "DOCKER_CONFIG": str(self.config)}

    def run(self, *args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
        """One ``docker compose`` command on the project, not checked."""
        command = [str(self.compose), "--project-name", self.name, "--file", str(COMPOSE_FILE), *args]
        return subprocess.run(command, env=self.environment(), capture_output=True, text=True, timeout=timeout)

    def check(self, *args: str, timeout: float = 180) -> str:
        """One ``docker compose`` command that must succeed; its stdout."""
        result = self.run(*args, timeout=timeout)
        assert result.returncode == 0, f"docker compose {' '.join(args)}: {result.returncode}\n{result.stderr[-3000:]}"
        return result.stdout

    def containers(self) -> list[dict[str, Any]]:
        """``docker compose ps --all``'s containers, as JSON (one object per line in Compose v2.21 and later)."""
        lines = self.check("ps", "--all", "--format", "json").splitlines()
        return [json.loads(line) for line in lines if line.strip()]

    def address(self, service: str, name: str) -> str:
        """127.0.0.1 and the port ``service`` publishes as ``name`` in this project."""
        (port,) = [port for port in self.moved if (port.service, port.name) == (service, name)]
        return f"127.0.0.1:{self.moved[port]}"

    def logs(self, *services: str) -> str:
        """The services' output so far (all of them when none is named), without colours."""
        return self.run("logs", "--no-color", *services).stdout
