"""The Containerfile, read the way a reviewer reads it (no container engine here): hadolint, the properties the
chart and a security review rely on, and a rehearsal of its build step with this machine's Python."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from tests.packaging.image_tools import HADOLINT
from tests.tools import locate

ROOT = Path(__file__).resolve().parents[2]
CONTAINERFILE = ROOT / "Containerfile"
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


@dataclass(frozen=True)
class Instruction:
    """One Containerfile instruction: its keyword, upper-cased, and the rest of its logical line."""

    keyword: str
    arguments: str


def instructions(text: str) -> list[Instruction]:
    """The Containerfile's instructions, with continuation lines joined and comments dropped."""
    logical: list[str] = []
    pending = ""
    for line in text.splitlines():
        if line.lstrip().startswith("#") or not line.strip():
            continue
        pending += line.rstrip().removesuffix("\\") + " "
        if not line.rstrip().endswith("\\"):
            logical.append(pending.strip())
            pending = ""
    result = []
    for entry in logical:
        keyword, _, arguments = entry.partition(" ")
        result.append(Instruction(keyword.upper(), arguments.strip()))
    return result


def stages(text: str) -> list[list[Instruction]]:
    """Instructions grouped by FROM; the last group is the image that ships."""
    groups: list[list[Instruction]] = []
    for instruction in instructions(text):
        if instruction.keyword == "FROM":
            groups.append([])
        if groups:
            groups[-1].append(instruction)
    return groups


def settings(stage: list[Instruction], keyword: str) -> dict[str, str]:
    """KEY=VALUE pairs of every ENV or LABEL in a stage (quotes removed)."""
    pairs: dict[str, str] = {}
    for instruction in stage:
        if instruction.keyword == keyword:
            for key, value in re.findall(r'([\w.\-]+)=("[^"]*"|\S+)', instruction.arguments):
                pairs[key] = value.strip('"')
    return pairs


TEXT = CONTAINERFILE.read_text()
RUNTIME_BASE, BUILD, RUNTIME = stages(TEXT)
ARGS = dict(re.findall(r"^ARG (\w+)=(\S+)$", TEXT, flags=re.MULTILINE))


def last(stage: list[Instruction], keyword: str) -> str:
    """The arguments of the stage's last ``keyword`` instruction, the one that takes effect."""
    return [i.arguments for i in stage if i.keyword == keyword][-1]


def test_hadolint_finds_nothing() -> None:
    """hadolint, at its strictest threshold, has no finding for the Containerfile."""
    result = subprocess.run(
        [str(locate(HADOLINT)), "--no-color", "--failure-threshold", "style", str(CONTAINERFILE)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_build_is_two_stages_on_slim_python_without_cuda() -> None:
    """A build stage on PYTHON_IMAGE and a runtime on RUNTIME_IMAGE (named, so the SBOM step can read its package
    list), both a slim Python of the project's version unless `make image` passes its Debian bases; no CUDA base."""
    froms = [stage[0].arguments for stage in (RUNTIME_BASE, BUILD, RUNTIME)]
    assert froms == ["${RUNTIME_IMAGE} AS runtime-base", "${PYTHON_IMAGE} AS build", "runtime-base"]
    assert len(RUNTIME_BASE) == 1, "the runtime base is only named, never changed"
    assert ARGS["RUNTIME_IMAGE"] == "${PYTHON_IMAGE}"
    base = ARGS["PYTHON_IMAGE"]
    assert re.fullmatch(r"python:3\.1[1-9]-slim-\w+", base), base
    assert PROJECT["requires-python"] == ">=3.11"
    assert "cuda" not in base.lower()


def test_the_runtime_stage_only_copies_the_built_environment() -> None:
    """The shipped stage runs no commands (the Debian runtime has no shell to run them) and copies only the venv
    and its SBOM from the build stage: no shell, no compiler, no pip comes in."""
    copies = [i.arguments for i in RUNTIME if i.keyword in ("COPY", "ADD")]
    assert copies == [
        "--from=build /opt/gpuscaler /opt/gpuscaler",
        "--from=build /sbom.cdx.json /usr/share/doc/gpuscaler/sbom.cdx.json",
    ]
    assert not [i for i in RUNTIME if i.keyword == "RUN"]
    assert "--without-pip" in " ".join(i.arguments for i in BUILD if i.keyword == "RUN")


def test_it_runs_as_a_numeric_non_root_user() -> None:
    """USER is a numeric UID:GID other than 0, the one the chart's gateway and compose.yaml's image run as; only
    what reads the kubelet's socket (the agent with podResources, the fake kubelet) runs as 0 (docs/install.md)."""
    user = last(RUNTIME, "USER")
    uid, _, gid = user.partition(":")
    assert uid.isdigit(), "runAsNonRoot can only verify a numeric user"
    assert gid.isdigit()
    assert int(uid) != 0
    chart = yaml.safe_load((ROOT / "charts/gpuscaler/values.yaml").read_text())
    context = chart["gateway"]["podSecurityContext"]
    assert (context["runAsUser"], context["runAsGroup"]) == (int(uid), int(gid))
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    users = {name: service["user"] for name, service in compose["services"].items()}
    assert users["gateway"] == user
    assert {name for name, used in users.items() if used != user} == {"kubelet", "node-a", "node-b", "node-c"}
    assert set(users.values()) == {user, "0:0"}


def test_it_asks_the_nvidia_runtime_for_every_gpu_and_nvml_only() -> None:
    """NVIDIA_VISIBLE_DEVICES=all and NVIDIA_DRIVER_CAPABILITIES=utility (NVML, no CUDA libraries)."""
    environment = settings(RUNTIME, "ENV")
    assert environment["NVIDIA_VISIBLE_DEVICES"] == "all"
    assert environment["NVIDIA_DRIVER_CAPABILITIES"] == "utility"
    assert environment["PYTHONDONTWRITEBYTECODE"] == "1", "a read-only root filesystem cannot take .pyc files"


def test_oci_labels_carry_source_version_and_licence_of_the_project() -> None:
    """The OCI labels agree with pyproject.toml, and the version ARG with the chart's appVersion."""
    labels = settings(RUNTIME, "LABEL")
    assert labels["org.opencontainers.image.source"] == PROJECT["urls"]["Source"]
    assert labels["org.opencontainers.image.licenses"] == PROJECT["license"]
    assert labels["org.opencontainers.image.version"] == "${VERSION}"
    assert labels["org.opencontainers.image.revision"] == "${REVISION}"
    assert ARGS["VERSION"] == PROJECT["version"]
    chart = yaml.safe_load((ROOT / "charts/gpuscaler/Chart.yaml").read_text())
    assert chart["appVersion"] == ARGS["VERSION"]


def test_entrypoint_is_the_console_script_and_serve_the_default_command() -> None:
    """ENTRYPOINT ["gpuscaler"] (the project's console script), CMD ["serve"], gRPC and metrics ports exposed."""
    assert json.loads(last(RUNTIME, "ENTRYPOINT")) == ["gpuscaler"]
    assert json.loads(last(RUNTIME, "CMD")) == ["serve"]
    assert "gpuscaler" in PROJECT["scripts"]
    assert last(RUNTIME, "EXPOSE").split() == ["6000", "9402"]


def test_the_build_context_holds_only_what_the_build_copies() -> None:
    """.dockerignore keeps .venv and .git out and lets in every COPY source of the build stage."""
    rules = [line for line in (ROOT / ".dockerignore").read_text().splitlines() if line and not line.startswith("#")]
    assert rules[0] == "*", "an allow-list: nothing enters the context unless named"
    allowed = {rule.removeprefix("!").rstrip("/") for rule in rules if rule.startswith("!")}
    copies = [i.arguments.split() for i in BUILD if i.keyword == "COPY" and not i.arguments.startswith("--from=")]
    sources = {word for words in copies for word in words[:-1]}
    assert sources <= allowed
    assert not {".venv", ".git"} & allowed


def _build_step_script(scratch: Path, venv: Path, status: Path) -> str:
    """The build stage's RUNs, pointed at scratch folders and this interpreter instead of the image's; the SBOM
    step reads ``status`` as the runtime's dpkg status."""
    script = " && ".join(i.arguments for i in BUILD if i.keyword == "RUN")
    script = script.replace("/wheels", str(scratch / "wheels")).replace("/opt/gpuscaler", str(venv))
    script = script.replace("> requirements.txt", f"> {scratch / 'requirements.txt'}")
    script = script.replace("--requirement requirements.txt", f"--requirement {scratch / 'requirements.txt'}")
    script = script.replace("/runtime/status", str(status)).replace("/runtime/os-release", str(status.parent / "os"))
    script = script.replace("/sbom.cdx.json", str(scratch / "sbom.cdx.json"))
    script = script.replace("${VERSION}", ARGS["VERSION"])
    script = re.sub(r"(?<![\w/-])pip(?![\w-])", f"{sys.executable} -m pip", script)
    return re.sub(r"(?<![\w/.-])python3?(?![\w.-])", sys.executable, script)


@pytest.mark.timeout(600)
def test_the_build_step_yields_a_small_venv_whose_gpuscaler_runs(tmp_path: Path) -> None:
    """Run as written, the build steps make a venv with the console script, the agent's version and no dev tools,
    and an SBOM of the runtime's packages and the venv's distributions."""
    venv, status = tmp_path / "venv", tmp_path / "status"
    status.write_text("Package: libc6\nStatus: install ok installed\nVersion: 2.36-9\nArchitecture: amd64\n")
    (tmp_path / "os").write_text("ID=debian\nVERSION_ID=12\n")
    script = _build_step_script(tmp_path, venv, status)
    subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=ROOT, check=True, timeout=540)
    sbom = json.loads((tmp_path / "sbom.cdx.json").read_text())
    purls = {component["purl"] for component in sbom["components"]}
    assert "pkg:deb/debian/libc6@2.36-9?arch=amd64&distro=debian-12" in purls
    assert f"pkg:pypi/gpuscaler@{PROJECT['version']}" in purls
    version = subprocess.run(
        [str(venv / "bin" / "gpuscaler"), "version"], capture_output=True, text=True, check=True, timeout=60
    )
    assert version.stdout.strip() == f"gpuscaler {PROJECT['version']}"
    installed = {path.name.split("-")[0].lower() for path in (venv / "lib").glob("python3*/site-packages/*.dist-info")}
    assert not {"pytest", "mypy", "ruff", "grpcio", "hypothesis", "pip"} & installed
    size = sum(path.stat().st_size for path in venv.rglob("*") if path.is_file())
    assert size < 80 * 1024**2, f"the venv is {size / 1024**2:.0f} MiB"


def test_hadolint_is_the_real_linter(tmp_path: Path) -> None:
    """The same hadolint flags an untagged base image and unpinned apt packages, so a clean result means something."""
    bad = tmp_path / "Containerfile"
    bad.write_text("FROM python\nRUN apt-get update && apt-get install -y curl\n")
    result = subprocess.run(
        [str(locate(HADOLINT)), "--no-color", str(bad)], capture_output=True, text=True, check=False
    )
    assert result.returncode == 1
    assert "DL3006" in result.stdout
    assert "DL3008" in result.stdout
