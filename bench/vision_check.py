"""GPU check of a VLM with images: a random Gemma-3-4B-shaped multimodal model (bench/models/gemma3-4b, its
SigLIP tower included) or Qwen2.5-VL-7B-shaped one (--model qwen2_5-vl-7b, its vision transformer included;
--layers / --vision-layers for fewer) against transformers on the same weights, teacher-forced after a prompt
holding one image, through the engine's step path (chunked prefill, CUDA graphs for decode), and what an image
costs: time to first token of a one-image prompt against a text prompt of the same length, and decode throughput
of a batch of such requests against text-only ones at the same context.
    python3 bench/vision_check.py                                   # the whole Gemma 3 4B shape, on the GPU
    python3 bench/vision_check.py --model qwen2_5-vl-7b             # Qwen2.5-VL 7B, an image of --image-size
    python3 bench/vision_check.py --model DIR --device cpu          # a multimodal checkpoint directory
Random pixels stand in for a preprocessed image (the processor's output is normalised to about [-1, 1]); a
Qwen2.5-VL image is --image-size pixels square, its grid of patches as the processor would make it."""
import argparse
import functools
import math
import statistics
import time
from random import randint, seed

import torch
from transformers import AutoConfig, Gemma3ForConditionalGeneration, Qwen2_5_VLForConditionalGeneration

from engine import LLM, SamplingParams
from engine.images import PromptImage
from logits_check import MARGIN, compare, engine_logits
from random_model import HERE, make_random_model

RANDOM_MODELS = ("gemma3-4b", "qwen2_5-vl-7b")  # bench/models whose random weights this check draws
DECODE_ROUNDS = 3  # decode runs of each kind, taking turns, so that warm-up or clock drift falls on both


def random_model(args) -> str:
    """A model directory: the given one, or random weights of bench/models/<name> with the layer counts asked."""
    if args.model not in RANDOM_MODELS:
        return args.model
    config = AutoConfig.from_pretrained(f"{HERE}/models/{args.model}")
    if config.model_type == "qwen2_5_vl":  # its config is flat: the decoder's fields at the top
        vision = config.vision_config.to_dict()
        layers = args.layers or config.get_text_config().num_hidden_layers
        vision["depth"] = args.vision_layers or vision["depth"]
        vision["fullatt_block_indexes"] = [i for i in vision["fullatt_block_indexes"] if i < vision["depth"]]
        overrides = {"num_hidden_layers": layers, "max_window_layers": layers, "vision_config": vision}
        vision_layers = vision["depth"]
    else:
        config = config.to_dict()
        text, vision = config["text_config"], config["vision_config"]
        layers = text["num_hidden_layers"] = args.layers or text["num_hidden_layers"]
        text.pop("layer_types", None)  # derived again from the layer count
        vision_layers = vision["num_hidden_layers"] = args.vision_layers or vision["num_hidden_layers"]
        overrides = {"text_config": text, "vision_config": vision}
    return make_random_model(args.model, f"/tmp/random-{args.model}-{layers}-{vision_layers}", args.device,
                             overrides)


def text_bound(config) -> int:
    """The largest token id random text takes: below the model's image tokens."""
    return (config.boi_token_id if config.model_type == "gemma3" else config.vision_start_token_id) - 1


def qwen_grid(config, image_size: int) -> tuple[int, int, int]:
    """The patch grid of a square image of image_size pixels, as Qwen2-VL's processor rounds it."""
    factor = config.vision_config.patch_size * config.vision_config.spatial_merge_size
    side = max(factor, round(image_size / factor) * factor) // config.vision_config.patch_size
    return (1, side, side)


def image_tokens(config, image_size: int) -> list[int]:
    """An image in the prompt: its start marker, a placeholder per soft token, its end marker."""
    if config.model_type == "gemma3":
        return [config.boi_token_id] + [config.image_token_id] * config.mm_tokens_per_image + [config.eoi_token_id]
    count = math.prod(qwen_grid(config, image_size)) // config.vision_config.spatial_merge_size ** 2
    return [config.vision_start_token_id] + [config.image_token_id] * count + [config.vision_end_token_id]


def image_prompt(config, length: int, image_size: int) -> list[int]:
    """Random text of `length` tokens with one image after the first tenth of it."""
    text = [randint(2, text_bound(config)) for _ in range(length)]
    cut = length // 10
    return text[:cut] + image_tokens(config, image_size) + text[cut:]


def pixels_of(config, device: str, image_size: int) -> torch.Tensor:
    """Gemma 3: an image at the tower's resolution [1, 3, S, S]; Qwen2.5-VL: its flattened patches."""
    if config.model_type == "gemma3":
        size = config.vision_config.image_size
        return torch.rand(1, 3, size, size, device=device) * 2 - 1
    vision = config.vision_config
    values = vision.in_channels * vision.temporal_patch_size * vision.patch_size ** 2
    return torch.rand(math.prod(qwen_grid(config, image_size)), values, device=device) * 2 - 1


def prompt_image(config, pixels: torch.Tensor, image_size: int) -> PromptImage:
    if config.model_type == "gemma3":
        return PromptImage.of_pixels(pixels[0].cpu())
    return PromptImage.of_pixels(pixels.cpu(), qwen_grid(config, image_size))


@torch.inference_mode()
def reference_logits(path: str, tokens: list[int], pixels: torch.Tensor, prompt_len: int, device: str,
                     image_size: int):
    """transformers' logits at the evaluated positions, bf16 and fp32."""
    config = AutoConfig.from_pretrained(path)
    ids = torch.tensor([tokens], device=device)
    is_image = ids == config.image_token_id
    if config.model_type == "gemma3":
        model_class, inputs = Gemma3ForConditionalGeneration, {"token_type_ids": is_image.long()}
    else:
        model_class = Qwen2_5_VLForConditionalGeneration
        inputs = {"mm_token_type_ids": is_image.int(),
                  "image_grid_thw": torch.tensor([qwen_grid(config, image_size)], device=device)}
    model = model_class.from_pretrained(path, dtype=torch.bfloat16).to(device).eval()
    bf16 = model(input_ids=ids, **inputs, pixel_values=pixels.bfloat16()).logits[0, prompt_len - 1:-1].float()
    fp32 = model.float()(input_ids=ids, **inputs, pixel_values=pixels.float()).logits[0, prompt_len - 1:-1].float()
    return bf16, fp32


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_to_first_token(llm: LLM, prompt: list[int], image, device: str, repeats: int) -> float:
    """Median seconds to compute the prompt and sample one token, the prefix cache emptied before each run (the
    image, a () -> PromptImage or None, encoded each time)."""
    times = []
    for _ in range(repeats + 1):  # the first run warms up
        llm.core.block_manager.reset_prefix_cache()
        images = [[image()]] if image is not None else None
        synchronize(device)
        started = time.perf_counter()
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), images=images)
        synchronize(device)
        times.append(time.perf_counter() - started)
    return statistics.median(times[1:])


def decode_throughput(llm: LLM, prompts: list[list[int]], image, new: int, device: str) -> float:
    """Output tokens per second of the steps after every prompt has its first token (decode only); image: a
    () -> PromptImage for each prompt's one image, or None."""
    core = llm.core
    core.block_manager.reset_prefix_cache()
    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    seqs = [core.make_sequence(i, prompt, params, images=[image()] if image is not None else ())
            for i, prompt in enumerate(prompts)]
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
    ap.add_argument("--model", default="gemma3-4b", help=f"{' or '.join(RANDOM_MODELS)} (random weights of "
                                                         "bench/models) or a multimodal checkpoint directory")
    ap.add_argument("--image-size", type=int, default=448, help="Qwen2.5-VL: the image's side in pixels")
    ap.add_argument("--layers", type=int, help="the random model's decoder layers (default: its config's)")
    ap.add_argument("--vision-layers", type=int, help="the random model's vision layers (default: its config's)")
    ap.add_argument("--text-len", type=int, default=300, help="text tokens of the prompt, beside its image")
    ap.add_argument("--positions", type=int, default=256, help="teacher-forced positions after the prompt")
    ap.add_argument("--chunk-tokens", type=int, default=512, help="max_num_batched_tokens: the prompt's chunks")
    ap.add_argument("--batch", type=int, default=32, help="requests decoding at once in the throughput runs")
    ap.add_argument("--new", type=int, default=128, help="tokens each of them generates")
    ap.add_argument("--repeats", type=int, default=5, help="time-to-first-token runs (median)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tensor-parallel-size", type=int, default=1, help="the engine's (its encoder runs on rank 0)")
    args = ap.parse_args()
    seed(0)
    torch.manual_seed(0)
    path = random_model(args)
    config = AutoConfig.from_pretrained(path)
    size = args.image_size
    prompt = image_prompt(config, args.text_len, size)
    tokens = prompt + [randint(2, text_bound(config)) for _ in range(args.positions)]
    pixels = pixels_of(config, args.device, size)
    ref, ref32 = reference_logits(path, tokens, pixels, len(prompt), args.device, size)
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    llm = LLM(path, max_num_batched_tokens=args.chunk_tokens, gpu_memory_utilization=0.5, device=args.device,
              max_model_len=len(tokens) + args.new + 1, tensor_parallel_size=args.tensor_parallel_size)
    overlap = llm.core.overlap  # engine_logits turns it off
    ours, _ = engine_logits(llm, tokens, len(prompt), images=[prompt_image(config, pixels, size)])
    llm.core.overlap = overlap
    rows = [("transformers bf16 vs fp32 (noise floor)", *compare(ref, ref32, ref32)),
            (f"engine (chunks of {args.chunk_tokens}) vs bf16", *compare(ours, ref, ref32)),
            (f"engine (chunks of {args.chunk_tokens}) vs fp32", *compare(ours, ref32, ref32))]
    top2 = ref32.topk(2, dim=-1).values
    print(f"{((top2[:, 0] - top2[:, 1]) > MARGIN).sum().item()} of {len(ref32)} positions have a top-2 margin over "
          f"{MARGIN} in the fp32 reference; prompt {len(prompt)} tokens, one image of "
          f"{image_tokens(config, size).count(config.image_token_id)}")
    print(f"{'comparison':48} {'top-1 all':>9} {'decided':>8} {'|dlogp| med':>11} {'|dlogp| max':>11} "
          f"{'widest flip':>11}")
    for name, agree, agree_decided, med, mx, flip in rows:
        print(f"{name:48} {agree:9.4f} {agree_decided:8.4f} {med:11.4f} {mx:11.4f} {flip:11.4f}")
    text_prompt = [randint(2, text_bound(config)) for _ in range(len(prompt))]
    image = functools.partial(prompt_image, config, pixels, size)  # a fresh PromptImage per request
    ttft_image = time_to_first_token(llm, prompt, image, args.device, args.repeats)
    ttft_text = time_to_first_token(llm, text_prompt, None, args.device, args.repeats)
    image_prompts = [image_prompt(config, args.text_len, size) for _ in range(args.batch)]
    text_prompts = [[randint(2, text_bound(config)) for _ in range(len(prompt))] for _ in range(args.batch)]
    rates = [(decode_throughput(llm, image_prompts, image, args.new, args.device),
              decode_throughput(llm, text_prompts, None, args.new, args.device)) for _ in range(DECODE_ROUNDS)]
    rate_image, rate_text = (statistics.median(kind) for kind in zip(*rates))
    print(f"time to first token, {len(prompt)}-token prompt: one image {ttft_image * 1000:.1f} ms, text only "
          f"{ttft_text * 1000:.1f} ms")
    print(f"decode, {args.batch} requests of {len(prompt)} + {args.new} tokens, median of {DECODE_ROUNDS} runs: "
          f"with an image each "
          f"{rate_image:.0f} tok/s, text only {rate_text:.0f} tok/s")


if __name__ == "__main__":
    main()
