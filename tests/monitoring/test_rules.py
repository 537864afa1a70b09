"""The alert rules (charts/gpuscaler/files/rules.yaml) under promtool, against the series agent and gateway export."""

from __future__ import annotations

import re
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import trustme
import yaml
from prometheus_client.parser import text_string_to_metric_families

from gpuscaler.agent.collectors.fake import FakeCollector
from gpuscaler.agent.process import Agent
from gpuscaler.gateway.process import Gateway
from tests.conftest import serve_settings
from tests.gateway.conftest import gateway_settings
from tests.monitoring.promql import exposition, promtool_or_skip, series_in
from tests.waiting import until

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "charts" / "gpuscaler" / "files" / "rules.yaml"
TESTS = sorted(Path(__file__).parent.glob("*_test.yaml"))
TROUBLESHOOTING = ROOT / "docs" / "troubleshooting.md"
VALUES = ROOT / "charts" / "gpuscaler" / "values.yaml"


@pytest.fixture(scope="module")
def promtool() -> Path:
    """The pinned promtool, or a loud skip."""
    return promtool_or_skip("ALERT RULE TESTS")


def run(promtool: Path, *args: str, stdin: str | None = None, cwd: Path = ROOT) -> None:
    """Run promtool; a failure shows everything it said."""
    result = subprocess.run([str(promtool), *args], input=stdin, capture_output=True, text=True, cwd=cwd, check=False)
    assert result.returncode == 0, f"promtool {' '.join(args)} failed:\n{result.stdout}{result.stderr}"


def alerts() -> list[dict[str, Any]]:
    """Every alerting rule of the rules file."""
    groups = yaml.safe_load(RULES.read_text(encoding="utf-8"))["groups"]
    return [rule for group in groups for rule in group["rules"] if "alert" in rule]


def test_rules_pass_promtool_check(promtool: Path) -> None:
    """promtool accepts the rules file as Prometheus would load it."""
    run(promtool, "check", "rules", str(RULES))


@pytest.mark.parametrize("test_file", TESTS, ids=lambda path: path.name)
def test_rules_pass_their_promtool_unit_tests(promtool: Path, test_file: Path) -> None:
    """Each alert fires on its cases and stays quiet on the others, as tests/monitoring/*_test.yaml say."""
    run(promtool, "test", "rules", test_file.name, cwd=test_file.parent)


def test_every_alert_has_a_unit_test_that_fires_it() -> None:
    """Every alert is expected to fire somewhere in the promtool tests, and expected quiet somewhere too."""
    fired: set[str] = set()
    quiet: set[str] = set()
    for path in TESTS:
        for test in yaml.safe_load(path.read_text(encoding="utf-8"))["tests"]:
            for case in test.get("alert_rule_test", []):
                (fired if case.get("exp_alerts") else quiet).add(case["alertname"])
    names = {rule["alert"] for rule in alerts()}
    assert sorted(names - fired) == []
    assert sorted(names - quiet) == []


def test_every_alert_says_how_long_how_bad_what_and_where_to_look() -> None:
    """Each alert has a for, a severity, a summary, a description and a runbook in docs/troubleshooting.md."""
    default_base = yaml.safe_load(VALUES.read_text(encoding="utf-8"))["prometheusRule"]["runbookBaseURL"]
    headings = set(re.findall(r"^#{2,4} (Gpuscaler\w+)$", TROUBLESHOOTING.read_text(encoding="utf-8"), re.M))
    for rule in alerts():
        name = rule["alert"]
        assert re.fullmatch(r"\d+[smh]", str(rule.get("for", ""))), name
        assert rule["labels"]["severity"] in ("critical", "warning", "info"), name
        assert rule["annotations"]["summary"], name
        assert rule["annotations"]["description"], name
        assert rule["annotations"]["runbook_url"] == f"{default_base}#{name.lower()}", name
        assert name in headings, f"docs/troubleshooting.md has no runbook section '### {name}'"


def test_rules_never_read_the_job_label() -> None:
    """A rule that matched on `job` would depend on how whoever scrapes us names the job."""
    for rule in alerts():
        assert "job" not in re.findall(r"[a-z_]+", rule["expr"]), rule["alert"]


def test_series_in_reads_names_not_functions_or_labels() -> None:
    """The name finder the next test relies on keeps series names and drops everything else."""
    expr = 'sum without (call) (rate(a_total{code!="3"}[5m])) / ignoring (le) group_left b_bucket{le="0.25"} > 0.1'
    assert series_in(expr) == {"a_total", "b_bucket"}
    assert series_in("x - time() < 7 * 86400") == {"x"}


@pytest.fixture
async def expositions(tmp_path: Path) -> AsyncIterator[dict[str, str]]:
    """The /metrics pages of an agent and a gateway that hears it, both serving TLS: every family they export."""
    ca = trustme.CA()
    cert, key, ca_pem = tmp_path / "tls.crt", tmp_path / "tls.key", tmp_path / "ca.crt"
    issued = ca.issue_cert("127.0.0.1", "localhost")
    issued.private_key_pem.write_to_path(str(key))
    cert.write_bytes(b"".join(blob.bytes() for blob in issued.cert_chain_pems))
    ca.cert_pem.write_to_path(str(ca_pem))
    tls = ("--tls-cert", str(cert), "--tls-key", str(key))
    agent = await Agent.start(serve_settings("--fake-gpus", "2", *tls), FakeCollector(node="gpu-a", gpu_count=2))
    gateway = None
    try:
        gateway = await Gateway.start(
            gateway_settings("--agents", f"127.0.0.1:{agent.port}", "--agent-tls-ca", str(ca_pem), *tls),
            directory=None,
        )
        view = gateway.view
        await until(lambda: view.latest is not None and len(view.latest.nodes) == 1, timeout=10)
        assert agent.frontend.metrics is not None
        assert gateway.frontend.metrics is not None
        yield {
            "agent": await exposition(agent.frontend.metrics.port),
            "gateway": await exposition(gateway.frontend.metrics.port),
        }
    finally:
        if gateway is not None:
            await gateway.stop()
        await agent.stop()


async def test_agent_and_gateway_metrics_pass_promtool_check_metrics(
    promtool: Path, expositions: dict[str, str]
) -> None:
    """promtool's linter finds nothing to say about either /metrics page (names, units, types, help)."""
    for page in expositions.values():
        run(promtool, "check", "metrics", stdin=page)


async def test_every_series_a_rule_reads_is_exported(expositions: dict[str, str]) -> None:
    """No rule waits on a series that agent and gateway never export (a typo would never fire)."""
    exported: set[str] = set()
    for page in expositions.values():
        for family in text_string_to_metric_families(page):
            suffixes = {
                "counter": ("_total",),
                "histogram": ("_bucket", "_count", "_sum"),
            }.get(family.type, ("",))
            exported.update(family.name + suffix for suffix in suffixes)
    assert "gpuscaler_tls_certificate_expiry_timestamp_seconds" in exported
    for rule in alerts():
        assert series_in(rule["expr"]) <= exported, (rule["alert"], sorted(series_in(rule["expr"]) - exported))
