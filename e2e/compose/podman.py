"""podman's Docker-compatible API socket, run from the unpacked Debian packages with a private configuration and
private folders, and every trace of it removed afterwards.

Nothing of the machine's container setup is read or written: CONTAINERS_CONF, CONTAINERS_STORAGE_CONF and
CONTAINERS_REGISTRIES_CONF name files of the run (never /etc/containers), HOME holds the signature policy, and the
storage, run, volume, network and temporary folders are the run's. What this kind of machine (Debian 12, root,
cgroup v1 in a VM, no CAP_SYS_RESOURCE) needs is in that configuration: runc (crun refuses the hybrid cgroup
layout), ``nofile`` no higher than ``ulimit -Hn`` and ``nproc`` at most 32768 (podman asks for more and fails in
setrlimit), the cgroupfs cgroup manager and the file events logger.

A few paths are fixed in podman 4.3 and netavark (``/run/containers/networks``, ``/run/netns``, the blob-info
cache under ``/var/lib/containers``): the suite runs in a mount namespace of its own (``python -m e2e.compose``),
where they are bind mounts of folders of the run; the mount points it had to create are removed at the end.
Its network namespace is its own too, so netavark's bridge, its iptables chains and its sysctls never reach the
machine's; the chains are deleted anyway, and the session checks that none is left.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import shlex
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from e2e.node.host import mounts_under

# podman 4.3's and netavark's fixed paths, shadowed by folders of the run in the suite's mount namespace.
SHADOWED = ("/run/containers", "/run/netns", "/var/lib/containers")
CGROUP_ROOT = Path("/sys/fs/cgroup")
# The cgroup podman's cgroupfs manager puts containers and conmon under, in every hierarchy.
CGROUP_PARENT = "libpod_parent"
# The most processes podman may ask for a container (its default asks for more, which setrlimit refuses here).
NPROC_LIMIT = 32768
CHAIN_PREFIX = "NETAVARK"
SERVICE_START_SECONDS = 60.0


class PodmanFailed(AssertionError):
    """A podman command failed; the message has its output."""


def cgroups_of_podman() -> set[Path]:
    """The cgroup folders podman's cgroupfs manager makes (``libpod_parent`` in each hierarchy, v1 or v2)."""
    return set(CGROUP_ROOT.glob(f"*/{CGROUP_PARENT}")) | set(CGROUP_ROOT.glob(CGROUP_PARENT))


@dataclass
class PrivatePodman:
    """podman from ``root`` (the unpacked packages) with all its state under ``state``."""

    root: Path
    state: Path
    service: subprocess.Popen[bytes] | None = None
    created: list[Path] = field(default_factory=list)
    mounted: list[Path] = field(default_factory=list)
    cgroups_before: set[Path] = field(default_factory=set)

    @property
    def socket(self) -> Path:
        """The Docker-compatible API's unix socket."""
        return self.state / "podman.sock"

    @property
    def docker_host(self) -> str:
        """DOCKER_HOST for a Docker client of this podman."""
        return f"unix://{self.socket}"

    @property
    def service_log(self) -> Path:
        """What ``podman system service`` wrote."""
        return self.state / "service.log"

    def _libraries(self) -> str:
        return ":".join(str(path) for path in sorted(self.root.glob("usr/lib/*-linux-gnu")) if path.is_dir())

    def environment(self) -> dict[str, str]:
        """The environment podman (and conmon, and the cleanup podman conmon runs) gets: the unpacked programs and
        libraries first, and the run's configuration files."""
        (xtables,) = self.root.glob("usr/lib/*-linux-gnu/xtables")
        config = self.state / "config"
        programs = [self.state / "bin", self.root / "usr/sbin", self.root / "usr/bin"]
        return {
            "PATH": ":".join([*map(str, programs), "/usr/sbin", "/usr/bin", "/sbin", "/bin"]),
            "LD_LIBRARY_PATH": self._libraries(),
            "XTABLES_LIBDIR": str(xtables),
            "CONTAINERS_CONF": str(config / "containers.conf"),
            "CONTAINERS_STORAGE_CONF": str(config / "storage.conf"),
            "CONTAINERS_REGISTRIES_CONF": str(config / "registries.conf"),
            # containers/image reads $HOME/.config/containers/policy.json before /etc/containers/policy.json.
            "HOME": str(self.state / "home"),
            "TMPDIR": str(self.state / "tmp"),
        }

    def write_config(self) -> None:
        """The run's containers.conf, storage.conf, registries.conf and policy.json, and ``iptables`` for netavark
        (iptables-nft from the packages: netavark runs whichever ``iptables`` is on PATH)."""
        for folder in ("config", "home/.config/containers", "tmp", "bin", "shadow", "storage", "run"):
            (self.state / folder).mkdir(parents=True, exist_ok=True)
        for name in ("iptables", "ip6tables", "iptables-save", "ip6tables-save"):
            (self.state / "bin" / name).symlink_to(self.root / "usr/sbin/xtables-nft-multi")
        nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        nproc = min(resource.getrlimit(resource.RLIMIT_NPROC)[1], NPROC_LIMIT)
        if nproc == resource.RLIM_INFINITY:
            nproc = NPROC_LIMIT
        environment = self.environment()
        # conmon starts with only these variables, and runs runc and podman's cleanup command with them.
        conmon_env = [f"{key}={environment[key]}" for key in ("PATH", "LD_LIBRARY_PATH", "XTABLES_LIBDIR")]
        conmon_env += [f"{key}={environment[key]}" for key in environment if key.startswith("CONTAINERS_")]
        state = self.state
        settings: dict[str, dict[str, object]] = {
            "containers": {
                "default_ulimits": [f"nofile={nofile}:{nofile}", f"nproc={nproc}:{nproc}"],
                "seccomp_profile": self.root / "usr/share/containers/seccomp.json",
            },
            "network": {"network_backend": "netavark", "network_config_dir": state / "networks"},
            "engine": {
                "cgroup_manager": "cgroupfs",
                "events_logger": "file",
                "events_logfile_path": state / "events.log",
                "runtime": "runc",
                "conmon_path": [self.root / "usr/bin/conmon"],
                "conmon_env_vars": conmon_env,
                "helper_binaries_dir": [self.root / "usr/lib/podman"],
                "tmp_dir": state / "libpod-tmp",
                "volume_path": state / "volumes",
                "static_dir": state / "libpod",
                "image_copy_tmp_dir": state / "tmp",
            },
            "engine.runtimes": {"runc": [self.root / "usr/sbin/runc"]},
        }
        (state / "config" / "containers.conf").write_text(_toml(settings))
        storage: dict[str, dict[str, object]] = {
            "storage": {"driver": "overlay", "graphroot": state / "storage", "runroot": state / "run"}
        }
        (state / "config" / "storage.conf").write_text(_toml(storage))
        # Short names resolve to local images only (compose.yaml's gpuscaler:0.1.0 is localhost/gpuscaler:0.1.0).
        (state / "config" / "registries.conf").write_text("unqualified-search-registries = []\n")
        policy = self.root / "etc/containers/policy.json"
        (state / "home/.config/containers/policy.json").write_text(policy.read_text())

    def shadow(self) -> None:
        """Binds a folder of the run over each of podman's fixed paths (this process must be in a mount namespace
        of its own), creating the mount points the machine lacks; ``unshadow`` undoes both."""
        for fixed in SHADOWED:
            target = Path(fixed)
            if not target.exists():
                missing = [target, *(parent for parent in target.parents if not parent.exists())]
                target.mkdir(parents=True)
                self.created.extend(reversed(missing))
            source = self.state / "shadow" / fixed.strip("/").replace("/", "-")
            source.mkdir(parents=True, exist_ok=True)
            # -n: no record in /run/mount/utab, which is the machine's file (only the mount table is private).
            _check(["mount", "-n", "--bind", str(source), str(target)])
            self.mounted.append(target)

    def unshadow(self) -> list[str]:
        """Unmounts what ``shadow`` mounted (and anything mounted under it) and removes the mount points it
        created; returns what it could not undo."""
        problems = []
        for target in reversed(self.mounted):
            while mounts_under(target):
                result = subprocess.run(["umount", "-n", "--recursive", str(target)], capture_output=True, text=True)
                if result.returncode != 0:
                    problems.append(f"umount -R {target}: {result.stderr.strip()}")
                    break
        self.mounted.clear()
        for folder in reversed(self.created):
            try:
                folder.rmdir()
            except OSError as error:
                problems.append(f"could not remove {folder}, which the suite created: {error.strerror}")
        self.created.clear()
        return problems

    def podman(self, *args: str, timeout: float = 300) -> str:
        """Runs one podman command; its stdout, or PodmanFailed with its output."""
        return _check([str(self.root / "usr/bin/podman"), *args], env=self.environment(), timeout=timeout)

    def start(self) -> None:
        """Starts ``podman system service`` on the socket and waits until it answers."""
        self.cgroups_before = cgroups_of_podman()
        with self.service_log.open("wb") as log:
            self.service = subprocess.Popen(
                [str(self.root / "usr/bin/podman"), "system", "service", "--time", "0", self.docker_host],
                env=self.environment(),
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + SERVICE_START_SECONDS
        while True:
            if self.service.poll() is not None:
                raise PodmanFailed(f"podman system service exited {self.service.returncode}:\n{self.log_tail()}")
            with contextlib.suppress(PodmanFailed):
                self.podman("--remote", "--url", self.docker_host, "version", timeout=30)
                return
            if time.monotonic() > deadline:
                raise PodmanFailed(f"podman system service did not answer in {SERVICE_START_SECONDS:g} s")
            time.sleep(0.2)

    def log_tail(self, lines: int = 40) -> str:
        """The end of the service's log."""
        if not self.service_log.exists():
            return ""
        return "\n".join(self.service_log.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> list[str]:
        """Removes every container, pod, network, volume and image (``podman system reset``), stops the service,
        deletes netavark's iptables chains, and removes the cgroups podman made; returns what was left."""
        problems = []
        if self.service is not None and self.service.poll() is None:
            self.service.send_signal(signal.SIGTERM)
            try:
                self.service.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.service.kill()
                self.service.wait()
                problems.append("podman system service did not stop at SIGTERM within 30 s")
        try:
            self.podman("system", "reset", "--force")
        except PodmanFailed as error:
            problems.append(str(error))
        problems += self.remove_chains()
        problems += self.remove_cgroups()
        return problems

    def iptables(self, *args: str) -> str:
        """Runs the unpacked iptables (the one netavark ran)."""
        return _check([str(self.state / "bin" / "iptables"), *args], env=self.environment())

    def chains(self) -> dict[str, list[str]]:
        """netavark's chains, by table."""
        found: dict[str, list[str]] = {}
        for table in ("filter", "nat", "mangle"):
            rules = self.iptables("-t", table, "-S").splitlines()
            chains = [line.split()[1] for line in rules if line.startswith(f"-N {CHAIN_PREFIX}")]
            if chains:
                found[table] = chains
        return found

    def remove_chains(self) -> list[str]:
        """Deletes the jumps into netavark's chains and then the chains (netavark 1.4 leaves them after the last
        network is gone); returns what could not be deleted."""
        for table in self.chains():
            for line in self.iptables("-t", table, "-S").splitlines():
                words = shlex.split(line)
                if words[0] == "-A" and not words[1].startswith(CHAIN_PREFIX) and CHAIN_PREFIX in line:
                    self.iptables("-t", table, "-D", *words[1:])
        for table, chains in self.chains().items():
            for chain in chains:
                self.iptables("-t", table, "-F", chain)
            for chain in chains:
                self.iptables("-t", table, "-X", chain)
        return [f"iptables chains left in {table}: {', '.join(chains)}" for table, chains in self.chains().items()]

    def remove_cgroups(self) -> list[str]:
        """Removes the cgroup folders podman made (empty once every container is gone), deepest first."""
        problems = []
        for parent in sorted(cgroups_of_podman() - self.cgroups_before):
            for folder in sorted((p for p in parent.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
                with contextlib.suppress(FileNotFoundError):
                    folder.rmdir()
            try:
                parent.rmdir()
            except OSError as error:
                problems.append(f"cgroup {parent} left: {error.strerror}")
        return problems


def _check(argv: list[str], env: dict[str, str] | None = None, timeout: float = 120) -> str:
    result = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0:
        raise PodmanFailed(
            f"{' '.join(argv)} failed ({result.returncode}):\n{result.stdout[-3000:]}{result.stderr[-3000:]}"
        )
    return result.stdout


def _toml(tables: dict[str, dict[str, object]]) -> str:
    """A TOML document of tables of strings, paths, numbers and lists of them: each value as JSON writes it, which
    TOML reads the same (basic strings, arrays, integers)."""
    lines = []
    for table, settings in tables.items():
        lines.append(f"[{table}]")
        lines += [f"{key} = {json.dumps(item, default=str)}" for key, item in settings.items()]
        lines.append("")
    return "\n".join(lines)


def other_processes_in_this_network_namespace() -> list[str]:
    """Processes other than this one in this process's network namespace: what the suite started and did not stop
    (the namespace is the suite's own)."""
    mine = os.stat("/proc/self/ns/net").st_ino
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            if (entry / "ns/net").stat().st_ino == mine:
                command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
                found.append(f"pid {entry.name}: {command or '(exited)'}")
    return found


def machine_traces(root: Path) -> dict[str, str]:
    """What this machine shows of podman, netavark and the suite, by what it is: podman on PATH and what its `info`
    says, the fixed paths, mounts under them, podman's cgroups, and netavark's iptables chains (read with the
    unpacked iptables). The same before and after a run means the run left nothing there."""
    found = {}
    podman = shutil.which("podman")
    found["podman on PATH"] = podman or "none"
    if podman is not None:
        info = subprocess.run(
            [podman, "info", "--format", "{{.Store.GraphRoot}} containers={{.Store.ContainerStore.Number}} "
             "images={{.Store.ImageStore.Number}}"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        found["podman info"] = f"exit {info.returncode}: {info.stdout.strip()}"
    for fixed in SHADOWED:
        path = Path(fixed)
        found[fixed] = "absent" if not path.exists() else f"holds {sorted(entry.name for entry in path.iterdir())}"
    found["mounts there"] = " ".join(mounts_under(*SHADOWED)) or "none"
    found["podman's cgroups"] = " ".join(map(str, sorted(cgroups_of_podman()))) or "none"
    (xtables,) = root.glob("usr/lib/*-linux-gnu/xtables")
    libraries = ":".join(str(path) for path in sorted(root.glob("usr/lib/*-linux-gnu")))
    for table in ("filter", "nat", "mangle"):
        listed = subprocess.run(
            [str(root / "usr/sbin/xtables-nft-multi"), "iptables", "-t", table, "-S"],
            env={**os.environ, "LD_LIBRARY_PATH": libraries, "XTABLES_LIBDIR": str(xtables)},
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        chains = [line.split()[1] for line in listed.stdout.splitlines() if line.startswith(f"-N {CHAIN_PREFIX}")]
        found[f"iptables {table} chains {CHAIN_PREFIX}*"] = " ".join(chains) or (
            "none" if listed.returncode == 0 else f"unreadable: {listed.stderr.strip()}"
        )
    return found
