"""Every pinned tool the test suites run, built (or found) before pytest starts; fixtures only locate them.

``python -m tests.tools [SUITE ...]`` builds each suite's tools into the user's tool cache, once per machine, and
prints one line per tool: name, version, seconds, and whether it was built, already cached, or skipped. ``make
tools`` runs it for the ``test`` suite before ``make test``, ``unit``, ``e2e`` and ``chart-test``; ``make e2e-keda``
and ``make e2e-node`` run it for theirs. A build never runs inside a test, where pytest-timeout's limit would cut a
cold build short: ``locate`` only looks, and says which command builds what is missing.

Without Go on PATH the ``test`` suite's Go tools are skipped here and the tests that need them skip, loudly (a
helm, kubeconform, promtool or prometheus on PATH stands in); the KEDA and node suites never skip.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Protocol, TextIO

from e2e.compose.tools import COMPOSE
from e2e.keda import tools as keda_tools
from tests.chart import chart_tools
from tests.chart.chart_tools import ToolUnavailable
from tests.packaging import image_tools


class Pinned(Protocol):
    """A tool at a pinned version: where it lands in the tool cache, and how it gets there."""

    @property
    def name(self) -> str:
        """What the progress line and the errors call it."""

    @property
    def version(self) -> str:
        """Its pin."""

    @property
    def needs_go(self) -> bool:
        """Whether building it takes a Go toolchain."""

    @property
    def stand_in(self) -> str | None:
        """A program on PATH that may stand in for it where there is no Go, if any."""

    @property
    def path(self) -> Path:
        """Where it is once built; computing this builds nothing."""

    def build(self) -> Path:
        """Builds it, once per machine under a file lock; returns ``path``."""


# Each suite's tools, in the order the setup step builds them; the command that runs that step.
SUITES: dict[str, tuple[Pinned, ...]] = {
    "test": (
        chart_tools.HELM,
        chart_tools.KUBECONFORM,
        # The schemas are made from these modules' sources: a line of their own says how long the download took.
        chart_tools.KUBERNETES_SOURCE,
        chart_tools.KUBERNETES_SCHEMAS,
        *chart_tools.CRD_SOURCES,
        chart_tools.CRD_SCHEMAS,
        chart_tools.PROMTOOL,
        chart_tools.PROMETHEUS,
        image_tools.COMPOSECHECK,
        image_tools.HADOLINT,
    ),
    "keda": (*keda_tools.TOOLS, keda_tools.KEDA_SOURCE, chart_tools.HELM, keda_tools.EPP, keda_tools.GIE_SOURCE),
    # The node suite reads the monitoring CRDs too; KEDA's source is one of the CRDs' modules.
    "node": tuple(
        dict.fromkeys(
            (
                *keda_tools.TOOLS,
                *keda_tools.NODE_TOOLS,
                keda_tools.KEDA_SOURCE,
                chart_tools.HELM,
                *chart_tools.CRD_SOURCES,
                keda_tools.EPP,
                keda_tools.GIE_SOURCE,
                # The serving-from-zero journey's Prometheus, beside the push path.
                chart_tools.PROMETHEUS,
            )
        )
    ),
}
# The compose suite's podman comes from Debian's packages, unpacked by its own entry point (e2e/compose/packages.py).
SUITES["compose"] = (COMPOSE,)
SETUP_COMMANDS = {"test": "make tools", "keda": "make e2e-keda", "node": "make e2e-node", "compose": "make e2e-compose"}
# Where a missing Go fails the setup step instead of skipping the tests that need it.
NEVER_SKIPPED = {"keda", "node", "compose"}


class ToolMissing(Exception):
    """A tool the setup step builds is not in the cache: the tests ran without that step."""


class NotInSetup(LookupError):
    """A fixture asked for a tool that no suite lists, so no setup step would ever build it."""


def locate(tool: Pinned) -> Path:
    """The built ``tool``; never builds, downloads or installs anything.

    Raises NotInSetup for a tool no suite lists, ToolMissing (naming the command that builds it) when Go is here but
    the tool is not built, and ToolUnavailable when there is no Go and nothing on PATH stands in.
    """
    suites = [suite for suite, members in SUITES.items() if tool in members]
    if not suites:
        raise NotInSetup(f"{tool.name} {tool.version} is in no suite of tests/tools.py: add it to SUITES")
    if tool.path.exists():
        return tool.path
    if tool.needs_go and shutil.which("go") is None:
        found = shutil.which(tool.stand_in) if tool.stand_in else None
        if found:
            return Path(found)
        instead = f", and no `{tool.stand_in}` on PATH" if tool.stand_in else ""
        raise ToolUnavailable(f"no `go` on PATH to build {tool.name} {tool.version} with{instead}")
    commands = " or ".join(f"`{SETUP_COMMANDS[suite]}`" for suite in suites)
    raise ToolMissing(
        f"{tool.name} {tool.version} is not built (looked for {tool.path}): run {commands} first, which builds "
        "every pinned tool the tests use once per machine (`python -m tests.tools` is that step alone)"
    )


def programs(tools: Iterable[keda_tools.Tool]) -> dict[str, Path]:
    """Every program of the e2e suites' Go tools, by name, located."""
    return {program: locate(tool) / program for tool in tools for program, _ in tool.programs}


def set_up(suite: str, out: TextIO = sys.stderr) -> None:
    """Builds or finds every tool of ``suite``, one progress line each; raises SystemExit when one cannot be had."""
    for tool in SUITES[suite]:
        started = time.monotonic()
        where: Path | None
        if tool.path.exists():
            state, where = "cached", tool.path
        elif tool.needs_go and shutil.which("go") is None:
            if suite in NEVER_SKIPPED:
                raise SystemExit(f"{tool.name} {tool.version}: no `go` on PATH to build it with")
            found = shutil.which(tool.stand_in) if tool.stand_in else None
            state, where = ("found on PATH", Path(found)) if found else ("skipped: no `go` on PATH", None)
        else:
            try:
                where = tool.build()
            except (subprocess.CalledProcessError, subprocess.TimeoutExpired, keda_tools.BuildFailed) as error:
                output = getattr(error, "stderr", None) or ""
                output = output if isinstance(output, str) else output.decode(errors="replace")
                raise SystemExit(f"{tool.name} {tool.version}: the build failed: {error}\n{output[-6000:]}") from None
            state = "built"
        seconds = time.monotonic() - started
        label = f"{tool.name} {tool.version}"
        print(f"{label:58} {seconds:7.1f} s  {state:8} {where or ''}", file=out, flush=True)


def main(argv: Sequence[str] | None = None) -> None:
    """Sets up the suites named on the command line (``test`` when none is)."""
    parser = argparse.ArgumentParser(prog="python -m tests.tools", description=__doc__.splitlines()[0])
    parser.add_argument("suites", nargs="*", metavar="SUITE", help=f"one of {', '.join(SUITES)} (default: test)")
    suites = parser.parse_args(argv).suites or ["test"]
    for unknown in sorted(set(suites) - set(SUITES)):
        parser.error(f"no suite {unknown!r}: the suites are {', '.join(SUITES)}")
    for suite in dict.fromkeys(suites):
        set_up(suite)


if __name__ == "__main__":
    main()
