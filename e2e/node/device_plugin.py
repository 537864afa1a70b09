"""A fake NVIDIA device plugin: the kubelet's device plugin API (v1beta1) over unix sockets, run as its own process.

It serves ``DevicePlugin`` on a socket in the kubelet's device-plugin folder, registers ``nvidia.com/gpu`` with the
kubelet's ``Registration`` service, and lists one healthy device per fake GPU, named as NVIDIA's plugin names them:
the GPU's UUID, or ``<uuid>::<n>`` for each of the ``--replicas`` time-sliced replicas of a shared GPU. The UUIDs
are the fake collector's (``GPU-fake-<node>-<index>``), so the agent on the node can tie the kubelet's assignments
to its fake GPUs. ``Allocate`` answers as NVIDIA's plugin does with its default strategy (envvar): the container
gets ``NVIDIA_VISIBLE_DEVICES`` listing its devices.

Run it: ``python -m e2e.node.device_plugin --node NODE --gpus 4 [--replicas 2]``. It exits 0 on SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path

from grpclib.client import Channel
from grpclib.server import Server

from gpuscaler.generated import v1beta1 as api

DEVICE_PLUGIN_FOLDER = Path("/var/lib/kubelet/device-plugins")  # fixed by the kubelet, whatever --root-dir says
KUBELET_SOCKET = DEVICE_PLUGIN_FOLDER / "kubelet.sock"
RESOURCE = "nvidia.com/gpu"
SOCKET_NAME = "gpuscaler-fake-gpu.sock"
HEALTHY = "Healthy"


def fake_gpu_uuid(node: str, index: int) -> str:
    """The UUID the fake collector gives GPU ``index`` on ``node`` (gpuscaler/agent/collectors/fake.py)."""
    return f"GPU-fake-{node}-{index}"


def device_ids(node: str, gpus: int, replicas: int) -> list[str]:
    """The device ids of ``gpus`` fake GPUs: each UUID, or with ``replicas`` > 1 each ``<uuid>::<n>``."""
    uuids = [fake_gpu_uuid(node, index) for index in range(gpus)]
    if replicas <= 1:
        return uuids
    return [f"{uuid}::{replica}" for uuid in uuids for replica in range(replicas)]


class FakeNvidiaDevicePlugin(api.DevicePluginBase):
    """The DevicePlugin service: a fixed list of healthy devices; allocations recorded and printed."""

    def __init__(self, ids: list[str]) -> None:
        self.ids = ids

    async def get_device_plugin_options(self, message: api.Empty) -> api.DevicePluginOptions:
        return api.DevicePluginOptions(pre_start_required=False, get_preferred_allocation_available=False)

    async def list_and_watch(self, message: api.Empty) -> AsyncIterator[api.ListAndWatchResponse]:
        yield api.ListAndWatchResponse(devices=[api.Device(id=device, health=HEALTHY) for device in self.ids])
        await asyncio.Event().wait()  # the list never changes; the kubelet holds the stream open

    async def get_preferred_allocation(
        self, message: api.PreferredAllocationRequest
    ) -> api.PreferredAllocationResponse:
        return api.PreferredAllocationResponse()

    async def allocate(self, message: api.AllocateRequest) -> api.AllocateResponse:
        responses = []
        for request in message.container_requests:
            print(f"allocate {','.join(request.devices_ids)}", flush=True)
            responses.append(
                api.ContainerAllocateResponse(envs={"NVIDIA_VISIBLE_DEVICES": ",".join(request.devices_ids)})
            )
        return api.AllocateResponse(container_responses=responses)

    async def pre_start_container(self, message: api.PreStartContainerRequest) -> api.PreStartContainerResponse:
        return api.PreStartContainerResponse()


async def register(kubelet_socket: Path, endpoint: str) -> None:
    """Registers ``endpoint`` (a socket name in the kubelet's folder) for nvidia.com/gpu."""
    channel = Channel(path=str(kubelet_socket))
    try:
        await api.RegistrationStub(channel).register(
            api.RegisterRequest(
                version="v1beta1",
                endpoint=endpoint,
                resource_name=RESOURCE,
                options=api.DevicePluginOptions(pre_start_required=False, get_preferred_allocation_available=False),
            ),
            timeout=10,
        )
    finally:
        channel.close()


async def serve(node: str, gpus: int, replicas: int, folder: Path) -> None:
    """Serves until SIGTERM or SIGINT; registers once the socket listens, as the kubelet requires."""
    ids = device_ids(node, gpus, replicas)
    socket = folder / SOCKET_NAME
    socket.unlink(missing_ok=True)
    server = Server([FakeNvidiaDevicePlugin(ids)])
    await server.start(path=str(socket))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    try:
        await register(folder / KUBELET_SOCKET.name, SOCKET_NAME)
        print(f"registered {RESOURCE} devices={','.join(ids)}", flush=True)
        await stop.wait()
    finally:
        server.close()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(5):
                await server.wait_closed()
        socket.unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> None:
    """Parses the flags and serves."""
    parser = argparse.ArgumentParser(prog="python -m e2e.node.device_plugin", description=__doc__.splitlines()[0])
    parser.add_argument("--node", required=True, help="the node's name, as the fake collector's UUIDs carry it")
    parser.add_argument("--gpus", type=int, required=True, help="how many fake GPUs the node's agent has")
    parser.add_argument("--replicas", type=int, default=1, help="time-sliced replicas per GPU (NVIDIA's <uuid>::<n>)")
    parser.add_argument("--folder", type=Path, default=DEVICE_PLUGIN_FOLDER, help="the kubelet's device-plugin folder")
    args = parser.parse_args(argv)
    asyncio.run(serve(args.node, args.gpus, args.replicas, args.folder))
    sys.exit(0)


if __name__ == "__main__":
    main()
