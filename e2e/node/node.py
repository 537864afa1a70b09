"""One real node beside the loopback control plane: containerd and runc, the kubelet, kube-scheduler, kube-proxy,
CoreDNS and the fake NVIDIA device plugin, each a process of the control plane's (logs in its folder, stopped with it).

``Node.start`` needs the private namespaces of ``host.py``. It stops in the order that leaves nothing behind: the
pods first (the kubelet unmounts their volumes and removes their sandboxes), then the kubelet, then whatever
containerd still holds (tasks killed and deleted, so their shims exit), then containerd, and last the shadowed paths
are unmounted. ``leftovers`` lists what survived, and the session fails on it.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import subprocess
import sys
import time
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from e2e.keda.control_plane import (
    ApiError,
    ControlPlane,
    ControlPlaneFailed,
    Daemon,
    Json,
    PlaneSettings,
    free_port,
)
from e2e.node import device_plugin, dra_driver
from e2e.node.host import (
    BRIDGE,
    CGROUP_ROOT,
    CLUSTER_DOMAIN,
    CNI_BIN_DIR,
    NODE_ADDRESS,
    POD_SUBNET,
    SHADOWED,
    PrivateHost,
    mounts_under,
)
from e2e.node.images import SANDBOX_IMAGE, ImageArchive

# The control plane for a real node: the kubelet runs the pods, kube-proxy and CoreDNS serve Services.
NODE_SETTINGS = PlaneSettings(
    advertise_address=NODE_ADDRESS,
    service_accounts=True,
    more_controllers=(
        "daemonset-controller",
        # The Services' EndpointSlices, which kube-proxy and CoreDNS read.
        "endpointslice-controller",
        "namespace-controller",
        "disruption-controller",
        # The kubelet registers its node tainted not-ready; this controller lifts the taint once the node is Ready.
        "node-lifecycle-controller",
        # Makes each pod's ResourceClaims from its ResourceClaimTemplates (DRA), and deletes them with the pod.
        "resourceclaim-controller",
    ),
    downscale_stabilization="0s",
    pod_stand_in=False,
    # The chart's nvmlHostMounts runs the agent privileged, and agent.processes with hostPID.
    allow_privileged=True,
)
NODE_NAME = "gpuscaler-e2e-node"
CONTAINERD = "/usr/bin/containerd"
CTR = "/usr/bin/ctr"
RUNC = "/usr/sbin/runc"
NVIDIA_RUNTIME = "nvidia"  # the runtime handler the GPU operator installs; here it is runc
CRI_NAMESPACE = "k8s.io"
PODS_GONE_TIMEOUT_SECONDS = 120.0
# What owns pods in the suite, deleted before the pods at the end: (API group path, plural).
OWNERS = (
    ("/apis/keda.sh/v1alpha1", "scaledobjects"),
    ("/apis/apps/v1", "deployments"),
    ("/apis/apps/v1", "daemonsets"),
)


def _containerd_config(directory: Path, socket: Path) -> str:
    """containerd 1.6's config: every path in the run's folder, CRI with the local sandbox image, no pulls."""
    root, state = directory / "containerd-root", directory / "containerd-state"
    cni_conf = directory / "cni"
    runc_options = f"""
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.{{name}}]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.{{name}}.options]
        BinaryName = "{RUNC}"
        SystemdCgroup = false
"""
    return f"""version = 2
root = "{root}"
state = "{state}"
disabled_plugins = [
  "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.zfs",
  "io.containerd.snapshotter.v1.devmapper",
  "io.containerd.snapshotter.v1.aufs",
  "io.containerd.tracing.processor.v1.otlp",
]

[grpc]
  address = "{socket}"
[ttrpc]
  address = "{socket}.ttrpc"
[debug]
  level = "info"
[metrics]
  address = ""

[plugins."io.containerd.internal.v1.opt"]
  path = "{directory / "containerd-opt"}"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{SANDBOX_IMAGE}"
  # This VM refuses a negative oom_score_adj: without it every sandbox fails ("can't get final child's PID").
  restrict_oom_score_adj = true
  enable_selinux = false
  stream_server_address = "127.0.0.1"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{CNI_BIN_DIR}"
    conf_dir = "{cni_conf}"
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
{runc_options.format(name="runc")}
{runc_options.format(name=NVIDIA_RUNTIME)}
"""


def _cni_config(directory: Path) -> Json:
    """A bridge network on the namespace's cni0 (made by host.py with the node's address), host-local addresses."""
    return {
        "cniVersion": "0.4.0",
        "name": "gpuscaler-e2e",
        "plugins": [
            {
                "type": "bridge",
                "bridge": BRIDGE,
                "isGateway": True,
                "ipMasq": False,
                "hairpinMode": True,
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{"subnet": POD_SUBNET, "gateway": NODE_ADDRESS}]],
                    "routes": [{"dst": "0.0.0.0/0"}],
                    "dataDir": str(directory / "cni-ipam"),
                },
            }
        ],
    }


@dataclass
class Node:
    """The node's processes; ``start`` brings them up in order, each waited for."""

    plane: ControlPlane
    directory: Path
    programs: Mapping[str, Path]
    host: PrivateHost
    name: str = NODE_NAME
    daemons: list[Daemon] = field(default_factory=list)
    device_plugin: Daemon | None = None
    device_plugin_starts: int = 0
    dra_daemon: Daemon | None = None
    containerd_socket: Path = Path()
    kubelet_healthz: int = 0

    # --- start ---------------------------------------------------------------------------------------

    def start(self, images: list[ImageArchive]) -> None:
        """CoreDNS, kube-proxy, kube-scheduler, containerd (with ``images`` imported), then the kubelet; returns
        when the node is Ready."""
        self.directory.mkdir(parents=True, exist_ok=True)
        self._start_coredns()
        self._start_kube_proxy()
        self._start_scheduler()
        self._start_containerd()
        for image in images:
            self.import_image(image)
        self._start_kubelet()

    def _daemon(self, name: str, argv: list[str], environ: Mapping[str, str] | None = None) -> Daemon:
        daemon = self.plane.start_daemon(name, argv, environ)
        self.daemons.append(daemon)
        return daemon

    def _start_coredns(self) -> None:
        ready, health = free_port(), free_port()
        corefile = self.directory / "Corefile"
        corefile.write_text(
            f""".:53 {{
    bind {NODE_ADDRESS}
    errors
    health 127.0.0.1:{health}
    ready 127.0.0.1:{ready}
    kubernetes {CLUSTER_DOMAIN} in-addr.arpa ip6.arpa {{
        kubeconfig {self.plane.kubeconfig} e2e
        pods insecure
        ttl 1
        fallthrough in-addr.arpa ip6.arpa
    }}
}}
"""
        )
        daemon = self._daemon("coredns", [str(self.programs["coredns"]), "-conf", str(corefile)])
        self.plane.wait_for("CoreDNS", lambda: _http_ok(ready, "/ready"), [daemon])

    def _start_kube_proxy(self) -> None:
        healthz = free_port()
        config = self.directory / "kube-proxy.yaml"
        config.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
                    "kind": "KubeProxyConfiguration",
                    "clientConnection": {"kubeconfig": str(self.plane.kubeconfig)},
                    "mode": "iptables",
                    "clusterCIDR": POD_SUBNET,
                    "hostnameOverride": self.name,
                    "healthzBindAddress": f"127.0.0.1:{healthz}",
                    "metricsBindAddress": f"127.0.0.1:{free_port()}",
                    # A network namespace of its own: leave the conntrack table's sysctls as they are.
                    "conntrack": {
                        "maxPerCore": 0,
                        "min": 0,
                        "tcpEstablishedTimeout": "0s",
                        "tcpCloseWaitTimeout": "0s",
                    },
                    "iptables": {"localhostNodePorts": False, "syncPeriod": "5s", "minSyncPeriod": "0s"},
                }
            )
        )
        daemon = self._daemon("kube-proxy", [str(self.programs["kube-proxy"]), f"--config={config}", "--v=2"])
        self.plane.wait_for("kube-proxy", lambda: _http_ok(healthz, "/livez"), [daemon])

    def _start_scheduler(self) -> None:
        config = self.directory / "kube-scheduler.yaml"
        config.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "kubescheduler.config.k8s.io/v1",
                    "kind": "KubeSchedulerConfiguration",
                    "clientConnection": {"kubeconfig": str(self.plane.kubeconfig)},
                    "leaderElection": {"leaderElect": False},
                }
            )
        )
        self._daemon("kube-scheduler", [str(self.programs["kube-scheduler"]), f"--config={config}", "--secure-port=0"])

    def _start_containerd(self) -> None:
        self.containerd_socket = self.directory / "containerd.sock"
        cni = self.directory / "cni"
        cni.mkdir(exist_ok=True)
        (cni / "10-gpuscaler-e2e.conflist").write_text(json.dumps(_cni_config(self.directory), indent=2))
        config = self.directory / "containerd.toml"
        config.write_text(_containerd_config(self.directory, self.containerd_socket))
        daemon = self._daemon("containerd", [CONTAINERD, "--config", str(config)])
        self.plane.wait_for("containerd", lambda: self.ctr("version").returncode == 0, [daemon])

    def ctr(self, *argv: str, namespace: str = CRI_NAMESPACE, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        """``ctr`` against this node's containerd, in the CRI's namespace."""
        return subprocess.run(
            [CTR, "--address", str(self.containerd_socket), "--namespace", namespace, *argv],
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def images(self) -> set[str]:
        """The image names containerd's CRI namespace holds."""
        return set(self.ctr("images", "ls", "--quiet").stdout.split())

    def import_image(self, image: ImageArchive, *also: str) -> None:
        """Imports an OCI archive into the CRI's namespace, unpacked, and tags it ``also`` too."""
        before = self.images()
        result = self.ctr("images", "import", "--no-unpack=false", str(image.path), timeout=600)
        if result.returncode != 0:
            raise ControlPlaneFailed(f"ctr images import {image.path} failed:\n{result.stdout}{result.stderr}")
        names = self.images()
        if image.name not in names:
            new = sorted(names - before)
            if len(new) != 1:
                raise ControlPlaneFailed(f"{image.path}: expected one new image named {image.name}, got {new}")
            self.tag_image(new[0], image.name)
        for name in also:
            self.tag_image(image.name, name)

    def tag_image(self, source: str, target: str) -> None:
        """Gives an image in the CRI's namespace one more name."""
        result = self.ctr("images", "tag", "--force", source, target)
        if result.returncode != 0:
            raise ControlPlaneFailed(f"ctr images tag {source} {target} failed:\n{result.stderr}")

    def _start_kubelet(self) -> None:
        self.kubelet_healthz = free_port()
        resolv = self.directory / "kubelet-resolv.conf"
        resolv.write_text(f"nameserver {NODE_ADDRESS}\n")
        config = self.directory / "kubelet.yaml"
        config.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "kubelet.config.k8s.io/v1beta1",
                    "kind": "KubeletConfiguration",
                    # What worked on this kind of machine (issue 20): cgroup v1, no QoS cgroups, swap allowed.
                    "failCgroupV1": False,
                    "cgroupsPerQOS": False,
                    "enforceNodeAllocatable": [],
                    "failSwapOn": False,
                    "cgroupDriver": "cgroupfs",
                    "containerRuntimeEndpoint": f"unix://{self.containerd_socket}",
                    "authentication": {"anonymous": {"enabled": True}, "webhook": {"enabled": False}},
                    "authorization": {"mode": "AlwaysAllow"},
                    "address": NODE_ADDRESS,
                    "port": free_port(),
                    "readOnlyPort": 0,
                    "healthzBindAddress": "127.0.0.1",
                    "healthzPort": self.kubelet_healthz,
                    "clusterDNS": [NODE_ADDRESS],
                    "clusterDomain": CLUSTER_DOMAIN,
                    "resolvConf": str(resolv),
                    "podCIDR": POD_SUBNET,
                    "serializeImagePulls": False,
                    "syncFrequency": "10s",
                    "nodeStatusUpdateFrequency": "2s",
                    # A shared machine's disk and memory are not the node's to guard: evict only when nearly out.
                    "evictionHard": {"memory.available": "50Mi", "nodefs.available": "1%", "imagefs.available": "1%"},
                    "imageGCHighThresholdPercent": 99,
                    "imageGCLowThresholdPercent": 98,
                }
            )
        )
        daemon = self._daemon(
            "kubelet",
            [
                str(self.programs["kubelet"]),
                f"--config={config}",
                f"--kubeconfig={self.plane.kubeconfig}",
                f"--hostname-override={self.name}",
                f"--node-ip={NODE_ADDRESS}",
                "--v=2",
            ],
        )
        self.plane.wait_for("the kubelet's Ready node", self.ready, [daemon])

    def ready(self) -> bool:
        """Whether the Node object says Ready."""
        node = self.plane.kube.get(f"/api/v1/nodes/{self.name}")
        for condition in ((node or {}).get("status") or {}).get("conditions") or []:
            if condition.get("type") == "Ready":
                return bool(condition.get("status") == "True")
        return False

    def label(self, labels: Mapping[str, str | None]) -> None:
        """Sets (or with None removes) labels on the Node, as GPU feature discovery does."""
        self.plane.kube.request(
            "PATCH",
            f"/api/v1/nodes/{self.name}",
            {"metadata": {"labels": dict(labels)}},
            content_type="application/merge-patch+json",
        )

    # --- the device plugin -------------------------------------------------------------------------

    def start_device_plugin(self, gpus: int, replicas: int = 1) -> None:
        """(Re)starts the fake NVIDIA device plugin with ``gpus`` GPUs x ``replicas``; returns once the node's
        allocatable nvidia.com/gpu says so."""
        self.stop_device_plugin()
        self.device_plugin_starts += 1
        self.device_plugin = self._daemon(
            f"device-plugin-{self.device_plugin_starts}",
            [
                sys.executable,
                "-m",
                "e2e.node.device_plugin",
                "--node",
                self.name,
                "--gpus",
                str(gpus),
                "--replicas",
                str(replicas),
            ],
            {"PYTHONPATH": str(Path(__file__).resolve().parents[2])},
        )
        expected = str(gpus * replicas)
        self.plane.wait_for(
            f"{expected} {device_plugin.RESOURCE} allocatable on the node",
            lambda: self.allocatable(device_plugin.RESOURCE) == expected,
            [self.device_plugin],
        )

    def allocatable(self, resource: str) -> str | None:
        """The node's allocatable amount of ``resource``, as the API has it."""
        node = self.plane.kube.get(f"/api/v1/nodes/{self.name}") or {}
        value = ((node.get("status") or {}).get("allocatable") or {}).get(resource)
        return None if value is None else str(value)

    def stop_device_plugin(self) -> None:
        """Stops the device plugin (the kubelet marks its devices unhealthy, pods keep theirs)."""
        if self.device_plugin is not None:
            self._end(self.device_plugin)
            self.device_plugin = None

    def _end(self, daemon: Daemon) -> None:
        daemon.stop()
        # Ended on purpose: not a dead process for check_alive (its log stays in the plane's folder).
        for daemons in (self.daemons, self.plane.daemons):
            if daemon in daemons:
                daemons.remove(daemon)

    # --- the DRA driver ------------------------------------------------------------------------------

    def start_dra_driver(self, devices: list[dra_driver.FakeDevice]) -> None:
        """Starts the fake NVIDIA DRA driver publishing ``devices``; returns once the kubelet has registered it and
        its ResourceSlice is in the API."""
        self.stop_dra_driver()
        listing = self.directory / "dra-devices.json"
        listing.write_text(json.dumps([device.as_json() for device in devices], indent=2))
        assert self.plane.kubeconfig is not None
        self.dra_daemon = self._daemon(
            "dra-driver",
            [
                sys.executable,
                "-m",
                "e2e.node.dra_driver",
                "--node",
                self.name,
                "--devices",
                str(listing),
                "--kubeconfig",
                str(self.plane.kubeconfig),
            ],
            {"PYTHONPATH": str(Path(__file__).resolve().parents[2])},
        )
        log = self.dra_daemon.log_path
        self.plane.wait_for(
            f"the kubelet to register {dra_driver.DRIVER}",
            lambda: f"registered {dra_driver.DRIVER} " in log.read_text(errors="replace"),
            [self.dra_daemon],
        )
        path = f"{dra_driver.RESOURCE_API}/resourceslices/{dra_driver.slice_name(self.name)}"
        self.plane.wait_for("the DRA driver's ResourceSlice", lambda: self.plane.kube.get(path) is not None, [])

    def stop_dra_driver(self) -> None:
        """Stops the DRA driver, which deletes its ResourceSlice (the claims it prepared stay prepared)."""
        if self.dra_daemon is not None:
            self._end(self.dra_daemon)
            self.dra_daemon = None

    # --- stop ----------------------------------------------------------------------------------------

    def delete_all_pods(self) -> list[str]:
        """Deletes every pod on the node (their owners first, so nothing recreates them) and waits until the
        kubelet has confirmed each termination; returns what did not go."""
        kube = self.plane.kube
        for group, plural in OWNERS:
            with contextlib.suppress(ApiError):
                for item in kube.request("GET", f"{group}/{plural}")["items"]:
                    metadata = item["metadata"]
                    with contextlib.suppress(ApiError):
                        kube.request(
                            "DELETE", f"{group}/namespaces/{metadata['namespace']}/{plural}/{metadata['name']}"
                        )
        deadline = time.monotonic() + PODS_GONE_TIMEOUT_SECONDS
        selector = urllib.parse.quote(f"spec.nodeName={self.name}")
        while True:
            pods = kube.request("GET", f"/api/v1/pods?fieldSelector={selector}")["items"]
            if not pods:
                return []
            if time.monotonic() > deadline:
                names = [f"{p['metadata']['namespace']}/{p['metadata']['name']}" for p in pods]
                return [f"pods still on the node after {PODS_GONE_TIMEOUT_SECONDS:g}s: {names}"]
            for pod in pods:
                metadata = pod["metadata"]
                if not metadata.get("deletionTimestamp"):
                    with contextlib.suppress(ApiError):
                        kube.request("DELETE", f"/api/v1/namespaces/{metadata['namespace']}/pods/{metadata['name']}")
            time.sleep(0.5)

    def stop(self) -> list[str]:
        """Stops everything in the order that leaves nothing behind; returns what could not be cleaned up."""
        problems: list[str] = []
        kubelet_alive = any(d.name == "kubelet" and d.process and d.process.poll() is None for d in self.daemons)
        if kubelet_alive:
            try:
                problems += self.delete_all_pods()
            except Exception as error:  # the API server may be gone already; the node is cleaned below anyway
                problems.append(f"deleting the pods failed: {error!r}")
        self.stop_device_plugin()
        for daemon in reversed(self.daemons):
            if daemon.name == "containerd":
                problems += self._empty_containerd()
            daemon.stop()
        problems += self._kill_leftover_shims()
        problems += self.host.restore()
        left = mounts_under(*SHADOWED, self.directory)
        if left:
            problems.append(f"mounts left behind: {left}")
        problems += self._remove_cgroups()
        return problems

    def _empty_containerd(self) -> list[str]:
        """Kills and deletes every task and container still in containerd (their shims exit with them)."""
        if not self.containerd_socket.exists():
            return []
        problems = []
        for task in self.ctr("tasks", "ls", "--quiet").stdout.split():
            self.ctr("tasks", "kill", "--signal", "SIGKILL", task)
            for _ in range(50):
                if self.ctr("tasks", "delete", task).returncode == 0:
                    break
                time.sleep(0.1)
            else:
                problems.append(f"containerd task {task} would not go")
        for container in self.ctr("containers", "ls", "--quiet").stdout.split():
            if self.ctr("containers", "delete", container).returncode != 0:
                problems.append(f"containerd container {container} would not go")
        return problems

    def _kill_leftover_shims(self) -> list[str]:
        """Shims of this node's containerd still alive (found by its socket in their command lines): killed by pid."""
        problems = []
        marker = str(self.containerd_socket).encode()
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                command = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if b"containerd-shim" in command and marker in command:
                problems.append(f"containerd shim {entry.name} outlived containerd: killed")
                with contextlib.suppress(OSError):
                    os.kill(int(entry.name), 9)
        return problems

    def _remove_cgroups(self) -> list[str]:
        """Removes the cgroups containerd made for the node's containers (runc removes them with each container;
        what is left is empty), deepest first."""
        problems = []
        for controller in CGROUP_ROOT.iterdir():
            top = controller / CRI_NAMESPACE
            if not top.is_dir():
                continue
            for folder in sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
                with contextlib.suppress(OSError):
                    folder.rmdir()
            try:
                top.rmdir()
            except OSError as error:
                problems.append(f"cgroup {top} left: {error.strerror}")
        return problems


def _http_ok(port: int, path: str) -> bool:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        response.read()
        return response.status == 200
    finally:
        connection.close()
