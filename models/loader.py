"""Weights into a decoder: checkpoint tensors (transformers names) copied into our fused parameters.

Tensors are streamed one at a time (safetensors.safe_open), so loading never holds a whole file in memory.
"""

import glob
import json
import os
from collections.abc import Iterable, Iterator

import torch
from safetensors import safe_open
from torch import Tensor, nn

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


def iterate_safetensors(model_dir: str) -> Iterator[tuple[str, Tensor]]:
    for path in safetensors_files(model_dir):
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def load_safetensors(model: nn.Module, model_dir: str) -> None:
    load_weights(model, iterate_safetensors(model_dir), source=model_dir)


def _target(model: nn.Module, params: dict, name: str) -> tuple[str, int | None] | None:
    """(our parameter name, slice index in a fused module or None) for a checkpoint name; None to skip it."""
    if name.endswith(IGNORED_SUFFIXES) or (name == "lm_head.weight" and model.tie_word_embeddings):
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
def load_weights(model: nn.Module, weights: Iterable[tuple[str, Tensor]], source: str) -> None:
    """Copy (transformers name, tensor) pairs into the model; every parameter must be filled exactly."""
    params = dict(model.named_parameters())
    missing = _expected(model, params)
    unexpected = []
    for name, tensor in weights:
        target = _target(model, params, name)
        if target is None:
            continue
        ours, index = target
        if ours not in params:
            unexpected.append(name)
            continue
        param = params[ours]
        destination = param.data if index is None else model.get_submodule(ours.rpartition(".")[0]).shard(param, index)
        if destination.shape != tensor.shape:
            raise ValueError(
                f"{source}: weight {name!r} has shape {tuple(tensor.shape)}, the model expects "
                f"{tuple(destination.shape)}; the checkpoint does not match its config.json"
            )
        destination.copy_(tensor)
        missing.discard(target)
    if unexpected:
        raise ValueError(f"{source}: unexpected weights {sorted(unexpected)[:10]} ({len(unexpected)} in all)")
    if missing:
        names = sorted({name for name, _ in missing})
        raise ValueError(f"{source}: checkpoint lacks weights for {names[:10]} ({len(names)} in all)")
