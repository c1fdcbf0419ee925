"""The inputs CUDA graphs replay, checked on the CPU: every step is staged padded to the captured shape the
GPU would replay (decode batch sizes, prefill token counts), and a stand-in graph runs the model eagerly on
exactly those padded device buffers. Greedy outputs must still equal transformers' token for token."""
import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.cuda_graphs import PREFILL_GRAPH_MAX_TOKENS, CudaGraphs, GraphShape
from engine.sequence import Sequence
from engine.step_inputs import StepBuffers
from kernels import AttentionMetadata

NEW = 24
GREEDY = SamplingParams(temperature=0, max_tokens=NEW)


class EagerReplay:
    """A stand-in for a captured graph: runs the forward on the padded step buffers of its shape, with the
    attention path its capture takes (staged as CudaGraphs.capture_next stages it: padding only)."""

    def __init__(self, runner, shape: GraphShape):
        self.runner, self.shape, self.replays = runner, shape, 0
        self.rows_read_each_other = runner.buffers.stage([], [], shape).rows_read_each_other

    def replay(self) -> None:
        runner, shape = self.runner, self.shape
        ids, positions, slots, _, cu_seqlens, seq_lens, order, tables = runner.buffers.device_views(
            shape.num_tokens, shape.num_rows, 0)
        meta = AttentionMetadata(slot_mapping=slots, cu_seqlens_q=cu_seqlens, seq_lens=seq_lens,
                                 block_tables=tables, max_seqlen_q=1 if shape.is_decode else shape.num_tokens,
                                 max_seqlen_k=runner.max_model_len, is_decode=shape.is_decode, seq_order=order,
                                 rows_read_each_other=self.rows_read_each_other)
        runner.graphs.hidden[:shape.num_tokens] = runner.model(ids, positions, meta)
        self.replays += 1


def with_eager_graphs(llm) -> dict:
    """Every graph shape's stand-in, after the warm-up (on CUDA it captures real graphs over them)."""
    llm.core.finish_warm_up()
    runner = llm.core.runner
    shapes = runner.graphs.shapes()
    runner.graphs.hidden = torch.zeros(max(s.num_tokens for s in shapes), runner.hidden_size, dtype=runner.dtype,
                                       device=runner.device)
    runner.graphs.captured = {shape: EagerReplay(runner, shape) for shape in shapes}
    return runner.graphs.captured


def test_padded_graph_steps_match_transformers(tiny_model, prompts_of_lengths):
    """Prefill steps padded with empty rows and unowned tokens, decode steps with one-token rows."""
    prompts = prompts_of_lengths([3, 17, 33, 50, 9])
    llm = LLM(tiny_model.path, dtype="float32", max_num_seqs=8, max_num_batched_tokens=40)
    graphs = with_eager_graphs(llm)
    outputs = [out["token_ids"] for out in llm.generate(prompts, GREEDY)]
    assert outputs == [tiny_model.greedy(prompt, NEW) for prompt in prompts]
    replayed = {shape for shape, graph in graphs.items() if graph.replays}
    assert any(not shape.is_decode for shape in replayed) and any(shape.is_decode for shape in replayed)
    assert all(graph.replays == 0 for shape, graph in graphs.items() if shape.num_tokens > 40)


def test_prefill_graph_padding_with_prefix_hits(tiny_llama, prompts_of_lengths):
    shared = prompts_of_lengths([40], seed=5)[0]
    prompts = [shared + tail for tail in prompts_of_lengths([1, 9, 20], seed=6)]
    llm = LLM(tiny_llama.path, dtype="float32", max_num_seqs=4)
    with_eager_graphs(llm)
    first = [out["token_ids"] for out in llm.generate(prompts[:1], GREEDY)]
    rest = [out["token_ids"] for out in llm.generate(prompts[1:], GREEDY)]
    assert llm.core.block_manager.num_hit_tokens >= 2 * 32
    assert first + rest == [tiny_llama.greedy(prompt, NEW) for prompt in prompts]


def test_graph_choice():
    """Pure decode picks the next decode batch size up; other steps the next prefill token count up (rows
    padded to max_num_seqs); past PREFILL_GRAPH_MAX_TOKENS or max_num_batched_tokens, eager."""
    graphs = CudaGraphs(EngineConfig(model="-", device="cpu", max_num_seqs=32, max_num_batched_tokens=4096))
    assert graphs.decode_sizes == [1, 2, 4, 8, 16, 24, 32]
    assert graphs.prefill_tokens == [16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072,
                                     4096]
    assert graphs.shape_for([1] * 5) is None  # nothing captured: every step runs eagerly
    graphs.captured = dict.fromkeys(graphs.shapes())
    assert graphs.shape_for([1] * 5) == GraphShape(8, 8, is_decode=True)
    assert graphs.shape_for([1] * 32) == GraphShape(32, 32, is_decode=True)
    assert graphs.shape_for([1024]) == GraphShape(1024, 32, is_decode=False)
    assert graphs.shape_for([1, 1, 30]) == GraphShape(32, 32, is_decode=False)
    assert graphs.shape_for([1030, 1, 1]) == GraphShape(1536, 32, is_decode=False)
    assert graphs.shape_for([2049]) == GraphShape(3072, 32, is_decode=False)
    assert graphs.shape_for([4000, 96]) == GraphShape(4096, 32, is_decode=False)
    assert graphs.shape_for([4097]) is None
    assert graphs.shape_for([1] * 33) is None
    graphs.plan_all()  # the order the warm-up captures them in: largest first, sharing the first one's pool
    assert [shape.num_tokens for shape in graphs.pending] == sorted(
        [shape.num_tokens for shape in graphs.shapes()], reverse=True)
    del graphs.captured[GraphShape(8, 8, is_decode=True)]  # not captured yet: a step of its size runs eagerly
    assert graphs.shape_for([1] * 5) is None
    assert graphs.shape_for([1] * 9) == GraphShape(16, 16, is_decode=True)
    offline = CudaGraphs(EngineConfig(model="-", device="cpu", max_num_seqs=32, max_num_batched_tokens=16384))
    assert offline.prefill_tokens[-4:] == [3072, 4096, 6144, PREFILL_GRAPH_MAX_TOKENS] == [3072, 4096, 6144, 8192]


@pytest.mark.parametrize("graph", [None, GraphShape(16, 16, is_decode=True, verifies=True)])
def test_a_requests_verification_rows_start_side_by_side_longest_request_first(graph):
    """A verification step staged as decode rows orders its rows by their request's context, longest first, a
    request's rows together (they read the same keys: started side by side, their reads can share L2), then its
    padding rows as they are."""
    config = EngineConfig(model="-", device="cpu", max_num_seqs=16, speculative="ngram:k=3")
    buffers = StepBuffers(config, 64, torch.device("cpu"))
    seqs = []
    for i, (context, drafts) in enumerate([(9, 2), (10, 2), (10, 3), (4, 1), (10, 2)]):
        seq = Sequence(i, list(range(context)), SamplingParams(), 64)
        seq.num_computed_tokens, seq.draft_token_ids, seq.block_table = context - 1, [1] * drafts, [i]
        seqs.append(seq)
    num_tokens = [1 + len(seq.draft_token_ids) for seq in seqs]
    assert buffers.verifies_as_rows(seqs, num_tokens)
    step = buffers.upload(buffers.stage(seqs, num_tokens, graph, as_rows=True))
    firsts = [sum(num_tokens[:i]) for i in range(len(seqs))]
    by_length = sorted(range(len(seqs)), key=lambda i: -(len(seqs[i]) + len(seqs[i].draft_token_ids)))
    rows = sum(num_tokens)
    expected = [firsts[i] + j for i in by_length for j in range(num_tokens[i])]
    assert step.meta.seq_order.tolist() == expected + list(range(rows, step.meta.seq_lens.shape[0]))
    assert step.meta.seq_lens[:rows].tolist() == [seq.num_computed_tokens + 1 + j
                                                  for seq, n in zip(seqs, num_tokens) for j in range(n)]


def test_staged_arrays_start_16_aligned(tiny_llama, prompts_of_lengths):
    """Whatever a step's sizes, every array it uploads starts at a multiple of 16 elements: Triton compiles a
    kernel variant per pointer alignment, and a variant first met mid-run cost seconds on the GPU."""
    llm = LLM(tiny_llama.path, dtype="float32", max_num_seqs=8)
    runner = llm.core.runner
    for num_tokens, num_rows in [(1, 1), (7, 3), (13, 5), (33, 8)]:
        views = runner.buffers.device_views(num_tokens, num_rows, num_rows)
        assert [view.storage_offset() % 16 for view in views] == [0] * len(views)
    prompts = prompts_of_lengths([3, 10, 21])
    assert ([out["token_ids"] for out in llm.generate(prompts, GREEDY)]
            == [tiny_llama.greedy(prompt, NEW) for prompt in prompts])


def test_decode_rows_are_ordered_longest_context_first(tiny_llama, prompts_of_lengths):
    """Every decode step stages the order the decode kernel starts its rows in: its sequences by decreasing
    context length, then its padding rows as they are."""
    llm = LLM(tiny_llama.path, dtype="float32", max_num_seqs=8, max_num_batched_tokens=24)
    runner, orders = llm.core.runner, []
    upload = runner.buffers.upload

    def recording_upload(staged):
        step = upload(staged)
        if staged.is_decode:
            rows = len(staged.sample_rows)  # every sequence of a decode step samples; padding rows do not
            orders.append((step.meta.seq_lens.tolist(), step.meta.seq_order.tolist(), rows))
        return step

    runner.buffers.upload = recording_upload
    prompts = prompts_of_lengths([5, 30, 1, 40, 12])
    assert ([out["token_ids"] for out in llm.generate(prompts, GREEDY)]
            == [tiny_llama.greedy(prompt, NEW) for prompt in prompts])
    for seq_lens, order, rows in orders:
        assert sorted(order[:rows]) == list(range(rows)) and order[rows:] == list(range(rows, len(seq_lens)))
        ordered = [seq_lens[row] for row in order[:rows]]
        assert ordered == sorted(ordered, reverse=True)
    assert any(rows > 1 and seq_lens[:rows] != sorted(seq_lens[:rows], reverse=True)
               for seq_lens, _, rows in orders)  # some step's rows were not already in order
