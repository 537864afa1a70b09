"""The record of ScaledObjects answered 0 for a selection of nothing: said once each, looked into again only when the
directory changed, kept through errors, bounded without churn, and forgotten when KEDA stops asking."""

from __future__ import annotations

from collections.abc import Collection, Iterator, MutableMapping
from contextlib import contextmanager
from typing import Any

import structlog

from gpuscaler.model.errors import Unavailable
from gpuscaler.model.pods import PodInfo
from gpuscaler.query.query import PodSelection
from gpuscaler.signals.empty_selection import Seen
from gpuscaler.signals.empty_selection_record import (
    EMPTY_SELECTION_IDLE_SECONDS,
    EmptySelectionRecord,
    Key,
)
from gpuscaler.signals.outcome import Evaluation, ListedContributions
from tests.signals.test_empty_selection import NAMES, Names, Remembering
from tests.signals.test_evaluation_workloads import parse

TYPO: Key = ("ml", "typo-so", "gpuscaler-gpu_utilization")
SLEEPER: Key = ("ml", "sleeper-so", "gpuscaler-gpu_utilization")
POLL = 30.0  # KEDA's default pollingInterval


class Clock:
    """A monotonic clock the test moves."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class CountingNames(Names):
    """A ``Names`` that counts the reads only the names a selection may have meant need."""

    def __init__(self, names: Names) -> None:
        super().__init__(names._seen)
        self.suggestion_reads = 0

    def workload_names(self, namespace: str) -> Collection[str]:
        self.suggestion_reads += 1
        return super().workload_names(namespace)


class Counting(Remembering):
    """NAMES' directory, counting how often its pods are read."""

    def __init__(self) -> None:
        super().__init__(seen={})
        self._pods = dict(NAMES._pods)
        assert isinstance(NAMES.seen_names, Names)
        self.seen_names = self.counted = CountingNames(NAMES.seen_names)
        self.reads = 0

    def pods(self, namespace: str) -> list[PodInfo]:
        self.reads += 1
        return super().pods(namespace)


def answer(workload: str | None) -> Evaluation:
    """The evaluation KEDA is answered from: 0 for a selection of ``workload`` whose pods hold no GPU, or (None) a
    value with pods."""
    query = parse(workload=workload or "trainer").value
    unmatched = PodSelection(namespace="ml", workload=workload) if workload is not None else None
    return Evaluation(query, ListedContributions(()), 0.0 if workload else 150.0, None, None, unmatched=unmatched)


def error() -> Evaluation:
    """An error answer for the same trigger: UNAVAILABLE, as when the gateway hears no agent of a node."""
    return Evaluation(parse(workload="trainr").value, ListedContributions(()), None, Unavailable("no node"), None)


def said(logged: list[MutableMapping[str, Any]], event: str) -> list[MutableMapping[str, Any]]:
    """The log events named ``event``."""
    return [entry for entry in logged if entry["event"] == event]


@contextmanager
def logs() -> Iterator[list[MutableMapping[str, Any]]]:
    """The log events made inside the block."""
    with structlog.testing.capture_logs() as logged:
        yield logged


def keda_round(record: EmptySelectionRecord, key: Key, evaluation: Evaluation) -> None:
    """KEDA's GetMetricsAndActivity for one trigger: GetMetrics, then IsActive, answered alike."""
    record.observe(key, evaluation)
    record.observe(key, evaluation)


def test_each_scaled_object_is_said_once_however_often_keda_asks() -> None:
    """Polls every 30 s for an hour: one warning for the typo, naming the close name; the workload at zero is the
    normal case, said once at debug without looking for names it may have meant."""
    clock = Clock()
    directory = Counting()
    record = EmptySelectionRecord(directory, clock=clock)
    with logs() as logged:
        for _ in range(120):
            keda_round(record, TYPO, answer("trainr"))
            keda_round(record, SLEEPER, answer("sleeper"))
            clock.now += POLL
    events = said(logged, "selection_matches_nothing")
    assert [(e["scaled_object"], e["seen"], e["log_level"]) for e in events] == [
        ("ml/typo-so", "no", "warning"),
        ("ml/sleeper-so", "yes", "debug"),
    ]
    assert events[0]["did_you_mean"] == ["trainer"]
    assert "did_you_mean" not in events[1]
    assert directory.counted.suggestion_reads == 1  # the typo's suggestions, once
    assert {key: finding.seen for key, finding in record.findings()} == {TYPO: Seen.NO, SLEEPER: Seen.YES}


def test_the_directory_is_read_again_only_when_the_namespace_changed() -> None:
    """Rounds over an unchanged directory cost look-ups; a change there is looked into at the next call, once."""
    clock = Clock()
    directory = Counting()
    record = EmptySelectionRecord(directory, clock=clock)
    keda_round(record, TYPO, answer("trainr"))
    first = directory.reads  # the look, and the names it may have meant for the log
    for _ in range(20):
        clock.now += POLL
        keda_round(record, TYPO, answer("trainr"))
    assert directory.reads == first
    directory.add(PodInfo("ml", "web-2", {"app": "web"}, "web", "Deployment"))
    with logs() as logged:
        keda_round(record, TYPO, answer("trainr"))
        keda_round(record, TYPO, answer("trainr"))
    assert directory.reads == first + 1  # the same finding, so the log stays quiet
    assert logged == []


def test_pods_that_appear_end_the_entry_at_the_next_answer_with_them() -> None:
    """Once the selection matches, the series goes and the log says it matches again, once."""
    record = EmptySelectionRecord(NAMES, clock=Clock())
    keda_round(record, TYPO, answer("trainr"))
    with logs() as logged:
        keda_round(record, TYPO, answer(None))
    assert list(record.findings()) == []
    assert [(e["scaled_object"], e["log_level"]) for e in said(logged, "selection_matches_again")] == [
        ("ml/typo-so", "info")
    ]


def test_an_error_answer_leaves_the_entry_as_it_is() -> None:
    """An agent not heard (UNAVAILABLE) says nothing of the pods: no "matches again", no fresh warning after it."""
    clock = Clock()
    record = EmptySelectionRecord(NAMES, clock=clock)
    with logs() as logged:
        keda_round(record, TYPO, answer("trainr"))
        for _ in range(3):
            clock.now += POLL
            keda_round(record, TYPO, error())
        clock.now += POLL
        keda_round(record, TYPO, answer("trainr"))
    assert [e["event"] for e in logged] == ["selection_matches_nothing"]
    assert [key for key, _ in record.findings()] == [TYPO]


def test_a_directory_that_cannot_tell_leaves_the_entry_as_it_is() -> None:
    """While the pod directory has a problem (the API silent), a changed namespace is not looked into again, and a
    new ScaledObject is not recorded: nothing reads as "matches"."""
    clock = Clock()
    directory = Counting()
    record = EmptySelectionRecord(directory, clock=clock)
    with logs() as logged:
        keda_round(record, TYPO, answer("trainr"))
        directory.fail("the pod watch has not heard the API for 61s")
        directory.add(PodInfo("ml", "web-2", {"app": "web"}, "web", "Deployment"))
        clock.now += POLL
        keda_round(record, TYPO, answer("trainr"))
        keda_round(record, SLEEPER, answer("sleeper"))
        directory.fail(None)
        clock.now += POLL
        keda_round(record, TYPO, answer("trainr"))
    assert [(e["event"], e["scaled_object"]) for e in logged] == [("selection_matches_nothing", "ml/typo-so")]
    assert [key for key, _ in record.findings()] == [TYPO]


def test_past_the_cap_the_entries_stay_and_the_rest_are_counted_not_said() -> None:
    """Six ScaledObjects polled for an hour with room for four: four said once each, one line that the record is
    full, the other two's answers counted; none pushed out while asked. A deleted one makes room for the next."""
    clock = Clock()
    record = EmptySelectionRecord(NAMES, clock=clock, max_entries=4)
    keys = [("ml", f"so-{n}", "m") for n in range(6)]
    with logs() as logged:
        for _ in range(120):
            for key in keys:
                keda_round(record, key, answer("trainr"))
            clock.now += POLL
    assert [e["scaled_object"] for e in said(logged, "selection_matches_nothing")] == [f"ml/so-{n}" for n in range(4)]
    assert [e["max_entries"] for e in said(logged, "selection_record_full")] == [4]
    assert record.unrecorded == 120 * 2 * 2
    assert [key for key, _ in record.findings()] == keys[:4]

    with logs() as logged:
        for _ in range(int(EMPTY_SELECTION_IDLE_SECONDS // POLL) + 2):  # so-0 is deleted: KEDA stops asking
            for key in keys[1:]:
                keda_round(record, key, answer("trainr"))
            clock.now += POLL
    assert [e["scaled_object"] for e in said(logged, "selection_matches_nothing")] == ["ml/so-4"]
    assert [key for key, _ in record.findings()] == keys[1:5]


def test_reading_the_findings_changes_nothing() -> None:
    """Past the idle time a scrape leaves the entry out, and keeps it until KEDA's next call is recorded."""
    clock = Clock()
    record = EmptySelectionRecord(NAMES, clock=clock)
    keda_round(record, TYPO, answer("trainr"))
    clock.now += EMPTY_SELECTION_IDLE_SECONDS + 1
    assert list(record.findings()) == []
    assert len(record) == 1
    record.observe(SLEEPER, answer(None))
    assert len(record) == 0


def test_an_edited_trigger_s_entry_goes_once_keda_asks_the_new_one_for_a_few_rounds() -> None:
    """workload trainr fixed to trainer: the metric name changes, and KEDA asks only the new one; the old entry goes
    within a few polling intervals, not the idle time, and the log says so."""
    clock = Clock()
    record = EmptySelectionRecord(NAMES, clock=clock)
    fixed: Key = ("ml", "typo-so", "gpuscaler-gpu_utilization-fixed")
    for _ in range(5):
        keda_round(record, TYPO, answer("trainr"))
        clock.now += POLL
    with logs() as logged:
        rounds = 0
        while list(record.findings()):
            keda_round(record, fixed, answer(None))
            clock.now += POLL
            rounds += 1
            assert rounds < 10
    assert 3 <= rounds <= 5
    assert [(e["event"], e["metric_name"]) for e in logged] == [("selection_no_longer_asked", TYPO[2])]


def test_a_live_trigger_stays_while_keda_asks_the_scaled_object_s_others_more_often() -> None:
    """Two triggers of one ScaledObject polled every 60 s: the HPA asks the other one every 15 s between rounds (the
    first one's metric cached), and KEDA pauses for five minutes (a restart); the trigger KEDA still asks in each of
    its rounds stays, said once."""
    clock = Clock()
    record = EmptySelectionRecord(NAMES, clock=clock)
    other: Key = ("ml", "typo-so", "gpuscaler-other")
    with logs() as logged:
        for tick in range(80):
            if tick % 4 == 0:
                keda_round(record, TYPO, answer("trainr"))
                keda_round(record, other, answer(None))
            else:
                keda_round(record, other, answer(None))  # the HPA's path: KEDA's cache answers for the first
            clock.now += 15.0
            if tick == 40:  # KEDA restarts; its first round asks the other trigger first
                clock.now += 300.0
                keda_round(record, other, answer(None))
                keda_round(record, TYPO, answer("trainr"))
    assert [e["event"] for e in logged] == ["selection_matches_nothing"]
    assert [key for key, _ in record.findings()] == [TYPO]
