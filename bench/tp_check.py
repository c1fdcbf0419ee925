"""GPU check of tensor parallelism: on a random Qwen3-0.6B-shaped model, TP=N greedy output against TP=1's
(64 tokens of 8 prompts), and, where bf16 rounding (a different all-reduce order) makes them part,
teacher-forced top-1 agreement: every engine is driven along TP=1's greedy tokens with its sampler
replaced, so each position is compared on the same context. Runs TP=N with CUDA graphs and eagerly, and
TP=1 eager as the noise floor (same weights, other kernels' rounding). Needs N GPUs."""
import argparse
import gc
from random import randint, seed

import torch
from transformers import AutoConfig

from engine import LLM, SamplingParams
from logits_check import MARGIN
from random_model import make_random_model


class TeacherForcing:
    """Stands in for the runner's sampler: feeds each request the reference's next token and records, per
    (request, position), the engine's top-1 token, its top-2 margin and the log-prob of the forced token."""

    def __init__(self, tokens: list[list[int]]):
        self.tokens, self.records = tokens, {}

    def __call__(self, logits, seqs):
        forced = torch.tensor([self.tokens[seq.request_id][seq.num_output_tokens] for seq in seqs],
                              device=logits.device)
        top2 = logits.topk(2, dim=-1).values
        logp = torch.log_softmax(logits, -1).gather(-1, forced[:, None])[:, 0]
        for seq, top1, margin, lp in zip(seqs, logits.argmax(-1).tolist(), (top2[:, 0] - top2[:, 1]).tolist(),
                                         logp.tolist()):
            self.records[seq.request_id, seq.num_output_tokens] = (top1, margin, lp)
        return forced


def run_engine(path, prompts, new_tokens, reference, **config) -> tuple[list[list[int]], dict, int]:
    """Greedy outputs, the teacher-forced records along `reference` (or the greedy outputs themselves when
    None), and the number of KV blocks."""
    llm = LLM(path, gpu_memory_utilization=0.5, **config)
    llm.core.overlap = False  # the forcing sampler reads each request's tokens when it samples
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=new_tokens)
    try:
        greedy = [out["token_ids"] for out in llm.generate(prompts, params)]
        runner = llm.core.runner
        forcing = TeacherForcing(reference or greedy)
        sampler, runner.sampler = runner.sampler, forcing
        try:
            llm.generate(prompts, params)
        finally:
            runner.sampler = sampler
        return greedy, forcing.records, runner.num_blocks
    finally:
        llm.shutdown()
        del llm
        gc.collect()
        torch.cuda.empty_cache()


def compare(name, greedy, records, ref_greedy, ref_records, num_blocks) -> tuple:
    same_seqs = sum(a == b for a, b in zip(greedy, ref_greedy))
    first_split = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(b)) for a, b in zip(greedy, ref_greedy)]
    keys = sorted(ref_records)
    agree = torch.tensor([records[k][0] == ref_greedy[k[0]][k[1]] for k in keys])
    decided = torch.tensor([ref_records[k][1] > MARGIN for k in keys])
    dlogp = torch.tensor([abs(records[k][2] - ref_records[k][2]) for k in keys])
    return (name, num_blocks, f"{same_seqs}/{len(greedy)}", min(first_split), agree.float().mean().item(),
            agree[decided].float().mean().item(), dlogp.median().item(), dlogp.max().item())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-0.6b", help="a config name under bench/models or a model directory")
    ap.add_argument("--tensor-parallel-size", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--max-prompt-len", type=int, default=600)
    args = ap.parse_args()
    seed(0)
    path = make_random_model(args.model) if "/" not in args.model else args.model
    top_id = min(10000, AutoConfig.from_pretrained(path).vocab_size - 1)
    prompts = [[randint(0, top_id) for _ in range(randint(16, args.max_prompt_len))] for _ in range(args.prompts)]
    ref_greedy, ref_records, ref_blocks = run_engine(path, prompts, args.new_tokens, None)
    n = args.tensor_parallel_size
    rows = [compare("TP=1 cuda graphs (reference)", ref_greedy, ref_records, ref_greedy, ref_records, ref_blocks)]
    for name, config in (("TP=1 eager (noise floor)", dict(enforce_eager=True)),
                         (f"TP={n} cuda graphs", dict(tensor_parallel_size=n)),
                         (f"TP={n} eager", dict(tensor_parallel_size=n, enforce_eager=True))):
        greedy, records, blocks = run_engine(path, prompts, args.new_tokens, ref_greedy, **config)
        rows.append(compare(name, greedy, records, ref_greedy, ref_records, blocks))
    decided = sum(record[1] > MARGIN for record in ref_records.values())
    print(f"{len(ref_records)} positions ({args.prompts} prompts x {args.new_tokens} tokens); {decided} have a "
          f"top-2 margin over {MARGIN} in the reference")
    print(f"{'engine':30} {'KV blocks':>9} {'greedy =':>8} {'1st split':>9} {'top-1 all':>9} {'decided':>8} "
          f"{'|dlogp| med':>11} {'|dlogp| max':>11}")
    for name, blocks, same, split, agree, agree_decided, med, mx in rows:
        print(f"{name:30} {blocks:9d} {same:>8} {split:9d} {agree:9.4f} {agree_decided:8.4f} {med:11.4f} {mx:11.4f}")
    tp_rows = rows[2:]
    ok = all(row[2] == f"{args.prompts}/{args.prompts}" or row[5] == 1.0 for row in tp_rows)
    print("PASS" if ok else "FAIL", f"(TP={n}: every greedy output equals TP=1's, or teacher-forced top-1 agrees "
                                    "wherever the reference's top-2 margin exceeds the bf16 noise)")
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
