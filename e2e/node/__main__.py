"""``make e2e-node``: installs what the node needs, builds its tools, then runs pytest in private namespaces.

``python -m e2e.node [PYTEST ARGS]``: as root, installs the missing Debian packages (containerd, runc, the CNI
plugins, iptables, busybox-static) with apt-get, builds the control plane's and the node's Go tools on first use
(``python -m tests.tools node``; the network is needed for both), then runs ``pytest e2e/node`` under ``unshare
--net --mount`` with GPUSCALER_E2E_NODE=1, so that nothing the node does reaches the host's network or mount table.
"""

from __future__ import annotations

import os
import shutil
import sys
import time

from e2e.node import host
from e2e.support.namespaces import namespaces
from tests import tools as setup_step


def main(argv: list[str]) -> None:
    """Prepares the host and replaces this process with pytest in the namespaces."""
    if os.geteuid() != 0:
        raise SystemExit("make e2e-node runs a kubelet and containerd: run it as root")
    started = time.monotonic()
    try:
        host.install_packages()
    except host.HostUnsuitable as error:
        raise SystemExit(str(error)) from None
    # The control plane's and the node's tools, and what the suite reads from the Go module cache, while the network
    # is there: inside the namespaces, fixtures only locate them.
    setup_step.set_up("node")
    unshare = shutil.which("unshare")
    if unshare is None:
        raise SystemExit("no `unshare` (util-linux) on PATH: the node suite runs in private namespaces")
    print(f"prerequisites ready in {time.monotonic() - started:.1f} s", file=sys.stderr)
    os.environ["GPUSCALER_E2E_NODE"] = "1"
    os.environ[host.HOST_NAMESPACES_VARIABLE] = namespaces()
    command = [unshare, "--net", "--mount", "--propagation", "private", "--"]
    command += [sys.executable, "-m", "pytest", "e2e/node", *argv]
    os.execv(unshare, command)


if __name__ == "__main__":
    main(sys.argv[1:])
