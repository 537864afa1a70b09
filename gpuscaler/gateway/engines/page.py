"""An engine's metrics page to the values its signals read: a prefilter by name, then Prometheus' own parser.

A vLLM page runs to hundreds of kB of histograms, of which the signals read a few lines. The prefilter finds
each wanted name with ``bytes.find`` (memchr-fast, where a regular expression walks every line: 4x the CPU on a
300 kB page) and keeps the sample and TYPE lines it starts; prometheus-client's parser reads only those.

What a page may cost is bounded before any per-line work: the prefilter takes the page a chunk at a time
(``PageFilter.feed``), never joins it, and refuses it (``TooManyLabelSets``) once a wanted series has more label
sets than ``max_label_sets``, or is named on more lines that are not its samples, and refuses as malformed a kept
line over ``MAX_LINE_BYTES`` or a second TYPE line of a name; the parser then reads at most that many lines per
series, ``PARSE_BATCH_BYTES`` of them at a time (``batches``), so that its caller can let the event loop run
between two (``page_reader.py`` says why there, and not in a thread or a process).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from gpuscaler.gateway.engines.limits import DEFAULT_SCRAPE_LIMITS
from gpuscaler.model.engines import EnginePage
from gpuscaler.model.series_labels import SeriesLabels

COUNTER_SUFFIX = "_total"
DEFAULT_MAX_LABEL_SETS = DEFAULT_SCRAPE_LIMITS.max_label_sets
# Text handed to the parser at once (its TYPE line and whole samples, so up to this plus two lines, 16 KiB): the
# parser's time goes with bytes, not lines (a line of 15 kB costs what 400 short ones do), about 2 ms for 8 KiB of
# short label sets (7-8 us each); the most one turn of the event loop spends parsing.
PARSE_BATCH_BYTES = 8 * 1024
# A kept line longer than this is no engine's: a label set of a Triton model (its name and version) or of a vLLM
# model (its name, a path or a repository id, at most a few hundred bytes) is under 1 kB. Checked on every kept line
# as it is found, and on the partial line carried from one chunk to the next, it bounds what one batch parses.
MAX_LINE_BYTES = 4 * 1024


class MalformedPage(ValueError):
    """The page is not Prometheus text, or a series the signals read has a value no engine gives."""


class TooManyLabelSets(ValueError):
    """A wanted series has more label sets on the page than ``--engine-max-label-sets`` allows."""


TYPE_PREFIX = b"# TYPE "
NEWLINE = 0x0A
# What may follow a series name on its own line: its labels, or the blank before its value.
NAME_ENDS = frozenset((b"{", b" ", b"\t"))


class Prefilter:
    """The series names one engine's signals read, with the most one label set of each may say (``bounds``) and
    what their labels mean (``labels``: which label sets count, and which label names a pool)."""

    def __init__(
        self,
        names: Iterable[str],
        bounds: Mapping[str, float] | None = None,
        labels: Mapping[str, SeriesLabels] | None = None,
    ) -> None:
        self._names = tuple(sorted({name.encode() for name in names}))
        self.bounds = dict(bounds or {})
        self.labels = dict(labels or {})
        # Every way a kept line can start; a partial line shorter than the longest cannot be told yet.
        self.starts = tuple(
            prefix + name + end for name in self._names for prefix in (b"", TYPE_PREFIX) for end in NAME_ENDS
        )
        self.head_bytes = max((len(start) for start in self.starts), default=0)

    @property
    def names(self) -> tuple[bytes, ...]:
        return self._names

    def filter(self, max_label_sets: int = DEFAULT_MAX_LABEL_SETS) -> PageFilter:
        """A fresh filter for one page."""
        return PageFilter(self, max_label_sets)

    def lines(self, body: bytes, max_label_sets: int = DEFAULT_MAX_LABEL_SETS) -> list[bytes]:
        """The kept lines of a whole page, each name's in the page's order (TYPE lines first)."""
        page = self.filter(max_label_sets)
        page.feed(body)
        return [line for kept in page.finish().values() for line in (kept.type_line, *kept.samples) if line]


@dataclass(slots=True)
class Kept:
    """One wanted name's lines on a page: its TYPE line and its samples, and how often it was named otherwise."""

    type_line: bytes = b""  # its one TYPE line, or none
    samples: list[bytes] = field(default_factory=list)
    mentions: int = 0  # lines that name it and are not its samples (HELP, TYPE, longer names, label values)


class PageFilter:
    """One page's wanted lines, kept as the page arrives a chunk at a time; ``TooManyLabelSets`` past the limit.

    It holds the kept lines and at most one partial line (``MAX_LINE_BYTES``), never the page. Its work is one
    ``bytes.find`` per wanted name per chunk, and Python's per-line work only for lines that name a wanted
    series, at most ``2 x max_label_sets`` per name before the page is refused.
    """

    def __init__(self, wanted: Prefilter, max_label_sets: int) -> None:
        self._wanted = wanted
        self._limit = max_label_sets
        self._kept = {name: Kept() for name in wanted.names}
        self._tail = b""  # the start of a line the last chunk did not end, where it may be kept
        self._skipping = False  # inside a line that cannot be kept, until its newline

    def feed(self, chunk: bytes) -> None:
        """Take the page's next bytes."""
        if self._skipping:
            end = chunk.find(b"\n")
            if end < 0:
                return
            self._skipping = False
            chunk = chunk[end + 1 :]
        data = self._tail + chunk if self._tail else chunk
        last = data.rfind(b"\n")
        if last >= 0:
            self._scan(data, last + 1)
        self._carry(data[last + 1 :])

    def finish(self) -> dict[bytes, Kept]:
        """Every wanted name's lines, the page's last line (with no newline) included."""
        if self._tail:
            self._scan(self._tail + b"\n", len(self._tail) + 1)
            self._tail = b""
        return self._kept

    def _carry(self, rest: bytes) -> None:
        if len(rest) < self._wanted.head_bytes or rest.startswith(self._wanted.starts):
            if len(rest) > MAX_LINE_BYTES:
                raise _long_line(rest[: self._wanted.head_bytes])
            self._tail = rest
        else:
            self._tail, self._skipping = b"", True

    def _scan(self, data: bytes, end: int) -> None:
        """Keep the wanted lines of ``data[:end]``, which starts a line and ends one."""
        limit = self._limit
        for name, kept in self._kept.items():
            start = 0
            while (found := data.find(name, start, end)) >= 0:
                after = found + len(name)
                line_end = data.find(b"\n", after, end)
                if data[after : after + 1] in NAME_ENDS and (found == 0 or data[found - 1] == NEWLINE):
                    if line_end - found > MAX_LINE_BYTES:
                        raise _long_line(data[found:after])
                    kept.samples.append(data[found:line_end])
                    if len(kept.samples) > limit:
                        raise TooManyLabelSets(
                            f"more than {limit} label sets of {name.decode()}, over the {limit} allowed"
                        )
                else:
                    kept.mentions += 1
                    if kept.mentions > limit:
                        raise TooManyLabelSets(
                            f"{name.decode()} named on more than {limit} lines that are not its samples, "
                            f"over the {limit} allowed"
                        )
                    line_start = found - len(TYPE_PREFIX)
                    if (
                        data[after : after + 1] in NAME_ENDS
                        and data[line_start:found] == TYPE_PREFIX
                        and (line_start == 0 or data[line_start - 1] == NEWLINE)
                    ):
                        if line_end - line_start > MAX_LINE_BYTES:
                            raise _long_line(data[line_start:after])
                        if kept.type_line:
                            raise MalformedPage(f"a second TYPE line of {name.decode()}; a name has one")
                        kept.type_line = data[line_start:line_end]
                # The rest of the line cannot start a kept line: on to the next.
                start = line_end + 1


def _long_line(head: bytes) -> MalformedPage:
    return MalformedPage(f"a line of {head!r}... is over {MAX_LINE_BYTES} bytes")


def prefilter(
    names: Iterable[str], bounds: Mapping[str, float] | None = None, labels: Mapping[str, SeriesLabels] | None = None
) -> Prefilter:
    """The prefilter of ``names``: build it once per engine, use it for every page."""
    return Prefilter(names, bounds, labels)


def batches(kept: Mapping[bytes, Kept]) -> Iterator[bytes]:
    """The kept lines as text for the parser, whole samples until a batch holds ``PARSE_BATCH_BYTES``, each batch
    with its name's TYPE line (a counter's samples are read as a counter in every batch)."""
    for lines in kept.values():
        head = (lines.type_line,) if lines.type_line else ()
        batch: list[bytes] = []
        size = 0
        for sample in lines.samples:
            batch.append(sample)
            size += len(sample) + 1
            if size >= PARSE_BATCH_BYTES:
                yield b"\n".join((*head, *batch, b""))
                batch, size = [], 0
        if batch:
            yield b"\n".join((*head, *batch, b""))


Pools = dict[str, dict[str, tuple[float, int]]]


def add_values(
    text: bytes, values: dict[str, float], counts: dict[str, int], wanted: Prefilter, pools: Pools | None = None
) -> None:
    """Add the samples of ``text`` (one batch) to ``values``, counters under their family's name, and count each
    series' label sets in ``counts`` (what a signal that averages them divides by); a label set its series' rule
    leaves out is not read, and a pool-labelled series' label sets are added to their pool's in ``pools`` too."""
    try:
        families = list(text_string_to_metric_families(text.decode("utf-8")))
    except (UnicodeDecodeError, ValueError, IndexError) as error:
        raise MalformedPage(f"not Prometheus text: {str(error)[:160]}") from None
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
            bound = wanted.bounds.get(name)
            if bound is not None and value > bound:
                raise MalformedPage(
                    f"{sample.name} is {value:g}, past the {bound:g} one label set can honestly read (docs/engines.md)"
                )
            rule = wanted.labels.get(name)
            if rule is not None and not rule.kept(sample.labels):
                continue
            values[name] = values.get(name, 0.0) + value
            counts[name] = counts.get(name, 0) + 1
            if rule is not None and rule.pool is not None and pools is not None:
                # At most --engine-max-label-sets pools a series, as the prefilter kept at most that many lines.
                of_series = pools.setdefault(name, {})
                pool = sample.labels.get(rule.pool, "")
                total, sets = of_series.get(pool, (0.0, 0))
                of_series[pool] = (total + value, sets + 1)


def page_of(values: dict[str, float], counts: dict[str, int], *, at: float, pools: Pools | None = None) -> EnginePage:
    """The page of summed ``values`` over ``counts`` label sets; ``MalformedPage`` where a sum is no longer a number
    (two label sets of 1.7e308 add up to infinity)."""
    for name, value in values.items():
        if not math.isfinite(value):
            raise MalformedPage(f"{name} sums to {value} over its label sets, which no engine reports")
    return EnginePage(at=at, values=values, counts=counts, pools=pools or {})


def read_whole_page(
    body: bytes, wanted: Prefilter, *, at: float, max_label_sets: int = DEFAULT_MAX_LABEL_SETS
) -> EnginePage:
    """The summed value of each wanted series on ``body`` and its label sets, all at once (tests and benchmarks; the
    gateway reads a page in turns, ``page_reader.read_page``)."""
    page = wanted.filter(max_label_sets)
    page.feed(body)
    values: dict[str, float] = {}
    counts: dict[str, int] = {}
    pools: Pools = {}
    for text in batches(page.finish()):
        add_values(text, values, counts, wanted, pools)
    return page_of(values, counts, at=at, pools=pools)
