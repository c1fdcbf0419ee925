"""The profile step that sizes the KV pool on CUDA (engine/kv_cache.py): the largest step's tokens, in sequences
short enough that attention's quadratic time stays out of the start, measuring the peak a step of long sequences
reaches."""
import pytest
import torch
from transformers import LlamaConfig

from engine import EngineConfig, kv_cache
from models.registry import load_model
from random_decoders import TINY, save_random_decoder


@pytest.mark.parametrize("num_tokens, max_model_len", [(8192, 40960), (8192, 4096), (5000, 700), (300, 4096)])
def test_the_profile_step_holds_every_token_in_sequences_no_longer_than_either_bound(num_tokens, max_model_len):
    lengths = kv_cache.profile_lengths(num_tokens, max_model_len)
    longest = min(max_model_len, kv_cache.PROFILE_SEQUENCE_TOKENS)
    assert sum(lengths) == num_tokens and all(0 < n <= longest for n in lengths)
    assert lengths.count(longest) == num_tokens // longest  # as few sequences as the bounds allow


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the profile step runs on CUDA")
def test_short_profile_sequences_reach_the_peak_of_one_long_sequence(tmp_path, monkeypatch):
    max_model_len = 4096
    save_random_decoder(LlamaConfig(**{**TINY, "max_position_embeddings": max_model_len}), tmp_path)
    model = load_model(str(tmp_path), torch.bfloat16, torch.device("cuda")).model
    config = EngineConfig(model=str(tmp_path), max_num_batched_tokens=max_model_len, max_num_seqs=16)

    def peak(longest: int) -> int:
        monkeypatch.setattr(kv_cache, "PROFILE_SEQUENCE_TOKENS", longest)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        kv_cache.profile_forward(model, config, max_model_len)
        return torch.cuda.max_memory_allocated() - before

    peak(max_model_len)  # the first step also allocates what stays allocated (cuBLAS's workspace): not measured
    one_sequence = peak(max_model_len)
    short_sequences = peak(256)
    assert one_sequence > 0
    assert abs(short_sequences - one_sequence) <= one_sequence // 100, (short_sequences, one_sequence)
