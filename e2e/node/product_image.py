"""The gpuscaler image the chart runs: the OCI archive ``make image`` leaves in build/image/.

``GPUSCALER_IMAGE_ARCHIVE`` names another archive (and ``GPUSCALER_IMAGE_NAME`` the name it carries, if it carries
none the suite can find). A missing archive fails with what to run: the suite never skips.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from e2e.node.images import ImageArchive

REPOSITORY_ROOT = Path(__file__).resolve().parents[2]


def chart_version() -> str:
    """The version in pyproject.toml: the image's tag and the chart's appVersion."""
    text = (REPOSITORY_ROOT / "pyproject.toml").read_text()
    match = re.search(r'^version = "([^"]+)"', text, re.MULTILINE)
    assert match, "pyproject.toml has no version"
    return match.group(1)


def chart_image_archive() -> ImageArchive:
    """The archive and the name it is imported as (localhost/gpuscaler:<version>, as buildah names it)."""
    version = chart_version()
    default = REPOSITORY_ROOT / "build" / "image" / f"gpuscaler-{version}-amd64.oci.tar"
    path = Path(os.environ.get("GPUSCALER_IMAGE_ARCHIVE") or default)
    if not path.is_file():
        raise AssertionError(f"no gpuscaler image archive at {path}: run `make image` (or set GPUSCALER_IMAGE_ARCHIVE)")
    return ImageArchive(os.environ.get("GPUSCALER_IMAGE_NAME") or f"localhost/gpuscaler:{version}", path)
