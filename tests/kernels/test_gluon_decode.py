"""kernels/gluon_decode.py on a GPU against the torch reference, directly and where the engine's dispatch sends a
decode step to it. The interpreter does not run Gluon: on CI, tests/bench/test_sass_report.py compiles the kernel for
Hopper and checks what its loop holds."""
from unittest import mock

import pytest
import torch
from kernel_testing import DEVICE, ON_CUDA, cos_sin_cache, paged_batch

import kernels
from kernels import gluon_decode, gpu_features, reference, triton_attention

pytestmark = pytest.mark.usefixtures("poisoned_outputs")

FP8 = torch.float8_e4m3fn
E4M3_GPU = ON_CUDA and torch.cuda.get_device_capability() >= (8, 9)
gpu_only = pytest.mark.skipif(not E4M3_GPU, reason="Gluon runs compiled only, on a GPU with e4m3 conversions")


def fp8_decode_batch(seq_lens, num_q_heads, num_kv_heads, block_size):
    q, k_cache, v_cache, meta = paged_batch([1] * len(seq_lens), seq_lens, num_q_heads, num_kv_heads, 128, block_size,
                                            torch.float32)
    scales = [(0.02 + 0.1 * torch.rand(num_kv_heads, device=DEVICE)).float() for _ in range(2)]
    k_cache, v_cache = (reference.quantize_kv(c.flatten(0, 1), s).view(c.shape) for c, s in zip((k_cache, v_cache),
                                                                                                scales))
    return q.to(torch.bfloat16), k_cache, v_cache, meta, *scales


@gpu_only
@pytest.mark.parametrize("warps", [1, 2, 4, 8])
@pytest.mark.parametrize("num_q_heads,num_kv_heads,block_size", [(2, 2, 16), (4, 2, 32), (16, 2, 16), (6, 2, 64)])
def test_matches_the_reference(warps, num_q_heads, num_kv_heads, block_size):
    # contexts within a page, at page and block edges, and long ones; some warps of a program see no key at all
    seq_lens = [1, 15, 16, 17, 33, 64, 127, 250, 1000, 2100]
    q, k_cache, v_cache, meta, k_scale, v_scale = fp8_decode_batch(seq_lens, num_q_heads, num_kv_heads, block_size)
    expected = reference.paged_attention(q, k_cache, v_cache, meta, 0.1, 0, None, k_scale, v_scale)
    out = gluon_decode.decode_attention(q, k_cache, v_cache, meta, 0.1, k_scale, v_scale, warps=warps)
    torch.testing.assert_close(out.float(), expected.float(), rtol=2e-2, atol=2e-2)


@gpu_only
def test_follows_the_engine_order_and_any_q_strides():
    q, k_cache, v_cache, meta, k_scale, v_scale = fp8_decode_batch([300, 5, 1200, 64], 8, 4, 16)
    meta.seq_order = torch.argsort(meta.seq_lens, descending=True).to(torch.int32)
    wide = torch.zeros(q.shape[0], q.shape[1] + 3, 128, dtype=q.dtype, device=DEVICE)
    wide[:, 1:-2] = q  # a view whose token stride is not the heads' span
    out = gluon_decode.decode_attention(wide[:, 1:-2], k_cache, v_cache, meta, 0.1, k_scale, v_scale)
    expected = reference.paged_attention(q, k_cache, v_cache, meta, 0.1, 0, None, k_scale, v_scale)
    torch.testing.assert_close(out.float(), expected.float(), rtol=2e-2, atol=2e-2)


@gpu_only
def test_the_engine_sends_large_fp8_decode_steps_to_it_with_the_prologue_apart():
    # with Gluon turned off (HFENDPOINT_GPU_FEATURES) the same step goes to the Triton kernel, as correct
    num_q_heads, num_kv_heads, batch = 16, 8, 160  # unsplit: batch * KV heads fills every SM's programs
    seq_lens = torch.randint(20, 600, (batch,)).tolist()
    q, k_cache, v_cache, meta, k_scale, v_scale = fp8_decode_batch(seq_lens, num_q_heads, num_kv_heads, 16)
    meta.slot_mapping = (meta.block_tables[torch.arange(batch, device=DEVICE), (meta.seq_lens - 1) // 16].long() * 16
                         + ((meta.seq_lens - 1) % 16))
    qkv = torch.randn(batch, (num_q_heads + 2 * num_kv_heads) * 128, device=DEVICE, dtype=torch.bfloat16)
    cos_sin = cos_sin_cache(4096, 128)
    norms = [torch.rand(128, device=DEVICE, dtype=torch.bfloat16) + 0.5 for _ in range(2)]
    positions = meta.seq_lens.long() - 1
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    q_ref, _, _ = reference.qkv_prologue(qkv, positions, cos_sin, num_q_heads, num_kv_heads, *norms, 1e-6, k_ref,
                                         v_ref, meta.slot_mapping, False, k_scale, v_scale)
    expected = reference.paged_attention(q_ref, k_ref, v_ref, meta, 0.1, 0, None, k_scale, v_scale)
    assert triton_attention.decodes_apart(qkv, num_q_heads, k_cache, meta)
    with mock.patch.object(gluon_decode, "decode_attention", wraps=gluon_decode.decode_attention) as gluon:
        out = kernels.qkv_paged_attention(qkv, positions, cos_sin, num_q_heads, num_kv_heads, *norms, 1e-6, k_cache,
                                          v_cache, meta, 0.1, k_scale=k_scale, v_scale=v_scale)
    assert gluon.call_count == gpu_features.has("gluon", k_cache)
    torch.testing.assert_close(out.float(), expected.float(), rtol=2e-2, atol=2e-2)
    assert torch.equal(k_cache.view(torch.uint8), k_ref.view(torch.uint8))  # the prologue stored the new keys


@gpu_only
def test_small_batches_and_other_caches_stay_on_triton():
    q, k_cache, v_cache, meta, k_scale, v_scale = fp8_decode_batch([100] * 4, 16, 8, 16)  # split
    qkv = torch.zeros(4, 32 * 128, device=DEVICE, dtype=torch.bfloat16)
    assert not triton_attention.decodes_apart(qkv, 16, k_cache, meta)
    assert not gluon_decode.supports(torch.bfloat16, 16, 128, k_cache.to(torch.bfloat16), 0, None)
    assert not gluon_decode.supports(torch.bfloat16, 16, 128, k_cache, 256, None)  # a window
    assert not gluon_decode.supports(torch.float32, 16, 128, k_cache, 0, None)
    assert not gluon_decode.supports(torch.bfloat16, 16, 64, k_cache, 0, None)
    assert not gluon_decode.supports(torch.bfloat16, 16, 128, k_cache.view(-1, 8, 8, 128), 0, None)  # blocks of 8
    gluon_on = gpu_features.has("gluon", k_cache)  # off: HFENDPOINT_GPU_FEATURES turned it off
    assert gluon_decode.supports(torch.bfloat16, 64, 128, k_cache, 0, None) == gluon_on  # 8 query heads per KV head
    assert not gluon_decode.supports(torch.bfloat16, 72, 128, k_cache, 0, None)
