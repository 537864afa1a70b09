"""`make dev` on a taken port: which address, the offset that moves past it, no traceback, from every process."""

from __future__ import annotations

import contextlib
import os
import random
import re
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests import dev_scripts

ROOT = Path(__file__).resolve().parents[2]


STACK = dev_scripts.load("stack")


@contextlib.contextmanager
def _held(address: str) -> Iterator[None]:
    """Another process's listening socket on ``address``, as a second stack's would be."""
    host, _, port = address.rpartition(":")
    with socket.socket() as holder:
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        holder.bind((host, int(port)))
        holder.listen()
        yield


def _free_offset(tmp_path: Path) -> int:
    """An offset whose every listening address is free now, so that the test runs beside a developer's `make dev`."""
    while True:
        offset = random.randrange(10_000, 23_000)
        if not STACK.taken(STACK.load(offset, tmp_path)):
            return offset


def _services() -> list[Any]:
    """The stack's services as compose.yaml has them (no offset), for collecting the cases."""
    with tempfile.TemporaryDirectory() as volumes:
        return list(STACK.load(0, Path(volumes)))


def _listening() -> list[tuple[str, int]]:
    """(service, position) of every address each service listens on, in compose.yaml's order."""
    return [(s.name, n) for s in _services() for n in range(len(s.listens))]


def test_every_process_that_listens_is_known_to_the_stack(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The stack knows the addresses of the agents, the gateway and the fake engines (the kubelet's are unix sockets
    in the stack's own folder, which no other stack shares), so a check covers them all."""
    for variable in [name for name in list(os.environ) if name.startswith("GPUSCALER_DEV_")]:
        monkeypatch.delenv(variable)
    services = {service.name: service for service in STACK.load(0, tmp_path)}
    assert services["gateway"].listens == ("127.0.0.1:6000", "127.0.0.1:9400")
    assert services["node-a"].listens == ("127.0.0.1:6001", "127.0.0.1:9402")
    assert services["engines"].listens == ("127.0.0.1:8101", "127.0.0.1:8102", "127.0.0.1:8103")
    assert services["kubelet"].listens == ()
    published = {address for service in services.values() for address in service.ports.values()}
    assert published == {address for service in services.values() for address in service.listens}


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("service", "position"), _listening(), ids=lambda v: str(v))
def test_a_taken_address_stops_the_stack_before_anything_starts(service: str, position: int, tmp_path: Path) -> None:
    """`make dev` with one address another process holds starts no service, says which address and whose it is, and
    the PORT_OFFSET whose addresses are all free now; no traceback, exit 1."""
    offset = _free_offset(tmp_path)
    [address] = [s.listens[position] for s in STACK.load(offset, tmp_path) if s.name == service]
    with _held(address):
        result = subprocess.run(
            [sys.executable, "dev/stack.py", "--port-offset", str(offset)],
            cwd=ROOT, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    assert "Traceback" not in output
    assert output.splitlines()[0] == (
        f"stack: {address} ({service}) is taken by another process (another `make dev`?)"
    ), output
    suggested = re.search(r"make dev PORT_OFFSET=(\d+) \(or python dev/stack\.py --port-offset (\d+)\)", output)
    assert suggested is not None, output
    assert suggested[1] == suggested[2]
    assert int(suggested[1]) > offset
    assert "whose ports are all free now: the gateway at 127.0.0.1:" in output
    assert not STACK.taken(STACK.load(int(suggested[1]), tmp_path))
    assert " | " not in output, "a service started"


def _one_service_at_a_time() -> list[Any]:
    """One case per service that listens, each kind once: an agent, the gateway, the fake engines."""
    cases, kinds = [], set()
    for service in _services():
        kind = tuple(service.argv[:2])
        if service.listens and kind not in kinds:
            kinds.add(kind)
            cases.append(pytest.param(service.name, id=service.name))
    return cases


@pytest.mark.timeout(120)
@pytest.mark.parametrize("service", _one_service_at_a_time())
def test_a_service_that_meets_a_taken_address_says_so_in_one_line(service: str, tmp_path: Path) -> None:
    """When an address is taken after the stack's check (a race with another program), the service that cannot
    listen says so in one line, no traceback, and the stack adds whose address it is and the offset to use."""
    offset = _free_offset(tmp_path)
    [running] = [s for s in STACK.load(offset, tmp_path) if s.name == service]
    address = running.listens[-1]
    # The stack's run() with this one service, in a process of its own as `make dev` runs it; the check before
    # start is left out, as if the address had been taken just after it.
    driver = (
        "import asyncio, importlib.util, sys\n"
        "from pathlib import Path\n"
        "spec = importlib.util.spec_from_file_location('stack', 'dev/stack.py')\n"
        "stack = sys.modules['stack'] = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(stack)\n"
        f"services = [s for s in stack.load({offset}, Path(sys.argv[1])) if s.name == {service!r}]\n"
        f"sys.exit(asyncio.run(stack.run(services, lambda line: print(line, flush=True), port_offset={offset})))\n"
    )
    with _held(address):
        result = subprocess.run(
            [sys.executable, "-c", driver, str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=90
        )
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    assert "Traceback" not in output
    own = [line for line in output.splitlines() if line.startswith(f"{service} ") and address in line]
    assert len(own) == 1, output
    assert "cannot listen" in own[0]
    assert f"stack: {service} exited before every service was up; stopping the others" in output
    assert f"stack: {address} ({service}) is taken by another process" in output
    assert re.search(r"make dev PORT_OFFSET=\d+ ", output), output


def test_make_dev_passes_the_port_offset() -> None:
    """`make dev PORT_OFFSET=N` runs the stack with --port-offset N, and without it with 0."""
    moved = subprocess.run(
        ["make", "-n", "dev", "PORT_OFFSET=100"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert moved.returncode == 0, moved.stderr
    assert "dev/stack.py --port-offset 100" in moved.stdout
    plain = subprocess.run(["make", "-n", "dev"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert "dev/stack.py --port-offset 0" in plain.stdout


def test_an_offset_that_moves_ports_past_65535_is_refused_with_the_range(tmp_path: Path) -> None:
    """An offset that would move a port outside 1-65535 is a usage error naming the offsets that fit."""
    result = subprocess.run(
        [sys.executable, "dev/stack.py", "--port-offset", "60000"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2
    assert "--port-offset 60000 moves ports outside 1-65535" in result.stderr
    assert re.search(r"use an offset from -\d+ to \d+$", result.stderr.strip()), result.stderr


def test_the_fake_kubelet_that_cannot_listen_says_so_in_one_line(tmp_path: Path) -> None:
    """The kubelet's sockets are its own (a folder of the stack's), so no other stack takes them; one it still cannot
    make (a path over the unix socket limit here) ends it with one line naming the path, no traceback."""
    folder = tmp_path / ("x" * 120)
    result = subprocess.run(
        [sys.executable, "dev/fake_kubelet.py", "--assignments", "dev/kubelet.yaml", "--socket-dir", str(folder)],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    [line] = result.stderr.strip().splitlines()
    assert line.startswith(f"fake kubelet: cannot listen on {folder}/"), line
