"""What the drafters guess on bench/speculative.py's copy workload, apart from any device's step costs: the
packaged SmolLM2-135M-Instruct decodes the workload's prompts greedily, speculation off (float32 on the CPU);
then each drafter replays every request as if each of its steps drafted: the drafter proposes k tokens (k by
the request's acceptance, as the engine chooses it: engine/speculation.py's draft_length), the longest prefix
equal to the recorded continuation is accepted, plus the model's own next token. Under greedy decoding a
verification accepts exactly that prefix, so these are the acceptance and draft tokens per output token a
batch-1 run that drafts every step has. Tokens per step (a drafting step's tokens, the first from the prompt's
step included) bound what drafting can gain at batch 1: a drafting step costs more than a plain one.
"""
import argparse
import types

from speculative import copy_workload, packaged_smollm2, read_headers_with_gguf_package

from engine import LLM
from engine.drafters import DRAFTERS
from engine.sequence import INITIAL_ACCEPTANCE
from engine.speculation import count_verification, draft_length


def replay(drafter, prompt: list[int], output: list[int], most: int) -> tuple[int, int, int, int]:
    """Steps, draft tokens, accepted draft tokens and steps that found no draft, for one request whose output
    the first (prompt) step starts."""
    seq = types.SimpleNamespace(token_ids=[*prompt, output[0]], draft_state=None, num_prompt_tokens=len(prompt),
                                acceptance=INITIAL_ACCEPTANCE, draft_gain=0.0)
    steps, drafted, accepted, empty, done = 1, 0, 0, 0, 1
    while done < len(output):
        draft = drafter.propose(seq, min(draft_length(seq, most), len(output) - done))
        taken = next((i for i, (a, b) in enumerate(zip(draft, output[done:])) if a != b), len(draft))
        if draft:
            count_verification(seq, len(draft), taken)
        empty += not draft
        drafted, accepted, steps = drafted + len(draft), accepted + taken, steps + 1
        seq.token_ids += output[done:done + taken + 1]
        done += taken + 1
    return steps, drafted, accepted, empty


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=8, help="the copy workload's first requests")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--methods", type=lambda s: s.split(","), default=["ngram", "suffix"])
    ap.add_argument("--k", type=int, default=8, help="most draft tokens per request and step")
    args = ap.parse_args()
    read_headers_with_gguf_package()
    llm = LLM(packaged_smollm2(), dtype="float32", max_num_seqs=args.requests)
    prompts, params = copy_workload(llm, args.requests, args.max_tokens)
    outputs = [out["token_ids"] for out in llm.generate(prompts, params)]
    tokens = sum(map(len, outputs))
    print(f"{'method':8} {'tokens':>7} {'steps':>6} {'tok/step':>8} {'draft/tok':>9} {'accept%':>7} {'empty':>6}")
    for method in args.methods:
        drafter = DRAFTERS[method]()
        steps, drafted, accepted, empty = (sum(column) for column in zip(
            *(replay(drafter, prompt, output, args.k) for prompt, output in zip(prompts, outputs))))
        print(f"{method:8} {tokens:7d} {steps:6d} {tokens / steps:8.2f} {drafted / tokens:9.2f} "
              f"{100 * accepted / max(drafted, 1):7.1f} {empty:6d}")


if __name__ == "__main__":
    main()
