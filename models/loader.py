"""Weights into a model: checkpoint tensors (transformers names) copied into our fused parameters.

Tensors are streamed (safetensors.safe_open maps the files), so loading never holds a whole file in memory.
Each parameter's weight_loader (models/parallel_layers.py) copies its rank's part: for safetensors it gets a
lazy slice, so a tensor-parallel rank reads only the rows it keeps. A NameMap says which of our parameters
(and which slice of a fused one) each checkpoint name fills.

Loading with several threads runs the weight loaders of different tensors at once: their copies (page-cache
reads, uploads) leave Python's lock, so they overlap. A GPU model's slices then reach the device through
DeviceUploads: each thread copies a read into small pinned chunks, two in turn, from which the device copies at
full speed while the thread fills the other (a copy from pageable memory is staged by the driver one piece at a
time instead). The weight loader gets the tensor on the device and slices, converts and copies it there. On the
CPU torch's own threads already share each copy: models/registry.py loads with one thread there.
"""

import contextlib
import functools
import glob
import json
import os
import re
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch
from safetensors import safe_open
from torch import Tensor, nn

from models.kv_scales import ATTENTION_SCALE
from models.moe import moe_checkpoint_target
from models.parallel_layers import default_weight_loader, shape_of

UPLOAD_CHUNK_BYTES = 16 << 20  # each loading thread holds two pinned chunks of this size


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


@contextlib.contextmanager
def open_safetensors(model_dir: str) -> Iterator[list]:
    """The checkpoint's files (safe_open handles), mapped until the block ends: slices taken from them may be
    read by other threads until then."""
    with contextlib.ExitStack() as files:
        yield [files.enter_context(safe_open(path, framework="pt", device="cpu"))
               for path in safetensors_files(model_dir)]


def tensors_of(files: list, lazy: bool = False) -> Iterator[tuple[str, Tensor]]:
    """(name, tensor) pairs of open safetensors files; lazy=True yields slices instead, read when indexed."""
    for f in files:
        for name in f.keys():  # noqa: SIM118 - a safe_open handle has keys() but cannot be iterated
            yield name, f.get_slice(name) if lazy else f.get_tensor(name)


def iterate_safetensors(model_dir: str, lazy: bool = False) -> Iterator[tuple[str, Tensor]]:
    """(name, tensor) pairs; lazy=True yields safetensors slices instead, read when indexed (while the
    iteration has not ended)."""
    with open_safetensors(model_dir) as files:
        yield from tensors_of(files, lazy)


def load_safetensors(model: nn.Module, model_dir: str, threads: int = 1) -> None:
    """The checkpoint's tensors into the model, `threads` of them at once; on a GPU, with more than one thread,
    each read reaches the device through its thread's pinned chunks (DeviceUploads)."""
    device = next(model.parameters()).device
    with open_safetensors(model_dir) as files:
        weights = tensors_of(files, lazy=True)
        if threads == 1 or device.type != "cuda":
            load_weights(model, weights, source=model_dir, threads=threads)
            return
        with DeviceUploads(device, threads) as uploads:
            load_weights(model, ((name, UploadedSlice(loaded, uploads)) for name, loaded in weights),
                         source=model_dir, threads=threads, on_thread=uploads.on_thread_stream)


class DeviceUploads:
    """Host tensors to one CUDA device, for the loading threads: each thread has its own stream and two pinned
    chunks of UPLOAD_CHUNK_BYTES, which it fills in turn while the device copies out of the other. A read is
    uploaded into a new device tensor; one too large for the free device memory (with a read as large in every
    thread) stays on the host, and its weight loader copies it from there. Leaving the `with` block hands the
    uploads' freed device memory back."""

    def __init__(self, device: torch.device, threads: int):
        self.device, self.threads = device, threads
        self._local = threading.local()

    def __enter__(self) -> "DeviceUploads":
        return self

    def __exit__(self, *exc_info) -> None:
        torch.cuda.empty_cache()

    def _thread_state(self):
        """The calling thread's stream, pinned chunks and their copy events, made at its first upload."""
        local = self._local
        if not hasattr(local, "stream"):
            local.stream = torch.cuda.Stream(self.device)
            local.chunks = [torch.empty(UPLOAD_CHUNK_BYTES, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
            local.chunk_arrays = [chunk.numpy() for chunk in local.chunks]
            local.copied = [torch.cuda.Event() for _ in range(2)]  # each chunk's last copy to the device
            local.turn = 0
        return local

    @contextlib.contextmanager
    def on_thread_stream(self):
        """Runs the block (a weight loader) on the calling thread's stream, after its uploads, and waits for
        what it queued there: the parameter holds its values once the block has ended."""
        stream = self._thread_state().stream
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            yield
        stream.synchronize()

    def upload(self, host: Tensor) -> Tensor:
        """host's values in a new tensor on the device, queued on the calling thread's stream; host itself when
        the device lacks the room."""
        free, _ = torch.cuda.mem_get_info(self.device)
        if host.numel() * host.element_size() * self.threads > free:
            return host
        local = self._thread_state()
        host = host.contiguous()
        with torch.cuda.device(self.device), torch.cuda.stream(local.stream):
            uploaded = torch.empty(host.shape, dtype=host.dtype, device=self.device)
            source, target = host.reshape(-1).view(torch.uint8).numpy(), uploaded.reshape(-1).view(torch.uint8)
            for start in range(0, source.size, UPLOAD_CHUNK_BYTES):
                length = min(UPLOAD_CHUNK_BYTES, source.size - start)
                turn, local.turn = local.turn, local.turn ^ 1
                local.copied[turn].synchronize()  # the device has copied what the chunk held before
                # numpy's copy: one thread (torch's would start a team of OpenMP threads in every loading thread)
                np.copyto(local.chunk_arrays[turn][:length], source[start:start + length])
                target[start:start + length].copy_(local.chunks[turn][:length], non_blocking=True)
                local.copied[turn].record(local.stream)
        return uploaded


class UploadedSlice:
    """A safetensors slice whose reads arrive on the device (DeviceUploads.upload)."""

    def __init__(self, loaded, uploads: DeviceUploads):
        self.loaded, self.uploads = loaded, uploads

    def get_shape(self) -> list[int]:
        return list(shape_of(self.loaded))

    def get_dtype(self) -> str:
        return self.loaded.get_dtype()

    def __getitem__(self, index) -> Tensor:
        return self.uploads.upload(self.loaded[index])


def _load_one(param: Tensor, loaded, index, name: str, source: str,
              on_thread: Callable[[], contextlib.AbstractContextManager]) -> None:
    """Runs the parameter's weight loader on one checkpoint tensor (or one slice of a fused parameter)."""
    weight_loader = getattr(param, "weight_loader", default_weight_loader)
    with torch.no_grad(), on_thread():  # no_grad: a pool's thread starts with gradients on
        try:
            weight_loader(param, loaded) if index is None else weight_loader(param, loaded, index)
        except ValueError as exc:
            raise ValueError(f"{source}: weight {name!r} {exc}; the checkpoint does not match its config.json") \
                from None


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
                 names: NameMap | None = None, threads: int = 1,
                 on_thread: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext) -> None:
    """Copy (checkpoint name, tensor or safetensors slice) pairs into the model; every parameter must be
    filled exactly. names: the checkpoint's names (by default the decoders' transformers names); a fused
    parameter's slice index None means the checkpoint holds it whole (Phi-3's qkv_proj). threads: how many
    weight loaders run at once (on a pool's threads, each inside on_thread(); they write disjoint parts of the
    parameters, and a loader's work is done when it returns); the first in checkpoint order to fail raises, those
    not started are cancelled. Then each module's process_weights_after_loading() runs, a module's before its
    children's."""
    params = dict(model.named_parameters())
    target_of = names or decoder_names(model)
    missing = _expected(model, params)
    unexpected = []
    pool = ThreadPoolExecutor(threads, thread_name_prefix="load-weights") if threads > 1 else None
    loads: deque[Future] = deque()  # submitted, in checkpoint order; at most 2 * threads
    try:
        for name, tensor in weights:
            target = target_of(name)
            if target is None:
                continue
            ours, index = target
            if ours not in params:
                unexpected.append(name)
                continue
            load = functools.partial(_load_one, params[ours], tensor, index, name, source, on_thread)
            if pool:
                if len(loads) == 2 * threads:  # the iterable is not read further ahead (it may hold tensors)
                    loads.popleft().result()
                loads.append(pool.submit(load))
            else:
                load()
            if index is None:
                missing[ours].clear()
            else:
                missing[ours].discard(index)
        while loads:
            loads.popleft().result()
    finally:
        if pool:
            pool.shutdown(cancel_futures=True)
    if unexpected:
        raise ValueError(f"{source}: unexpected weights {sorted(unexpected)[:10]} ({len(unexpected)} in all)")
    lacking = sorted(name for name, slices in missing.items() if slices)
    if lacking:
        raise ValueError(f"{source}: checkpoint lacks weights for {lacking[:10]} ({len(lacking)} in all)")
    for module in model.modules():
        if hasattr(module, "process_weights_after_loading"):
            module.process_weights_after_loading()
