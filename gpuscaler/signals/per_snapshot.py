"""What is computed once per snapshot (or per scrape) and kept until the next: the one cache of that shape.

An answer read from one snapshot holds while that snapshot is the newest: KEDA's polls, Explain and every push
stream of one tick reuse it, and the first look-up at a newer snapshot forgets it all at once. The key is what
moves when the answer may change: a snapshot's sequence, an engine source's generation.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")

_NONE_YET = object()


class PerSnapshot(Generic[K, V]):
    """Values kept for one snapshot: ``at`` a new key starts afresh, and ``on_forget`` sees what it drops."""

    __slots__ = ("_key", "_on_forget", "_values")

    def __init__(self, on_forget: Callable[[dict[K, V]], None] | None = None) -> None:
        """``on_forget``: called with the values kept for the last key (when any) as a new key replaces it."""
        self._key: Hashable = _NONE_YET
        self._values: dict[K, V] = {}
        self._on_forget = on_forget

    def kept(self, key: Hashable) -> Mapping[K, V]:
        """The values kept for ``key``, to read only: none unless ``key`` is the current one, which it leaves as it is
        (a read path's look-up: it neither forgets the last key's values nor starts a new key's)."""
        return self._values if key == self._key else {}

    @property
    def current(self) -> Mapping[K, V]:
        """The values kept for the current key, to read only."""
        return self._values

    def at(self, key: Hashable) -> dict[K, V]:
        """The values kept for ``key`` (a snapshot's sequence, a scrape's generation), to read and fill."""
        if key != self._key:
            forgotten, self._key, self._values = self._values, key, {}
            if forgotten and self._on_forget is not None:
                self._on_forget(forgotten)
        return self._values
