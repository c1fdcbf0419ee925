"""Model resolution: the mounted repository, MODEL_ID (directory, .gguf, hub id via the HF cache), the default."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from handler.model_source import DEFAULT_MODEL_ID, ModelNotFound, packaged_model_path, resolve_model


def model_dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    return path


def hub_snapshot(cache: Path, repo_id: str, revision: str = "0123456789abcdef0123456789abcdef01234567") -> Path:
    """A model laid out as huggingface_hub caches it: models--org--name/{refs/main, snapshots/<rev>/}."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(revision)
    return model_dir(repo / "snapshots" / revision)


@pytest.fixture
def env(tmp_path):
    """No mounted repository, an empty hub cache, the hub off."""
    return {"HFENDPOINT_REPOSITORY_DIR": str(tmp_path / "repository"), "HF_HUB_CACHE": str(tmp_path / "hub"),
            "HF_HUB_OFFLINE": "1"}


def test_mounted_repository_wins_over_model_id(tmp_path, env):
    model_dir(tmp_path / "repository")
    env["MODEL_ID"] = "org/other"
    assert resolve_model(env).path == str(tmp_path / "repository")


def test_mounted_repository_with_a_gguf_file(tmp_path, env):
    (tmp_path / "repository").mkdir()
    (tmp_path / "repository" / "model.Q4.gguf").write_bytes(b"GGUF")
    assert resolve_model(env).path == str(tmp_path / "repository" / "model.Q4.gguf")


def test_empty_repository_is_skipped(tmp_path, env):
    (tmp_path / "repository").mkdir()
    env["MODEL_ID"] = str(model_dir(tmp_path / "local"))
    assert resolve_model(env).path == str(tmp_path / "local")


def test_model_id_local_directory_and_gguf_file(tmp_path, env):
    env["MODEL_ID"] = str(model_dir(tmp_path / "local"))
    assert resolve_model(env).path == str(tmp_path / "local")
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    env["MODEL_ID"] = str(gguf)
    assert resolve_model(env).path == str(gguf)


def test_model_id_from_the_hub_cache(tmp_path, env):
    snapshot = hub_snapshot(tmp_path / "hub", "org/tiny-model")
    env["MODEL_ID"] = "org/tiny-model"
    resolved = resolve_model(env)
    assert Path(resolved.path) == snapshot
    assert resolved.name == "org/tiny-model"


@pytest.mark.parametrize("model_id", ["org/not-cached", "/no/such/model.gguf", "./missing-dir"])
def test_unresolvable_model_id_is_an_error_not_a_fallback(env, model_id):
    env["MODEL_ID"] = model_id
    with pytest.raises(ModelNotFound, match=model_id.lstrip("./")):
        resolve_model(env)


def test_directory_without_a_model_is_an_error(tmp_path, env):
    (tmp_path / "empty").mkdir()
    env["MODEL_ID"] = str(tmp_path / "empty")
    with pytest.raises(ModelNotFound, match="without config.json"):
        resolve_model(env)


def test_default_model_from_the_hub_cache(tmp_path, env):
    snapshot = hub_snapshot(tmp_path / "hub", DEFAULT_MODEL_ID)
    assert Path(resolve_model(env).path) == snapshot


def test_default_falls_back_to_the_packaged_model_offline(env, capfd):
    resolved = resolve_model(env)
    assert resolved.path == packaged_model_path() and resolved.path is not None
    assert "serving the packaged SmolLM2" in capfd.readouterr().err


def test_unreachable_hub_gives_up_in_seconds(env, capfd):
    """A real download attempt against an endpoint with no route to it fails fast, then falls back."""
    del env["HF_HUB_OFFLINE"]
    env["HF_ENDPOINT"] = "http://10.255.255.1"  # reserved, unroutable: never the real hub, even with network
    started = time.monotonic()
    assert resolve_model(env).path == packaged_model_path()
    assert time.monotonic() - started < 30
    assert "cannot be reached" in capfd.readouterr().err


@pytest.mark.slow  # a handler process
def test_handler_exits_with_one_clear_line_when_model_id_cannot_be_resolved(tmp_path, env):
    env["MODEL_ID"] = "org/not-cached"
    result = subprocess.run([sys.executable, "-m", "handler"], env={**os.environ, **env}, capture_output=True,
                            text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert result.returncode != 0
    assert result.stderr.strip().splitlines() == [
        "handler: error: org/not-cached is not in the local cache and HF_HUB_OFFLINE is set"]


def test_a_bad_hf_hub_offline_is_named(env):
    env.update(MODEL_ID="org/not-cached", HF_HUB_OFFLINE="maybe")
    with pytest.raises(ModelNotFound, match="HF_HUB_OFFLINE='maybe' is invalid: expected a boolean"):
        resolve_model(env)
