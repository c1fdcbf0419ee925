"""CUDA graphs of the decoder's forward, captured once, largest first, and replayed by steps of their shape.

A pure-decode step replays the graph of the next batch size up on a ladder, padded with one-token rows that write to
slot -1 and read one key. A speculative engine also captures verification graphs on that ladder (from two rows up: a
verification has a draft token at least): a verification step staged as decode rows, one per token, has rows that
read keys other rows of their request store in the same step, so its attention stores every key first and then
attends (kernels' rows_read_each_other), where a plain decode step stores each row's key within the attention launch
(the fused kernel). Plain decode steps of a speculative engine replay the plain graphs, as those of an engine
without speculation do. Any other step of at most PREFILL_GRAPH_MAX_TOKENS tokens replays the graph of the next
token count up, padded with empty rows to max_num_seqs and with tokens that no row owns (slot -1, never attended).
Small prefills need it because an eager forward costs more host time than they take on the GPU; large ones because a
served engine shares its host with the event loop and the encoding threads, and an eager forward's launches, each
taking the GIL again, stretch the step while a burst of requests arrives. The token counts alternate 2^k and 1.5 x
2^k, so padding adds at most half a step's tokens. A graph reads its inputs from the step buffers at fixed addresses
(engine/step_inputs.py) and writes its hidden states into one shared output tensor.

Start-up captures none: the engine captures them after it is ready (engine/model_runner.py's warm-up), one at a
time, and until a step's graph exists the step runs eagerly.
"""
import bisect
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from engine.config import EngineConfig

# The handler's token budget per step: every step it builds replays a graph. Larger ones (the offline LLM's) run
# eagerly, their GPU time covering their launches.
PREFILL_GRAPH_MAX_TOKENS = EngineConfig.max_num_batched_tokens


@dataclass(frozen=True)
class GraphShape:
    """The padded shape a captured graph runs. Decode graphs pad with one-token rows (num_tokens ==
    num_rows); prefill graphs pad with empty rows and with tokens no row owns. verifies: a decode graph of
    verification rows, which read each other's keys."""
    num_tokens: int
    num_rows: int
    is_decode: bool
    verifies: bool = False


class CudaGraphs:
    def __init__(self, config: EngineConfig):
        self.max_num_seqs = max_size = config.max_num_seqs
        self.decode_sizes = sorted({s for s in [1, 2, 4, 8, *range(16, max_size + 1, 8), max_size] if s <= max_size})
        self.verification_sizes = self.decode_sizes[1:] if config.num_speculative_tokens else []
        most = min(config.max_num_batched_tokens, PREFILL_GRAPH_MAX_TOKENS)  # 16, 24, 32, 48, 64, ..., most
        self.prefill_tokens = sorted({t for t in [*(m << e for e in range(3, most.bit_length()) for m in (2, 3)), most]
                                      if t <= most})
        self.captured: dict[GraphShape, torch.cuda.CUDAGraph] = {}  # empty: every step runs eagerly
        self.pending: list[GraphShape] = []  # to capture, largest first (plan_all())
        self.hidden: Tensor | None = None  # the hidden states every graph writes, [largest graph's tokens, H]
        self._pool = None  # the memory pool of the first graph, which the later, smaller ones share

    def shape_for(self, num_tokens: list[int], as_rows: bool = False) -> GraphShape | None:
        """The captured graph to replay for a step computing num_tokens per row (as_rows: a verification step
        staged as a decode row per token, which replays a verification graph); None runs it eagerly."""
        num_rows, total = len(num_tokens), sum(num_tokens)
        if not self.captured or num_rows > self.max_num_seqs:
            return None
        if total == num_rows or as_rows:  # one token per row: pure decode (or verification rows)
            size = self.decode_sizes[bisect.bisect_left(self.decode_sizes, total)]
            shape = GraphShape(size, size, is_decode=True, verifies=as_rows)
        elif total <= self.prefill_tokens[-1]:
            size = self.prefill_tokens[bisect.bisect_left(self.prefill_tokens, total)]
            shape = GraphShape(size, self.max_num_seqs, is_decode=False)
        else:
            return None
        return shape if shape in self.captured else None  # not captured yet: eagerly

    def shapes(self) -> list[GraphShape]:
        return ([GraphShape(size, size, is_decode=True) for size in self.decode_sizes]
                + [GraphShape(size, size, is_decode=True, verifies=True) for size in self.verification_sizes]
                + [GraphShape(size, self.max_num_seqs, is_decode=False) for size in self.prefill_tokens])

    def plan_all(self) -> None:
        """Every shape becomes pending, largest first so the smaller graphs reuse the first one's memory pool."""
        self.pending = sorted(self.shapes(), key=lambda shape: shape.num_tokens, reverse=True)

    def capture_next(self, model, prepare: Callable, hidden_size: int) -> None:
        """Captures the first pending graph, warmed up and captured on a step of padding only, whose inputs
        prepare([], [], shape) stages in the step buffers (nothing may be in flight that reads them)."""
        shape = self.pending.pop(0)
        parameter = next(model.parameters())
        if self.hidden is None:  # the first graph is the largest
            self.hidden = torch.zeros(shape.num_tokens, hidden_size, dtype=parameter.dtype, device=parameter.device)
        with torch.inference_mode():
            step = prepare([], [], shape)
            hidden = self.hidden[:shape.num_tokens]
            graph = torch.cuda.CUDAGraph()
            hidden.copy_(model(step.input_ids, step.positions, step.meta))  # warm-up
            torch.cuda.synchronize(parameter.device)
            with torch.cuda.graph(graph, self._pool):
                hidden.copy_(model(step.input_ids, step.positions, step.meta))
            torch.cuda.synchronize(parameter.device)
        self._pool = graph.pool()
        self.captured[shape] = graph

    def replay(self, shape: GraphShape) -> Tensor:
        """Runs the graph of this shape on the staged inputs; returns its hidden states, padding included."""
        self.captured[shape].replay()
        return self.hidden[:shape.num_tokens]
