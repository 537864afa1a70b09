"""The image's Debian base: a bookworm rootfs made by mmdebstrap at the lock file's exact versions, and the runtime
tree cut from it, which holds the interpreter, the libraries it loads and their data, and no shell.

Why the runtime is cut from the build rootfs instead of bootstrapped on its own: dpkg runs maintainer scripts with
/bin/sh, so any rootfs that dpkg installs has a shell, apt and dpkg in it (and purging them by force leaves a
database that lies). The build rootfs has run every script already (the CA bundle and ld.so.cache exist), so the
runtime copies, for the dependency closure of ``RUNTIME_ROOTS``, exactly the files dpkg lists for those packages
(less ``DROPPED``), plus the few generated files they need (``GENERATED``). The closure never enters ``CUT``, each
entry with its reason. The dpkg status file stays, pruned to what is there, so scanners and the SBOM see the
packages. Both trees come from one mmdebstrap run, so the build stage's venv links the runtime's very interpreter.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from image.dpkg import Package, closure, list_file_names, parse_status, status_text

SUITE = "bookworm"
# The build stage's packages, beyond mmdebstrap's minbase (Essential: yes, and apt).
# binutils: strip, for the debug symbols some wheels' extension modules carry (Containerfile).
BUILD_PACKAGES = ("python3", "python3-venv", "python3-pip", "ca-certificates", "binutils")
# mmdebstrap's own hooks: merged /usr through usr-is-merged, as debootstrap makes it (else apt picks usrmerge, which
# brings perl).
MMDEBSTRAP_HOOKS = Path("/usr/share/mmdebstrap/hooks/merged-usr")
# What the runtime needs: the interpreter (python3 -> python3.11 for the venv's links), its standard library, CA
# certificates (TLS to the Kubernetes API), and base-files (/etc/os-release, which scanners read). Time zones come
# from the venv's tzdata distribution (python-dateutil requires it), so Debian's tzdata would be a second copy.
# libstdc++6: the one library beyond glibc and libgcc that manylinux wheels may link (frozenlist's extension does).
RUNTIME_ROOTS: tuple[str, ...] = ("python3-minimal", "python3.11-minimal", "libpython3.11-stdlib")
RUNTIME_ROOTS += ("ca-certificates", "base-files", "libstdc++6")
# Packages the closure never enters, and why.
CUT = {
    "dpkg": "configures packages; nothing is configured in the runtime",
    "debconf": "the same (and it is perl)",
    "perl-base": "the same",
    "install-info": "the same",
    "mawk": "only base-files' maintainer script runs awk",
    "openssl": "the command; libssl3 is kept, and openssl.cnf and the certificate links are in GENERATED",
    "tzdata": "the venv's tzdata has the same zones",
    # Libraries of standard-library extension modules that gpuscaler never imports; the modules go too
    # (DROPPED_MODULES), so importing one fails with ModuleNotFoundError.
    "libdb5.3": "_dbm",
    "libsqlite3-0": "_sqlite3",
    "libreadline8": "readline (the interactive prompt)",
    "libncursesw6": "_curses, _curses_panel",
    "libtinfo6": "readline and curses",
    "libnsl2": "nis",
    "libtirpc3": "nis's RPC, and through it Kerberos",
}
DROPPED_MODULES = ("_dbm", "_sqlite3", "readline", "_curses", "_curses_panel", "nis")
# Files that maintainer scripts made (or that cut packages own) and the runtime needs; trees are copied whole.
GENERATED = (
    "etc/ssl/certs",  # update-ca-certificates: the bundle and its hash links
    "etc/ssl/openssl.cnf",  # openssl's configuration, which libssl reads
    "usr/lib/ssl/cert.pem",  # where OpenSSL, and so Python's ssl, looks for the bundle
    "usr/lib/ssl/certs",
    "usr/lib/ssl/openssl.cnf",
    "etc/nsswitch.conf",  # base-files' postinst
    "etc/ld.so.cache",  # ldconfig; it lists libraries the runtime lacks too, which the loader then skips
)
# Files dpkg lists that a container never reads: documentation (copyright files stay: licences travel with
# binaries), glibc's iconv modules (gconv, 8 MB; Python's codecs are its own), and CPython's tests of itself
# (the test package, the _test* and xxlimited extension modules) with pydoc's help topics (2.5 MB).
DROPPED = re.compile(
    r"usr/share/(doc|man|info|lintian|locale)/|usr/lib/[^/]+/gconv/|usr/lib/python3\.\d+/(test|pydoc_data)/"
)
SELF_TESTS = r"_test\w*|_xxtestfuzz|_ctypes_test|xxlimited\w*"
DROPPED_MODULE = re.compile(
    rf"usr/lib/python3\.\d+/lib-dynload/({'|'.join(DROPPED_MODULES)}|{SELF_TESTS})\.cpython-[^/]+\.so"
)
# Commands that must not be in the runtime: shells, package managers, pip.
FORBIDDEN_COMMANDS = ("sh", "bash", "dash", "busybox", "apt", "apt-get", "dpkg", "perl", "pip", "pip3")
# The runtime's users: root, and the numeric non-root user the image runs as (distroless's "nonroot").
NONROOT_UID = 65532
PASSWD = (
    "root:x:0:0:root:/root:/sbin/nologin\n"
    f"nonroot:x:{NONROOT_UID}:{NONROOT_UID}:nonroot:/home/nonroot:/sbin/nologin\n"
    "nobody:x:65534:65534:nobody:/nonexistent:/sbin/nologin\n"
)
GROUP = f"root:x:0:\nnonroot:x:{NONROOT_UID}:\nnogroup:x:65534:\n"


class LockMismatch(Exception):
    """The archive no longer serves the lock's versions (or the package set changed): re-pin."""


@dataclass(frozen=True)
class Lock:
    """The lock file of one architecture: every package of the build rootfs, at its exact version."""

    path: Path
    versions: dict[str, str]


def lock_path(root: Path, arch: str) -> Path:
    """``image/debian-packages-<arch>.lock``: binNMUs ("+b1") make versions differ between architectures."""
    return root / "image" / f"debian-packages-{arch}.lock"


def parse_lock(text: str) -> dict[str, str]:
    """``name=version`` lines (``#`` comments and blank lines skipped); ValueError names a malformed line."""
    versions: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip() or line.startswith("#"):
            continue
        name, sep, version = line.partition("=")
        if not sep or not name or not version or " " in line or name in versions:
            raise ValueError(f"line {number}: {line!r} is not a new NAME=VERSION")
        versions[name] = version
    return versions


def read_lock(root: Path, arch: str) -> Lock:
    """The lock of ``arch``; FileNotFoundError says how to make one."""
    path = lock_path(root, arch)
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: run `make image-lock IMAGE_ARCH={arch}` to pin the base")
    return Lock(path, parse_lock(path.read_text()))


def lock_text(packages: Iterable[Package], arch: str) -> str:
    """The lock file of a rootfs holding ``packages``."""
    header = (
        f"# Every Debian package of the image's {SUITE} {arch} base (the build stage; the runtime is a subset),\n"
        "# at the exact version `make image` installs. Re-pin (then review the diff): make image-lock"
        f"{'' if arch == 'amd64' else f' IMAGE_ARCH={arch}'}\n"
    )
    return header + "".join(f"{p.name}={p.version}\n" for p in sorted(packages, key=lambda p: p.name))


def apt_preferences(versions: Mapping[str, str]) -> str:
    """An apt preferences file that makes apt choose each locked version wherever the archive still has it."""
    return "".join(
        f"Package: {name}\nPin: version {version}\nPin-Priority: 1001\n\n" for name, version in sorted(versions.items())
    )


def check_against_lock(installed: Mapping[str, Package], lock: Lock) -> None:
    """LockMismatch naming each package whose installed version is not the locked one, and what to run."""
    problems = []
    for name, package in sorted(installed.items()):
        locked = lock.versions.get(name)
        if locked is None:
            problems.append(f"  {name}: not in the lock; the archive has {package.version} (a new dependency)")
        elif locked != package.version:
            problems.append(f"  {name}: locked {locked}, the archive now has {package.version}")
    for name in sorted(set(lock.versions) - set(installed)):
        problems.append(f"  {name}: locked {lock.versions[name]}, no longer installed (a dependency went away)")
    if problems:
        arch = lock.path.stem.rsplit("-", 1)[-1]
        raise LockMismatch(
            f"the Debian archive has moved on from {lock.path.name} ({len(problems)} package(s)):\n"
            + "\n".join(problems)
            + f"\nRe-pin with `make image-lock IMAGE_ARCH={arch}`, review the diff and commit it."
        )


def mmdebstrap_command(target: Path, arch: str, preferences: Path | None) -> list[str]:
    """mmdebstrap of the build rootfs into the directory ``target``, with apt pinned by ``preferences``."""
    command = [
        "mmdebstrap",
        "--variant=minbase",
        "--mode=root",
        "--format=directory",
        f"--architectures={arch}",
        f"--hook-dir={MMDEBSTRAP_HOOKS}",
        f"--include={','.join(BUILD_PACKAGES)}",
    ]
    if preferences is not None:
        command.append(
            '--setup-hook=mkdir -p "$1/etc/apt/preferences.d" && cp '
            f"'{preferences}' \"$1/etc/apt/preferences.d/gpuscaler-lock.pref\""
        )
    return [*command, SUITE, str(target)]


def bootstrap(target: Path, arch: str, lock: Lock | None, log: Path) -> dict[str, Package]:
    """Runs mmdebstrap (about 40 s) into ``target``; with ``lock``, pinned and checked against it."""
    preferences = None
    if lock is not None:
        preferences = target.parent / f"{target.name}.pref"
        preferences.write_text(apt_preferences(lock.versions))
    with log.open("w") as output:
        result = subprocess.run(
            mmdebstrap_command(target, arch, preferences), stdout=output, stderr=subprocess.STDOUT, check=False
        )
    if result.returncode != 0:
        tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-20:])
        raise RuntimeError(f"mmdebstrap failed (exit {result.returncode}); the end of {log}:\n{tail}")
    installed = parse_status((target / "var/lib/dpkg/status").read_text())
    if lock is not None:
        check_against_lock(installed, lock)
    return installed


def resolve(root: Path, path: str) -> Path:
    """Where ``path`` (absolute inside the rootfs ``root``) lies, its directory symlinks (/lib -> usr/lib) followed
    inside ``root``; the last component is not followed."""
    current = PurePosixPath("/")
    for part in PurePosixPath(path).relative_to("/").parts[:-1]:
        candidate = current / part
        for _ in range(40):
            on_disk = root / candidate.relative_to("/")
            if not on_disk.is_symlink():
                break
            link = PurePosixPath(os.readlink(on_disk))
            candidate = link if link.is_absolute() else candidate.parent / link
            candidate = PurePosixPath(os.path.normpath(candidate))
        current = candidate
    return root / (current / PurePosixPath(path).name).relative_to("/")


def _kept(relative: str) -> bool:
    """Whether a packaged path goes into the runtime (see DROPPED and DROPPED_MODULES)."""
    if relative.startswith("usr/share/doc/") and relative.endswith("/copyright"):
        return True
    return not DROPPED.match(relative) and not DROPPED_MODULE.match(relative)


def _copy_entry(source: Path, destination: Path) -> None:
    """One file, symlink or folder (not its contents), with its mode and owner."""
    info = source.lstat()
    destination.parent.mkdir(parents=True, exist_ok=True)
    if stat.S_ISDIR(info.st_mode):
        destination.mkdir(exist_ok=True)
        os.chmod(destination, stat.S_IMODE(info.st_mode))
    elif stat.S_ISLNK(info.st_mode):
        if destination.is_symlink():
            destination.unlink()
        os.symlink(os.readlink(source), destination)
    else:
        shutil.copy2(source, destination, follow_symlinks=False)
    if os.geteuid() == 0:  # as root (make image) owners are kept; a test's tree is all its own user's anyway
        os.lchown(destination, info.st_uid, info.st_gid)


def _copy_path(source_root: Path, target_root: Path, relative: str) -> None:
    """``relative`` from one rootfs to the other, a folder with everything in it."""
    source = resolve(source_root, "/" + relative)
    if not source.exists() and not source.is_symlink():
        return
    destination = target_root / source.relative_to(source_root)
    _copy_entry(source, destination)
    if source.is_dir() and not source.is_symlink():
        for folder, names, files in os.walk(source):
            for name in [*names, *files]:
                entry = Path(folder) / name
                _copy_entry(entry, target_root / entry.relative_to(source_root))


def package_paths(source_root: Path, package: Package) -> list[str]:
    """The paths dpkg lists for ``package``, rootfs-relative, with the .pyc files Debian compiled for its .py."""
    info = source_root / "var/lib/dpkg/info"
    listings = [info / name for name in list_file_names(package) if (info / name).exists()]
    if not listings:
        raise FileNotFoundError(f"dpkg has no file list for {package.name} in {info}")
    listing = listings[0]
    paths = []
    for line in listing.read_text().splitlines():
        relative = line.strip().lstrip("/")
        if not relative or relative == "." or not _kept(relative):
            continue
        paths.append(relative)
        if relative.endswith(".py"):
            # py3compile, in the postinst, compiled it; without the .pyc a read-only image compiles on every start.
            source = resolve(source_root, "/" + relative)
            for compiled in sorted((source.parent / "__pycache__").glob(f"{source.stem}.*.pyc")):
                paths.append(str(compiled.relative_to(source_root)))
    return paths


def runtime_tree(source_root: Path, target_root: Path, installed: Mapping[str, Package]) -> set[str]:
    """Writes the runtime into ``target_root`` from the build rootfs ``source_root``; returns its packages."""
    kept = closure(installed, RUNTIME_ROOTS, CUT)
    target_root.mkdir(parents=True)
    os.chmod(target_root, 0o755)  # noqa: S103 - a root filesystem's / is world-readable
    for entry in sorted(source_root.iterdir()):
        if entry.is_symlink():  # merged /usr: bin -> usr/bin, lib64 -> usr/lib64 (the ELF interpreter's path)
            _copy_entry(entry, target_root / entry.name)
    for name in sorted(kept):
        for relative in package_paths(source_root, installed[name]):
            source = resolve(source_root, "/" + relative)
            if source.exists() or source.is_symlink():
                _copy_entry(source, target_root / source.relative_to(source_root))
    for relative in GENERATED:
        _copy_path(source_root, target_root, relative)
    for folder, mode, owner in (
        ("tmp", 0o1777, 0),
        ("proc", 0o555, 0),
        ("sys", 0o555, 0),
        ("dev", 0o755, 0),
        ("run", 0o755, 0),
        ("root", 0o700, 0),
        ("home/nonroot", 0o700, NONROOT_UID),
        ("var/lib/dpkg", 0o755, 0),
    ):
        path = target_root / folder
        path.mkdir(parents=True, exist_ok=True)
        os.chmod(path, mode)
        if os.geteuid() == 0:
            os.chown(path, owner, owner)
    (target_root / "etc/passwd").write_text(PASSWD)
    (target_root / "etc/group").write_text(GROUP)
    (target_root / "var/lib/dpkg/status").write_text(status_text(installed[name] for name in kept))
    return kept


def forbidden_commands(root: Path) -> list[str]:
    """Shells, package managers and pip found in ``root``'s command folders (resolved through merged /usr)."""
    found = []
    for folder in ("/bin", "/sbin", "/usr/bin", "/usr/sbin", "/usr/local/bin", "/opt/gpuscaler/bin"):
        for command in FORBIDDEN_COMMANDS:
            path = resolve(root, f"{folder}/{command}")
            if path.exists() or path.is_symlink():
                found.append(f"{folder}/{command}")
    return found


def tar_tree(tree: Path, archive: Path) -> None:
    """A tar of ``tree`` with numeric owners and extended attributes, as ``ADD`` unpacks it."""
    subprocess.run(
        ["tar", "--numeric-owner", "--xattrs", "--xattrs-include=*", "-C", str(tree), "-cf", str(archive), "."],
        check=True,
    )
