"""One pod's engine signal from its newest scrapes: a gauge as read, or a counter's increase between two pages.

A gauge's label sets combine as its signal says (``label_sets``): a queue is the sum of its label sets', a usage
share their mean (a pod's two data-parallel engines at 50% and 70% make 60%).

A counter that went down was reset (the engine restarted): its increase is its new value, as Prometheus'
``rate()`` takes it, so a restart never gives a negative or a spike. A page older than ``stale_after`` is
not an answer; a value no engine gives (NaN, infinite, negative, past its bound) never gets this far
(``gateway/engines/page.py``), and a rate or a ratio that is not a number, or past its signal's bound, is no
answer either: the pod is unread, named with why.
"""

from __future__ import annotations

import math

from gpuscaler.model.engines import EnginePage, EngineSignal, LabelSets, PodScrape, SignalKind


def signal_value(signal: EngineSignal, scrape: PodScrape | None, *, now: float, stale_after: float) -> float | str:
    """The pod's value of ``signal`` now, or why it has none."""
    if scrape is None or (scrape.page is None and scrape.error is None):
        return "not read yet"
    if scrape.error is not None:
        return f"{scrape.endpoint}: {scrape.error}"
    page = scrape.page
    assert page is not None
    age = now - page.at
    if age > stale_after:
        return f"{scrape.endpoint}: last read {age:.1f}s ago, older than {stale_after:g}s"
    current = _series(signal, page)
    if isinstance(current, str):
        return f"{scrape.endpoint}: {current}"
    if signal.kind is SignalKind.GAUGE:
        return _checked(signal, current * signal.scale, scrape.endpoint)
    if scrape.previous is None:
        return f"{scrape.endpoint}: {signal.kind.value} of counters needs two scrapes, and there has been one"
    before = _series(signal, scrape.previous)
    if isinstance(before, str):
        return "not read twice yet"
    increase = _increase(before, current)
    seconds = page.at - scrape.previous.at
    if signal.kind is SignalKind.RATE:
        return _checked(signal, increase / seconds * signal.scale if seconds > 0 else 0.0, scrape.endpoint)
    assert signal.per is not None
    per_now, per_before = page.values.get(signal.per), scrape.previous.values.get(signal.per)
    if per_now is None or per_before is None:
        return f"{scrape.endpoint}: its page has no {signal.per}"
    finished = _increase(per_before, per_now)
    return _checked(signal, increase / finished * signal.scale if finished > 0 else signal.idle, scrape.endpoint)


def _checked(signal: EngineSignal, value: float, endpoint: str) -> float | str:
    """``value``, or why it is no answer: not a number (an increase of 1e308 over a millisecond), or past the
    signal's bound. A gauge's bound is per label set and was checked on the page; its sum is only finite, and its
    mean within the bound."""
    if not math.isfinite(value):
        return f"{endpoint}: its {signal.kind.value} of {signal.series[0]} is {value}, which no engine reports"
    if signal.kind is not SignalKind.GAUGE and value > signal.bound:
        return (
            f"{endpoint}: its {signal.kind.value} of {signal.series[0]} is {value:g} {signal.unit}, past the "
            f"{signal.bound:g} {signal.unit} a pod can honestly read (docs/engines.md)"
        )
    return value


def _series(signal: EngineSignal, page: EnginePage) -> float | str:
    for name in signal.series:
        value = page.values.get(name)
        if value is None:
            continue
        if signal.label_sets is LabelSets.SUM:
            return value
        count = page.counts.get(name, 0)
        if count < 1:
            return f"its page does not say how many label sets {name} has, and its value is their mean"
        return value / count
    return f"its page has no {' or '.join(signal.series)}: is it a {signal.engine.value} pod?"


def _increase(before: float, after: float) -> float:
    return after - before if after >= before else after  # a reset: it counted from 0 since
