"""The ScaledObjects KEDA is answered 0 for because their selection matches no pod: logged once each, kept for /metrics.

Fed from where KEDA's calls are answered (GetMetrics and IsActive, through ``Evaluator.value``), never from
Explain. An answer that selects pods the common way costs a dictionary look-up here; a selection that matches
nothing is looked into (``empty_selection.find_empty``: one pass over the namespace's pods, and look-ups in the
names the directory remembers) at most every ``RECHECK_SECONDS`` per ScaledObject and trigger. The log says it
once per ScaledObject and trigger, and again only when what it says changes (the selection, or whether its name
was seen); only then are the names it may have meant looked for. An entry lives ``idle_seconds``
after the last call for it (KEDA polls every 30 s, so a deleted ScaledObject's entry goes), at most
``max_entries`` of them, the least recently asked first out.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import structlog

from gpuscaler.model.pods import PodDirectory
from gpuscaler.query.query import PodSelection
from gpuscaler.signals.empty_selection import EmptySelection, find_empty, unmatched_of
from gpuscaler.signals.outcome import Evaluation

log = structlog.get_logger(__name__)

# A ScaledObject whose selection matched nothing is looked into again after this long: pods that appear without a GPU
# yet (Pending) make it match, and leave the answer 0.
RECHECK_SECONDS = 30.0
# As the per-ScaledObject answer series (server/telemetry.py): past KEDA's polling interval, not a deleted one's life.
EMPTY_ANSWER_IDLE_SECONDS = 10 * 60.0
EMPTY_ANSWER_ENTRIES = 5000

Key = tuple[str, str, str]  # the ScaledObject's namespace and name, the trigger's metric name


@dataclass(slots=True)
class _Entry:
    selection: PodSelection
    finding: EmptySelection | None  # None: checked, and a pod matches (it holds no GPU yet)
    checked: float
    asked: float


class EmptyAnswers:
    """By (namespace, ScaledObject, metric name): the finding for an answer of 0 whose selection matched no pod."""

    def __init__(
        self,
        directory: PodDirectory | None,
        *,
        clock: Callable[[], float],
        recheck_seconds: float = RECHECK_SECONDS,
        idle_seconds: float = EMPTY_ANSWER_IDLE_SECONDS,
        max_entries: int = EMPTY_ANSWER_ENTRIES,
    ) -> None:
        self._directory = directory
        self._clock = clock
        self._recheck_seconds = recheck_seconds
        self._idle_seconds = idle_seconds
        self._max_entries = max_entries
        self._entries: OrderedDict[Key, _Entry] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def observe(self, key: Key, evaluation: Evaluation) -> None:
        """KEDA was answered ``evaluation`` for this ScaledObject's trigger."""
        selection = unmatched_of(evaluation)
        if selection is None:
            if self._entries:
                entry = self._entries.pop(key, None)
                if entry is not None and entry.finding is not None:
                    log.info("selection_matches_again", scaled_object=f"{key[0]}/{key[1]}", metric_name=key[2])
            return
        now = self._clock()
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
            entry.asked = now
            if entry.selection == selection and now - entry.checked < self._recheck_seconds:
                return
        finding = find_empty(selection, self._directory, suggest=False)
        said = entry.finding if entry is not None else None
        if entry is None:
            self._forget(now, room=True)
            entry = self._entries[key] = _Entry(selection, finding, now, now)
        else:
            entry.selection, entry.finding, entry.checked = selection, finding, now
        if finding is not None and (said is None or (said.selection, said.seen) != (finding.selection, finding.seen)):
            finding = find_empty(selection, self._directory) or finding  # the names it may have meant, for the log
            log.warning(
                "selection_matches_nothing",
                scaled_object=f"{key[0]}/{key[1]}",
                metric_name=key[2],
                selection=finding.selection,
                workload_seen=finding.seen.value,
                did_you_mean=list(finding.did_you_mean) or None,
                namespace_did_you_mean=list(finding.namespaces) or None,
                seen_in_namespaces=list(finding.seen_in) or None,
                detail=finding.describe(),
            )
        elif finding is None and said is not None:
            log.info("selection_matches_again", scaled_object=f"{key[0]}/{key[1]}", metric_name=key[2])

    def findings(self) -> Iterator[tuple[Key, EmptySelection]]:
        """Each ScaledObject's trigger whose selection matches no pod, as last looked into; the idle forgotten."""
        self._forget(self._clock())
        for key, entry in self._entries.items():
            if entry.finding is not None:
                yield key, entry.finding

    def _forget(self, now: float, *, room: bool = False) -> None:
        """Drop the idle entries and, to make ``room`` for one more, the least recently asked past the cap."""
        entries = self._entries
        keep = self._max_entries - 1 if room else self._max_entries
        while entries:
            key, entry = next(iter(entries.items()))  # asked least recently: entries move to the end when asked
            if now - entry.asked <= self._idle_seconds and len(entries) <= keep:
                return
            del entries[key]
