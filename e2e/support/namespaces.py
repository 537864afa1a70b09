"""Which network and mount namespaces this process is in, for the suites that run pytest in private ones."""

from __future__ import annotations

import os

NAMESPACE_KINDS = ("net", "mnt")


def namespaces() -> str:
    """This process's network and mount namespaces, as ``net:INODE,mnt:INODE``."""
    return ",".join(f"{kind}:{os.stat(f'/proc/self/ns/{kind}').st_ino}" for kind in NAMESPACE_KINDS)


def left(outer: str) -> bool:
    """Whether this process is in none of the namespaces ``outer`` (what ``namespaces()`` said before entering
    private ones) names; False when ``outer`` is empty, as when pytest was started some other way."""
    return bool(outer) and not set(outer.split(",")) & set(namespaces().split(","))
