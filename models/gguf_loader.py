"""Decoder models from a GGUF file (llama.cpp's format): a model directory for its config and tokenizer, and
its weights dequantised tensor by tensor to transformers names.

Parsing a GGUF's metadata is slow: gguf's GGUFReader walks the vocabulary and the merge table one element at a
time, and transformers' AutoConfig and AutoTokenizer each parse the file
again. So gguf_model_dir converts the metadata once into an ordinary model directory (config.json,
generation_config.json, the fast tokenizer's files with the chat template), cached on disk under
$HFENDPOINT_CACHE_DIR (default ~/.cache/nanovllm-endpoint) and reused while the file keeps its path, size and
mtime. The weights stay in the .gguf: finding them needs only the tensor table (transformers' GgufHeader skips
the vocabulary, so it is quick), and gguf.quants.dequantize materialises one float32 tensor at a time.
"""

import contextlib
import copy
import json
import os
import re
import shutil
import tempfile
import threading
from collections.abc import Iterator
from typing import NamedTuple

import numpy as np
import torch
import xxhash
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quant_shape_to_byte_shape
from torch import Tensor
from transformers import AutoConfig, AutoTokenizer, GenerationConfig
from transformers.integrations.gguf import GgufHeader

# GGUF general.architecture -> the transformers architecture we build for it.
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
# llama.cpp's converter reorders Q and K rows for these architectures only (see unpermute_rotary_rows).
PERMUTED_QK_ARCHITECTURES = ("llama",)

GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Precomputed rope factors; we derive the same from the config.
IGNORED = ("rope_freqs",)
LAYER_PATTERN = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")

CACHE_DIR_ENV = "HFENDPOINT_CACHE_DIR"
# Written last into a converted directory: which file it was made from and a hash of every file in it.
MANIFEST = "gguf_source.json"
_build_lock = threading.Lock()  # one conversion at a time in this process (see transformers_parse_once)


class GgufSource(NamedTuple):
    """A .gguf file as the cache knows it: a converted directory is valid for exactly this path, size and mtime."""

    path: str
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, path: str) -> "GgufSource":
        path = os.path.abspath(path)
        stat = os.stat(path)
        return cls(path, stat.st_size, stat.st_mtime_ns)

    @property
    def cache_name(self) -> str:
        stem = os.path.splitext(os.path.basename(self.path))[0]
        return f"{stem}-{xxhash.xxh64_hexdigest(json.dumps(list(self)).encode())}"


def gguf_model_dir(path: str) -> str:
    """A directory with config.json, generation_config.json and tokenizer files converted from the .gguf file,
    to load with AutoConfig / AutoTokenizer.from_pretrained(dir) like any model directory.

    Built on first use (one metadata parse), then reused by every process until the file changes; a missing,
    stale or damaged conversion is rebuilt. The weights are not in it: read them with iterate_gguf(path, ...).
    """
    source = GgufSource.of(path)
    roots = (cache_root(), os.path.join(tempfile.gettempdir(), "nanovllm-endpoint"))  # the second if unwritable
    for root in roots:
        directory = os.path.join(root, "gguf", source.cache_name)
        if is_converted(directory, source):
            return directory
        with _build_lock:
            if is_converted(directory, source):  # another thread finished it while we waited
                return directory
            try:
                staging = tempfile.mkdtemp(prefix=f".{source.cache_name}.", dir=ensure_dir(os.path.dirname(directory)))
            except OSError:
                continue
            os.chmod(staging, 0o755)  # mkdtemp makes it private; a shared cache is read by other users
            try:
                convert_metadata(source.path, staging)
                write_manifest(staging, source)
            except BaseException:
                shutil.rmtree(staging, ignore_errors=True)
                raise
            return publish(staging, directory, source)
    raise OSError(f"cannot write the converted metadata of {path} under {' or '.join(roots)}; "
                  f"set {CACHE_DIR_ENV} to a writable directory")


def cache_root() -> str:
    configured = os.environ.get(CACHE_DIR_ENV, "").strip()
    if configured:
        return os.path.expanduser(configured)
    xdg = os.environ.get("XDG_CACHE_HOME", "").strip() or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(xdg, "nanovllm-endpoint")


def ensure_dir(directory: str) -> str:
    os.makedirs(directory, exist_ok=True)
    return directory


def convert_metadata(path: str, out_dir: str) -> None:
    """Write the config, generation config and tokenizer transformers builds from the GGUF's metadata."""
    directory, name = os.path.split(path)
    with transformers_parse_once(path) as parsed:
        config = AutoConfig.from_pretrained(directory, gguf_file=name)
        tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name) if parsed["tokenizer"] else None
    if not getattr(config, "architectures", None):  # GGUF configs lack it; unsupported ones get a name to report
        config.architectures = [ARCHITECTURES.get(config.model_type, f"{config.model_type} (GGUF)")]
    config.save_pretrained(out_dir)
    GenerationConfig.from_model_config(config).save_pretrained(out_dir)
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)


@contextlib.contextmanager
def transformers_parse_once(path: str):
    """Within the block, transformers' GGUF metadata parser (load_gguf_checkpoint, built on the slow GGUFReader)
    runs once for `path`: AutoConfig and AutoTokenizer each call it, and get copies of the one result. Yields it.

    The parser is looked up from its module at each call, so replacing the module attribute reaches them all;
    _build_lock keeps two threads from swapping it at once.
    """
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    original = gguf_utils.load_gguf_checkpoint
    parsed = original(path, return_tensors=False)

    def reuse_parsed(gguf_path, return_tensors=False, **kwargs):
        if os.path.abspath(gguf_path) == path and not return_tensors and not kwargs:
            return copy.deepcopy(parsed)
        return original(gguf_path, return_tensors=return_tensors, **kwargs)

    gguf_utils.load_gguf_checkpoint = reuse_parsed
    try:
        yield parsed
    finally:
        gguf_utils.load_gguf_checkpoint = original


def file_hashes(directory: str) -> dict[str, str]:
    names = sorted(name for name in os.listdir(directory) if name != MANIFEST)
    return {name: file_hash(os.path.join(directory, name)) for name in names}


def file_hash(path: str) -> str:
    with open(path, "rb") as file:
        return xxhash.xxh64_hexdigest(file.read())


def write_manifest(directory: str, source: GgufSource) -> None:
    manifest = {"source": source._asdict(), "files": file_hashes(directory)}
    with open(os.path.join(directory, MANIFEST), "w") as file:
        json.dump(manifest, file, indent=2)


def is_converted(directory: str, source: GgufSource) -> bool:
    """Whether `directory` is a complete conversion of `source`: its manifest names this file, size and mtime,
    and every file it lists is there with the content it had when written."""
    try:
        with open(os.path.join(directory, MANIFEST)) as file:
            manifest = json.load(file)
        return manifest["source"] == source._asdict() and manifest["files"] == file_hashes(directory)
    except (OSError, ValueError, KeyError, TypeError):
        return False


def publish(staging: str, directory: str, source: GgufSource) -> str:
    """Move a finished conversion into place atomically. A concurrent process may publish first: use its copy
    when it is valid; a damaged copy is moved aside (so readers never see it half deleted) and replaced."""
    for _ in range(3):
        try:
            os.rename(staging, directory)
            return directory
        except OSError:
            if is_converted(directory, source):
                shutil.rmtree(staging, ignore_errors=True)
                return directory
            discard(directory)
    return staging  # still contended: this process uses its own complete conversion


def discard(directory: str) -> None:
    with contextlib.suppress(OSError):
        trash = tempfile.mkdtemp(prefix=".discarded.", dir=os.path.dirname(directory))
        os.rename(directory, os.path.join(trash, "old"))
        shutil.rmtree(trash, ignore_errors=True)


def transformers_name(gguf_name: str) -> str | None:
    """The transformers checkpoint name for a GGUF tensor name; None for tensors we do not load."""
    stem, _, leaf = gguf_name.rpartition(".")
    if stem in IGNORED:
        return None
    if stem in GLOBAL_NAMES:
        return f"{GLOBAL_NAMES[stem]}.{leaf}"
    match = LAYER_PATTERN.match(gguf_name)
    if match is None or match.group(2) not in LAYER_NAMES:
        return gguf_name  # the weight loader reports it as unexpected
    layer, module, leaf = match.groups()
    return f"model.layers.{layer}.{LAYER_NAMES[module]}.{leaf}"


def unpermute_rotary_rows(weight: Tensor, num_heads: int) -> Tensor:
    """Undo llama.cpp's Q/K row order for Llama.

    llama.cpp rotates adjacent pairs (GPT-J style), so its converter interleaves each head's rows: row i of the
    first half and row i of the second half become rows 2i and 2i + 1. We rotate halves (NeoX style), so the
    rows go back: per head, view the rows as [D/2, 2] and transpose to [2, D/2].
    """
    return weight.reshape(num_heads, -1, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def iterate_gguf(path: str, hf_config) -> Iterator[tuple[str, Tensor]]:
    """(transformers name, float32 tensor) for each tensor in the file, dequantised one at a time."""
    header = GgufHeader.from_file(path)
    data = np.memmap(path, mode="r", dtype=np.uint8)
    permuted = header.architecture in PERMUTED_QK_ARCHITECTURES
    heads = {"q_proj": hf_config.num_attention_heads, "k_proj": hf_config.num_key_value_heads}
    for info in header.tensors:
        name = transformers_name(info.name)
        if name is None:
            continue
        start, kind = header.data_start + info.offset, GGMLQuantizationType(info.ggml_type)
        stored = data[start:start + info.nbytes].reshape(quant_shape_to_byte_shape(info.shape, kind))
        values = dequantize(stored, kind)  # new memory, except float32 tensors: views of the read-only map
        weight = torch.from_numpy(values if values.flags.writeable else values.copy())
        module = name.rsplit(".", 2)[-2]
        if permuted and module in heads:
            weight = unpermute_rotary_rows(weight, heads[module])
        yield name, weight
