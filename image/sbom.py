"""A CycloneDX 1.5 SBOM of an image: its Debian packages (dpkg status) and its venv's Python distributions.

Run inside the image's build stage (``python -m image.sbom``), where the runtime's dpkg status and the venv are
plain files. Standard library only. The output is deterministic (no timestamp unless SOURCE_DATE_EPOCH is set,
a serial number derived from the content), so an unchanged image gets a byte-identical SBOM.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import sys
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from email.parser import Parser
from pathlib import Path
from typing import Any
from urllib.parse import quote

from image.dpkg import Package, parse_status

SPEC_VERSION = "1.5"
# The namespace of the serial numbers this module derives from an SBOM's content.
SERIAL_NAMESPACE = uuid.UUID("2f6f1a52-6a8e-4d2a-9a43-5d3c3f0b9b7e")

Json = dict[str, Any]


@dataclass(frozen=True)
class Distribution:
    """One installed Python distribution (a ``*.dist-info`` folder)."""

    name: str
    version: str
    license: str | None


def os_release(text: str) -> dict[str, str]:
    """The KEY=value pairs of an os-release file, quotes removed."""
    pairs = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep and not key.startswith("#"):
            pairs[key.strip()] = value.strip().strip("\"'")
    return pairs


def distributions(site_packages: Path) -> list[Distribution]:
    """The distributions installed in ``site_packages``, from each dist-info's METADATA."""
    found = []
    for metadata_path in sorted(site_packages.glob("*.dist-info/METADATA")):
        metadata = Parser().parsestr(metadata_path.read_text(encoding="utf-8"), headersonly=True)
        licence = metadata.get("License-Expression")
        found.append(Distribution(metadata["Name"], metadata["Version"], licence.strip() if licence else None))
    return found


def _purl_part(text: str) -> str:
    """A purl name or version, percent-encoded as the purl spec asks ("1:2.3+b1" -> "1%3A2.3%2Bb1")."""
    return quote(text, safe="")


def deb_purl(package: Package, distro: str) -> str:
    """``pkg:deb/debian/libc6@2.36-9%2Bdeb12u14?arch=amd64&distro=debian-12``."""
    version = _purl_part(package.version)
    return f"pkg:deb/debian/{_purl_part(package.name)}@{version}?arch={package.architecture}&distro={distro}"


def pypi_purl(distribution: Distribution) -> str:
    """``pkg:pypi/kubernetes-asyncio@36.1.0``: the name normalised as PEP 503 says."""
    name = re.sub(r"[-_.]+", "-", distribution.name).lower()
    return f"pkg:pypi/{name}@{_purl_part(distribution.version)}"


def deb_component(package: Package, distro: str) -> Json:
    """A Debian package as a CycloneDX component."""
    purl = deb_purl(package, distro)
    component: Json = {"type": "library", "bom-ref": purl, "name": package.name, "version": package.version}
    component["purl"] = purl
    if package.source != package.name:
        component["properties"] = [{"name": "debian:source", "value": package.source}]
    return component


def python_component(distribution: Distribution) -> Json:
    """A Python distribution as a CycloneDX component."""
    purl = pypi_purl(distribution)
    component: Json = {"type": "library", "bom-ref": purl, "name": distribution.name}
    component |= {"version": distribution.version, "purl": purl}
    if distribution.license:
        component["licenses"] = [{"expression": distribution.license}]
    return component


def interpreter_component(version: str) -> Json:
    """The Python interpreter, where no Debian package carries it (an upstream python image builds its own)."""
    purl = f"pkg:generic/cpython@{_purl_part(version)}"
    return {"type": "application", "bom-ref": purl, "name": "cpython", "version": version, "purl": purl}


def sbom(
    *,
    name: str,
    version: str,
    packages: Iterable[Package],
    distro: str,
    python: Iterable[Distribution],
    interpreter: str | None,
    timestamp: datetime.datetime | None = None,
) -> Json:
    """The SBOM of image ``name``:``version``: ``packages`` (Debian), ``python`` and, if given, ``interpreter``."""
    components = [deb_component(package, distro) for package in sorted(packages, key=lambda p: p.name)]
    components += [python_component(d) for d in sorted(python, key=lambda d: pypi_purl(d))]
    if interpreter:
        components.append(interpreter_component(interpreter))
    image: Json = {"type": "container", "bom-ref": f"{name}@{version}", "name": name, "version": version}
    metadata: Json = {"component": image, "tools": {"components": [{"type": "application", "name": "image.sbom"}]}}
    if timestamp is not None:
        metadata = {"timestamp": timestamp.strftime("%Y-%m-%dT%H:%M:%SZ"), **metadata}
    identity = json.dumps([image, components], sort_keys=True)
    return {
        "bomFormat": "CycloneDX",
        "specVersion": SPEC_VERSION,
        "serialNumber": f"urn:uuid:{uuid.uuid5(SERIAL_NAMESPACE, identity)}",
        "version": 1,
        "metadata": metadata,
        "components": components,
    }


def carries_interpreter(packages: Iterable[Package], python_version: str) -> bool:
    """Whether a Debian package ships this Python (``python3.11-minimal`` for 3.11.x)."""
    major, minor, *_ = python_version.split(".")
    return any(package.name == f"python{major}.{minor}-minimal" for package in packages)


def site_packages(venv: Path) -> Path:
    """The venv's one site-packages folder."""
    (found,) = venv.glob("lib/python3*/site-packages")
    return found


def main(argv: Sequence[str] | None = None) -> int:
    """Writes the SBOM of a runtime (dpkg status, os-release) with a venv to stdout or ``--output``."""
    parser = argparse.ArgumentParser(prog="python -m image.sbom", description=main.__doc__)
    parser.add_argument("--name", required=True)
    parser.add_argument("--version", required=True)
    parser.add_argument("--dpkg-status", type=Path, required=True, help="the runtime's /var/lib/dpkg/status")
    parser.add_argument("--os-release", type=Path, required=True, help="the runtime's /usr/lib/os-release")
    parser.add_argument("--venv", type=Path, required=True)
    parser.add_argument("--output", type=Path)
    args = parser.parse_args(argv)
    packages = parse_status(args.dpkg_status.read_text(encoding="utf-8")).values()
    release = os_release(args.os_release.read_text(encoding="utf-8"))
    distro = f"{release.get('ID', 'debian')}-{release.get('VERSION_ID', 'unknown')}"
    python_version = platform.python_version()
    epoch = os.environ.get("SOURCE_DATE_EPOCH")
    document = sbom(
        name=args.name,
        version=args.version,
        packages=packages,
        distro=distro,
        python=distributions(site_packages(args.venv)),
        interpreter=None if carries_interpreter(packages, python_version) else python_version,
        timestamp=datetime.datetime.fromtimestamp(int(epoch), datetime.UTC) if epoch else None,
    )
    text = json.dumps(document, indent=2) + "\n"
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(text, encoding="utf-8")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
