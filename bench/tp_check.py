"""GPU check of tensor parallelism: on a random Qwen3-0.6B-shaped model, TP=N greedy output against TP=1's
(64 tokens of 8 prompts), and, where bf16 rounding (a different all-reduce order) makes them part,
teacher-forced top-1 agreement: every engine is driven along TP=1's greedy tokens with its sampler
replaced, so each position is compared on the same context. Runs TP=N with CUDA graphs and eagerly, and
TP=1 eager as the noise floor (same weights, other kernels' rounding). Needs N GPUs; --device cpu (ranks
joined by gloo, no graphs) with a small --model directory smoke-tests the script itself.

Each engine runs in a fresh process of its own (this script again, with --run), so no engine, process group
or CUDA state is built in a process that held another; the reference runs first and its greedy tokens go
to the others through a file."""
import argparse
import faulthandler
import json
import os
import pickle
import subprocess
import sys
import tempfile
import time
from random import randint, seed

import torch
from transformers import AutoConfig

from engine import LLM, SamplingParams
from engine.tensor_parallel import NO_MULTICAST
from logits_check import MARGIN
from random_model import make_random_model

LOG_TAIL_LINES = 40


class TeacherForcing:
    """Stands in for the runner's sampler: feeds each request the reference's next token and records, per
    (request, position), the engine's top-1 token, its top-2 margin and the log-prob of the forced token.
    The runner also asks its sampler for the batch's sampling plan and upload ring: the real sampler's."""

    def __init__(self, tokens: list[list[int]], sampler):
        self.tokens, self.records, self.plan_for, self.uploads = tokens, {}, sampler.plan_for, sampler.uploads

    def sample(self, logits, seqs, ahead=0, masks=None):
        forced = torch.tensor([self.tokens[seq.request_id][seq.num_output_tokens] for seq in seqs],
                              device=logits.device)
        top2 = logits.topk(2, dim=-1).values
        logp = torch.log_softmax(logits, -1).gather(-1, forced[:, None])[:, 0]
        for seq, top1, margin, lp in zip(seqs, logits.argmax(-1).tolist(), (top2[:, 0] - top2[:, 1]).tolist(),
                                         logp.tolist()):
            self.records[seq.request_id, seq.num_output_tokens] = (top1, margin, lp)
        return forced, None


def run_engine(path, prompts, new_tokens, reference, **config) -> tuple[list[list[int]], dict, int]:
    """Greedy outputs, the teacher-forced records along `reference` (or the greedy outputs themselves when
    None), and the number of KV blocks."""
    llm = LLM(path, **config)
    llm.core.finish_warm_up()  # graphs from the first step
    llm.core.overlap = False  # the forcing sampler reads each request's tokens when it samples
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=new_tokens)
    try:
        greedy = [out["token_ids"] for out in llm.generate(prompts, params)]
        runner = llm.core.runner
        forcing = TeacherForcing(reference or greedy, runner.sampler)
        sampler, runner.sampler = runner.sampler, forcing
        try:
            llm.generate(prompts, params)
        finally:
            runner.sampler = sampler
        return greedy, forcing.records, runner.num_blocks
    finally:
        llm.shutdown()


def run_child(args) -> None:
    """The --run side: one engine's run_engine() results, pickled to --out. At --dump-at (shortly before the
    parent would kill it) it writes its threads' stacks to --out.stacks, so a hang shows where it is stuck."""
    with open(args.out + ".stacks", "w") as stacks:
        faulthandler.dump_traceback_later(max(args.dump_at - time.time(), 0.01), file=stacks)
        try:
            with open(args.job, "rb") as f:
                job = pickle.load(f)
            result = run_engine(**job, **json.loads(args.run))
        finally:
            faulthandler.cancel_dump_traceback_later()
    with open(args.out, "wb") as f:
        pickle.dump(result, f)


def spawn(name, config, job, out, timeout) -> tuple:
    """run_engine() with `config` in a fresh process; exits, showing what the process left, if it fails."""
    started = time.time()
    command = [sys.executable, os.path.abspath(__file__), "--run", json.dumps(config), "--job", job,
               "--out", out, "--dump-at", str(started + 0.9 * timeout)]
    env = {**os.environ, **NO_MULTICAST, "PYTHONUNBUFFERED": "1"}
    print(f"{name}: starting its engine process", flush=True)
    with open(out + ".log", "w") as log:  # a file, not a pipe: ranks outliving a killed child can't hold it open
        try:
            code = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            code = None
    elapsed = time.time() - started
    if code != 0:
        print(leftovers(out), end="", file=sys.stderr, flush=True)
        why = f"timed out after {timeout:g} s" if code is None else f"exited with code {code} after {elapsed:.1f} s"
        raise SystemExit(f"{name}: the engine process {why}; what it left is above")
    print(f"{name}: done in {elapsed:.1f} s", flush=True)
    with open(out, "rb") as f:
        return pickle.load(f)


def leftovers(out) -> str:
    """A failed engine process's output tail (its ranks write there too), and its stacks if it timed out."""
    with open(out + ".log") as f:
        text = f"--- the last lines of its output ---\n{''.join(f.readlines()[-LOG_TAIL_LINES:])}"
    if os.path.exists(out + ".stacks") and os.path.getsize(out + ".stacks"):
        with open(out + ".stacks") as f:
            text += f"--- its threads' stacks, shortly before the timeout ---\n{f.read()}"
    return text


def dump(obj, path) -> str:
    with open(path, "wb") as f:
        pickle.dump(obj, f)
    return path


def compare(name, greedy, records, ref_greedy, ref_records, num_blocks) -> tuple:
    same_seqs = sum(a == b for a, b in zip(greedy, ref_greedy))
    first_split = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(b))
                   for a, b in zip(greedy, ref_greedy)]
    keys = sorted(ref_records)
    agree = torch.tensor([records[k][0] == ref_greedy[k[0]][k[1]] for k in keys])
    decided = torch.tensor([ref_records[k][1] > MARGIN for k in keys])
    dlogp = torch.tensor([abs(records[k][2] - ref_records[k][2]) for k in keys])
    return (name, num_blocks, f"{same_seqs}/{len(greedy)}", min(first_split), agree.float().mean().item(),
            agree[decided].float().mean().item(), dlogp.median().item(), dlogp.max().item())


def run_all(args, path, prompts) -> tuple[list[tuple], dict]:
    """The reference's and the other engines' compare() rows, each engine in its own process, and the
    reference's records."""
    base = dict(device=args.device, dtype=args.dtype)
    if torch.device(args.device).type == "cuda":
        base["gpu_memory_utilization"] = 0.5
    n = args.tensor_parallel_size
    job = dict(path=path, prompts=prompts, new_tokens=args.new_tokens, reference=None)
    with tempfile.TemporaryDirectory(prefix="tp_check-") as tmp:
        name = "TP=1 cuda graphs (reference)"
        ref_greedy, ref_records, ref_blocks = spawn(name, base, dump(job, f"{tmp}/reference-job.pkl"),
                                                    f"{tmp}/0.pkl", args.child_timeout)
        rows = [compare(name, ref_greedy, ref_records, ref_greedy, ref_records, ref_blocks)]
        forced_job = dump({**job, "reference": ref_greedy}, f"{tmp}/job.pkl")
        for i, (name, config) in enumerate((("TP=1 eager (noise floor)", dict(enforce_eager=True)),
                                            (f"TP={n} cuda graphs", dict(tensor_parallel_size=n)),
                                            (f"TP={n} eager", dict(tensor_parallel_size=n, enforce_eager=True))), 1):
            greedy, records, blocks = spawn(name, {**base, **config}, forced_job, f"{tmp}/{i}.pkl",
                                            args.child_timeout)
            rows.append(compare(name, greedy, records, ref_greedy, ref_records, blocks))
    return rows, ref_records


def report(args, rows, ref_records) -> bool:
    """Prints the table and the verdict: whether every TP=N row passes."""
    decided = sum(record[1] > MARGIN for record in ref_records.values())
    print(f"{len(ref_records)} positions ({args.prompts} prompts x {args.new_tokens} tokens); {decided} have a "
          f"top-2 margin over {MARGIN} in the reference")
    print(f"{'engine':30} {'KV blocks':>9} {'greedy =':>8} {'1st split':>9} {'top-1 all':>9} {'decided':>8} "
          f"{'|dlogp| med':>11} {'|dlogp| max':>11}")
    for name, blocks, same, split, agree, agree_decided, med, mx in rows:
        print(f"{name:30} {blocks:9d} {same:>8} {split:9d} {agree:9.4f} {agree_decided:8.4f} {med:11.4f} {mx:11.4f}")
    ok = all(row[2] == f"{args.prompts}/{args.prompts}" or row[5] == 1.0 for row in rows[2:])
    print("PASS" if ok else "FAIL", f"(TP={args.tensor_parallel_size}: every greedy output equals TP=1's, or "
                                    "teacher-forced top-1 agrees wherever the reference's top-2 margin exceeds the "
                                    "bf16 noise)")
    return ok


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-0.6b", help="a config name under bench/models or a model directory")
    ap.add_argument("--tensor-parallel-size", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--max-prompt-len", type=int, default=600)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="auto", help="the engines' dtype: auto (bfloat16 on CUDA) or float32, "
                                                     "where TP=N and TP=1 part only by float32 rounding")
    ap.add_argument("--child-timeout", type=float, default=240, help="seconds each engine process may take")
    ap.add_argument("--run", help=argparse.SUPPRESS)  # internal: an engine process's config, as JSON
    ap.add_argument("--job", help=argparse.SUPPRESS)  # a pickled dict of run_engine()'s other arguments
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--dump-at", type=float, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.run:
        return run_child(args)
    seed(0)
    path = make_random_model(args.model, device=args.device) if "/" not in args.model else args.model
    top_id = min(10000, AutoConfig.from_pretrained(path).vocab_size - 1)
    prompts = [[randint(0, top_id) for _ in range(randint(16, args.max_prompt_len))] for _ in range(args.prompts)]
    rows, ref_records = run_all(args, path, prompts)
    raise SystemExit(0 if report(args, rows, ref_records) else 1)


if __name__ == "__main__":
    main()
