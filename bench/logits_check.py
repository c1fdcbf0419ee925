"""GPU check: the engine's logits for a random Qwen3-0.6B-shaped model (or another of bench/models, with fewer
layers or another sliding window) against transformers' on the same weights, teacher-forced over 256 positions,
through the real step path: chunked prefill, decode with and without CUDA graphs, and a second pass that hits
the prefix cache. Prints top-1 agreement and log-prob error.

A sliding-window model with a prompt longer than its window checks the window's mask in every kernel, and that
the blocks freed behind the window are never read:
    python3 bench/logits_check.py --model mistral-7b --layers 4 --sliding-window 512 --prompt-len 1500
Gemma-3-1B's local layers have a window of 512: --model gemma3-1b --prompt-len 1000. --fp8: the engine serves
the model's block-wise FP8 copy (bench/random_model.py); transformers computes what that copy specifies, W8A8:
the dequantized weights, each projection's input rounded through e4m3 per token and 128 columns (as
kernels/reference.py's quantize_fp8; `--fp8-gemm triton` computes exactly that, scaled_mm requantizes per row),
since on random weights the rounding alone moves most near-ties.
--kv-cache-dtype fp8 runs the engine with an FP8 KV cache (transformers keeps its bf16 / fp32 one)."""
import argparse
from random import randint, seed

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine import LLM, SamplingParams
from kernels.reference import dequantize_fp8, quantize_fp8
from random_model import FP8_BLOCK, add_fp8_arguments, add_gpu_features_argument, make_fp8_copy, make_random_model
from real_model import readme_tokens, smollm2_safetensors

MARGIN = 0.05  # logits; above the largest bf16-vs-fp32 log-prob error transformers itself shows here


class TeacherForcing:
    """Stands in for the engine's sampler (whose batch plan and upload ring the runner still reads): records each
    step's logits and returns the reference token, without logprobs."""

    def __init__(self, tokens: list[int], sampler):
        self.tokens, self.logits, self.plan_for, self.uploads = tokens, [], sampler.plan_for, sampler.uploads

    def sample(self, logits, seqs, ahead=0, masks=None):
        seq = seqs[0]
        self.logits.append(logits[0].float())
        return torch.tensor([self.tokens[len(seq)]], device=logits.device), None


def engine_logits(llm, tokens: list[int], prompt_len: int, images=()) -> torch.Tensor:
    """images: the prompt's (engine/images.py's PromptImage), for a model that reads images."""
    core = llm.core
    core.overlap = False  # the forcing sampler reads each request's tokens when it samples
    forcing = TeacherForcing(tokens, core.runner.sampler)
    sampler, core.runner.sampler = core.runner.sampler, forcing
    try:
        seq = core.make_sequence("check", tokens[:prompt_len], SamplingParams(
            temperature=0, ignore_eos=True, max_tokens=len(tokens) - prompt_len), images=images)
        core.add(seq)
        while core.has_work():
            core.step()
    finally:
        core.runner.sampler = sampler
    return torch.stack(forcing.logits), seq.num_cached_tokens


def as_w8a8(model) -> None:
    """Makes a transformers model compute as the FP8 copy of its weights specifies: every decoder-layer
    projection's weight rounded block-wise to e4m3 (as make_fp8_copy does) and its input rounded per token and
    128 columns."""
    def quantized_input(module, args):
        x = args[0]
        values, scales = quantize_fp8(x.reshape(-1, x.shape[-1]), (1, FP8_BLOCK[1]))
        return dequantize_fp8(values, scales, (1, FP8_BLOCK[1]), x.dtype).view(x.shape),

    for name, module in model.named_modules():
        if ".layers." in name and name.endswith("proj") and isinstance(module, torch.nn.Linear):
            values, scales = quantize_fp8(module.weight.data, FP8_BLOCK)
            module.weight.data = dequantize_fp8(values, scales, FP8_BLOCK, module.weight.dtype)
            module.register_forward_pre_hook(quantized_input)


def compare(ours: torch.Tensor, ref: torch.Tensor, margin_ref: torch.Tensor,
            margin: float = MARGIN) -> tuple[float, float, float, float, float]:
    """Top-1 agreement over all positions and over the positions bf16 can decide (margin_ref's top two
    logits more than `margin` apart; random weights give near-ties that bf16 rounding flips either way),
    the median and max error of the log-prob of ref's top token, and the widest margin_ref top-2 gap among the
    positions whose top-1 differs (0 when none does: agreement is 1.000 above that margin)."""
    same = ours.argmax(-1) == ref.argmax(-1)
    top2 = margin_ref.topk(2, dim=-1).values
    gaps = top2[:, 0] - top2[:, 1]
    decided = gaps > margin
    ref_top = ref.argmax(-1, keepdim=True)
    err = (torch.log_softmax(ours, -1).gather(-1, ref_top) - torch.log_softmax(ref, -1).gather(-1, ref_top)).abs()
    widest_flip = gaps[~same].max().item() if not same.all() else 0.0
    return (same.float().mean().item(), same[decided].float().mean().item(), err.median().item(), err.max().item(),
            widest_flip)


def reference_logits(path: str, tokens: list[int], prompt_len: int, device: str, w8a8: bool,
                     dtype: torch.dtype = torch.bfloat16):
    """transformers' logits at the evaluated positions, in dtype (16-bit) and fp32, on the weights at path (with
    w8a8, as the FP8 copy specifies them: as_w8a8)."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    if w8a8:
        as_w8a8(model)
    ids = torch.tensor([tokens], device=device)
    half = model(ids).logits[0, prompt_len - 1:-1].float()
    fp32 = model.float()(ids).logits[0, prompt_len - 1:-1].float()
    return half, fp32


def random_or_real_model(args) -> tuple[str, list[int]]:
    """(model directory, evaluated tokens): SmolLM2's real weights on README.md's text, or random weights (of
    bench/models or a directory) on random token ids."""
    count = args.prompt_len + args.positions
    if args.model == "smollm2":
        path = smollm2_safetensors()
        return path, readme_tokens(AutoTokenizer.from_pretrained(path), count)
    overrides = {key: value for key, value in [("num_hidden_layers", args.layers),
                                               ("sliding_window", args.sliding_window)] if value is not None}
    path = make_random_model(args.model, overrides=overrides) if "/" not in args.model else args.model
    return path, [randint(0, 10000) for _ in range(count)]


@torch.inference_mode()
def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-0.6b", help="a config name under bench/models, a model directory, or "
                                                          "smollm2 (real weights: bench/real_model.py)")
    ap.add_argument("--prompt-len", type=int, default=300)
    ap.add_argument("--positions", type=int, default=256)
    ap.add_argument("--layers", type=int, help="num_hidden_layers of the random model (default: its config's)")
    ap.add_argument("--sliding-window", type=int, help="sliding_window of the random model (default: its config's)")
    ap.add_argument("--margin", type=float, default=MARGIN,
                    help="top-2 gap (fp32 logits) of a decided position (an FP8 KV cache's rounding moves log-probs "
                         "more than bf16's)")
    ap.add_argument("--chunk-tokens", type=int, default=128,
                    help="the engine's max_num_batched_tokens: prefill chunks of this size (past 2,048 on the GPU, the "
                         "chunks replay the large prefill graphs)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="cpu: the engine computes in float32, with FP8 weights dequantized (models/fp8.py)")
    add_fp8_arguments(ap, "the engine serves the model's FP8 copy")
    add_gpu_features_argument(ap)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"],
                    help="the engine's and transformers' 16-bit dtype on the GPU (float16: what a T4 runs)")
    args = ap.parse_args()
    seed(0)
    path, tokens = random_or_real_model(args)
    served, label = (make_fp8_copy(path), "engine FP8") if args.fp8 else (path, "engine")
    dtype = getattr(torch, args.dtype)
    half = "bf16" if dtype == torch.bfloat16 else "fp16"
    ref, ref32 = reference_logits(path, tokens, args.prompt_len, args.device, args.fp8, dtype)
    margin = args.margin
    reference = "transformers W8A8" if args.fp8 else "transformers"
    rows = [(f"{reference} {half} vs fp32 (noise floor)", *compare(ref, ref32, ref32, margin))]
    if args.fp8:  # against the weights before quantization: what FP8 costs
        plain, plain32 = reference_logits(path, tokens, args.prompt_len, args.device, False, dtype)
        rows.append(("transformers W8A8 fp32 vs unquantized fp32", *compare(ref32, plain32, plain32, margin)))
        rows.append((f"transformers unquantized {half} vs fp32", *compare(plain, plain32, plain32, margin)))
    for eager in (False, True) if args.device.startswith("cuda") else (True,):
        llm = LLM(served, enforce_eager=eager, max_num_batched_tokens=args.chunk_tokens, gpu_memory_utilization=0.3,
                  max_model_len=len(tokens) + 1, fp8_gemm=args.fp8_gemm, kv_cache_dtype=args.kv_cache_dtype,
                  device=args.device, gpu_features=args.gpu_features,
                  **({"dtype": args.dtype} if args.device.startswith("cuda") else {}))
        llm.core.finish_warm_up()  # the prefill steps replay graphs too
        window = llm.core.block_manager.window
        name = (("eager" if eager else "cuda graphs") + (f", window {window}" if window else "")
                + (", fp8 KV" if args.kv_cache_dtype == "fp8" else "") + f", {half}, GPU features {args.gpu_features}")
        ours, _ = engine_logits(llm, tokens, args.prompt_len)
        rows.append((f"{label} ({name}, chunks of {args.chunk_tokens}) vs {half}",
                     *compare(ours, ref, ref32, margin)))
        rows.append((f"{label} ({name}) vs fp32", *compare(ours, ref32, ref32, margin)))
        if args.fp8:
            rows.append((f"{label} ({name}) vs unquantized fp32", *compare(ours, plain32, plain32, margin)))
        ours, cached = engine_logits(llm, tokens, args.prompt_len)
        rows.append((f"{label} ({name}, prefix hit {cached} tok) vs fp32", *compare(ours, ref32, ref32, margin)))
        del llm
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    for name, reference_fp32 in [("fp32 reference", ref32)] + ([("unquantized fp32", plain32)] if args.fp8 else []):
        top2 = reference_fp32.topk(2, dim=-1).values
        decided = ((top2[:, 0] - top2[:, 1]) > margin).sum().item()
        print(f"{decided} of {len(reference_fp32)} positions have a top-2 margin over {margin} in the {name}")
    print(f"{'comparison':100} {'top-1 all':>9} {'decided':>8} {'|dlogp| med':>11} {'|dlogp| max':>11} "
          f"{'widest flip':>11}")
    for name, agree, agree_decided, med, mx, flip in rows:
        print(f"{name:100} {agree:9.4f} {agree_decided:8.4f} {med:11.4f} {mx:11.4f} {flip:11.4f}")


if __name__ == "__main__":
    main()
