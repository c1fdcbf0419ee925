"""Weights into a model: checkpoint tensors (transformers names) copied into our fused parameters.

Tensors are streamed one at a time (safetensors.safe_open), so loading never holds a whole file in memory.
Each parameter's weight_loader (models/parallel_layers.py) copies its rank's part: for safetensors it gets a
lazy slice, so a tensor-parallel rank reads only the rows it keeps.
"""

import functools
import glob
import json
import os
from collections.abc import Callable, Iterable, Iterator

import torch
from safetensors import safe_open
from torch import Tensor, nn

from models.kv_scales import is_attention_scale
from models.parallel_layers import default_weight_loader

# Checkpoint tensors that are buffers or duplicates, not parameters.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def safetensors_files(model_dir: str) -> list[str]:
    """The checkpoint's files: those a model.safetensors.index.json names, else every *.safetensors."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(model_dir, name) for name in names]
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")
    return files


def iterate_safetensors(model_dir: str, lazy: bool = False) -> Iterator[tuple[str, Tensor]]:
    """(name, tensor) pairs; lazy=True yields safetensors slices instead, read when indexed (while the
    iteration has not moved on)."""
    for path in safetensors_files(model_dir):
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_slice(name) if lazy else f.get_tensor(name)


def load_safetensors(model: nn.Module, model_dir: str) -> None:
    load_weights(model, iterate_safetensors(model_dir, lazy=True), source=model_dir)


def _target(model: nn.Module, params: dict, name: str) -> tuple[str, int | None] | None:
    """(our parameter name, slice index in a fused module or None) for a checkpoint name; None to skip it (FP8
    attention scales: an FP8 KV cache reads those of keys and values itself, models/kv_scales.py)."""
    if name.endswith(IGNORED_SUFFIXES) or is_attention_scale(name) or (
            name == "lm_head.weight" and model.tie_word_embeddings):
        return None
    if name not in params and not name.startswith(("model.", "lm_head.")):
        name = "model." + name
    module_path, _, leaf = name.rpartition(".")
    parent, _, module = module_path.rpartition(".")
    if module in model.packed_modules:
        fused, index = model.packed_modules[module]
        return f"{parent}.{fused}.{leaf}", index
    return name, None


def _expected(model: nn.Module, params: dict) -> set[tuple[str, int | None]]:
    """Every (parameter, slice) the checkpoint must fill."""
    expected = set()
    for name in params:
        module = model.get_submodule(name.rpartition(".")[0])
        slices = range(len(module.output_sizes)) if hasattr(module, "output_sizes") else (None,)
        expected.update((name, index) for index in slices)
    return expected


@torch.no_grad()
def load_weights(model: nn.Module, weights: Iterable[tuple[str, Tensor]], source: str,
                 target: Callable[[str], tuple[str, int | None] | None] | None = None) -> None:
    """Copy (checkpoint name, tensor or safetensors slice) pairs into the model; every parameter must be
    filled exactly. target maps a checkpoint name to (our parameter, slice index in a fused module or None),
    or None to skip it; by default the decoders' transformers names."""
    params = dict(model.named_parameters())
    target_of = target or functools.partial(_target, model, params)
    missing = _expected(model, params)
    unexpected = []
    for name, tensor in weights:
        target = target_of(name)
        if target is None:
            continue
        ours, index = target
        if ours not in params:
            unexpected.append(name)
            continue
        param = params[ours]
        weight_loader = getattr(param, "weight_loader", default_weight_loader)
        try:
            weight_loader(param, tensor) if index is None else weight_loader(param, tensor, index)
        except ValueError as exc:
            raise ValueError(f"{source}: weight {name!r} {exc}; the checkpoint does not match its config.json") from None
        missing.discard(target)
    if unexpected:
        raise ValueError(f"{source}: unexpected weights {sorted(unexpected)[:10]} ({len(unexpected)} in all)")
    if missing:
        names = sorted({name for name, _ in missing})
        raise ValueError(f"{source}: checkpoint lacks weights for {names[:10]} ({len(names)} in all)")
