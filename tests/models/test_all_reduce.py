"""Which path the decoder's tensor-parallel sums take (models/all_reduce.py): the norm fused with a sum over peer
memory only on a group of GPUs that can read each other's memory, for rows that fit its exchange; dist.all_reduce and
the norm after it for everything else. The fused kernel is tested in tests/kernels/test_all_reduce_norm.py and, with
ranks at once, on GPUs by bench/all_reduce_check.py; on the CPU the two-rank tests under tests/tp and
tests/models/test_moe.py run every layer's sum through gloo."""
import pytest
import torch
import torch.distributed as dist

from engine import EngineConfig
from kernels import reference
from models import all_reduce
from models.all_reduce import RankPartial, set_up_exchange, unavailable_reason

HERE = torch.device("cpu")
GPU0 = torch.device("cuda", 0)


def test_the_path_needs_gpus_with_nccl_that_read_each_others_memory(monkeypatch):
    assert "HFENDPOINT_P2P_ALL_REDUCE" in unavailable_reason(False, "nccl", 2, GPU0)
    assert "gloo" in unavailable_reason(True, "gloo", 2, HERE)
    assert "at most 8" in unavailable_reason(True, "nccl", 16, GPU0)
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda device, peer: peer != 2)
    assert unavailable_reason(True, "nccl", 4, GPU0) == "GPU 0 cannot read the memory of GPU 2 (no peer access)"
    assert unavailable_reason(True, "nccl", 2, GPU0) is None


@pytest.fixture
def gloo_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_on_gloo_a_norm_sums_through_dist_all_reduce_first(monkeypatch, gloo_group):
    summed = []
    monkeypatch.setattr(dist, "all_reduce", lambda x, *args, **kwargs: summed.append(x.clone()) or x.mul_(2))
    line = set_up_exchange(True, HERE, torch.float32)
    assert line.startswith("tensor-parallel sums through gloo only") and all_reduce._exchange is None
    part, residual, weight = torch.randn(3, 64), torch.randn(3, 64), torch.randn(64)
    normed, new_residual = RankPartial(part.clone()).norm(residual, weight, 1e-6)
    assert torch.equal(summed[0], part)
    expected = reference.add_rms_norm(part * 2, residual, weight, 1e-6)
    torch.testing.assert_close((normed, new_residual), expected)
    torch.testing.assert_close(RankPartial(part.clone()).norm(None, weight, 1e-6),
                               reference.rms_norm(part * 2, weight, 1e-6))


def test_a_process_that_rendezvoused_before_keeps_its_next_group_on_the_group_backend(monkeypatch, gloo_group):
    """Rank 0 outlives its engines: torch would wait for its next rendezvous forever (see models/all_reduce.py)."""
    monkeypatch.setattr(all_reduce, "_rendezvoused", True)
    monkeypatch.setattr(all_reduce, "unavailable_reason", lambda *args: None)  # as if on GPUs with peer access
    line = set_up_exchange(True, HERE, torch.float32)
    assert "an earlier process group of this process rendezvoused" in line and all_reduce._exchange is None


def test_every_rank_joins_the_agreement_even_with_a_reason_of_its_own(monkeypatch):
    """A rank that cannot take the path still joins the collective its peers wait in, or they would wait forever."""
    joined = []
    monkeypatch.setattr(all_reduce, "min_over_ranks", lambda value: joined.append(value) or 0)
    assert all_reduce.agreed("no peer access") == "no peer access"
    assert all_reduce.agreed(None) == "another rank cannot take it"
    assert joined == [0, 1]


def test_the_switch_comes_from_the_environment():
    assert EngineConfig("/m").p2p_all_reduce
    assert not EngineConfig.from_env("/m", {"HFENDPOINT_P2P_ALL_REDUCE": "false"}).p2p_all_reduce
    with pytest.raises(ValueError, match="HFENDPOINT_P2P_ALL_REDUCE"):
        EngineConfig.from_env("/m", {"HFENDPOINT_P2P_ALL_REDUCE": "sometimes"})
