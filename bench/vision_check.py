"""GPU check of Gemma 3 with images: a random Gemma-3-4B-shaped multimodal model (bench/models/gemma3-4b, its
SigLIP tower included; --layers / --vision-layers for fewer) against transformers on the same weights,
teacher-forced after a prompt holding one image, through the engine's step path (chunked prefill, CUDA graphs for
decode), and what an image costs: time to first token of a one-image prompt against a text prompt of the same
length, and decode throughput of a batch of such requests against text-only ones at the same context.
    python3 bench/vision_check.py                                   # the whole 4B shape, on the GPU
    python3 bench/vision_check.py --model DIR --device cpu          # a multimodal checkpoint directory
Random pixels stand in for a preprocessed image (the processor's output is normalised to [-1, 1])."""
import argparse
import statistics
import time
from random import randint, seed

import torch
from transformers import AutoConfig, Gemma3ForConditionalGeneration

from engine import LLM, SamplingParams
from engine.images import PromptImage
from logits_check import MARGIN, compare, engine_logits
from random_model import HERE, make_random_model


def random_model(args) -> str:
    """A model directory: the given one, or random weights of bench/models/gemma3-4b with the layer counts asked."""
    if args.model != "gemma3-4b":
        return args.model
    config = AutoConfig.from_pretrained(f"{HERE}/models/gemma3-4b").to_dict()
    text, vision = config["text_config"], config["vision_config"]
    text["num_hidden_layers"] = args.layers or text["num_hidden_layers"]
    text.pop("layer_types", None)  # derived again from the layer count
    vision["num_hidden_layers"] = args.vision_layers or vision["num_hidden_layers"]
    overrides = {"text_config": text, "vision_config": vision}
    return make_random_model("gemma3-4b", f"/tmp/random-gemma3-4b-{text['num_hidden_layers']}-"
                             f"{vision['num_hidden_layers']}", args.device, overrides)


def image_prompt(config, length: int) -> list[int]:
    """Random text of `length` tokens with one image (<start_of_image>, its soft tokens, <end_of_image>) after the
    first tenth of it."""
    text = [randint(2, config.boi_token_id - 1) for _ in range(length)]
    cut = length // 10
    image = [config.boi_token_id] + [config.image_token_id] * config.mm_tokens_per_image + [config.eoi_token_id]
    return text[:cut] + image + text[cut:]


def pixels_of(config, device: str) -> torch.Tensor:
    size = config.vision_config.image_size
    return (torch.rand(1, 3, size, size, device=device) * 2 - 1)


@torch.inference_mode()
def reference_logits(path: str, tokens: list[int], pixels: torch.Tensor, prompt_len: int, device: str):
    """transformers' logits at the evaluated positions, bf16 and fp32."""
    model = Gemma3ForConditionalGeneration.from_pretrained(path, dtype=torch.bfloat16).to(device).eval()
    ids = torch.tensor([tokens], device=device)
    inputs = {"input_ids": ids, "token_type_ids": (ids == model.config.image_token_id).long()}
    bf16 = model(**inputs, pixel_values=pixels.bfloat16()).logits[0, prompt_len - 1:-1].float()
    fp32 = model.float()(**inputs, pixel_values=pixels.float()).logits[0, prompt_len - 1:-1].float()
    return bf16, fp32


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_to_first_token(llm: LLM, prompt: list[int], pixels: torch.Tensor | None, device: str, repeats: int) -> float:
    """Median seconds to compute the prompt and sample one token, the prefix cache emptied before each run (the
    image encoded each time)."""
    times = []
    for _ in range(repeats + 1):  # the first run warms up
        llm.core.block_manager.reset_prefix_cache()
        images = [[PromptImage.of_pixels(pixels[0].cpu())]] if pixels is not None else None
        synchronize(device)
        started = time.perf_counter()
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), images=images)
        synchronize(device)
        times.append(time.perf_counter() - started)
    return statistics.median(times[1:])


def decode_throughput(llm: LLM, prompts: list[list[int]], pixels: torch.Tensor | None, new: int,
                      device: str) -> float:
    """Output tokens per second of the steps after every prompt has its first token (decode only)."""
    core = llm.core
    core.block_manager.reset_prefix_cache()
    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    seqs = [core.make_sequence(i, prompt, params, images=[PromptImage.of_pixels(pixels[0].cpu())]
                               if pixels is not None else ()) for i, prompt in enumerate(prompts)]
    for seq in seqs:
        core.add(seq)
    while any(seq.num_output_tokens == 0 for seq in seqs):
        core.step()
    synchronize(device)
    first, started = sum(seq.num_output_tokens for seq in seqs), time.perf_counter()
    while core.has_work():
        core.step()
    synchronize(device)
    return (sum(seq.num_output_tokens for seq in seqs) - first) / (time.perf_counter() - started)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gemma3-4b", help="gemma3-4b (random weights of bench/models) or a multimodal "
                                                         "checkpoint directory")
    ap.add_argument("--layers", type=int, help="the random model's decoder layers (default: its config's)")
    ap.add_argument("--vision-layers", type=int, help="the random model's vision layers (default: its config's)")
    ap.add_argument("--text-len", type=int, default=300, help="text tokens of the prompt, beside its image")
    ap.add_argument("--positions", type=int, default=256, help="teacher-forced positions after the prompt")
    ap.add_argument("--chunk-tokens", type=int, default=512, help="max_num_batched_tokens: the prompt's chunks")
    ap.add_argument("--batch", type=int, default=32, help="requests decoding at once in the throughput runs")
    ap.add_argument("--new", type=int, default=128, help="tokens each of them generates")
    ap.add_argument("--repeats", type=int, default=5, help="time-to-first-token runs (median)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    seed(0)
    torch.manual_seed(0)
    path = random_model(args)
    config = AutoConfig.from_pretrained(path)
    prompt = image_prompt(config, args.text_len)
    tokens = prompt + [randint(2, config.boi_token_id - 1) for _ in range(args.positions)]
    pixels = pixels_of(config, args.device)
    ref, ref32 = reference_logits(path, tokens, pixels, len(prompt), args.device)
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    llm = LLM(path, max_num_batched_tokens=args.chunk_tokens, gpu_memory_utilization=0.5, device=args.device,
              max_model_len=len(tokens) + args.new + 1)
    overlap = llm.core.overlap  # engine_logits turns it off
    ours, _ = engine_logits(llm, tokens, len(prompt), images=[PromptImage.of_pixels(pixels[0].cpu())])
    llm.core.overlap = overlap
    rows = [("transformers bf16 vs fp32 (noise floor)", *compare(ref, ref32, ref32)),
            (f"engine (chunks of {args.chunk_tokens}) vs bf16", *compare(ours, ref, ref32)),
            (f"engine (chunks of {args.chunk_tokens}) vs fp32", *compare(ours, ref32, ref32))]
    top2 = ref32.topk(2, dim=-1).values
    print(f"{((top2[:, 0] - top2[:, 1]) > MARGIN).sum().item()} of {len(ref32)} positions have a top-2 margin over "
          f"{MARGIN} in the fp32 reference; prompt {len(prompt)} tokens, one image of {config.mm_tokens_per_image}")
    print(f"{'comparison':48} {'top-1 all':>9} {'decided':>8} {'|dlogp| med':>11} {'|dlogp| max':>11} "
          f"{'widest flip':>11}")
    for name, agree, agree_decided, med, mx, flip in rows:
        print(f"{name:48} {agree:9.4f} {agree_decided:8.4f} {med:11.4f} {mx:11.4f} {flip:11.4f}")
    text_prompt = [randint(2, config.boi_token_id - 1) for _ in range(len(prompt))]
    ttft_image = time_to_first_token(llm, prompt, pixels, args.device, args.repeats)
    ttft_text = time_to_first_token(llm, text_prompt, None, args.device, args.repeats)
    rate_image = decode_throughput(llm, [image_prompt(config, args.text_len) for _ in range(args.batch)], pixels,
                                   args.new, args.device)
    rate_text = decode_throughput(llm, [[randint(2, config.boi_token_id - 1) for _ in range(len(prompt))]
                                        for _ in range(args.batch)], None, args.new, args.device)
    print(f"time to first token, {len(prompt)}-token prompt: one image {ttft_image * 1000:.1f} ms, text only "
          f"{ttft_text * 1000:.1f} ms")
    print(f"decode, {args.batch} requests of {len(prompt)} + {args.new} tokens: with an image each "
          f"{rate_image:.0f} tok/s, text only {rate_text:.0f} tok/s")


if __name__ == "__main__":
    main()
