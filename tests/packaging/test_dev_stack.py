"""`make dev`: compose.yaml's stack as local processes, serving what it prints (pod queries included), surviving one
service's end, until Ctrl-C stops all of it; and installed with the runtime dependencies alone."""

from __future__ import annotations

import ast
import contextlib
import importlib.metadata
import importlib.util
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

from tests import dev_scripts, readme_commands

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
SERVICES: dict[str, Any] = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]
# Node name -> GPU count, for each agent as compose.yaml configures it.
NODES = {
    spec["environment"]["NODE_NAME"]: int(spec["command"][spec["command"].index("--fake-gpus") + 1])
    for spec in SERVICES.values()
    if spec.get("command", [None])[0] == "serve"
}
# compose.yaml publishes each port at ``${VARIABLE:-default}``: the default, as no test sets the variables.
PORT_VARIABLE = re.compile(r"\$\{(?P<name>\w+):-(?P<default>\d+)\}")


def _default(port: dict[str, Any]) -> int:
    """Where compose.yaml publishes ``port`` when its variable is unset."""
    match = PORT_VARIABLE.fullmatch(port["published"])
    assert match is not None, port
    return int(match["default"])


PUBLISHED = [_default(port) for spec in SERVICES.values() for port in spec.get("ports", [])]
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

    def type(self, command: str) -> None:
        """A line typed into the stack's terminal."""
        assert self.process.stdin is not None
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()

    def said(self, pattern: str) -> str:
        """Waits for an output line that matches ``pattern`` (a regular expression), and returns it."""
        found = _until(
            lambda: next((line for line in list(self.lines) if re.search(pattern, line)), None),
            lambda line: line is not None or self.process.poll() is not None,
        )
        assert found is not None, f"the stack ended without saying {pattern!r}:\n{self.tail()}"
        return found

    def address(self, port: int) -> str:
        """127.0.0.1 and compose.yaml's published ``port``, moved by this stack's offset."""
        return f"127.0.0.1:{port + self.offset}"

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
        cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
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
        assert process.stdin is not None
        process.stdin.close()


@pytest.fixture(scope="module")
def dev_stack() -> Iterator[Stack]:
    """One running stack for the tests that only look at it."""
    with running_stack() as stack:
        yield stack


@pytest.mark.timeout(180)
def test_it_serves_every_node_and_the_gateway_at_the_addresses_it_prints(dev_stack: Stack) -> None:
    """The banner names every port compose.yaml publishes; each agent answers there as its own node with its
    GPUs, the gateway for all of them, and each metrics address serves that node's series."""
    dev_stack.said("^Ctrl-C stops them all.$")  # the banner comes once every service is up
    lines = dev_stack.lines
    first = next(line for line in lines if line.startswith("gpuscaler dev stack"))
    banner = lines[lines.index(first) : lines.index("Ctrl-C stops them all.")]
    printed = {
        words[0]: dict(re.findall(r"([\w-]+) (127\.0\.0\.1:\d+)", line))
        for line in banner
        if (words := line.split()) and words[0] in SERVICES
    }
    assert printed == {
        name: {port["name"]: f"127.0.0.1:{_default(port) + dev_stack.offset}" for port in spec.get("ports", [])}
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
    commands = readme_commands.block(readme_commands.DEV_STACK)
    results = []
    for command in commands:
        if "--address" not in command:  # the CLI's default, which README relies on
            command = re.sub(r"gpuscaler (query|fake \w+)", r"\g<0> --address 127.0.0.1:6000", command)
        command = re.sub(r"127\.0\.0\.1:(\d+)", lambda m: f"127.0.0.1:{int(m[1]) + dev_stack.offset}", command)
        command = re.sub(r" --watch \d+", "", command.replace(".venv/bin/", f"{BIN}/"))
        results.append(readme_commands.run(command))
    readme_commands.check_dev_stack(commands, results)


@pytest.mark.timeout(180)
def test_keda_view_prints_what_keda_gets_from_the_gateway(dev_stack: Stack) -> None:
    """keda-view's loop prints `gpuscaler query`'s report from the gateway, with the GPUs of every node."""
    _until(
        lambda: "\n".join(line for line in dev_stack.lines if line.startswith("keda-view")),
        lambda text: "What KEDA gets" in text and all(node in text for node in NODES),
    )


@pytest.mark.timeout(180)
def test_a_second_stack_on_taken_ports_stops_with_the_reason(dev_stack: Stack) -> None:
    """A second `make dev` beside a running one does not run half a stack: it starts no service, says which
    addresses are taken and the offset that moves past them, without a traceback, and exits 1."""
    command = [sys.executable, "dev/stack.py", "--port-offset", str(dev_stack.offset)]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stdout[-3000:]
    assert f"127.0.0.1:{6001 + dev_stack.offset} (node-a)" in result.stdout, result.stdout
    assert "taken by another process" in result.stdout
    assert "make dev PORT_OFFSET=" in result.stdout
    assert " | " not in result.stdout, "a service started"
    assert "Traceback" not in result.stdout + result.stderr
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
    it started, and any child of theirs, is gone and every port is free for the next `make dev`."""
    with running_stack() as stack:
        # Ctrl-C while keda-view waits for its next round: it must end at SIGTERM, not finish its wait.
        stack.said(r"^keda-view\s+\| What KEDA gets")
        started = _descendants(stack.process.pid, _processes())
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


# Which pod holds which GPU (dev/kubelet.yaml) and who each pod is (dev/pods.yaml): what pod queries must find.
KUBELET = dev_scripts.load("fake_kubelet")
ASSIGNED = KUBELET.parse_assignments((ROOT / "dev" / "kubelet.yaml").read_text(), "dev/kubelet.yaml")
DIRECTORY: dict[str, Any] = yaml.safe_load((ROOT / "dev" / "pods.yaml").read_text())
DRA_GPU = re.compile(r"gpu-(?P<minor>[0-9]+)")


def _indices(node: str, held: Any) -> list[int]:
    """The GPU indices a pod holds on ``node``: its device-plugin GPUs and its DRA GPUs (``gpu-<minor>``), whose minor
    number the fake collector counts down from the node's last index."""
    dra = [DRA_GPU.fullmatch(name) for name in held.dra]
    assert all(dra), f"dev/kubelet.yaml names only whole DRA GPUs, which this check places: {held.dra}"
    return [*held.gpus, *(NODES[node] - 1 - int(match["minor"]) for match in dra if match)]


def _held_by(namespace: str, chosen: Callable[[dict[str, Any]], bool]) -> set[tuple[str, int]]:
    """(node, GPU index) of every GPU the kubelet gives the directory's pods of ``namespace`` that ``chosen`` picks."""
    pods = {(namespace, pod["pod"]) for pod in DIRECTORY["pods"] if pod["namespace"] == namespace and chosen(pod)}
    return {
        (node, index)
        for node, assigned in ASSIGNED.items()
        for pod, held in assigned.items()
        if pod in pods
        for index in _indices(node, held)
    }


def _pod_query(address: str, *words: str) -> tuple[bool, set[tuple[str, int]]]:
    """Whether `gpuscaler query` got a value, and the (node, index) of the GPUs that went in."""
    command = [str(BIN / "gpuscaler"), "query", "--address", address, "--output", "json", *words]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60)
    report = json.loads(result.stdout)
    gpus = {(gpu["node"], gpu["index"]) for gpu in report["explanation"]["gpus"]}
    return bool(report["get_metrics"]["ok"]), gpus


POD_QUERIES = [
    (("namespace=ml", "workload=trainer", "profile=training"), "ml", lambda pod: pod["workload"] == "trainer"),
    (
        ("namespace=ml", "podSelector=app=vllm,tier=serving", "metric=gpu_utilization"),
        "ml",
        lambda pod: pod["labels"].get("app") == "vllm" and pod["labels"].get("tier") == "serving",
    ),
    (
        ("namespace=ml", "pod=trainer-7c9d8-x*", "metric=gpu_utilization"),
        "ml",
        lambda pod: pod["pod"].startswith("trainer-7c9d8-x"),
    ),
    (("namespace=team-b", "workload=vllm", "metric=gpu_utilization"), "team-b", lambda pod: pod["workload"] == "vllm"),
    (("namespace=ml", "workload=embedder", "metric=gpu_utilization"), "ml", lambda pod: pod["workload"] == "embedder"),
    (
        ("--scaled-object", "ml/vllm", "scaleTargetPods=true", "profile=vllm-inference"),
        "ml",
        lambda pod: pod["workload"] == "vllm",
    ),
]


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("words", "namespace", "chosen"), POD_QUERIES, ids=[" ".join(q[0]) for q in POD_QUERIES])
def test_pod_queries_count_exactly_the_gpus_the_fake_kubelet_gives_those_pods(
    dev_stack: Stack, words: tuple[str, ...], namespace: str, chosen: Callable[[dict[str, Any]], bool]
) -> None:
    """Through the gateway, `workload`, `podSelector`, `pod` and `scaleTargetPods` each get a value made of the GPUs
    dev/kubelet.yaml assigns to the pods dev/pods.yaml says they select, and no other GPU."""
    expected = _held_by(namespace, chosen)
    assert expected, "the query selects some GPU, or the check says nothing"
    gateway = dev_stack.address(6000)
    ok, gpus = _until(lambda: _pod_query(gateway, *words), lambda got: got == (True, expected), timeout=30)
    assert (ok, gpus) == (True, expected)


@pytest.mark.timeout(120)
def test_the_vllm_pods_queue_is_read_from_their_fake_engines(dev_stack: Stack) -> None:
    """`profile=vllm-queue workload=vllm` through the gateway reads each ml/vllm pod's fake engine (moved with the
    stack's ports), and the value is the sum of the pods' queues."""
    command = [str(BIN / "gpuscaler"), "query", "--address", dev_stack.address(6000), "--output", "json"]
    command += ["--scaled-object", "ml/vllm", "profile=vllm-queue", "workload=vllm"]

    def ask() -> dict[str, Any]:
        report: dict[str, Any] = json.loads(subprocess.run(command, capture_output=True, text=True, timeout=60).stdout)
        return report

    report = _until(ask, lambda got: bool(got["get_metrics"]["ok"]), timeout=60)
    rows = report["explanation"]["pods"]
    expected = {pod["pod"] for pod in DIRECTORY["pods"] if pod["namespace"] == "ml" and pod["workload"] == "vllm"}
    assert {row["pod"] for row in rows if row["included"]} == expected, rows
    value = report["get_metrics"]["fields"]["metricValues"][0]["metricValueFloat"]
    assert value == sum(row["value"] for row in rows), rows


def test_the_two_pod_files_describe_the_same_pods() -> None:
    """Every pod that holds a GPU in dev/kubelet.yaml is in dev/pods.yaml on that node and the other way round, every
    GPU index (and DRA GPU's minor number) exists on its node, no two pods hold one GPU, and some pod holds a DRA GPU
    whose minor number is not its index."""
    held = {(node, pod) for node, pods in ASSIGNED.items() for pod in pods}
    known = {(pod["node"], (pod["namespace"], pod["pod"])) for pod in DIRECTORY["pods"] if pod.get("gpus")}
    assert held == known
    for node, pods in ASSIGNED.items():
        indices = [index for entry in pods.values() for index in _indices(node, entry)]
        assert all(0 <= index < NODES[node] for index in indices), node
        assert len(indices) == len(set(indices)), f"two pods hold one GPU of {node}"
    assert any(
        _indices(node, KUBELET.Held(dra=entry.dra))
        != [int(m["minor"]) for name in entry.dra if (m := DRA_GPU.match(name))]
        for node, pods in ASSIGNED.items()
        for entry in pods.values()
        if entry.dra
    ), "a DRA GPU whose minor number is its index would not show that the agent reads minor numbers"


@pytest.mark.timeout(300)
def test_one_agent_ending_leaves_the_rest_serving_and_ctrl_c_still_stops_all() -> None:
    """kill -9 of one agent (its PID from the banner): the stack says so and how to start it again; the other
    agents, the kubelet and the gateway keep serving, and the README's quiet-node commands get what their comments
    say; `start` brings it back, `stop` ends one cleanly, and Ctrl-C then stops everything with status 0."""
    with running_stack() as stack:
        pid = int(re.findall(r"pid (\d+)", stack.said(r"^\s+node-b\s+pid \d+"))[0])
        os.kill(pid, signal.SIGKILL)
        others = len(SERVICES) - 1
        stack.said(
            rf"^stack: node-b exited \(signal SIGKILL\); {others} other service\(s\) keep running .*'start node-b'"
        )
        for name, spec in SERVICES.items():
            if name != "node-b" and spec["command"][0] == "serve":
                node = spec["environment"]["NODE_NAME"]
                stack.answers(stack.address(_default(spec["ports"][0])), {node: NODES[node]})
        gateway = stack.address(6000)
        _until(lambda: _pod_query(gateway, "profile=batch")[0], lambda ok: not ok)  # gpu-node-b is silent now
        for command in readme_commands.block(readme_commands.QUIET_NODE):
            command = re.sub(r"gpuscaler query", f"gpuscaler query --address {gateway}", command)
            command = command.replace(".venv/bin/", f"{BIN}/")
            readme_commands.check_quiet_node(command, readme_commands.run(command))
        stack.type("start node-b")
        stack.said(r"^stack: started node-b again \(pid \d+\)")
        stack.answers(gateway, NODES)
        stack.type("stop node-a")
        stack.said(rf"^stack: node-a stopped \(code 0\); {others} other service\(s\) keep running")
        stack.type("start node-a")
        stack.answers(gateway, NODES)
        os.killpg(stack.process.pid, signal.SIGINT)
        assert stack.process.wait(timeout=60) == 0, stack.tail()


def test_make_dev_moves_each_port_with_compose_yaml_s_variable(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The variables that move compose.yaml's published ports move `make dev`'s too, with --port-offset added on top:
    every published address, every address a service calls, and the pod directory's engine ports follow."""
    stack = dev_scripts.load("stack")
    moved: dict[tuple[str, str], int] = {}
    for name, spec in SERVICES.items():
        for port in spec.get("ports", []):
            variable = f"GPUSCALER_DEV_{name}_{port['name']}_PORT".upper().replace("-", "_")
            moved[name, port["name"]] = 21000 + len(moved)
            monkeypatch.setenv(variable, str(moved[name, port["name"]]))
    services = {service.name: service for service in stack.load(5, tmp_path)}
    got = {
        (name, port): int(address.rpartition(":")[2])
        for name, s in services.items()
        for port, address in s.ports.items()
    }
    assert got == {key: value + 5 for key, value in moved.items()}
    gateway = services["gateway"]
    agents = gateway.argv[gateway.argv.index("--agents") + 1].split(",")
    assert sorted(agents) == sorted(
        f"127.0.0.1:{moved[name, 'grpc'] + 5}" for name in services if name.startswith("node-")
    )
    directory = yaml.safe_load(Path(gateway.argv[gateway.argv.index("--pod-directory") + 1]).read_text())
    engine_ports = {
        int(pod["annotations"]["prometheus.io/port"])
        for pod in directory["pods"]
        if pod.get("annotations", {}).get("prometheus.io/port")
    }
    assert engine_ports == {moved["gateway", f"vllm{n}"] + 5 for n in (1, 2, 3)}
    monkeypatch.setenv("GPUSCALER_DEV_GATEWAY_GRPC_PORT", "60k")
    with pytest.raises(SystemExit, match="GPUSCALER_DEV_GATEWAY_GRPC_PORT='60k': a port number"):
        stack.load(0, tmp_path)


def test_unknown_commands_are_answered_with_the_list(dev_stack: Stack) -> None:
    """A line the stack does not know is answered with the commands and the services, and changes nothing."""
    dev_stack.type("restart everything")
    line = dev_stack.said(r"^stack: 'restart everything'\?")
    assert "start NAME" in line
    assert all(name in line for name in SERVICES)
    dev_stack.answers(dev_stack.address(6000), NODES)


def test_make_dev_installs_the_runtime_dependencies_only(tmp_path: Path) -> None:
    """In a fresh clone `make dev` installs gpuscaler without its [dev] extra (no mypy, ruff, pytest), and
    `make test` still installs it all."""
    venv = f"VENV={tmp_path / 'venv'}"
    dev = subprocess.run(["make", "-n", "dev", venv], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert dev.returncode == 0, dev.stderr
    assert "pip install --quiet --constraint constraints.txt -e .;" in dev.stdout
    assert "[dev]" not in dev.stdout
    assert "dev/stack.py" in dev.stdout
    full = subprocess.run(["make", "-n", "test", venv], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert "-e '.[dev]'" in full.stdout


def _requirements(distribution: str) -> set[str]:
    """The normalised names of a distribution's requirements outside any extra."""
    names = set()
    for requirement in importlib.metadata.requires(distribution) or []:
        if "extra ==" not in requirement:
            name = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", requirement)
            assert name is not None, requirement
            names.add(re.sub(r"[-_.]+", "-", name[0]).lower())
    return names


def test_the_dev_stack_imports_only_what_make_dev_installs() -> None:
    """dev/*.py import the standard library, gpuscaler and gpuscaler's runtime dependencies (with theirs) only, so
    the light install of `make dev` runs them."""
    runtime: set[str] = set()
    todo = _requirements("gpuscaler")
    while todo:
        name = todo.pop()
        runtime.add(name)
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            todo |= _requirements(name) - runtime
    providers = importlib.metadata.packages_distributions()
    for path in sorted((ROOT / "dev").glob("*.py")):
        tree = ast.parse(path.read_text())
        imported = {
            alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names
        }
        imported |= {
            node.module.split(".")[0]
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.module and not node.level
        }
        for module in sorted(imported - set(sys.stdlib_module_names) - {"__future__", "gpuscaler"}):
            distributions = {re.sub(r"[-_.]+", "-", d).lower() for d in providers.get(module, [])}
            assert distributions & runtime, f"{path.name} imports {module}, which `make dev` does not install"
