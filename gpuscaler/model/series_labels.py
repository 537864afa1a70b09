"""Which label sets of a series a signal reads, and which of its labels names the pool a label set is of."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SeriesLabels:
    """What a page reader does with one series' labels: which label names its pool, which label sets it keeps."""

    pool: str | None = None
    keep: tuple[tuple[str, frozenset[str]], ...] = ()

    def kept(self, labels: Mapping[str, str]) -> bool:
        """Whether a label set of the series counts."""
        return all(labels[label] in allowed for label, allowed in self.keep if label in labels)
