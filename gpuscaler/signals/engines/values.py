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


def signal_value(
    signal: EngineSignal, scrape: PodScrape | None, *, now: float, stale_after: float, pool: str | None = None
) -> float | str:
    """The pod's value of ``signal`` now, or why it has none; ``pool`` keeps a pool-labelled signal's label sets of
    that pool alone (``EngineSignal.pool_label``)."""
    if scrape is None or (scrape.page is None and scrape.error is None):
        return "not read yet"
    if scrape.error is not None:
        return f"{scrape.endpoint}: {scrape.error}"
    page = scrape.page
    assert page is not None
    age = now - page.at
    if age > stale_after:
        return f"{scrape.endpoint}: last read {age:.1f}s ago, older than {stale_after:g}s"
    pool = pool if signal.pool_label is not None else None
    current = _series(signal, page, pool)
    if isinstance(current, str):
        return f"{scrape.endpoint}: {current}"
    name, value = current
    if signal.kind is SignalKind.GAUGE:
        return _checked(signal, value * signal.scale, scrape.endpoint)
    if scrape.previous is None:
        return f"{scrape.endpoint}: {signal.kind.value} of counters needs two scrapes, and there has been one"
    before = _series(signal, scrape.previous, pool, name)
    if isinstance(before, str):
        return "not read twice yet"
    increase = _increase(before[1], value)
    seconds = page.at - scrape.previous.at
    if signal.kind is SignalKind.RATE:
        return _checked(signal, increase / seconds * signal.scale if seconds > 0 else 0.0, scrape.endpoint)
    per = signal.per_of(name) if name is not None else None
    assert per is not None or signal.kind is SignalKind.MEAN
    per_now = _counted(signal, page, per, pool) if per is not None else 0.0
    per_before = _counted(signal, scrape.previous, per, pool) if per is not None else 0.0
    if per_now is None or per_before is None:
        return f"{scrape.endpoint}: its page has no {per}"
    finished = _increase(per_before, per_now)
    if finished > 0:
        return _checked(signal, increase / finished * signal.scale, scrape.endpoint)
    waiting = _waiting(signal, page, pool)
    if waiting > 0:
        return (
            f"{scrape.endpoint}: {waiting:g} requests wait and none left the queue since the last read, so their wait "
            "is unknown, not 0 (their number is the queue signal)"
        )
    return signal.idle


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


def _named(page: EnginePage, name: str, pool: str | None) -> float | None:
    """One series' value on ``page``, of ``pool``'s label sets where one is named; None where the page has none."""
    if pool is None or name not in page.pools:
        return page.values.get(name)
    found = page.pools[name].get(pool)
    return found[0] if found is not None else None


def _series(
    signal: EngineSignal, page: EnginePage, pool: str | None, only: str | None = None
) -> tuple[str | None, float] | str:
    """The series read (the first of ``signal.read`` on the page, or ``only``) and its value; (None, 0) where the
    page shows the engine would count it and has none yet; or why there is no value."""
    for name in signal.read if only is None else (only,):
        if name not in page.values:
            continue
        if pool is None:
            value, count = page.values[name], page.counts.get(name, 0)
        else:
            of_pool = page.pools.get(name, {}).get(pool)
            if of_pool is None:
                others = ", ".join(sorted(repr(other) for other in page.pools.get(name, {}))[:3])
                return (
                    f"its {name} is of {signal.pool_label} {others}, not {pool!r}: it serves another pool, so select "
                    f"the pods of the EPP of {pool!r}"
                )
            value, count = of_pool
        if signal.label_sets is LabelSets.SUM:
            return name, value
        if count < 1:
            return f"its page does not say how many label sets {name} has, and its value is their mean"
        return name, value / count
    if _counts(signal, page, pool):
        # Nothing was ever counted (a Prometheus vector shows a label set once it is first set); on the page before,
        # the series read now was not there yet: it counted from 0.
        return only, 0.0
    for_pool = f" of {signal.pool_label} {pool!r}" if pool is not None else ""
    return f"its page has no {' or '.join(signal.read)}{for_pool}: is it a {signal.engine.value} pod?"


def _counts(signal: EngineSignal, page: EnginePage, pool: str | None) -> bool:
    """Whether ``page`` shows its engine would count ``signal`` (``zero_when_absent_with``)."""
    return any(_named(page, marker, pool) is not None for marker in signal.zero_when_absent_with)


def _counted(signal: EngineSignal, page: EnginePage, name: str, pool: str | None) -> float | None:
    """``name``'s value on ``page``, 0 where the page shows it would count it and has none yet, else None."""
    value = _named(page, name, pool)
    if value is None and _counts(signal, page, pool):
        return 0.0
    return value


def _waiting(signal: EngineSignal, page: EnginePage, pool: str | None) -> float:
    """What ``signal.busy_with`` gauges read on ``page``: the first found."""
    for name in signal.busy_with:
        value = _named(page, name, pool)
        if value is not None:
            return value
    return 0.0


def _increase(before: float, after: float) -> float:
    return after - before if after >= before else after  # a reset: it counted from 0 since
