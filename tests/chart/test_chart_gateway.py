"""The gateway as the chart renders it: KEDA's way in, its settings, its RBAC, its disruption budget."""

from __future__ import annotations

from typing import Any

import pytest

from gpuscaler.cli import build_parser
from gpuscaler.flags import ENV_PREFIX, Address
from gpuscaler.gateway.settings import GATEWAY_FLAGS, gateway_settings_from_args
from tests.chart.rendering import (
    CI_VALUES,
    NAMESPACE,
    RELEASE,
    Helm,
    Manifest,
    connection_limit_defaults,
    connection_limit_settings,
    env_field_refs,
    env_values,
    find,
    of_kind,
    restricted_violations,
    selects,
)

CI = {path.name.removesuffix("-values.yaml"): path for path in CI_VALUES}
GATEWAY = f"{RELEASE}-gateway"


def deployment(helm: Helm, scenario: str = "defaults", sets: tuple[str, ...] = ()) -> Manifest:
    """The gateway Deployment that CI's ``scenario`` values render, with ``sets`` as ``--set`` overrides."""
    return find(helm.template(CI[scenario], sets=sets), "Deployment", GATEWAY)


def container(manifest: Manifest) -> dict[str, Any]:
    """The gateway Deployment's only container, which must be named gateway."""
    (only,) = manifest["spec"]["template"]["spec"]["containers"]
    assert only["name"] == "gateway"
    result: dict[str, Any] = only
    return result


def test_two_replicas_spread_over_nodes_and_restricted(helm: Helm) -> None:
    """A Deployment of 2, preferring different nodes, that Pod Security "restricted" admits."""
    gateway = deployment(helm)
    spec = gateway["spec"]["template"]["spec"]
    assert gateway["spec"]["replicas"] == 2
    assert restricted_violations(spec) == []
    term = spec["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0]["podAffinityTerm"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert selects(term["labelSelector"]["matchLabels"], gateway["spec"]["template"]["metadata"]["labels"])
    assert container(gateway)["args"] == ["gateway"]


@pytest.mark.parametrize("scenario", sorted(CI))
def test_the_gateway_accepts_the_rendered_settings(helm: Helm, scenario: str) -> None:
    """`gpuscaler gateway`'s own check passes for the chart's environment, and it finds the agents' headless Service."""
    for gateway in of_kind(helm.template(CI[scenario]), "Deployment"):
        environ = env_values(container(gateway))
        settings = gateway_settings_from_args(build_parser(environ).parse_args(container(gateway)["args"]), environ)
        agent_port = 7000 if scenario == "tls" else 6000
        assert settings.agents_dns == Address(f"{RELEASE}-agents.{NAMESPACE}.svc", agent_port)
        assert settings.pod_directory == "kubernetes"


def test_defaults_are_the_documented_ones(helm: Helm) -> None:
    """The gateway's default settings as environment variables."""
    assert env_values(container(deployment(helm))) == {
        "GPUSCALER_LISTEN": "0.0.0.0:6000",
        "GPUSCALER_AGENTS_DNS": f"{RELEASE}-agents.{NAMESPACE}.svc:6000",
        "GPUSCALER_RESOLVE_INTERVAL": "5",
        "GPUSCALER_HISTORY": "2m",
        "GPUSCALER_POD_DIRECTORY": "kubernetes",
        "GPUSCALER_ENGINE_SCRAPE_TIMEOUT": "2",
        "GPUSCALER_ENGINE_MAX_PAGE_BYTES": "4194304",
        "GPUSCALER_ENGINE_SCRAPE_CONCURRENCY": "32",
        "GPUSCALER_ENGINE_MIN_SCRAPE_INTERVAL": "1s",
        "GPUSCALER_ENGINE_MAX_PODS_PER_SELECTION": "500",
        "GPUSCALER_ENGINE_MAX_LABEL_SETS": "8192",
        "GPUSCALER_LOG_FORMAT": "json",
        "GPUSCALER_LOG_LEVEL": "info",
        "GPUSCALER_DRAIN_TIMEOUT": "5",
        "GPUSCALER_METRICS_LISTEN": "0.0.0.0:9402",
        **connection_limit_defaults(),
    }


SETTABLE = [
    ("gateway.listen.port=7100", "GPUSCALER_LISTEN", "0.0.0.0:7100"),
    ("gateway.resolveInterval=30", "GPUSCALER_RESOLVE_INTERVAL", "30"),
    ("gateway.history=10m", "GPUSCALER_HISTORY", "10m"),
    ("gateway.podDirectory=", "GPUSCALER_POD_DIRECTORY", ""),
    ("gateway.engineScrapes.timeout=5", "GPUSCALER_ENGINE_SCRAPE_TIMEOUT", "5"),
    ("gateway.engineScrapes.maxPageBytes=1048576", "GPUSCALER_ENGINE_MAX_PAGE_BYTES", "1048576"),
    ("gateway.engineScrapes.concurrency=8", "GPUSCALER_ENGINE_SCRAPE_CONCURRENCY", "8"),
    ("gateway.engineScrapes.minScrapeInterval=250ms", "GPUSCALER_ENGINE_MIN_SCRAPE_INTERVAL", "250ms"),
    ("gateway.engineScrapes.maxPodsPerSelection=2000", "GPUSCALER_ENGINE_MAX_PODS_PER_SELECTION", "2000"),
    ("gateway.engineScrapes.maxLabelSets=20000", "GPUSCALER_ENGINE_MAX_LABEL_SETS", "20000"),
    (
        "gateway.epp.metricsToken.enabled=true,gateway.epp.metricsToken.namespaces={ml}",
        "GPUSCALER_EPP_METRICS_TOKEN_SERVICE_ACCOUNT",
        f"{NAMESPACE}/{GATEWAY}-epp-metrics",
    ),
    (
        "gateway.epp.metricsToken.enabled=true,gateway.epp.metricsToken.namespaces={ml,serving}",
        "GPUSCALER_EPP_NAMESPACES",
        "ml,serving",
    ),
    ("gateway.log.format=console", "GPUSCALER_LOG_FORMAT", "console"),
    ("gateway.log.level=debug", "GPUSCALER_LOG_LEVEL", "debug"),
    ("gateway.drainTimeout=2", "GPUSCALER_DRAIN_TIMEOUT", "2"),
    *connection_limit_settings("gateway"),
    ("gateway.metrics.port=9500", "GPUSCALER_METRICS_LISTEN", "0.0.0.0:9500"),
    ("gateway.metrics.enabled=false", "GPUSCALER_METRICS_LISTEN", ""),
    ("gateway.tls.secretName=g", "GPUSCALER_TLS_CERT", "/etc/gpuscaler/tls/tls.crt"),
    ("gateway.tls.secretName=g", "GPUSCALER_TLS_KEY", "/etc/gpuscaler/tls/tls.key"),
    ("gateway.tls.secretName=g,gateway.tls.reloadInterval=30", "GPUSCALER_TLS_RELOAD_INTERVAL", "30"),
    (
        "gateway.tls.secretName=g,gateway.tls.requireClientCert=true",
        "GPUSCALER_TLS_CLIENT_CA",
        "/etc/gpuscaler/tls/ca.crt",
    ),
    ("agent.tls.secretName=a", "GPUSCALER_AGENT_TLS_CA", "/etc/gpuscaler/agent-tls/ca.crt"),
    ("agent.tls.secretName=a", "GPUSCALER_AGENT_TLS_SERVER_NAME", f"{RELEASE}-agents.{NAMESPACE}.svc"),
    ("agent.tls.secretName=a,gateway.agentServerName=x.example", "GPUSCALER_AGENT_TLS_SERVER_NAME", "x.example"),
    (
        "agent.tls.secretName=a,agent.tls.requireClientCert=true",
        "GPUSCALER_AGENT_TLS_CERT",
        "/etc/gpuscaler/agent-tls/tls.crt",
    ),
    (
        "agent.tls.secretName=a,agent.tls.requireClientCert=true",
        "GPUSCALER_AGENT_TLS_KEY",
        "/etc/gpuscaler/agent-tls/tls.key",
    ),
]
NOT_FROM_THE_CHART = {
    ENV_PREFIX + "AGENTS": "the chart always discovers agents through the headless Service",
    ENV_PREFIX + "AGENTS_FILE": "the same: a file of agents is for gateways outside Kubernetes (compose, tests)",
}


@pytest.mark.parametrize(("assignment", "variable", "expected"), SETTABLE)
def test_each_gateway_setting_is_settable_from_values(
    helm: Helm, assignment: str, variable: str, expected: str
) -> None:
    """Each `gpuscaler gateway` flag the chart owns has a value that sets its GPUSCALER_* variable."""
    assert env_values(container(deployment(helm, sets=(assignment,))))[variable] == expected


def test_the_chart_covers_every_flag_the_gateway_has() -> None:
    """Every flag in GATEWAY_FLAGS is settable from values, or named here with why the chart leaves it alone."""
    settable = {variable for _, variable, _ in SETTABLE} | {ENV_PREFIX + "AGENTS_DNS"} | set(NOT_FROM_THE_CHART)
    assert {ENV_PREFIX + env for env, _, _ in GATEWAY_FLAGS.values()} <= settable


def test_agent_tls_mounts_the_agents_secret_read_only(helm: Helm) -> None:
    """With agent TLS on, the gateway mounts that Secret read-only to verify (and, with mTLS, present to) agents."""
    gateway = deployment(helm, "tls")
    volume = next(v for v in gateway["spec"]["template"]["spec"]["volumes"] if v["name"] == "agent-tls")
    assert volume["secret"] == {"secretName": "gpuscaler-tls", "defaultMode": 0o440}
    mount = {"name": "agent-tls", "mountPath": "/etc/gpuscaler/agent-tls", "readOnly": True}
    assert mount in container(gateway)["volumeMounts"]


def test_rbac_is_get_list_watch_on_pods_and_scaledobjects_only(helm: Helm) -> None:
    """The ClusterRole allows get/list/watch on pods and KEDA's ScaledObjects, nothing else, for the gateway."""
    manifests = helm.template(CI["defaults"])
    role = find(manifests, "ClusterRole", GATEWAY)
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
        {"apiGroups": ["keda.sh"], "resources": ["scaledobjects"], "verbs": ["get", "list", "watch"]},
    ]
    binding = find(manifests, "ClusterRoleBinding", GATEWAY)
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": GATEWAY}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": GATEWAY, "namespace": NAMESPACE}]
    gateway = find(manifests, "Deployment", GATEWAY)["spec"]["template"]["spec"]
    assert gateway["serviceAccountName"] == GATEWAY
    assert gateway["automountServiceAccountToken"] is True


def test_without_a_pod_watch_there_is_no_rbac_and_no_token(helm: Helm) -> None:
    """podDirectory "" renders no ClusterRole and mounts no API token."""
    manifests = helm.template(CI["defaults"], sets=("gateway.podDirectory=",))
    assert not of_kind(manifests, "ClusterRole")
    assert not of_kind(manifests, "ClusterRoleBinding")
    assert find(manifests, "ServiceAccount", GATEWAY)["automountServiceAccountToken"] is False
    assert find(manifests, "Deployment", GATEWAY)["spec"]["template"]["spec"]["automountServiceAccountToken"] is False


EPP_METRICS = f"{GATEWAY}-epp-metrics"
EPP_TOKEN_ON = ("gateway.epp.metricsToken.enabled=true", "gateway.epp.metricsToken.namespaces={ml,serving}")


def test_the_epp_token_is_off_by_default_and_renders_none_of_its_rbac(helm: Helm) -> None:
    """Off: no ServiceAccount for the EPP, no Role, no rule on InferencePools, Services or /metrics, no flag."""
    manifests = helm.template(CI["defaults"])
    assert [m for m in manifests if m["metadata"]["name"] == EPP_METRICS] == []
    assert not of_kind(manifests, "Role")
    assert not of_kind(manifests, "RoleBinding")
    rules = [rule for role in of_kind(manifests, "ClusterRole") for rule in role["rules"]]
    assert not [r for r in rules if "nonResourceURLs" in r or {"inferencepools", "services"} & set(r["resources"])]
    env = container(deployment(helm))["env"]
    assert not [e for e in env if e["name"].startswith(("GPUSCALER_EPP_", "POD_"))]


def test_the_epp_token_on_renders_exactly_its_rules(helm: Helm) -> None:
    """On: a ServiceAccount that may only get /metrics; the gateway may list/watch InferencePools and Services in
    each of the trusted namespaces alone (a Role in each, none cluster-wide) and create that one account's tokens in
    its namespace; it is given the flags and its own pod's identity."""
    manifests = helm.template(CI["defaults"], sets=EPP_TOKEN_ON)
    account = find(manifests, "ServiceAccount", EPP_METRICS)
    assert account["metadata"]["namespace"] == NAMESPACE
    assert account["automountServiceAccountToken"] is False
    assert find(manifests, "ClusterRole", EPP_METRICS)["rules"] == [{"nonResourceURLs": ["/metrics"], "verbs": ["get"]}]
    metrics_binding = find(manifests, "ClusterRoleBinding", EPP_METRICS)
    assert metrics_binding["roleRef"]["name"] == EPP_METRICS
    assert metrics_binding["subjects"] == [{"kind": "ServiceAccount", "name": EPP_METRICS, "namespace": NAMESPACE}]
    assert find(manifests, "ClusterRole", GATEWAY)["rules"] == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
        {"apiGroups": ["keda.sh"], "resources": ["scaledobjects"], "verbs": ["get", "list", "watch"]},
    ]
    pickers = {
        r["metadata"]["namespace"]: r for r in of_kind(manifests, "Role") if r["metadata"]["name"] != EPP_METRICS
    }
    assert sorted(pickers) == ["ml", "serving"]
    for namespace, picker_role in pickers.items():
        assert picker_role["rules"] == [
            {"apiGroups": ["inference.networking.k8s.io"], "resources": ["inferencepools"], "verbs": ["list", "watch"]},
            {"apiGroups": [""], "resources": ["services"], "verbs": ["list", "watch"]},
        ]
        (bound,) = [
            b
            for b in of_kind(manifests, "RoleBinding")
            if b["metadata"]["namespace"] == namespace and b["roleRef"]["name"] == picker_role["metadata"]["name"]
        ]
        assert bound["subjects"] == [{"kind": "ServiceAccount", "name": GATEWAY, "namespace": NAMESPACE}]
    (role,) = [r for r in of_kind(manifests, "Role") if r["metadata"]["name"] == EPP_METRICS]
    assert role["metadata"]["namespace"] == NAMESPACE
    assert role["rules"] == [
        {
            "apiGroups": [""],
            "resources": ["serviceaccounts/token"],
            "resourceNames": [EPP_METRICS],
            "verbs": ["create"],
        }
    ]
    (binding,) = [b for b in of_kind(manifests, "RoleBinding") if b["metadata"]["name"] == EPP_METRICS]
    assert binding["metadata"]["namespace"] == NAMESPACE
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": EPP_METRICS}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": GATEWAY, "namespace": NAMESPACE}]
    gateway = container(find(manifests, "Deployment", GATEWAY))
    assert env_values(gateway)["GPUSCALER_EPP_METRICS_TOKEN_SERVICE_ACCOUNT"] == f"{NAMESPACE}/{EPP_METRICS}"
    assert env_values(gateway)["GPUSCALER_EPP_NAMESPACES"] == "ml,serving"
    refs = env_field_refs(gateway)
    assert {key: refs[key] for key in ("POD_NAMESPACE", "POD_NAME", "POD_UID")} == {
        "POD_NAMESPACE": "metadata.namespace",
        "POD_NAME": "metadata.name",
        "POD_UID": "metadata.uid",
    }
    environ = env_values(gateway)
    settings = gateway_settings_from_args(build_parser(environ).parse_args(["gateway"]), environ)
    assert settings.epp_namespaces == ("ml", "serving")


def test_the_epp_token_without_namespaces_or_the_pod_watch_fails_the_render(helm: Helm) -> None:
    """On without a namespace to trust, or without the pod watch, the render fails saying what is missing; a
    namespace that is not a namespace's name is refused by the schema."""
    error = helm.template_error(CI["defaults"], sets=("gateway.epp.metricsToken.enabled=true",))
    assert "gateway.epp.metricsToken.enabled needs gateway.epp.metricsToken.namespaces" in error
    error = helm.template_error(CI["defaults"], sets=(*EPP_TOKEN_ON, "gateway.podDirectory="))
    assert 'gateway.epp.metricsToken.enabled needs gateway.podDirectory "kubernetes"' in error
    bad = (EPP_TOKEN_ON[0], "gateway.epp.metricsToken.namespaces={Bad_NS}")
    error = helm.template_error(CI["defaults"], sets=bad)
    assert "'/gateway/epp/metricsToken/namespaces/0': 'Bad_NS' does not match pattern" in error


def test_the_pdb_keeps_one_gateway(helm: Helm) -> None:
    """The PodDisruptionBudget keeps minAvailable 1 of the gateway's pods; it can be turned off."""
    manifests = helm.template(CI["defaults"])
    pdb = find(manifests, "PodDisruptionBudget", GATEWAY)
    assert pdb["spec"]["minAvailable"] == 1
    labels = find(manifests, "Deployment", GATEWAY)["spec"]["template"]["metadata"]["labels"]
    assert selects(pdb["spec"]["selector"]["matchLabels"], labels)
    assert not of_kind(
        helm.template(CI["defaults"], sets=("gateway.podDisruptionBudget.enabled=false",)), "PodDisruptionBudget"
    )


def test_probes_ready_on_the_scaler_live_on_tcp(helm: Helm) -> None:
    """Readiness asks gRPC health of the ExternalScaler (/healthz with TLS); liveness is a TCP check only."""
    probes = container(deployment(helm))
    assert probes["readinessProbe"]["grpc"] == {"port": 6000, "service": "externalscaler.ExternalScaler"}
    assert probes["livenessProbe"]["tcpSocket"] == {"port": "grpc"}
    with_tls = container(deployment(helm, sets=("gateway.tls.secretName=g",)))
    assert with_tls["readinessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}


def test_the_headless_service_publishes_not_ready_agents(helm: Helm) -> None:
    """A sick agent keeps its DNS record, so the gateway still counts it as a known node (minNodes)."""
    headless = find(helm.template(CI["defaults"]), "Service", f"{RELEASE}-agents")
    assert headless["spec"]["publishNotReadyAddresses"] is True


def test_networkpolicy_admits_keda_to_the_gateway(helm: Helm) -> None:
    """With the policy on, the gateway's pods admit KEDA's namespace on its port, and metricsFrom on /metrics."""
    manifests = helm.template(CI["networkpolicy"])
    policy = find(manifests, "NetworkPolicy", GATEWAY)["spec"]
    labels = find(manifests, "Deployment", GATEWAY)["spec"]["template"]["metadata"]["labels"]
    assert selects(policy["podSelector"]["matchLabels"], labels)
    rule, metrics = policy["ingress"]
    assert rule["ports"] == [{"protocol": "TCP", "port": 6000}]
    assert rule["from"][0]["namespaceSelector"] == {"matchLabels": {"kubernetes.io/metadata.name": "keda-system"}}
    assert metrics["ports"] == [{"protocol": "TCP", "port": 9402}]  # networkPolicy.metricsFrom may scrape it


def test_the_gateways_egress_is_left_alone_unless_asked_for(helm: Helm) -> None:
    """Off by default: a policy with an Egress type would deny the gateway's DNS, API and agent traffic."""
    policy = find(helm.template(CI["defaults"], sets=("networkPolicy.enabled=true",)), "NetworkPolicy", GATEWAY)["spec"]
    assert policy["policyTypes"] == ["Ingress"]
    assert "egress" not in policy


def test_gateway_egress_reaches_dns_the_api_the_agents_and_the_engines_metrics_ports(helm: Helm) -> None:
    """With gatewayEgress on, the gateway may reach DNS, the API server, the agents' port and the engine ports."""
    manifests = helm.template(CI["networkpolicy"], sets=("agent.listen.port=7100",))
    policy = find(manifests, "NetworkPolicy", GATEWAY)["spec"]
    assert policy["policyTypes"] == ["Ingress", "Egress"]
    dns, api, agents, engines = policy["egress"]
    assert {(p["protocol"], p["port"]) for p in dns["ports"]} == {("UDP", 53), ("TCP", 53)}
    assert [p["port"] for p in api["ports"]] == [443, 6443]
    agent_labels = of_kind(manifests, "DaemonSet")[0]["spec"]["template"]["metadata"]["labels"]
    assert selects(agents["to"][0]["podSelector"]["matchLabels"], agent_labels)
    assert agents["ports"] == [{"protocol": "TCP", "port": 7100}]
    assert engines["to"] == [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "llm"}}}]
    assert [p["port"] for p in engines["ports"]] == [8000, 8002, 30000, 80, 9090]


def test_the_grace_period_must_outlast_the_drain(helm: Helm) -> None:
    """A gateway drain as long as its grace period is refused at render time, naming both."""
    error = helm.template_error(CI["defaults"], sets=("gateway.drainTimeout=20",))
    assert "gateway.terminationGracePeriodSeconds" in error


def test_what_the_agents_need_on_a_node_never_reaches_the_gateway(helm: Helm) -> None:
    """Root for the kubelet's socket and host mounts' privileged widen the agents only; the gateway stays restricted."""
    manifests = helm.template(
        CI["host-mounts"], sets=("agent.podSecurityContext.runAsUser=0", "agent.podSecurityContext.runAsNonRoot=false")
    )
    agent_spec = of_kind(manifests, "DaemonSet")[0]["spec"]["template"]["spec"]
    assert agent_spec["securityContext"]["runAsUser"] == 0
    gateway_spec = find(manifests, "Deployment", GATEWAY)["spec"]["template"]["spec"]
    assert restricted_violations(gateway_spec) == []
    assert gateway_spec["securityContext"]["runAsUser"] == 65532
    assert "privileged" not in container(find(manifests, "Deployment", GATEWAY))["securityContext"]


def test_probe_timings_are_set_per_component(helm: Helm) -> None:
    """gateway.probes times the gateway's probes and agent.probes the agents'; neither moves the other."""
    gateway_probe = container(deployment(helm, sets=("gateway.probes.readiness.periodSeconds=7",)))["readinessProbe"]
    assert gateway_probe["periodSeconds"] == 7
    manifests = helm.template(CI["defaults"], sets=("agent.probes.readiness.periodSeconds=30",))
    agent_probe = find(manifests, "DaemonSet")["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]
    assert agent_probe["periodSeconds"] == 30
    assert container(find(manifests, "Deployment", GATEWAY))["readinessProbe"]["periodSeconds"] == 5


def test_the_gateway_serves_metrics_and_probes_health_there_under_tls(helm: Helm) -> None:
    """The gateway's metrics port is on the pod and on KEDA's Service; with TLS, readiness GETs /healthz there."""
    gateway = container(deployment(helm, sets=("gateway.tls.secretName=g",)))
    assert {"name": "metrics", "containerPort": 9402, "protocol": "TCP"} in gateway["ports"]
    assert gateway["readinessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    service = find(helm.template(CI["defaults"]), "Service", RELEASE)
    assert {"name": "metrics", "port": 9402, "targetPort": "metrics", "protocol": "TCP"} in service["spec"]["ports"]
    off = container(deployment(helm, sets=("gateway.metrics.enabled=false", "gateway.tls.secretName=g")))
    assert [port["name"] for port in off["ports"]] == ["grpc"]
    assert off["readinessProbe"]["tcpSocket"] == {"port": "grpc"}
