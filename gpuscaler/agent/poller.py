"""The poll loop: one asyncio task that samples every GPU each tick into the history.

Reads run on worker threads with a deadline inside the tick, so a hung NVML call costs that GPU its
sample and never delays the loop or an RPC. A GPU whose previous read is still hung is not read
again (that would pile up threads); its sample is missing until the read returns.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Callable, Sequence
from typing import Protocol

import structlog

from gpuscaler.agent.collectors.base import Collector
from gpuscaler.agent.history import History
from gpuscaler.agent.last_reads import LastReads
from gpuscaler.model.samples import (
    ATTRIBUTION_OFF,
    DEVICE_FIELD,
    Attribution,
    GpuIdentity,
    GpuSample,
    ReadError,
    ReadErrorKind,
    Snapshot,
)

log = structlog.get_logger(__name__)

DEFAULT_POLL_INTERVAL_SECONDS = 0.5
MIN_POLL_INTERVAL_SECONDS = 0.05
MAX_POLL_INTERVAL_SECONDS = 60.0
REDISCOVER_EVERY_SECONDS = 60.0
# A name the attribution could not place may be a device made since the last enumeration (a DRA driver makes a MIG
# instance when it prepares the pod's claim): the devices are enumerated again at the next tick, but at most this
# often, so a name that never places (a device on no GPU here) costs an enumeration every 2 s, not every tick.
REDISCOVER_SOON_SECONDS = 2.0


def read_timeout_for(poll_interval_seconds: float) -> float:
    """How long a tick waits for reads: most of the interval, so ticks stay on schedule."""
    return max(0.8 * poll_interval_seconds, 0.04)


class Attributor(Protocol):
    """Adds to each tick's samples the pods that hold each GPU (``attribution.PodResourcesWatcher``)."""

    def attribute(self, samples: Sequence[GpuSample]) -> tuple[tuple[GpuSample, ...], Attribution]: ...

    def awaiting_devices(self) -> bool:
        """Whether the last ``attribute`` left a name unplaced that enumerating the devices again may place."""
        ...


TickObserver = Callable[[float, float], None]  # seconds the reads took, seconds the tick started late


class Poller:
    """Samples ``collector`` every ``poll_interval_seconds`` and appends each snapshot to ``history``."""

    def __init__(
        self,
        collector: Collector,
        history: History,
        *,
        poll_interval_seconds: float,
        on_tick: TickObserver | None = None,
        attributor: Attributor | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._attributor = attributor
        self._collector = collector
        self._history = history
        self._interval = poll_interval_seconds
        self._read_timeout = read_timeout_for(poll_interval_seconds)
        self._on_tick = on_tick
        self._lag = 0.0
        self._devices: list[GpuIdentity] = []
        self._in_flight: dict[str, tuple[float, concurrent.futures.Future[GpuSample]]] = {}
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._sequence = 0
        self._last_discovery = 0.0
        self._clock = clock  # times the gaps between enumerations only (the event loop's clock by default)
        self._devices_awaited = False
        self._last_reads = LastReads()

    @property
    def devices(self) -> list[GpuIdentity]:
        return list(self._devices)

    async def start(self) -> None:
        """Discover the devices; call before ``run`` so that start-up errors surface at once."""
        self._devices = list(await asyncio.to_thread(self._collector.discover))
        self._last_discovery = self._clock()
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=max(4, 2 * len(self._devices)), thread_name_prefix="gpu-read"
        )
        log.info("gpus_discovered", count=len(self._devices), uuids=[gpu.uuid for gpu in self._devices])

    async def run(self) -> None:
        """Tick until cancelled."""
        loop = asyncio.get_running_loop()
        next_tick = loop.time()
        try:
            while True:
                self._lag = max(0.0, loop.time() - next_tick)
                await self.tick()
                next_tick += self._interval
                now = loop.time()
                if now > next_tick:
                    missed = int((now - next_tick) / self._interval) + 1
                    log.warning("poll_behind", missed_ticks=missed, lag_seconds=round(now - next_tick, 3))
                    next_tick += missed * self._interval
                await asyncio.sleep(next_tick - now)
        finally:
            if self._executor is not None:
                # Hung reads keep their threads; do not wait for them on the way out.
                self._executor.shutdown(wait=False, cancel_futures=True)

    async def tick(self) -> Snapshot:
        """Sample every device once and append the snapshot (the history announces it)."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        taken_at = time.time()
        since = self._clock() - self._last_discovery
        if since >= REDISCOVER_EVERY_SECONDS or (self._devices_awaited and since >= REDISCOVER_SOON_SECONDS):
            await self.rediscover()
        samples = self._last_reads.stamp(await self._read_all(started), taken_at)
        if self._on_tick is not None:
            self._on_tick(loop.time() - started, self._lag)
        attributed, attribution = (
            self._attributor.attribute(samples) if self._attributor is not None else (tuple(samples), ATTRIBUTION_OFF)
        )
        self._devices_awaited = self._attributor is not None and self._attributor.awaiting_devices()
        self._sequence += 1
        snapshot = Snapshot(
            sequence=self._sequence,
            taken_at=taken_at,
            monotonic=started,
            node=self._collector.node,
            samples=attributed,
            attribution=attribution,
        )
        self._history.append(snapshot)
        return snapshot

    async def _read_all(self, started: float) -> list[GpuSample]:
        assert self._executor is not None, "call start() first"
        loop = asyncio.get_running_loop()
        pending: dict[GpuIdentity, asyncio.Future[GpuSample]] = {}
        samples: dict[GpuIdentity, GpuSample] = {}
        for gpu in self._devices:
            hung = self._in_flight.get(gpu.uuid)
            if hung is not None and not hung[1].done():
                samples[gpu] = _missing(
                    gpu,
                    self._collector.node,
                    ReadErrorKind.TIMEOUT,
                    f"previous read has not returned for {started - hung[0]:.1f}s (hung NVML call)",
                )
                continue
            read = self._executor.submit(self._collector.read, gpu)
            self._in_flight[gpu.uuid] = (started, read)
            pending[gpu] = asyncio.wrap_future(read, loop=loop)
        if pending:
            await asyncio.wait(pending.values(), timeout=self._read_timeout)
        for gpu, future in pending.items():
            if not future.done():
                # The thread keeps running; we stop waiting. asyncio must not warn about the result later.
                future.add_done_callback(_consume)
                samples[gpu] = _missing(
                    gpu,
                    self._collector.node,
                    ReadErrorKind.TIMEOUT,
                    f"read did not finish within {self._read_timeout:g}s",
                )
            elif (error := future.exception()) is not None:
                log.error("gpu_read_failed", gpu=gpu.index, uuid=gpu.uuid, error=repr(error))
                samples[gpu] = _missing(gpu, self._collector.node, ReadErrorKind.OTHER, f"read failed: {error!r}")
            else:
                samples[gpu] = future.result()
        return [samples[gpu] for gpu in self._devices]

    async def rediscover(self) -> None:
        """Enumerate the devices again (every REDISCOVER_EVERY_SECONDS by itself, or sooner for an unplaced name);
        keeps the old list on failure."""
        self._last_discovery = self._clock()
        try:
            async with asyncio.timeout(self._read_timeout):
                devices = list(await asyncio.to_thread(self._collector.discover))
        except Exception as error:  # noqa: BLE001 - whatever discovery raised, keep the devices we know
            # Keep sampling the devices we know; a failed re-discovery is not a failed GPU.
            log.warning("gpu_rediscovery_failed", error=repr(error))
            return
        if devices != self._devices:
            log.info("gpus_changed", before=[g.uuid for g in self._devices], after=[g.uuid for g in devices])
            self._devices = devices


def _missing(gpu: GpuIdentity, node: str, kind: ReadErrorKind, detail: str) -> GpuSample:
    return GpuSample(gpu=gpu, node=node, errors=(ReadError(DEVICE_FIELD, kind, detail),))


def _consume(future: asyncio.Future[GpuSample]) -> None:
    if not future.cancelled():
        future.exception()
