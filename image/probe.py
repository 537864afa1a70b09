"""Checks run by the image's own interpreter, inside its root filesystem (``image.build`` passes this file as
``python -c``): every extension module loads, and how soon a starting agent answers gRPC health with SERVING.

``imports``: imports every extension module (``*.so``) of the standard library and the venv, and prints the ones
that fail with why; exit 1 if any does. ``serving HOST PORT``: prints ``ready`` once its own imports are done, then
checks health every 2 ms (a refused connection is a retry) and prints ``SERVING`` the moment the server says so.
"""

from __future__ import annotations

import asyncio
import importlib
import sys
import sysconfig
import time
from pathlib import Path

POLL_SECONDS = 0.002
DEADLINE_SECONDS = 30.0


def extension_modules() -> list[str]:
    """Dotted names of the extension modules under the standard library and site-packages."""
    names = []
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    for key in ("stdlib", "platlib"):  # in a venv, platstdlib is the venv's own lib folder
        base = Path(sysconfig.get_paths()[key])
        for path in sorted(base.rglob(f"*{suffix}")):
            relative = path.relative_to(base)
            parts = relative.parts
            if parts[0] == "lib-dynload":
                parts = parts[1:]
            if any(part in ("test", "tests", "site-packages", "dist-packages") for part in parts[:-1]):
                continue
            names.append(".".join([*parts[:-1], parts[-1].removesuffix(suffix)]))
    return names


# What the two processes import beyond the extension modules: the gateway's Kubernetes client ships without its
# sources (the Containerfile compiles it), and must still import.
ENTRY_MODULES = ("gpuscaler.cli", "gpuscaler.gateway.process", "kubernetes_asyncio.client", "kubernetes_asyncio.watch")


def check_imports() -> int:
    """Imports each extension module and each entry module; prints the failures."""
    failures = []
    for name in [*extension_modules(), *ENTRY_MODULES]:
        try:
            importlib.import_module(name)
        except Exception as error:  # noqa: BLE001 - every failure is reported, whatever its kind
            failures.append(f"{name}: {type(error).__name__}: {error}")
    print(f"imported {len(extension_modules())} extension, {len(ENTRY_MODULES)} entry modules; {len(failures)} failed")
    for failure in failures:
        print(f"  {failure}")
    return 1 if failures else 0


async def wait_serving(host: str, port: int) -> int:
    """Polls gRPC health until SERVING (exit 0) or the deadline (exit 1)."""
    from grpclib.client import Channel

    from gpuscaler.generated.grpc.health.v1 import (
        HealthCheckRequest,
        HealthCheckResponseServingStatus,
        HealthStub,
    )

    print("ready", flush=True)
    deadline = time.monotonic() + DEADLINE_SECONDS
    while time.monotonic() < deadline:
        channel = Channel(host, port)
        try:
            response = await HealthStub(channel).check(HealthCheckRequest(), timeout=1.0)
            if response.status == HealthCheckResponseServingStatus.SERVING:
                print("SERVING", flush=True)
                return 0
        except (TimeoutError, OSError):
            pass
        finally:
            channel.close()
        await asyncio.sleep(POLL_SECONDS)
    print("no SERVING before the deadline", flush=True)
    return 1


def main(argv: list[str]) -> int:
    """``imports`` or ``serving HOST PORT``."""
    if argv[:1] == ["imports"]:
        return check_imports()
    if argv[:1] == ["serving"] and len(argv) == 3:
        return asyncio.run(wait_serving(argv[1], int(argv[2])))
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
