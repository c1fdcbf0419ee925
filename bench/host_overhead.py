"""Host time of one engine step, on the CPU, with the GPU's part taken away: a fake model returns
correctly shaped tensors at once and the sampler returns fixed ids, so what is left is the scheduler, the
block manager, building the step's inputs (the CUDA-graph path, with a no-op replay, unless --eager) and
applying the step's results. Decode steps of 1, 64 and 256 running sequences with 1,024-token contexts;
--overlap times the overlapped path (each step launches the next before applying its own results)."""
import argparse
import statistics
import time
from types import SimpleNamespace

import torch
from torch import nn

from engine.config import EngineConfig
from engine.engine_core import EngineCore
from engine.sampler import Sampler
from engine.sampling_params import SamplingParams

VOCAB, HIDDEN = 32000, 64


class FakeModel(nn.Module):
    """A decoder's interface without its work: hidden states and logits are preallocated views."""

    def __init__(self, max_tokens: int, max_rows: int):
        super().__init__()
        self.anchor = nn.Parameter(torch.zeros(1))  # the runner reads device and dtype from the parameters
        self.lm_head = True
        self.kv_window = 0  # no sliding window: every block stays readable
        self.uses_mrope = False  # one position per token
        self.hidden = torch.zeros(max_tokens, HIDDEN)
        self.logits = torch.zeros(max_rows, 1)

    def kv_cache_shape(self, num_blocks, block_size):
        return 1, num_blocks, block_size, 1, 1

    def set_kv_cache(self, k_caches, v_caches, k_scales=None, v_scales=None):
        pass

    def forward(self, input_ids, positions, meta):
        return self.hidden[:len(input_ids)]

    def compute_logits(self, hidden):
        return self.logits[:len(hidden)]


class FixedSampler(Sampler):
    """Plans the batch as the real sampler does, then returns fixed ids."""

    def __init__(self, max_rows: int):
        super().__init__(torch.device("cpu"))
        self.fixed = torch.full((max_rows,), 7, dtype=torch.int64)

    def sample(self, logits, seqs, ahead=0, masks=None):
        self.plan_for(seqs)
        return self.fixed[:len(seqs)], None


class NoopGraph:
    def replay(self):
        pass


def fake_graphs(runner) -> None:
    """Turns on the CUDA-graph path on the CPU: same input preparation, replay does nothing."""
    shapes = runner.graphs.shapes()
    runner.graphs.hidden = torch.zeros(max(shape.num_tokens for shape in shapes), HIDDEN)
    runner.graphs.captured = {shape: NoopGraph() for shape in shapes}


def make_core(batch: int, context: int, steps: int, eager: bool, overlap: bool) -> EngineCore:
    config = EngineConfig(model="-", device="cpu", dtype="float32", num_kv_blocks=batch * ((context + steps) // 16 + 2))
    loaded = SimpleNamespace(model=FakeModel(config.max_num_batched_tokens, config.max_num_seqs), model_dir="/-",
                             vision=None,
                             hf_config=SimpleNamespace(vocab_size=VOCAB, hidden_size=HIDDEN, eos_token_id=None,
                                                       max_position_embeddings=40960))
    core = EngineCore(config, loaded)
    core.runner.sampler = FixedSampler(config.max_num_seqs)
    core.overlap = overlap
    if not eager:
        fake_graphs(core.runner)
    return core


def timed_steps(batch: int, context: int, steps: int, eager: bool, overlap: bool) -> tuple[float, float]:
    """Median and mean milliseconds of `steps` decode steps after the prefill and a few warm-up steps."""
    core = make_core(batch, context, steps, eager, overlap)
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=steps + 64)
    for i in range(batch):
        prompt = torch.randint(0, VOCAB, (context - 1,), generator=g).tolist()
        core.add(core.make_sequence(i, prompt, params))
    while core.scheduler.waiting or any(seq.num_computed_tokens < len(seq) - 1 for seq in core.scheduler.running):
        core.step()
    for _ in range(8):
        core.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        results = core.step()
        times.append((time.perf_counter() - start) * 1e3)
        assert len(results) == batch
    return statistics.median(times), statistics.fmean(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,64,256")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=256)
    ap.add_argument("--eager", action="store_true", help="time the eager path (no CUDA-graph padding)")
    ap.add_argument("--overlap", action="store_true", help="time the overlapped path")
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"host time per decode step, {'eager' if args.eager else 'graph'} path"
          f"{', overlapped' if args.overlap else ''}, {args.context}-token contexts, "
          f"{args.steps} steps")
    print(f"{'batch':>6} {'median ms':>10} {'mean ms':>9} {'us/seq':>7}")
    for batch in map(int, args.batches.split(",")):
        median, mean = timed_steps(batch, args.context, args.steps, args.eager, args.overlap)
        print(f"{batch:>6} {median:>10.3f} {mean:>9.3f} {mean * 1e3 / batch:>7.1f}", flush=True)


if __name__ == "__main__":
    main()
