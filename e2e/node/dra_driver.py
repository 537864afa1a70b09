"""A fake NVIDIA DRA driver: the kubelet's DRA plugin API (v1) and plugin registration over unix sockets, and the
node's ResourceSlice in the API, run as its own process.

It publishes one ResourceSlice for driver ``gpu.nvidia.com`` whose pool is the node's name, with the devices of a
JSON file named as NVIDIA's driver (kubernetes-sigs/dra-driver-nvidia-gpu v0.4.1) names them: ``gpu-<minor>`` for a
whole GPU, ``gpu-<parentMinor>-mig-<profile>-<giProfileId>-<placementStart>`` for a MIG device, with the driver's
attributes (``type``, ``uuid``, ``minor`` / ``parentMinor``, ``profile``, ``parentUUID``); a device whose ``uuid`` is
null is published without one, as a MIG device the driver makes on demand (DynamicMIG) is. It then serves
``DRAPlugin`` on a socket under the kubelet's plugins folder and registers through the kubelet's plugin watcher (a
``Registration`` socket in ``plugins_registry``).

``NodePrepareResources`` reads each claim's allocation from the API, as the driver's kubelet plugin does, and answers
the devices allocated from this node's pool, with the CDI device names the driver gives them
(``k8s.gpu.nvidia.com/claim=<claimUID>-<device>``) and the allocation's share id. No CDI spec is written: Debian's
containerd 1.6 does not apply CDI devices, and attribution comes from the kubelet's PodResources API, which reports
what this answer says. The prepared claims are printed, one line each.

Run it: ``python -m e2e.node.dra_driver --node NODE --devices FILE --kubeconfig FILE``. On SIGTERM it deletes its
ResourceSlice and exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import sys
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

import yaml
from grpclib.server import Server

from e2e.keda.control_plane import ApiError, Json, Kube
from gpuscaler.generated import pluginregistration
from gpuscaler.generated.k8s.io.kubelet.pkg.apis.dra import v1 as dra

DRIVER = "gpu.nvidia.com"
KUBELET_ROOT = Path("/var/lib/kubelet")  # the kubelet's --root-dir default, shadowed by the suite
# The kubelet's plugin watcher finds plugins by the sockets in this folder.
REGISTRY_FOLDER = KUBELET_ROOT / "plugins_registry"
PLUGIN_FOLDER = KUBELET_ROOT / "plugins" / DRIVER
# The DRA services this plugin serves, as the kubelet names them in its choice (``<api version>.DRAPlugin``).
SUPPORTED_SERVICES = ["v1.DRAPlugin"]
RESOURCE_API = "/apis/resource.k8s.io/v1"
CDI_KIND = "k8s.gpu.nvidia.com/claim"


@dataclass(frozen=True)
class FakeDevice:
    """One device of the ResourceSlice: its name and the driver's attributes (``uuid`` None: not published)."""

    name: str
    kind: str  # "gpu" or "mig", the driver's ``type`` attribute
    uuid: str | None
    minor: int
    profile: str | None = None
    parent_uuid: str | None = None

    def as_json(self) -> Json:
        return {
            "name": self.name,
            "kind": self.kind,
            "uuid": self.uuid,
            "minor": self.minor,
            "profile": self.profile,
            "parent_uuid": self.parent_uuid,
        }

    def published(self) -> Json:
        """The device as the ResourceSlice carries it."""
        attributes: dict[str, Json] = {"type": {"string": self.kind}}
        if self.uuid is not None:
            attributes["uuid"] = {"string": self.uuid}
        if self.kind == "gpu":
            attributes["minor"] = {"int": self.minor}
        else:
            attributes["parentMinor"] = {"int": self.minor}
            if self.profile is not None:
                attributes["profile"] = {"string": self.profile}
            if self.parent_uuid is not None:
                attributes["parentUUID"] = {"string": self.parent_uuid}
        return {"name": self.name, "attributes": attributes}


def load_devices(path: Path) -> list[FakeDevice]:
    """The devices written by ``FakeDevice.as_json``, one JSON list."""
    return [FakeDevice(**entry) for entry in json.loads(path.read_text(encoding="utf-8"))]


def resource_slice(node: str, devices: list[FakeDevice]) -> Json:
    """The node's one ResourceSlice: pool = the node's name, as NVIDIA's driver publishes it."""
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": slice_name(node)},
        "spec": {
            "driver": DRIVER,
            "nodeName": node,
            "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
            "devices": [device.published() for device in devices],
        },
    }


def slice_name(node: str) -> str:
    """The ResourceSlice's name: one slice per node and driver."""
    return f"{node}-{DRIVER}"


def kube_from(kubeconfig: Path) -> Kube:
    """An API client from the suite's kubeconfig (one cluster, one user with a token)."""
    config = yaml.safe_load(kubeconfig.read_text(encoding="utf-8"))
    cluster = config["clusters"][0]["cluster"]
    return Kube(cluster["server"], config["users"][0]["user"]["token"], Path(cluster["certificate-authority"]))


class FakeDraPlugin(dra.DraPluginBase):
    """The DRAPlugin service: prepares a claim by reading its allocation from the API."""

    def __init__(self, kube: Kube, node: str) -> None:
        self.kube = kube
        self.node = node

    async def node_prepare_resources(
        self, message: dra.NodePrepareResourcesRequest
    ) -> dra.NodePrepareResourcesResponse:
        answers = {}
        for claim in message.claims:
            answers[claim.uid] = await asyncio.to_thread(self._prepare, claim)
        return dra.NodePrepareResourcesResponse(claims=answers)

    def _prepare(self, claim: dra.Claim) -> dra.NodePrepareResourceResponse:
        path = f"{RESOURCE_API}/namespaces/{claim.namespace}/resourceclaims/{urllib.parse.quote(claim.name)}"
        try:
            found = self.kube.get(path)
        except (ApiError, OSError) as error:
            return dra.NodePrepareResourceResponse(error=f"reading claim {claim.namespace}/{claim.name}: {error}")
        if found is None or found["metadata"]["uid"] != claim.uid:
            return dra.NodePrepareResourceResponse(error=f"claim {claim.namespace}/{claim.name} ({claim.uid}) is gone")
        results = (((found.get("status") or {}).get("allocation") or {}).get("devices") or {}).get("results") or []
        devices = [
            dra.Device(
                request_names=[result["request"]],
                pool_name=result["pool"],
                device_name=result["device"],
                cdi_device_ids=[f"{CDI_KIND}={claim.uid}-{result['device']}"],
                share_id=result.get("shareID"),
            )
            for result in results
            if result["driver"] == DRIVER and result["pool"] == self.node
        ]
        print(
            f"prepare {claim.namespace}/{claim.name} devices={','.join(d.device_name for d in devices)}"
            + "".join(f" share_id={d.share_id}" for d in devices if d.share_id),
            flush=True,
        )
        return dra.NodePrepareResourceResponse(devices=devices)

    async def node_unprepare_resources(
        self, message: dra.NodeUnprepareResourcesRequest
    ) -> dra.NodeUnprepareResourcesResponse:
        for claim in message.claims:
            print(f"unprepare {claim.namespace}/{claim.name}", flush=True)
        return dra.NodeUnprepareResourcesResponse(
            claims={claim.uid: dra.NodeUnprepareResourceResponse() for claim in message.claims}
        )


class Registration(pluginregistration.RegistrationBase):
    """What the kubelet's plugin watcher asks a plugin: its kind, name, endpoint and services."""

    def __init__(self, endpoint: Path) -> None:
        self.endpoint = endpoint

    async def get_info(self, message: pluginregistration.InfoRequest) -> pluginregistration.PluginInfo:
        return pluginregistration.PluginInfo(
            type="DRAPlugin", name=DRIVER, endpoint=str(self.endpoint), supported_versions=SUPPORTED_SERVICES
        )

    async def notify_registration_status(
        self, message: pluginregistration.RegistrationStatus
    ) -> pluginregistration.RegistrationStatusResponse:
        if message.plugin_registered:
            print(f"registered {DRIVER} with the kubelet", flush=True)  # what the suite waits for
        else:
            print(f"the kubelet refused the registration: {message.error}", flush=True)
        return pluginregistration.RegistrationStatusResponse()


async def _close(server: Server, socket: Path) -> None:
    server.close()
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(5):
            await server.wait_closed()
    _remove(socket)


def _remove(socket: Path) -> None:
    socket.unlink(missing_ok=True)


async def serve(node: str, devices: list[FakeDevice], kube: Kube) -> None:
    """Publishes the slice, serves and registers; until SIGTERM or SIGINT, then deletes the slice."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    document = resource_slice(node, devices)
    await asyncio.to_thread(kube.apply, document)
    print(f"published {slice_name(node)} devices={','.join(d.name for d in devices)}", flush=True)
    PLUGIN_FOLDER.mkdir(parents=True, exist_ok=True)
    REGISTRY_FOLDER.mkdir(parents=True, exist_ok=True)
    endpoint, registry = PLUGIN_FOLDER / "dra.sock", REGISTRY_FOLDER / f"{DRIVER}-reg.sock"
    plugin, registration = Server([FakeDraPlugin(kube, node)]), Registration(endpoint)
    watcher = Server([registration])
    try:
        _remove(endpoint)
        await plugin.start(path=str(endpoint))
        try:
            _remove(registry)
            await watcher.start(path=str(registry))  # the kubelet finds it from here on
            try:
                await stop.wait()
            finally:
                await _close(watcher, registry)
        finally:
            await _close(plugin, endpoint)
            with contextlib.suppress(OSError):  # made here and empty again; else the suite's shadow holds it
                PLUGIN_FOLDER.rmdir()
    finally:
        await asyncio.to_thread(kube.delete, document)


def main(argv: list[str] | None = None) -> None:
    """Parses the flags and serves."""
    parser = argparse.ArgumentParser(prog="python -m e2e.node.dra_driver", description=__doc__.splitlines()[0])
    parser.add_argument("--node", required=True, help="the node's name: the slice's node and pool")
    parser.add_argument("--devices", type=Path, required=True, help="JSON list of the devices to publish")
    parser.add_argument("--kubeconfig", type=Path, required=True, help="the suite's kubeconfig (admin token)")
    args = parser.parse_args(argv)
    asyncio.run(serve(args.node, load_devices(args.devices), kube_from(args.kubeconfig)))
    sys.exit(0)


if __name__ == "__main__":
    main()
