"""Which pod a process runs in, from ``/proc/<pid>/cgroup``: the pod UID and container id the kubelet put there.

The kubelet names a pod's cgroup after its UID and the runtime names a container's after its id, in one of
a few spellings:

    0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1b4e..._..._....slice/cri-containerd-<id>.scope
    12:memory:/kubepods/besteffort/pod1b4e...-...-.../<id>
    0::/kubepods/pod1b4e.../crio-<id>.scope

A process outside every pod (a host daemon, the driver's persistence daemon) names none. The PodResources
API says which pods hold which GPUs, but not their UIDs: the UID is what the gateway's pod directory
(the pod watch reads ``metadata.uid``) turns into a pod name.

Reading another user's ``/proc/<pid>/cgroup`` needs no privilege (the file is world-readable), only that
the process is visible: the agent must share the host's PID namespace, where NVML's PIDs live.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

DEFAULT_PROC_ROOT = Path("/proc")

# A pod UID is a UUID; the systemd cgroup driver spells its dashes as underscores. A static pod's cgroup
# carries the 32-hex hash of its manifest instead, which is also its mirror pod's config hash.
_UUID = r"[0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12}"
_POD = re.compile(rf"pod({_UUID}|[0-9a-f]{{32}})(?:\.slice)?$")
_CONTAINER = re.compile(r"^(?:[a-z-]+-)?([0-9a-f]{64})(?:\.scope)?$")


@dataclass(frozen=True, slots=True)
class Container:
    """Where a process runs: its pod's UID (empty outside every pod) and its container id (empty if unnamed)."""

    pod_uid: str
    container_id: str


def container_of(cgroup: str) -> Container:
    """The pod and container a ``/proc/<pid>/cgroup`` text names; ``Container("", "")`` outside every pod."""
    for line in cgroup.splitlines():
        _hierarchy, _sep, path = line.partition(":")
        _controllers, _sep, path = path.partition(":")
        if "kubepods" not in path:
            continue
        pod_uid = container_id = ""
        for part in path.strip("/").split("/"):
            pod = _POD.search(part)
            if pod is not None:
                pod_uid = pod.group(1).replace("_", "-")
                container_id = ""  # a container is below its pod
                continue
            container = _CONTAINER.match(part)
            if container is not None and pod_uid:
                container_id = container.group(1)
        if pod_uid:
            return Container(pod_uid, container_id)
    return Container("", "")


class ProcReader:
    """Reads ``<proc_root>/<pid>/cgroup``; ``proc_root`` is ``/proc`` in a pod that shares the host's PIDs."""

    def __init__(self, proc_root: Path = DEFAULT_PROC_ROOT) -> None:
        self.proc_root = proc_root

    def container(self, pid: int) -> Container | None:
        """Where ``pid`` runs, or None when its cgroup cannot be read (it exited, or it is not visible here)."""
        try:
            text = (self.proc_root / str(pid) / "cgroup").read_text(encoding="utf-8", errors="replace")
        except OSError:
            return None
        return container_of(text)
