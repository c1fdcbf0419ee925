"""A tiny random Gemma 3 multimodal checkpoint (SigLIP tower, projector, decoder), with a word-level tokenizer, a
chat template and the model's processor files, and transformers' greedy decoding on it with images (shared by
the engine and handler tests; tests/ is on the import path)."""
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3TextConfig, SiglipVisionConfig

from random_decoders import TINY

BOI, EOI, IMAGE = 381, 382, 383  # <start_of_image>, <end_of_image>, the soft token's placeholder
TOKENS_PER_IMAGE = 4
IMAGE_SIZE = 56  # 4 x 4 patches of 14, pooled 2 x 2 into the 4 soft tokens
SPECIAL = {"<start_of_image>": BOI, "<end_of_image>": EOI, "<image_soft_token>": IMAGE, "<eos>": 1, "[UNK]": 0}
TEMPLATE_WORDS = {"<start_of_turn>": 2, "<end_of_turn>": 3, "user": 4, "model": 5, "system": 6, "assistant": 7}
CHAT_TEMPLATE = (
    "{% for m in messages %}<start_of_turn> {{ m.role }} "
    "{% if m.content is string %}{{ m.content }}{% else %}{% for part in m.content %}"
    "{% if part.type == 'image' %}<start_of_image>{% else %}{{ part.text }}{% endif %}{% endfor %}{% endif %}"
    " <end_of_turn> {% endfor %}{% if add_generation_prompt %}<start_of_turn> model {% endif %}")


def gemma3_vision_config() -> Gemma3Config:
    """A window (16) longer than an image's soft tokens, around a global layer."""
    text = Gemma3TextConfig(**{**TINY, "num_hidden_layers": 3}, head_dim=32, sliding_window=16,
                            sliding_window_pattern=2, query_pre_attn_scalar=24, rope_theta=1000.0,
                            rope_local_base_freq=50.0)
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                image_size=IMAGE_SIZE, patch_size=14, vision_use_head=False)
    return Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(),
                        mm_tokens_per_image=TOKENS_PER_IMAGE, image_token_index=IMAGE, boi_token_index=BOI,
                        eoi_token_index=EOI, bos_token_id=None, eos_token_id=None, pad_token_id=None,
                        architectures=["Gemma3ForConditionalGeneration"])


@torch.no_grad()
def save_gemma3_vision(path) -> Gemma3ForConditionalGeneration:
    """A seeded random model saved under `path` (norms, biases and the projection drawn too, so that no wrong
    mapping hides behind zeros and ones); returns it in eval mode."""
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(gemma3_vision_config())
    for name, param in model.named_parameters():
        if name.endswith("bias") or "norm" in name:
            param.copy_(torch.randn_like(param) * 0.5 + (0.0 if name.endswith("bias") else 1.0))
        elif "mm_input_projection" in name:
            param.copy_(torch.randn_like(param) * 0.2)
    model.save_pretrained(path)
    return model.eval()


def save_processor(path):
    """A word-level tokenizer over the tiny vocabulary (word i is "w{i}", but for the template's words), the
    Gemma 3 image tokens as special tokens, a chat template that places an image part as <start_of_image>, and
    the Gemma 3 processor (its image processor at the tower's resolution), saved under `path`."""
    # Imported here: the engine tests use this module without a processor, also where transformers is older
    from transformers import Gemma3ImageProcessorPil, Gemma3Processor, PreTrainedTokenizerFast

    words = {**SPECIAL, **TEMPLATE_WORDS}
    taken = set(words.values())
    vocab = {f"w{i}": i for i in range(TINY["vocab_size"]) if i not in taken} | words
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<eos>", unk_token="[UNK]", chat_template=CHAT_TEMPLATE,
        extra_special_tokens={"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                              "image_token": "<image_soft_token>"})
    image_processor = Gemma3ImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    processor = Gemma3Processor(image_processor, tokenizer, chat_template=CHAT_TEMPLATE,
                                image_seq_length=TOKENS_PER_IMAGE)
    processor.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return processor


def image_prompt(text_ids: list[int], *cuts: int) -> list[int]:
    """text_ids with an image (<start_of_image>, its soft tokens, <end_of_image>) inserted at each cut."""
    prompt, last = [], 0
    for cut in cuts:
        prompt += text_ids[last:cut] + [BOI] + [IMAGE] * TOKENS_PER_IMAGE + [EOI]
        last = cut
    return prompt + text_ids[last:]


@torch.inference_mode()
def greedy_with_images(model, prompt: list[int], pixel_values: torch.Tensor, max_new_tokens: int
                       ) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens for a prompt with images (pixel_values [n, 3, H, W], one per run of soft
    tokens) and the log-probability of each."""
    ids = torch.tensor([prompt])
    out = model.generate(input_ids=ids, pixel_values=pixel_values, token_type_ids=(ids == IMAGE).long(),
                         attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0, eos_token_id=None,
                         output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt):].tolist()
    return tokens, [torch.log_softmax(logits[0].float(), -1)[t].item() for logits, t in zip(out.logits, tokens)]


def graphs_that_hold_no_images(runner, monkeypatch) -> None:
    """Gives a CPU runner what a CUDA one has once its warm-up is done: a captured graph for every prefill step's
    size (a decode step runs eagerly here). A graph replays the forward it captured, which has no image rows and no
    M-RoPE positions, so a step with images that picked one would compute wrong tokens: here its replay fails."""
    from engine.cuda_graphs import GraphShape

    def shape_for(num_tokens, as_rows=False):
        total = sum(num_tokens)
        return GraphShape(-(-total // 16) * 16, runner.graphs.max_num_seqs, False) if total > len(num_tokens) else None

    def replay(shape):
        raise AssertionError(f"a step replayed the CUDA graph of {shape}, which holds no image inputs")

    monkeypatch.setattr(runner.graphs, "shape_for", shape_for)
    monkeypatch.setattr(runner.graphs, "replay", replay)


LOGPROB_TOLERANCE = 1e-4


def generated(llm, prompts: list[list[int]], images: list[list], params) -> list[tuple[list[int], list[float]]]:
    """The engine's tokens for each prompt with its images (engine/images.py's PromptImage), and the log-probability
    of each."""
    results = llm.generate(prompts, params, images=images)
    return [(out["token_ids"], [logprob for logprob, *_ in out["logprobs"]]) for out in results]


def assert_same(got, expected) -> None:
    """Equal tokens, and their log-probabilities within LOGPROB_TOLERANCE."""
    (tokens, logprobs), (expected_tokens, expected_logprobs) = got, expected
    assert tokens == expected_tokens
    assert max(abs(a - b) for a, b in zip(logprobs, expected_logprobs)) < LOGPROB_TOLERANCE
