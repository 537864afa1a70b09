"""A fake kubelet for the dev stack: the PodResources API on one unix socket per fake node, from dev/kubelet.yaml.

Each agent of compose.yaml reads its node's socket exactly as it reads a real kubelet's, so the gateway's pod
queries (``workload``, ``pod``, ``podSelector``, ``scaleTargetPods``) answer over the dev stack's fake GPUs. The
file is read again at every ``List`` whose answer it could change (its modification time moved), so editing it
moves GPUs between pods while the stack runs. The sockets are made as the kubelet makes its own: ``srwxr-xr-x`` in
a ``0750`` folder, both the owner's, so only an agent running as the same user can connect (the chart runs the
agent as uid 0 for that reason; docs/install.md).

The file's ``nodes`` map each node to its pods, ``NAMESPACE/POD``, and each pod to what it holds: a list of GPU
indices (the NVIDIA device plugin's devices, ``GPU-fake-<node>-<index>``), or a mapping with ``gpus`` (the same list)
and ``dra`` (DRA devices as NVIDIA's DRA driver names them: ``gpu-<minor>``,
``gpu-<minor>-mig-<profile>-<profileId>-<placement>``, ``gpu-vfio-<index>``), reported as ``dynamic_resources``: one
claim ``<pod>-gpu`` in the pod's namespace, driver ``gpu.nvidia.com``, pool the node's name. A fake GPU's minor number
counts down from the node's last index (gpuscaler/agent/collectors/fake.py), so ``gpu-0`` on a node of 4 is GPU 3.

Usage: ``python dev/fake_kubelet.py --assignments dev/kubelet.yaml --socket-dir DIR``; ``DIR/<node>.sock`` for each
node in the file.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from grpclib.const import Status
from grpclib.exceptions import GRPCError
from grpclib.server import Server

from gpuscaler.agent.attribution.devices import NVIDIA_DRA_DRIVER, DeviceKey, dra_name
from gpuscaler.generated import v1 as kubelet
from gpuscaler.model.samples import ReadErrorKind

GPU_RESOURCE = "nvidia.com/gpu"
HELD_KEYS = ("gpus", "dra")
DRA_FORMS = "gpu-<minor>, gpu-<minor>-mig-<profile>-<profileId>-<placement> or gpu-vfio-<index>"
SOCKET_MODE = 0o755  # the kubelet's: only its owner may write, and connecting to a unix socket is a write
FOLDER_MODE = 0o750


class AssignmentError(ValueError):
    """The assignments file is not what this module's docstring describes; the message names the entry."""


def device_id(node: str, index: int) -> str:
    """The NVIDIA device plugin's id for a whole GPU: its UUID, which for fake GPUs is ``GPU-fake-<node>-<index>``."""
    return f"GPU-fake-{node}-{index}"


@dataclass(frozen=True, slots=True)
class Held:
    """What one pod holds: GPUs by index (device-plugin devices) and DRA devices by the driver's name."""

    gpus: tuple[int, ...] = ()
    dra: tuple[str, ...] = ()


Nodes = dict[str, dict[tuple[str, str], Held]]


def parse_assignments(text: str, source: str) -> Nodes:
    """node -> (namespace, pod) -> what it holds, from the file's ``nodes`` mapping of ``NAMESPACE/POD`` to a list of
    GPU indices or to ``{gpus: [INDEX, ...], dra: [NAME, ...]}``."""
    document = yaml.safe_load(text) or {}
    if not isinstance(document, dict) or set(document) - {"nodes"} or not isinstance(document.get("nodes"), dict):
        raise AssignmentError(f"{source}: expected a mapping with one key, 'nodes'")
    nodes: Nodes = {}
    for node, pods in document["nodes"].items():
        if not isinstance(pods, dict):
            raise AssignmentError(
                f"{source}: nodes.{node} must map NAMESPACE/POD to a list of GPU indices or to "
                f"{{gpus: [INDEX, ...], dra: [NAME, ...]}}, got {pods!r}"
            )
        nodes[str(node)] = {}
        for key, value in pods.items():
            namespace, _, pod = str(key).partition("/")
            if not namespace or not pod:
                raise AssignmentError(f"{source}: nodes.{node}.{key}: use NAMESPACE/POD")
            nodes[str(node)][(namespace, pod)] = _held(value, f"{source}: nodes.{node}.{key}")
    return nodes


def _held(value: object, where: str) -> Held:
    """One pod's entry: a list of GPU indices, or a mapping of ``gpus`` and ``dra``."""
    if isinstance(value, list):
        return Held(gpus=_indices(value, where))
    if not isinstance(value, dict):
        raise AssignmentError(
            f"{where}: expected a list of GPU indices or a mapping with 'gpus' and/or 'dra', got {value!r}"
        )
    unknown = sorted(map(str, set(value) - set(HELD_KEYS)))
    if unknown or not value:
        raise AssignmentError(
            f"{where}: expected the keys 'gpus' (GPU indices) and/or 'dra' (DRA device names), got {sorted(value)!r}"
        )
    return Held(gpus=_indices(value.get("gpus", []), f"{where}.gpus"), dra=_dra(value.get("dra", []), f"{where}.dra"))


def _indices(value: object, where: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in value):
        raise AssignmentError(f"{where}: expected a list of GPU indices (whole numbers from 0), got {value!r}")
    return tuple(value)


def _dra(value: object, where: str) -> tuple[str, ...]:
    """DRA device names the agent reads: any it would not place by its form is refused here, not left to the agent."""
    if not isinstance(value, list):
        raise AssignmentError(f"{where}: expected a list of DRA device names ({DRA_FORMS}), got {value!r}")
    for name in value:
        named = dra_name(NVIDIA_DRA_DRIVER, name) if isinstance(name, str) else None
        vfio = named is not None and not isinstance(named, DeviceKey) and named.kind is ReadErrorKind.NOT_SUPPORTED
        if not (isinstance(named, DeviceKey) and named.uuid is None) and not vfio:
            raise AssignmentError(f"{where}: {name!r} is not a DRA device name: expected {DRA_FORMS}")
    return tuple(value)


@dataclass
class Assignments:
    """The file, read again when its modification time changes; a broken edit keeps the last good assignments."""

    path: Path
    nodes: Nodes = field(default_factory=dict)
    _mtime: float | None = None

    def current(self) -> Nodes:
        mtime = self.path.stat().st_mtime
        if mtime != self._mtime:
            try:
                self.nodes = parse_assignments(self.path.read_text(encoding="utf-8"), str(self.path))
            except (AssignmentError, yaml.YAMLError) as error:
                if self._mtime is None:
                    raise
                print(f"fake_kubelet_reload_failed keeping=previous error={error}", flush=True)
            self._mtime = mtime
        return self.nodes


@dataclass(eq=False)
class NodeKubelet(kubelet.PodResourcesListerBase):
    """One node's PodResources ``List``: each assigned pod as one container holding its GPUs and DRA devices."""

    node: str
    assignments: Assignments

    async def list(self, message: kubelet.ListPodResourcesRequest) -> kubelet.ListPodResourcesResponse:
        pods = self.assignments.current().get(self.node, {})
        return kubelet.ListPodResourcesResponse(
            pod_resources=[
                kubelet.PodResources(
                    name=pod,
                    namespace=namespace,
                    containers=[
                        kubelet.ContainerResources(
                            name="main",
                            devices=[
                                kubelet.ContainerDevices(
                                    resource_name=GPU_RESOURCE,
                                    device_ids=[device_id(self.node, index) for index in held.gpus],
                                )
                            ]
                            if held.gpus
                            else [],
                            dynamic_resources=[
                                kubelet.DynamicResource(
                                    claim_name=f"{pod}-gpu",
                                    claim_namespace=namespace,
                                    claim_resources=[
                                        kubelet.ClaimResource(
                                            # As NVIDIA's driver names them (a made-up claim UID here).
                                            cdi_devices=[
                                                kubelet.CdiDevice(name=f"k8s.gpu.nvidia.com/claim={pod}-gpu-{name}")
                                            ],
                                            driver_name=NVIDIA_DRA_DRIVER,
                                            pool_name=self.node,
                                            device_name=name,
                                        )
                                        for name in held.dra
                                    ],
                                )
                            ]
                            if held.dra
                            else [],
                        )
                    ],
                )
                for (namespace, pod), held in sorted(pods.items())
            ]
        )

    async def get_allocatable_resources(
        self, message: kubelet.AllocatableResourcesRequest
    ) -> kubelet.AllocatableResourcesResponse:
        return kubelet.AllocatableResourcesResponse()

    async def get(self, message: kubelet.GetPodResourcesRequest) -> kubelet.GetPodResourcesResponse:
        raise GRPCError(Status.UNIMPLEMENTED, "the dev stack's fake kubelet answers List only")


# dev/fake_engines.py has its own, as it cannot import this one: make e2e-node runs it alone, from a ConfigMap.
class CannotListen(Exception):
    """A socket the fake kubelet cannot serve on."""


async def serve(assignments: Assignments, socket_dir: Path) -> None:
    """Serves every node's socket until SIGINT or SIGTERM, then removes the sockets."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    servers: list[tuple[Server, Path]] = []
    try:
        for node in sorted(assignments.current()):
            path = socket_dir / f"{node}.sock"
            _remove(path)  # left by a killed run
            server = Server([NodeKubelet(node, assignments)])
            try:
                await server.start(path=str(path))
            except OSError as error:  # said in one line by main, as every process of the dev stack says it
                raise CannotListen(f"cannot listen on {path}: {error.strerror or error}") from None
            path.chmod(SOCKET_MODE)
            servers.append((server, path))
        pods = sum(len(pods) for pods in assignments.nodes.values())
        sockets = ",".join(str(path) for _, path in servers)
        print(f"fake_kubelet_started nodes={len(servers)} pods={pods} sockets={sockets}", flush=True)
        await stop.wait()
    finally:
        for server, path in servers:
            server.close()
            await server.wait_closed()
            _remove(path)


def _remove(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


def main() -> int:
    """Parse the flags, check the file once, and serve."""
    parser = argparse.ArgumentParser(description="The dev stack's fake kubelet: PodResources on unix sockets.")
    parser.add_argument("--assignments", type=Path, required=True, help="YAML of nodes -> NAMESPACE/POD -> GPUs")
    parser.add_argument("--socket-dir", type=Path, required=True, help="folder for one <node>.sock per node")
    args = parser.parse_args()
    assignments = Assignments(args.assignments)
    try:
        assignments.current()
        args.socket_dir.mkdir(parents=True, exist_ok=True)
        args.socket_dir.chmod(FOLDER_MODE)
    except (OSError, AssignmentError, yaml.YAMLError) as error:
        parser.exit(2, f"fake kubelet: {error}\n")
    try:
        asyncio.run(serve(assignments, args.socket_dir))
    except CannotListen as error:
        parser.exit(1, f"fake kubelet: {error}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
