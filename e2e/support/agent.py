"""A ``gpuscaler serve --collector fake`` process, started the way a user starts it, on an ephemeral loopback port.

The process is the console script installed next to this interpreter. Its JSON log goes to a file that the
tests read (the ``agent_started`` event carries the bound port). ``stop`` sends SIGTERM and insists on exit 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from grpclib.health.v1.health_pb2 import HealthCheckRequest, HealthCheckResponse

from e2e.support.certs import TlsFiles, grpcio_credentials

CONSOLE_SCRIPT = Path(sys.executable).with_name("gpuscaler")
HEALTH_CHECK_METHOD = "/grpc.health.v1.Health/Check"
NODE_NAME = "e2e-node"
READY_TIMEOUT_SECONDS = 30.0
STOP_TIMEOUT_SECONDS = 20.0


class AgentFailed(AssertionError):
    """The agent process did not start, did not stop cleanly, or logged an unexpected error."""


@dataclass
class AgentProcess:
    """One running agent. Use ``start`` to make one; ``stop`` (or ``terminate``) ends it."""

    process: subprocess.Popen[bytes]
    log_path: Path
    port: int
    argv: Sequence[str]
    tls: TlsFiles | None = None
    mtls: bool = False
    started_at: float = 0.0
    serving_after_seconds: float = 0.0
    stop_seconds: float = 0.0
    expect_errors: bool = False
    expected_exit_code: int = 0

    @classmethod
    def start(
        cls,
        *flags: str,
        log_dir: Path,
        gpus: int = 8,
        poll_interval: float = 0.5,
        tls: TlsFiles | None = None,
        mtls: bool = False,
        ready_timeout: float = READY_TIMEOUT_SECONDS,
    ) -> AgentProcess:
        """Start an agent with ``gpus`` fake GPUs and wait until its health check says SERVING."""
        argv = [
            str(CONSOLE_SCRIPT),
            "serve",
            "--collector",
            "fake",
            "--listen",
            "127.0.0.1:0",
            "--fake-gpus",
            str(gpus),
            "--poll-interval",
            str(poll_interval),
            "--log-format",
            "json",
            "--metrics-listen",
            "127.0.0.1:0",  # an ephemeral port too, so agents side by side never collide
        ]
        if tls is not None:
            argv += ["--tls-cert", str(tls.server_cert), "--tls-key", str(tls.server_key)]
            if mtls:
                argv += ["--tls-client-ca", str(tls.ca)]
        argv += list(flags)
        log_dir.mkdir(parents=True, exist_ok=True)
        log_path = log_dir / f"agent-{time.monotonic_ns()}.log"
        started_at = time.monotonic()
        with log_path.open("wb") as log_file:
            process = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT, env=agent_environment()
            )
        agent = cls(process, log_path, 0, argv, tls=tls, mtls=mtls, started_at=started_at)
        try:
            agent.port = agent._wait_for_port(ready_timeout)
            agent.wait_health("SERVING", timeout=ready_timeout - (time.monotonic() - started_at))
        except BaseException:
            agent.kill()
            raise
        agent.serving_after_seconds = time.monotonic() - started_at
        return agent

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def metrics_port(self) -> int:
        """The port of /metrics, from the ``agent_started`` event."""
        return int(self.events("agent_started")[0]["metrics_port"])

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    # Logs

    def log_text(self) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace")

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def events(self, name: str | None = None) -> list[dict[str, Any]]:
        """The agent's JSON log events, oldest first; only those named ``name`` when given."""
        return [event for event in _events(self.log_text()) if name is None or event.get("event") == name]

    def unexpected_errors(self) -> list[str]:
        """Log lines at error level or above, and anything that is not a JSON event (a raw traceback)."""
        problems = []
        for line in self.log_text().splitlines():
            if not line.strip():
                continue
            try:
                event = json.loads(line)
            except ValueError:
                problems.append(line)
                continue
            if not isinstance(event, dict) or event.get("level") in ("error", "critical", "exception"):
                problems.append(line)
        return problems

    def _wait_for_port(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for event in self.events("agent_started"):
                return int(event["port"])
            if self.process.poll() is not None:
                raise AgentFailed(f"agent exited with {self.process.returncode} before listening:\n{self.log_tail()}")
            time.sleep(0.01)
        raise AgentFailed(f"agent did not log agent_started within {timeout:g}s:\n{self.log_tail()}")

    # Health, through grpcio with grpclib's health messages (standard protobuf classes)

    @contextlib.contextmanager
    def grpcio_channel(self, *, client_cert: bool | None = None) -> Iterator[Any]:
        """A synchronous grpcio channel to the agent, with TLS (and a client certificate under mTLS) if it uses it."""
        if self.tls is None:
            channel = grpc.insecure_channel(self.address)
        else:
            with_cert = self.mtls if client_cert is None else client_cert
            channel = grpc.secure_channel(
                self.address, grpcio_credentials(self.tls, client_cert=with_cert), options=self.tls.grpcio_options
            )
        try:
            yield channel
        finally:
            channel.close()

    def health(self, service: str = "", timeout: float = 2.0) -> str:
        """The agent's health status name (SERVING, NOT_SERVING, ...) from ``grpc.health.v1.Health/Check``."""
        with self.grpcio_channel() as channel:
            check = channel.unary_unary(
                HEALTH_CHECK_METHOD,
                request_serializer=HealthCheckRequest.SerializeToString,
                response_deserializer=HealthCheckResponse.FromString,
            )
            response: HealthCheckResponse = check(HealthCheckRequest(service=service), timeout=timeout)
            return str(HealthCheckResponse.ServingStatus.Name(response.status))

    def wait_health(self, status: str, timeout: float = 10.0) -> float:
        """Poll health until it reports ``status``; the seconds that took."""
        started = time.monotonic()
        deadline = started + max(timeout, 0.1)
        last = "no answer"
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AgentFailed(f"agent exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                last = self.health(timeout=1.0)
            except grpc.RpcError as error:
                last = f"{error.code().name}: {error.details()}"
            if last == status:
                return time.monotonic() - started
            time.sleep(0.01)
        raise AgentFailed(f"health did not become {status} within {timeout:g}s (last: {last}):\n{self.log_tail()}")

    # Stopping

    def stop(self, timeout: float = STOP_TIMEOUT_SECONDS) -> float:
        """SIGTERM, wait for the exit, and fail unless the exit code is 0; the seconds the exit took."""
        if self.process.poll() is not None:
            self._check_exit()
            return 0.0
        started = time.monotonic()
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AgentFailed(f"agent did not exit within {timeout:g}s of SIGTERM:\n{self.log_tail()}") from None
        self.stop_seconds = time.monotonic() - started
        self._check_exit()
        return self.stop_seconds

    async def terminate(self, timeout: float = STOP_TIMEOUT_SECONDS) -> float:
        """``stop`` without blocking the event loop, so that the test's clients see the drain as it happens."""
        if self.process.poll() is not None:
            self._check_exit()
            return 0.0
        started = time.monotonic()
        self.process.send_signal(signal.SIGTERM)
        while self.process.poll() is None:
            if time.monotonic() - started > timeout:
                self.kill()
                raise AgentFailed(f"agent did not exit within {timeout:g}s of SIGTERM:\n{self.log_tail()}")
            await asyncio.sleep(0.005)
        self.stop_seconds = time.monotonic() - started
        self._check_exit()
        return self.stop_seconds

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def _check_exit(self) -> None:
        code = self.process.returncode
        if code != self.expected_exit_code:
            raise AgentFailed(f"agent exited with {code}, not {self.expected_exit_code}:\n{self.log_tail()}")
        if not self.expect_errors and (problems := self.unexpected_errors()):
            raise AgentFailed("agent logged errors:\n" + "\n".join(problems[:20]))


def agent_environment(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The caller's environment without ``GPUSCALER_*`` settings, so that only the flags configure the agent."""
    environ = dict(os.environ if base is None else base)
    for key in [key for key in environ if key.startswith("GPUSCALER_")]:
        del environ[key]
    environ["NODE_NAME"] = NODE_NAME
    return environ


def _events(text: str) -> Iterator[dict[str, Any]]:
    for line in text.splitlines():
        with contextlib.suppress(ValueError):
            event = json.loads(line)
            if isinstance(event, dict):
                yield event
