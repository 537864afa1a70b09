"""Runs compose.yaml's services as local processes (``make dev``), for machines without a container engine.

compose.yaml stays the one definition of the stack: each service's ``entrypoint`` + ``command`` runs with its
``environment``, where an address it binds (``0.0.0.0:6000``) or calls (``node-b:6000``) becomes 127.0.0.1 and the
port compose.yaml publishes for it, and a bind-mounted folder (``/scenarios``) the host's. The other keys (image,
user, ...) mean nothing to a local process; ``--port-offset N`` moves every port, to run beside another stack.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
ADDRESS = re.compile(r"\b(?P<host>[\w.-]+):(?P<port>\d+)\b")
STOP_GRACE_SECONDS = 15.0  # compose.yaml's stop_grace_period: longer than the agent's drain


@dataclass(frozen=True, slots=True)
class Service:
    """One service of compose.yaml as a local process."""

    name: str
    argv: list[str]
    environment: dict[str, str]
    ports: dict[str, str]  # the port's name in compose.yaml -> the local address
    labels: dict[str, str]


def load(port_offset: int = 0) -> list[Service]:
    """compose.yaml's services, mapped onto the host; they start in file order, as every client here retries."""
    text = (ROOT / "compose.yaml").read_text(encoding="utf-8")
    if "$" in text:
        sys.exit("stack: compose.yaml uses ${...} interpolation, which dev/stack.py does not do")
    specs = yaml.safe_load(text)["services"]
    # Every port is published on 127.0.0.1 (a compose.yaml test holds it to that), so that is the local address.
    published = {
        (name, port["target"]): f"127.0.0.1:{int(port['published']) + port_offset}"
        for name, spec in specs.items()
        for port in spec.get("ports", [])
    }

    def local(name: str, mounts: list[list[str]], word: object) -> str:
        def address(match: re.Match[str]) -> str:
            key = (name if match["host"] == "0.0.0.0" else match["host"], int(match["port"]))
            if match["host"] == "0.0.0.0" and key not in published:
                sys.exit(f"stack: {name} binds {match[0]}, which compose.yaml does not publish on the host")
            return published.get(key, match[0])

        text = ADDRESS.sub(address, str(word))
        for source, target in mounts:
            if text == target or text.startswith(f"{target}/"):
                return str((ROOT / source).resolve()) + text[len(target) :]
        return text

    services = []
    for name, spec in specs.items():
        mounts = [volume.split(":")[:2] for volume in spec.get("volumes", [])]
        services.append(
            Service(
                name=name,
                argv=[local(name, mounts, word) for word in [*spec["entrypoint"], *spec.get("command", [])]],
                environment={key: local(name, mounts, value) for key, value in spec.get("environment", {}).items()},
                ports={port["name"]: published[name, port["target"]] for port in spec.get("ports", [])},
                labels=spec.get("labels", {}),
            )
        )
    return services


def banner(services: list[Service]) -> list[str]:
    """What ``make dev`` prints first: every service's addresses, and where a KEDA-like client connects."""
    width = max(len(service.name) for service in services)
    lines = [f"gpuscaler dev stack: compose.yaml's {len(services)} services as local processes"]
    for service in services:
        ports = "".join(f"{name} {address}  " for name, address in service.ports.items())
        lines.append(f"  {service.name:<{width}}  {ports}{service.labels.get('gpuscaler.dev/description', '')}")
    for service in services:
        if service.labels.get("gpuscaler.dev/keda-endpoint") == "true":
            lines.append(f"KEDA-like clients connect to {service.ports['grpc']} ({service.name}), e.g.:")
            lines.append(f"  .venv/bin/gpuscaler query --address {service.ports['grpc']} profile=training")
    lines.append("Ctrl-C stops them all.")
    return lines


async def run(services: list[Service], write: Callable[[str], None]) -> int:
    """Starts every service and copies its output behind its name; on SIGINT or SIGTERM, or when one service
    exits, stops them all. Returns 0 when every service stopped cleanly."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    # The developer's own agent settings (GPUSCALER_COLLECTOR=nvml, say) would override compose.yaml's defaults.
    environment = {key: value for key, value in os.environ.items() if not key.startswith("GPUSCALER_")}
    environment["PATH"] = os.pathsep.join(filter(None, (str(Path(sys.executable).parent), os.environ.get("PATH"))))
    width = max(len(service.name) for service in services)
    children: list[asyncio.subprocess.Process] = []
    pumps: list[asyncio.Task[None]] = []
    try:
        for service in services:
            child = await asyncio.create_subprocess_exec(
                *service.argv,
                env=environment | service.environment,
                cwd=ROOT,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
                # Its own process group: Ctrl-C reaches only us, and we stop each group (a shell and its children).
                start_new_session=True,
            )
            children.append(child)
            pumps.append(asyncio.create_task(_pump(f"{service.name:<{width}} |", child, write)))
        for line in banner(services):
            write(line)
        stopped = asyncio.create_task(stop.wait())
        await asyncio.wait([stopped, *pumps], return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
    finally:
        await asyncio.gather(*(_stop(child) for child in children))
        await asyncio.gather(*pumps)
    return 0 if all(child.returncode in (0, -signal.SIGTERM) for child in children) else 1


async def _pump(prefix: str, child: asyncio.subprocess.Process, write: Callable[[str], None]) -> None:
    assert child.stdout is not None
    async for line in child.stdout:
        write(f"{prefix} {line.decode(errors='replace').rstrip()}")
    write(f"{prefix} exited with code {await child.wait()}")


async def _stop(child: asyncio.subprocess.Process) -> None:
    """SIGTERM to the child's process group, SIGKILL after the grace period."""
    if child.returncode is not None:  # its pid, and so the group's id, may belong to someone else by now
        return
    for signum in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):  # it exited meanwhile
            os.killpg(child.pid, signum)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(child.wait(), STOP_GRACE_SECONDS)
            return


def main() -> int:
    """Run the stack until Ctrl-C or a service exits; the exit status is 0 when every service stopped cleanly."""
    parser = argparse.ArgumentParser(description="Run compose.yaml's services as local processes.")
    parser.add_argument(
        "--port-offset", type=int, default=0, help="add N to every published port, to run beside another stack"
    )
    args = parser.parse_args()
    try:
        return asyncio.run(run(load(args.port_offset), partial(print, flush=True)))
    except OSError as error:  # a command that cannot start; those started before it have been stopped
        parser.exit(1, f"stack: cannot run {error.filename}: {error.strerror}\n")


if __name__ == "__main__":
    sys.exit(main())
