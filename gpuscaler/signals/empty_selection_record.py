"""The record, fed by KEDA's calls, of the ScaledObjects answered 0 because their selection matches no pod: a log line
each, and what the gauge gpuscaler_gateway_selection_empty reads.

The finding is ``empty_selection.py``'s, pure; this module decides when to make one and keeps what was found, by
(namespace, ScaledObject, metric name). It is fed where KEDA's GetMetrics and IsActive are answered (through
``Evaluator.value``), never by Explain, a preview (``gpuscaler query``) or a scrape, which only read it.

What a call costs: an answer that selects pods, with nothing recorded for its ScaledObject, costs a dictionary
look-up. A selection that matched nothing is looked into (``find_empty``: the namespace's pods and the names
remembered there) when it is new, when the selection changed, or when the directory's version of the namespace
moved since the last look; otherwise its entry is only marked asked. The log says each entry once, and again only
when what it says changes (the selection, or whether its name was seen): a warning, with the names it may have meant,
when the name was never seen or the selection names no workload; at debug for a workload at zero replicas (seen yes),
the normal case, which thousands of ScaledObjects may be in at once.

An entry stays as it is through an error answer (an agent not heard, the pod directory unable to tell): only an
answer with pods ends it. It goes ``idle_seconds`` after KEDA last asked for it (a deleted ScaledObject), or once
KEDA asks the same ScaledObject's other triggers but not its own for ``REPLACED_AFTER_ROUNDS`` rounds (an edited
trigger: its metric name holds a hash of the selection). At most ``max_entries`` are kept; past that, idle ones make
room, and a new ScaledObject is neither recorded nor logged while none is idle (``unrecorded`` counts those answers).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass

import structlog

from gpuscaler.model.pods import PodDirectory
from gpuscaler.query.query import PodSelection
from gpuscaler.signals.empty_selection import EmptySelection, Seen, find_empty, unmatched_of
from gpuscaler.signals.outcome import Evaluation

log = structlog.get_logger(__name__)

# As the per-ScaledObject answer series (server/telemetry.py): past KEDA's polling interval, not a deleted one's life.
EMPTY_SELECTION_IDLE_SECONDS = 10 * 60.0
# A few hundred bytes an entry.
EMPTY_SELECTION_ENTRIES = 5000
# KEDA asks a trigger with GetMetrics and then IsActive, and a ScaledObject's triggers one after another: calls for a
# ScaledObject closer together than this are one polling round (KEDA's shortest pollingInterval is 1 s).
ROUND_SECONDS = 0.5
# KEDA asks every trigger of a ScaledObject in each polling round. An entry whose metric name KEDA has not asked while
# it asked the ScaledObject's other metric names in more than REPLACED_AFTER_OTHER_ROUNDS rounds (the first may be the
# round this one was asked in), and for more than REPLACED_AFTER_ROUNDS times the longest it ever waited between two
# rounds of its own, is a trigger that is gone. Rounds alone are not enough, as the HPA asks some metrics between
# rounds; time alone is not, as KEDA restarting makes every trigger wait.
REPLACED_AFTER_ROUNDS = 3
REPLACED_AFTER_OTHER_ROUNDS = 2

Key = tuple[str, str, str]  # the ScaledObject's namespace and name, the trigger's metric name


@dataclass(slots=True)
class _Entry:
    selection: PodSelection
    finding: EmptySelection | None  # None: looked into, and a pod matches (it holds no GPU yet)
    version: Hashable  # the directory's version of the selection's namespace when looked into
    asked: float  # when KEDA last asked for it
    longest_round: float = 0.0  # the longest time between two of its rounds; 0 until its second round
    other_rounds: int = 0  # rounds in which KEDA asked the ScaledObject's other metric names since it asked this one
    other_asked: float = float("-inf")


class EmptySelectionRecord:
    """By (namespace, ScaledObject, metric name): the finding for KEDA's answer of 0 whose selection matched no pod."""

    def __init__(
        self,
        directory: PodDirectory,
        *,
        clock: Callable[[], float],
        idle_seconds: float = EMPTY_SELECTION_IDLE_SECONDS,
        max_entries: int = EMPTY_SELECTION_ENTRIES,
    ) -> None:
        self._directory = directory
        self._clock = clock
        self._idle_seconds = idle_seconds
        self._max_entries = max_entries
        self._entries: OrderedDict[Key, _Entry] = OrderedDict()  # the least recently asked first
        self._metric_names: dict[tuple[str, str], set[str]] = {}  # by ScaledObject: the metric names with an entry
        # KEDA's answers of a selection that matched no GPU-holding pod, for a ScaledObject not recorded: full.
        self.unrecorded = 0
        self._said_full = False

    def __len__(self) -> int:
        return len(self._entries)

    def observe(self, key: Key, evaluation: Evaluation) -> None:
        """KEDA was answered ``evaluation`` for this ScaledObject's trigger."""
        selection = unmatched_of(evaluation)
        if selection is None and not self._entries:
            return
        now = self._clock()
        self._forget_idle(now)
        names = self._metric_names.get((key[0], key[1]))
        if names is not None and (len(names) > 1 or key[2] not in names):
            self._others_asked(key, names, now)
        entry = self._entries.get(key)
        if entry is not None:
            self._asked(key, entry, now)
        if selection is None:
            if entry is not None and evaluation.error is None:
                self._drop(key)
                if entry.finding is not None:
                    _said_after(entry.finding, "selection_matches_again", key)
            return  # an error answer says nothing of the pods: whatever was found stays
        if entry is None and len(self._entries) >= self._max_entries:
            self._unrecorded()  # none idle (``_forget_idle`` dropped those): recording it would push out one in use
            return
        directory = self._directory
        version = directory.version(selection.namespace)
        if entry is not None and entry.selection == selection and entry.version == version:
            return
        if directory.problem() is not None:
            return  # the directory cannot tell now: whatever was found stays
        finding = find_empty(selection, directory, suggest=False)
        said = entry.finding if entry is not None else None
        if entry is None:
            self._entries[key] = _Entry(selection, finding, version, now)
            self._metric_names.setdefault((key[0], key[1]), set()).add(key[2])
        else:
            entry.selection, entry.finding, entry.version = selection, finding, version
        if finding is not None and (said is None or (said.selection, said.seen) != (finding.selection, finding.seen)):
            self._say(key, finding, selection)
        elif finding is None and said is not None:
            _said_after(said, "selection_matches_again", key)

    def findings(self) -> Iterator[tuple[Key, EmptySelection]]:
        """Each ScaledObject's trigger whose selection matches no pod, as last looked into; idle ones left out.

        Only reads: entries are forgotten where KEDA's calls are recorded."""
        oldest = self._clock() - self._idle_seconds
        for key, entry in self._entries.items():
            if entry.finding is not None and entry.asked >= oldest:
                yield key, entry.finding

    def _say(self, key: Key, finding: EmptySelection, selection: PodSelection) -> None:
        scaled_object, metric_name = f"{key[0]}/{key[1]}", key[2]
        if finding.seen is Seen.YES:  # a workload at zero replicas: what 0 is for
            log.debug(
                "selection_matches_nothing",
                scaled_object=scaled_object,
                metric_name=metric_name,
                selection=finding.selection,
                seen=finding.seen.value,
                detail=finding.describe(),
            )
            return
        finding = find_empty(selection, self._directory) or finding  # with the names it may have meant
        log.warning(
            "selection_matches_nothing",
            scaled_object=scaled_object,
            metric_name=metric_name,
            selection=finding.selection,
            seen=finding.seen.value,
            did_you_mean=list(finding.did_you_mean) or None,
            did_you_mean_elsewhere=list(finding.did_you_mean_elsewhere) or None,
            namespace_did_you_mean=list(finding.namespace_did_you_mean) or None,
            seen_in_namespaces=list(finding.seen_in_namespaces) or None,
            detail=finding.describe(),
        )

    def _asked(self, key: Key, entry: _Entry, now: float) -> None:
        waited = now - entry.asked
        if waited >= ROUND_SECONDS and waited > entry.longest_round:
            entry.longest_round = waited
        entry.asked = now
        entry.other_rounds = 0
        self._entries.move_to_end(key)

    def _others_asked(self, key: Key, names: set[str], now: float) -> None:
        """KEDA asked ``key``: the ScaledObject's entries under other metric names count a round, or are gone."""
        for name in [name for name in names if name != key[2]]:
            other = (key[0], key[1], name)
            entry = self._entries[other]
            if now - entry.other_asked >= ROUND_SECONDS:
                entry.other_rounds += 1
                entry.other_asked = now
            if (
                entry.other_rounds > REPLACED_AFTER_OTHER_ROUNDS
                and entry.longest_round > 0
                and now - entry.asked > REPLACED_AFTER_ROUNDS * entry.longest_round
            ):
                self._drop(other)
                if entry.finding is not None:
                    _said_after(entry.finding, "selection_no_longer_asked", other)

    def _unrecorded(self) -> None:
        self.unrecorded += 1
        if not self._said_full:
            self._said_full = True
            log.warning(
                "selection_record_full",
                max_entries=self._max_entries,
                detail=(
                    "so many ScaledObjects' selections match nothing that new ones are neither recorded nor logged "
                    "until one has gone unasked for the idle time; gpuscaler_gateway_selection_empty_unrecorded_total "
                    "counts KEDA's answers for them"
                ),
            )

    def _forget_idle(self, now: float) -> None:
        entries = self._entries
        oldest = now - self._idle_seconds
        while entries:
            key, entry = next(iter(entries.items()))  # asked least recently: entries move to the end when asked
            if entry.asked >= oldest:
                return
            self._drop(key)

    def _drop(self, key: Key) -> None:
        del self._entries[key]
        scaled_object = (key[0], key[1])
        names = self._metric_names[scaled_object]
        names.discard(key[2])
        if not names:
            del self._metric_names[scaled_object]


def _said_after(finding: EmptySelection, event: str, key: Key) -> None:
    """The end of what was logged for ``key``, at the level it was said at (a workload at zero: debug)."""
    say = log.debug if finding.seen is Seen.YES else log.info
    say(event, scaled_object=f"{key[0]}/{key[1]}", metric_name=key[2])
