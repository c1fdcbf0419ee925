"""M-RoPE positions (Qwen2.5-VL): three position streams per token, temporal, height and width, as transformers'
get_rope_index lays them out.

Text tokens have the three equal, counting on from the token before. An image's tokens, its merged patches in
row-major order over its grid (t, h, w) / merge, sit at (start + frame, start + row, start + column), start being
where the text before it stopped; the text after it goes on from start + max(h, w) / merge. A prompt with images
thus carries its [3, prompt length] positions, and every token after the last image (all decode tokens) sits at
its index + rope_delta in each stream, where rope_delta is what the images saved. Only a prefill step that
computes part of such a prompt needs the three streams (step_rope_positions); every other step runs the ordinary
rotary at index + rope_delta (engine/step_inputs.py).
"""

import numpy as np


def prompt_rope_positions(num_tokens: int, images, merge: int) -> tuple[np.ndarray, int]:
    """The [3, num_tokens] positions of a prompt whose images are placed (engine/images.py: offset, length, grid
    (t, h, w) in patches of which merge x merge make one token), and its rope_delta."""
    positions = np.empty((3, num_tokens), dtype=np.int64)
    cursor = next_position = 0
    for image in sorted(images, key=lambda image: image.offset):
        text = image.offset - cursor
        positions[:, cursor:image.offset] = next_position + np.arange(text)
        next_position += text
        t, h, w = image.grid[0], image.grid[1] // merge, image.grid[2] // merge
        grid = np.stack(np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij")).reshape(3, -1)
        positions[:, image.offset:image.end] = next_position + grid
        next_position += max(h, w)
        cursor = image.end
    positions[:, cursor:] = next_position + np.arange(num_tokens - cursor)
    return positions, next_position - cursor


def step_rope_positions(seqs, starts: list[int], num_tokens: list[int]) -> np.ndarray | None:
    """The [3, T] positions of a step's tokens when it computes part of a prompt with M-RoPE positions (sequences'
    rope_positions); None otherwise (the step's shifted 1D positions serve)."""
    if not any(seq.rope_positions is not None and start < seq.num_prompt_tokens
               for seq, start in zip(seqs, starts)):
        return None
    parts = []
    for seq, start, n in zip(seqs, starts, num_tokens):
        indices = np.arange(start, start + n)
        if seq.rope_positions is None:
            parts.append(np.broadcast_to(indices, (3, n)))
            continue
        in_prompt = max(0, min(start + n, seq.num_prompt_tokens) - start)
        parts.append(seq.rope_positions[:, start:start + in_prompt])
        parts.append(np.broadcast_to(indices[in_prompt:] + seq.rope_delta, (3, n - in_prompt)))
    return np.concatenate(parts, axis=1)
