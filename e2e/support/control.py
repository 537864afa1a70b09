"""Driving an agent's fake GPUs and reading its snapshots: in-process stubs, and the ``gpuscaler fake`` command.

``Control.set`` returns once the agent applied the values; ``next_tick`` waits for a snapshot whose reads
began after a given wall-clock time, so that a test can say "the agent has sampled my change" exactly.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path

from e2e.support.agent import CONSOLE_SCRIPT, AgentProcess
from e2e.support.certs import SERVER_NAME
from gpuscaler.client.channels import ClientOptions, client_address, open_channel
from gpuscaler.generated.gpuscaler import v1 as pb

FAILURES = {
    "lost": pb.FakeFailure.LOST,
    "not_supported": pb.FakeFailure.NOT_SUPPORTED,
    "timeout": pb.FakeFailure.TIMEOUT,
}


class Control:
    """FakeControl and Agent stubs over one grpclib channel to ``agent``."""

    def __init__(self, agent: AgentProcess) -> None:
        self._agent = agent
        self._stack = contextlib.AsyncExitStack()
        self._fake: pb.FakeControlStub | None = None
        self._api: pb.AgentStub | None = None

    async def __aenter__(self) -> Control:
        tls = self._agent.tls
        options = ClientOptions(
            address=client_address(self._agent.address),
            tls_ca=tls.ca if tls else None,
            tls_cert=tls.client_cert if tls and self._agent.mtls else None,
            tls_key=tls.client_key if tls and self._agent.mtls else None,
            server_name=SERVER_NAME if tls else None,
        )
        channel = await self._stack.enter_async_context(open_channel(options))
        self._fake = pb.FakeControlStub(channel)
        self._api = pb.AgentStub(channel)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self._stack.aclose()

    @property
    def fake(self) -> pb.FakeControlStub:
        assert self._fake is not None, "use Control as `async with`"
        return self._fake

    @property
    def api(self) -> pb.AgentStub:
        assert self._api is not None, "use Control as `async with`"
        return self._api

    async def set(self, gpu: int | None, values: Mapping[str, float]) -> pb.FakeGpus:
        """Set values on GPU ``gpu`` (None: every GPU); the next tick reads them."""
        selector = pb.GpuSelector(all=True) if gpu is None else pb.GpuSelector(index=gpu)
        return await self.fake.set(pb.SetRequest(gpu=selector, values=dict(values)), timeout=10)

    async def fail(self, gpu: int, failure: str) -> pb.FakeGpus:
        return await self.fake.fail(pb.FailRequest(index=gpu, failure=FAILURES[failure]), timeout=10)

    async def heal(self, gpu: int | None) -> pb.FakeGpus:
        selector = pb.GpuSelector(all=True) if gpu is None else pb.GpuSelector(index=gpu)
        return await self.fake.heal(pb.HealRequest(gpu=selector), timeout=10)

    async def snapshot(self) -> pb.Snapshot:
        return await self.api.get_snapshot(pb.GetSnapshotRequest(), timeout=10)

    async def next_tick(self, after: float | None = None, timeout: float = 10.0) -> pb.Snapshot:
        """The first snapshot whose tick began at or after ``after`` (wall clock; default: now)."""
        since = time.time() if after is None else after
        async with asyncio.timeout(timeout):
            async for snapshot in self.api.watch_snapshots(pb.WatchSnapshotsRequest()):
                if snapshot.taken_at_unix_seconds >= since:
                    return snapshot
        raise AssertionError("WatchSnapshots ended before a new snapshot")

    async def set_and_wait(self, gpu: int | None, values: Mapping[str, float]) -> pb.Snapshot:
        """``set``, then wait for the first tick that read the new values."""
        await self.set(gpu, values)
        return await self.next_tick(after=time.time())  # the Set call has returned: applied in the agent


def fake_cli(agent: AgentProcess, *args: str) -> subprocess.CompletedProcess[str]:
    """``gpuscaler fake ARGS... --address <agent>`` as a user types it; never raises on a non-zero exit."""
    return subprocess.run(
        [str(CONSOLE_SCRIPT), "fake", *args, "--address", agent.address],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


def write_scenario(path: Path, gpus: Mapping[int, Mapping[str, float]], *, power_limit_watts: float = 700.0) -> Path:
    """A ``--fake-scenario`` file giving each listed GPU constant values from the agent's first tick on."""
    document = {
        "defaults": {"power_limit_watts": power_limit_watts},
        "gpus": {str(index): {"values": dict(values)} for index, values in gpus.items()},
    }
    path.write_text(json.dumps(document, indent=2), encoding="utf-8")
    return path


async def fake_cli_async(agent: AgentProcess, *args: str) -> tuple[int, str]:
    """``fake_cli`` without blocking the event loop; (exit code, stdout and stderr)."""
    process = await asyncio.create_subprocess_exec(
        str(CONSOLE_SCRIPT),
        "fake",
        *args,
        "--address",
        agent.address,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    async with asyncio.timeout(30):
        output, _ = await process.communicate()
    assert process.returncode is not None
    return process.returncode, output.decode(errors="replace")
