"""A ``gpuscaler`` process (agent or gateway) started as a user starts it, found by the port its JSON log reports."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Process:
    """A gpuscaler process with a JSON log; ``port`` comes from its started event."""

    argv: list[str]
    log_path: Path
    environ: dict[str, str]
    started_event: str
    process: subprocess.Popen[bytes] | None = None
    port: int = 0

    def start(self) -> Process:
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                self.argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=self.environ
            )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            for event in self.events(self.started_event):
                self.port = int(str(event["port"]))
                return self
            if self.process.poll() is not None:
                raise AssertionError(f"{self.argv[1]} exited with {self.process.returncode}:\n{self.tail()}")
            time.sleep(0.02)
        raise AssertionError(f"{self.argv[1]} did not start:\n{self.tail()}")

    def events(self, name: str) -> list[dict[str, object]]:
        found = []
        for line in self.log_path.read_text(errors="replace").splitlines():
            with contextlib.suppress(ValueError):
                event = json.loads(line)
                if isinstance(event, dict) and event.get("event") == name:
                    found.append(event)
        return found

    def tail(self, lines: int = 30) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    async def terminate(self) -> int:
        if self.process is None or self.process.poll() is not None:
            return self.process.returncode if self.process else 0
        self.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 20
        while self.process.poll() is None:
            if time.monotonic() > deadline:
                self.kill()
                break
            await asyncio.sleep(0.02)
        return self.process.returncode


def environment(node: str | None = None) -> dict[str, str]:
    """Our environment less any GPUSCALER_* variable, so only the flags given count; NODE_NAME ``node`` if given."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("GPUSCALER_")}
    if node is not None:
        environ["NODE_NAME"] = node
    return environ
