"""Runs compose.yaml's services as local processes, for machines without a container engine (``make dev``).

compose.yaml stays the one definition of the dev stack. Each service's ``entrypoint`` + ``command`` runs with its
``environment``; what only makes sense inside a container is mapped to the host: an address the service binds
(``0.0.0.0:6000``) becomes its published one (``127.0.0.1:6001``), another service's address (``node-b:6000``)
becomes that service's published port, and a bind-mounted path (``/scenarios/busy.yaml``) becomes the host file.
Anything that cannot be mapped is an error naming the service, not a silent difference from ``compose up``.

    python dev/stack.py up      start every service, print their addresses, stop them all on Ctrl-C
    python dev/stack.py plan    print the local command of each service without starting anything
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import shlex
import signal
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
COMPOSE_FILE = ROOT / "compose.yaml"
# compose.yaml marks the service a KEDA-like client talks to with this label (the gateway, once it exists).
KEDA_ENDPOINT_LABEL = "gpuscaler.dev/keda-endpoint"
DESCRIPTION_LABEL = "gpuscaler.dev/description"
DEFAULT_STOP_GRACE_SECONDS = 10.0  # compose's default stop_grace_period
BIND_ALL_HOSTS = frozenset({"0.0.0.0", "::", "[::]"})
# HOST:PORT inside a larger string: a name, an IPv4 address or a bracketed IPv6 address, then a port.
ADDRESS = re.compile(r"(?<![\w.\-\[])(?P<host>\[[0-9A-Fa-f:.]*\]|[A-Za-z0-9][A-Za-z0-9_.\-]*):(?P<port>\d{1,5})\b")
VARIABLE = re.compile(
    r"\$(?:\$"  # $$, a literal $
    r"|\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}"  # ${NAME}, ${NAME:-default}
    r"|(?P<bare>[A-Za-z_][A-Za-z0-9_]*))"  # $NAME
)
DURATION = re.compile(r"(?P<number>\d+(?:\.\d+)?)(?P<unit>us|ms|s|m|h)")
DURATION_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


class StackError(Exception):
    """compose.yaml asks for something a local process cannot do; the message names the service."""


@dataclass(frozen=True, slots=True)
class Port:
    """One published port: ``host_ip:published`` on the host reaches ``target`` in the service."""

    target: int
    published: int
    host_ip: str = "127.0.0.1"
    name: str | None = None

    @property
    def bind(self) -> str:
        """What the service itself listens on, as a local process: the host side of the mapping."""
        return _host_port(self.host_ip, self.published)

    @property
    def address(self) -> str:
        """Where a local client connects: a published bind-all address is reached on loopback."""
        return _host_port("127.0.0.1" if self.host_ip in BIND_ALL_HOSTS else self.host_ip, self.published)


def _host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


@dataclass(frozen=True, slots=True)
class Service:
    """A compose service, as much of it as a local process needs."""

    name: str
    argv: tuple[str, ...]
    environment: Mapping[str, str]
    ports: tuple[Port, ...] = ()
    depends_on: tuple[str, ...] = ()
    labels: Mapping[str, str] = field(default_factory=dict)
    binds: tuple[tuple[Path, str], ...] = ()  # (host path, container path)
    stop_grace_seconds: float = DEFAULT_STOP_GRACE_SECONDS

    def port_for(self, target: int) -> Port | None:
        return next((port for port in self.ports if port.target == target), None)


@dataclass(frozen=True, slots=True)
class LocalProcess:
    """What ``up`` runs for one service."""

    service: Service
    argv: tuple[str, ...]
    environment: Mapping[str, str]  # only the service's own variables, after mapping


# --- reading compose.yaml ------------------------------------------------------------------------------


def interpolate(text: str, environ: Mapping[str, str]) -> str:
    """Compose's interpolation: ``$$`` is a literal ``$``; ``${NAME}``, ``${NAME:-default}``, ``${NAME:?error}``."""

    def replace(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name = match.group("braced") or match.group("bare")
        op, arg = match.group("op"), match.group("arg") or ""
        value = environ.get(name)
        unset = value is None or (value == "" and op is not None and op.startswith(":"))
        if op in (":-", "-") and unset:
            return arg
        if op in (":?", "?") and unset:
            raise StackError(f"variable {name} is required: {arg or 'not set'}")
        return value or ""

    return VARIABLE.sub(replace, text)


def _interpolate_all(node: Any, environ: Mapping[str, str]) -> Any:
    if isinstance(node, str):
        return interpolate(node, environ)
    if isinstance(node, list):
        return [_interpolate_all(item, environ) for item in node]
    if isinstance(node, dict):
        return {key: _interpolate_all(value, environ) for key, value in node.items()}
    return node


def load_services(path: Path = COMPOSE_FILE, environ: Mapping[str, str] | None = None) -> list[Service]:
    """The services of a compose file, in an order that starts each after what it depends on."""
    document = yaml.safe_load(path.read_text(encoding="utf-8"))
    document = _interpolate_all(document, os.environ if environ is None else environ)
    services = [
        parse_service(name, spec, base_dir=path.parent) for name, spec in (document.get("services") or {}).items()
    ]
    return start_order(services)


def parse_service(name: str, spec: Mapping[str, Any], *, base_dir: Path) -> Service:
    """One service's entry; refuses what a local process could only get wrong."""
    if "entrypoint" not in spec:
        raise StackError(
            f"service {name}: no entrypoint; spell out the image's ENTRYPOINT so the command can run without it"
        )
    argv = (*_words(spec["entrypoint"]), *_words(spec.get("command", [])))
    return Service(
        name=name,
        argv=argv,
        environment=_environment(name, spec.get("environment", {})),
        ports=tuple(_port(name, item) for item in spec.get("ports", [])),
        depends_on=tuple(spec.get("depends_on", [])),  # a list, or a mapping whose keys are the names
        labels={str(key): str(value) for key, value in _mapping_or_list(spec.get("labels", {})).items()},
        binds=tuple(bind for item in spec.get("volumes", []) if (bind := _bind(base_dir, item))),
        stop_grace_seconds=_seconds(name, spec.get("stop_grace_period")),
    )


def _words(value: str | Sequence[str]) -> list[str]:
    return shlex.split(value) if isinstance(value, str) else [str(word) for word in value]


def _mapping_or_list(value: Mapping[str, Any] | Sequence[str]) -> dict[str, Any]:
    if isinstance(value, Mapping):
        return dict(value)
    pairs = (item.partition("=") for item in value)
    return {key: (text if sep else None) for key, sep, text in pairs}


def _environment(service: str, value: Mapping[str, Any] | Sequence[str]) -> dict[str, str]:
    environment: dict[str, str] = {}
    for key, text in _mapping_or_list(value).items():
        if text is None:
            raise StackError(f"service {service}: {key} has no value; give it one in compose.yaml")
        environment[str(key)] = str(text).lower() if isinstance(text, bool) else str(text)
    return environment


def _port(service: str, item: Any) -> Port:
    """Long syntax ``{target, published, host_ip, name}`` or short ``[HOST_IP:]PUBLISHED:TARGET[/tcp]``."""
    if isinstance(item, Mapping):
        target, published = item.get("target"), item.get("published")
        host_ip, name = str(item.get("host_ip") or "0.0.0.0"), item.get("name")
    else:
        *front, target = str(item).removesuffix("/tcp").rsplit(":", 2)
        published = front.pop() if front else ""
        host_ip, name = (front.pop().strip("[]") if front else "0.0.0.0"), None
    if not (str(published).isdigit() and str(target).isdigit()):
        raise StackError(
            f"service {service}: port {item!r} needs one fixed published port (no ranges, no random host port)"
        )
    return Port(target=int(str(target)), published=int(str(published)), host_ip=host_ip, name=name)


def _bind(base_dir: Path, item: Any) -> tuple[Path, str] | None:
    """A bind mount as (host path, container path); named volumes and tmpfs are not files on the host."""
    if isinstance(item, Mapping):
        if item.get("type") != "bind":
            return None
        source, target = str(item["source"]), str(item["target"])
    else:
        source, _, rest = str(item).partition(":")
        target = rest.partition(":")[0]
        if not source.startswith((".", "/", "~")):
            return None
    return (base_dir / Path(source).expanduser()).resolve(), target.rstrip("/")


def _seconds(service: str, value: Any) -> float:
    if value is None:
        return DEFAULT_STOP_GRACE_SECONDS
    text = str(value)
    parts = list(DURATION.finditer(text))
    if not parts or "".join(part.group(0) for part in parts) != text:
        raise StackError(f"service {service}: stop_grace_period {text!r} is not a duration like 15s or 1m30s")
    return sum(float(part.group("number")) * DURATION_UNITS[part.group("unit")] for part in parts)


def start_order(services: Sequence[Service]) -> list[Service]:
    """File order, except that a service starts after the services it depends on."""
    by_name = {service.name: service for service in services}
    ordered: list[Service] = []
    visiting: set[str] = set()

    def visit(service: Service) -> None:
        if service in ordered:
            return
        if service.name in visiting:
            raise StackError(f"service {service.name}: depends_on forms a cycle")
        visiting.add(service.name)
        for name in service.depends_on:
            if name not in by_name:
                raise StackError(f"service {service.name}: depends on {name}, which compose.yaml does not define")
            visit(by_name[name])
        ordered.append(service)

    for service in services:
        visit(service)
    return ordered


# --- mapping a service onto the host ---------------------------------------------------------------------


def localize(service: Service, services: Sequence[Service]) -> LocalProcess:
    """The service's command and environment with container addresses and paths replaced by host ones."""
    by_name = {other.name: other for other in services}

    def address(match: re.Match[str]) -> str:
        host, port = match.group("host"), int(match.group("port"))
        if host in BIND_ALL_HOSTS:
            published = service.port_for(port)
            if published is None:
                raise StackError(
                    f"service {service.name}: listens on {match.group(0)} but compose.yaml publishes no host port "
                    f"for {port}; as local processes all services share the host's ports"
                )
            return published.bind
        other = by_name.get(host)
        if other is None:
            return match.group(0)
        published = other.port_for(port)
        if published is None:
            raise StackError(f"service {service.name}: uses {match.group(0)}, but {host} publishes no port {port}")
        return published.address

    def path(word: str) -> str:
        for source, target in service.binds:
            if word == target or word.startswith(target + "/"):
                return str(source) + word[len(target) :]
        return word

    def local(text: str) -> str:
        return path(ADDRESS.sub(address, text))

    return LocalProcess(
        service=service,
        argv=tuple(local(word) for word in service.argv),
        environment={key: local(value) for key, value in service.environment.items()},
    )


def process_environment(process: LocalProcess, environ: Mapping[str, str], bin_dir: Path) -> dict[str, str]:
    """The developer's environment without agent settings of their own, then the service's; our venv first."""
    environment = {key: value for key, value in environ.items() if not key.startswith("GPUSCALER_")}
    environment["PATH"] = os.pathsep.join(filter(None, (str(bin_dir), environ.get("PATH"))))
    environment.update(process.environment)
    return environment


def describe(processes: Sequence[LocalProcess]) -> list[str]:
    """The lines ``up`` prints: every address it started, and where a KEDA-like client connects."""
    width = max((len(process.service.name) for process in processes), default=0)
    lines = [f"gpuscaler dev stack: {len(processes)} services from compose.yaml, as local processes"]
    for process in processes:
        service = process.service
        ports = "  ".join(f"{port.name or port.target} {port.address}" for port in service.ports) or "(no ports)"
        description = service.labels.get(DESCRIPTION_LABEL, "")
        lines.append(f"  {service.name:<{width}}  {ports}  {description}".rstrip())
    for process in processes:
        if process.service.labels.get(KEDA_ENDPOINT_LABEL) == "true" and process.service.ports:
            grpc = next((p for p in process.service.ports if p.name == "grpc"), process.service.ports[0])
            lines.append(f"KEDA-like clients connect to {grpc.address} ({process.service.name})")
            lines.append(f"  try: gpuscaler query --address {grpc.address} profile=training")
    lines.append("Ctrl-C stops them all.")
    return lines


# --- running ---------------------------------------------------------------------------------------------


async def _pump(name: str, width: int, child: asyncio.subprocess.Process, write: Callable[[str], None]) -> None:
    """Copies one child's output, line by line, behind its name; then says how it ended."""
    assert child.stdout is not None
    async for raw in child.stdout:
        write(f"{name:<{width}} | {raw.decode(errors='replace').rstrip()}")
    write(f"{name:<{width}} | exited with code {await child.wait()}")


async def run(processes: Sequence[LocalProcess], *, bin_dir: Path, write: Callable[[str], None] = print) -> int:
    """Starts every process, prefixes its output with the service name, and on SIGINT or SIGTERM sends each
    SIGTERM and then SIGKILL after its stop_grace_period. Returns 0 when all stopped cleanly."""
    width = max(len(process.service.name) for process in processes)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    children: list[tuple[LocalProcess, asyncio.subprocess.Process]] = []
    pumps: list[asyncio.Task[None]] = []
    try:
        for process in processes:
            try:
                child = await asyncio.create_subprocess_exec(
                    *process.argv,
                    env=process_environment(process, os.environ, bin_dir),
                    cwd=ROOT,
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=asyncio.subprocess.PIPE,
                    stderr=asyncio.subprocess.STDOUT,
                    # Its own process group: Ctrl-C reaches only us, and we stop each group (a shell and its children).
                    start_new_session=True,
                )
            except OSError as error:
                raise StackError(
                    f"service {process.service.name}: cannot run {process.argv[0]}: {error.strerror}"
                ) from None
            children.append((process, child))
            pumps.append(asyncio.create_task(_pump(process.service.name, width, child, write)))
        for line in describe(processes):
            write(line)
        all_exited: asyncio.Future[Any] = asyncio.gather(*pumps)  # every service ended by itself
        stopping: asyncio.Future[Any] = asyncio.ensure_future(stop.wait())
        await asyncio.wait([all_exited, stopping], return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
    finally:
        await asyncio.gather(*(_stop(process, child, write) for process, child in children))
        await asyncio.gather(*pumps, return_exceptions=True)
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(signum)
    failed = [process.service.name for process, child in children if child.returncode not in (0, -signal.SIGTERM)]
    for name in failed:
        write(f"{name} exited with an error")
    return 1 if failed else 0


async def _stop(process: LocalProcess, child: asyncio.subprocess.Process, write: Callable[[str], None]) -> None:
    if child.returncode is not None:
        return
    with contextlib.suppress(ProcessLookupError):  # it exited meanwhile
        os.killpg(child.pid, signal.SIGTERM)
    try:
        await asyncio.wait_for(child.wait(), process.service.stop_grace_seconds)
    except TimeoutError:
        write(f"{process.service.name} did not stop within {process.service.stop_grace_seconds:g}s; killing it")
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGKILL)
        await child.wait()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run compose.yaml's services as local processes.")
    parser.add_argument("action", nargs="?", choices=("up", "plan"), default="up")
    parser.add_argument("--file", type=Path, default=COMPOSE_FILE, help="the compose file (default: compose.yaml)")
    args = parser.parse_args(argv)
    bin_dir = Path(sys.executable).parent
    try:
        services = load_services(args.file)
        processes = [localize(service, services) for service in services]
    except StackError as error:
        parser.exit(2, f"stack: {error}\n")
    if args.action == "plan":
        for process in processes:
            variables = " ".join(f"{key}={shlex.quote(value)}" for key, value in process.environment.items())
            print(f"{process.service.name}: {variables} {shlex.join(process.argv)}")
        return 0
    try:
        return asyncio.run(run(processes, bin_dir=bin_dir))
    except StackError as error:  # the services started before it have been stopped
        parser.exit(1, f"stack: {error}\n")


if __name__ == "__main__":
    sys.exit(main())
