"""What `helm template` renders for each scenario: the things a cluster operator and a security review look at."""

from __future__ import annotations

import re
import tomllib
from argparse import Namespace

import pytest
import yaml
from grpclib.client import Channel
from grpclib.const import Status
from grpclib.exceptions import GRPCError
from grpclib.health.v1.health_grpc import HealthStub
from grpclib.health.v1.health_pb2 import HealthCheckRequest, HealthCheckResponse

from gpuscaler.agent.collectors.scenario import parse_scenario
from gpuscaler.agent.settings import SERVE_FLAGS, env_name, settings_from_args
from gpuscaler.cli import build_parser
from tests.chart.rendering import (
    CHART,
    CI_VALUES,
    NAMESPACE,
    RELEASE,
    Helm,
    Manifest,
    agent_container,
    connection_limit_defaults,
    connection_limit_settings,
    env_field_refs,
    env_values,
    find,
    kinds,
    of_kind,
    pod_spec,
    restricted_violations,
    selects,
)

CI = {path.name.removesuffix("-values.yaml"): path for path in CI_VALUES}
FULLNAME = RELEASE  # the release name contains the chart name, so it is the prefix as it is
# Announced by the CLI contract and set by the chart ahead of the agent reading them.
ANNOUNCED_SETTINGS = {"GPUSCALER_METRICS_LISTEN", "GPUSCALER_POD_RESOURCES_SOCKET", "GPUSCALER_PROCESSES"}


def daemonset(helm: Helm, scenario: str = "defaults", sets: tuple[str, ...] = ()) -> Manifest:
    """The agent DaemonSet that CI's ``scenario`` values render, with ``sets`` as ``--set`` overrides."""
    return find(helm.template(CI[scenario], sets=sets), "DaemonSet")


def test_every_scenario_lints_clean(helm: Helm) -> None:
    """`helm lint --strict` reports no warning or error for any ci/*-values.yaml."""
    for values in CI_VALUES:
        result = helm.run("lint", "--strict", str(CHART), "--values", str(values))
        assert result.returncode == 0, result.stdout + result.stderr
        assert "[WARNING]" not in result.stdout, result.stdout
        assert "[ERROR]" not in result.stdout, result.stdout


def test_defaults_render_the_agent_its_services_and_nothing_optional(helm: Helm) -> None:
    """By default: the agents' DaemonSet, the gateway (with its RBAC and PDB), both Services, two ServiceAccounts."""
    manifests = helm.template(CI["defaults"])
    assert kinds(manifests) == [
        "ClusterRole",
        "ClusterRoleBinding",
        "DaemonSet",
        "Deployment",
        "PodDisruptionBudget",
        "Service",
        "Service",
        "ServiceAccount",
        "ServiceAccount",
    ]
    assert {m["metadata"].get("namespace", NAMESPACE) for m in manifests} == {NAMESPACE}
    assert find(manifests, "ServiceAccount", FULLNAME)["automountServiceAccountToken"] is False
    without = helm.template(CI["gateway-off"])
    assert kinds(without) == ["DaemonSet", "Service", "Service", "ServiceAccount"]


def test_agents_run_on_gpu_nodes_only_and_tolerate_the_gpu_taint(helm: Helm) -> None:
    """The DaemonSet requires one of the GPU node labels (not GPU feature discovery's alone) and tolerates
    nvidia.com/gpu:NoSchedule."""
    spec = pod_spec(daemonset(helm))
    assert "nodeSelector" not in spec
    (terms,) = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"].values()
    keys = [expression["key"] for term in terms for expression in term["matchExpressions"]]
    assert "nvidia.com/gpu.present" in keys
    assert "feature.node.kubernetes.io/pci-10de.present" in keys
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    assert spec["runtimeClassName"] == "nvidia"
    assert spec["priorityClassName"] == "system-node-critical"


def test_upgrades_roll_one_node_at_a_time(helm: Helm) -> None:
    """RollingUpdate with maxUnavailable 1 by default; a percentage passes through."""
    assert daemonset(helm)["spec"]["updateStrategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxUnavailable": 1},
    }
    tls = daemonset(helm, "tls")["spec"]["updateStrategy"]
    assert tls["rollingUpdate"] == {"maxUnavailable": "10%"}


# What Pod Security "restricted" refuses in the default agent, each for the kubelet's pod-resources socket
# (docs/install.md#the-agents-privileges): a hostPath of its folder, and uid 0, the only user that can connect to it.
POD_RESOURCES_VIOLATIONS = [
    "volume pod-resources: ['hostPath']",
    "agent: runAsNonRoot is not true",
    "agent: runAsUser 0",
]


def kubelet_refusals(spec: Manifest) -> list[str]:
    """Why the kubelet would refuse to start a container of the pod: runAsNonRoot true with uid 0."""
    pod_context = spec.get("securityContext", {})
    refused = []
    for container in spec["containers"]:
        context = pod_context | container.get("securityContext", {})
        if context.get("runAsNonRoot") is True and context.get("runAsUser") == 0:
            refused.append(f"{container['name']}: runAsNonRoot with runAsUser 0")
    return refused


def test_defaults_read_the_kubelet_as_uid_0_with_no_privilege(helm: Helm) -> None:
    """By default the agent mounts the pod-resources folder read-only and runs as uid 0, and has nothing else: no
    capabilities, no escalation, a read-only root, RuntimeDefault seccomp; runAsNonRoot is false, not a refusal."""
    ds = daemonset(helm)
    spec = pod_spec(ds)
    assert restricted_violations(spec) == POD_RESOURCES_VIOLATIONS
    assert kubelet_refusals(spec) == []
    assert spec["securityContext"] == {
        "runAsUser": 0,
        "runAsGroup": 0,
        "runAsNonRoot": False,
        "fsGroup": 65532,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    context = agent_container(ds)["securityContext"]
    assert context == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }
    assert "privileged" not in context
    assert {"name": "pod-resources", "hostPath": {"path": "/var/lib/kubelet/pod-resources", "type": "Directory"}} in (
        spec["volumes"]
    )
    mount = next(m for m in agent_container(ds)["volumeMounts"] if m["name"] == "pod-resources")
    assert mount == {"name": "pod-resources", "mountPath": "/var/lib/kubelet/pod-resources", "readOnly": True}
    assert env_values(agent_container(ds))["GPUSCALER_POD_RESOURCES_SOCKET"] == mount["mountPath"] + "/kubelet.sock"
    assert spec["automountServiceAccountToken"] is False
    assert spec["enableServiceLinks"] is False, "service links would inject GPUSCALER_* look-alike variables"


def test_without_pod_resources_the_agent_is_non_root_and_restricted(helm: Helm) -> None:
    """agent.podResources.enabled=false is the one switch to an agent Pod Security "restricted" admits: uid 65532,
    runAsNonRoot, no hostPath, and attribution off."""
    ds = daemonset(helm, "restricted")
    spec = pod_spec(ds)
    assert restricted_violations(spec) == []
    assert restricted_violations(pod_spec(find(helm.template(CI["restricted"]), "Deployment"))) == []
    assert (spec["securityContext"]["runAsUser"], spec["securityContext"]["runAsNonRoot"]) == (65532, True)
    assert spec["securityContext"]["runAsGroup"] == 65532
    assert env_values(agent_container(ds))["GPUSCALER_POD_RESOURCES_SOCKET"] == ""
    assert [v["name"] for v in spec["volumes"]] == ["tmp"]


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (
            ("agent.podSecurityContext.runAsNonRoot=true",),
            "agent.podSecurityContext.runAsNonRoot is true but the agent runs as uid 0 (derived from "
            "agent.podResources.enabled=true): the kubelet refuses to start such a pod",
        ),
        (
            ("agent.securityContext.runAsNonRoot=true",),
            "agent.securityContext.runAsNonRoot is true but the agent runs as uid 0",
        ),
        (
            (
                "agent.podResources.enabled=false",
                "agent.podSecurityContext.runAsUser=0",
                "agent.podSecurityContext.runAsNonRoot=true",
            ),
            "agent.podSecurityContext.runAsNonRoot is true but the agent runs as uid 0 "
            "(agent.podSecurityContext.runAsUser)",
        ),
        (
            (
                "agent.podResources.enabled=false",
                "agent.securityContext.runAsUser=0",
                "agent.podSecurityContext.runAsNonRoot=true",
            ),
            "agent.podSecurityContext.runAsNonRoot is true but the agent runs as uid 0 "
            "(agent.securityContext.runAsUser)",
        ),
    ],
)
def test_run_as_non_root_beside_uid_0_is_refused(helm: Helm, sets: tuple[str, ...], message: str) -> None:
    """A pod the kubelet would refuse to start (runAsNonRoot true, uid 0) fails the render, naming the keys."""
    assert message in helm.template_error(CI["defaults"], sets=sets)


@pytest.mark.parametrize(
    ("sets", "user", "non_root"),
    [
        ((), 0, False),
        (("agent.podResources.enabled=false",), 65532, True),
        (("agent.podSecurityContext.runAsUser=1000",), 1000, True),
        (("agent.securityContext.runAsUser=1000",), 1000, True),
        (("agent.podResources.enabled=false", "agent.securityContext.runAsUser=0"), 0, False),
        (("agent.podSecurityContext.runAsNonRoot=false",), 0, False),
    ],
)
def test_run_as_non_root_follows_the_user_the_container_gets(
    helm: Helm, sets: tuple[str, ...], user: int, non_root: bool
) -> None:
    """runAsNonRoot, when not set, is derived from the user the agent container ends up with, wherever it is set."""
    spec = pod_spec(daemonset(helm, sets=sets))
    context = spec["securityContext"] | agent_container(daemonset(helm, sets=sets)).get("securityContext", {})
    assert (context["runAsUser"], context["runAsNonRoot"]) == (user, non_root)
    assert kubelet_refusals(spec) == []


@pytest.mark.parametrize("scenario", sorted(CI))
def test_no_scenario_renders_a_pod_the_kubelet_refuses(helm: Helm, scenario: str) -> None:
    """In every ci/ scenario, no agent or gateway pod has runAsNonRoot true beside uid 0."""
    for manifest in helm.template(CI[scenario]):
        if manifest["kind"] in ("DaemonSet", "Deployment"):
            assert kubelet_refusals(pod_spec(manifest)) == [], (scenario, manifest["metadata"]["name"])


def test_the_refusal_check_notices_a_refused_pod() -> None:
    """kubelet_refusals finds runAsNonRoot true beside uid 0 at either level, so the test above can fail."""
    spec: Manifest = {
        "securityContext": {"runAsNonRoot": True},
        "containers": [{"name": "a", "securityContext": {"runAsUser": 0}}],
    }
    assert kubelet_refusals(spec) == ["a: runAsNonRoot with runAsUser 0"]
    spec["securityContext"] = {"runAsNonRoot": True, "runAsUser": 0}
    spec["containers"] = [{"name": "a"}]
    assert kubelet_refusals(spec) == ["a: runAsNonRoot with runAsUser 0"]


@pytest.mark.parametrize("scenario", ["fake", "no-runtime-class", "tls", "servicemonitor", "networkpolicy"])
def test_other_scenarios_widen_the_agent_only_for_the_kubelet(helm: Helm, scenario: str) -> None:
    """Outside agent.nvmlHostMounts and agent.processes, the agent leaves Pod Security "restricted" only for the
    kubelet's socket (its hostPath and uid 0)."""
    assert restricted_violations(pod_spec(daemonset(helm, scenario))) == POD_RESOURCES_VIOLATIONS


def test_processes_add_the_host_pid_namespace_and_nothing_else(helm: Helm) -> None:
    """agent.processes.enabled sets hostPID and --processes; the agent keeps the default's user (uid 0, for the
    kubelet), no capabilities and a read-only root, and gets no host /proc."""
    ds = daemonset(helm, "processes")
    spec = pod_spec(ds)
    assert spec["hostPID"] is True
    assert restricted_violations(spec) == ["hostPID", *POD_RESOURCES_VIOLATIONS]
    container = agent_container(ds)
    assert env_values(container)["GPUSCALER_PROCESSES"] == "true"
    context = container["securityContext"]
    assert context == agent_container(daemonset(helm))["securityContext"]
    assert context["capabilities"] == {"drop": ["ALL"]}
    assert spec["securityContext"] == pod_spec(daemonset(helm))["securityContext"]
    assert [v["name"] for v in spec["volumes"]] == ["tmp", "pod-resources"]  # no host /proc


def test_processes_are_off_by_default_without_host_pid(helm: Helm) -> None:
    """By default there is no hostPID, and the agent is told not to read processes."""
    ds = daemonset(helm)
    assert "hostPID" not in pod_spec(ds)
    assert env_values(agent_container(ds))["GPUSCALER_PROCESSES"] == "false"


def test_host_mounts_grant_privileged_only_in_that_mode(helm: Helm) -> None:
    """With agent.nvmlHostMounts the container is privileged (so escalation is unset) and still non-root."""
    manifests = helm.template(CI["host-mounts"])
    for ds in of_kind(manifests, "DaemonSet"):
        context = agent_container(ds)["securityContext"]
        assert context["privileged"] is True
        assert "allowPrivilegeEscalation" not in context, "the API rejects it as false beside privileged"
        assert context["readOnlyRootFilesystem"] is True
        assert pod_spec(ds)["securityContext"] == pod_spec(daemonset(helm))["securityContext"]
        assert "privileged" in " ".join(restricted_violations(pod_spec(ds)))
    for ds in of_kind(helm.template(CI["host-mounts"], sets=("agent.podResources.enabled=false",)), "DaemonSet"):
        assert pod_spec(ds)["securityContext"]["runAsUser"] == 65532, "privileged, but not root without the kubelet"


def test_host_mounts_render_one_daemonset_per_architecture_with_its_library(helm: Helm) -> None:
    """amd64 and arm64 each get a DaemonSet pinned by kubernetes.io/arch, mounting that arch's libnvidia-ml."""
    manifests = helm.template(CI["host-mounts"])
    by_arch = {pod_spec(ds)["nodeSelector"]["kubernetes.io/arch"]: ds for ds in of_kind(manifests, "DaemonSet")}
    assert sorted(by_arch) == ["amd64", "arm64"]
    expected = {
        "amd64": "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1",
        "arm64": "/usr/lib/aarch64-linux-gnu/libnvidia-ml.so.1",
    }
    for arch, ds in by_arch.items():
        volumes = {v["name"]: v for v in pod_spec(ds)["volumes"]}
        assert volumes["libnvidia-ml"]["hostPath"] == {"path": expected[arch], "type": "File"}
        assert pod_spec(ds)["affinity"] == pod_spec(daemonset(helm))["affinity"], "the GPU node labels apply too"
        container = agent_container(ds)
        mount = next(m for m in container["volumeMounts"] if m["name"] == "libnvidia-ml")
        assert mount["readOnly"] is True
        assert mount["mountPath"].rsplit("/", 1) == [env_values(container)["LD_LIBRARY_PATH"], "libnvidia-ml.so.1"]
    # The two DaemonSets must not adopt each other's pods.
    amd64, arm64 = (by_arch[a]["spec"]["selector"]["matchLabels"] for a in ("amd64", "arm64"))
    assert not selects(amd64, by_arch["arm64"]["spec"]["template"]["metadata"]["labels"])
    assert not selects(arm64, by_arch["amd64"]["spec"]["template"]["metadata"]["labels"])


def test_host_mounts_mount_each_device_file_as_a_typed_char_device(helm: Helm) -> None:
    """`files` mode mounts /dev/nvidiactl, /dev/nvidia0..N-1 and the extras, read-only, as CharDevice."""
    ds = of_kind(helm.template(CI["host-mounts"]), "DaemonSet")[0]
    devices = {v["hostPath"]["path"]: v["hostPath"]["type"] for v in pod_spec(ds)["volumes"] if "/dev/" in str(v)}
    assert devices == {
        "/dev/nvidiactl": "CharDevice",
        "/dev/nvidia0": "CharDevice",
        "/dev/nvidia1": "CharDevice",
        "/dev/nvidia-uvm": "CharDevice",
    }
    mounts = {m["mountPath"]: m.get("readOnly", False) for m in agent_container(ds)["volumeMounts"]}
    assert all(mounts[path] for path in devices)


def test_host_mounts_dev_mode_mounts_the_whole_dev_for_one_architecture(helm: Helm) -> None:
    """`dev` mode mounts the host's /dev as a Directory; only the listed architecture gets a DaemonSet."""
    (ds,) = of_kind(helm.template(CI["host-mounts-dev"]), "DaemonSet")
    assert pod_spec(ds)["nodeSelector"]["kubernetes.io/arch"] == "amd64"
    host_paths = {v["hostPath"]["path"]: v["hostPath"]["type"] for v in pod_spec(ds)["volumes"] if "hostPath" in v}
    assert host_paths == {
        "/usr/lib64/libnvidia-ml.so.1": "File",
        "/dev": "Directory",
        "/var/lib/kubelet/pod-resources": "Directory",
    }


def test_the_termination_message_leaves_dev_only_when_the_hosts_dev_is_mounted(helm: Helm) -> None:
    """Over the host's read-only /dev, runc cannot create /dev/termination-log (the pod never starts, as the real
    kubelet showed): the message goes to the writable /tmp then, and stays at the kubelet's default otherwise."""
    (dev,) = of_kind(helm.template(CI["host-mounts-dev"]), "DaemonSet")
    assert agent_container(dev)["terminationMessagePath"] == "/tmp/termination-log"
    assert {"name": "tmp", "mountPath": "/tmp"} in agent_container(dev)["volumeMounts"]
    for scenario in ("defaults", "host-mounts"):
        for ds in of_kind(helm.template(CI[scenario]), "DaemonSet"):
            assert "terminationMessagePath" not in agent_container(ds)


def test_runtime_class_can_be_emptied(helm: Helm) -> None:
    """agent.runtimeClassName "" leaves the field out, so the node's default runtime runs the agent."""
    assert "runtimeClassName" not in pod_spec(daemonset(helm, "no-runtime-class"))


def test_probes_are_native_grpc_on_the_health_service(helm: Helm) -> None:
    """Startup, readiness (ExternalScaler's health) and liveness (overall health) are gRPC probes on port 6000."""
    container = agent_container(daemonset(helm))
    assert container["startupProbe"]["grpc"] == {"port": 6000}
    assert container["readinessProbe"]["grpc"] == {"port": 6000, "service": "externalscaler.ExternalScaler"}
    assert container["livenessProbe"]["grpc"] == {"port": 6000}
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"grpc": 6000, "metrics": 9402}


def test_with_tls_the_probes_use_healthz_on_the_metrics_port(helm: Helm) -> None:
    """The kubelet's gRPC probe cannot speak TLS, so with TLS on the probes GET /healthz on port metrics."""
    container = agent_container(daemonset(helm, "tls", sets=("agent.metrics.enabled=true",)))
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe] == container[probe] | {"httpGet": {"path": "/healthz", "port": "metrics"}}
        assert "grpc" not in container[probe]


def test_with_tls_and_no_metrics_port_the_probes_fall_back_to_tcp(helm: Helm) -> None:
    """With TLS on and the metrics listener off, nothing plaintext is left to ask, so the probes are TCP checks."""
    container = agent_container(daemonset(helm, "tls"))  # this scenario turns metrics off
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe] == container[probe] | {"tcpSocket": {"port": "grpc"}}


def test_grace_period_outlasts_the_drain(helm: Helm) -> None:
    """terminationGracePeriodSeconds is longer than GPUSCALER_DRAIN_TIMEOUT, and a shorter one is refused."""
    for scenario, values in CI.items():
        for ds in of_kind(helm.template(values), "DaemonSet"):
            drain = float(env_values(agent_container(ds))["GPUSCALER_DRAIN_TIMEOUT"])
            assert pod_spec(ds)["terminationGracePeriodSeconds"] > drain, scenario
    error = helm.template_error(CI["defaults"], sets=["agent.drainTimeout=20"])
    assert "agent.terminationGracePeriodSeconds (15) must be longer than agent.drainTimeout (20)" in error


def test_the_downward_api_names_the_node_and_pod(helm: Helm) -> None:
    """NODE_NAME, POD_NAME and POD_NAMESPACE come from the pod's own fields."""
    assert env_field_refs(agent_container(daemonset(helm))) == {
        "NODE_NAME": "spec.nodeName",
        "POD_NAME": "metadata.name",
        "POD_NAMESPACE": "metadata.namespace",
    }


def test_default_settings_are_the_documented_ones(helm: Helm) -> None:
    """The defaults as environment variables: nvml, both listeners, JSON logs, the kubelet's PodResources socket and
    NVIDIA's DRA driver."""
    assert env_values(agent_container(daemonset(helm))) == {
        "GPUSCALER_COLLECTOR": "nvml",
        "GPUSCALER_LISTEN": "0.0.0.0:6000",
        "GPUSCALER_POLL_INTERVAL": "0.5",
        "GPUSCALER_HISTORY": "10m",
        "GPUSCALER_LOG_FORMAT": "json",
        "GPUSCALER_LOG_LEVEL": "info",
        "GPUSCALER_DRAIN_TIMEOUT": "5",
        "GPUSCALER_METRICS_LISTEN": "0.0.0.0:9402",
        "GPUSCALER_POD_RESOURCES_SOCKET": "/var/lib/kubelet/pod-resources/kubelet.sock",
        "GPUSCALER_DRA_DRIVERS": "gpu.nvidia.com",
        "GPUSCALER_PROCESSES": "false",
        **connection_limit_defaults(),
    }


SETTABLE = [
    ("agent.collector=fake", "GPUSCALER_COLLECTOR", "fake"),
    ("agent.listen.port=7000", "GPUSCALER_LISTEN", "0.0.0.0:7000"),
    ("agent.listen.host=::", "GPUSCALER_LISTEN", "[::]:6000"),
    ("agent.pollInterval=2", "GPUSCALER_POLL_INTERVAL", "2"),
    ("agent.history=30m", "GPUSCALER_HISTORY", "30m"),
    ("agent.log.format=console", "GPUSCALER_LOG_FORMAT", "console"),
    ("agent.log.level=debug", "GPUSCALER_LOG_LEVEL", "debug"),
    ("agent.drainTimeout=2.5", "GPUSCALER_DRAIN_TIMEOUT", "2.5"),
    *connection_limit_settings("agent"),
    ("agent.metrics.port=9500", "GPUSCALER_METRICS_LISTEN", "0.0.0.0:9500"),
    ("agent.metrics.enabled=false", "GPUSCALER_METRICS_LISTEN", ""),
    ("agent.podResources.enabled=false", "GPUSCALER_POD_RESOURCES_SOCKET", ""),
    (
        "agent.podResources.hostPath=/run/kubelet/pod-resources",
        "GPUSCALER_POD_RESOURCES_SOCKET",
        "/run/kubelet/pod-resources/kubelet.sock",
    ),
    ("agent.collector=fake,agent.fake.gpus=16", "GPUSCALER_FAKE_GPUS", "16"),
    ("agent.processes.enabled=true", "GPUSCALER_PROCESSES", "true"),
    (
        "agent.podResources.draDrivers={gpu.nvidia.com,gpu.example.com}",
        "GPUSCALER_DRA_DRIVERS",
        "gpu.nvidia.com,gpu.example.com",
    ),
    ("agent.podResources.draDrivers=null", "GPUSCALER_DRA_DRIVERS", ""),
    ("agent.tls.secretName=t", "GPUSCALER_TLS_CERT", "/etc/gpuscaler/tls/tls.crt"),
    ("agent.tls.secretName=t", "GPUSCALER_TLS_KEY", "/etc/gpuscaler/tls/tls.key"),
    ("agent.tls.secretName=t,agent.tls.reloadInterval=30", "GPUSCALER_TLS_RELOAD_INTERVAL", "30"),
    ("agent.tls.secretName=t,agent.tls.requireClientCert=true", "GPUSCALER_TLS_CLIENT_CA", "/etc/gpuscaler/tls/ca.crt"),
]


@pytest.mark.parametrize(("assignment", "variable", "expected"), SETTABLE)
def test_each_serve_setting_is_settable_from_values(helm: Helm, assignment: str, variable: str, expected: str) -> None:
    """Each `gpuscaler serve` flag has a value that sets its GPUSCALER_* variable."""
    assert env_values(agent_container(daemonset(helm, sets=(assignment,))))[variable] == expected


def test_the_chart_covers_every_flag_the_agent_has(helm: Helm) -> None:
    """Every flag in gpuscaler.agent.settings.SERVE_FLAGS can be set from values, and the chart sets no unknown one."""
    settable = {variable for _, variable, _ in SETTABLE} | {"GPUSCALER_FAKE_SCENARIO"}
    assert {env_name(flag) for flag in SERVE_FLAGS} <= settable
    rendered: set[str] = set()
    for scenario in CI:
        for ds in of_kind(helm.template(CI[scenario]), "DaemonSet"):
            rendered |= {name for name in env_values(agent_container(ds)) if name.startswith("GPUSCALER_")}
    assert rendered <= {env_name(flag) for flag in SERVE_FLAGS} | ANNOUNCED_SETTINGS


@pytest.mark.parametrize("scenario", sorted(CI))
def test_the_agent_accepts_the_rendered_settings(helm: Helm, scenario: str) -> None:
    """The agent's own settings check passes for the environment the chart gives it."""
    for ds in of_kind(helm.template(CI[scenario]), "DaemonSet"):
        container = agent_container(ds)
        environ = env_values(container) | {"NODE_NAME": "gpu-node-1"}
        args: Namespace = build_parser(environ).parse_args(container["args"])
        settings = settings_from_args(args, environ)
        assert settings.node_name == "gpu-node-1"


def test_the_fake_scenario_reaches_the_agent_as_a_file_it_accepts(helm: Helm) -> None:
    """agent.fake.scenario becomes a ConfigMap file the agent's parser accepts, mounted where the env points."""
    manifests = helm.template(CI["fake"])
    config = find(manifests, "ConfigMap", f"{FULLNAME}-scenario")
    ds = find(manifests, "DaemonSet")
    container = agent_container(ds)
    environment = env_values(container)
    scenario = parse_scenario(
        yaml.safe_load(config["data"]["scenario.yaml"]), gpu_count=int(environment["GPUSCALER_FAKE_GPUS"])
    )
    assert list(scenario.gpus) == [0]
    mount = next(m for m in container["volumeMounts"] if m["name"] == "scenario")
    assert environment["GPUSCALER_FAKE_SCENARIO"] == mount["mountPath"] + "/scenario.yaml"
    annotation = ds["spec"]["template"]["metadata"]["annotations"]["checksum/scenario"]
    changed = find(
        helm.template(CI["fake"], sets=("agent.fake.gpus=3", "agent.fake.scenario.gpus.2.name=x")), "DaemonSet"
    )
    assert changed["spec"]["template"]["metadata"]["annotations"]["checksum/scenario"] != annotation


def test_tls_mounts_the_secret_read_only_with_a_group_readable_key(helm: Helm) -> None:
    """The TLS Secret is mounted read-only, mode 0440, readable through fsGroup by the non-root user."""
    ds = daemonset(helm, "tls")
    volume = next(v for v in pod_spec(ds)["volumes"] if v["name"] == "tls")
    assert volume["secret"] == {"secretName": "gpuscaler-tls", "defaultMode": 0o440}
    assert pod_spec(ds)["securityContext"]["fsGroup"] == 65532
    assert {"name": "tls", "mountPath": "/etc/gpuscaler/tls", "readOnly": True} in agent_container(ds)["volumeMounts"]


def test_keda_service_is_a_clusterip_on_port_6000_named_grpc(helm: Helm) -> None:
    """KEDA's Service: ClusterIP, port 6000 named grpc, selecting the gateway; the agents without the gateway."""
    manifests = helm.template(CI["defaults"])
    service = find(manifests, "Service", FULLNAME)
    assert service["spec"]["type"] == "ClusterIP"
    assert service["spec"]["ports"] == [
        {"name": "grpc", "port": 6000, "targetPort": "grpc", "protocol": "TCP"},
        {"name": "metrics", "port": 9402, "targetPort": "metrics", "protocol": "TCP"},  # the gateway pods' /metrics
    ]
    gateway_labels = find(manifests, "Deployment")["spec"]["template"]["metadata"]["labels"]
    agent_labels = find(manifests, "DaemonSet")["spec"]["template"]["metadata"]["labels"]
    assert selects(service["spec"]["selector"], gateway_labels)
    assert not selects(service["spec"]["selector"], agent_labels), "a ClusterIP to the agents reads ONE node"
    without = helm.template(CI["gateway-off"])
    pod_labels = find(without, "DaemonSet")["spec"]["template"]["metadata"]["labels"]
    assert selects(find(without, "Service", FULLNAME)["spec"]["selector"], pod_labels)


def test_headless_service_lists_every_agent_with_both_ports(helm: Helm) -> None:
    """The headless Service (clusterIP None) has grpc and metrics; without metrics, only grpc."""
    manifests = helm.template(CI["defaults"])
    headless = find(manifests, "Service", f"{FULLNAME}-agents")
    assert headless["spec"]["clusterIP"] == "None"
    assert [(p["name"], p["port"]) for p in headless["spec"]["ports"]] == [("grpc", 6000), ("metrics", 9402)]
    assert selects(headless["spec"]["selector"], find(manifests, "DaemonSet")["spec"]["template"]["metadata"]["labels"])
    without = find(helm.template(CI["tls"]), "Service", f"{FULLNAME}-agents")
    assert [(p["name"], p["port"]) for p in without["spec"]["ports"]] == [("grpc", 7000)]


def test_services_select_pods_of_every_architecture(helm: Helm) -> None:
    """With one DaemonSet per architecture, the headless Service (and KEDA's, without the gateway) reaches all."""
    manifests = helm.template(CI["host-mounts"], sets=("gateway.enabled=false",))
    for service in of_kind(manifests, "Service"):
        for ds in of_kind(manifests, "DaemonSet"):
            assert selects(service["spec"]["selector"], ds["spec"]["template"]["metadata"]["labels"])


def test_servicemonitor_scrapes_the_agents_and_the_gateway(helm: Helm) -> None:
    """The ServiceMonitor selects the headless Service (one target per node) and KEDA's (one per gateway pod)."""
    manifests = helm.template(CI["servicemonitor"])
    monitor = find(manifests, "ServiceMonitor")
    selector = monitor["spec"]["selector"]
    (expression,) = selector["matchExpressions"]
    assert expression["key"] == "gpuscaler/service"
    assert expression["operator"] == "In"
    for service, role in ((f"{FULLNAME}-agents", "agents"), (FULLNAME, "scaler")):
        labels = find(manifests, "Service", service)["metadata"]["labels"]
        assert selects(selector["matchLabels"], labels)
        assert labels["gpuscaler/service"] == role
        assert role in expression["values"]
    (endpoint,) = monitor["spec"]["endpoints"]
    assert (endpoint["port"], endpoint["path"], endpoint["interval"]) == ("metrics", "/metrics", "30s")
    assert {"sourceLabels": ["__meta_kubernetes_pod_node_name"], "targetLabel": "kubernetes_node"} in endpoint[
        "relabelings"
    ]
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    agents_only = find(helm.template(CI["servicemonitor"], sets=["gateway.metrics.enabled=false"]), "ServiceMonitor")
    assert agents_only["spec"]["selector"]["matchExpressions"][0]["values"] == ["agents"]


def test_servicemonitor_leaves_the_series_own_node_namespace_and_pod_alone(helm: Helm) -> None:
    """By default no relabeling writes `node` (GPU series carry the GPU's own), and the series' own labels win over
    the target's, so a GPU's node, an engine pod's namespace and pod are not renamed exported_*."""
    (endpoint,) = find(helm.template(CI["prometheusrule"]), "ServiceMonitor")["spec"]["endpoints"]
    assert endpoint["honorLabels"] is True
    targets = [relabeling.get("targetLabel") for relabeling in endpoint["relabelings"]]
    assert targets == ["kubernetes_node"]
    assert not {"node", "namespace", "pod"} & set(targets)


def test_prometheusrule_renders_the_rules_file_with_its_runbooks_and_labels(helm: Helm) -> None:
    """The PrometheusRule holds files/rules.yaml's groups as they are, but each alert's runbook is under
    prometheusRule.runbookBaseURL and prometheusRule.additionalLabels join its labels, its own severity winning."""
    plain = yaml.safe_load((CHART / "files" / "rules.yaml").read_text())
    manifests = helm.template(CI["prometheusrule"])
    rule = find(manifests, "PrometheusRule")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    rendered = rule["spec"]["groups"]
    assert [group["name"] for group in rendered] == [group["name"] for group in plain["groups"]]
    for ours, theirs in zip(plain["groups"], rendered, strict=True):
        for alert, out in zip(ours["rules"], theirs["rules"], strict=True):
            assert out["alert"] == alert["alert"]
            assert (out["expr"], out["for"]) == (alert["expr"], alert["for"])
            assert out["labels"] == alert["labels"] | {"team": "gpu-platform"}, "its own severity wins"
            assert out["annotations"] == alert["annotations"] | {
                "runbook_url": f"https://runbooks.example.com/gpuscaler/troubleshooting.md#{alert['alert'].lower()}"
            }


def test_prometheusrule_defaults_to_the_plain_files_runbooks(helm: Helm) -> None:
    """Without a runbookBaseURL of one's own, the rendered alerts point where files/rules.yaml does."""
    plain = yaml.safe_load((CHART / "files" / "rules.yaml").read_text())
    rendered = find(helm.template(CI["defaults"], sets=["prometheusRule.enabled=true"]), "PrometheusRule")
    assert rendered["spec"]["groups"] == plain["groups"]


def test_servicemonitor_without_metrics_is_refused(helm: Helm) -> None:
    """A ServiceMonitor with every metrics listener off would scrape nothing, so rendering fails and says why."""
    error = helm.template_error(
        CI["servicemonitor"], sets=["agent.metrics.enabled=false", "gateway.metrics.enabled=false"]
    )
    assert "serviceMonitor.enabled needs agent.metrics.enabled or gateway.metrics.enabled" in error


def test_networkpolicy_admits_grpc_from_keda_only(helm: Helm) -> None:
    """The NetworkPolicy lets KEDA's namespace (and pods) reach port 6000 and the monitoring namespace 9402."""
    manifests = helm.template(CI["networkpolicy"])
    policy = find(manifests, "NetworkPolicy", FULLNAME)["spec"]
    assert selects(
        policy["podSelector"]["matchLabels"], find(manifests, "DaemonSet")["spec"]["template"]["metadata"]["labels"]
    )
    assert policy["policyTypes"] == ["Ingress"]
    grpc, metrics = policy["ingress"]
    assert grpc["ports"] == [{"protocol": "TCP", "port": 6000}]
    gateway_labels = find(manifests, "Deployment")["spec"]["template"]["metadata"]["labels"]
    keda, gateway = grpc["from"]
    assert keda == {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "keda-system"}},
        "podSelector": {"matchLabels": {"app": "keda-operator"}},
    }
    assert selects(gateway["podSelector"]["matchLabels"], gateway_labels)
    assert metrics["ports"] == [{"protocol": "TCP", "port": 9402}]
    assert metrics["from"] == [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]


def test_optional_resources_are_off_by_default(helm: Helm) -> None:
    """No ServiceMonitor or PrometheusRule (each needs a CRD) and no NetworkPolicy unless asked for."""
    assert not {"ServiceMonitor", "PrometheusRule", "NetworkPolicy"} & set(kinds(helm.template(CI["defaults"])))


def test_default_image_is_the_published_tag_of_this_release(helm: Helm) -> None:
    """The image tag defaults to appVersion, which is the bare project version that `make image` tags."""
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    project = tomllib.loads((CHART.parents[1] / "pyproject.toml").read_text())["project"]
    assert chart["appVersion"] == project["version"]
    assert agent_container(daemonset(helm))["image"] == f"gpuscaler/gpuscaler:{project['version']}"
    assert re.fullmatch(r"\d+\.\d+\.\d+", chart["appVersion"]), "published tags carry no v prefix"
    pinned = agent_container(daemonset(helm, "tls"))["image"]
    assert pinned == f"registry.example/gpuscaler/gpuscaler:{project['version']}@sha256:" + "0123456789abcdef" * 4


def test_resources_request_little_and_cap_memory(helm: Helm) -> None:
    """Small requests so the agent fits beside GPU jobs; a memory limit so a leak cannot hurt the node."""
    assert agent_container(daemonset(helm))["resources"] == {
        "requests": {"cpu": "20m", "memory": "64Mi"},
        "limits": {"memory": "256Mi"},
    }


def test_root_filesystem_stays_read_only_with_a_scratch_tmp(helm: Helm) -> None:
    """The only writable path is /tmp, a size-limited emptyDir; the kubelet's folder is mounted read-only."""
    ds = daemonset(helm)
    assert {"name": "tmp", "emptyDir": {"sizeLimit": "16Mi"}} in pod_spec(ds)["volumes"]
    assert agent_container(ds)["volumeMounts"] == [
        {"name": "tmp", "mountPath": "/tmp"},
        {"name": "pod-resources", "mountPath": "/var/lib/kubelet/pod-resources", "readOnly": True},
    ]


def test_old_clusters_without_grpc_probes_are_refused(helm: Helm) -> None:
    """Kubernetes before 1.27 lacks GA gRPC probes; the chart's kubeVersion refuses it."""
    error = helm.template_error(CI["defaults"], extra=["--kube-version", "1.26.0"])
    assert "chart requires kubeVersion: >=1.27.0-0" in error
    assert helm.template(CI["defaults"], extra=["--kube-version", "1.27.0"])


async def test_probe_services_are_ones_the_agent_reports_serving(helm: Helm, channel: Channel) -> None:
    """Each gRPC probe's service name is one the agent's health service answers SERVING for (a typo would not)."""
    container = agent_container(daemonset(helm))
    health = HealthStub(channel)
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        name = container[probe]["grpc"].get("service", "")
        response = await health.Check(HealthCheckRequest(service=name))
        assert response.status == HealthCheckResponse.SERVING, probe
    with pytest.raises(GRPCError) as unknown:
        await health.Check(HealthCheckRequest(service="externalscaler.ExternalScalar"))
    assert unknown.value.status is Status.NOT_FOUND
