"""Prometheus as prometheus-operator would run it for the chart's ServiceMonitor, over processes on loopback.

``scrape_config`` turns the ServiceMonitor that ``helm template`` renders into Prometheus' scrape configuration the
way the operator does, for the parts the chart uses: the selector of Services (matchLabels, matchExpressions In)
and the endpoint's port name become keep rules, the target's namespace, service, pod, container, endpoint and job
labels are set from Kubernetes' meta labels, and the chart's own relabelings and metricRelabelings follow, as
written. Kubernetes service discovery is replaced by a file of targets carrying the meta labels Kubernetes would
give the chart's Services' endpoints (``target``), so the relabelings run on the labels they would see in a
cluster. Only ``__meta_*`` labels come from this module: every label a series ends with is the chart's doing.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

Json = dict[str, Any]


def meta_name(label: str) -> str:
    """A Kubernetes label key as Prometheus' meta label suffix: every character outside [a-zA-Z0-9_] becomes _."""
    return re.sub(r"[^a-zA-Z0-9_]", "_", label)


def _relabeling(rule: Mapping[str, Any]) -> Json:
    """One ServiceMonitor relabeling (camelCase, as the CRD spells it) as Prometheus' relabel_config."""
    names = {"sourceLabels": "source_labels", "targetLabel": "target_label"}
    return {names.get(key, key.lower()): value for key, value in rule.items()}


def scrape_config(monitor: Json, files: Path) -> list[Json]:
    """The scrape jobs prometheus-operator makes of ``monitor``, one per endpoint, reading targets from ``files``."""
    selector = monitor["spec"]["selector"]
    keeps: list[Json] = []
    for key, value in (selector.get("matchLabels") or {}).items():
        keeps.append(
            {"source_labels": [f"__meta_kubernetes_service_label_{meta_name(key)}"], "regex": value, "action": "keep"}
        )
    for expression in selector.get("matchExpressions") or []:
        assert expression["operator"] == "In", f"the chart's selector uses {expression['operator']}: model it here"
        keeps.append(
            {
                "source_labels": [f"__meta_kubernetes_service_label_{meta_name(expression['key'])}"],
                "regex": "|".join(expression["values"]),
                "action": "keep",
            }
        )
    jobs = []
    for index, endpoint in enumerate(monitor["spec"]["endpoints"]):
        name = f"serviceMonitor/{monitor['metadata']['namespace']}/{monitor['metadata']['name']}/{index}"
        relabel = [
            *keeps,
            {"source_labels": ["__meta_kubernetes_endpoint_port_name"], "regex": endpoint["port"], "action": "keep"},
            *(
                {"source_labels": [f"__meta_kubernetes_{source}"], "target_label": target}
                for source, target in (
                    ("namespace", "namespace"),
                    ("service_name", "service"),
                    ("pod_name", "pod"),
                    ("pod_container_name", "container"),
                    ("service_name", "job"),
                )
            ),
            {"target_label": "endpoint", "replacement": endpoint["port"]},
            *(_relabeling(rule) for rule in endpoint.get("relabelings") or []),
        ]
        jobs.append(
            {
                "job_name": name,
                "honor_labels": bool(endpoint.get("honorLabels", False)),
                "metrics_path": endpoint.get("path", "/metrics"),
                "scheme": endpoint.get("scheme", "http"),
                "scrape_interval": "1s",  # the chart's interval, shortened so that the test waits seconds
                "scrape_timeout": "1s",
                "file_sd_configs": [{"files": [str(files)], "refresh_interval": "1s"}],
                "relabel_configs": relabel,
                "metric_relabel_configs": [_relabeling(rule) for rule in endpoint.get("metricRelabelings") or []],
            }
        )
    return jobs


def target(address: str, service: Json, pod: str, node: str, container: str) -> Json:
    """A file_sd target: the endpoint at ``address`` of the rendered ``service``'s ``metrics`` port, on pod ``pod``
    of node ``node``, with the meta labels Kubernetes' endpoints discovery gives it."""
    labels = {
        "__meta_kubernetes_namespace": service["metadata"]["namespace"],
        "__meta_kubernetes_service_name": service["metadata"]["name"],
        "__meta_kubernetes_pod_name": pod,
        "__meta_kubernetes_pod_node_name": node,
        "__meta_kubernetes_pod_container_name": container,
        "__meta_kubernetes_endpoint_port_name": "metrics",
    }
    for key, value in (service["metadata"].get("labels") or {}).items():
        labels[f"__meta_kubernetes_service_label_{meta_name(key)}"] = value
    port_names = [port.get("name") for port in service["spec"]["ports"]]
    assert "metrics" in port_names, f"Service {service['metadata']['name']} has no metrics port: {port_names}"
    return {"targets": [address], "labels": labels}


@dataclass
class Prometheus:
    """A Prometheus server on loopback and its HTTP API."""

    process: subprocess.Popen[bytes]
    port: int
    log: Path

    def api(self, path: str, **query: str) -> Any:
        """``/api/v1/<path>``'s data; raises with Prometheus' error."""
        url = f"http://127.0.0.1:{self.port}/api/v1/{path}"
        if query:
            url += "?" + urllib.parse.urlencode(query)
        with urllib.request.urlopen(url, timeout=10) as response:
            body = json.loads(response.read())
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expression: str) -> list[Json]:
        """The instant vector ``expression`` gives now."""
        data = self.api("query", query=expression)
        result: list[Json] = data["result"]
        return result

    def alerts(self) -> list[Json]:
        """Every pending or firing alert."""
        found: list[Json] = self.api("alerts")["alerts"]
        return found

    def wait(self, what: str, check: Any, timeout: float = 60) -> Any:
        """Calls ``check()`` until it returns something true, or fails naming ``what`` and the last answer."""
        deadline = time.monotonic() + timeout
        while True:
            self.alive()
            answer = check()
            if answer:
                return answer
            if time.monotonic() > deadline:
                raise AssertionError(f"{what}: not within {timeout:g} s; last: {answer!r}"[:4000])
            time.sleep(0.25)

    def alive(self) -> None:
        if self.process.poll() is not None:
            raise AssertionError(f"prometheus exited {self.process.returncode}:\n{self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def start(binary: Path, folder: Path, jobs: list[Json], rule_files: list[Path], port: int) -> Prometheus:
    """Prometheus with ``jobs`` and ``rule_files``, evaluating every second, its data in ``folder``."""
    config = folder / "prometheus.yml"
    config.write_text(
        yaml.safe_dump(
            {
                "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                "rule_files": [str(path) for path in rule_files],
                "scrape_configs": jobs,
            }
        )
    )
    log = folder / "prometheus.log"
    with log.open("wb") as output:
        process = subprocess.Popen(
            [
                str(binary),
                f"--config.file={config}",
                f"--storage.tsdb.path={folder / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--log.level=warn",
            ],
            stdout=output,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    server = Prometheus(process, port, log)
    server.wait("Prometheus ready", lambda: _ready(port), timeout=60)
    return server


def _ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/-/ready", timeout=2) as response:
            return bool(response.status == 200)
    except OSError:
        return False
