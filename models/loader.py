"""Weights into a model: checkpoint tensors (transformers names) copied into our fused parameters.

Tensors are streamed one at a time (safetensors.safe_open maps the files), so loading never holds a whole file in
memory. Each parameter's weight_loader (models/parallel_layers.py) copies its rank's part: for safetensors it gets a
lazy slice, so a tensor-parallel rank reads only the rows it keeps. A NameMap says which of our parameters
(and which slice of a fused one) each checkpoint name fills.
"""

import glob
import json
import os
import re
from collections.abc import Callable, Iterable, Iterator, Mapping

import torch
from safetensors import safe_open
from torch import Tensor, nn

from models.kv_scales import ATTENTION_SCALE
from models.moe import moe_checkpoint_target
from models.parallel_layers import default_weight_loader


class NameMap:
    """From a checkpoint's tensor names to (our parameter name, slice index in a fused parameter or None), or
    None for a tensor we do not load. A name is rewritten by `rewrites` ((pattern, replacement) pairs, each
    applied in turn), skipped if `skip` matches it, then given to `route` (a target for names that no module
    rename expresses, such as stacked experts', or None), and then, when its module path ends with a key of
    `modules`, that ending is replaced by the module it goes into, with the slice it fills (longest key
    first)."""

    def __init__(self, modules: Mapping[str, tuple[str, int | None]], rewrites: tuple[tuple[str, str], ...] = (),
                 skip: str | None = None, route: Callable[[str], tuple[str, object] | None] | None = None):
        self.modules = sorted(modules.items(), key=lambda item: -len(item[0]))
        self.rewrites = [(re.compile(pattern), replacement) for pattern, replacement in rewrites]
        self.skip = re.compile(skip) if skip else None
        self.route = route

    def __call__(self, name: str) -> tuple[str, object] | None:
        for pattern, replacement in self.rewrites:
            name = pattern.sub(replacement, name)
        if self.skip and self.skip.search(name):
            return None
        if self.route and (routed := self.route(name)) is not None:
            return routed
        module_path, _, leaf = name.rpartition(".")
        for key, (ours, index) in self.modules:
            if module_path == key or module_path.endswith("." + key):
                return f"{module_path[:len(module_path) - len(key)]}{ours}.{leaf}", index
        return name, None


# Rewrites of the decoders' checkpoint names, in order: the text decoder of a multimodal checkpoint (Gemma 3, in
# transformers 5's and 4's layouts) as a decoder's own; a bare decoder's names (saved without `model.`) with it;
# fine-grained FP8's block scales as our weight_scale.
DECODER_REWRITES = (
    (r"^model\.language_model\.", "model."),
    (r"^language_model\.model\.", "model."),
    (r"^language_model\.lm_head\.", "lm_head."),
    (r"^(?!model\.|lm_head\.)", "model."),
    (r"\.weight_scale_inv$", ".weight_scale"),
)
# Checkpoint tensors we do not load: rotary buffers, a multimodal checkpoint's vision tower and projector (Gemma 3)
# or visual encoder (Qwen2.5-VL; saved without `model.` too, which the rewrites above prefix), static
# FP8 activation scales (our FP8 GEMMs scale activations per token as they go), and attention scales (an FP8 KV
# cache reads those of keys and values itself, models/kv_scales.py).
DECODER_SKIPPED = (r"rotary_emb\.inv_freq$|^model\.(vision_tower|multi_modal_projector|visual)\.|\.input_scale$|"
                   + ATTENTION_SCALE.pattern)


def decoder_names(model: nn.Module) -> NameMap:
    """The decoders' transformers names (see DECODER_REWRITES and DECODER_SKIPPED), and the LM head skipped when
    it is tied to the embeddings; routed experts' tensors go where models/moe.py says."""
    skip = DECODER_SKIPPED + (r"|^lm_head\.weight$" if model.tie_word_embeddings else "")
    return NameMap(model.packed_modules, rewrites=DECODER_REWRITES, skip=skip, route=moe_checkpoint_target)


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
            for name in f.keys():  # noqa: SIM118 - a safe_open handle has keys() but cannot be iterated
                yield name, f.get_slice(name) if lazy else f.get_tensor(name)


def load_safetensors(model: nn.Module, model_dir: str) -> None:
    """The checkpoint's tensors into the model, one at a time."""
    load_weights(model, iterate_safetensors(model_dir, lazy=True), source=model_dir)


def _expected(model: nn.Module, params: dict) -> dict[str, set[int | None]]:
    """Every parameter the checkpoint must fill, with the slices of it (None: the whole parameter)."""
    expected = {}
    for name in params:
        module_path, _, leaf = name.rpartition(".")
        module = model.get_submodule(module_path)
        if hasattr(module, "checkpoint_slices"):  # stacked experts (models/moe.py)
            expected[name] = set(module.checkpoint_slices(leaf))
        else:
            expected[name] = set(range(len(module.output_sizes))) if hasattr(module, "output_sizes") else {None}
    return expected


@torch.no_grad()
def load_weights(model: nn.Module, weights: Iterable[tuple[str, Tensor]], source: str,
                 names: NameMap | None = None) -> None:
    """Copy (checkpoint name, tensor or safetensors slice) pairs into the model; every parameter must be
    filled exactly. names: the checkpoint's names (by default the decoders' transformers names); a fused
    parameter's slice index None means the checkpoint holds it whole (Phi-3's qkv_proj). Then each module's
    process_weights_after_loading() runs, a module's before its children's."""
    params = dict(model.named_parameters())
    target_of = names or decoder_names(model)
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
            raise ValueError(f"{source}: weight {name!r} {exc}; the checkpoint does not match its config.json") \
                from None
        if index is None:
            missing[ours].clear()
        else:
            missing[ours].discard(index)
    if unexpected:
        raise ValueError(f"{source}: unexpected weights {sorted(unexpected)[:10]} ({len(unexpected)} in all)")
    lacking = sorted(name for name, slices in missing.items() if slices)
    if lacking:
        raise ValueError(f"{source}: checkpoint lacks weights for {lacking[:10]} ({len(lacking)} in all)")
    for module in model.modules():
        if hasattr(module, "process_weights_after_loading"):
            module.process_weights_after_loading()
