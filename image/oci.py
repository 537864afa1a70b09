"""An image archive read without an engine: its config, its layers' uncompressed size, and its root filesystem.

Reads an OCI archive (``buildah push oci-archive:``, ``podman save --format oci-archive``) and the archive that
``docker save`` writes, so that ``make image`` checks what it ships the same way whichever engine built it.
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import tarfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import IO, Any, cast

WHITEOUT = ".wh."
OPAQUE = ".wh..wh..opq"
# The layers are this project's own, and _inside() keeps every entry in the root; Python 3.14's default filter
# ("data") would refuse the image's absolute symlinks (/usr/lib/ssl/certs -> /etc/ssl/certs).
EXTRACT_OPTIONS: dict[str, Any] = {"filter": "fully_trusted"} if hasattr(tarfile, "fully_trusted_filter") else {}

Json = dict[str, Any]


@dataclass(frozen=True)
class ImageArchive:
    """An archive's one image: its config (architecture, Env, User, Labels) and its layers, bottom first."""

    config: Json
    layers: tuple[str, ...]  # member names inside the archive


def _json(archive: tarfile.TarFile, name: str) -> Any:
    member = archive.extractfile(name)
    if member is None:
        raise ValueError(f"{name} is not a file in the archive")
    return json.load(member)


def _blob(digest: str) -> str:
    algorithm, _, value = digest.partition(":")
    return f"blobs/{algorithm}/{value}"


def read(path: Path) -> ImageArchive:
    """The image of the archive at ``path`` (the first, if it holds several)."""
    with tarfile.open(path) as archive:
        names = set(archive.getnames())
        if "index.json" in names:
            index = _json(archive, "index.json")
            manifest = _json(archive, _blob(index["manifests"][0]["digest"]))
            config = _json(archive, _blob(manifest["config"]["digest"]))
            return ImageArchive(config, tuple(_blob(layer["digest"]) for layer in manifest["layers"]))
        if "manifest.json" in names:  # docker save before Docker 25
            (entry, *_) = _json(archive, "manifest.json")
            return ImageArchive(_json(archive, entry["Config"]), tuple(entry["Layers"]))
    raise ValueError(f"{path} is neither an OCI archive nor a docker save archive")


@contextmanager
def _layer_stream(archive: tarfile.TarFile, name: str) -> Iterator[IO[bytes]]:
    """A layer's tar stream, decompressed if it is gzip (OCI layers may be either)."""
    member = archive.extractfile(name)
    if member is None:
        raise ValueError(f"layer {name} is not a file in the archive")
    magic = member.read(2)
    member.seek(0)
    if magic == b"\x1f\x8b":
        with gzip.GzipFile(fileobj=member) as stream:
            yield cast(IO[bytes], stream)
    else:
        yield member


def uncompressed_size(path: Path) -> int:
    """The bytes of every layer as an uncompressed tar: the size ``buildah images`` and ``docker images`` show."""
    image = read(path)
    total = 0
    with tarfile.open(path) as archive:
        for layer in image.layers:
            with _layer_stream(archive, layer) as stream:
                while chunk := stream.read(1 << 20):
                    total += len(chunk)
    return total


def _inside(root: Path, relative: PurePosixPath) -> Path:
    """``root/relative``, after checking that no symlink already there leads its parent out of ``root``."""
    target = root / relative
    real_root = os.path.realpath(root)
    parent = os.path.realpath(target.parent)
    if parent != real_root and not parent.startswith(real_root + os.sep):
        raise ValueError(f"layer entry {relative} would be written outside the root, through {parent}")
    return target


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def unpack(path: Path, root: Path) -> ImageArchive:
    """Applies every layer of the archive at ``path`` to the empty folder ``root``, whiteouts included (as root,
    owners are kept). Returns the image."""
    image = read(path)
    root.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path) as archive:
        for layer in image.layers:
            with _layer_stream(archive, layer) as stream, tarfile.open(fileobj=stream, mode="r|") as entries:
                for member in entries:
                    relative = PurePosixPath(member.name.lstrip("/"))
                    if relative.parts and relative.parts[0] == ".":
                        relative = PurePosixPath(*relative.parts[1:]) if len(relative.parts) > 1 else relative
                    if str(relative) in ("", "."):
                        continue
                    if ".." in relative.parts:
                        raise ValueError(f"layer entry {member.name} climbs out of the root")
                    target = _inside(root, relative)
                    if relative.name == OPAQUE:
                        for child in list(target.parent.iterdir()) if target.parent.is_dir() else []:
                            _remove(child)
                        continue
                    if relative.name.startswith(WHITEOUT):
                        _remove(target.parent / relative.name.removeprefix(WHITEOUT))
                        continue
                    if not member.isdir():
                        _remove(target)
                    member.name = str(relative)
                    entries.extract(member, root, numeric_owner=True, **EXTRACT_OPTIONS)
    return image
