"""The paged KV cache of a decoder: how many blocks fit, and their allocation in the model's layers.

On CUDA the pool is what gpu_memory_utilization leaves of the GPU after the weights and the peak activations
of the largest step the scheduler can build, measured by running that step once; on the CPU it is
cpu_kv_cache_gb, capped by what max_num_seqs requests of max_model_len tokens could ever hold. With tensor
parallelism every rank sizes its own pool and all take the smallest.
"""
import numpy as np
import torch

from engine.config import EngineConfig
from engine.embedding import forward_decoder
from kernels import gumbel_argmax
from models.parallel_layers import min_over_ranks


def allocate_kv_cache(model, config: EngineConfig, max_model_len: int) -> int:
    """Allocates the keys and values of every layer and hands them to the model; returns the number of blocks."""
    parameter = next(model.parameters())
    device, dtype = parameter.device, parameter.dtype
    shape = model.kv_cache_shape(1, config.block_size)
    block_bytes = 2 * int(np.prod(shape)) * dtype.itemsize
    num_blocks = config.num_kv_blocks or (
        blocks_fitting_gpu(model, config, max_model_len, block_bytes) if device.type == "cuda"
        else blocks_fitting_cpu(config, max_model_len, block_bytes))
    num_blocks = min_over_ranks(num_blocks)
    if num_blocks < 1:
        raise RuntimeError(f"no memory left for the KV cache (a block needs {block_bytes} bytes): raise "
                           "HFENDPOINT_GPU_MEMORY_UTILIZATION / HFENDPOINT_CPU_KV_CACHE_GB or lower "
                           "HFENDPOINT_MAX_BATCHED_TOKENS")
    num_layers, *layer_shape = model.kv_cache_shape(num_blocks, config.block_size)
    k_caches, v_caches = ([torch.zeros(layer_shape, dtype=dtype, device=device) for _ in range(num_layers)]
                          for _ in range(2))
    model.set_kv_cache(k_caches, v_caches)
    return num_blocks


def blocks_fitting_cpu(config: EngineConfig, max_model_len: int, block_bytes: int) -> int:
    budget = int(config.cpu_kv_cache_gb * 2**30) // block_bytes
    most_ever_used = config.max_num_seqs * -(-max_model_len // config.block_size)
    return min(budget, most_ever_used)


def blocks_fitting_gpu(model, config: EngineConfig, max_model_len: int, block_bytes: int) -> int:
    """What gpu_memory_utilization leaves after the weights and a full-budget forward's activations."""
    device = next(model.parameters()).device
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    profile_forward(model, config, max_model_len)
    free, total = torch.cuda.mem_get_info(device)
    peak_extra = torch.cuda.max_memory_allocated(device) - torch.cuda.memory_allocated(device)
    budget = total * config.gpu_memory_utilization - (total - free) - peak_extra
    return int(budget) // block_bytes


@torch.inference_mode()
def profile_forward(model, config: EngineConfig, max_model_len: int) -> None:
    """The largest step the scheduler can build: max_num_batched_tokens in sequences of max_model_len, then
    logits and sampling for max_num_seqs rows (which also compiles the one-pass sampler's kernel now rather
    than at the first request)."""
    device = next(model.parameters()).device
    num_tokens = config.max_num_batched_tokens
    lengths = [max_model_len] * (num_tokens // max_model_len) + [num_tokens % max_model_len]
    hidden, _ = forward_decoder(model, [[0] * n for n in lengths if n])
    num_rows = min(config.max_num_seqs, num_tokens)
    logits = model.compute_logits(hidden[:1].expand(num_rows, -1).contiguous())
    if logits is not None:  # tensor-parallel ranks other than 0 get no logits and do not sample
        torch.softmax(logits, -1).argmax(-1)
        gumbel_argmax(logits, torch.zeros(num_rows, device=device),
                      torch.zeros(num_rows, dtype=torch.int64, device=device))
    torch.cuda.synchronize(device)
