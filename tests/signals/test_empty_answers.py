"""The ScaledObjects answered 0 for a selection of nothing: said once each, looked into again, forgotten when gone."""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

import structlog

from gpuscaler.query.query import PodSelection
from gpuscaler.signals.empty_answers import RECHECK_SECONDS, EmptyAnswers, Key
from gpuscaler.signals.empty_selection import Seen
from gpuscaler.signals.outcome import Evaluation, ListedContributions
from tests.signals.test_empty_selection import NAMES, Remembering
from tests.signals.test_evaluation_workloads import parse

TYPO: Key = ("ml", "typo-so", "gpuscaler-gpu_utilization")
SLEEPER: Key = ("ml", "sleeper-so", "gpuscaler-gpu_utilization")


class Clock:
    """A monotonic clock the test moves."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def answer(workload: str | None) -> Evaluation:
    """The evaluation KEDA is answered from: 0 for a selection of ``workload`` whose pods hold no GPU, or (None) a
    value with pods."""
    query = parse(workload=workload or "trainer").value
    unmatched = PodSelection(namespace="ml", workload=workload) if workload is not None else None
    return Evaluation(query, ListedContributions(()), 0.0 if workload else 150.0, None, None, unmatched=unmatched)


def said(logged: list[MutableMapping[str, Any]], event: str) -> list[MutableMapping[str, Any]]:
    """The log events named ``event``."""
    return [entry for entry in logged if entry["event"] == event]


def test_each_scaled_object_is_said_once_however_often_keda_asks() -> None:
    """Polls every 30 s for an hour: one warning per ScaledObject, naming it and the close name."""
    clock = Clock()
    answers = EmptyAnswers(NAMES, clock=clock)
    with structlog.testing.capture_logs() as logged:
        for _ in range(120):
            answers.observe(TYPO, answer("trainr"))
            answers.observe(SLEEPER, answer("sleeper"))
            clock.now += 30.0
    warnings = said(logged, "selection_matches_nothing")
    assert [(w["scaled_object"], w["workload_seen"]) for w in warnings] == [
        ("ml/typo-so", "no"),
        ("ml/sleeper-so", "yes"),
    ]
    assert warnings[0]["did_you_mean"] == ["trainer"]
    assert {key: finding.seen for key, finding in answers.findings()} == {TYPO: Seen.NO, SLEEPER: Seen.YES}


def test_between_rechecks_the_directory_is_not_read() -> None:
    """Within RECHECK_SECONDS an answer costs a look-up: the pods that appear are seen at the next recheck."""
    clock = Clock()
    directory = Remembering(seen={})
    reads = 0
    pods = directory.pods

    def counted(namespace: str) -> list[Any]:
        nonlocal reads
        reads += 1
        return pods(namespace)

    directory.pods = counted  # type: ignore[method-assign]
    answers = EmptyAnswers(directory, clock=clock)
    answers.observe(TYPO, answer("trainr"))
    first = reads  # the look, and the names it may have meant for the log
    for _ in range(10):
        clock.now += RECHECK_SECONDS / 20
        answers.observe(TYPO, answer("trainr"))
    assert reads == first
    clock.now += RECHECK_SECONDS
    answers.observe(TYPO, answer("trainr"))
    assert reads == first + 1  # the recheck looks again; the finding is the same, so the log stays quiet


def test_an_answer_with_pods_or_an_error_clears_the_scaled_object_and_says_so() -> None:
    """Once the selection matches (or the answer is an error), the series goes and the log says it matches again."""
    answers = EmptyAnswers(NAMES, clock=Clock())
    answers.observe(TYPO, answer("trainr"))
    with structlog.testing.capture_logs() as logged:
        answers.observe(TYPO, answer(None))
    assert list(answers.findings()) == []
    assert [entry["scaled_object"] for entry in said(logged, "selection_matches_again")] == ["ml/typo-so"]


def test_a_scaled_object_keda_stopped_asking_about_is_forgotten() -> None:
    """Ten minutes without a call (a deleted ScaledObject) and the entry is gone; the cap keeps the newest."""
    clock = Clock()
    answers = EmptyAnswers(NAMES, clock=clock, max_entries=2)
    for name in ("a", "b", "c"):
        answers.observe(("ml", name, "m"), answer("trainr"))
    assert [key[1] for key, _ in answers.findings()] == ["b", "c"]
    clock.now += 10 * 60.0 + 1
    assert list(answers.findings()) == []
    assert len(answers) == 0
