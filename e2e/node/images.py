"""The node's small images, written as OCI archives by hand: a static busybox for the pod sandbox and the workloads.

No registry is reachable from the node and no image builder is needed: an image is one uncompressed layer (Debian's
static ``/bin/busybox`` and a few links to it), a config and a manifest, in the OCI layout that ``ctr images import``
reads. The sandbox image stands in for ``pause``: a process that sleeps and holds the pod's namespaces.
"""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from dataclasses import dataclass
from pathlib import Path

BUSYBOX = Path("/bin/busybox")  # Debian's busybox-static: no shared libraries to carry
# The applets the suite's containers run.
APPLETS = ("sh", "sleep", "cat", "ls", "true")
SANDBOX_IMAGE = "localhost/gpuscaler-e2e/pause:1"
BUSYBOX_IMAGE = "localhost/gpuscaler-e2e/busybox:1"
# The workload's command: sleeps until SIGTERM, then exits at once (busybox as PID 1 would ignore SIGTERM and wait
# out the grace period).
WORKLOAD_COMMAND = ["/bin/sh", "-c", "trap 'exit 0' TERM; sleep 86400 & wait"]


@dataclass(frozen=True)
class ImageArchive:
    """An OCI archive on disk and the name ``ctr images import`` gives it."""

    name: str
    path: Path


def _digest(data: bytes) -> str:
    return f"sha256:{hashlib.sha256(data).hexdigest()}"


def _layer() -> bytes:
    """One tar layer: /bin/busybox, links to it for each applet, and an empty /tmp."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as layer:
        for folder in ("bin", "tmp"):
            info = tarfile.TarInfo(folder)
            info.type, info.mode = tarfile.DIRTYPE, 0o1777 if folder == "tmp" else 0o755
            layer.addfile(info)
        binary = BUSYBOX.read_bytes()
        info = tarfile.TarInfo("bin/busybox")
        info.size, info.mode = len(binary), 0o755
        layer.addfile(info, io.BytesIO(binary))
        for applet in APPLETS:
            link = tarfile.TarInfo(f"bin/{applet}")
            link.type, link.linkname, link.mode = tarfile.SYMTYPE, "busybox", 0o777
            layer.addfile(link)
    return buffer.getvalue()


def write_archive(path: Path, name: str, entrypoint: list[str]) -> ImageArchive:
    """Writes the busybox image ``name`` (``host/path:tag``) that runs ``entrypoint`` as an OCI archive at ``path``."""
    if not BUSYBOX.exists():
        raise FileNotFoundError(f"{BUSYBOX} is missing: apt-get install busybox-static")
    return write_image(path, name, _layer(), {"Entrypoint": entrypoint, "Env": ["PATH=/bin"], "WorkingDir": "/"})


def write_image(path: Path, name: str, layer: bytes, settings: dict[str, object]) -> ImageArchive:
    """Writes a one-layer image (``layer``: an uncompressed tar; ``settings``: the config's ``config``) named
    ``name`` as an OCI archive at ``path``."""
    config = json.dumps(
        {
            "architecture": "amd64",
            "os": "linux",
            "config": settings,
            "rootfs": {"type": "layers", "diff_ids": [_digest(layer)]},
        }
    ).encode()
    manifest = json.dumps(
        {
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {
                "mediaType": "application/vnd.oci.image.config.v1+json",
                "digest": _digest(config),
                "size": len(config),
            },
            "layers": [
                {"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": _digest(layer), "size": len(layer)}
            ],
        }
    ).encode()
    index = json.dumps(
        {
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.index.v1+json",
            "manifests": [
                {
                    "mediaType": "application/vnd.oci.image.manifest.v1+json",
                    "digest": _digest(manifest),
                    "size": len(manifest),
                    "annotations": {"io.containerd.image.name": name, "org.opencontainers.image.ref.name": name},
                }
            ],
        }
    ).encode()
    blobs = {_digest(blob): blob for blob in (layer, config, manifest)}
    with tarfile.open(path, mode="w") as archive:
        for member, data in [
            ("oci-layout", json.dumps({"imageLayoutVersion": "1.0.0"}).encode()),
            ("index.json", index),
            *((f"blobs/sha256/{digest.removeprefix('sha256:')}", blob) for digest, blob in blobs.items()),
        ]:
            info = tarfile.TarInfo(member)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return ImageArchive(name, path)


def suite_images(directory: Path) -> list[ImageArchive]:
    """The sandbox image and the workloads' busybox image, written into ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    return [
        write_archive(directory / "pause.oci.tar", SANDBOX_IMAGE, ["/bin/sleep", "2147483647"]),
        write_archive(directory / "busybox.oci.tar", BUSYBOX_IMAGE, ["/bin/sh"]),
    ]
