"""Sentence-embedding pooling, configured the way sentence-transformers saves a model.

A sentence-transformers model directory lists its pipeline in modules.json (Transformer -> Pooling ->
optionally Normalize); the Pooling module's folder holds config.json with the pooling mode and
sentence_bert_config.json holds the truncation length. Models without these files (a plain
transformers checkpoint) fall back to the caller's default mode, normalised.
"""
import json
import os
from dataclasses import dataclass

import torch
from torch import Tensor

POOLING_MODES = ("mean", "cls", "last")

# sentence-transformers' names for the modes we implement: the legacy boolean keys and the
# single "pooling_mode" string newer versions write.
_LEGACY_MODE_KEYS = {
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
    "pooling_mode_lasttoken": "last",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
}
_MODE_NAMES = {"mean": "mean", "cls": "cls", "lasttoken": "last", "last": "last"}


@dataclass
class PoolingConfig:
    mode: str                   # "mean" | "cls" | "last"
    normalize: bool             # L2-normalise the pooled vector
    max_seq_length: int | None  # truncate inputs to this many tokens (None: the model's maximum)

    def __post_init__(self):
        if self.mode not in POOLING_MODES:
            raise ValueError(f"pooling mode must be one of {POOLING_MODES}, got {self.mode!r}")


def _read_json(path: str) -> dict | list | None:
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _module_class(entry: dict) -> str:
    """'sentence_transformers.models.Pooling' -> 'Pooling' (the module path moved between versions)."""
    return str(entry.get("type", "")).rsplit(".", 1)[-1]


def _mode_from_pooling_config(config: dict, where: str) -> str:
    if "pooling_mode" in config:
        names = config["pooling_mode"]
        names = [names] if isinstance(names, str) else list(names)
    else:
        names = [mode for key, mode in _LEGACY_MODE_KEYS.items() if config.get(key)]
    modes = [_MODE_NAMES.get(name, name) for name in names]
    if len(modes) != 1 or modes[0] not in POOLING_MODES:
        raise ValueError(f"{where}: pooling {names or 'none'} is not supported; "
                         f"exactly one of mean, cls or lasttoken pooling is")
    return modes[0]


def read_pooling_config(model_dir: str, default_mode: str) -> PoolingConfig:
    """Pooling as sentence-transformers would apply it to the model in `model_dir`.

    Without modules.json the model is not a sentence-transformers model: pool with `default_mode`
    and normalise (what embedding endpoints return). With it, follow it exactly: its Pooling
    module's mode, normalisation only if a Normalize module is listed.
    """
    modules = _read_json(os.path.join(model_dir, "modules.json"))
    st_config = _read_json(os.path.join(model_dir, "sentence_bert_config.json")) or {}
    max_seq_length = st_config.get("max_seq_length")
    if modules is None:
        return PoolingConfig(default_mode, normalize=True, max_seq_length=max_seq_length)
    classes = {_module_class(entry): entry for entry in modules}
    unsupported = sorted(set(classes) - {"Transformer", "Pooling", "Normalize"})
    if unsupported:
        raise ValueError(f"{model_dir}/modules.json lists sentence-transformers modules we do not implement: "
                         f"{', '.join(unsupported)} (supported: Transformer, Pooling, Normalize)")
    pooling = classes.get("Pooling")
    mode = default_mode
    if pooling is not None:
        config_path = os.path.join(model_dir, pooling.get("path", ""), "config.json")
        config = _read_json(config_path)
        if config is None:
            raise ValueError(f"{config_path} is missing: modules.json lists a Pooling module there")
        mode = _mode_from_pooling_config(config, config_path)
    return PoolingConfig(mode, normalize="Normalize" in classes, max_seq_length=max_seq_length)


def pool(hidden: Tensor, cu_seqlens: Tensor, mode: str) -> Tensor:
    """Pool packed token states [T, H] into one float32 vector per sequence [B, H].

    cu_seqlens (int32 [B+1]) delimits the sequences in `hidden`; every sequence is non-empty.
    Sums accumulate in float32 whatever the activations' dtype.
    """
    starts, ends = cu_seqlens[:-1].long(), cu_seqlens[1:].long()
    if mode == "cls":
        return hidden[starts].float()
    if mode == "last":
        return hidden[ends - 1].float()
    if mode != "mean":
        raise ValueError(f"pooling mode must be one of {POOLING_MODES}, got {mode!r}")
    lengths = ends - starts
    segment_ids = torch.repeat_interleave(torch.arange(len(lengths), device=hidden.device), lengths,
                                          output_size=hidden.shape[0])  # no device sync
    sums = torch.zeros(len(lengths), hidden.shape[1], dtype=torch.float32, device=hidden.device)
    sums.index_add_(0, segment_ids, hidden.float())
    return sums / lengths.unsqueeze(1).float()
