"""podman and what it runs (conmon, runc, netavark, aardvark-dns, iptables), from Debian's packages, extracted into
the tool cache rather than installed.

Nothing is installed on the machine: ``apt-get download`` fetches the packages (and the libraries of theirs that
the machine lacks) and ``dpkg-deb -x`` unpacks them into one folder per set of package versions, under
``${XDG_CACHE_HOME:-~/.cache}/gpuscaler-tools/podman-debian/``. e2e/compose/podman.py runs the programs from there
with their libraries on LD_LIBRARY_PATH and every setting in a private configuration, so a machine without podman
still has none afterwards, and one with podman finds its own untouched.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from image.build import cache_dir
from tests.chart.chart_tools import locked

# The programs the suite runs, and the package of each. runc, not crun: crun 1.8 refuses cgroup v1's hybrid layout
# (a VM like CI's), even with --cgroups=disabled. golang-github-containers-common has seccomp.json and policy.json.
PACKAGES = (
    "podman",
    "conmon",
    "runc",
    "netavark",
    "aardvark-dns",
    "iptables",
    "golang-github-containers-common",
)
# Bump when the way the folder is made changes, so every cache unpacks again.
RECIPE = 1
# One line of `apt-get download --print-uris`: 'URI' FILE SIZE SHA256:...
URI_LINE = re.compile(r"^'(?P<uri>[^']+)' (?P<file>\S+\.deb) (?P<size>\d+) ")
# A package `apt-get install -s` would install that is not installed here at all ("Inst NAME (VERSION ...").
NEW_PACKAGE = re.compile(r"^Inst (?P<name>\S+) \(")


class PackagesUnavailable(Exception):
    """The packages cannot be had here (no apt, no network, no such package): the message says which step failed."""


def _apt(*argv: str, cwd: Path | None = None) -> str:
    result = subprocess.run(
        argv, cwd=cwd, capture_output=True, text=True, env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    )
    if result.returncode != 0:
        raise PackagesUnavailable(f"{' '.join(argv)} failed:\n{result.stdout[-2000:]}{result.stderr[-2000:]}")
    return result.stdout


def _lists_ready() -> None:
    """apt's package lists, fetched once if this machine has none (a fresh Debian image ships without them)."""
    if shutil.which("apt-get") is None or shutil.which("dpkg-deb") is None:
        raise PackagesUnavailable("no apt-get and dpkg-deb here: the compose suite takes podman from Debian 12")
    if not any(Path("/var/lib/apt/lists").glob("*Packages*")):
        _apt("apt-get", "update", "-q")


def wanted() -> list[str]:
    """PACKAGES and the packages they depend on that are not installed here (their libraries), by name."""
    simulated = _apt("apt-get", "install", "-s", "--no-install-recommends", *PACKAGES)
    missing = [match["name"] for line in simulated.splitlines() if (match := NEW_PACKAGE.match(line))]
    return sorted({*PACKAGES, *missing})


def root() -> Path:
    """The folder the packages are unpacked in (``usr/bin/podman``, ...), unpacked now unless the cache has this
    set at these versions. Needs apt's lists, and the network the first time."""
    _lists_ready()
    names = wanted()
    listed = _apt("apt-get", "download", "--print-uris", *names)
    files = sorted(match["file"] for line in listed.splitlines() if (match := URI_LINE.match(line)))
    if len(files) != len(names):
        raise PackagesUnavailable(f"apt-get download --print-uris gave {files} for {names}")
    key = hashlib.sha256("\n".join([f"r{RECIPE}", *files]).encode()).hexdigest()[:12]
    target = cache_dir() / "podman-debian" / key
    with locked():
        if target.exists():
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent, prefix="unpack-") as scratch_name:
            scratch = Path(scratch_name)
            debs = scratch / "debs"
            debs.mkdir()
            # As root, apt's sandbox user could not write into the cache: download as root.
            _apt("apt-get", "download", "-q", "-o", "APT::Sandbox::User=root", *names, cwd=debs)
            unpacked = scratch / "root"
            for deb in sorted(debs.glob("*.deb")):
                _apt("dpkg-deb", "-x", str(deb), str(unpacked))
            (unpacked / "packages.txt").write_text("\n".join(files) + "\n")
            os.replace(unpacked, target)  # all or nothing: a failed unpack leaves no half folder
    return target


def versions(unpacked: Path) -> str:
    """``podman 4.3.1+ds1-8+deb12u1+b3, runc ...``: the versions of PACKAGES in an unpacked folder."""
    found = {}
    for line in (unpacked / "packages.txt").read_text().split():
        name, version, _ = line.split("_")
        found[name] = version.replace("%3a", ":")
    return ", ".join(f"{name} {found[name]}" for name in PACKAGES)
