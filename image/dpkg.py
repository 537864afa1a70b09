"""dpkg's package database read without dpkg: the status file's packages, and the closure of their dependencies.

Standard library only: the image's build stage runs it (through ``image.sbom``) with whatever Python it has.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

# A dependency as dpkg writes it: a name, an optional ":arch" qualifier, then an optional "(op version)" and
# "[arch list]" or "<profile>" restrictions, none of which matter to an installed, consistent system.
_DEPENDENCY_NAME = re.compile(r"^\s*([a-z0-9][a-z0-9+.\-]+)")


@dataclass(frozen=True)
class Package:
    """One installed package of a dpkg status file."""

    name: str
    version: str
    architecture: str
    source: str
    # Pre-Depends and Depends; each entry is its alternatives ("a | b"), names only.
    depends: tuple[tuple[str, ...], ...]
    provides: tuple[str, ...]
    installed_size_kib: int
    # The package's paragraph of the status file, as dpkg wrote it (for a status file of a subset).
    paragraph: str


def paragraphs(text: str) -> Iterator[str]:
    """The blank-line-separated paragraphs of a deb822 file (a dpkg status file)."""
    for paragraph in re.split(r"\n\s*\n", text):
        if paragraph.strip():
            yield paragraph.strip("\n")


def fields(paragraph: str) -> dict[str, str]:
    """A paragraph's fields by name; continuation lines are joined with newlines."""
    result: dict[str, str] = {}
    name = ""
    for line in paragraph.splitlines():
        if line[:1] in (" ", "\t") and name:
            result[name] += "\n" + line.strip()
        else:
            name, _, value = line.partition(":")
            result[name] = value.strip()
    return result


def dependency_names(field: str) -> tuple[tuple[str, ...], ...]:
    """``"a (>= 1), b:any | c"`` -> ``(("a",), ("b", "c"))``."""
    entries = []
    for entry in field.split(","):
        alternatives = []
        for alternative in entry.split("|"):
            match = _DEPENDENCY_NAME.match(alternative)
            if match:
                alternatives.append(match.group(1))
        if alternatives:
            entries.append(tuple(alternatives))
    return tuple(entries)


def parse_status(text: str) -> dict[str, Package]:
    """The installed packages ("install ok installed") of a dpkg status file, by name."""
    packages = {}
    for paragraph in paragraphs(text):
        values = fields(paragraph)
        if values.get("Status") != "install ok installed":
            continue
        name = values["Package"]
        source = values.get("Source", name).split(" ")[0]
        packages[name] = Package(
            name=name,
            version=values["Version"],
            architecture=values.get("Architecture", "all"),
            source=source,
            depends=dependency_names(values.get("Pre-Depends", "")) + dependency_names(values.get("Depends", "")),
            provides=tuple(name for (name, *_) in dependency_names(values.get("Provides", ""))),
            installed_size_kib=int(values.get("Installed-Size", "0") or 0),
            paragraph=paragraph,
        )
    return packages


def list_file_names(package: Package) -> tuple[str, ...]:
    """The names dpkg may have given the package's file list in /var/lib/dpkg/info, most likely first."""
    return (f"{package.name}:{package.architecture}.list", f"{package.name}.list")


def closure(packages: Mapping[str, Package], roots: Iterable[str], cut: Iterable[str]) -> set[str]:
    """``roots`` and every package they depend on, directly or not, never entering a package of ``cut``.

    An alternative ("a | b") is met by its first installed choice that is not cut; a virtual name by the installed
    packages that provide it. A dependency that only a cut package meets is dropped with it: that is what cutting
    means (debconf for tzdata's configuration, dpkg for the triggers of a package that is never configured again).
    """
    cut = set(cut)
    providers: dict[str, list[str]] = {}
    for package in packages.values():
        for virtual in package.provides:
            providers.setdefault(virtual, []).append(package.name)

    def choices(name: str) -> list[str]:
        return [name] if name in packages else sorted(providers.get(name, []))

    missing = [root for root in roots if root not in packages]
    if missing:
        raise KeyError(f"not installed: {', '.join(missing)}")
    kept: set[str] = set()
    pending = [root for root in roots if root not in cut]
    while pending:
        name = pending.pop()
        if name in kept:
            continue
        kept.add(name)
        for alternatives in packages[name].depends:
            met = [choice for alternative in alternatives for choice in choices(alternative) if choice not in cut]
            if met:
                pending.append(met[0])
    return kept


def status_text(packages: Iterable[Package]) -> str:
    """A dpkg status file holding exactly ``packages``, sorted by name, as dpkg writes one."""
    return "".join(f"{package.paragraph}\n\n" for package in sorted(packages, key=lambda package: package.name))
