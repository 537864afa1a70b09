"""When each failing reading was last read: stamped on its ReadError by the poll loop, sent with it on the wire.

A lost GPU's error says "last read 14:02:07": the one fact an operator needs to match it with a kernel log or
an Xid. The agent stamps it, not whoever evaluates, because only the agent has seen every tick since it
started; a gateway keeps a node's newest snapshot only, and would answer "never" for a GPU its agent read a
minute ago.
"""

from __future__ import annotations

from collections.abc import Sequence

from gpuscaler.model.samples import DEVICE_FIELD, GpuSample, ReadErrorKind


class LastReads:
    """Remembers, per GPU, when each of its failing fields (or the whole device) last read fine."""

    __slots__ = ("_failing", "_previous")

    def __init__(self) -> None:
        # GPU UUID -> its fields failing on the previous tick -> when each last read fine (None: not since start).
        self._failing: dict[str, dict[str, float | None]] = {}
        self._previous: tuple[float, frozenset[str]] | None = None  # the previous tick and the GPUs it sampled

    def stamp(self, samples: Sequence[GpuSample], taken_at: float) -> list[GpuSample]:
        """``samples`` of the tick ``taken_at``, each error carrying when its field last read fine."""
        failing_now: dict[str, dict[str, float | None]] = {}
        stamped = [self._stamp(sample, failing_now) if sample.errors else sample for sample in samples]
        self._failing = failing_now
        self._previous = (taken_at, frozenset(sample.gpu.uuid for sample in samples))
        return stamped

    def _stamp(self, sample: GpuSample, failing_now: dict[str, dict[str, float | None]]) -> GpuSample:
        before = self._failing.get(sample.gpu.uuid, {})
        failing: dict[str, float | None] = {}
        if any(error.field == DEVICE_FIELD for error in sample.errors):
            failing.update(before)  # nothing was read this tick: what failed before last read when it did
        for error in sample.errors:
            if error.kind is ReadErrorKind.NOT_SUPPORTED:
                continue  # never read, and never will be: there is no "last read" to tell
            if error.field in before:
                failing[error.field] = before[error.field]
            elif DEVICE_FIELD in before:
                failing[error.field] = before[DEVICE_FIELD]  # read, at best, when the whole GPU last answered
            elif self._previous is not None and sample.gpu.uuid in self._previous[1]:
                failing[error.field] = self._previous[0]  # it read fine on the tick before this one
            else:
                failing[error.field] = None
        failing_now[sample.gpu.uuid] = failing
        errors = tuple(
            error if error.kind is ReadErrorKind.NOT_SUPPORTED else error._replace(last_read_at=failing[error.field])
            for error in sample.errors
        )
        return sample._replace(errors=errors)
