"""With flash-attn installed, a decode step over a cache flash-attn cannot read (the default blocks of 16 tokens,
FP8) still runs the fused prologue kernel; one over a cache it reads runs the prologue, then flash-attn; a prefill
step with image spans runs our Triton attention, which masks them. The backend's kernels are recorders here: what
is checked is which of them a step launches."""
from types import SimpleNamespace

import pytest
import torch
from kernel_testing import cos_sin_cache, paged_batch

import kernels

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM = 4, 2, 16


def recording_backends():
    launched = []

    def record(name, result=None):
        def kernel(*args, **kwargs):
            launched.append(name)
            return result(*args) if result else None
        return kernel

    triton = SimpleNamespace(
        paged_attention=record("triton attention", lambda q, *_: q), varlen_attention=record("triton varlen"),
        fused_decode=record("fused prologue and attention", lambda qkv, *_: qkv),
        decodes_apart=lambda *args: False,  # the Gluon kernel's share: none at this batch size
        qkv_prologue=record("prologue", lambda qkv, *_: (qkv[:, :NUM_Q_HEADS * HEAD_DIM].unflatten(1, (
            NUM_Q_HEADS, HEAD_DIM)), None, None)))
    flash_attn = SimpleNamespace(flash_attn_with_kvcache=record("flash-attn decode", lambda q, *_: q),
                                 flash_attn_varlen_func=record("flash-attn varlen"), __version__="stand-in")
    return kernels._with_flash_attn(triton, flash_attn), launched


@pytest.mark.parametrize("block_size, dtype, expected", [
    (16, torch.float32, ["fused prologue and attention"]),
    (256, kernels.FP8_KV_CACHE_DTYPE, ["fused prologue and attention"]),
    (256, torch.float32, ["prologue", "flash-attn decode"]),
])
def test_flash_attn_takes_only_the_decode_steps_it_can_read(monkeypatch, block_size, dtype, expected):
    backend, launched = recording_backends()
    monkeypatch.setattr(kernels, "_backend", lambda device_type: backend)
    _, k_cache, v_cache, meta = paged_batch([1, 1], [5, 9], NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, block_size,
                                            torch.float32)
    scales = {}
    if dtype == kernels.FP8_KV_CACHE_DTYPE:
        k_cache, v_cache = k_cache.to(dtype), v_cache.to(dtype)
        ones = torch.ones(NUM_KV_HEADS, device=k_cache.device)
        scales = {"k_scale": ones, "v_scale": ones}
    qkv = torch.randn(2, (NUM_Q_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM)
    kernels.qkv_paged_attention(qkv, meta.seq_lens.long() - 1, cos_sin_cache(16, HEAD_DIM), NUM_Q_HEADS,
                                NUM_KV_HEADS, None, None, 1e-6, k_cache, v_cache, meta, HEAD_DIM**-0.5, **scales)
    assert launched == expected


def test_rows_that_read_each_others_keys_store_them_all_before_attention(monkeypatch):
    """A verification step's rows (one request's draft tokens) read keys that other rows store in the same step:
    never in the fused kernel, whose programs store only their own row's key before attending."""
    backend, launched = recording_backends()
    monkeypatch.setattr(kernels, "_backend", lambda device_type: backend)
    _, k_cache, v_cache, meta = paged_batch([1, 1], [5, 6], NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, 16, torch.float32)
    meta.rows_read_each_other = True
    qkv = torch.randn(2, (NUM_Q_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM)
    kernels.qkv_paged_attention(qkv, meta.seq_lens.long() - 1, cos_sin_cache(16, HEAD_DIM), NUM_Q_HEADS,
                                NUM_KV_HEADS, None, None, 1e-6, k_cache, v_cache, meta, HEAD_DIM**-0.5)
    assert launched == ["prologue", "triton attention"]


@pytest.mark.parametrize("image_spans", [False, True])
def test_flash_attn_never_takes_a_step_with_image_spans(monkeypatch, image_spans):
    """flash-attn's masks are causal or none: a prefill with an image's both-ways rows stays with Triton, even over
    a cache flash-attn reads; the same step without spans goes to flash-attn."""
    backend, launched = recording_backends()
    monkeypatch.setattr(kernels, "_backend", lambda device_type: backend)
    _, k_cache, v_cache, meta = paged_batch([6, 1], [6, 9], NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, 256, torch.float32)
    if image_spans:
        meta.image_spans = torch.tensor([[0, 0]] + [[1, 5]] * 4 + [[0, 0]] * 2)
    qkv = torch.randn(7, (NUM_Q_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM)
    kernels.qkv_paged_attention(qkv, torch.arange(7), cos_sin_cache(16, HEAD_DIM), NUM_Q_HEADS, NUM_KV_HEADS, None,
                                None, 1e-6, k_cache, v_cache, meta, HEAD_DIM**-0.5)
    assert launched == ["prologue", "triton attention" if image_spans else "flash-attn varlen"]
