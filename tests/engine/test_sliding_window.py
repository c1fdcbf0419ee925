"""A model whose every layer has a sliding window (Mistral): greedy decoding equals transformers token for token
with prompts longer than the window (plain, chunked prefill, prefix hits, a preempting pool), and the blocks
that fall out of a running request's window go back to the pool exactly when no query can read them again."""
import pytest
import torch
from test_graph_padding import with_eager_graphs
from test_speculative import VOCAB, speculating

from engine import LLM, SamplingParams
from engine.block_manager import FREED
from kernels import reference
from random_decoders import MISTRAL_WINDOW
from speculative_testing import CorruptedOracle

BLOCK_SIZE = 8  # the window (20) spans parts of 3 or 4 blocks: most of a long request's blocks are freed
LENGTHS = [30, 45, 61, 70]
NEW = 40
GREEDY = SamplingParams(temperature=0, max_tokens=NEW)


def generated(llm, prompts, params=GREEDY):
    return [out["token_ids"] for out in llm.generate(prompts, params)]


def held_blocks(num_computed: int) -> int:
    """Blocks a request holds once num_computed tokens are in the cache: those up to its last token, less those
    wholly before the window of its next token (position num_computed: keys num_computed - window + 1 on)."""
    return -(-num_computed // BLOCK_SIZE) - max(num_computed - MISTRAL_WINDOW + 1, 0) // BLOCK_SIZE


@pytest.mark.parametrize("engine", [{}, {"max_num_batched_tokens": 8}, {"overlap_steps": False}])
def test_greedy_matches_transformers(tiny_mistral, prompts_of_lengths, engine):
    prompts = prompts_of_lengths(LENGTHS)
    llm = LLM(tiny_mistral.path, dtype="float32", block_size=BLOCK_SIZE, **engine)
    assert llm.core.block_manager.window == MISTRAL_WINDOW
    assert generated(llm, prompts) == [tiny_mistral.greedy(prompt, NEW) for prompt in prompts]
    assert llm.core.block_manager.num_free_blocks == len(llm.core.block_manager.blocks)


def test_preemption_with_a_window(tiny_mistral, prompts_of_lengths):
    """14 blocks of 8: one request (up to 110 tokens, 14 blocks without the window) fits; four do not."""
    prompts = prompts_of_lengths(LENGTHS)
    llm = LLM(tiny_mistral.path, dtype="float32", block_size=BLOCK_SIZE, num_kv_blocks=14,
              max_num_batched_tokens=32)
    assert generated(llm, prompts) == [tiny_mistral.greedy(prompt, NEW) for prompt in prompts]
    assert llm.core.scheduler.num_preemptions > 0
    assert llm.core.block_manager.num_free_blocks == 14


def test_prefix_hits_past_the_window(tiny_mistral, prompts_of_lengths):
    """A later turn of a conversation (the first prompt and output, then more) hits the cached blocks in the
    window of its first new token and takes none before it."""
    first = prompts_of_lengths([52], seed=5)[0]
    llm = LLM(tiny_mistral.path, dtype="float32", block_size=BLOCK_SIZE)
    answer = generated(llm, [first])[0]
    second = first + answer + prompts_of_lengths([9], seed=6)[0]
    core = llm.core
    seq = core.make_sequence(1, second, GREEDY)
    admitted = []  # the request's block table as its prompt was admitted, before any step computes
    allocate = core.block_manager.allocate

    def recording_allocate(allocated_seq, *args, **kwargs):
        taken = allocate(allocated_seq, *args, **kwargs)
        if allocated_seq is seq and not admitted:
            admitted.extend(seq.block_table)
        return taken

    core.block_manager.allocate = recording_allocate
    core.add(seq)
    core.step()
    assert seq.num_cached_tokens >= 80  # 10 of the 12 full blocks before the last token
    num_unread = (seq.num_cached_tokens - MISTRAL_WINDOW + 1) // BLOCK_SIZE
    assert admitted[:num_unread] == [FREED] * num_unread and FREED not in admitted[num_unread:]
    while core.has_work():
        core.step()
    assert seq.output_token_ids == tiny_mistral.greedy(second, NEW)


@pytest.mark.parametrize("max_num_batched_tokens", [16384, 16])
def test_free_blocks_follow_the_window_exactly(tiny_mistral, prompts_of_lengths, max_num_batched_tokens):
    """After every step of a long generation (and every chunk of its prompt) the pool holds exactly the
    blocks of the request's window: none freed a step late, none a step early."""
    llm = LLM(tiny_mistral.path, dtype="float32", block_size=BLOCK_SIZE, overlap_steps=False,
              max_num_batched_tokens=max_num_batched_tokens)
    core = llm.core
    total = core.block_manager.num_free_blocks
    prompt = prompts_of_lengths([50], seed=7)[0]
    seq = core.make_sequence(0, prompt, SamplingParams(temperature=0, max_tokens=150))
    core.add(seq)
    counts = []
    while not seq.is_finished:
        core.step()
        if not seq.is_finished:
            counts.append((seq.num_computed_tokens, core.block_manager.num_free_blocks))
    assert len(counts) >= 148
    assert [free for _, free in counts] == [total - held_blocks(computed) for computed, _ in counts]
    assert max(held_blocks(computed) for computed, _ in counts) <= 4  # a 200-token context in 4 blocks of 8
    assert seq.output_token_ids == tiny_mistral.greedy(prompt, 150)
    assert core.block_manager.num_free_blocks == total


def test_padding_rows_of_a_graph_never_read_a_block_freed_behind_a_window(tiny_mistral, prompts_of_lengths,
                                                                          monkeypatch):
    """A decode graph's padding rows attend to the first key of whatever table row they are staged over: a row
    left by a request whose first blocks fell out of its window holds FREED there, which the GPU's kernels would
    read as a block at a negative address. With requests ending at different lengths (the batch shrinks below a
    graph's size) and verification steps staged a row per token, every block read is a block."""
    freed_reads = []
    gather = reference._gather_blocks

    def checked(cache, tables, first_blocks, ends, num_blocks):
        last = (ends.long() - 1).clamp(min=0) // cache.shape[1]
        read = tables.gather(1, torch.minimum(first_blocks[:, None].long() + torch.arange(num_blocks), last[:, None]))
        freed_reads.extend(read[read == FREED].tolist())
        return gather(cache, tables, first_blocks, ends, num_blocks)

    prompts = prompts_of_lengths(LENGTHS)
    lengths = [NEW, 12, 25, 33]
    expected = [tiny_mistral.greedy(prompt, n) for prompt, n in zip(prompts, lengths)]
    params = [SamplingParams(temperature=0, max_tokens=n) for n in lengths]
    llm = speculating(LLM(tiny_mistral.path, dtype="float32", block_size=BLOCK_SIZE, speculative="ngram:k=4"),
                      CorruptedOracle(expected, VOCAB))
    with_eager_graphs(llm)
    monkeypatch.setattr(reference, "_gather_blocks", checked)
    assert generated(llm, prompts, params) == expected
    assert not freed_reads
