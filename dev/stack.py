"""Runs compose.yaml's services as local processes (``make dev``), for machines without a container engine.

compose.yaml stays the one definition of the stack: each service's ``entrypoint`` + ``command`` runs with its
``environment``, where an address it binds (``0.0.0.0:6000``) or calls (``node-b:6000``) becomes 127.0.0.1 and the
port compose.yaml publishes for it, a bind-mounted folder (``/scenarios``) the host's, and a named volume a folder
of a temporary directory that lives as long as the stack. The other keys (image, user, ...) mean nothing to a local
process; ``--port-offset N`` (``make dev PORT_OFFSET=N``) moves every port, to run beside another stack.

A service is up once it has logged the event its ``gpuscaler.dev/up-when-logged`` label names (at once without the
label). Before anything starts, every address a service listens on is tried: one that another process holds (a
second ``make dev``, say) stops the stack with the address and an offset whose ports are free, without a traceback.
A service that exits before every service is up stops the whole stack (no half a stack), with the same advice when
another process holds an address it listens on; one that exits later is reported, and the others keep running, as
the nodes of a cluster do when one agent dies. Lines typed into the stack's terminal control single services:
``stop NAME``, ``kill NAME`` (SIGKILL, as a crash), ``start NAME``, ``status``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import signal
import socket
import sys
import tempfile
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
ADDRESS = re.compile(r"\b(?P<host>[\w.-]+):(?P<port>\d+)\b")
# The only interpolation compose.yaml uses: a published port's variable and its default.
INTERPOLATION = re.compile(r"\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*):-(?P<default>[^}$]*)\}")
STOP_GRACE_SECONDS = 15.0  # compose.yaml's stop_grace_period: longer than the agent's drain
COMMANDS = "stop NAME, kill NAME, start NAME, status"
POD_DIRECTORY = "--pod-directory"
METRICS_PORT = "prometheus.io/port"  # where a pod of the pod directory serves its engine's metrics
OFFSET_STEP = 100  # a clash suggests the next multiple: ports keep their last two digits, so 6101 is still node-a
NAMED_ADDRESSES = 3  # a clash names this many taken addresses, then counts the rest


@dataclass(frozen=True, slots=True)
class Service:
    """One service of compose.yaml as a local process."""

    name: str
    argv: list[str]
    environment: dict[str, str]
    ports: dict[str, str]  # the port's name in compose.yaml -> the local address
    labels: dict[str, str]
    listens: tuple[str, ...] = ()  # the local addresses its process listens on (its own or its network's ports)

    @property
    def up_when_logged(self) -> str | None:
        """The log event after which the service counts as up; None: as soon as it runs."""
        return self.labels.get("gpuscaler.dev/up-when-logged")


def load(port_offset: int, volumes: Path) -> list[Service]:
    """compose.yaml's services, mapped onto the host; they start in file order, as every client here retries.
    Named volumes become folders under ``volumes``."""
    text = interpolate((ROOT / "compose.yaml").read_text(encoding="utf-8"), os.environ)
    specs = yaml.safe_load(text)["services"]
    # Every port is published on 127.0.0.1 (a compose.yaml test holds it to that), so that is the local address.
    published = {
        (name, port["target"]): f"127.0.0.1:{int(port['published']) + port_offset}"
        for name, spec in specs.items()
        for port in spec.get("ports", [])
    }

    def host_path(source: str) -> Path:
        if source.startswith((".", "/")):  # a bind mount
            return (ROOT / source).resolve()
        return volumes / source  # a named volume

    def network_of(name: str) -> str:
        """The service whose network namespace ``name`` is in: its own, or the one ``network_mode`` names."""
        mode = str(specs[name].get("network_mode", ""))
        return mode.removeprefix("service:") if mode.startswith("service:") else name

    listening: dict[str, list[str]] = {}

    def local(name: str, mounts: list[list[str]], word: object) -> str:
        def address(match: re.Match[str]) -> str:
            key = (network_of(name) if match["host"] == "0.0.0.0" else match["host"], int(match["port"]))
            if match["host"] == "0.0.0.0" and key not in published:
                sys.exit(f"stack: {name} binds {match[0]}, which compose.yaml does not publish on the host")
            if match["host"] == "0.0.0.0":
                listening.setdefault(name, []).append(published[key])
            return published.get(key, match[0])

        text = ADDRESS.sub(address, str(word))
        for source, target in mounts:
            if text == target or text.startswith(f"{target}/"):
                return str(host_path(source)) + text[len(target) :]
        return text

    services = []
    for name, spec in specs.items():
        mounts = [volume.split(":")[:2] for volume in spec.get("volumes", [])]
        argv = [local(name, mounts, word) for word in [*spec["entrypoint"], *spec.get("command", [])]]
        if POD_DIRECTORY in argv:
            at = argv.index(POD_DIRECTORY) + 1
            argv[at] = str(moved_pod_directory(Path(argv[at]), published, name, volumes))
        services.append(
            Service(
                name=name,
                argv=argv,
                environment={key: local(name, mounts, value) for key, value in spec.get("environment", {}).items()},
                ports={port["name"]: published[name, port["target"]] for port in spec.get("ports", [])},
                labels=spec.get("labels", {}),
                listens=tuple(dict.fromkeys(listening.get(name, []))),
            )
        )
    return services


def free(address: str) -> bool:
    """Whether a server could listen on ``address`` (HOST:PORT) now, binding as the services' servers do (asyncio's
    SO_REUSEADDR: a port whose last connections linger in TIME_WAIT is free)."""
    host, _, port = address.rpartition(":")
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, int(port)))
        except OSError:
            return False
    return True


def taken(services: list[Service]) -> list[tuple[str, str]]:
    """(address, service) of each address a service listens on that another process holds now."""
    return [(address, service.name) for service in services for address in service.listens if not free(address)]


def shifted(address: str, by: int) -> str:
    """``address`` (HOST:PORT) with its port moved ``by``."""
    host, _, port = address.rpartition(":")
    return f"{host}:{int(port) + by}"


def clash(held: list[tuple[str, str]], services: list[Service], port_offset: int) -> list[str]:
    """What the stack says when addresses it listens on are taken: which, and the offset that moves past them (the
    next multiple of OFFSET_STEP whose addresses are all free now, if one is)."""
    named = ", ".join(f"{address} ({name})" for address, name in held[:NAMED_ADDRESSES])
    if len(held) > NAMED_ADDRESSES:
        named += f" and {len(held) - NAMED_ADDRESSES} more"
    addresses = [address for service in services for address in service.listens]
    ports = [int(address.rpartition(":")[2]) - port_offset for address in addresses]  # as compose.yaml has them
    first = (port_offset // OFFSET_STEP + 1) * OFFSET_STEP
    fitting = [
        offset
        for offset in range(first, first + 100 * OFFSET_STEP, OFFSET_STEP)
        if min(ports, default=1) + offset >= 1 and max(ports, default=1) + offset <= 65535
    ]
    free_now = next(
        (offset for offset in fitting if all(free(shifted(a, offset - port_offset)) for a in addresses)), None
    )
    offset = free_now if free_now is not None else fitting[0] if fitting else first
    endpoint = next((s.ports["grpc"] for s in services if s.labels.get("gpuscaler.dev/keda-endpoint") == "true"), None)
    where = f": the gateway at {shifted(endpoint, offset - port_offset)}" if endpoint else ""
    return [
        f"stack: {named} {'is' if len(held) == 1 else 'are'} taken by another process (another `make dev`?)",
        f"stack: move every port to run beside it: make dev PORT_OFFSET={offset} "
        f"(or python dev/stack.py --port-offset {offset}), "
        + (f"whose ports are all free now{where}" if free_now is not None else f"which moves them{where}"),
    ]


def interpolate(text: str, environ: Mapping[str, str]) -> str:
    """compose.yaml with each ``${NAME:-default}`` (a published port's variable) replaced as Docker Compose does:
    NAME's value, or the default where NAME is unset or empty. A value that is no port, or any other ``$`` form,
    ends the stack with what is wrong."""

    def value(match: re.Match[str]) -> str:
        chosen = environ.get(match["name"]) or match["default"]
        if not chosen.isdigit() or not 1 <= int(chosen) <= 65535:
            sys.exit(f"stack: {match['name']}={chosen!r}: a port number, 1 to 65535")
        return chosen

    resolved = INTERPOLATION.sub(value, text)
    if "$" in resolved:
        sys.exit("stack: compose.yaml uses a ${...} form other than ${NAME:-default}, which dev/stack.py does not do")
    return resolved


def moved_pod_directory(path: Path, published: dict[tuple[str, int], str], service: str, volumes: Path) -> Path:
    """A copy of the pod directory file whose pods' metrics ports (``prometheus.io/port``) are moved where their
    pages are published: the pods' engines serve in ``service``'s network namespace, moved by --port-offset or a
    port's variable. The copy is made once; edits to the original are not followed while a moved stack runs.
    ``path`` itself where no port moved."""
    directory = yaml.safe_load(path.read_text(encoding="utf-8"))
    changed = False
    for pod in directory.get("pods") or []:
        annotations = pod.get("annotations") or {}
        port = str(annotations.get(METRICS_PORT, ""))
        if port.isdigit() and (service, int(port)) in published:
            annotations[METRICS_PORT] = published[service, int(port)].rpartition(":")[2]
            changed = changed or annotations[METRICS_PORT] != port
    if not changed:
        return path
    moved = volumes / f"moved-{path.name}"
    moved.write_text(yaml.safe_dump(directory), encoding="utf-8")
    return moved


def banner(services: list[Service], pids: dict[str, int] | None = None) -> list[str]:
    """What ``make dev`` prints once every service is up: each service's process and addresses, where a
    KEDA-like client connects, and how to stop one service."""
    width = max(len(service.name) for service in services)
    lines = [f"gpuscaler dev stack: compose.yaml's {len(services)} services as local processes"]
    for service in services:
        pid = f"pid {pids[service.name]:<8}" if pids and service.name in pids else ""
        ports = "".join(f"{name} {address}  " for name, address in service.ports.items())
        description = service.labels.get("gpuscaler.dev/description", "")
        lines.append(f"  {service.name:<{width}}  {pid}{ports}{description}")
    for service in services:
        if service.labels.get("gpuscaler.dev/keda-endpoint") == "true":
            lines.append(f"KEDA-like clients connect to {service.ports['grpc']} ({service.name}), e.g.:")
            lines.append(f"  .venv/bin/gpuscaler query --address {service.ports['grpc']} profile=training")
            lines.append(f"  .venv/bin/gpuscaler query --address {service.ports['grpc']} namespace=ml workload=trainer")
    lines.append(f"Type a command and Enter here to drive one service ({COMMANDS}); the others keep running.")
    lines.append("Ctrl-C stops them all.")
    return lines


def describe_exit(code: int) -> str:
    """An exit status as a person reads it: ``code 1``, ``SIGKILL``."""
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"signal {signal.Signals(-code).name}"
    return f"code {code}"


@dataclass(eq=False)
class Running:
    """A service's process and the task that copies its output; ``up`` is set once it is up."""

    service: Service
    child: asyncio.subprocess.Process
    up: asyncio.Event = field(default_factory=asyncio.Event)
    pump: asyncio.Task[None] | None = None
    stopped_on_purpose: bool = False


class Stack:
    """The services' processes, their output behind their names, and the commands typed into the terminal."""

    def __init__(self, services: list[Service], write: Callable[[str], None]) -> None:
        self.services = {service.name: service for service in services}
        self.write = write
        self.width = max(len(name) for name in self.services)
        self.running: dict[str, Running] = {}
        self.exits: asyncio.Queue[Running] = asyncio.Queue()
        # The developer's own agent settings (GPUSCALER_COLLECTOR=nvml, say) would override compose.yaml's defaults.
        environment = {key: value for key, value in os.environ.items() if not key.startswith("GPUSCALER_")}
        path = os.pathsep.join(filter(None, (str(Path(sys.executable).parent), os.environ.get("PATH"))))
        self.environment = environment | {"PATH": path}

    async def start(self, name: str) -> Running:
        service = self.services[name]
        child = await asyncio.create_subprocess_exec(
            *service.argv,
            env=self.environment | service.environment,
            cwd=ROOT,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            # Its own process group: Ctrl-C reaches only us, and we stop each group (a shell and its children).
            start_new_session=True,
        )
        running = Running(service, child)
        running.pump = asyncio.create_task(self._pump(running))
        if service.up_when_logged is None:
            running.up.set()
        self.running[name] = running
        return running

    async def _pump(self, running: Running) -> None:
        prefix = f"{running.service.name:<{self.width}} |"
        event = running.service.up_when_logged
        assert running.child.stdout is not None
        async for raw in running.child.stdout:
            line = raw.decode(errors="replace").rstrip()
            self.write(f"{prefix} {line}")
            if event is not None and re.search(rf"\b{re.escape(event)}\b", line):
                running.up.set()
        self.write(f"{prefix} exited with {describe_exit(await running.child.wait())}")
        self.exits.put_nowait(running)

    async def stop(self, running: Running, signals: tuple[signal.Signals, ...]) -> None:
        """Each signal in turn to the service's process group, waiting the grace period after each but the last."""
        running.stopped_on_purpose = True
        child = running.child
        for signum in signals:
            if child.returncode is not None:  # its pid, and so the group's id, may belong to someone else by now
                break
            with contextlib.suppress(ProcessLookupError):  # it exited meanwhile
                os.killpg(child.pid, signum)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(child.wait(), STOP_GRACE_SECONDS)
        if running.pump is not None:
            await running.pump

    async def command(self, line: str) -> None:
        """One line typed into the stack's terminal."""
        words = line.split()
        if not words:
            return
        if words == ["status"]:
            for name in self.services:
                running = self.running.get(name)
                state = "not running"
                if running is not None and running.child.returncode is None:
                    state = f"running, pid {running.child.pid}"
                elif running is not None and running.child.returncode is not None:
                    state = f"exited with {describe_exit(running.child.returncode)}"
                self.write(f"stack: {name:<{self.width}}  {state}")
            return
        if len(words) != 2 or words[0] not in ("start", "stop", "kill") or words[1] not in self.services:
            self.write(f"stack: {line.strip()!r}? Commands: {COMMANDS}; services: {', '.join(self.services)}")
            return
        verb, name = words
        running = self.running.get(name)
        alive = running is not None and running.child.returncode is None
        if verb == "start":
            if alive:
                self.write(f"stack: {name} is already running")
                return
            started = await self.start(name)
            self.write(f"stack: started {name} again (pid {started.child.pid})")
        elif running is None or not alive:
            self.write(f"stack: {name} is not running; type 'start {name}' to start it")
        else:
            self.write(f"stack: {'stopping' if verb == 'stop' else 'killing'} {name} (pid {running.child.pid})")
            signals = (signal.SIGTERM, signal.SIGKILL) if verb == "stop" else (signal.SIGKILL,)
            await self.stop(running, signals)

    def report_exit(self, running: Running) -> None:
        """Says that a service ended while the others run on, and how to bring it back."""
        name = running.service.name
        others = [n for n, r in self.running.items() if n != name and r.child.returncode is None]
        how = "stopped" if running.stopped_on_purpose else "exited"
        code = describe_exit(running.child.returncode if running.child.returncode is not None else 0)
        self.write(
            f"stack: {name} {how} ({code}); {len(others)} other service(s) keep running ({', '.join(others)}). "
            f"Type 'start {name}' here to start it again; Ctrl-C stops the stack."
        )

    async def all_up(self) -> None:
        """Returns once every service started so far is up."""
        for running in list(self.running.values()):
            await running.up.wait()

    async def stop_all(self) -> None:
        """Stops every service still running, each SIGTERM then SIGKILL, and waits for all their output."""
        alive = [r for r in self.running.values() if r.child.returncode is None]
        await asyncio.gather(*(self.stop(r, (signal.SIGTERM, signal.SIGKILL)) for r in alive))
        await asyncio.gather(*(r.pump for r in self.running.values() if r.pump is not None))


async def run(
    services: list[Service],
    write: Callable[[str], None],
    commands: asyncio.Queue[str] | None = None,
    *,
    port_offset: int = 0,
) -> int:
    """Starts every service, copies its output behind its name, and prints the banner once all are up. Until SIGINT
    or SIGTERM: a service that exits is reported and the others go on, and each line put into ``commands`` is a
    command (``stop NAME``, ...). A service that exits before all are up stops every service, and returns 1; when
    another process holds an address it listens on, the stack says which and the offset (``port_offset``: the
    services' own) that moves past it. Otherwise returns 0 when every service still running at the signal stopped
    cleanly."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    commands = commands if commands is not None else asyncio.Queue()
    stack = Stack(services, write)
    stopping = asyncio.create_task(stop.wait())
    try:
        for service in services:
            await stack.start(service.name)
        all_up = asyncio.create_task(stack.all_up())
        first_exit = asyncio.create_task(stack.exits.get())
        await asyncio.wait([all_up, first_exit, stopping], return_when=asyncio.FIRST_COMPLETED)
        if not all_up.done():  # one exited, or Ctrl-C, before every service was up
            all_up.cancel()
            if not first_exit.done():
                first_exit.cancel()
                return 0
            service = first_exit.result().service
            write(f"stack: {service.name} exited before every service was up; stopping the others")
            # Its own sockets closed when it exited: an address it listens on that is not free is someone else's.
            held = [(address, service.name) for address in service.listens if not free(address)]
            for line in clash(held, services, port_offset) if held else []:
                write(line)
            return 1
        first_exit.cancel()
        pids = {name: running.child.pid for name, running in stack.running.items()}
        for line in banner(services, pids):
            write(line)
        while not stopping.done():
            exited = asyncio.create_task(stack.exits.get())
            typed = asyncio.create_task(commands.get())
            done, _ = await asyncio.wait([stopping, exited, typed], return_when=asyncio.FIRST_COMPLETED)
            if exited in done:
                stack.report_exit(exited.result())
            else:
                exited.cancel()
            if typed in done:
                await stack.command(typed.result())
            else:
                typed.cancel()
        final = [r for r in stack.running.values() if r.child.returncode is None]
        await stack.stop_all()
        return 0 if all(r.child.returncode in (0, -signal.SIGTERM) for r in final) else 1
    finally:
        stopping.cancel()
        await stack.stop_all()


def read_commands(loop: asyncio.AbstractEventLoop, commands: asyncio.Queue[str]) -> None:
    """Feeds lines typed into the terminal to ``commands``, from a thread (stdin has no portable async reader)."""

    def reader() -> None:
        with contextlib.suppress(OSError, ValueError):  # EIO in the background, a closed stdin at exit
            for line in sys.stdin:
                loop.call_soon_threadsafe(commands.put_nowait, line)

    threading.Thread(target=reader, name="stack-commands", daemon=True).start()


def main() -> int:
    """Run the stack until Ctrl-C; the exit status is 0 when every service then stopped cleanly."""
    parser = argparse.ArgumentParser(description="Run compose.yaml's services as local processes.")
    parser.add_argument(
        "--port-offset",
        type=int,
        default=0,
        help="add N to every published port, to run beside another stack (make dev PORT_OFFSET=N)",
    )
    args = parser.parse_args()
    # A stack moved to the background that reads the terminal would be stopped by SIGTTIN; ignored, the read
    # fails instead, and the commands are off while it runs there.
    signal.signal(signal.SIGTTIN, signal.SIG_IGN)

    async def main_async(volumes: Path) -> int:
        services = load(args.port_offset, volumes)
        ports = {int(address.rpartition(":")[2]) for s in services for address in [*s.ports.values(), *s.listens]}
        if ports and not 1 <= min(ports) <= max(ports) <= 65535:
            low, high = 1 - (min(ports) - args.port_offset), 65535 - (max(ports) - args.port_offset)
            parser.error(
                f"--port-offset {args.port_offset} moves ports outside 1-65535 (to {min(ports)}-{max(ports)}); "
                f"use an offset from {low} to {high}"
            )
        held = taken(services)
        if held:  # before anything starts: a second stack must not run half a stack, nor print tracebacks
            for line in clash(held, services, args.port_offset):
                print(line, flush=True)
            return 1
        commands: asyncio.Queue[str] = asyncio.Queue()
        read_commands(asyncio.get_running_loop(), commands)
        return await run(services, partial(print, flush=True), commands, port_offset=args.port_offset)

    with tempfile.TemporaryDirectory(prefix="gpuscaler-dev-") as volumes:
        try:
            return asyncio.run(main_async(Path(volumes)))
        except OSError as error:  # a command that cannot start; those started before it have been stopped
            parser.exit(1, f"stack: cannot run {error.filename}: {error.strerror}\n")


if __name__ == "__main__":
    sys.exit(main())
