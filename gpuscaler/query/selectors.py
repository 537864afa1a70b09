"""Kubernetes label selectors (the ``kubectl -l`` syntax) parsed into requirements and matched. Pure.

``app=web,tier!=cache,env in (prod,staging),!legacy,gpu`` is five requirements that must all hold.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping
from dataclasses import dataclass

_KEY = re.compile(r"^([a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$")
_SET = re.compile(r"^(?P<key>[^\s!=()]+)\s+(?P<op>in|notin)\s*\((?P<values>[^()]*)\)$")
_EQUALITY = re.compile(r"^(?P<key>[^\s!=()]+)\s*(?P<op>==|=|!=)\s*(?P<value>[^\s!=()]*)$")


class Operator(enum.Enum):
    """How a requirement tests its key: its value in or not in a set, the key present, or the key absent (``!key``)."""

    IN = "in"
    NOT_IN = "notin"
    EXISTS = "exists"
    DOES_NOT_EXIST = "!"


@dataclass(frozen=True, slots=True)
class Requirement:
    """One comma-separated clause of a selector: ``key`` tested by ``operator`` against ``values``."""

    key: str
    operator: Operator
    values: frozenset[str] = frozenset()

    def matches(self, labels: Mapping[str, str]) -> bool:
        match self.operator:
            case Operator.IN:
                return labels.get(self.key) in self.values
            case Operator.NOT_IN:
                return labels.get(self.key) not in self.values
            case Operator.EXISTS:
                return self.key in labels
            case Operator.DOES_NOT_EXIST:
                return self.key not in labels


@dataclass(frozen=True, slots=True)
class LabelSelector:
    """All of ``requirements`` must hold; ``text`` is the selector as written, for messages and names."""

    text: str
    requirements: tuple[Requirement, ...]

    def matches(self, labels: Mapping[str, str]) -> bool:
        return all(requirement.matches(labels) for requirement in self.requirements)


def parse_label_selector(text: str) -> LabelSelector:
    """Parse ``text``; ValueError says which part is wrong."""
    parts = _split(text)
    if not parts:
        raise ValueError("is empty; use e.g. 'app=web' or 'app in (web,api),tier!=cache'")
    requirements = tuple(sorted((_requirement(part) for part in parts), key=_order))
    return LabelSelector(text=",".join(parts), requirements=requirements)


def _split(text: str) -> list[str]:
    parts: list[str] = []
    current: list[str] = []
    depth = 0
    for char in text:
        if char == "(":
            depth += 1
        elif char == ")":
            depth -= 1
            if depth < 0:
                raise ValueError("has a ')' without its '('")
        if char == "," and depth == 0:
            parts.append("".join(current).strip())
            current = []
        else:
            current.append(char)
    if depth:
        raise ValueError("has a '(' without its ')'")
    parts.append("".join(current).strip())
    if any(not part for part in parts) and any(parts):
        raise ValueError("has an empty requirement (two commas, or a comma at an end)")
    return [part for part in parts if part]


def _requirement(part: str) -> Requirement:
    if match := _SET.match(part):
        values = [value.strip() for value in match["values"].split(",")]
        if not any(values) or any(not _VALUE.match(value) for value in values):
            raise ValueError(f"{part!r}: the set needs one or more valid label values")
        operator = Operator.IN if match["op"] == "in" else Operator.NOT_IN
        return Requirement(_key(match["key"], part), operator, frozenset(values))
    if match := _EQUALITY.match(part):
        value = match["value"]
        if not _VALUE.match(value):
            raise ValueError(f"{part!r}: {value!r} is not a valid label value")
        operator = Operator.NOT_IN if match["op"] == "!=" else Operator.IN
        return Requirement(_key(match["key"], part), operator, frozenset({value}))
    if part.startswith("!"):
        return Requirement(_key(part[1:].strip(), part), Operator.DOES_NOT_EXIST)
    return Requirement(_key(part, part), Operator.EXISTS)


def _key(key: str, part: str) -> str:
    if not _KEY.match(key):
        raise ValueError(f"{part!r}: {key!r} is not a valid label key")
    return key


def _order(requirement: Requirement) -> tuple[str, str, tuple[str, ...]]:
    return (requirement.key, requirement.operator.value, tuple(sorted(requirement.values)))
