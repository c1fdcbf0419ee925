"""The paged KV cache of a decoder: its dtype, how many blocks fit, their allocation in the model's layers, and
the scales of an FP8 cache.

On CUDA the pool is what gpu_memory_utilization leaves of the GPU after the weights and the peak activations
of the largest step the scheduler can build, measured by running that step once; on the CPU it is
cpu_kv_cache_gb, capped by what max_num_seqs requests of max_model_len tokens could ever hold. With tensor
parallelism every rank sizes its own pool and all take the smallest. The pool is sized in bytes: an FP8 cache
(kv_cache_dtype fp8, e4m3: one byte an element) holds twice the tokens of a 16-bit one.

An FP8 cache stores each key and value divided by its layer's scale for keys or values (kernels/reference.py's
quantize_kv; the kernels take one per KV head of the rank, so a checkpoint's per-head scales serve too): the
checkpoint's when it ships them (models/kv_scales.py), else calibrated at start-up. Calibration runs one prefill of
CALIBRATION_TOKENS fixed token ids through a temporary cache in the model's dtype and takes each layer's largest
|k| and |v| (over its KV heads and the tensor-parallel ranks); the scale maps KV_SCALE_MARGIN times that to e4m3's
largest value, 448, rounded up to a power of two (exact to divide by and to multiply back). e4m3 keeps 3 mantissa
bits from 2^-6 to 448 times the scale, with subnormals below: such a scale leaves room for values 4 to 8 times the
calibrated peak and full precision down to 1/3,500 of it or further, where a scale of 1 (vLLM's default) stores a
layer of small values (|v| < 2^-6) in subnormals. Per-layer scales rather than per-KV-head ones: the finer ones
measured no better (bench/RESULTS.md's decisions log has what each choice gave).
"""
import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from engine.config import EngineConfig
from engine.embedding import forward_decoder
from engine.startup_log import phase
from kernels import FP8_KV_CACHE_DTYPE, AttentionMetadata, gumbel_argmax
from models.all_reduce import min_over_ranks
from models.kv_scales import heads_of_rank, read_kv_scales
from models.loader import safetensors_files
from models.parallel_layers import tp_rank, tp_size

CALIBRATION_TOKENS = 512
PROFILE_SEQUENCE_TOKENS = 1024  # the longest sequence of the profile step (profile_lengths says why)
KV_SCALE_MARGIN = 4
E4M3_MAX = torch.finfo(FP8_KV_CACHE_DTYPE).max


def allocate_kv_cache(model, config: EngineConfig, max_model_len: int, model_dir: str, extra_block_bytes: int = 0
                      ) -> int:
    """Allocates the keys and values of every layer (and an FP8 cache's scales, read from the checkpoint in
    model_dir or calibrated) and hands them to the model; returns the number of blocks. extra_block_bytes: what
    the caller keeps per block beside it (a draft head's states, engine/eagle3_drafter.py), in the budget."""
    device, dtype = next(model.parameters()).device, config.kv_cache_torch_dtype
    # Scales first: calibration's temporary cache is gone before the pool is sized.
    scales = fp8_kv_scales(model, config, model_dir, max_model_len) if dtype == FP8_KV_CACHE_DTYPE else ()
    shape = model.kv_cache_shape(1, config.block_size)
    block_bytes = 2 * int(np.prod(shape)) * dtype.itemsize + extra_block_bytes
    num_blocks = config.num_kv_blocks or (
        blocks_fitting_gpu(model, config, max_model_len, block_bytes) if device.type == "cuda"
        else blocks_fitting_cpu(config, max_model_len, block_bytes))
    num_blocks = min_over_ranks(num_blocks)
    if num_blocks < 1:
        raise RuntimeError(f"no memory left for the KV cache (a block needs {block_bytes} bytes): raise "
                           "HFENDPOINT_GPU_MEMORY_UTILIZATION / HFENDPOINT_CPU_KV_CACHE_GB or lower "
                           "HFENDPOINT_MAX_BATCHED_TOKENS")
    with phase("KV pool", lambda: f"{num_blocks} blocks of {config.block_size} tokens, "
               f"{num_blocks * block_bytes / 2**30:.2f} GiB"):
        num_layers, *layer_shape = model.kv_cache_shape(num_blocks, config.block_size)
        k_caches, v_caches = ([torch.zeros(layer_shape, dtype=dtype, device=device) for _ in range(num_layers)]
                              for _ in range(2))
        model.set_kv_cache(k_caches, v_caches, *scales)
    return num_blocks


def fp8_kv_scales(model, config: EngineConfig, model_dir: str, max_model_len: int) -> tuple[Tensor, Tensor]:
    """Float32 [num_layers, n_kv] scales of this rank's KV heads for the keys and the values: the checkpoint's,
    else calibrated (see the module docstring)."""
    device = next(model.parameters()).device
    checkpoint = checkpoint_kv_scales(model, model_dir)
    if checkpoint is not None:
        return tuple(scales.to(device) for scales in checkpoint)
    k_amax, v_amax = kv_amax(model, config.block_size, min(CALIBRATION_TOKENS, max_model_len))
    return tuple(calibrated_scales(max_over_ranks(amax.amax(1)), KV_SCALE_MARGIN)[:, None].expand_as(amax)
                 .contiguous() for amax in (k_amax, v_amax))


def checkpoint_kv_scales(model, model_dir: str) -> tuple[Tensor, Tensor] | None:
    """The checkpoint's key and value scales of this rank's KV heads [num_layers, n_kv], or None if it has none
    (a GGUF model's directory has no safetensors)."""
    try:
        found = read_kv_scales(safetensors_files(model_dir), model.num_layers)
    except FileNotFoundError:
        return None
    if found is None:
        return None
    total_heads = model.config.num_key_value_heads
    return tuple(torch.stack([heads_of_rank(scale, total_heads, tp_rank(), tp_size(), f"layer {i}'s {what} scale")
                              for i, scale in enumerate(scales)])
                 for scales, what in zip(found, ("key", "value")))


def calibrated_scales(amax: Tensor, margin: float) -> Tensor:
    """The powers of two that map margin * amax to at most e4m3's largest value (1 where amax is 0)."""
    scales = torch.exp2(torch.ceil(torch.log2(amax.float() * margin / E4M3_MAX)))
    return torch.where(amax > 0, scales, 1.0)


def max_over_ranks(values: Tensor) -> Tensor:
    if tp_size() > 1:
        dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return values


@torch.inference_mode()
def kv_amax(model, block_size: int, num_tokens: int) -> tuple[Tensor, Tensor]:
    """The largest |k| and |v| [num_layers, n_kv] (this rank's KV heads) that a prefill of num_tokens fixed
    token ids (calibration_tokens) stores, in a temporary cache of the model's dtype that is detached after.
    Every tensor-parallel rank runs it."""
    parameter = next(model.parameters())
    device = parameter.device
    num_blocks = -(-num_tokens // block_size)
    num_layers, *layer_shape = model.kv_cache_shape(num_blocks, block_size)
    k_caches, v_caches = ([torch.zeros(layer_shape, dtype=parameter.dtype, device=device) for _ in range(num_layers)]
                          for _ in range(2))
    model.set_kv_cache(k_caches, v_caches)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(num_tokens, device=device),
        cu_seqlens_q=torch.tensor([0, num_tokens], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=device),
        block_tables=torch.arange(num_blocks, dtype=torch.int32, device=device)[None],
        max_seqlen_q=num_tokens, max_seqlen_k=num_tokens, is_decode=False)
    model(calibration_tokens(model.config, num_tokens).to(device), torch.arange(num_tokens, device=device), meta)
    model.set_kv_cache([None] * num_layers, [None] * num_layers)
    return tuple(torch.stack([cache.abs().amax(dim=(0, 1, 3)).float() for cache in caches])
                 for caches in (k_caches, v_caches))


def calibration_tokens(hf_config, num_tokens: int) -> Tensor:
    """Fixed token ids for calibration: the beginning-of-sequence token (whose keys and values are often the
    largest a model stores) when the model has one, then ids drawn from a generator seeded with 0."""
    ids = torch.randint(0, hf_config.vocab_size, (num_tokens,), generator=torch.Generator().manual_seed(0))
    bos = getattr(hf_config, "bos_token_id", None)
    if isinstance(bos, int) and 0 <= bos < hf_config.vocab_size:
        ids[0] = bos
    return ids


def blocks_fitting_cpu(config: EngineConfig, max_model_len: int, block_bytes: int) -> int:
    budget = int(config.cpu_kv_cache_gb * 2**30) // block_bytes
    most_ever_used = config.max_num_seqs * -(-max_model_len // config.block_size)
    return min(budget, most_ever_used)


def blocks_fitting_gpu(model, config: EngineConfig, max_model_len: int, block_bytes: int) -> int:
    """What gpu_memory_utilization leaves after the weights and a full-budget forward's activations."""
    device = next(model.parameters()).device
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    with phase("profile step", lambda: f"{config.max_num_batched_tokens} tokens and sampling: its kernels compile"):
        profile_forward(model, config, max_model_len)
    free, total = torch.cuda.mem_get_info(device)
    peak_extra = torch.cuda.max_memory_allocated(device) - torch.cuda.memory_allocated(device)
    budget = total * config.gpu_memory_utilization - (total - free) - peak_extra
    return int(budget) // block_bytes


def profile_lengths(num_tokens: int, max_model_len: int) -> list[int]:
    """The sequences of the profile step: num_tokens tokens, in sequences of at most max_model_len and
    PROFILE_SEQUENCE_TOKENS tokens. A step's activations grow with its tokens, not with how they split into
    sequences (attention keeps no scores of a sequence's length squared, and a sequence of PROFILE_SEQUENCE_TOKENS
    takes the tiles a longer one does), so longer sequences would measure the same peak and only add attention's
    quadratic time to the start."""
    longest = min(max_model_len, PROFILE_SEQUENCE_TOKENS)
    return [longest] * (num_tokens // longest) + ([num_tokens % longest] if num_tokens % longest else [])


@torch.inference_mode()
def profile_forward(model, config: EngineConfig, max_model_len: int) -> None:
    """The largest step the scheduler can build, as far as memory goes: max_num_batched_tokens tokens
    (profile_lengths), then logits and sampling for max_num_seqs rows (which also compiles the one-pass sampler's
    kernel now rather than at the first request)."""
    device = next(model.parameters()).device
    num_tokens = config.max_num_batched_tokens
    hidden, _ = forward_decoder(model, [[0] * n for n in profile_lengths(num_tokens, max_model_len)])
    num_rows = min(config.max_num_seqs, num_tokens)
    logits = model.compute_logits(hidden[:1].expand(num_rows, -1).contiguous())
    if logits is not None:  # tensor-parallel ranks other than 0 get no logits and do not sample
        torch.softmax(logits, -1).argmax(-1)
        gumbel_argmax(logits, torch.zeros(num_rows, device=device),
                      torch.zeros(num_rows, dtype=torch.int64, device=device))
    torch.cuda.synchronize(device)
