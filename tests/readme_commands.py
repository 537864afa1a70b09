"""The README's dev-stack command blocks, and what each command promises, for every stack that runs them.

`make dev` (tests/packaging/test_dev_stack.py) and `docker compose up` (e2e/compose/) must give the same answers to
the same commands: both read the blocks here and check each run with the same rules, so a README edit is checked
against both stacks at once.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"
# The commands README shows for a running dev stack, and those for "one node goes quiet".
DEV_STACK = r"`make dev` installs only the runtime.*?in another terminal:\n\n```sh\n(.*?)```"
QUIET_NODE = r"\*\*One node goes quiet\.\*\*.*?```sh\n(.*?)```"


def block(pattern: str) -> list[str]:
    """The command lines of the README's block that ``pattern``'s first group matches."""
    match = re.search(pattern, README.read_text(), re.S)
    assert match is not None, f"README has no block matching {pattern!r}"
    return match[1].splitlines()


def run(command: str) -> subprocess.CompletedProcess[str]:
    """One README command, in bash with pipefail, as a reader pastes it."""
    return subprocess.run(["bash", "-o", "pipefail", "-c", command], capture_output=True, text=True, timeout=60)


def check_dev_stack(commands: list[str], results: list[subprocess.CompletedProcess[str]]) -> None:
    """Every dev-stack command succeeds, but the query after `fake fail`, which gets the UNAVAILABLE KEDA would."""
    assert any("fake fail" in command for command in commands)
    after_failure = False
    for command, result in zip(commands, results, strict=True):
        if after_failure:
            assert result.returncode == 1, (command, result.stdout, result.stderr)
            assert "UNAVAILABLE" in result.stdout, command
        else:
            assert result.returncode == 0, (command, result.stdout, result.stderr)
        after_failure = "fake fail" in command


def check_quiet_node(command: str, result: subprocess.CompletedProcess[str]) -> None:
    """A quiet-node command gets what its comment says: UNAVAILABLE naming the node, or an answer."""
    comment = command.partition("#")[2]
    if named := re.search(r"UNAVAILABLE, naming (\S+)", comment):
        assert result.returncode == 1, (command, result.stdout)
        assert "UNAVAILABLE" in result.stdout, command
        assert named[1] in result.stdout, command
    else:
        assert result.returncode == 0, (command, result.stdout, result.stderr)
