"""A combined query: each signal asks for ``value / target`` replicas, and the answer is the most any asks for.

Any signal unknown makes the answer unknown: the others' largest is only a lower bound, and a lower bound
can scale in. A value over a target that is not a finite number (a huge value over a tiny target) is unknown too.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from gpuscaler.model.errors import Unavailable
from gpuscaler.query.query import CombinedQuery, SingleQuery
from gpuscaler.signals.outcome import Evaluation, ListedContributions


def evaluate_combined(query: CombinedQuery, evaluate: Callable[[SingleQuery], Evaluation]) -> Evaluation:
    """Each of ``query``'s signals by ``evaluate``, then the largest replica count they ask for."""
    parts = tuple(evaluate(part.query) for part in query.signals)
    snapshot = next((part.snapshot for part in parts if part.snapshot is not None), None)
    failures = [(part, evaluation) for part, evaluation in zip(query.signals, parts, strict=True) if evaluation.error]
    if failures:
        part, evaluation = failures[0]
        assert evaluation.error is not None
        error = type(evaluation.error)(f"signal {part.query.metric.value}: {evaluation.error.message}")
        if len(failures) > 1:
            error = type(error)(f"{error.message} (and {len(failures) - 1} more signal(s) unknown)")
        return Evaluation(query, ListedContributions(()), None, error, snapshot, parts=parts)
    asked = [
        evaluation.value / part.target
        for part, evaluation in zip(query.signals, parts, strict=True)
        if evaluation.value is not None
    ]
    if len(asked) != len(parts):  # pragma: no cover - an evaluation has a value or an error
        return Evaluation(query, ListedContributions(()), None, Unavailable("a signal has no value"), snapshot)
    for part, ratio in zip(query.signals, asked, strict=True):
        if not math.isfinite(ratio):
            error = Unavailable(
                f"signal {part.query.metric.value}: its value over its target {part.target:g} is {ratio}, not a number"
            )
            return Evaluation(query, ListedContributions(()), None, error, snapshot, parts=parts)
    return Evaluation(query, ListedContributions(()), max(asked), None, snapshot, parts=parts)
