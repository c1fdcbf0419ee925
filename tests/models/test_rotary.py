"""The head layout of models/rotary.py: moving a head's dimensions (and padding it to a power of two) so that
rotary over part of it runs as the kernels' NeoX rotation over a whole head leaves every score q.k as
transformers' partial rotary computes it, and a per-head RMSNorm commutes with the move."""
import pytest
import torch

from kernels import reference
from models.rotary import RotaryEmbedding, head_layout, inverse_frequencies

PARAMS = {"rope_type": "default", "rope_theta": 1000.0}


def transformers_rotary(x: torch.Tensor, positions: torch.Tensor, rotary: int) -> torch.Tensor:
    """transformers' partial rotary: rotate-half over the first `rotary` dimensions, the rest passed."""
    inv_freq, _ = inverse_frequencies(rotary, PARAMS, 0)
    freqs = positions[:, None].float() * inv_freq
    cos, sin = (torch.cat((f, f), dim=-1)[:, None] for f in (freqs.cos(), freqs.sin()))
    rot, passed = x[..., :rotary], x[..., rotary:]
    half = torch.cat((-rot[..., rotary // 2:], rot[..., :rotary // 2]), dim=-1)
    return torch.cat((rot * cos + half * sin, passed), dim=-1)


def placed(x: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """x [..., D] with its last dimension laid out as `source` says (zeros where it says -1)."""
    return torch.where(source >= 0, x[..., source.clamp(min=0)], torch.zeros(()))


@pytest.mark.parametrize("head_dim,rotary", [(24, 12), (16, 12), (96, 96), (128, 96), (32, 32)])
def test_laid_out_heads_keep_every_score(head_dim, rotary):
    layout = head_layout(head_dim, rotary)
    assert layout.padded == 1 << (head_dim - 1).bit_length()
    positions = torch.tensor([0, 3, 17, 40, 63])
    q, k = torch.randn(5, 4, head_dim), torch.randn(5, 2, head_dim)
    expected = torch.einsum("thd,shd->tsh", transformers_rotary(q, positions, rotary)[:, :2],
                            transformers_rotary(k, positions, rotary))
    cos_sin = RotaryEmbedding(layout, 64, PARAMS, 64).cos_sin_cache
    q_ours, k_ours = reference.apply_rotary(placed(q, layout.qk_source), placed(k, layout.qk_source), positions,
                                            cos_sin)
    scores = torch.einsum("thd,shd->tsh", q_ours[:, :2], k_ours)
    torch.testing.assert_close(scores, expected, atol=1e-5, rtol=1e-5)
    v = torch.randn(5, 2, head_dim)
    assert torch.equal(placed(v, layout.v_source)[..., :head_dim], v)  # o_proj reads v's own columns
    assert placed(v, layout.v_source)[..., head_dim:].abs().sum() == 0


def test_per_head_norm_commutes_with_the_move():
    layout = head_layout(16, 12)
    x, weight = torch.randn(3, 2, 16), torch.randn(16)
    source = layout.qk_source
    moved_then_normed = reference.rms_norm(placed(x, source), weight[source], 1e-6)
    torch.testing.assert_close(moved_then_normed, placed(reference.rms_norm(x, weight, 1e-6), source))
