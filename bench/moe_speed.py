"""The fused MoE (kernels/triton_moe.py) on the GPU: correctness against the torch reference, speed against
the reference's loop over experts and against the floor, and a sweep of its tiles.

Run on a CUDA machine from the repo root:
    PYTHONPATH=. python3 bench/moe_speed.py                      # check + time, Qwen3-30B-A3B and gpt-oss shapes
    PYTHONPATH=. python3 bench/moe_speed.py --sweep --shapes qwen3-30b-a3b   # best tiles per token count
    PYTHONPATH=. python3 bench/moe_speed.py --shapes qwen3-30b-a3b --tokens 1,2,4 --direct-max-tokens 0  # sorted

Routing is uniform at random (softmax of random logits), so a step of T tokens reaches about
E (1 - (1 - k/E)^T) experts. The floor of a call is the larger of: the bytes it must move (the weights of the
experts it reaches, its input and output) at the measured copy bandwidth, and its FLOPs (6 T k H I) at the
measured bf16 matmul rate. Times are CUDA-graph replays (triton.testing.do_bench_cudagraph), as the engine
runs decode steps; "layer" adds the router GEMM and the top-k to the experts. --direct-max-tokens sets
kernels/triton_moe.py's DIRECT_MAX_TOKENS and DIRECT_MXFP4_MAX_TOKENS for the run (0: every token count sorted by
expert).
"""
import argparse
import itertools
import sys

import torch
import triton
import triton.testing

from kernels.mxfp4 import Mxfp4Weight

DTYPE = torch.bfloat16
DEVICE = "cuda"
SHAPES = {  # experts, top-k, hidden, expert intermediate (this rank's), activation, biases, MXFP4 experts
    "qwen3-30b-a3b": (128, 8, 2048, 768, "silu", False, False),
    "qwen3-30b-a3b-tp2": (128, 8, 2048, 384, "silu", False, False),
    "gpt-oss-20b": (32, 4, 2880, 2880, "clamped_swiglu", True, False),
    "gpt-oss-20b-mxfp4": (32, 4, 2880, 2880, "clamped_swiglu", True, True),
    "gpt-oss-120b-mxfp4": (128, 4, 2880, 2880, "clamped_swiglu", True, True),
}
TOKENS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
SWEEP_TOKENS = [1, 4, 16, 64, 256, 1024, 4096, 16384]
REFERENCE_MAX_TOKENS = 4096


def copy_bandwidth() -> float:
    """Bytes per second of a 1 GiB device-to-device copy (read plus write), as bench.md's floors use."""
    src = torch.empty(2**30, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=10, rep=200, return_mode="median")
    return 2 * src.numel() / (ms * 1e-3)


def matmul_flops() -> float:
    a, b = (torch.randn(8192, 8192, device=DEVICE, dtype=DTYPE) for _ in range(2))
    ms = triton.testing.do_bench(lambda: a @ b, warmup=10, rep=200, return_mode="median")
    return 2 * 8192**3 / (ms * 1e-3)


def graph_us(fn, rep: int = 50) -> float:
    return triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median") * 1e3


class Case:
    """Random bf16 experts (or MXFP4 ones: random codes, scales around 2^-7) of one shape and a routed batch of T
    tokens."""

    def __init__(self, shape: str, num_tokens: int):
        from kernels.triton_moe import select_experts

        self.shape, self.num_tokens = shape, num_tokens
        experts, self.top_k, hidden, inter, self.activation, bias, mxfp4 = SHAPES[shape]
        generator = torch.Generator(device=DEVICE).manual_seed(0)

        def randn(*size, scale=1.0):
            return (torch.randn(*size, device=DEVICE, generator=generator) * scale).to(DTYPE)

        self.x = randn(num_tokens, hidden)
        self.router = randn(experts, hidden, scale=hidden**-0.5)
        def weight(rows, cols):
            if not mxfp4:
                return randn(experts, rows, cols, scale=cols**-0.5)
            blocks = torch.randint(0, 256, (experts, rows, cols // 2), dtype=torch.uint8, device=DEVICE,
                                   generator=generator)
            return Mxfp4Weight(blocks, torch.full((experts, rows, cols // 32), 120, dtype=torch.uint8, device=DEVICE))

        self.w_gate_up, self.w_down = weight(2 * inter, hidden), weight(hidden, inter)
        self.b_gate_up = randn(experts, 2 * inter) if bias else None
        self.b_down = randn(experts, hidden) if bias else None
        self.ids, self.weights = select_experts(self.x @ self.router.T, self.top_k, True)
        self.num_reached = int(self.ids.unique().numel())
        self.kwargs = dict(activation=self.activation, swiglu_alpha=1.702, swiglu_limit=7.0)

    def experts(self):
        return self.w_gate_up, self.w_down, self.b_gate_up, self.b_down

    def bytes_moved(self) -> int:
        """The weights of the experts reached (and their biases, an MXFP4 weight's scales), the input and the
        output."""
        tensors = [part for t in self.experts() if t is not None
                   for part in ((t.blocks, t.scales) if isinstance(t, Mxfp4Weight) else (t,))]
        per_expert = sum(t[0].numel() * t.element_size() for t in tensors)
        return self.num_reached * per_expert + 2 * self.x.numel() * self.x.element_size()

    def flops(self) -> int:
        hidden, inter = self.w_down.shape[1:]
        return 6 * self.num_tokens * self.top_k * hidden * inter

    def fused(self, tiles=None):
        from kernels.triton_moe import fused_moe

        return fused_moe(self.x, self.ids, self.weights, *self.experts(), tiles=tiles, **self.kwargs)

    def layer(self):
        from kernels.triton_moe import routed_experts

        return routed_experts(self.x, self.router, None, self.top_k, True, *self.experts(), **self.kwargs)

    def reference(self):
        from kernels import reference

        return reference.fused_moe(self.x, self.ids, self.weights, *self.experts(), **self.kwargs)


def check_and_time(shapes, tokens, bandwidth, flops_rate):
    rows, failures = [], []
    for shape in shapes:
        for num_tokens in tokens:
            case = Case(shape, num_tokens)
            with_reference = num_tokens <= REFERENCE_MAX_TOKENS
            error = None
            if with_reference:
                expected = case.reference().float()
                error = ((case.fused().float() - expected).abs().max() / expected.abs().max()).item()
                if error > 2e-2:
                    failures.append(f"{shape} T{num_tokens}: max error {error:.2e} of the largest output")
            fused_us, layer_us = graph_us(case.fused), graph_us(case.layer)
            reference_us = triton.testing.do_bench(case.reference, rep=50, return_mode="median") * 1e3 \
                if with_reference else None
            floor_us = max(case.bytes_moved() / bandwidth, case.flops() / flops_rate) * 1e6
            rows.append((shape, num_tokens, case.num_reached, case.bytes_moved() / 1e6, fused_us, layer_us, floor_us,
                         case.bytes_moved() / (fused_us * 1e-6) / 1e9, case.flops() / (fused_us * 1e-6) / 1e12,
                         reference_us, error))
            print(f"{shape} T{num_tokens}: {fused_us:.1f} us", file=sys.stderr, flush=True)
            del case
            torch.cuda.empty_cache()
    print(f"\n== fused MoE on {torch.cuda.get_device_name()}: copy {bandwidth / 1e12:.2f} TB/s, "
          f"bf16 matmul {flops_rate / 1e12:.0f} TFLOP/s (measured)")
    print(f"{'shape':<18} {'T':>6} {'experts':>7} {'MB':>7} {'fused us':>9} {'layer us':>9} {'floor us':>9} "
          f"{'floor/fused':>11} {'GB/s':>6} {'TFLOP/s':>7} {'ref us':>9} {'ref/fused':>9} {'rel err':>8}")
    for shape, num_tokens, reached, mb, fused_us, layer_us, floor_us, gbps, tflops, reference_us, error in rows:
        ref = f"{reference_us:9.0f} {reference_us / fused_us:9.1f}" if reference_us else f"{'':>9} {'':>9}"
        err = f"{error:8.1e}" if error is not None else ""
        print(f"{shape:<18} {num_tokens:>6} {reached:>7} {mb:7.1f} {fused_us:9.1f} {layer_us:9.1f} {floor_us:9.1f} "
              f"{floor_us / fused_us:10.0%} {gbps:6.0f} {tflops:7.1f} {ref} {err}")
    for failure in failures:
        print(f"FAIL {failure}")
    return not failures


# ---- tile sweep -----------------------------------------------------------------------------------------

SWEEP_REP = 20  # ms of replays per timing: the sweep times a few hundred launches per token count
GEMM_TILES = [(n, k, w, s) for n, k, w, s in itertools.product((32, 64, 128), (64, 128), (4, 8), (3, 4))
              if not (w == 8 and n == 32)]


def block_m_candidates(num_tokens: int) -> tuple[int, ...]:
    if num_tokens <= 16:
        return 16, 32
    if num_tokens <= 256:
        return 16, 32, 64
    return (32, 64, 128) if num_tokens <= 2048 else (64, 128)


def sweep(shapes, tokens):
    """Per token count: each BLOCK_M's best gate/up and down tiles, timed kernel by kernel; the fastest sum."""
    from kernels.triton_moe import choose_tiles

    for shape in shapes:
        best_by_tokens = {}
        for num_tokens in tokens:
            case = Case(shape, num_tokens)
            results = [best_tiles(case, block_m) for block_m in block_m_candidates(num_tokens)]
            total_us, align_us, gate_up_us, down_us, tiles = min(results, key=lambda result: result[0])
            best_by_tokens[num_tokens] = tiles
            print(f"{shape} T{num_tokens}: best {total_us:.1f} us (align {align_us:.1f}, gate/up {gate_up_us:.1f}, "
                  f"down {down_us:.1f}), shipped tiles {graph_us(case.fused):.1f} us ({choose_tiles(num_tokens)}): "
                  f"{tiles}", flush=True)
            del case
            torch.cuda.empty_cache()
        print(f"\n== best tiles for {shape} by token count (for kernels/triton_moe.py's TILE_TABLE)")
        for num_tokens, tiles in best_by_tokens.items():
            print(f"    {num_tokens}: {tiles},")


def best_tiles(case: Case, block_m: int) -> tuple:
    """(whole call us, align us, gate/up us, down us, MoeTiles) with this BLOCK_M's fastest tiles per GEMM."""
    from kernels.triton_moe import (
        GemmTiles,
        MoeTiles,
        align_rows,
        expert_activations,
        weighted_expert_outputs,
    )

    num_experts = case.w_gate_up.shape[0]
    sorted_rows, block_experts = align_rows(case.ids, num_experts, block_m)

    def gate_up(tiles):
        return expert_activations(case.x, sorted_rows, block_experts, case.w_gate_up, case.b_gate_up, case.top_k,
                                  case.activation, 1.702, 7.0, block_m, tiles)

    def fastest(launch) -> tuple[float, GemmTiles]:
        candidates = [GemmTiles(*t) for t in GEMM_TILES]
        timed = [(graph_us(lambda tiles=tiles: launch(tiles), SWEEP_REP), tiles) for tiles in candidates]
        return min(timed, key=lambda item: item[0])

    gate_up_us, gate_up_tiles = fastest(gate_up)
    activations = gate_up(gate_up_tiles)
    down_us, down_tiles = fastest(lambda tiles: weighted_expert_outputs(
        activations, sorted_rows, block_experts, case.w_down, case.b_down, case.weights, block_m, tiles))
    tiles = MoeTiles(block_m, gate_up_tiles, down_tiles)
    align_us = graph_us(lambda: align_rows(case.ids, num_experts, block_m), SWEEP_REP)
    return graph_us(lambda: case.fused(tiles)), align_us, gate_up_us, down_us, tiles


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    ap.add_argument("--sweep", action="store_true", help="search the tiles instead of checking and timing")
    ap.add_argument("--tokens", help=f"comma-separated token counts (default {TOKENS}; {SWEEP_TOKENS} with --sweep)")
    ap.add_argument("--direct-max-tokens", type=int,
                    help="kernels/triton_moe.py's DIRECT_MAX_TOKENS and DIRECT_MXFP4_MAX_TOKENS for this run")
    args = ap.parse_args()
    if args.direct_max_tokens is not None:
        from kernels import triton_moe

        triton_moe.DIRECT_MAX_TOKENS = triton_moe.DIRECT_MXFP4_MAX_TOKENS = args.direct_max_tokens
    if not torch.cuda.is_available():
        sys.exit("bench/moe_speed.py needs a CUDA GPU (the kernels are tested on CPU by tests/kernels)")
    shapes = args.shapes.split(",")
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        sys.exit(f"unknown shapes {unknown}; known: {', '.join(SHAPES)}")
    tokens = [int(t) for t in args.tokens.split(",")] if args.tokens else None
    if args.sweep:
        sweep(shapes, tokens or SWEEP_TOKENS)
        return
    sys.exit(0 if check_and_time(shapes, tokens or TOKENS, copy_bandwidth(), matmul_flops()) else 1)


if __name__ == "__main__":
    main()
