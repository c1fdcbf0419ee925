"""The decoder's tensor-parallel sums (models/all_reduce.py) on N GPUs of one host: a norm of a RankPartial, fused
with the sum over peer memory where the rows fit, against NCCL's all-reduce followed by the norm, eagerly and
replayed inside a CUDA graph (fused and NCCL sums interleaved); then the time of one sum and norm per row count,
fused against NCCL plus the norm, both inside CUDA graphs as decode steps run them.

Run from the repo root on a host with N GPUs (NVLink multicast stays off, as in the engine):
    PYTHONPATH=. python3 bench/all_reduce_check.py [--ranks 2]

A result counts as right when every rank's equals rank 0's bit for bit and each element equals NCCL's path within
the rounding that summing N terms in its dtype may bring (at TP=2 both round the one float32 sum: equal). Exits 1
on a wrong result.
"""
import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engine.tensor_parallel import NO_MULTICAST
from kernels import add_rms_norm
from models import all_reduce
from models.all_reduce import RankPartial, set_up_exchange

ROWS = [(1, 2048), (1, 4096), (8, 4096), (64, 2048), (128, 4096), (256, 4096)]
GRAPH_CALLS = 50  # sums captured in one timed graph
REPLAYS = 20
EPS = 1e-6


def inputs(shape, dtype, rank: int, step: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(this rank's part, the residual, the norm's weight): the last two alike on every rank."""
    def draw(seed):
        return torch.randn(shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(seed)).to(dtype)
    return draw(1000 * step + rank), draw(1000 * step + 99), draw(7)[0].abs() + 0.5


def through_nccl(shape, dtype, step: int = 0):
    return nccl_then_norm(*inputs(shape, dtype, dist.get_rank(), step))


def same_on_every_rank(t: torch.Tensor) -> bool:
    gathered = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, t.contiguous())
    return all(torch.equal(g, gathered[0]) for g in gathered)


def wrong_sums(got, shape, dtype, world: int, step: int) -> list[str]:
    """What is wrong with `got` (normed, sum + residual): equal to NCCL's path at two ranks (both round the one
    float32 sum), within a few roundings of it beyond (NCCL's ring sums in another order)."""
    wrong = [] if all(same_on_every_rank(t) for t in got) else ["ranks differ"]
    for name, ours, nccl in zip(("norm", "sum + residual"), got, through_nccl(shape, dtype, step)):
        tolerance = 0 if world == 2 else 4 * world * torch.finfo(dtype).eps
        if not torch.allclose(ours.float(), nccl.float(), rtol=tolerance, atol=tolerance):
            wrong.append(f"{name} off NCCL's by {(ours.float() - nccl.float()).abs().max().item():.3g}")
    return wrong


def check_eager(world: int) -> list[str]:
    wrong = []
    for shape in ROWS:
        for dtype in (torch.bfloat16, torch.float32):
            part, residual, weight = inputs(shape, dtype, dist.get_rank())
            got = RankPartial(part).norm(residual, weight, EPS)
            wrong += [f"eager {shape} {dtype}: {what}" for what in wrong_sums(got, shape, dtype, world, 0)]
    return wrong


def check_graph(world: int) -> list[str]:
    """One graph of every row count's sum and norm (fused and NCCL's interleaved in one stream), replayed on fresh
    inputs three times."""
    statics = [inputs(shape, torch.bfloat16, dist.get_rank()) for shape in ROWS]
    for part, residual, weight in statics:  # warm-up outside the graph (NCCL's first call sets up)
        RankPartial(part.clone()).norm(residual, weight, EPS)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [RankPartial(part).norm(residual, weight, EPS) for part, residual, weight in statics]
    wrong = []
    for step in range(1, 4):
        for static, shape in zip(statics, ROWS):
            for tensor, fresh in zip(static, inputs(shape, torch.bfloat16, dist.get_rank(), step)):
                tensor.copy_(fresh)
        graph.replay()
        torch.cuda.synchronize()
        for out, shape in zip(outs, ROWS):
            wrong += [f"graph replay {step} {shape}: {what}"
                      for what in wrong_sums(out, shape, torch.bfloat16, world, step)]
    return wrong


def graph_us(sum_and_norm, shape) -> float:
    """Microseconds per sum and norm of `shape`'s rows, GRAPH_CALLS of them captured in one graph (every rank replays
    the same count: a collective benchmark cannot pick its repetitions from its own timings)."""
    part, residual, weight = (t.zero_() for t in inputs(shape, torch.bfloat16, dist.get_rank()))
    sum_and_norm(part, residual, weight)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(GRAPH_CALLS):
            sum_and_norm(part, residual, weight)
    graph.replay()
    torch.cuda.synchronize()
    dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(REPLAYS):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / (REPLAYS * GRAPH_CALLS)


def nccl_then_norm(part, residual, weight):
    dist.all_reduce(part)
    return add_rms_norm(part, residual, weight, EPS)


def rank_main(rank: int, world: int, port: int) -> None:
    """One rank: the checks and timings; rank 0 prints every rank's findings before the group is left (should
    leaving hang, the findings are out)."""
    os.environ.update(NO_MULTICAST)
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0)
    dist.init_process_group("nccl", store=store, rank=rank, world_size=world, device_id=device)
    line = set_up_exchange(True, device, torch.bfloat16)
    wrong = check_eager(world) + check_graph(world)
    timings = []
    for shape in ROWS:
        fused = all_reduce._exchange is not None and all_reduce._exchange.fits(torch.empty(shape, dtype=torch.bfloat16))
        ours = graph_us(lambda p, r, w: RankPartial(p).norm(r, w, EPS), shape)
        timings.append((shape, "peer" if fused else "NCCL", ours, graph_us(nccl_then_norm, shape)))
    found = [None] * world
    dist.all_gather_object(found, wrong)
    wrong = [f"rank {r}: {what}" for r, whats in enumerate(found) for what in whats]
    if rank == 0:
        report(world, line, wrong, timings)
    all_reduce.release_exchange()
    getattr(dist.distributed_c10d, "_abort_process_group", dist.destroy_process_group)()
    if wrong:
        sys.exit(1)


def report(world: int, line: str, wrong: list[str], timings: list[tuple]) -> None:
    print(f"{world} x {torch.cuda.get_device_name()}, torch {torch.__version__}: {line}")
    print("sums: " + ("all as NCCL's, alike on every rank (eager and graph replays)" if not wrong
                      else "WRONG: " + "; ".join(wrong[:20])))
    print(f"\n{'rows':>12} {'path':>5} {'ours us':>8} {'NCCL+norm us':>13}"
          "   (bf16, one sum, residual add and norm, inside CUDA graphs)", flush=True)
    for shape, path, ours, nccl in timings:
        print(f"{shape!s:>12} {path:>5} {ours:8.2f} {nccl:13.2f}", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    args = ap.parse_args()
    mp.spawn(rank_main, args=(args.ranks, 29517), nprocs=args.ranks)  # raises if a rank exits non-zero


if __name__ == "__main__":
    main()
