"""Greedy decoding through engine.LLM equals transformers' greedy output token for token, on tiny random
Llama / Qwen2 / Qwen3 models (GQA), also with prefix-cache hits, chunked prefill and preemption."""
import copy

import pytest
import torch

from engine import LLM, SamplingParams
from engine.cuda_graphs import GraphShape
from random_decoders import Reference

LENGTHS = [3, 17, 33, 50]
NEW = 32
GREEDY = SamplingParams(temperature=0, max_tokens=NEW)
FP16_NEW = 16


def expected(ref, prompts):
    return [ref.greedy(prompt, NEW) for prompt in prompts]


def generated(llm, prompts, params=GREEDY):
    return [out["token_ids"] for out in llm.generate(prompts, params)]


def test_greedy_matches_transformers(tiny_model, prompts_of_lengths):
    prompts = prompts_of_lengths(LENGTHS)
    llm = LLM(tiny_model.path, dtype="float32")
    assert generated(llm, prompts) == expected(tiny_model, prompts)
    stats = llm.core.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"] and stats["running"] == stats["waiting"] == 0


def test_float16_greedy_matches_transformers_float16(tiny_llama_or_qwen3, prompts_of_lengths):
    """What a GPU without bfloat16 serves (HFENDPOINT_DTYPE=auto is float16 on a T4): float16 greedy decoding equals
    transformers' in float16, on the CPU (transformers' model and ours both there), over FP16_NEW tokens: float16's
    rounding, summed in another order, flips a near-tie of the random models further on (of Qwen2's and Mistral's
    within it)."""
    tiny = tiny_llama_or_qwen3
    prompts = prompts_of_lengths(LENGTHS)
    reference = Reference(tiny.path, copy.deepcopy(tiny.hf_model).half())
    llm = LLM(tiny.path, dtype="float16", device="cpu")
    params = SamplingParams(temperature=0, max_tokens=FP16_NEW)
    assert generated(llm, prompts, params) == [reference.greedy(prompt, FP16_NEW) for prompt in prompts]


def test_prefix_cache_hits_keep_outputs_exact(tiny_model, prompts_of_lengths):
    shared = prompts_of_lengths([40], seed=5)[0]
    prompts = [shared + tail for tail in prompts_of_lengths([1, 9, 20], seed=6)]
    llm = LLM(tiny_model.path, dtype="float32")
    first = generated(llm, prompts[:1])  # caches the shared prefix
    hits_before = llm.core.block_manager.num_hit_tokens
    rest = generated(llm, prompts[1:])
    assert llm.core.block_manager.num_hit_tokens - hits_before >= 2 * 32  # two full blocks per request
    again = generated(llm, prompts)  # second round: whole prompts (and outputs) hit
    assert first + rest == again == expected(tiny_model, prompts)


def test_chunked_prefill_keeps_outputs_exact(tiny_llama, prompts_of_lengths):
    prompts = prompts_of_lengths(LENGTHS)
    llm = LLM(tiny_llama.path, dtype="float32", max_num_batched_tokens=8)
    assert generated(llm, prompts) == expected(tiny_llama, prompts)


def test_preemption_keeps_outputs_exact(tiny_llama, prompts_of_lengths):
    prompts = prompts_of_lengths(LENGTHS)
    llm = LLM(tiny_llama.path, dtype="float32", num_kv_blocks=7)  # 112 slots: one request fits, the batch does not
    assert generated(llm, prompts) == expected(tiny_llama, prompts)
    assert llm.core.stats()["num_preemptions"] > 0
    assert llm.core.block_manager.num_free_blocks == 7


def test_seeded_sampling_is_reproducible_in_any_batch(tiny_llama, prompts_of_lengths):
    llm = LLM(tiny_llama.path, dtype="float32")
    prompts = prompts_of_lengths([7, 20, 11], seed=3)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, seed=42)
    other = SamplingParams(temperature=1.0, max_tokens=24)
    alone = generated(llm, prompts[:1], seeded)[0]
    assert generated(llm, prompts[:1], seeded)[0] == alone
    in_batch = generated(llm, [prompts[1], prompts[0], prompts[2]], [other, seeded, other])
    assert in_batch[1] == alone
    assert generated(llm, prompts[:1], SamplingParams(temperature=1.0, max_tokens=16, seed=43))[0] != alone


def test_top_k_one_equals_greedy(tiny_llama, prompts_of_lengths):
    llm = LLM(tiny_llama.path, dtype="float32")
    prompts = prompts_of_lengths([9, 21], seed=4)
    top1 = SamplingParams(temperature=0.8, top_k=1, max_tokens=NEW)
    assert generated(llm, prompts, top1) == generated(llm, prompts)


def test_stop_tokens_and_length_limits(tiny_llama, prompts_of_lengths):
    prompt = prompts_of_lengths([9], seed=8)[0]
    reference = tiny_llama.greedy(prompt, NEW)
    llm = LLM(tiny_llama.path, dtype="float32", max_model_len=len(prompt) + 5)
    stop = reference[2]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=NEW, stop_token_ids=[stop]))[0]
    assert out["token_ids"] == reference[:reference.index(stop) + 1]
    capped = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=None))[0]
    assert capped["token_ids"] == reference[:5]  # max_model_len
    longest = prompt + reference[:4]  # max_model_len - 1 tokens: room for one
    assert generated(llm, [longest]) == [tiny_llama.greedy(longest, 1)]
    for too_long in (prompt + [1] * 5, prompt + [1] * 6):  # max_model_len tokens, and one more
        with pytest.raises(ValueError, match=f"the prompt has {len(too_long)} tokens.*max_model_len"):
            llm.generate([too_long], GREEDY)


@torch.inference_mode()
def test_padded_decode_step_matches_unpadded(tiny_llama, prompts_of_lengths):
    """The inputs a CUDA graph replays: dummy rows up to the captured size change no output and no cache."""
    llm = LLM(tiny_llama.path, dtype="float32", overlap_steps=False)  # no step launched ahead of the prompts
    core, runner = llm.core, llm.core.runner
    for i, prompt in enumerate(prompts_of_lengths([5, 18, 9])):
        core.add(core.make_sequence(i, prompt, GREEDY))
    core.step()
    seqs, counts = core.scheduler.schedule()
    assert counts == [1, 1, 1]
    caches = [layer.self_attn.k_cache for layer in runner.model.model.layers]
    before = [cache.clone() for cache in caches]
    outputs = []
    for graph in (None, GraphShape(8, 8, is_decode=True)):
        for cache, saved in zip(caches, before):
            cache.copy_(saved)
        step = runner.buffers.prepare(seqs, counts, graph)
        assert step.meta.is_decode and len(step.input_ids) == (graph.num_tokens if graph else 3)
        outputs.append(runner.model(step.input_ids, step.positions, step.meta)[:3])
    assert torch.allclose(outputs[0], outputs[1], atol=1e-5)  # batch size may change matmul rounding only
    written = step.meta.slot_mapping[:3]
    assert step.meta.slot_mapping[3:].eq(-1).all() and step.meta.seq_lens[3:].eq(1).all()
    assert step.meta.cu_seqlens_q.tolist() == list(range(9)) and step.positions[3:].eq(0).all()
    assert step.logits_indices == slice(0, 3) and step.sample_rows == [0, 1, 2]
    for cache, saved in zip(caches, before):  # the padded step wrote its three real slots and nothing else
        untouched = torch.ones(cache.shape[0] * cache.shape[1], dtype=torch.bool)
        untouched[written] = False
        assert torch.equal(cache.flatten(0, 1)[untouched], saved.flatten(0, 1)[untouched])
        assert not torch.equal(cache.flatten(0, 1)[written], saved.flatten(0, 1)[written])


@torch.inference_mode()
def test_staged_inputs_follow_batch_changes(tiny_llama, prompts_of_lengths):
    """The staged block table rewrites only what changed: rows that now hold another sequence, or a
    sequence whose blocks were freed and allocated again, get its whole table. A step of dummy rows only
    (what graphs are captured on) writes nothing to the cache."""
    llm = LLM(tiny_llama.path, dtype="float32", max_num_batched_tokens=64)
    core, runner = llm.core, llm.core.runner
    seqs = [core.make_sequence(i, prompt, GREEDY) for i, prompt in enumerate(prompts_of_lengths([40, 7, 23]))]
    for seq in seqs:
        core.add(seq)
    core.step()  # 40 + 7 + 17 of 23 tokens
    caches = [layer.self_attn.k_cache.clone() for layer in runner.model.model.layers]
    for batch in (seqs, seqs[::-1], seqs[1:]):
        step = runner.buffers.prepare(batch, [1] * len(batch), GraphShape(4, 4, is_decode=True))
        for row, seq in enumerate(batch):
            assert step.meta.block_tables[row, :len(seq.block_table)].tolist() == seq.block_table
            expected = seq.block_table[seq.num_computed_tokens // 16] * 16 + seq.num_computed_tokens % 16
            assert step.meta.slot_mapping[row] == expected
    core.block_manager.free(seqs[2])
    core.block_manager.allocate(seqs[2], 1)  # one block, at the front of the free queue
    step = runner.buffers.prepare(seqs[1:], [1, 1])
    assert step.meta.block_tables[1, :1].tolist() == seqs[2].block_table and step.meta.seq_lens.tolist() == [8, 1]
    step = runner.buffers.prepare([], [], GraphShape(2, 2, is_decode=True))
    runner.model(step.input_ids, step.positions, step.meta)
    assert all(torch.equal(layer.self_attn.k_cache, saved) for layer, saved in zip(runner.model.model.layers, caches))
