"""What a benchmark measures: any ExternalScaler server, started from a command line or already running.

By default that is our agent (``gpuscaler serve --collector fake --fake-gpus 8``). ``--command`` starts
any other server instead, so that the prior art is measured by the same code with the same grpcio
client; ``--address`` measures a server that is already running (no start-up, no process figures).

A command names the port the benchmark talks to as ``{port}``; each ``{free_port}`` becomes another
unused port (for a metrics or probe listener). The benchmark picks the ports, so it knows where to
connect without reading the server's log. A server counts as started when ``grpc.health.v1.Health/Check``
answers SERVING, asked every 10 ms from just before the spawn.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpclib.health.v1.health_pb2 import HealthCheckRequest, HealthCheckResponse

from e2e.support.agent import CONSOLE_SCRIPT, HEALTH_CHECK_METHOD, agent_environment
from e2e.support.clients import GrpcioScaler, Metadata
from e2e.support.keda_grpcio import KedaProto

READY_TIMEOUT_SECONDS = 30.0
STOP_TIMEOUT_SECONDS = 60.0
HEALTH_EVERY_SECONDS = 0.01
OURS_NAME = "gpuscaler"
Popen = subprocess.Popen[bytes]


def ours_command(*, gpus: int = 8, poll_interval: float = 0.5) -> list[str]:
    """Our agent with fake GPUs, listening on ``{port}``, /metrics on a free port, JSON logs (as in a container)."""
    return [
        str(CONSOLE_SCRIPT),
        "serve",
        "--collector",
        "fake",
        "--fake-gpus",
        str(gpus),
        "--poll-interval",
        str(poll_interval),
        "--listen",
        "127.0.0.1:{port}",
        "--metrics-listen",
        "127.0.0.1:{free_port}",
        "--log-format",
        "json",
    ]


@dataclass(frozen=True, slots=True)
class Target:
    """Where the measured server comes from: a command (``argv`` with placeholders) or a running ``address``."""

    name: str
    argv: tuple[str, ...] = ()
    address: str | None = None
    metadata: tuple[tuple[str, str], ...] = (("gpuIndex", "0"),)

    @classmethod
    def ours(cls, metadata: Metadata | None = None) -> Target:
        return cls(OURS_NAME, tuple(ours_command()), metadata=_items(metadata))

    @classmethod
    def from_options(
        cls, *, name: str | None, command: str | None, address: str | None, metadata: Metadata | None
    ) -> Target:
        """Our agent unless ``command`` or ``address`` says otherwise; ``name`` labels the results."""
        if command and address:
            raise ValueError("give --command or --address, not both")
        if command:
            argv = tuple(shlex.split(command))
            if not any("{port}" in arg for arg in argv):
                raise ValueError("--command must contain {port}: the port the benchmark connects to")
            return cls(name or Path(argv[0]).name, argv, metadata=_items(metadata))
        if address:
            return cls(name or "external", address=address, metadata=_items(metadata))
        return cls.ours(metadata)

    @property
    def startable(self) -> bool:
        return bool(self.argv)

    @property
    def query(self) -> Metadata:
        return dict(self.metadata)


def _items(metadata: Metadata | None) -> tuple[tuple[str, str], ...]:
    return tuple((metadata or {"gpuIndex": "0"}).items())


@dataclass
class Server:
    """A server being measured: its address, and its pid when this benchmark started it."""

    address: str
    pid: int | None = None
    serving_after_seconds: float | None = None
    stop_seconds: float | None = None
    exit_code: int | None = None


def free_port() -> int:
    """A loopback port nothing listens on now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def expand(argv: Sequence[str]) -> tuple[list[str], int]:
    """``argv`` with ``{port}`` and each ``{free_port}`` replaced by unused ports; the first port too."""
    port = free_port()
    expanded = []
    for arg in argv:
        arg = arg.replace("{port}", str(port))
        while "{free_port}" in arg:
            arg = arg.replace("{free_port}", str(free_port()), 1)
        expanded.append(arg)
    return expanded, port


def health(address: str, timeout: float = 1.0) -> str:
    """The overall health status name, from a fresh grpcio channel (as a kubelet probe asks)."""
    with grpc.insecure_channel(address) as channel:
        check = channel.unary_unary(
            HEALTH_CHECK_METHOD,
            request_serializer=HealthCheckRequest.SerializeToString,
            response_deserializer=HealthCheckResponse.FromString,
        )
        response: HealthCheckResponse = check(HealthCheckRequest(service=""), timeout=timeout)
        return str(HealthCheckResponse.ServingStatus.Name(response.status))


def start(argv: Sequence[str], log_path: Path, timeout: float = READY_TIMEOUT_SECONDS) -> tuple[Server, Popen]:
    """Spawn ``argv`` and wait for SERVING; the time from just before the spawn is ``serving_after_seconds``."""
    expanded, port = expand(argv)
    address = f"127.0.0.1:{port}"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            expanded, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=agent_environment()
        )
    deadline = started + timeout
    last = "no answer"
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"{Path(expanded[0]).name} exited with {process.returncode} before serving ({last})")
        try:
            last = health(address)
        except grpc.RpcError as error:
            last = f"{error.code().name}"
        if last == "SERVING":
            break
        if time.monotonic() > deadline:
            process.kill()
            process.wait()
            raise RuntimeError(f"{Path(expanded[0]).name} did not serve within {timeout:g}s (last: {last})")
        time.sleep(HEALTH_EVERY_SECONDS)
    return Server(address, process.pid, serving_after_seconds=time.monotonic() - started), process


async def stop(server: Server, process: Popen) -> None:
    """SIGTERM, then SIGKILL after STOP_TIMEOUT_SECONDS; records how long the exit took and its code."""
    started = time.monotonic()
    process.send_signal(signal.SIGTERM)
    while process.poll() is None:
        if time.monotonic() - started > STOP_TIMEOUT_SECONDS:
            process.kill()
            break
        await asyncio.sleep(0.005)
    process.wait()
    server.stop_seconds = time.monotonic() - started
    server.exit_code = process.returncode


@contextlib.asynccontextmanager
async def running(target: Target, folder: Path) -> AsyncIterator[Server]:
    """The target's server for the block: started (and stopped after) when it is a command."""
    if target.address is not None:
        yield Server(target.address)
        return
    log_path = folder / "logs" / f"{target.name}-{time.monotonic_ns()}.log"
    server, process = await asyncio.to_thread(start, target.argv, log_path)
    try:
        yield server
    finally:
        await stop(server, process)


@contextlib.asynccontextmanager
async def client(server: Server, proto: KedaProto) -> AsyncIterator[GrpcioScaler]:
    """One grpcio channel to ``server``, as KEDA keeps one connection per scaler address."""
    scaler = GrpcioScaler(grpc.aio.insecure_channel(server.address), proto)
    try:
        yield scaler
    finally:
        await scaler.close()


def python_bytecode() -> None:
    """Compile our package's bytecode, as ``pip install`` of the wheel does in the image.

    An editable install under PYTHONDONTWRITEBYTECODE would otherwise compile every module at each
    start, which no deployed agent does.
    """
    package = Path(__file__).resolve().parents[1] / "gpuscaler"
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(package)], check=True, env=dict(os.environ))
