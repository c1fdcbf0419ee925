"""The files of a model besides its weights and config: its tokenizer and its generation_config.json.

A .gguf file's are those its metadata was converted into (models/gguf_loader.py's gguf_model_dir)."""
import json
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the tokenizer's modules load with it, on start-up's tokenizer thread
    from transformers import PreTrainedTokenizerBase

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def model_dir_of(model_path: str, cache_dir: str | None = None) -> str:
    """The directory holding a model's config and tokenizer: the path itself, or a .gguf file's converted
    metadata (kept under cache_dir when given and writable)."""
    if model_path.endswith(".gguf") and os.path.isfile(model_path):
        from models.gguf_loader import gguf_model_dir

        return gguf_model_dir(model_path, cache_dir)
    return model_path


def load_tokenizer(model_path: str, cache_dir: str | None = None) -> "PreTrainedTokenizerBase | None":
    """The tokenizer of a model directory or .gguf file, or None when it has none."""
    model_dir = model_dir_of(model_path, cache_dir)
    if not any(os.path.isfile(os.path.join(model_dir, name)) for name in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer  # its modules take seconds to import on some versions: only when used

    return AutoTokenizer.from_pretrained(model_dir)


def read_generation_config(model_dir: str) -> dict:
    """The model directory's generation_config.json ({} when it has none)."""
    path = os.path.join(model_dir, "generation_config.json")
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def eos_token_ids(hf_config, model_dir: str) -> tuple[int, ...]:
    """End-of-sequence ids from the model's (text) config and its generation_config.json (each an int or a list)."""
    found = []
    generation_config = read_generation_config(model_dir)
    for source in (getattr(hf_config, "eos_token_id", None), generation_config.get("eos_token_id")):
        if source is not None:
            found.extend(source if isinstance(source, (list, tuple)) else [source])
    return tuple(dict.fromkeys(int(token) for token in found))
