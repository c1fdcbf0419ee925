"""A tiny random Qwen2.5-VL checkpoint (vision transformer with windows and a full-attention block, patch merger,
M-RoPE decoder), its processor files with a word-level tokenizer, and transformers' greedy decoding on it with
images (shared by the engine and handler tests; tests/ is on the import path)."""
import math

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

from random_decoders import TINY

VIDEO, VISION_START, VISION_END, IMAGE = 380, 381, 382, 383  # <|video_pad|>, <|vision_start|>, ..., <|image_pad|>
PATCH, MERGE, TEMPORAL = 4, 2, 2
PATCH_VALUES = 3 * TEMPORAL * PATCH * PATCH  # one row of the processor's flattened patches
SPECIAL = {"<|video_pad|>": VIDEO, "<|vision_start|>": VISION_START, "<|vision_end|>": VISION_END,
           "<|image_pad|>": IMAGE, "<|im_end|>": 1, "[UNK]": 0}
TEMPLATE_WORDS = {"<|im_start|>": 2, "user": 4, "assistant": 5, "system": 6}
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|> {{ m.role }} "
    "{% if m.content is string %}{{ m.content }}{% else %}{% for part in m.content %}"
    "{% if part.type == 'image' %}<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ part.text }}{% endif %}"
    "{% endfor %}{% endif %} <|im_end|> {% endfor %}{% if add_generation_prompt %}<|im_start|> assistant {% endif %}")


def qwen2_5_vl_config() -> Qwen2_5_VLConfig:
    """Heads of 16 dimensions, their 8 rotary frequencies split 2 / 3 / 3 among the temporal, height and width
    streams; a vision window of 2 x 2 merged tokens, the middle one of three blocks attending to the whole image."""
    text = {**TINY, "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 1000.0}}
    vision = dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, in_channels=3, patch_size=PATCH,
                  spatial_merge_size=MERGE, temporal_patch_size=TEMPORAL, window_size=PATCH * MERGE * 2,
                  out_hidden_size=TINY["hidden_size"], fullatt_block_indexes=[1])
    return Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=IMAGE, video_token_id=VIDEO,
                            vision_start_token_id=VISION_START, vision_end_token_id=VISION_END,
                            architectures=["Qwen2_5_VLForConditionalGeneration"])


@torch.no_grad()
def save_qwen2_5_vl(path) -> Qwen2_5_VLForConditionalGeneration:
    """A seeded random model saved under `path` (norms and biases drawn too, so that no wrong mapping hides behind
    zeros and ones); returns it in eval mode."""
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(qwen2_5_vl_config())
    for name, param in model.named_parameters():
        if name.endswith("bias") or "norm" in name or "ln_q" in name:
            param.copy_(torch.randn_like(param) * 0.5 + (0.0 if name.endswith("bias") else 1.0))
        else:
            param.copy_(torch.randn_like(param) * 0.3)
    model.save_pretrained(path)
    return model.eval()


def random_patches(grid: tuple[int, int, int], seed: int) -> torch.Tensor:
    """Normalised patches of an image of this grid, as the processor flattens them."""
    return torch.randn(math.prod(grid), PATCH_VALUES, generator=torch.Generator().manual_seed(seed))


def image_tokens(grid: tuple[int, int, int]) -> list[int]:
    return [VISION_START] + [IMAGE] * (math.prod(grid) // MERGE ** 2) + [VISION_END]


def image_prompt(text_ids: list[int], cuts: list[int], grids: list[tuple[int, int, int]]) -> list[int]:
    """text_ids with an image of each grid inserted at each cut."""
    prompt, last = [], 0
    for cut, grid in zip(cuts, grids):
        prompt += text_ids[last:cut] + image_tokens(grid)
        last = cut
    return prompt + text_ids[last:]


@torch.inference_mode()
def greedy_with_images(model, prompt: list[int], patches: list[torch.Tensor], grids: list, max_new_tokens: int
                       ) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens for a prompt with images (their patches and grids, one per run of image
    tokens) and the log-probability of each."""
    ids = torch.tensor([prompt])
    images = {"pixel_values": torch.cat(patches), "image_grid_thw": torch.tensor(grids)} if patches else {}
    out = model.generate(input_ids=ids, mm_token_type_ids=(ids == IMAGE).int(), attention_mask=torch.ones_like(ids),
                         max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False,
                         pad_token_id=0, eos_token_id=None, output_logits=True, return_dict_in_generate=True,
                         **images)
    tokens = out.sequences[0, len(prompt):].tolist()
    return tokens, [torch.log_softmax(logits[0].float(), -1)[t].item() for logits, t in zip(out.logits, tokens)]


def save_processor(path, min_pixels: int = 8 * 8 * 4, max_pixels: int = 32 * 32):
    """A word-level tokenizer over the tiny vocabulary (word i is "w{i}", but for the template's words), the
    Qwen2.5-VL vision tokens as special tokens, a chat template that places an image part as
    <|vision_start|><|image_pad|><|vision_end|>, and the Qwen2-VL image processor with the tiny tower's patches and
    these min and max pixels, saved under `path`; returns (tokenizer, image processor). (The whole
    Qwen2_5_VLProcessor also needs a video processor, which needs torchvision.)"""
    from transformers import PreTrainedTokenizerFast
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    words = {**SPECIAL, **TEMPLATE_WORDS}
    taken = set(words.values())
    vocab = {f"w{i}": i for i in range(TINY["vocab_size"]) if i not in taken} | words
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", unk_token="[UNK]",
                                        chat_template=CHAT_TEMPLATE,
                                        additional_special_tokens=[name for name in SPECIAL if name.startswith("<|")])
    image_processor = Qwen2VLImageProcessorPil(patch_size=PATCH, temporal_patch_size=TEMPORAL, merge_size=MERGE,
                                               min_pixels=min_pixels, max_pixels=max_pixels)
    image_processor.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return tokenizer, image_processor


def processed(tokenizer, image_processor, parts: list[dict], images: list) -> tuple[list[int], dict]:
    """The prompt and image processor outputs for a user message of these parts, as Qwen2_5_VLProcessor makes them:
    the template's prompt, each image's pad token repeated once per merged patch of its grid."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": parts}], tokenize=False,
                                         add_generation_prompt=True)
    inputs = image_processor(images=images, return_tensors="pt")
    pieces = text.split("<|image_pad|>")
    counts = [math.prod(grid) // MERGE ** 2 for grid in inputs["image_grid_thw"].tolist()]
    text = pieces[0] + "".join("<|image_pad|>" * count + piece for count, piece in zip(counts, pieces[1:]))
    return tokenizer.encode(text, add_special_tokens=False), inputs
