"""``make e2e-compose``: unpacks podman, builds Docker Compose, then runs pytest in private namespaces and checks that
the machine is as it was.

``python -m e2e.compose [PYTEST ARGS]``: as root, unpacks podman's Debian packages into the tool cache
(e2e/compose/packages.py: nothing is installed), builds Docker Compose from its pinned Go module once (before pytest,
never inside a test's timeout), then runs ``pytest e2e/compose`` under ``unshare --net --mount`` with
GPUSCALER_E2E_COMPOSE=1. Afterwards it compares what the machine shows of podman (on PATH, its ``info``), its fixed
paths, mounts, cgroups and netavark's iptables chains with what it showed before, and fails naming any difference.
The image is `make image`'s archive, which `make e2e-compose` builds first.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

from e2e.compose import packages
from e2e.compose.conftest import HOST_NAMESPACES_VARIABLE, PACKAGES_VARIABLE
from e2e.compose.podman import machine_traces
from e2e.support.namespaces import namespaces
from image.build import archive_path, host_architecture, project_version
from tests import tools


def _line(name: str, version: str, seconds: float, state: str, where: object) -> None:
    print(f"{name:32} {version:16} {seconds:7.1f} s  {state:8} {where}", file=sys.stderr, flush=True)


def main(argv: list[str]) -> int:
    """Prepares podman and Docker Compose, runs the suite in private namespaces, then checks the machine."""
    if os.geteuid() != 0:
        raise SystemExit("make e2e-compose runs podman as root: run it as root")
    unshare = shutil.which("unshare")
    if unshare is None:
        raise SystemExit("no `unshare` (util-linux) on PATH: the compose suite runs in private namespaces")
    archive = archive_path(project_version(), host_architecture())
    if not archive.exists():
        raise SystemExit(f"{archive} is missing: `make e2e-compose` builds it with `make image` first")
    started = time.monotonic()
    try:
        root = packages.root()
    except packages.PackagesUnavailable as error:
        raise SystemExit(str(error)) from None
    _line("podman (Debian, unpacked)", "", time.monotonic() - started, "ready", root)
    print(f"  {packages.versions(root)}", file=sys.stderr)
    tools.set_up("compose")
    print(f"prerequisites ready in {time.monotonic() - started:.1f} s", file=sys.stderr, flush=True)
    before = machine_traces(root)
    environment = dict(os.environ, GPUSCALER_E2E_COMPOSE="1")
    environment |= {PACKAGES_VARIABLE: str(root), HOST_NAMESPACES_VARIABLE: namespaces()}
    command = [unshare, "--net", "--mount", "--propagation", "private", "--"]
    suite = subprocess.Popen([*command, sys.executable, "-m", "pytest", "e2e/compose", *argv], env=environment)
    try:
        returncode = suite.wait()
    except KeyboardInterrupt:  # pytest got the Ctrl-C too, and cleans up before it exits
        returncode = suite.wait()
    after = machine_traces(root)
    changed = [
        f"{what}: {before[what]} before, {after.get(what)} after" for what in before if before[what] != after[what]
    ]
    if changed:
        print("make e2e-compose left this machine changed:\n- " + "\n- ".join(changed), file=sys.stderr)
        return 1
    print("this machine's podman, fixed paths, mounts, cgroups and iptables chains are as before", file=sys.stderr)
    return returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
