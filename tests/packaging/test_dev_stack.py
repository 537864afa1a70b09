"""dev/stack.py: compose.yaml read as local processes, with container addresses and paths mapped to the host."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "dev"))
import stack  # dev/ holds scripts, not a package

from tests.chart import chart_tools

ROOT = Path(__file__).resolve().parents[2]


def compose(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "compose.yaml"
    path.write_text(textwrap.dedent(text))
    return path


@pytest.mark.parametrize(
    ("text", "environ", "expected"),
    [
        ("$$node", {}, "$node"),
        ("${A}-$A", {"A": "x"}, "x-x"),
        ("${A:-fallback}", {}, "fallback"),
        ("${A:-fallback}", {"A": ""}, "fallback"),
        ("${A-fallback}", {"A": ""}, ""),
        ("${MISSING}", {}, ""),
    ],
)
def test_interpolation_follows_compose(text: str, environ: dict[str, str], expected: str) -> None:
    """$$ escapes a dollar; ${NAME}, $NAME and the :- and - defaults behave as in compose."""
    assert stack.interpolate(text, environ) == expected


def test_a_required_variable_that_is_unset_is_an_error() -> None:
    """${NAME:?message} stops with that message when NAME is unset."""
    with pytest.raises(stack.StackError, match="TOKEN is required: set it"):
        stack.interpolate("${TOKEN:?set it}", {})


@pytest.mark.parametrize(
    ("item", "expected"),
    [
        ("127.0.0.1:6001:6000", stack.Port(target=6000, published=6001, host_ip="127.0.0.1")),
        ("6001:6000/tcp", stack.Port(target=6000, published=6001, host_ip="0.0.0.0")),
        (
            {"name": "grpc", "host_ip": "127.0.0.1", "published": "6002", "target": 6000},
            stack.Port(target=6000, published=6002, host_ip="127.0.0.1", name="grpc"),
        ),
    ],
)
def test_ports_in_short_and_long_syntax(item: object, expected: stack.Port) -> None:
    """Both port syntaxes give the same published/target pair."""
    assert stack.parse_service("s", {"entrypoint": ["x"], "ports": [item]}, base_dir=ROOT).ports == (expected,)


@pytest.mark.parametrize("item", ["6000", "127.0.0.1:6000-6002:6000"])
def test_ports_without_one_fixed_host_port_are_refused(item: str) -> None:
    """A random or ranged host port has no fixed local address, so it is an error naming the service."""
    with pytest.raises(stack.StackError, match="service s: port"):
        stack.parse_service("s", {"entrypoint": ["x"], "ports": [item]}, base_dir=ROOT)


def test_compose_yaml_maps_to_distinct_local_listeners_and_host_files() -> None:
    """Each agent of compose.yaml listens on its published ports and reads its scenario from dev/scenarios."""
    services = stack.load_services(ROOT / "compose.yaml", environ={})
    assert [service.name for service in services] == ["node-a", "node-b", "node-c", "gateway", "keda-view"]
    processes = {service.name: stack.localize(service, services) for service in services}
    node_b = processes["node-b"]
    assert node_b.environment["GPUSCALER_LISTEN"] == "127.0.0.1:6002"
    assert node_b.environment["GPUSCALER_METRICS_LISTEN"] == "127.0.0.1:9403"
    assert node_b.argv[:2] == ("gpuscaler", "serve")
    scenario = Path(node_b.argv[node_b.argv.index("--fake-scenario") + 1])
    assert scenario == ROOT / "dev" / "scenarios" / "idle.yaml"
    assert scenario.is_file()
    listeners = [p.environment["GPUSCALER_LISTEN"] for p in processes.values() if "GPUSCALER_LISTEN" in p.environment]
    assert listeners == ["127.0.0.1:6001", "127.0.0.1:6002", "127.0.0.1:6003", "127.0.0.1:6000"]


def test_the_gateway_and_the_client_reach_services_at_their_published_ports() -> None:
    """`node-b:6000` in the gateway's agent list becomes 127.0.0.1:6002, `gateway:6000` in the client's script
    127.0.0.1:6000."""
    services = stack.load_services(ROOT / "compose.yaml", environ={})
    local = {service.name: stack.localize(service, services) for service in services}
    assert local["gateway"].argv == ("gpuscaler", "gateway", "--agents", "127.0.0.1:6001,127.0.0.1:6002,127.0.0.1:6003")
    client = local["keda-view"]
    assert client.argv[:2] == ("/bin/sh", "-c")
    assert "gpuscaler query --address 127.0.0.1:6000 profile=training" in client.argv[-1]


def test_listening_on_an_unpublished_port_is_an_error(tmp_path: Path) -> None:
    """As local processes all services share the host's ports, so an unpublished listener would collide."""
    path = compose(
        tmp_path,
        """
        services:
          a:
            entrypoint: [agent]
            environment: {LISTEN: "0.0.0.0:9402"}
        """,
    )
    (service,) = stack.load_services(path, environ={})
    with pytest.raises(stack.StackError, match=r"service a: listens on 0\.0\.0\.0:9402 but compose\.yaml publishes no"):
        stack.localize(service, [service])


def test_using_another_services_unpublished_port_is_an_error(tmp_path: Path) -> None:
    """A client cannot reach b:7000 locally when b publishes no port 7000."""
    path = compose(
        tmp_path,
        """
        services:
          a: {entrypoint: [client, "b:7000"]}
          b: {entrypoint: [agent], ports: ["127.0.0.1:6000:6000"]}
        """,
    )
    services = stack.load_services(path, environ={})
    with pytest.raises(stack.StackError, match="service a: uses b:7000, but b publishes no port 7000"):
        stack.localize(services[0], services)


@pytest.mark.parametrize(
    ("services", "message"),
    [
        ("a: {image: x}", "service a: no entrypoint"),
        ("a: {entrypoint: [x], depends_on: [b]}\n  b: {entrypoint: [x], depends_on: [a]}", "cycle"),
        ("a: {entrypoint: [x], depends_on: [nobody]}", "depends on nobody, which compose.yaml does not define"),
        ("a: {entrypoint: [x], environment: [FROM_HOST]}", "service a: FROM_HOST has no value"),
        ("a: {entrypoint: [x], stop_grace_period: soon}", "stop_grace_period 'soon' is not a duration"),
    ],
)
def test_what_a_local_process_cannot_do_is_refused(tmp_path: Path, services: str, message: str) -> None:
    """Each refusal names the service and what to change."""
    path = tmp_path / "compose.yaml"
    path.write_text(f"services:\n  {services}\n")
    with pytest.raises(stack.StackError, match=message):
        stack.load_services(path, environ={})


def test_startup_lines_list_every_address_and_the_keda_endpoint() -> None:
    """`up` prints each service's addresses and that KEDA-like clients use 127.0.0.1:6000 (the gateway)."""
    services = stack.load_services(ROOT / "compose.yaml", environ={})
    lines = stack.describe([stack.localize(service, services) for service in services])
    text = "\n".join(lines)
    for address in ("6000", "6001", "6002", "6003", "9402", "9403", "9404"):
        assert f"127.0.0.1:{address}" in text
    assert "KEDA-like clients connect to 127.0.0.1:6000 (gateway)" in lines


def test_local_environment_drops_the_developers_agent_settings(tmp_path: Path) -> None:
    """A GPUSCALER_* variable in the developer's shell does not leak into the stack; our venv comes first on PATH."""
    service = stack.Service(name="a", argv=("gpuscaler",), environment={"GPUSCALER_LISTEN": "127.0.0.1:6000"})
    process = stack.localize(service, [service])
    environment = stack.process_environment(
        process, {"PATH": "/usr/bin", "GPUSCALER_COLLECTOR": "nvml", "HOME": "/home/dev"}, tmp_path
    )
    assert environment == {"PATH": f"{tmp_path}:/usr/bin", "HOME": "/home/dev", "GPUSCALER_LISTEN": "127.0.0.1:6000"}


def test_plan_prints_each_local_command(capsys: pytest.CaptureFixture[str]) -> None:
    """`stack.py plan` shows what `up` would run, without starting anything."""
    assert stack.main(["plan"]) == 0
    out = capsys.readouterr().out
    assert "node-a: GPUSCALER_COLLECTOR=fake GPUSCALER_LISTEN=127.0.0.1:6001" in out
    assert f"--fake-scenario {ROOT}/dev/scenarios/busy.yaml" in out


async def _gone(pid: int) -> bool:
    """Whether the process has exited (and been reaped, which init may take a moment to do)."""
    for _ in range(50):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        await asyncio.sleep(0.05)
    return False


@pytest.mark.timeout(60)
async def test_up_runs_every_service_and_stops_them_all_on_sigterm(tmp_path: Path) -> None:
    """Output comes prefixed by service; SIGTERM stops every process group, killing one that ignores it."""
    python = sys.executable
    path = compose(
        tmp_path,
        f"""
        services:
          talker:
            entrypoint: [{python}, -c, "import time; print('hello', flush=True); time.sleep(60)"]
          stubborn:
            entrypoint:
              - {python}
              - -c
              - |
                import os, signal, time
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
                open("{tmp_path}/stubborn.pid", "w").write(str(os.getpid()))
                print("ignoring SIGTERM", flush=True)
                time.sleep(60)
            stop_grace_period: 500ms
          shell:
            entrypoint: [/bin/sh, -c, "sleep 60 & echo $$! > {tmp_path}/grandchild.pid; echo started; wait"]
        """,
    )
    services = stack.load_services(path, environ={})
    processes = [stack.localize(service, services) for service in services]
    lines: list[str] = []
    loop = asyncio.get_running_loop()
    started = {"talker   | hello", "stubborn | ignoring SIGTERM", "shell    | started"}

    def write(line: str) -> None:
        lines.append(line)
        if line in started:
            started.discard(line)
            if not started:  # everyone is up: stop the stack the way `kill` or Ctrl-C would
                loop.call_soon(os.kill, os.getpid(), signal.SIGTERM)

    code = await stack.run(processes, bin_dir=tmp_path, write=write)
    assert code == 1, "a service that had to be killed is a failure"
    assert "stubborn did not stop within 0.5s; killing it" in lines
    assert "stubborn exited with an error" in lines
    assert "talker exited with an error" not in lines
    assert await _gone(int((tmp_path / "stubborn.pid").read_text()))
    assert await _gone(int((tmp_path / "grandchild.pid").read_text())), "the shell's child went with its group"


async def test_a_command_that_cannot_start_stops_the_others_and_says_which(tmp_path: Path) -> None:
    """A missing executable is an error naming the service; the service started before it is stopped."""
    path = compose(
        tmp_path,
        f"""
        services:
          first: {{entrypoint: [{sys.executable}, -c, "import time; time.sleep(60)"]}}
          second: {{entrypoint: [{tmp_path}/no-such-program]}}
        """,
    )
    services = stack.load_services(path, environ={})
    lines: list[str] = []
    with pytest.raises(stack.StackError, match=r"service second: cannot run .*no-such-program: No such file"):
        await stack.run([stack.localize(s, services) for s in services], bin_dir=tmp_path, write=lines.append)
    assert lines == ["first  | exited with code -15"]


def _free_ports(count: int) -> list[int]:
    """Loopback ports free right now, so the real stack can run beside a developer's own `make dev`."""
    sockets = [socket.socket() for _ in range(count)]
    for sock in sockets:
        sock.bind(("127.0.0.1", 0))
    ports = [sock.getsockname()[1] for sock in sockets]
    for sock in sockets:
        sock.close()
    return ports


async def _query(address: str, deadline: float, gpus: int) -> dict[str, Any]:
    """`gpuscaler query --output json`, retried until the agent or gateway answers for that many GPUs."""
    gpuscaler = str(Path(sys.executable).parent / "gpuscaler")
    while True:
        child = await asyncio.create_subprocess_exec(
            gpuscaler, "query", "--address", address, "--output", "json", "profile=batch",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        out, _ = await child.communicate()
        if child.returncode == 0:
            report: dict[str, Any] = json.loads(out)
            if len(report["explanation"]["gpus"]) == gpus:
                return report
        assert time.monotonic() < deadline, f"nothing answered on {address} for {gpus} GPUs"
        await asyncio.sleep(0.2)


@pytest.mark.timeout(90)
async def test_the_compose_stack_runs_as_agents_that_answer_like_separate_nodes() -> None:
    """compose.yaml as local processes (moved to spare ports): each agent is its own node with its own GPUs,
    the busy node reads higher than the idle one, the gateway sees all three, and the client prints it."""
    services = stack.load_services(ROOT / "compose.yaml", environ={})
    spare = iter(_free_ports(sum(len(service.ports) for service in services)))
    services = [
        dataclasses.replace(s, ports=tuple(dataclasses.replace(p, published=next(spare)) for p in s.ports))
        for s in services
    ]
    lines: list[str] = []
    runner = asyncio.create_task(
        stack.run(
            [stack.localize(s, services) for s in services], bin_dir=Path(sys.executable).parent, write=lines.append
        )
    )
    deadline = time.monotonic() + 45
    try:
        expected = {"node-a": 8, "node-b": 2, "node-c": 4, "gateway": 14}
        reports = {s.name: await _query(s.ports[0].address, deadline, expected[s.name]) for s in services if s.ports}
        while not any(line.startswith("keda-view | What KEDA gets") for line in lines):
            assert time.monotonic() < deadline, "\n".join(lines[-20:])
            await asyncio.sleep(0.2)
    finally:
        if not runner.done():  # its handler takes the signal only while it runs
            os.kill(os.getpid(), signal.SIGTERM)  # what Ctrl-C does to `make dev`
        code = await runner
    assert code == 0, "\n".join(lines[-20:])
    gpus = {name: report["explanation"]["gpus"] for name, report in reports.items()}
    assert {name: {gpu["node"] for gpu in gpu_list} for name, gpu_list in gpus.items()} == {
        "node-a": {"gpu-node-a"},
        "node-b": {"gpu-node-b"},
        "node-c": {"gpu-node-c"},
        "gateway": {"gpu-node-a", "gpu-node-b", "gpu-node-c"},
    }
    value = {name: r["get_metrics"]["fields"]["metricValues"][0]["metricValueFloat"] for name, r in reports.items()}
    assert value["node-a"] > 8 * 50 > value["node-b"]


@pytest.fixture(scope="module")
def composecheck() -> Path:
    """tests/packaging/composecheck: compose-go, Docker Compose's own loader, printing a file's project as JSON."""
    try:
        return chart_tools.build_local("composecheck", Path(__file__).with_name("composecheck"))
    except chart_tools.ToolUnavailable as missing:
        pytest.skip(f"COMPOSE LOADER CHECK NOT RUN: it is built with Go, and there is none ({missing})")


def _compose_go(composecheck: Path, path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(composecheck), str(path)], capture_output=True, text=True, timeout=60, check=False)


@pytest.fixture(scope="module")
def compose_go_project(composecheck: Path) -> dict[str, Any]:
    """compose.yaml as compose-go reads it."""
    result = _compose_go(composecheck, ROOT / "compose.yaml")
    assert result.returncode == 0, result.stderr
    project: dict[str, Any] = json.loads(result.stdout)
    return project


@pytest.mark.timeout(300)
def test_compose_go_refuses_a_broken_file(composecheck: Path, tmp_path: Path) -> None:
    """The loader check is not vacuous: compose-go rejects a dependency on a service that does not exist."""
    path = compose(tmp_path, "services:\n  a: {image: x, depends_on: [nobody]}\n")
    result = _compose_go(composecheck, path)
    assert result.returncode == 1
    assert "nobody" in result.stderr


@pytest.mark.timeout(300)
def test_stack_reads_compose_yaml_as_docker_compose_does(compose_go_project: dict[str, Any]) -> None:
    """Per service, dev/stack.py's command, environment, ports, binds, order and grace equal compose-go's."""
    reference = compose_go_project["services"]
    services = stack.load_services(ROOT / "compose.yaml", environ={})
    assert sorted(s.name for s in services) == sorted(reference)
    for service in services:
        expected = reference[service.name]
        assert service.argv == (*expected.get("entrypoint", []), *expected.get("command", [])), service.name
        assert dict(service.environment) == expected.get("environment", {}), service.name
        ports = [(p["host_ip"], int(p["published"]), p["target"], p.get("name")) for p in expected.get("ports", [])]
        assert [(p.host_ip, p.published, p.target, p.name) for p in service.ports] == ports, service.name
        binds = [(Path(v["source"]), v["target"]) for v in expected.get("volumes", []) if v["type"] == "bind"]
        assert list(service.binds) == binds, service.name
        assert set(service.depends_on) == set(expected.get("depends_on", {})), service.name
        grace = expected.get("stop_grace_period")
        assert service.stop_grace_seconds == (float(grace.removesuffix("s")) if grace else 10.0), service.name
