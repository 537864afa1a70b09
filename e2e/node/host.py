"""The machine the node runs on: its prerequisites, and the private namespaces that keep the node off the host.

``make e2e-node`` runs pytest under ``unshare --net --mount``: a network namespace of its own, so the node's bridge,
pod addresses, kube-proxy's iptables rules and CoreDNS touch nothing outside it (127.0.0.1 is the namespace's own),
and a mount namespace of its own, in which the paths the kubelet, containerd and CNI insist on (the kubelet's
device-plugin socket is at a fixed path whatever --root-dir says; containerd's shims and network namespaces live
under /run) are bind mounts of folders in the run's temporary folder. Every mount the kubelet makes for a pod is made
in that namespace too, so none of it outlives the run, and the host's /var/lib/kubelet is never written.

What the suite needs from the host is checked here, and each missing piece fails the run with what to do.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from e2e.keda.control_plane import SERVICE_CLUSTER_IP_RANGE
from e2e.support.namespaces import left

# The node's address: the CNI bridge's, on which the pods' gateway, the API server's advertised address and CoreDNS
# listen. Inside the private network namespace only.
NODE_ADDRESS = "10.88.0.1"
POD_SUBNET = "10.88.0.0/16"
POD_SUBNET_PREFIX = 16
BRIDGE = "cni0"
CLUSTER_DOMAIN = "cluster.local"
# Paths fixed in the kubelet, containerd 1.6 and libcni, shadowed by folders of the run.
SHADOWED = (
    "/var/lib/kubelet",
    "/var/lib/cni",
    "/run/containerd",
    "/run/netns",
    "/var/log/pods",
    "/var/log/containers",
    # libmount's record of the mounts the kubelet makes with mount(8) (utab): the host's file otherwise.
    "/run/mount",
    # The CDI spec folders a DRA driver writes (/var/run/cdi is this one where /var/run links to /run, as on Debian):
    # the fake DRA driver writes none, but a real one, or a containerd that applies CDI, must find the run's own.
    "/etc/cdi",
    "/run/cdi",
)
RESOLV_CONF = Path("/etc/resolv.conf")
# Debian packages the suite runs, and a program each provides.
DEBIAN_PACKAGES = {
    "containerd": "/usr/bin/containerd",
    "runc": "/usr/sbin/runc",
    "containernetworking-plugins": "/usr/lib/cni/bridge",
    "iptables": "/usr/sbin/iptables",
    "busybox-static": "/bin/busybox",
}
CNI_BIN_DIR = Path("/usr/lib/cni")
CGROUP_ROOT = Path("/sys/fs/cgroup")


class HostUnsuitable(AssertionError):
    """The machine lacks something the suite needs; the message says what and how to get it."""


def missing_packages() -> list[str]:
    """The Debian packages of DEBIAN_PACKAGES that are not installed."""
    return [package for package, program in DEBIAN_PACKAGES.items() if not Path(program).exists()]


def install_packages() -> None:
    """Installs the missing Debian packages with apt-get (run before entering the namespaces: apt needs the network)."""
    missing = missing_packages()
    if not missing:
        return
    if os.geteuid() != 0:
        raise HostUnsuitable(f"the node suite needs root to install {', '.join(missing)} (and to run a kubelet)")
    if shutil.which("apt-get") is None:
        raise HostUnsuitable(f"missing {', '.join(missing)}, and no apt-get to install them: install them by hand")
    environ = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for argv in (["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", "--no-install-recommends", *missing]):
        result = subprocess.run(argv, env=environ, capture_output=True, text=True)
        if result.returncode != 0:
            raise HostUnsuitable(f"{' '.join(argv)} failed:\n{result.stdout[-3000:]}{result.stderr[-3000:]}")


# Set by ``python -m e2e.node`` to the namespaces it ran in, before it entered private ones (PID 1's may not be
# readable, even by root).
HOST_NAMESPACES_VARIABLE = "GPUSCALER_E2E_NODE_HOST_NAMESPACES"


def check() -> None:
    """Raises HostUnsuitable unless this process is root, in private network and mount namespaces, with the
    packages installed and cgroup v1 controllers mounted."""
    problems = []
    if os.geteuid() != 0:
        problems.append("not root: the kubelet, containerd and the CNI bridge need root")
    outer = os.environ.get(HOST_NAMESPACES_VARIABLE, "")
    if not left(outer):
        problems.append(
            "not in private network and mount namespaces: run `make e2e-node` (python -m e2e.node), which runs "
            "pytest under `unshare --net --mount`, so the node's network and mounts stay off the host"
        )
    missing = missing_packages()
    if missing:
        problems.append(f"missing Debian packages {', '.join(missing)}: `make e2e-node` installs them with apt-get")
    if not (CGROUP_ROOT / "memory").is_dir() and not (CGROUP_ROOT / "cgroup.controllers").exists():
        problems.append(f"no cgroup hierarchy under {CGROUP_ROOT}")
    if problems:
        raise HostUnsuitable("the node suite cannot run here:\n- " + "\n- ".join(problems))


def _run(*argv: str) -> None:
    result = subprocess.run(argv, capture_output=True, text=True)
    if result.returncode != 0:
        raise HostUnsuitable(f"{' '.join(argv)} failed ({result.returncode}): {result.stderr.strip()}")


@dataclass
class PrivateHost:
    """The namespace's network (loopback and the bridge) and the shadowed paths; ``restore`` undoes the mounts and
    removes the mount points this run created."""

    directory: Path
    mounted: list[Path] = field(default_factory=list)
    created: list[Path] = field(default_factory=list)

    def set_up(self, nameserver: str) -> None:
        """Brings up loopback and the bridge; shadows the fixed paths and /etc/resolv.conf (``nameserver``)."""
        _run("ip", "link", "set", "lo", "up")
        _run("ip", "link", "add", BRIDGE, "type", "bridge")
        _run("ip", "addr", "add", f"{NODE_ADDRESS}/{POD_SUBNET_PREFIX}", "dev", BRIDGE)
        _run("ip", "link", "set", BRIDGE, "up")
        # A node's processes reach ClusterIPs by a route (kube-proxy rewrites the destination after routing): a
        # real node's default route; here only the Service range, on the bridge.
        _run("ip", "route", "add", SERVICE_CLUSTER_IP_RANGE, "dev", BRIDGE, "src", NODE_ADDRESS)
        for fixed in SHADOWED:
            target = Path(fixed)
            source = self.directory / "host" / fixed.strip("/").replace("/", "-")
            source.mkdir(parents=True, exist_ok=True)
            if not target.exists():
                self._create(target)
            self._bind(source, target)
        resolv = self.directory / "resolv.conf"
        # The node's own name service, for the suite's processes and KEDA's (the kubelet gets clusterDNS itself).
        resolv.write_text(
            f"nameserver {nameserver}\nsearch svc.{CLUSTER_DOMAIN} {CLUSTER_DOMAIN}\noptions ndots:5 timeout:1\n"
        )
        self._bind(resolv, RESOLV_CONF)

    def _create(self, target: Path) -> None:
        missing = [target, *(parent for parent in target.parents if not parent.exists())]
        target.mkdir(parents=True)
        self.created.extend(reversed(missing))  # parents first, so restore removes the deepest first

    def _bind(self, source: Path, target: Path) -> None:
        # -n: no record in /run/mount/utab, which is the host's file (only the mount table is private).
        _run("mount", "-n", "--bind", str(source), str(target))
        self.mounted.append(target)

    def restore(self) -> list[str]:
        """Unmounts (recursively) what ``set_up`` mounted, newest first, and removes the folders it created; returns
        what it could not undo, for the report."""
        problems = []
        for target in reversed(self.mounted):
            # The kubelet bind-mounts its root onto itself (to make it rshared): unmount until nothing is there.
            while mounts_under(target):
                result = subprocess.run(["umount", "-n", "--recursive", str(target)], capture_output=True, text=True)
                if result.returncode != 0:
                    problems.append(f"umount -R {target}: {result.stderr.strip()}")
                    break
        self.mounted.clear()
        for folder in reversed(self.created):
            with contextlib.suppress(OSError):
                folder.rmdir()
        self.created.clear()
        return problems


def mounts_under(*prefixes: Path | str) -> list[str]:
    """The mount points in this namespace at or under any of ``prefixes`` (what a cleanup has left)."""
    found = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4].replace("\\040", " ")
        if any(point == str(prefix) or point.startswith(f"{str(prefix).rstrip('/')}/") for prefix in prefixes):
            found.append(point)
    return found


@contextlib.contextmanager
def private_host(directory: Path, nameserver: str) -> Iterator[PrivateHost]:
    """``PrivateHost`` set up for the block and restored after it."""
    check()
    host = PrivateHost(directory)
    try:
        host.set_up(nameserver)
        yield host
    finally:
        host.restore()
