"""compose.yaml under `docker compose` on podman, from the image `make image` built: every service runs (none has a
shell to run), the README's dev-stack commands get what `make dev` gives, and one node going quiet reads as in
docs/gateway.md."""

from __future__ import annotations

import json
import re
import subprocess
import time
import urllib.request
from collections.abc import Callable
from functools import partial
from typing import Any, TypeVar

import yaml

from e2e.compose.conftest import BIN, EXPECTED_GPUS, gpus_per_node
from e2e.compose.project import ROOT, Project, published_ports
from image.build import project_version
from tests import readme_commands

T = TypeVar("T")
SERVICES: dict[str, Any] = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]
DIRECTORY: dict[str, Any] = yaml.safe_load((ROOT / "dev" / "pods.yaml").read_text())
ASSIGNED: dict[str, dict[str, list[int]]] = yaml.safe_load((ROOT / "dev" / "kubelet.yaml").read_text())["nodes"]


def _until(call: Callable[[], T], accept: Callable[[T], bool], timeout: float = 60) -> T:
    """Calls ``call`` until ``accept`` takes its result, for at most ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not accept(result := call()):
        assert time.monotonic() < deadline, f"not there after {timeout}s: {result!r}"[:3000]
        time.sleep(0.2)
    return result


def _moved(stack: Project, command: str) -> str:
    """A README command for the default ports, pointed at the project's: each 127.0.0.1:PORT becomes the port that
    replaced it, a query or fake command without --address gets the gateway's, and .venv/bin is this venv's."""
    defaults = {port.default: value for port, value in stack.moved.items()}
    if "--address" not in command:  # the CLI's default, the gateway on 6000, which README relies on
        command = re.sub(r"gpuscaler (query|fake \w+)", r"\g<0> --address 127.0.0.1:6000", command)
    command = re.sub(r"127\.0\.0\.1:(\d+)", lambda m: f"127.0.0.1:{defaults[int(m[1])]}", command)
    return command.replace(".venv/bin/", f"{BIN}/")


def _query(stack: Project, *words: str) -> dict[str, Any]:
    """`gpuscaler query --output json` at the gateway."""
    command = [str(BIN / "gpuscaler"), "query", "--address", stack.address("gateway", "grpc"), "--output", "json"]
    result = subprocess.run([*command, *words], capture_output=True, text=True, timeout=60)
    report: dict[str, Any] = json.loads(result.stdout)
    return report


def test_every_service_runs_the_image_make_image_built(stack: Project) -> None:
    """All of compose.yaml's services run, from the image `make image` built (which has no shell), each port
    published where its variable put it."""
    containers = {container["Service"]: container for container in stack.containers()}
    assert set(containers) == set(SERVICES)
    for name, container in containers.items():
        assert container["State"] == "running", (name, container["Status"])
        assert container["Image"].removeprefix("localhost/") == f"gpuscaler:{project_version()}", name
    published = {
        (name, int(port["PublishedPort"]))
        for name, container in containers.items()
        for port in container.get("Publishers") or []
        if port.get("PublishedPort")
    }
    expected = {(port.service, value) for port, value in stack.moved.items()}
    assert expected <= published
    assert all(port.default != value for port, value in stack.moved.items()), "every port moved off its default"


def test_keda_view_prints_what_keda_gets_from_the_gateway(stack: Project) -> None:
    """keda-view, a Python process with no shell, prints `gpuscaler query`'s report from the gateway, with every
    node's GPUs, and the vllm pods' queue."""
    _until(
        lambda: stack.logs("keda-view"),
        lambda text: "What KEDA gets" in text and all(node in text for node in EXPECTED_GPUS) and "vllm" in text,
        timeout=90,
    )


def test_the_readme_dev_commands_answer_as_under_make_dev(stack: Project) -> None:
    """Each command README shows for the dev stack succeeds (`--watch` left out, so it runs once), and the query
    after `fake fail` gets the UNAVAILABLE KEDA would, as under `make dev`."""
    commands = readme_commands.block(readme_commands.DEV_STACK)
    results = [readme_commands.run(re.sub(r" --watch \d+", "", _moved(stack, command))) for command in commands]
    readme_commands.check_dev_stack(commands, results)


def _held_by(namespace: str, chosen: Callable[[dict[str, Any]], bool]) -> set[tuple[str, int]]:
    """(node, GPU index) of every GPU the fake kubelet gives the directory's pods of ``namespace`` that ``chosen``
    picks."""
    pods = {f"{namespace}/{pod['pod']}" for pod in DIRECTORY["pods"] if pod["namespace"] == namespace and chosen(pod)}
    return {(node, i) for node, held in ASSIGNED.items() for pod, gpus in held.items() if pod in pods for i in gpus}


def test_pod_queries_count_the_gpus_of_the_pods_they_select(stack: Project) -> None:
    """Through the gateway, trainer's query gets its pods' 8 GPUs and no other, and the podSelector one leaves
    team-b's vllm pods out: what dev/kubelet.yaml gives the pods dev/pods.yaml says each selects."""
    trainer = _held_by("ml", lambda pod: pod["workload"] == "trainer")
    serving = _held_by("ml", lambda pod: pod["labels"].get("app") == "vllm" and pod["labels"].get("tier") == "serving")
    team_b = _held_by("team-b", lambda pod: True)
    assert len(trainer) == 8
    assert team_b
    for words, expected in (
        (("namespace=ml", "workload=trainer", "profile=training"), trainer),
        (("namespace=ml", "podSelector=app=vllm,tier=serving", "metric=gpu_utilization"), serving),
    ):
        report = _until(partial(_query, stack, *words), lambda got: bool(got["get_metrics"]["ok"]))
        gpus = {(gpu["node"], gpu["index"]) for gpu in report["explanation"]["gpus"]}
        assert gpus == expected, words
        assert not gpus & team_b


def test_the_engine_pages_answer_where_the_gateway_reads_them(stack: Project) -> None:
    """Each fake vLLM page, published by the gateway's container, serves vLLM's queue series, and the vllm-queue
    query sums what the gateway reads from them."""
    for name in ("vllm1", "vllm2", "vllm3"):
        with urllib.request.urlopen(f"http://{stack.address('gateway', name)}/metrics", timeout=30) as response:
            assert re.search(r"^vllm:num_requests_waiting\{", response.read().decode(), re.M), name
    report = _until(
        lambda: _query(stack, "--scaled-object", "ml/vllm", "workload=vllm", "profile=vllm-queue"),
        lambda got: bool(got["get_metrics"]["ok"]),
    )
    rows = [row for row in report["explanation"]["pods"] if row["included"]]
    assert {row["pod"] for row in rows} == {
        pod["pod"] for pod in DIRECTORY["pods"] if pod["namespace"] == "ml" and pod["workload"] == "vllm"
    }
    assert report["get_metrics"]["fields"]["metricValues"][0]["metricValueFloat"] == sum(row["value"] for row in rows)


def test_one_node_going_quiet_reads_unavailable_naming_it(stack: Project) -> None:
    """`docker compose stop node-b`: the other agents keep answering, and the README's quiet-node commands get what
    their comments say (UNAVAILABLE naming gpu-node-b where it counts, values from the two nodes it hears where
    that is allowed); `docker compose start node-b` brings the gateway back to every GPU."""
    stack.check("stop", "node-b")
    try:
        _until(lambda: bool(_query(stack, "profile=batch")["get_metrics"]["ok"]), lambda ok: not ok)
        for port in published_ports():
            if port.service.startswith("node-") and port.service != "node-b" and port.name == "grpc":
                node = SERVICES[port.service]["environment"]["NODE_NAME"]
                got = _until(partial(gpus_per_node, stack.address(port.service, "grpc")), bool)
                assert set(got) == {node}, port.service
        for command in readme_commands.block(readme_commands.QUIET_NODE):
            command = _moved(stack, command)
            readme_commands.check_quiet_node(command, readme_commands.run(command))
    finally:
        stack.check("start", "node-b")
    _until(lambda: gpus_per_node(stack.address("gateway", "grpc")), lambda got: got == EXPECTED_GPUS, timeout=90)
