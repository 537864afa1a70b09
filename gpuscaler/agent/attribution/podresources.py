"""The agent's side of attribution: the kubelet's PodResources ``List``, refreshed, and attached to samples.

``List`` is read over the kubelet's unix socket every ``interval_seconds``, and at once on demand:
at start (before the first snapshot) and when the set of GPUs changes (``request_refresh``). A failed
read keeps the last good assignment for ``stale_after_seconds``; after that the node's attribution is
UNAVAILABLE, and a query that selects pods fails instead of reading a pod as idle. No socket at the
path is OFF, which is FAILED_PRECONDITION: a missing mount does not fix itself. Whether the last read worked,
and when one last did, are kept for the agent's series (``gpuscaler_attribution_up`` and its last-success time).

Device-plugin devices and the DRA claims of the drivers in ``dra_drivers`` (``--dra-drivers``) are placed on the
GPUs each tick (``devices.py``); a device none carries is listed in the tick's attribution (``unplaced``), so that
its pod's share is unknown rather than absent.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import structlog
from grpclib.client import Channel
from grpclib.exceptions import GRPCError, StreamTerminatedError

from gpuscaler.agent.attribution.devices import (
    DEFAULT_DRA_DRIVERS,
    Assignment,
    device_plugin_name,
    dra_name,
    place,
)
from gpuscaler.generated import v1 as kubelet
from gpuscaler.model.samples import Attribution, AttributionState, GpuSample, PodRef, UnplacedDevice
from gpuscaler.model.staleness import assignment_stale_after

log = structlog.get_logger(__name__)

DEFAULT_INTERVAL_SECONDS = 1.0
LIST_TIMEOUT_SECONDS = 2.0


def assignments(
    response: kubelet.ListPodResourcesResponse, dra_drivers: Sequence[str] = DEFAULT_DRA_DRIVERS
) -> list[Assignment]:
    """Every GPU device assigned to a container in a ``List`` answer: device-plugin devices, then DRA claims'."""
    found: list[Assignment] = []
    for pod in response.pod_resources:
        for container in pod.containers:
            ref = PodRef(namespace=pod.namespace, pod=pod.name, container=container.name)
            for devices in container.devices:
                for device_id in devices.device_ids:
                    named = device_plugin_name(devices.resource_name, device_id)
                    if named is not None:
                        found.append(Assignment(ref, devices.resource_name, device_id, named))
            for claim in container.dynamic_resources:
                for resource in claim.claim_resources:
                    named = dra_name(resource.driver_name, resource.device_name, dra_drivers)
                    if named is not None:
                        found.append(Assignment(ref, resource.driver_name, resource.device_name, named))
    return found


class PodResourcesWatcher:
    """Keeps the kubelet's GPU assignments for the poll loop, which asks ``attribute`` once per tick."""

    def __init__(
        self,
        socket_path: Path,
        *,
        interval_seconds: float = DEFAULT_INTERVAL_SECONDS,
        timeout_seconds: float = LIST_TIMEOUT_SECONDS,
        wall_clock: Callable[[], float] = time.time,
        dra_drivers: Sequence[str] = DEFAULT_DRA_DRIVERS,
    ) -> None:
        self.socket_path = socket_path
        self.dra_drivers = tuple(dra_drivers)
        self.interval_seconds = interval_seconds
        self.stale_after_seconds = assignment_stale_after(interval_seconds)
        self._timeout = timeout_seconds
        self._channel: Channel | None = None
        self._pairs: list[Assignment] = []
        self._last_success: float | None = None
        self._state = Attribution(AttributionState.UNAVAILABLE, "the kubelet has not been read yet")
        self._wake = asyncio.Event()
        self._devices: frozenset[str] = frozenset()
        self._unplaced: tuple[UnplacedDevice, ...] = ()
        self._awaiting = False
        # The devices the last tick could not place, for the series (None: nothing placed, attribution not OK).
        self.unplaced_now: tuple[UnplacedDevice, ...] | None = None
        self._wall_clock = wall_clock
        # The last read's outcome (None: not read yet; a missing socket is a failed read) and the Unix time of
        # the last good one (None: never), for the series: a kept assignment hides a failing kubelet otherwise.
        self.last_read_ok: bool | None = None
        self.last_success_unix: float | None = None

    @property
    def state(self) -> Attribution:
        return self._state

    def attribute(self, samples: Sequence[GpuSample]) -> tuple[tuple[GpuSample, ...], Attribution]:
        """``samples`` with the pods that hold each GPU, and the node's attribution state."""
        devices = frozenset(sample.gpu.uuid for sample in samples)
        if devices != self._devices:
            self._devices = devices
            self.request_refresh()  # GPUs came or went (a MIG change, a GPU lost): read the kubelet now
        if self._state.state is not AttributionState.OK:
            self._awaiting = False
            self.unplaced_now = None
            return tuple(samples), self._state
        placed = place([sample.gpu for sample in samples], self._pairs)
        self._awaiting = placed.awaiting
        self.unplaced_now = placed.unplaced
        found = placed.pods
        attributed = tuple(
            sample._replace(pods=found[sample.gpu.uuid]) if sample.gpu.uuid in found else sample for sample in samples
        )
        if placed.unplaced != self._unplaced:  # logged when the set changes, not every tick
            self._unplaced = placed.unplaced
            if placed.unplaced:
                log.warning(
                    "devices_unplaced",
                    devices=[f"{u.pod.namespace}/{u.pod.pod}: {u.device}: {u.detail}" for u in placed.unplaced],
                )
            else:
                log.info("devices_all_placed")
        if placed.unplaced:
            return attributed, Attribution(self._state.state, self._state.detail, placed.unplaced)
        return attributed, self._state

    def awaiting_devices(self) -> bool:
        """Whether the last ``attribute`` left a name unplaced that a device made since enumeration may carry."""
        return self._awaiting

    def request_refresh(self) -> None:
        """Read the kubelet now rather than at the next interval."""
        self._wake.set()

    async def refresh(self) -> Attribution:
        """One ``List``; updates the assignment and the state, never raises for a kubelet problem."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        if not _exists(self.socket_path):
            self._close_channel()
            self.last_read_ok = False
            return self._set(
                Attribution(
                    AttributionState.OFF,
                    f"no kubelet socket at {str(self.socket_path)!r}: mount the kubelet's pod-resources folder "
                    "into the agent (the chart's agent.podResources.enabled), or set --pod-resources-socket '' to turn "
                    "attribution off",
                ),
                keep_pairs=False,
            )
        try:
            if self._channel is None:
                self._channel = Channel(path=str(self.socket_path))
            stub = kubelet.PodResourcesListerStub(self._channel)
            response = await stub.list(kubelet.ListPodResourcesRequest(), timeout=self._timeout)
        except (OSError, GRPCError, StreamTerminatedError, TimeoutError) as error:
            self._close_channel()
            self.last_read_ok = False
            detail = f"kubelet PodResources List on {str(self.socket_path)!r} failed: {_describe(error)}"
            if self._last_success is not None and now - self._last_success <= self.stale_after_seconds:
                log.warning("pod_resources_list_failed", error=detail, keeping_last_for=self.stale_after_seconds)
                return self._state
            return self._set(Attribution(AttributionState.UNAVAILABLE, detail), keep_pairs=False)
        self._pairs = assignments(response, self.dra_drivers)
        self._last_success = now
        self.last_read_ok, self.last_success_unix = True, self._wall_clock()
        return self._set(Attribution(AttributionState.OK), keep_pairs=True)

    def _set(self, state: Attribution, *, keep_pairs: bool) -> Attribution:
        if not keep_pairs:
            self._pairs = []
        if state != self._state:
            event = log.info if state.state is AttributionState.OK else log.warning
            event("attribution_changed", state=state.state.value, detail=state.detail, socket=str(self.socket_path))
        self._state = state
        return state

    async def run(self) -> None:
        """Refresh every interval, or sooner when asked, until cancelled."""
        try:
            while True:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.interval_seconds):
                        await self._wake.wait()
                self._wake.clear()
                await self.refresh()
        finally:
            self._close_channel()

    def close(self) -> None:
        self._close_channel()

    def _close_channel(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None


def _exists(path: Path) -> bool:
    """A stat of a local path: microseconds, so fine on the loop."""
    return os.path.exists(path)


def _describe(error: BaseException) -> str:
    if isinstance(error, GRPCError):
        return f"{error.status.name}: {error.message}"
    if isinstance(error, TimeoutError):
        return "no answer in time"
    return repr(error)
