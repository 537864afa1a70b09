"""The one interface the poll loop reads GPUs through.

Every method blocks (NVML does), so the poll loop calls them from worker threads with a timeout.
A read never raises for a device problem: it returns a sample whose absent values carry errors.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from gpuscaler.model.samples import GpuIdentity, GpuSample


class CollectorUnavailable(Exception):
    """The collector cannot start at all; the message is one line that says what to do."""


class Collector(Protocol):
    """A source of GPU samples for one node."""

    @property
    def node(self) -> str: ...

    def open(self) -> None:
        """Initialise; raises CollectorUnavailable when there is nothing to read from."""

    def discover(self) -> Sequence[GpuIdentity]:
        """The devices to sample: whole GPUs, and MIG instances in place of a MIG-enabled GPU."""

    def read(self, gpu: GpuIdentity) -> GpuSample:
        """One sample of ``gpu``; unreadable values are None with a ReadError each."""

    def close(self) -> None:
        """Release the library; called once, after the last read."""
