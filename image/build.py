"""``make image``: the image built with docker or podman where one answers and runs a trial build, else with
buildah, then checked.

The Debian bases (image/debian.py) are built once per lock file and kept in the engine's storage under
``localhost/gpuscaler-debian-{build,runtime}:<arch>-<key>``; the Containerfile then starts FROM them. What ships is
checked as shipped, from the archive: no shell or package manager, ``gpuscaler --version`` runs in it as its user,
every extension module loads; its size, what fills it, and how soon ``gpuscaler serve`` answers SERVING are printed.

buildah keeps its storage under ``${XDG_CACHE_HOME:-~/.cache}/gpuscaler-tools/buildah/`` and runs in a mount
namespace of its own, so that nothing it mounts outlives the command. Tools that are missing (buildah, mmdebstrap,
qemu-user-static for another architecture) are installed with apt-get, as the Go tools are built on first use.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import platform
import shutil
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from image import debian, oci
from image.dpkg import parse_status

ROOT = Path(__file__).resolve().parents[1]
OUTPUT = ROOT / "build" / "image"
NAME = "localhost/gpuscaler"
SBOM_IN_IMAGE = "usr/share/doc/gpuscaler/sbom.cdx.json"
VENV_IN_IMAGE = "/opt/gpuscaler"
USER = "65532:65532"
# Where a mounted CA bundle and pip configuration appear inside the build (buildah and podman mount them).
BUILD_CA = "/etc/gpuscaler-build/ca.pem"
BUILD_PIP_CONF = "/etc/pip.conf"
# pip settings that mean the same inside the build as here; paths (find-links, a client certificate) do not.
PIP_KEYS = ("index-url", "extra-index-url", "trusted-host", "timeout", "default-timeout", "retries", "proxy")
ARCHITECTURES = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64"}
QEMU = {"arm64": "aarch64", "amd64": "x86_64"}
BINFMT = Path("/proc/sys/fs/binfmt_misc")
# What `make image` reports its image against: uncompressed size, and how soon the agent answers SERVING.
SIZE_GOAL_MB = 120
SERVING_GOAL_SECONDS = 0.5


def log(message: str) -> None:
    """A progress line on stderr, prefixed so it stands out among the tools' own output."""
    print(f"==> {message}", file=sys.stderr, flush=True)


def run(command: Sequence[str], env: Mapping[str, str] | None = None) -> None:
    """Runs ``command``, raising CalledProcessError on failure; the command is logged first."""
    log("$ " + " ".join(command))
    subprocess.run(list(command), check=True, env=env)


def cache_dir() -> Path:
    """``${XDG_CACHE_HOME:-~/.cache}/gpuscaler-tools``, shared with the chart and e2e tools."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    path = Path(base) / "gpuscaler-tools"
    path.mkdir(parents=True, exist_ok=True)
    return path


@contextlib.contextmanager
def build_lock() -> Iterator[None]:
    """One image build at a time on this machine: they share the engine's storage and the tool installs."""
    with (cache_dir() / "image.lock").open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def project_version() -> str:
    """pyproject.toml's version: the image's tag and label."""
    return str(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"])


def git_revision() -> str:
    """The checked-out commit, ``-dirty`` when the tree has changes; ``unknown`` outside git."""
    try:
        commit = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain"], capture_output=True, text=True)
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return commit + ("-dirty" if dirty.stdout.strip() else "")


def host_architecture() -> str:
    """This machine's architecture as Debian and OCI name it (amd64, arm64)."""
    machine = platform.machine().lower()
    if machine not in ARCHITECTURES:
        raise SystemExit(f"unknown machine architecture {machine!r}: pass --arch amd64 or arm64")
    return ARCHITECTURES[machine]


# --- tools -----------------------------------------------------------------------------------------------------


def install_debian_packages(packages: Mapping[str, str]) -> None:
    """Installs with apt-get the packages whose command (the key) is missing; SystemExit says how if it cannot."""
    missing = {command: package for command, package in packages.items() if shutil.which(command) is None}
    if not missing:
        return
    wanted = sorted(set(missing.values()))
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise SystemExit(f"{', '.join(sorted(missing))} missing: install {' '.join(wanted)} (as root: apt-get install)")
    environment = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    lists = Path("/var/lib/apt/lists")
    if not any(lists.glob("*Packages*")):
        run(["apt-get", "update", "-q"], env=environment)
    try:
        run(["apt-get", "install", "-y", "-q", *wanted], env=environment)
    except subprocess.CalledProcessError:  # a stale package list: refresh it once
        run(["apt-get", "update", "-q"], env=environment)
        run(["apt-get", "install", "-y", "-q", *wanted], env=environment)


@dataclass
class Emulation:
    """qemu-user-static registered with binfmt_misc for a foreign architecture, undone by ``close``."""

    interpreter: str
    mounted: bool = False
    enabled: bool = False

    def close(self) -> None:
        """Unregisters what this build registered and unmounts binfmt_misc if it mounted it."""
        if self.enabled:
            subprocess.run(["update-binfmts", "--disable", self.interpreter], check=False)
        if self.mounted:
            subprocess.run(["umount", str(BINFMT)], check=False)


def emulate(arch: str) -> Emulation:
    """Makes this machine run ``arch`` binaries (mmdebstrap's maintainer scripts, the build's RUN steps)."""
    interpreter = f"qemu-{QEMU[arch]}"
    install_debian_packages({f"{interpreter}-static": "qemu-user-static", "update-binfmts": "binfmt-support"})
    emulation = Emulation(interpreter)
    if not (BINFMT / "register").exists():
        run(["mount", "binfmt_misc", "-t", "binfmt_misc", str(BINFMT)])
        emulation.mounted = True
    entry = BINFMT / interpreter
    if not entry.exists() or not entry.read_text().startswith("enabled"):
        run(["update-binfmts", "--enable", interpreter])
        emulation.enabled = True
    # F: the kernel opens the interpreter when it is registered, so it runs inside chroots that lack it.
    flags = [line.split(":", 1)[1].strip() for line in entry.read_text().splitlines() if line.startswith("flags:")]
    if not flags or "F" not in flags[0]:
        emulation.close()
        raise SystemExit(f"{entry} lacks the F flag: chroots (mmdebstrap, RUN steps) would not find {interpreter}")
    return emulation


# --- engines ---------------------------------------------------------------------------------------------------


def answers(command: Sequence[str]) -> bool:
    """Whether an engine's CLI reaches a working engine (``docker info`` with no daemon does not)."""
    try:
        return subprocess.run(list(command), capture_output=True, timeout=30, check=False).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@dataclass(frozen=True)
class Engine:
    """How to build, tag and save with one engine: ``command`` is the CLI with its global options."""

    name: str
    command: tuple[str, ...]
    # buildah and podman can mount the host's pip configuration and CA bundle into RUN steps; docker cannot.
    mounts_volumes: bool
    notes: tuple[str, ...] = ()
    # buildah's runtime state for this run, removed by close().
    runroot: Path | None = None

    def has_image(self, image: str) -> bool:
        """Whether ``image`` is in the engine's storage."""
        inspect = ["inspect", "--type", "image"] if self.name == "buildah" else ["image", "inspect"]
        return subprocess.run([*self.command, *inspect, image], capture_output=True, check=False).returncode == 0

    def build(
        self,
        containerfile: Path,
        context: Path,
        tags: Sequence[str],
        arch: str,
        build_args: Mapping[str, str] | None = None,
        volumes: Sequence[str] = (),
    ) -> None:
        """Builds ``containerfile`` in ``context`` for ``arch`` and tags the result."""
        verb = ["bud", "--isolation", "chroot"] if self.name == "buildah" else ["build"]
        layers = ["--layers"] if self.name != "docker" else []
        command = [*self.command, *verb, *layers, "--platform", f"linux/{arch}", "-f", str(containerfile)]
        for tag in tags:
            command += ["-t", tag]
        for key, value in (build_args or {}).items():
            command += ["--build-arg", f"{key}={value}"]
        for volume in volumes:
            command += ["-v", volume]
        run([*command, str(context)])

    def save(self, image: str, archive: Path, reference: str) -> None:
        """Writes ``image`` to ``archive`` as an OCI archive (docker: its own save format) named ``reference``."""
        archive.unlink(missing_ok=True)
        if self.name == "buildah":
            run([*self.command, "push", "--quiet", image, f"oci-archive:{archive}:{reference}"])
            return
        run([*self.command, "tag", image, reference])
        if self.name == "podman":
            run([*self.command, "save", "--format", "oci-archive", "-o", str(archive), reference])
        else:
            run([*self.command, "save", "-o", str(archive), reference])

    def cleanup(self) -> None:
        """Removes the working containers a build left (buildah 1.28 leaves one per stage that only names a base)."""
        if self.name == "buildah":
            subprocess.run([*self.command, "rm", "--all"], capture_output=True, check=False)

    def close(self) -> None:
        """Removes this run's state."""
        if self.runroot is not None:
            shutil.rmtree(self.runroot, ignore_errors=True)


def buildah_engine() -> Engine:
    """buildah with its storage in the user cache: overlay where the kernel allows it there, else vfs
    (``STORAGE_DRIVER=vfs`` chooses), each in its own folder, in a mount namespace of its own."""
    install_debian_packages({"buildah": "buildah"})
    if os.geteuid() != 0:
        raise SystemExit("building with buildah here needs root (mmdebstrap and buildah's chroot isolation)")
    storage = cache_dir() / "buildah"
    # Runtime state (mount counts, locks of running containers) lives as long as the mount namespace: per run.
    runroot = Path(tempfile.mkdtemp(prefix="buildah-run-", dir=cache_dir()))

    def command(driver: str) -> tuple[str, ...]:
        prefix = ("unshare", "--mount", "--propagation", "private", "buildah")
        return (
            *prefix,
            "--root",
            str(storage / driver),
            "--runroot",
            str(runroot / driver),
            "--storage-driver",
            driver,
        )

    driver = os.environ.get("STORAGE_DRIVER", "")
    if not driver:
        driver = "overlay" if answers([*command("overlay"), "info"]) else "vfs"
    notes = (f"buildah storage: {storage / driver} ({driver}); list it: buildah --root {storage / driver} images",)
    return Engine("buildah", command(driver), mounts_volumes=True, notes=notes, runroot=runroot)


def trial_context(directory: Path) -> Path:
    """A build context whose Containerfile runs a program (``true``, with the shared libraries it loads, copied from
    this machine) FROM scratch: building it makes the engine run a container, as the image's RUN steps do, with no
    base image to pull."""
    program = Path(shutil.which("true") or "/bin/true").resolve()
    listed = subprocess.run(["ldd", str(program)], capture_output=True, text=True, check=False, timeout=30).stdout
    # "libc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x...)" and "/lib64/ld-linux-x86-64.so.2 (0x...)"
    libraries = [Path(word) for line in listed.splitlines() for word in line.split() if word.startswith("/")]
    for source, target in [(program, Path("/bin/true")), *((library, library) for library in libraries)]:
        copy = directory / target.relative_to("/")
        copy.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source.resolve(), copy)
        copy.chmod(0o755)
    (directory / "Containerfile").write_text('FROM scratch\nCOPY . /\nRUN ["/bin/true"]\n')
    return directory


def builds(name: str) -> str | None:
    """Why engine ``name`` cannot build the image, from a trial build that runs one container (podman answering
    `podman info` may still fail at its first RUN step, as crun does on a hybrid cgroup v1 layout); None when it
    builds. The trial image is removed."""
    tag = f"localhost/gpuscaler-engine-check:{os.getpid()}"
    with tempfile.TemporaryDirectory(prefix="engine-check-", dir=cache_dir()) as scratch:
        context = trial_context(Path(scratch))
        command = [name, "build", "-q", "-t", tag, "-f", str(context / "Containerfile"), str(context)]
        try:
            trial = subprocess.run(command, capture_output=True, text=True, check=False, timeout=180)
        except (OSError, subprocess.TimeoutExpired) as error:
            return f"`{name} build` of a one-step trial did not finish: {error}"
    if trial.returncode != 0:
        said = [line.strip() for line in (trial.stderr or trial.stdout).splitlines() if line.strip()]
        # The runtime's own words come first ("error running container: ... crun ...: cgroups in hybrid mode not
        # supported"); the engine's summary last.
        reason = next((line for line in said if "error" in line.lower()), said[-1] if said else "")
        return f"`{name} build` of a one-step trial failed ({reason or f'exit {trial.returncode}'})"
    subprocess.run([name, "rmi", tag], capture_output=True, check=False, timeout=60)
    return None


def engine_choice(requested: str) -> tuple[str, str | None]:
    """The engine to build with, and the line that says why when it is not the first one that answers: ``requested``
    (buildah, podman, docker) as asked; otherwise podman, then docker, if its `info` answers and a trial build
    runs, else buildah."""
    if requested in ("podman", "docker"):
        if not (shutil.which(requested) and answers([requested, "info"])):
            raise SystemExit(f"ENGINE={requested}, but `{requested} info` does not answer")
        return requested, None
    if requested not in ("", "buildah"):
        raise SystemExit(f"unknown ENGINE {requested!r}: buildah, podman or docker")
    if requested == "buildah":
        return "buildah", None
    failures: list[str] = []
    for name in ("podman", "docker"):
        if shutil.which(name) and answers([name, "info"]):
            failure = builds(name)
            if failure is None:
                return name, (f"{'; '.join(failures)}: building with {name}" if failures else None)
            failures.append(f"{name} answers `{name} info` but {failure}")
    if failures:
        return "buildah", f"{'; '.join(failures)}: building with buildah"
    return "buildah", "no container engine answers (podman info, docker info): building with buildah"


def choose_engine(requested: str) -> Engine:
    """The Engine ``engine_choice`` names; the reason, if any, is logged in one line."""
    name, reason = engine_choice(requested)
    if reason is not None:
        log(reason)
    if name == "buildah":
        return buildah_engine()
    return Engine(name, (name,), mounts_volumes=name == "podman")


# --- pip inside the build ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PipSettings:
    """What pip inside the build needs from this machine's pip: its configuration and the CA bundle it trusts."""

    config: str  # a pip.conf
    ca_bundle: Path | None


def pip_settings(listed: str, environ: Mapping[str, str], default_cafile: str | None) -> PipSettings:
    """From ``pip config list`` here (files and PIP_* variables), the settings that mean the same inside the
    build, and the CA bundle that pip here verifies with: its ``cert``, else SSL_CERT_FILE, else OpenSSL's."""
    settings: dict[str, str] = {}
    cert = ""
    for line in listed.splitlines():
        key, sep, value = line.partition("=")
        if not sep:
            continue
        name = key.split(".", 1)[-1]
        value = value.strip().strip("'\"")
        if name == "cert":
            cert = value
        elif name in PIP_KEYS:
            settings[name] = value
    candidates = [cert, environ.get("PIP_CERT", ""), environ.get("SSL_CERT_FILE", ""), default_cafile or ""]
    bundle = next((Path(c) for c in candidates if c and Path(c).is_file()), None)
    lines = ["[global]", *(f"{key} = {value}" for key, value in sorted(settings.items()))]
    if bundle is not None:
        lines.append(f"cert = {BUILD_CA}")
    return PipSettings("\n".join(lines) + "\n", bundle)


def host_pip_settings() -> PipSettings:
    """``pip_settings`` of this machine's pip and OpenSSL."""
    listed = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, check=False
    ).stdout
    return pip_settings(listed, os.environ, ssl.get_default_verify_paths().cafile)


# --- the Debian bases ----------------------------------------------------------------------------------------------


def base_key(arch: str) -> str:
    """What the Debian bases are made from: the lock, the recipe (debian.py) and the base Containerfile."""
    digest = hashlib.sha256()
    for path in (debian.lock_path(ROOT, arch), ROOT / "image" / "debian.py", ROOT / "image" / "rootfs.Containerfile"):
        digest.update(path.read_bytes())
    return f"{arch}-{digest.hexdigest()[:12]}"


def debian_bases(engine: Engine, arch: str, work: Path) -> tuple[str, str]:
    """The build and runtime base images for ``arch``, made now (about a minute) unless the storage has them."""
    key = base_key(arch)
    build_image = f"localhost/gpuscaler-debian-build:{key}"
    runtime_image = f"localhost/gpuscaler-debian-runtime:{key}"
    if engine.has_image(build_image) and engine.has_image(runtime_image):
        log(f"Debian bases {key}: in the engine's storage already")
        return build_image, runtime_image
    install_debian_packages({"mmdebstrap": "mmdebstrap"})
    lock = debian.read_lock(ROOT, arch)
    started = time.monotonic()
    log(f"mmdebstrap: {debian.SUITE} {arch}, {len(lock.versions)} packages pinned by {lock.path.name}")
    build_tree, runtime_tree = work / "build-rootfs", work / "runtime-rootfs"
    installed = debian.bootstrap(build_tree, arch, lock, OUTPUT / f"mmdebstrap-{arch}.log")
    kept = debian.runtime_tree(build_tree, runtime_tree, installed)
    forbidden = debian.forbidden_commands(runtime_tree)
    if forbidden:
        raise SystemExit(f"the runtime tree has {', '.join(forbidden)}: image/debian.py's CUT lets a tool in")
    took = time.monotonic() - started
    log(f"rootfs: {len(installed)} packages for the build, {len(kept)} in the runtime ({took:.0f} s)")
    for tree, image in ((build_tree, build_image), (runtime_tree, runtime_image)):
        context = work / f"{tree.name}-context"
        context.mkdir()
        debian.tar_tree(tree, context / "rootfs.tar")
        shutil.rmtree(tree)
        engine.build(ROOT / "image" / "rootfs.Containerfile", context, [image], arch)
        shutil.rmtree(context)
    return build_image, runtime_image


def pin_lock(arch: str) -> Path:
    """``make image-lock``: mmdebstrap unpinned, then the lock rewritten from what it installed."""
    install_debian_packages({"mmdebstrap": "mmdebstrap"})
    emulation = emulate(arch) if arch != host_architecture() else None
    path = debian.lock_path(ROOT, arch)
    try:
        with tempfile.TemporaryDirectory(prefix="image-lock-", dir=cache_dir()) as scratch:
            OUTPUT.mkdir(parents=True, exist_ok=True)
            installed = debian.bootstrap(Path(scratch) / "rootfs", arch, None, OUTPUT / f"mmdebstrap-{arch}.log")
    finally:
        if emulation is not None:
            emulation.close()
    before = debian.parse_lock(path.read_text()) if path.exists() else {}
    path.write_text(debian.lock_text(installed.values(), arch))
    changed = {name for name, package in installed.items() if before.get(name) != package.version}
    gone = set(before) - set(installed)
    log(f"{path.relative_to(ROOT)}: {len(installed)} packages, {len(changed)} new or changed, {len(gone)} gone")
    return path


# --- the checks of what ships --------------------------------------------------------------------------------------


def _environment(config: Mapping[str, object]) -> dict[str, str]:
    """The image's Env as a dict."""
    env = config.get("Env") or []
    assert isinstance(env, list)
    return dict(str(entry).split("=", 1) for entry in env)


def in_image(rootfs: Path, config: Mapping[str, object], command: Sequence[str], user: str = USER) -> list[str]:
    """``command`` run inside the unpacked image by chroot as ``user``, with only the image's environment."""
    env = [f"{key}={value}" for key, value in _environment(config).items()]
    chroot = shutil.which("chroot") or "/usr/sbin/chroot"  # env -i would look it up on the image's PATH
    return ["env", "-i", *env, chroot, f"--userspec={user}", str(rootfs), *command]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def runc_config(rootfs: Path, config: Mapping[str, object], args: Sequence[str]) -> dict[str, object]:
    """An OCI runtime config as a kubelet would ask for the agent: read-only root, uid 65532, no capabilities,
    /tmp a tmpfs; the host's network namespace, so that a probe on loopback reaches it."""
    uid, gid = (int(part) for part in USER.split(":"))
    return {
        "ociVersion": "1.0.2",
        "process": {
            "terminal": False,
            "user": {"uid": uid, "gid": gid},
            "args": list(args),
            "env": [f"{key}={value}" for key, value in _environment(config).items()],
            "cwd": "/",
            "noNewPrivileges": True,
            "capabilities": {"bounding": [], "effective": [], "permitted": [], "ambient": []},
        },
        "root": {"path": str(rootfs), "readonly": True},
        "hostname": "gpuscaler",
        "mounts": [
            {"destination": "/proc", "type": "proc", "source": "proc"},
            {"destination": "/dev", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "mode=755"]},
            # The container's /tmp, a fresh tmpfs: what the chart mounts for a read-only root.
            {"destination": "/tmp", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "mode=1777"]},  # noqa: S108 - not this machine's /tmp
        ],
        "linux": {"namespaces": [{"type": "pid"}, {"type": "ipc"}, {"type": "uts"}, {"type": "mount"}]},
    }


def time_to_serving(rootfs: Path, config: Mapping[str, object], work: Path) -> tuple[float, str]:
    """Seconds from starting ``gpuscaler serve --collector fake`` to its first SERVING, and how it was started:
    in a runc container when runc is here (as a kubelet would run it), else chrooted."""
    port, metrics = _free_port(), _free_port()
    serve = [f"{VENV_IN_IMAGE}/bin/gpuscaler", "serve", "--collector", "fake", "--pod-resources-socket", ""]
    serve += ["--listen", f"127.0.0.1:{port}", "--metrics-listen", f"127.0.0.1:{metrics}", "--log-format", "json"]
    probe_source = (ROOT / "image" / "probe.py").read_text()
    probe_command = [f"{VENV_IN_IMAGE}/bin/python", "-c", probe_source, "serving", "127.0.0.1", str(port)]
    probe = subprocess.Popen(
        in_image(rootfs, config, probe_command, user="0:0"), stdout=subprocess.PIPE, text=True, cwd="/"
    )
    runc = shutil.which("runc")
    state = work / "runc-state"
    container = f"gpuscaler-image-check-{os.getpid()}"
    if runc:
        bundle = work / "runc-bundle"
        bundle.mkdir()
        (bundle / "config.json").write_text(json.dumps(runc_config(rootfs, config, serve)))
        start = [runc, "--root", str(state), "run", "--bundle", str(bundle), container]
        how = "runc: read-only root, uid 65532, no capabilities"
    else:
        start = in_image(rootfs, config, serve)
        how = "chroot (no runc here)"
    server = None
    try:
        assert probe.stdout is not None
        if probe.stdout.readline().strip() != "ready":
            raise SystemExit("the health probe did not start inside the image")
        started = time.monotonic()
        server = subprocess.Popen(start, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        answer = probe.stdout.readline().strip()
        elapsed = time.monotonic() - started
        if answer != "SERVING":
            server.terminate()
            _, errors = server.communicate(timeout=30)
            raise SystemExit(f"gpuscaler serve never answered SERVING ({answer!r}); its stderr:\n{errors[-3000:]}")
        return elapsed, how
    finally:
        probe.kill()
        probe.wait()
        if server is not None:
            if runc:
                subprocess.run(
                    [runc, "--root", str(state), "kill", container, "KILL"], capture_output=True, check=False
                )
            server.kill()
            server.wait(timeout=30)
            if runc:
                subprocess.run([runc, "--root", str(state), "delete", "--force", container], capture_output=True)


def verdict(measured: float, goal: float, unit: str) -> str:
    """How a measurement stands against its goal (at most ``goal``): met, or missed by how much. A miss is reported,
    never a failure: one start on a busy machine is a noisy number."""
    if measured <= goal:
        return f"the goal is <= {goal:g} {unit}: met"
    return f"the goal is <= {goal:g} {unit}: missed by {measured - goal:.3g} {unit} ({measured / goal:.1f}x)"


def biggest(rootfs: Path, depth: int, count: int) -> list[tuple[int, str]]:
    """The ``count`` largest folders ``depth`` levels down, in bytes (apparent sizes)."""
    sizes: dict[str, int] = {}
    for folder, _, files in os.walk(rootfs):
        relative = Path(folder).relative_to(rootfs)
        key = "/" + "/".join(relative.parts[:depth])
        for name in files:
            path = Path(folder) / name
            if not path.is_symlink():
                sizes[key] = sizes.get(key, 0) + path.lstat().st_size
    return sorted(((size, key) for key, size in sizes.items()), reverse=True)[:count]


@dataclass(frozen=True)
class Report:
    """What ``make image`` prints at the end."""

    lines: list[str]


def check_archive(archive: Path, arch: str, version: str, work: Path) -> Report:
    """Unpacks the archive and checks what ships; SystemExit on a failed check."""
    rootfs = work / "check-rootfs"
    image = oci.unpack(archive, rootfs)
    config = image.config.get("config", {})
    problems = []
    if image.config.get("architecture") != arch:
        problems.append(f"architecture {image.config.get('architecture')!r}, not {arch}")
    if config.get("User") != USER:
        problems.append(f"user {config.get('User')!r}, not {USER}")
    labels = config.get("Labels") or {}
    for label in ("version", "source", "revision"):
        if not labels.get(f"org.opencontainers.image.{label}"):
            problems.append(f"no org.opencontainers.image.{label} label")
    if labels.get("org.opencontainers.image.version") != version:
        problems.append(f"version label {labels.get('org.opencontainers.image.version')!r}, not {version}")
    status_path = rootfs / "var/lib/dpkg/status"
    distroless = status_path.exists() and "dash" not in parse_status(status_path.read_text())
    forbidden = debian.forbidden_commands(rootfs)
    if distroless and forbidden:
        problems.append(f"has {', '.join(forbidden)}")
    sbom_path = rootfs / SBOM_IN_IMAGE
    if not sbom_path.exists():
        problems.append(f"no SBOM at /{SBOM_IN_IMAGE}")
    if problems:
        raise SystemExit(f"{archive.name}: " + "; ".join(problems))
    version_line = subprocess.run(
        in_image(rootfs, config, ["gpuscaler", "--version"]), capture_output=True, text=True, check=True
    ).stdout.strip()
    if version_line != f"gpuscaler {version}":
        raise SystemExit(f"`gpuscaler --version` in the image printed {version_line!r}")
    probe_source = (ROOT / "image" / "probe.py").read_text()
    imports = subprocess.run(
        in_image(rootfs, config, ["python", "-c", probe_source, "imports"]), capture_output=True, text=True
    )
    if imports.returncode != 0:
        raise SystemExit(f"extension modules that do not load in the image:\n{imports.stdout}{imports.stderr}")
    sbom = json.loads(sbom_path.read_text())
    sbom_copy = archive.with_name(archive.name.removesuffix(".oci.tar") + ".cdx.json")
    sbom_copy.write_text(json.dumps(sbom, indent=2) + "\n")
    kinds: dict[str, int] = {}
    for component in sbom["components"]:
        kind = component["purl"].split("/", 1)[0].removeprefix("pkg:")
        kinds[kind] = kinds.get(kind, 0) + 1
    size = oci.uncompressed_size(archive)
    lines = [
        f"archive: {archive.relative_to(ROOT)} ({archive.stat().st_size / 1e6:.1f} MB compressed)",
        f"size: {size / 1e6:.1f} MB uncompressed ({size / 2**20:.1f} MiB), " + verdict(size / 1e6, SIZE_GOAL_MB, "MB"),
        "largest folders: "
        + ", ".join(f"{key} {bytes_ / 1e6:.1f} MB" for bytes_, key in biggest(rootfs, 3, 4))
        + "; in the venv: "
        + ", ".join(
            f"{Path(key).name} {bytes_ / 1e6:.1f} MB" for bytes_, key in biggest(rootfs / "opt/gpuscaler/lib", 3, 4)
        ),
        f"shell: {'none' if distroless else 'the base image has one'}; `gpuscaler --version`: {version_line}",
        f"extension modules: {imports.stdout.strip().splitlines()[0]}",
        f"SBOM: {sbom_copy.relative_to(ROOT)}, {len(sbom['components'])} components "
        + ", ".join(f"{count} {kind}" for kind, count in sorted(kinds.items())),
    ]
    if arch == host_architecture():
        elapsed, how = time_to_serving(rootfs, config, work)
        lines.append(f"start -> SERVING: {elapsed:.3f} s ({how}), " + verdict(elapsed, SERVING_GOAL_SECONDS, "s"))
    else:
        lines.append("start -> SERVING: not measured (emulated architecture)")
    return Report(lines)


# --- make image --------------------------------------------------------------------------------------------------


def archive_path(version: str, arch: str) -> Path:
    """``build/image/gpuscaler-<version>-<arch>.oci.tar``, which ``make e2e-node`` imports."""
    return OUTPUT / f"gpuscaler-{version}-{arch}.oci.tar"


def build(arch: str, python_image: str, requested_engine: str) -> Path:
    """Builds, saves and checks the image; returns the archive."""
    started = time.monotonic()
    version, revision = project_version(), git_revision()
    OUTPUT.mkdir(parents=True, exist_ok=True)
    engine = choose_engine(requested_engine)
    emulation = emulate(arch) if arch != host_architecture() else None
    work = Path(tempfile.mkdtemp(prefix="image-", dir=cache_dir()))
    try:
        build_args = {"VERSION": version, "REVISION": revision}
        if python_image:
            build_args |= {"PYTHON_IMAGE": python_image, "RUNTIME_IMAGE": python_image}
        else:
            build_args["PYTHON_IMAGE"], build_args["RUNTIME_IMAGE"] = debian_bases(engine, arch, work)
        volumes: list[str] = []
        if engine.mounts_volumes:
            pip = host_pip_settings()
            (work / "pip.conf").write_text(pip.config)
            volumes.append(f"{work / 'pip.conf'}:{BUILD_PIP_CONF}:ro")
            if pip.ca_bundle is not None:
                volumes.append(f"{pip.ca_bundle}:{BUILD_CA}:ro")
        else:
            log(f"{engine.name} cannot mount this machine's pip configuration: pip in the build uses its defaults")
        tags = [f"{NAME}:{version}-{arch}"] + ([f"{NAME}:{version}"] if arch == host_architecture() else [])
        engine.build(ROOT / "Containerfile", ROOT, tags, arch, build_args, volumes)
        engine.cleanup()
        archive = archive_path(version, arch)
        engine.save(tags[0], archive, f"{NAME}:{version}")
        built = time.monotonic() - started
        report = check_archive(archive, arch, version, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        engine.close()
        if emulation is not None:
            emulation.close()
    print(f"\ngpuscaler {version} ({arch}, revision {revision}), built with {engine.name} in {built:.0f} s")
    print(f"image: {', '.join(tags)} in {engine.name}'s storage")
    for line in [*report.lines, *engine.notes]:
        print(f"  {line}")
    print(f"  import it into containerd: ctr -n k8s.io images import {archive.relative_to(ROOT)}")
    return archive


def main(argv: Sequence[str] | None = None) -> int:
    """``image`` (the default) or ``lock``."""
    parser = argparse.ArgumentParser(prog="python -m image.build", description=__doc__.split("\n")[0])
    parser.add_argument("action", nargs="?", default="image", choices=("image", "lock"))
    parser.add_argument("--arch", default="", help="amd64 or arm64 (default: this machine's)")
    parser.add_argument(
        "--python-image", default=os.environ.get("PYTHON_IMAGE", ""), help="an upstream base instead of Debian's"
    )
    parser.add_argument("--engine", default=os.environ.get("ENGINE", ""), help="buildah, podman or docker")
    args = parser.parse_args(argv)
    arch = args.arch or host_architecture()
    if arch not in QEMU:
        parser.error(f"--arch {arch}: amd64 or arm64")
    with build_lock():
        try:
            if args.action == "lock":
                pin_lock(arch)
            else:
                build(arch, args.python_image, args.engine)
        except debian.LockMismatch as error:
            print(f"make image: {error}", file=sys.stderr)
            return 1
        except subprocess.CalledProcessError as error:
            print(f"make image: {' '.join(map(str, error.cmd))} failed (exit {error.returncode})", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
