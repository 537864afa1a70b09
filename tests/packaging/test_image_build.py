"""What `make image` relies on, checked without building: the Debian lock files, the version-mismatch message, the
runtime's cut (no shell), the SBOM, the pip settings carried into the build, and the archive reader."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from image import debian, oci, sbom
from image.build import BUILD_CA, answers, engine_choice, pip_settings, trial_context, verdict
from image.dpkg import closure, parse_status

ROOT = Path(__file__).resolve().parents[2]
LOCKS = sorted((ROOT / "image").glob("debian-packages-*.lock"))
# Debian policy 5.6.1 and 5.6.12: package names, and [epoch:]upstream[-revision] versions.
PACKAGE_NAME = re.compile(r"[a-z0-9][a-z0-9+.\-]+")
VERSION = re.compile(r"(\d+:)?[0-9][A-Za-z0-9.+~\-]*")


def paragraph(name: str, version: str = "1.0", depends: str = "", provides: str = "", arch: str = "amd64") -> str:
    """One installed package's paragraph of a dpkg status file."""
    lines = [f"Package: {name}", "Status: install ok installed", f"Architecture: {arch}", f"Version: {version}"]
    lines += [f"Depends: {depends}"] if depends else []
    lines += [f"Provides: {provides}"] if provides else []
    return "\n".join(lines) + "\n"


def test_there_is_a_lock_for_amd64() -> None:
    """The architecture CI and most nodes run has its lock committed."""
    assert debian.lock_path(ROOT, "amd64") in LOCKS


@pytest.mark.parametrize("lock", LOCKS, ids=lambda path: path.name)
def test_every_lock_line_pins_one_package_to_an_exact_version(lock: Path) -> None:
    """Each line is NAME=VERSION in Debian's syntax, sorted, once; the build's and the runtime's roots are there."""
    versions = debian.parse_lock(lock.read_text())
    bad = [f"{name}={version}" for name, version in versions.items()]
    bad = [line for line in bad if not re.fullmatch(f"{PACKAGE_NAME.pattern}={VERSION.pattern}", line)]
    assert not bad, f"malformed pins in {lock.name}: {bad}"
    assert list(versions) == sorted(versions)
    missing = set(debian.BUILD_PACKAGES + debian.RUNTIME_ROOTS) - set(versions)
    assert not missing, f"{lock.name} lacks {missing}"


def test_a_malformed_lock_line_is_named() -> None:
    """A line that is not NAME=VERSION fails with its number and text."""
    with pytest.raises(ValueError, match=r"line 3: 'libc6 2.36' is not a new NAME=VERSION"):
        debian.parse_lock("# comment\nbash=5.2\nlibc6 2.36\n")
    with pytest.raises(ValueError, match="line 2"):
        debian.parse_lock("bash=5.2\nbash=5.3\n")


def test_the_archive_moving_on_names_each_package_and_both_versions(tmp_path: Path) -> None:
    """A build whose packages differ from the lock fails naming the package, the locked version, the archive's
    version now, and the command that re-pins."""
    status = paragraph("libc6", "2.36-9+deb12u14") + "\n" + paragraph("libnew1", "0.5-1")
    lock = debian.Lock(tmp_path / "debian-packages-arm64.lock", {"libc6": "2.36-9+deb12u13", "libold1": "1.0"})
    with pytest.raises(debian.LockMismatch) as raised:
        debian.check_against_lock(parse_status(status), lock)
    message = str(raised.value)
    assert "libc6: locked 2.36-9+deb12u13, the archive now has 2.36-9+deb12u14" in message
    assert "libnew1: not in the lock; the archive has 0.5-1" in message
    assert "libold1: locked 1.0, no longer installed" in message
    assert "make image-lock IMAGE_ARCH=arm64" in message


def test_a_build_at_the_locked_versions_passes() -> None:
    """Installed versions equal to the lock's raise nothing."""
    lock = debian.Lock(Path("debian-packages-amd64.lock"), {"libc6": "2.36-9"})
    debian.check_against_lock(parse_status(paragraph("libc6", "2.36-9")), lock)


def test_apt_is_pinned_to_every_locked_version() -> None:
    """The preferences file gives each locked version a priority above any other (1001)."""
    text = debian.apt_preferences({"libc6": "2.36-9", "bash": "5.2"})
    assert text == (
        "Package: bash\nPin: version 5.2\nPin-Priority: 1001\n\n"
        "Package: libc6\nPin: version 2.36-9\nPin-Priority: 1001\n\n"
    )


def test_the_lock_text_reads_back_as_the_packages() -> None:
    """lock_text and parse_lock agree, so `make image-lock` writes what `make image` reads."""
    packages = parse_status(paragraph("zlib1g", "1:1.2.13") + "\n" + paragraph("bash", "5.2.15-2+b13"))
    text = debian.lock_text(packages.values(), "amd64")
    assert debian.parse_lock(text) == {"bash": "5.2.15-2+b13", "zlib1g": "1:1.2.13"}


def test_the_closure_takes_the_first_alternative_and_providers_and_never_enters_cut() -> None:
    """Dependencies are followed through "a | b" (the first not cut) and virtual names; a cut package and what
    only it needs stay out."""
    status = "\n".join(
        [
            paragraph("app", depends="libc6 (>= 2.34), debconf (>= 0.5) | debconf-2.0, mail-transport-agent"),
            paragraph("libc6", depends="libgcc-s1"),
            paragraph("libgcc-s1"),
            paragraph("debconf", depends="perl-base"),
            paragraph("perl-base"),
            paragraph("exim", provides="mail-transport-agent", depends="libc6"),
            paragraph("tool", depends="dpkg | install-info"),
            paragraph("dpkg"),
        ]
    )
    packages = parse_status(status)
    assert closure(packages, ["app"], cut=["debconf"]) == {"app", "libc6", "libgcc-s1", "exim"}
    assert closure(packages, ["tool"], cut=["dpkg"]) == {"tool"}
    with pytest.raises(KeyError, match="not installed: absent"):
        closure(packages, ["absent"], cut=[])


def _fake_package(root: Path, name: str, files: dict[str, str | None], depends: str = "") -> str:
    """Writes a package's files (None: a folder) and its dpkg file list into ``root``; returns its paragraph."""
    listing = ["/."]
    for path, content in files.items():
        target = debian.resolve(root, path)
        if content is None:
            target.mkdir(parents=True, exist_ok=True)
        elif content.startswith("->"):
            target.parent.mkdir(parents=True, exist_ok=True)
            target.symlink_to(content.removeprefix("->"))
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(content)
        listing.append(path)
    info = root / "var/lib/dpkg/info"
    info.mkdir(parents=True, exist_ok=True)
    (info / f"{name}.list").write_text("\n".join(listing) + "\n")
    return paragraph(name, depends=depends)


@pytest.fixture
def build_rootfs(tmp_path: Path) -> Path:
    """A tiny merged-/usr rootfs shaped as mmdebstrap leaves one: an interpreter, libc, a shell, dpkg."""
    root = tmp_path / "build"
    (root / "usr/bin").mkdir(parents=True)
    (root / "usr/lib").mkdir()
    (root / "bin").symlink_to("usr/bin")
    (root / "lib").symlink_to("usr/lib")
    triplet = "x86_64-linux-gnu"
    paragraphs = [
        _fake_package(
            root,
            "python3.11-minimal",
            {"/usr/bin/python3.11": "ELF"},
            depends="libc6 (>= 2.35), libpython3.11-minimal",
        ),
        _fake_package(root, "python3-minimal", {"/usr/bin/python3": "->python3.11"}, depends="dpkg (>= 1.13.20)"),
        _fake_package(
            root,
            "libpython3.11-stdlib",
            {
                "/usr/lib/python3.11": None,
                "/usr/lib/python3.11/os.py": "import sys\n",
                f"/usr/lib/python3.11/lib-dynload/_ssl.cpython-311-{triplet}.so": "ELF",
                f"/usr/lib/python3.11/lib-dynload/_sqlite3.cpython-311-{triplet}.so": "ELF",
                "/usr/lib/python3.11/test/regrtest.py": "",
            },
            depends="libsqlite3-0, media-types | mime-support",
        ),
        _fake_package(root, "libpython3.11-minimal", {"/usr/lib/python3.11/abc.py": ""}),
        _fake_package(
            root,
            "libc6",
            {
                f"/lib/{triplet}/libc.so.6": "ELF",
                f"/usr/lib/{triplet}/gconv/UTF-16.so": "ELF",
                "/usr/share/doc/libc6/copyright": "GPL",
                "/usr/share/doc/libc6/changelog.Debian.gz": "log",
            },
        ),
        _fake_package(root, "libsqlite3-0", {f"/usr/lib/{triplet}/libsqlite3.so.0": "ELF"}),
        _fake_package(root, "mime-support", {"/etc/mime.types": "text/plain txt\n"}),
        _fake_package(root, "ca-certificates", {"/usr/share/ca-certificates/a.crt": "PEM"}, depends="openssl"),
        _fake_package(root, "openssl", {"/usr/bin/openssl": "ELF"}),
        _fake_package(root, "base-files", {"/usr/lib/os-release": "ID=debian\n"}),
        _fake_package(root, "libstdc++6", {f"/usr/lib/{triplet}/libstdc++.so.6": "ELF"}),
        _fake_package(root, "dash", {"/bin/dash": "ELF", "/bin/sh": "->dash"}),
        _fake_package(root, "dpkg", {"/usr/bin/dpkg": "ELF"}),
    ]
    (root / "usr/lib/python3.11/__pycache__").mkdir()
    (root / "usr/lib/python3.11/__pycache__/os.cpython-311.pyc").write_text("pyc")
    (root / "etc/ssl/certs").mkdir(parents=True)
    (root / "etc/ssl/certs/ca-certificates.crt").write_text("BUNDLE")
    (root / "var/lib/dpkg/status").write_text("\n".join(paragraphs))
    return root


def test_the_runtime_tree_keeps_the_interpreter_and_its_libraries_and_no_shell(
    build_rootfs: Path, tmp_path: Path
) -> None:
    """The runtime holds the closure's files (through merged /usr), the generated CA bundle and the stdlib's .pyc;
    not dash, dpkg, openssl's command, cut libraries' modules, documentation beyond copyright, gconv or tests."""
    installed = parse_status((build_rootfs / "var/lib/dpkg/status").read_text())
    runtime = tmp_path / "runtime"
    kept = debian.runtime_tree(build_rootfs, runtime, installed)
    assert kept == {
        "python3.11-minimal",
        "python3-minimal",
        "libpython3.11-stdlib",
        "libpython3.11-minimal",
        "libc6",
        "mime-support",
        "ca-certificates",
        "base-files",
        "libstdc++6",
    }
    present = {str(path.relative_to(runtime)) for path in runtime.rglob("*")}
    for path in (
        "usr/bin/python3.11",
        "usr/bin/python3",
        "usr/lib/x86_64-linux-gnu/libc.so.6",
        "usr/lib/python3.11/__pycache__/os.cpython-311.pyc",
        "usr/lib/python3.11/lib-dynload/_ssl.cpython-311-x86_64-linux-gnu.so",
        "usr/share/doc/libc6/copyright",
        "etc/ssl/certs/ca-certificates.crt",
        "etc/mime.types",
    ):
        assert path in present, path
    for path in (
        "usr/bin/dash",
        "usr/bin/sh",
        "usr/bin/dpkg",
        "usr/bin/openssl",
        "usr/lib/x86_64-linux-gnu/libsqlite3.so.0",
        "usr/lib/python3.11/lib-dynload/_sqlite3.cpython-311-x86_64-linux-gnu.so",
        "usr/lib/python3.11/test/regrtest.py",
        "usr/lib/x86_64-linux-gnu/gconv/UTF-16.so",
        "usr/share/doc/libc6/changelog.Debian.gz",
    ):
        assert path not in present, path
    assert (runtime / "bin").is_symlink()
    assert debian.forbidden_commands(runtime) == []
    assert "/bin/sh" in debian.forbidden_commands(build_rootfs)
    assert set(parse_status((runtime / "var/lib/dpkg/status").read_text())) == kept
    assert "nonroot:x:65532:65532:" in (runtime / "etc/passwd").read_text()
    assert (runtime / "tmp").stat().st_mode & 0o1777 == 0o1777


def test_the_sbom_lists_debian_packages_and_python_distributions(tmp_path: Path) -> None:
    """The SBOM is CycloneDX 1.5 with a purl per Debian package (version percent-encoded) and per distribution,
    the same bytes for the same input, and an interpreter component only where no Debian package carries it."""
    site = tmp_path / "venv/lib/python3.11/site-packages"
    for name, version, licence in (("kubernetes_asyncio", "36.1.0", None), ("gpuscaler", "0.1.0", "Apache-2.0")):
        info = site / f"{name}-{version}.dist-info"
        info.mkdir(parents=True)
        expression = f"License-Expression: {licence}\n" if licence else ""
        (info / "METADATA").write_text(f"Metadata-Version: 2.4\nName: {name}\nVersion: {version}\n{expression}\n")
    status = tmp_path / "status"
    status.write_text(paragraph("libc6", "2.36-9+deb12u14") + "\n" + paragraph("zlib1g", "1:1.2.13.dfsg-1"))
    release = tmp_path / "os-release"
    release.write_text('PRETTY_NAME="Debian GNU/Linux 12 (bookworm)"\nID=debian\nVERSION_ID="12"\n')
    output = tmp_path / "sbom.cdx.json"
    arguments = ["--name", "gpuscaler", "--version", "0.1.0", "--dpkg-status", str(status)]
    arguments += ["--os-release", str(release), "--venv", str(tmp_path / "venv"), "--output", str(output)]
    assert sbom.main(arguments) == 0
    document = json.loads(output.read_text())
    assert (document["bomFormat"], document["specVersion"]) == ("CycloneDX", "1.5")
    assert document["metadata"]["component"]["name"] == "gpuscaler"
    purls = [component["purl"] for component in document["components"]]
    assert purls[:2] == [
        "pkg:deb/debian/libc6@2.36-9%2Bdeb12u14?arch=amd64&distro=debian-12",
        "pkg:deb/debian/zlib1g@1%3A1.2.13.dfsg-1?arch=amd64&distro=debian-12",
    ]
    assert "pkg:pypi/kubernetes-asyncio@36.1.0" in purls
    assert any(purl.startswith("pkg:generic/cpython@") for purl in purls), "no Debian python3.X-minimal here"
    licences = {c["name"]: c.get("licenses") for c in document["components"]}
    assert licences["gpuscaler"] == [{"expression": "Apache-2.0"}]
    first = output.read_bytes()
    assert sbom.main(arguments) == 0
    assert output.read_bytes() == first
    packages = parse_status(paragraph("python3.11-minimal", "3.11.2-6"))
    assert sbom.carries_interpreter(packages.values(), "3.11.2")


def test_pip_in_the_build_gets_the_index_and_ca_but_no_host_paths(tmp_path: Path) -> None:
    """The index, timeout and trusted hosts are carried; find-links (a path here) is not; the CA bundle pip uses
    here is mounted and named at its mount point."""
    bundle = tmp_path / "ca.pem"
    bundle.write_text("PEM")
    listed = "\n".join(
        [
            "global.index-url='https://index.example.com/simple'",
            f"global.cert='{bundle}'",
            ":env:.default-timeout='180'",
            ":env:.find-links='/opt/wheels'",
            "install.trusted-host='index.example.com'",
        ]
    )
    settings = pip_settings(listed, {}, None)
    assert settings.ca_bundle == bundle
    assert settings.config == (
        "[global]\ndefault-timeout = 180\nindex-url = https://index.example.com/simple\n"
        f"trusted-host = index.example.com\ncert = {BUILD_CA}\n"
    )
    assert pip_settings("", {"SSL_CERT_FILE": str(bundle)}, None).ca_bundle == bundle
    assert pip_settings("", {}, str(tmp_path / "missing.pem")) == pip_settings("", {}, None)


def _layer(entries: list[tuple[str, str | None, str]]) -> bytes:
    """A gzip layer of (name, content or None for a folder, symlink target or "")."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as layer:
        for name, content, link in entries:
            info = tarfile.TarInfo(name)
            if link:
                info.type, info.linkname = tarfile.SYMTYPE, link
                layer.addfile(info)
            elif content is None:
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                layer.addfile(info)
            else:
                info.size = len(content)
                layer.addfile(info, io.BytesIO(content.encode()))
    return gzip.compress(buffer.getvalue())


def _archive(path: Path, layers: list[bytes]) -> None:
    """An OCI archive of one image with ``layers``."""
    blobs: dict[str, bytes] = {}

    def add(data: bytes) -> dict[str, object]:
        digest = hashlib.sha256(data).hexdigest()
        blobs[digest] = data
        return {"digest": f"sha256:{digest}", "size": len(data)}

    config = json.dumps({"architecture": "amd64", "config": {"User": "65532:65532"}}).encode()
    manifest = json.dumps({"config": add(config), "layers": [add(layer) for layer in layers]}).encode()
    index = json.dumps({"manifests": [add(manifest)]}).encode()
    with tarfile.open(path, "w") as archive:
        for name, data in [("index.json", index), *((f"blobs/sha256/{d}", b) for d, b in blobs.items())]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))


def test_an_archive_unpacks_with_its_whiteouts(tmp_path: Path) -> None:
    """Layers apply in order: a whiteout removes a file, an opaque folder drops what lower layers put in it; the
    size is the layers' uncompressed bytes."""
    lower = _layer([("etc", None, ""), ("etc/a", "a", ""), ("etc/b", "b", ""), ("dir", None, ""), ("dir/x", "x", "")])
    upper = _layer([("etc/.wh.a", "", ""), ("dir/.wh..wh..opq", "", ""), ("dir/y", "y", "")])
    archive = tmp_path / "image.oci.tar"
    _archive(archive, [lower, upper])
    image = oci.unpack(archive, tmp_path / "rootfs")
    assert image.config["config"]["User"] == "65532:65532"
    files = sorted(str(p.relative_to(tmp_path / "rootfs")) for p in (tmp_path / "rootfs").rglob("*"))
    assert files == ["dir", "dir/y", "etc", "etc/b"]
    assert oci.uncompressed_size(archive) == len(gzip.decompress(lower)) + len(gzip.decompress(upper))


def test_an_archive_entry_cannot_write_through_a_symlink_out_of_the_root(tmp_path: Path) -> None:
    """A layer whose entry would land outside the root through an absolute symlink is refused, and nothing is
    written there."""
    outside = tmp_path / "outside"
    outside.mkdir()
    archive = tmp_path / "image.oci.tar"
    _archive(archive, [_layer([("escape", None, str(outside)), ("escape/evil", "x", "")])])
    with pytest.raises(ValueError, match="outside the root"):
        oci.unpack(archive, tmp_path / "rootfs")
    assert not (outside / "evil").exists()


def test_an_engine_answers_only_when_its_info_command_succeeds() -> None:
    """`docker info` with no daemon behind it exits non-zero: that engine is passed over (as is a missing one)."""
    assert answers([sys.executable, "-c", "pass"])
    assert not answers([sys.executable, "-c", "raise SystemExit(1)"])
    assert not answers(["/nonexistent/docker", "info"])


# crun 1.8's words on a hybrid cgroup v1 layout, as podman 4.3 prints them when a build reaches a RUN step.
CRUN_HYBRID = (
    "error running container: from /usr/bin/crun creating container for [/bin/true]: cgroups in hybrid mode not "
    "supported, drop all controllers from cgroupv2"
)


def _stand_in(folder: Path, name: str, info: int, build: int, log: Path) -> None:
    """A program called ``name`` in ``folder`` that logs its arguments; `info` exits ``info``, `build` prints crun's
    hybrid-cgroup error and exits ``build``, anything else exits 0."""
    script = folder / name
    script.write_text(
        f"#!{sys.executable}\n"
        "import sys\n"
        f"open({str(log)!r}, 'a').write({name!r} + ' ' + ' '.join(sys.argv[1:]) + '\\n')\n"
        f"if sys.argv[1] == 'info': sys.exit({info})\n"
        f"if sys.argv[1] == 'build':\n"
        f"    print({CRUN_HYBRID!r}, file=sys.stderr)\n"
        f"    sys.exit({build})\n"
    )
    script.chmod(0o755)


@pytest.fixture
def stand_ins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A folder first on PATH for stand-in engines, with a `docker` whose daemon does not answer; XDG_CACHE_HOME in
    the test's folder. Returns the log the stand-ins write their calls to."""
    folder = tmp_path / "bin"
    folder.mkdir()
    log = tmp_path / "calls.log"
    log.touch()
    _stand_in(folder, "docker", info=1, build=1, log=log)
    monkeypatch.setenv("PATH", f"{folder}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return log


def test_podman_that_answers_info_but_cannot_build_gives_way_to_buildah_with_one_line(
    stand_ins: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A podman whose `info` answers but whose trial build fails as crun does on a hybrid cgroup layout is passed
    over for buildah, and the one line says which engine, that its build failed, and the runtime's words."""
    _stand_in(stand_ins.parent / "bin", "podman", info=0, build=125, log=stand_ins)
    name, reason = engine_choice("")
    assert name == "buildah"
    assert reason is not None
    assert "\n" not in reason
    assert reason.startswith("podman answers `podman info` but `podman build` of a one-step trial failed")
    assert "cgroups in hybrid mode not supported" in reason
    assert reason.endswith(": building with buildah")
    calls = stand_ins.read_text().splitlines()
    assert calls[:2] == ["podman info", calls[1]]
    assert calls[1].startswith("podman build")
    assert "docker info" in calls  # docker was asked next, and its daemon did not answer
    assert not any(call.startswith("docker build") for call in calls)
    assert capsys.readouterr().err == ""  # the choice says nothing itself: make image logs the one line


def test_podman_that_builds_is_chosen_and_its_trial_image_removed(stand_ins: Path) -> None:
    """A podman whose trial build succeeds is the engine, with no line, and the trial's image is removed."""
    _stand_in(stand_ins.parent / "bin", "podman", info=0, build=0, log=stand_ins)
    assert engine_choice("") == ("podman", None)
    calls = stand_ins.read_text().splitlines()
    (build,) = [call for call in calls if call.startswith("podman build")]
    tag = build.split()[build.split().index("-t") + 1]
    assert f"podman rmi {tag}" in calls


def test_docker_that_builds_is_chosen_after_podman_that_cannot(stand_ins: Path) -> None:
    """When podman's trial fails and docker's runs, docker builds, and the one line says why podman did not."""
    _stand_in(stand_ins.parent / "bin", "podman", info=0, build=125, log=stand_ins)
    _stand_in(stand_ins.parent / "bin", "docker", info=0, build=0, log=stand_ins)
    name, reason = engine_choice("")
    assert name == "docker"
    assert reason is not None
    assert "cgroups in hybrid mode not supported" in reason
    assert reason.endswith(": building with docker")


def test_no_engine_answering_means_buildah_with_one_line(stand_ins: Path, tmp_path: Path) -> None:
    """Without an engine whose `info` answers, buildah is chosen and the line says so; an asked-for engine that does
    not answer fails naming it."""
    _stand_in(stand_ins.parent / "bin", "podman", info=1, build=0, log=stand_ins)
    assert engine_choice("") == (
        "buildah",
        "no container engine answers (podman info, docker info): building with buildah",
    )
    with pytest.raises(SystemExit, match="ENGINE=docker, but `docker info` does not answer"):
        engine_choice("docker")
    assert engine_choice("buildah") == ("buildah", None)


def test_the_trial_build_context_runs_a_program_with_its_libraries(tmp_path: Path) -> None:
    """The trial's context holds `true` and every shared library it loads, at the paths the loader looks for them,
    and a Containerfile that runs it FROM scratch (no base image to pull, no shell)."""
    context = trial_context(tmp_path)
    assert (context / "Containerfile").read_text() == 'FROM scratch\nCOPY . /\nRUN ["/bin/true"]\n'
    assert os.access(context / "bin" / "true", os.X_OK)
    listed = subprocess.run(["ldd", str(context / "bin" / "true")], capture_output=True, text=True, check=True)
    needed = [word for line in listed.stdout.splitlines() for word in line.split() if word.startswith("/")]
    assert any("ld-linux" in path for path in needed), "the dynamic loader is among them"
    assert all((context / path.lstrip("/")).is_file() for path in needed), needed


def test_a_goal_reads_met_or_missed_by_how_much() -> None:
    """A measurement within its goal reads "met"; one over it reads how far over, and it is a line, not a failure."""
    assert verdict(0.4, 0.5, "s") == "the goal is <= 0.5 s: met"
    assert verdict(1.381, 0.5, "s") == "the goal is <= 0.5 s: missed by 0.881 s (2.8x)"
    assert verdict(102.2, 120, "MB") == "the goal is <= 120 MB: met"


def test_no_registry_or_machine_path_is_written_into_the_image_files() -> None:
    """The image's committed files name no package registry or mirror: they are discovered when building."""
    hosts = re.compile(r"pypi\.org|pythonhosted|debian\.org|docker\.io|ghcr\.io|quay\.io|/root/|/home/(?!nonroot)\w")
    files = [ROOT / "Containerfile", ROOT / ".dockerignore", *sorted((ROOT / "image").iterdir())]
    found = [f"{p.name}: {m.group(0)}" for p in files if p.is_file() for m in hosts.finditer(p.read_text())]
    assert not found
