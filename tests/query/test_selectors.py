"""Label selectors parse as kubectl's do, and match labels."""

from __future__ import annotations

import re

import pytest

from gpuscaler.query.selectors import parse_label_selector


@pytest.mark.parametrize(
    ("selector", "labels", "matches"),
    [
        ("app=web", {"app": "web"}, True),
        ("app==web", {"app": "web"}, True),
        ("app=web", {"app": "api"}, False),
        ("app!=web", {"app": "api"}, True),
        ("app!=web", {}, True),
        ("app in (web, api)", {"app": "api"}, True),
        ("app in (web,api)", {"app": "db"}, False),
        ("app notin (web)", {}, True),
        ("app notin (web)", {"app": "web"}, False),
        ("gpu", {"gpu": ""}, True),
        ("gpu", {}, False),
        ("!legacy", {"app": "x"}, True),
        ("!legacy", {"legacy": "1"}, False),
        ("app=web,tier in (front),!legacy", {"app": "web", "tier": "front"}, True),
        ("app=web,tier in (front),!legacy", {"app": "web", "tier": "back"}, False),
        ("example.com/team=vision", {"example.com/team": "vision"}, True),
        ("app=", {"app": ""}, True),
    ],
)
def test_matching(selector: str, labels: dict[str, str], matches: bool) -> None:
    """Equality, inequality, set, existence and absence requirements all have to hold."""
    assert parse_label_selector(selector).matches(labels) is matches


@pytest.mark.parametrize(
    ("selector", "complaint"),
    [
        ("", "is empty"),
        ("app=web,,tier=x", "empty requirement"),
        ("app in (web", "without its ')'"),
        ("app in web)", "without its '('"),
        ("app in ()", "one or more valid label values"),
        ("-bad=x", "not a valid label key"),
        ("app=we b", "not a valid label key"),
        ("app=a/b", "not a valid label value"),
    ],
)
def test_errors_say_what_is_wrong(selector: str, complaint: str) -> None:
    """A malformed selector raises ValueError naming the problem."""
    with pytest.raises(ValueError, match=re.escape(complaint)):
        parse_label_selector(selector)


def test_equal_selectors_written_differently_have_equal_requirements() -> None:
    """Order and spacing do not change the requirements (so equal queries share one evaluation)."""
    assert parse_label_selector("b=2, a in (y,x)").requirements == parse_label_selector("a in (x, y),b=2").requirements
