"""Images in prompts: where each image's soft tokens sit, what a step needs to compute them, and the rules that
keep results exact with them.

A prompt holds the model's image token once per soft token of each image, in runs (one run per image, in the
order of the images): a fixed count per image (Gemma 3) or one per merged patch of its grid (Qwen2.5-VL, whose
image tokens also take M-RoPE positions from the grid: engine/mrope.py). The encoder runs once per request, at
the first step that computes part of an image; its soft tokens replace those rows' token embeddings, and, for
Gemma 3, the rows of one image attend to each other both ways (AttentionMetadata.image_spans). So that this needs
no more than one step:
- a prefill chunk never ends inside an image (fit_chunk): it stops before the image, or takes all of its rest;
- a full KV block's prefix-cache hash covers the content of every image that has a token in it or before it
  (image_keys), since those keys depend on the whole image: two prompts with equal tokens and different
  images never share blocks from the first image on.
"""

from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import xxhash
from torch import Tensor

from engine.errors import PromptRejected


@dataclass(eq=False)
class PromptImage:
    """One image of a prompt: its preprocessed pixels (the model's image processor's output: [C, H, W] for
    Gemma 3, Qwen2.5-VL's flattened patches [t * h * w, values] with their grid (t, h, w)) and a hash of both. The
    engine places it (offset, length: its run of image tokens) and computes its soft tokens once (embeds
    [length, hidden]), dropping the pixels then."""

    pixel_values: Tensor | None
    key: int
    offset: int = 0
    length: int = 0
    embeds: Tensor | None = None
    grid: tuple[int, int, int] | None = None

    @classmethod
    def of_pixels(cls, pixel_values: Tensor, grid: tuple[int, int, int] | None = None) -> "PromptImage":
        pixels = pixel_values.contiguous()
        digest = xxhash.xxh3_64(pixels.numpy().tobytes())
        if grid is not None:
            digest.update(np.asarray(grid, dtype=np.int64).tobytes())
        return cls(pixels, digest.intdigest(), grid=None if grid is None else tuple(grid))

    @property
    def end(self) -> int:
        return self.offset + self.length


def image_runs(token_ids: list[int], image_token_id: int) -> list[tuple[int, int]]:
    """(start, end) of each run of image_token_id in the prompt, in order."""
    is_image = np.concatenate(([False], np.asarray(token_ids) == image_token_id, [False]))
    edges = np.flatnonzero(is_image[1:] != is_image[:-1])
    return list(zip(edges[::2].tolist(), edges[1::2].tolist()))


def check_step_budget(lengths: list[int], max_num_batched_tokens: int) -> None:
    """PromptRejected when an image has more soft tokens than a step computes: an image is computed in one step."""
    if lengths and max(lengths) > max_num_batched_tokens:  # a large image at a high max_pixels
        raise PromptRejected(f"an image is {max(lengths)} tokens, more than the step budget "
                             f"max_num_batched_tokens={max_num_batched_tokens}: raise it to serve images")


def place_images(token_ids: list[int], images: list[PromptImage], image_token_id: int, lengths: list[int]) -> None:
    """Sets each image's span from the runs of image_token_id in the prompt; PromptRejected when the runs do not
    match the images one to one, each as long as its soft tokens (lengths)."""
    runs = image_runs(token_ids, image_token_id)
    if len(runs) != len(images):
        raise PromptRejected(f"the prompt has {len(runs)} runs of the image token (id {image_token_id}) but "
                         f"{len(images)} images came with it: each image needs one run")
    for i, ((start, end), image, length) in enumerate(zip(runs, images, lengths)):
        if end - start != length:
            raise PromptRejected(f"image {i}'s run of image tokens is {end - start} long; the model reads "
                             f"{length} soft tokens for it")
        image.offset, image.length = start, end - start


def fit_chunk(images: list[PromptImage], start: int, n: int) -> int:
    """How many of the n tokens from start a step may compute: n, or fewer so as to stop before an image the
    chunk would end inside; 0 when the chunk starts inside or at an image whose rest does not fit in n."""
    end = start + n
    for image in images:
        if image.offset < end < image.end:
            return image.offset - start if image.offset > start else 0
    return n


def image_keys(images: list[PromptImage], block_end: int) -> list[int]:
    """The keys of the images with a token before block_end, for a block's hash (its chain covers the earlier
    blocks' images already, but the first block an image touches must name it, and each later one too: an image's
    keys read the whole image)."""
    return [image.key for image in images if image.offset < block_end]


@dataclass
class StepImages:
    """What a step's forward needs for its image tokens: their rows among the step's tokens and soft tokens
    (the model's image_embeds), and, for a model whose image tokens see each other both ways (the encoder's
    bidirectional_images: Gemma 3, not Qwen2.5-VL), each row's span of key positions (AttentionMetadata.image_spans)."""

    rows: Tensor
    embeds: Tensor | None
    spans: Tensor | None
    embeds_shape: tuple[int, int] | None = None  # where embeds travel apart (the other tensor-parallel ranks)
    embeds_dtype: torch.dtype | None = None

    def __reduce__(self):
        """As sent to the other tensor-parallel ranks: rows and spans on the host, the soft tokens' shape alone
        (rank 0 broadcasts them within the step: ModelRunner.execute)."""
        spans = self.spans.cpu() if self.spans is not None else None
        return StepImages, (self.rows.cpu(), None, spans, tuple(self.embeds.shape), self.embeds.dtype)

    def on(self, device: torch.device) -> "StepImages":
        """These rows on device, with the soft tokens: rank 0's own, or received from rank 0 (a collective:
        every rank calls it in the same step)."""
        embeds = self.embeds
        if embeds is None:
            embeds = torch.empty(self.embeds_shape, dtype=self.embeds_dtype, device=device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast(embeds, src=0)
        spans = self.spans.to(device) if self.spans is not None else None
        return StepImages(self.rows.to(device), embeds, spans)


def step_images(seqs, starts: list[int], num_tokens: list[int], encoder) -> StepImages | None:
    """The image rows of a step whose sequences compute num_tokens tokens from starts (rows and spans on the host,
    StepImages.on moves them); runs the encoder, in one batch, for the images that first appear. None when the
    step has no image token."""
    parts = []  # (image, first row of the step, first token of the image, count)
    row = 0
    for seq, start, n in zip(seqs, starts, num_tokens):
        if start >= seq.num_prompt_tokens:  # decode tokens: no image
            row += n
            continue
        for image in seq.images:
            low, high = max(image.offset, start), min(image.end, start + n)
            if low < high:
                parts.append((image, row + low - start, low - image.offset, high - low))
        row += n
    if not parts:
        return None
    encode_images(list(dict.fromkeys(image for image, *_ in parts if image.embeds is None)), encoder)
    rows = torch.cat([torch.arange(first, first + count) for _, first, _, count in parts])
    embeds = torch.cat([image.embeds[skip:skip + count] for image, _, skip, count in parts])
    if not encoder.bidirectional_images:
        return StepImages(rows, embeds, None)
    spans = torch.zeros(row, 2, dtype=torch.int64)
    for image, first, _, count in parts:
        spans[first:first + count] = torch.tensor([image.offset, image.end])
    return StepImages(rows, embeds, spans)


@torch.inference_mode()
def encode_images(images: list[PromptImage], encoder) -> None:
    """Soft tokens for each image, in one batch through the encoder (its embed_images); the pixels are dropped once
    they have them."""
    if not images:
        return
    weight = next(encoder.parameters())
    pixels = [image.pixel_values.to(weight.device, weight.dtype) for image in images]
    for image, embeds in zip(images, encoder.embed_images(pixels, [image.grid for image in images])):
        image.embeds, image.pixel_values = embeds, None
