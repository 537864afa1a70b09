"""`make dev`: compose.yaml's stack as local processes, serving what it prints, until Ctrl-C stops all of it."""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
SERVICES: dict[str, Any] = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]
# Node name -> GPU count, for each agent as compose.yaml configures it.
NODES = {
    spec["environment"]["NODE_NAME"]: int(spec["command"][spec["command"].index("--fake-gpus") + 1])
    for spec in SERVICES.values()
    if spec.get("command", [None])[0] == "serve"
}
PUBLISHED = [int(port["published"]) for spec in SERVICES.values() for port in spec.get("ports", [])]
T = TypeVar("T")


def _until(call: Callable[[], T], accept: Callable[[T], bool], timeout: float = 60) -> T:
    """Calls ``call`` until ``accept`` takes its result, for at most ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not accept(result := call()):
        assert time.monotonic() < deadline, f"not there after {timeout}s: {result!r}"[:3000]
        time.sleep(0.1)
    return result


def _free(port: int) -> bool:
    """Whether a server could listen on the port now (SO_REUSEADDR, as servers bind)."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _gpus(address: str) -> Counter[str]:
    """GPUs per node in what `gpuscaler query` gets there, as a developer runs it; none while nothing answers."""
    command = [str(BIN / "gpuscaler"), "query", "--address", address, "--output", "json", "profile=batch"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60)
    gpus = json.loads(result.stdout)["explanation"]["gpus"] if result.returncode == 0 else []
    return Counter(gpu["node"] for gpu in gpus)


@dataclass
class Stack:
    """``python dev/stack.py``, what ``make dev`` runs, with every port moved by ``offset``, and its output."""

    offset: int
    process: subprocess.Popen[str]
    lines: list[str] = field(default_factory=list)

    def answers(self, address: str, nodes: dict[str, int]) -> None:
        """Waits until a query at ``address`` gets exactly those GPUs per node, while the stack runs."""
        _until(lambda: _gpus(address), lambda got: got == nodes or self.process.poll() is not None)
        assert self.process.poll() is None, self.tail()

    def tail(self) -> str:
        return "\n".join(self.lines[-30:])


@contextlib.contextmanager
def running_stack() -> Iterator[Stack]:
    """A stack, in a process group of its own as a shell starts it, once its gateway answers for every agent's
    GPUs; Ctrl-C'd on the way out if still running."""
    # Every port moved to one free now, so that the test runs beside a developer's own `make dev`.
    offset = _until(lambda: random.randrange(10_000, 23_000), lambda n: all(_free(p + n) for p in PUBLISHED))
    process = subprocess.Popen(
        [sys.executable, "dev/stack.py", "--port-offset", str(offset)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    assert process.stdout is not None
    stack = Stack(offset, process)
    reader = threading.Thread(target=lambda: stack.lines.extend(line.rstrip() for line in process.stdout or []))
    reader.start()
    try:
        stack.answers(f"127.0.0.1:{6000 + offset}", NODES)
        yield stack
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGINT)
        process.wait(timeout=60)
        reader.join(timeout=60)  # it reads to the end: only the stack itself holds the pipe
        process.stdout.close()


@pytest.fixture(scope="module")
def dev_stack() -> Iterator[Stack]:
    """One running stack for the tests that only look at it."""
    with running_stack() as stack:
        yield stack


@pytest.mark.timeout(180)
def test_it_serves_every_node_and_the_gateway_at_the_addresses_it_prints(dev_stack: Stack) -> None:
    """The banner names every port compose.yaml publishes; each agent answers there as its own node with its
    GPUs, the gateway for all of them, and each metrics address serves that node's series."""
    # The gateway answered, so the banner is out: it comes before anything can answer.
    lines = dev_stack.lines
    first = next(line for line in lines if line.startswith("gpuscaler dev stack"))
    banner = lines[lines.index(first) : lines.index("Ctrl-C stops them all.")]
    printed = {
        words[0]: dict(re.findall(r"(\w+) (127\.0\.0\.1:\d+)", line))
        for line in banner
        if (words := line.split()) and words[0] in SERVICES
    }
    assert printed == {
        name: {port["name"]: f"127.0.0.1:{int(port['published']) + dev_stack.offset}" for port in spec.get("ports", [])}
        for name, spec in SERVICES.items()
    }
    gateway = next(name for name, spec in SERVICES.items() if spec["command"][0] == "gateway")
    assert f"KEDA-like clients connect to {printed[gateway]['grpc']} ({gateway}), e.g.:" in banner
    for name, spec in SERVICES.items():
        if spec["command"][0] == "serve":
            node = spec["environment"]["NODE_NAME"]
            dev_stack.answers(printed[name]["grpc"], {node: NODES[node]})
            with urllib.request.urlopen(f"http://{printed[name]['metrics']}/metrics", timeout=30) as response:
                series = re.findall(rf'^gpuscaler_gpu_up{{.*node="{node}"', response.read().decode(), re.M)
            assert len(series) == NODES[node], name
    dev_stack.answers(printed[gateway]["grpc"], NODES)


@pytest.mark.timeout(180)
def test_the_readme_dev_commands_work_against_it(dev_stack: Stack) -> None:
    """Each command README shows for a running `make dev` succeeds against it (on its ports; `--watch` left out,
    so it runs once), and the query after `fake fail` gets the UNAVAILABLE KEDA would."""
    readme = (ROOT / "README.md").read_text()
    match = re.search(r"With `make dev` running.*?```sh\n(.*?)```", readme, re.S)
    assert match is not None
    commands = match[1].splitlines()
    assert any("fake fail" in command for command in commands)
    after_failure = False
    for command in commands:
        if "--address" not in command:  # the CLI's default, which README relies on
            command = re.sub(r"gpuscaler (query|fake \w+)", r"\g<0> --address 127.0.0.1:6000", command)
        command = re.sub(r"127\.0\.0\.1:(\d+)", lambda m: f"127.0.0.1:{int(m[1]) + dev_stack.offset}", command)
        command = re.sub(r" --watch \d+", "", command.replace(".venv/bin/", f"{BIN}/"))
        result = subprocess.run(["bash", "-o", "pipefail", "-c", command], capture_output=True, text=True, timeout=60)
        if after_failure:
            assert result.returncode == 1, (command, result.stdout, result.stderr)
            assert "UNAVAILABLE" in result.stdout, command
        else:
            assert result.returncode == 0, (command, result.stdout, result.stderr)
        after_failure = "fake fail" in command


@pytest.mark.timeout(180)
def test_keda_view_prints_what_keda_gets_from_the_gateway(dev_stack: Stack) -> None:
    """keda-view's loop prints `gpuscaler query`'s report from the gateway, with the GPUs of every node."""
    _until(
        lambda: "\n".join(line for line in dev_stack.lines if line.startswith("keda-view")),
        lambda text: "What KEDA gets" in text and all(node in text for node in NODES),
    )


@pytest.mark.timeout(180)
def test_a_second_stack_on_taken_ports_stops_with_the_reason(dev_stack: Stack) -> None:
    """A second `make dev` beside a running one does not run half a stack: it stops every service, says which
    address is taken, and exits 1."""
    command = [sys.executable, "dev/stack.py", "--port-offset", str(dev_stack.offset)]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stdout[-3000:]
    assert "address already in use" in result.stdout
    dev_stack.answers(f"127.0.0.1:{6000 + dev_stack.offset}", NODES)  # the first one still runs


def _processes() -> dict[int, tuple[int, str, str, str]]:
    """pid -> (parent pid, state, time since it started as [[dd-]hh:]mm:ss, command line), from ps."""
    command = ["ps", "-A", "-o", "pid=,ppid=,stat=,etime=,args="]
    out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    rows = (line.split(maxsplit=4) for line in out.splitlines())
    return {int(pid): (int(ppid), stat, etime, args) for pid, ppid, stat, etime, args in rows}


def _descendants(root: int, processes: dict[int, tuple[int, str, str, str]]) -> set[int]:
    found = {root}
    while more := {pid for pid, (ppid, *_) in processes.items() if ppid in found} - found:
        found |= more
    return found - {root}


@pytest.mark.timeout(180)
def test_ctrl_c_stops_every_process_it_started_and_exits_0() -> None:
    """SIGINT to its process group, as Ctrl-C sends it, ends the stack with status 0 within seconds; every process
    it started, the shell's children too, is gone and every port is free for the next `make dev`."""
    with running_stack() as stack:
        # Ctrl-C in the first second of keda-view's `sleep 10`: had only the shell been stopped, not its process
        # group, that sleep would hold the stack's pipe, and so the stack, for 9 s more.
        processes = _until(
            _processes,
            lambda table: any(table[p][2:] == ("00:00", "sleep 10") for p in _descendants(stack.process.pid, table)),
        )
        started = _descendants(stack.process.pid, processes)
        os.killpg(stack.process.pid, signal.SIGINT)
        try:
            assert stack.process.wait(timeout=8) == 0, stack.tail()
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running 8 s after Ctrl-C:\n{stack.tail()}")
    _until(  # a zombie has exited; only init has yet to reap it
        lambda: {pid for pid, (_, stat, *_) in _processes().items() if pid in started and not stat.startswith("Z")},
        lambda alive: not alive,
        timeout=5,
    )
    assert all(_free(port + stack.offset) for port in PUBLISHED)
