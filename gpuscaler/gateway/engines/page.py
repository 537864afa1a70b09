"""An engine's metrics page to the values its signals read: a prefilter by name, then Prometheus' own parser.

A vLLM page runs to hundreds of kB of histograms, of which the signals read a few lines. One regular
expression pass keeps those lines (and their TYPE lines); prometheus-client's parser reads only them.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable

from prometheus_client.parser import text_string_to_metric_families

from gpuscaler.model.engines import EnginePage

COUNTER_SUFFIX = "_total"


class MalformedPage(ValueError):
    """The page is not Prometheus text, or a series the signals read has a value no engine gives."""


def prefilter(names: Iterable[str]) -> re.Pattern[bytes]:
    """A pattern that matches the sample and TYPE lines of ``names``, and nothing else."""
    alternatives = b"|".join(re.escape(name.encode()) for name in sorted(names, key=len, reverse=True))
    return re.compile(rb"^(?:# TYPE )?(?:" + alternatives + rb")(?:[{ \t][^\n]*)?$", re.MULTILINE)


def read_page(body: bytes, wanted: re.Pattern[bytes], *, at: float) -> EnginePage:
    """The summed value of each wanted series on ``body``, counters under their family's name."""
    kept = b"\n".join(match.group(0) for match in wanted.finditer(body))
    try:
        text = kept.decode("utf-8")
        families = list(text_string_to_metric_families(text + "\n"))
    except (UnicodeDecodeError, ValueError, IndexError) as error:
        raise MalformedPage(f"not Prometheus text: {str(error)[:160]}") from None
    values: dict[str, float] = {}
    for family in families:
        for sample in family.samples:
            name = sample.name
            if family.type in ("histogram", "summary", "gaugehistogram"):
                continue  # its _bucket/_sum/_count samples under a kept name
            if name.endswith(COUNTER_SUFFIX) and family.type in ("counter", "unknown"):
                name = name[: -len(COUNTER_SUFFIX)]  # a counter, however the page spelled it
            value = sample.value
            if math.isnan(value) or math.isinf(value) or value < 0:
                raise MalformedPage(f"{sample.name} is {value}, which no engine reports")
            values[name] = values.get(name, 0.0) + value
    return EnginePage(at=at, values=values)
