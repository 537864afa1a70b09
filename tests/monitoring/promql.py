"""What the alert-rule and dashboard checks share: promtool, the series a PromQL expression reads, a /metrics page."""

from __future__ import annotations

import re
from pathlib import Path

import aiohttp
import pytest

from tests.chart import chart_tools
from tests.tools import locate

# What PromQL spells that is not a series name: keywords, and the label lists that follow some of them.
_KEYWORDS = {"and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset"}
_LABEL_LIST = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_IDENTIFIER = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")


def promtool_or_skip(what: str) -> Path:
    """The pinned promtool as the setup step built it (tests/tools.py), or, without Go, a loud skip naming ``what``."""
    try:
        return locate(chart_tools.PROMTOOL)
    except chart_tools.ToolUnavailable as missing:
        pytest.skip(f"{what} NOT RUN: promtool is built with a Go toolchain ({missing})")


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
