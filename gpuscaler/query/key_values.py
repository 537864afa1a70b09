"""One trigger key's text to a value, or an InvalidMetadata that names the key, the value and what is allowed.

``metadata.py`` decides which keys a trigger may set together and what they mean; these only read one value.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import TypeVar

from gpuscaler.model.aggregation import Aggregation, WindowFunction
from gpuscaler.model.errors import InvalidMetadata
from gpuscaler.model.gpu_metrics import Metric
from gpuscaler.query.query import NodeQuorum, UnreadableTolerance

_E = TypeVar("_E", Metric, Aggregation, WindowFunction)
_T = TypeVar("_T")
METRIC_NAME = re.compile(r"^[a-z0-9]([a-z0-9._-]{0,98}[a-z0-9])?$")
NAMESPACE = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
OBJECT_NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")
POD_GLOB = re.compile(r"^[-a-z0-9.*?\[\]!]{1,253}$")
MAX_MIN_NODES = 100_000
MAX_UNREADABLE_COUNT = 100_000


def parse_float(key: str, text: str, *, minimum: float, exclusive: bool = False, maximum: float = math.inf) -> float:
    """A finite decimal within the bounds; ``maximum`` is a target's, which KEDA keeps as int64 thousandths."""
    try:
        number = float(text.strip())
    except ValueError:
        raise InvalidMetadata(f"{key} {text!r} is not a number; use a decimal like '70' or '0.5'") from None
    if not math.isfinite(number):
        raise InvalidMetadata(f"{key} {text!r} is not finite; use a finite decimal")
    if number < minimum or (exclusive and number == minimum) or number > maximum:
        bound = f"> {format_number(minimum)}" if exclusive else f">= {format_number(minimum)}"
        if maximum != math.inf:
            bound += f" and <= {int(maximum):,} (KEDA keeps a target as int64 thousandths)"
        raise InvalidMetadata(f"{key} {text!r} is out of range; it must be {bound}")
    return number


def parse_enum(key: str, text: str, kind: type[_E]) -> _E:
    """One of ``kind``'s values, surrounding blanks ignored."""
    try:
        return kind(text.strip())
    except ValueError:
        raise not_one_of(key, text, [member.value for member in kind]) from None


def not_one_of(key: str, text: str, allowed: list[str]) -> InvalidMetadata:
    """The refusal of a value that is none of ``allowed``."""
    return InvalidMetadata(f"{key} {text!r} is not allowed; use one of: {', '.join(allowed)}")


def parse_bool(key: str, text: str) -> bool:
    """'true' or 'false', in any case."""
    value = text.strip().lower()
    if value not in ("true", "false"):
        raise InvalidMetadata(f"{key} {text!r} is not allowed; use 'true' or 'false'")
    return value == "true"


def parse_name(key: str, text: str, pattern: re.Pattern[str], allowed: str) -> str:
    """A Kubernetes name that ``pattern`` allows; ``allowed`` says what that is, for the refusal."""
    name = text.strip()
    if not pattern.fullmatch(name):
        raise InvalidMetadata(f"{key} {text!r} is not allowed; use {allowed} (lowercase letters, digits, '-')")
    return name


def parse_min_nodes(text: str) -> NodeQuorum:
    """minNodes: a node count, or a share of the known nodes ('75%')."""
    count, percent = _count_or_percent(
        "minNodes", text, "use a node count like '3', or a share of the known nodes like '75%'"
    )
    if percent is not None:
        if not 0 < percent <= 100:
            raise InvalidMetadata(f"minNodes {text!r} is out of range; a share must be above 0% and at most 100%")
        return NodeQuorum(fraction=percent / 100.0)
    if not 1 <= count <= MAX_MIN_NODES:
        raise InvalidMetadata(f"minNodes {text!r} is out of range; it must be between 1 and {MAX_MIN_NODES}")
    return NodeQuorum(count=count)


def parse_max_unreadable(text: str) -> UnreadableTolerance:
    """maxUnreadable: a GPU count, or a share of the selected GPUs ('5%')."""
    count, percent = _count_or_percent(
        "maxUnreadable", text, "use a GPU count like '0' or '2', or a share of the selected GPUs like '5%'"
    )
    if percent is not None:
        if not 0 <= percent <= 100:  # also refuses nan
            raise InvalidMetadata(f"maxUnreadable {text!r} is out of range; a share must be from 0% to 100%")
        return UnreadableTolerance(fraction=percent / 100.0)
    if count > MAX_UNREADABLE_COUNT:
        raise InvalidMetadata(
            f"maxUnreadable {text!r} is out of range; a count must be from 0 to {MAX_UNREADABLE_COUNT}"
        )
    return UnreadableTolerance(count=count)


def _count_or_percent(key: str, text: str, allowed: str) -> tuple[int, float | None]:
    """A count ('3'), or a share ('75%') as its percent with the count 0; refused naming ``key`` otherwise."""
    item = text.strip()
    if item.endswith("%"):
        try:
            return 0, float(item[:-1])
        except ValueError:
            raise InvalidMetadata(f"{key} {text!r} is not a number; {allowed}") from None
    if not re.fullmatch(r"\d{1,6}", item):
        raise InvalidMetadata(f"{key} {text!r} is not allowed; {allowed}")
    return int(item), None


def parse_indices(text: str) -> tuple[int, ...] | None:
    """gpuIndex: sorted distinct NVML indices, or None for -1 (every GPU)."""
    indices = parse_list("gpuIndex", text, parse_index)
    if -1 in indices:
        if len(indices) > 1:
            raise InvalidMetadata(f"gpuIndex {text!r} mixes -1 (all GPUs) with indices; use -1 alone")
        return None
    return tuple(sorted(set(indices)))


def parse_index(item: str) -> int:
    """One gpuIndex entry; ValueError (which parse_list words) for anything but an index or -1."""
    if not re.fullmatch(r"-?\d{1,6}", item) or int(item) < -1:
        raise ValueError("an index is an integer >= 0, or -1 for all GPUs")
    return int(item)


def non_empty(item: str) -> str:
    """A list entry taken as it is (parse_list has refused empty ones)."""
    return item


def parse_list(key: str, text: str, parse: Callable[[str], _T]) -> tuple[_T, ...]:
    """A comma-separated list of ``parse``'s values; an empty entry or a bad one is refused naming the key."""
    items = [item.strip() for item in text.split(",")]
    if not text.strip() or any(not item for item in items):
        raise InvalidMetadata(f"{key} {text!r} has an empty entry; use a comma-separated list like '0,2'")
    try:
        return tuple(parse(item) for item in items)
    except ValueError as error:
        raise InvalidMetadata(f"{key} {text!r}: {error}") from None


def parse_metric_name(text: str) -> str:
    """metricName as KEDA can put it in a URL path."""
    if not METRIC_NAME.fullmatch(text):  # match() would let a trailing newline through "$"
        raise InvalidMetadata(
            f"metricName {text!r} is not allowed; use 1-100 lowercase letters, digits, '-', '_' or '.', "
            "starting and ending with a letter or digit (KEDA puts it in a URL path)"
        )
    return text


def format_number(number: float) -> str:
    """A number as a refusal writes it: '70', '0.5'."""
    return f"{number:g}"
