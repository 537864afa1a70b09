"""The dev stack's programs loaded as modules, for tests that read their functions and constants.

dev/ is no package: `make dev` runs its files as scripts, and the image runs dev/fake_engines.py as one file from a
ConfigMap, so they cannot be imported by name. Each is loaded once per test process.
"""

from __future__ import annotations

import functools
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

DEV = Path(__file__).resolve().parents[1] / "dev"


@functools.cache
def load(name: str) -> ModuleType:
    """dev/<name>.py as the module ``dev_<name>``."""
    spec = importlib.util.spec_from_file_location(f"dev_{name}", DEV / f"{name}.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module
