"""The one-line errors that docs/troubleshooting.md quotes: each names what is wrong and what to check."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import trustme

from gpuscaler.agent.collectors.nvml import NvmlCollector
from gpuscaler.agent.process import Agent
from gpuscaler.cli import main
from gpuscaler.model.errors import ConfigError
from gpuscaler.tls import server_context
from tests.conftest import serve_settings
from tests.fakes.fake_nvml import FakeDevice, FakeNvml


async def run_cli(*argv: str) -> int:
    """Runs `gpuscaler ARGV...` in a thread (it runs its own event loop) and returns its exit code."""
    return await asyncio.to_thread(main, list(argv), {})


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A loopback port that another socket is listening on."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield int(holder.getsockname()[1])


@pytest.fixture
def ca_path(tmp_path: Path) -> Path:
    """A PEM CA bundle that signed nothing the agent serves."""
    path = tmp_path / "ca.pem"
    trustme.CA().cert_pem.write_to_path(str(path))
    return path


def test_missing_tls_cert_names_the_cert_flag(tmp_path: Path) -> None:
    """A missing --tls-cert is reported under --tls-cert with its path, not as the key."""
    leaf = trustme.CA().issue_cert("localhost")
    key = tmp_path / "tls.key"
    leaf.private_key_pem.write_to_path(str(key))
    with pytest.raises(ConfigError, match=r"^--tls-cert '.*missing\.crt': no such file$"):
        server_context(tmp_path / "missing.crt", key, None)


def test_missing_tls_key_names_the_key_flag(tmp_path: Path) -> None:
    """A missing --tls-key is reported under --tls-key with its path."""
    leaf = trustme.CA().issue_cert("localhost")
    cert = tmp_path / "tls.crt"
    leaf.cert_chain_pems[0].write_to_path(str(cert))
    with pytest.raises(ConfigError, match=r"^--tls-key '.*missing\.key': no such file$"):
        server_context(cert, tmp_path / "missing.key", None)


def test_serve_on_a_busy_port_exits_1_with_one_line(busy_port: int) -> None:
    """`serve` on a port in use exits 1 with one `gpuscaler serve: --listen ...` line, no traceback."""
    # A real process: `serve` configures logging for the whole interpreter.
    result = subprocess.run(
        [
            *(sys.executable, "-m", "gpuscaler", "serve", "--collector", "fake", "--log-level", "warning"),
            *("--listen", f"127.0.0.1:{busy_port}", "--metrics-listen", "0"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 1
    last_line = result.stderr.splitlines()[-1]
    assert last_line.startswith(f"gpuscaler serve: --listen 127.0.0.1:{busy_port}: cannot listen")
    assert "Traceback" not in result.stderr


async def test_tls_client_against_a_plain_agent_says_so(
    agent: Agent, ca_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--tls-ca against an agent without TLS says the server there does not speak TLS, in one line."""
    code = await run_cli("query", "--address", f"127.0.0.1:{agent.port}", "--tls-ca", str(ca_path), "profile=batch")
    err = capsys.readouterr().err
    assert code == 1
    assert err.strip() == (
        f"gpuscaler query: cannot reach 127.0.0.1:{agent.port}: the server there does not speak TLS; "
        "drop --tls-ca, --tls-cert and --tls-key"
    )


async def test_fake_against_an_nvml_agent_says_it_has_no_fake_gpus(capsys: pytest.CaptureFixture[str]) -> None:
    """`gpuscaler fake` against an agent on NVML says that agent has no fake GPUs."""
    collector = NvmlCollector(node="node-a", nvml=FakeNvml([FakeDevice(uuid="GPU-a")]))
    agent = await Agent.start(serve_settings(), collector)
    try:
        code = await run_cli("fake", "heal", "--address", f"127.0.0.1:{agent.port}", "--gpu", "all")
    finally:
        await agent.stop()
    assert code == 1
    error = capsys.readouterr().err
    assert error.startswith(f"gpuscaler fake heal: UNIMPLEMENTED: 127.0.0.1:{agent.port} has no fake GPUs")
    assert "pass --address" in error


async def test_fake_value_errors_quote_the_value_as_typed(agent: Agent, capsys: pytest.CaptureFixture[str]) -> None:
    """An out-of-range fake value is quoted as typed ('150'), not as the wire's double ('150.0')."""
    code = await run_cli("fake", "set", "--address", f"127.0.0.1:{agent.port}", "--gpu", "0", "gpu_utilization=150")
    assert code == 1
    assert "gpu_utilization '150' is a percentage" in capsys.readouterr().err
