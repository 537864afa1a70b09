"""What the alert-rule and dashboard checks share: promtool, the series a PromQL expression reads, a /metrics page."""

from __future__ import annotations

import re
from pathlib import Path

import aiohttp
import pytest

from tests.chart import chart_tools

# What PromQL spells that is not a series name: keywords, and the label lists that follow some of them.
_KEYWORDS = {"and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset"}
_LABEL_LIST = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_IDENTIFIER = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")


def promtool_or_skip(what: str) -> Path:
    """The pinned promtool (tests/chart/chart_tools.py builds it once per machine), or a loud skip naming ``what``."""
    try:
        return chart_tools.promtool()
    except chart_tools.ToolUnavailable as missing:
        pytest.skip(f"{what} NOT RUN: promtool needs a Go toolchain to build it ({missing})")


def series_in(expr: str) -> set[str]:
    """The series names a PromQL expression reads: identifiers that are no keyword, function, label or duration."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)  # strings (label values)
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # ranges
    expr = _LABEL_LIST.sub("", expr)
    names = set()
    for match in _IDENTIFIER.finditer(expr):
        if match[0] in _KEYWORDS or expr[match.end() :].lstrip().startswith("("):
            continue  # a keyword or a function call
        names.add(match[0])
    return names


async def exposition(port: int) -> str:
    """The text of a /metrics page on 127.0.0.1."""
    async with aiohttp.ClientSession() as session, session.get(f"http://127.0.0.1:{port}/metrics") as response:
        assert response.status == 200
        return await response.text()
