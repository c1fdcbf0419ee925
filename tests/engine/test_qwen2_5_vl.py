"""Qwen2.5-VL with images through engine.LLM on a tiny random checkpoint: greedy tokens, and the log-probability of
each, equal transformers' generate with one image and with two (of different grids), whole, in chunks that would
split an image, and preempted; a text-only prompt too; the vision transformer equals transformers' on a batch of
images; M-RoPE positions equal transformers' get_rope_index; a different image misses the prefix cache."""
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
from qwen_vl_models import greedy_with_images, image_prompt, random_patches, save_qwen2_5_vl
from safetensors.torch import load_file, save_file
from vision_models import assert_same, generated, graphs_that_hold_no_images

from engine import LLM, PromptRejected, SamplingParams
from engine.images import PromptImage
from engine.mrope import prompt_rope_positions
from models import load_model

NEW = 12
GREEDY = SamplingParams(temperature=0, max_tokens=NEW, logprobs=0)
GRIDS = [(1, 6, 10), (1, 8, 4), (1, 4, 6)]  # 15, 8 and 6 soft tokens; windows of 2 x 2 tokens cut the first two


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen2_5_vl")
    return str(path), save_qwen2_5_vl(path)


@pytest.fixture(scope="module")
def patches():
    return [random_patches(grid, seed) for seed, grid in enumerate(GRIDS)]


@pytest.fixture(scope="module")
def prompts(prompts_of_lengths):
    """(prompt, indices of its images): one image after 10 text tokens; two images; text alone."""
    first, second, third = prompts_of_lengths([24, 20, 18], seed=3, vocab=380)
    return [(image_prompt(first, [10], [GRIDS[0]]), [0]),
            (image_prompt(second, [3, 12], [GRIDS[1], GRIDS[2]]), [1, 2]),
            (third, [])]


@pytest.fixture(scope="module")
def expected(reference, patches, prompts):
    """transformers' greedy tokens and their log-probabilities for each prompt."""
    return [greedy_with_images(reference[1], prompt, [patches[i] for i in indices], [GRIDS[i] for i in indices], NEW)
            for prompt, indices in prompts]


def engine_images(patches, indices) -> list[PromptImage]:
    return [PromptImage.of_pixels(patches[i], GRIDS[i]) for i in indices]


def outputs(llm: LLM, prompts, patches) -> list[tuple[list[int], list[float]]]:
    return generated(llm, [prompt for prompt, _ in prompts],
                     [engine_images(patches, indices) for _, indices in prompts], GREEDY)


def test_vision_transformer_equals_transformers_on_a_batch(reference, patches):
    """Three images of different grids in one batch equal transformers' encoder (no image sees another)."""
    path, model = reference
    encoder = load_model(path, torch.float32, torch.device("cpu")).vision
    with torch.inference_mode():
        expected = model.model.get_image_features(torch.cat(patches), torch.tensor(GRIDS)).pooler_output
        for got, want in zip(encoder.embed_images(patches, GRIDS), expected):
            assert got.shape == want.shape
            assert (got - want).abs().max() < 1e-5 * want.abs().max()  # float32 rounding, at the outputs' scale


def test_rope_positions_equal_transformers(reference, prompts):
    model = reference[1]
    for prompt, indices in prompts[:2]:
        images = [PromptImage(None, key=0, grid=GRIDS[i]) for i in indices]
        llm_images = [image for image in images]
        starts = [i for i, token in enumerate(prompt) if token == model.config.image_token_id
                  and prompt[i - 1] != model.config.image_token_id]
        for image, start, i in zip(llm_images, starts, indices):
            image.offset, image.length = start, GRIDS[i][1] * GRIDS[i][2] // 4
        ids = torch.tensor([prompt])
        want, delta = model.model.get_rope_index(ids, (ids == model.config.image_token_id).int(),
                                                 torch.tensor([GRIDS[i] for i in indices]))
        positions, rope_delta = prompt_rope_positions(len(prompt), llm_images, 2)
        assert positions.tolist() == want[:, 0].tolist()
        assert rope_delta == delta.item()


@pytest.mark.parametrize("engine", [
    {},
    {"max_num_batched_tokens": 16},  # chunks of 16 would end inside the images: they stop before them instead
    {"num_kv_blocks": 6, "block_size": 16},  # the prompts fit, not all of them as they grow: one is preempted
])
def test_greedy_with_images_matches_transformers(reference, patches, prompts, expected, engine):
    llm = LLM(reference[0], dtype="float32", **engine)
    for got, want in zip(outputs(llm, prompts, patches), expected):
        assert_same(got, want)
    if "num_kv_blocks" in engine:
        assert llm.core.scheduler.num_preemptions > 0
    assert llm.core.block_manager.num_free_blocks == llm.core.runner.num_blocks


def test_steps_with_images_run_eagerly(reference, patches, prompts, expected, monkeypatch):
    """A prefill step of a prompt with images (its image rows, its M-RoPE positions) never replays a CUDA graph."""
    llm = LLM(reference[0], dtype="float32")
    graphs_that_hold_no_images(llm.core.runner, monkeypatch)
    for got, want in zip(outputs(llm, prompts[:2], patches), expected[:2]):
        assert_same(got, want)


def test_a_different_image_does_not_hit_the_prefix_cache(reference, patches, prompts, expected):
    """Blocks of 4: the two blocks before the image (its tokens from 11) are shared; from the image's block on,
    only the same image hits. The other image has the same grid: only its pixels differ."""
    path, model = reference
    llm = LLM(path, dtype="float32", block_size=4)
    prompt, _ = prompts[0]
    other = random_patches(GRIDS[0], seed=7)
    manager = llm.core.block_manager
    other_image = greedy_with_images(model, prompt, [other], [GRIDS[0]], NEW)
    for pixels, expected_hits, want in ((patches[0], 0, expected[0]), (other, 8, other_image),
                                        (patches[0], (len(prompt) - 1) // 4 * 4, expected[0])):
        hits = manager.num_hit_tokens
        (got,) = generated(llm, [prompt], [[PromptImage.of_pixels(pixels, GRIDS[0])]], GREEDY)
        assert manager.num_hit_tokens - hits == expected_hits
        assert_same(got, want)


def test_a_checkpoint_in_the_hubs_layout_loads(reference, patches, prompts, expected, tmp_path):
    """The released checkpoints' names (transformers 4: model.layers..., visual...) load as transformers 5's do."""
    path = reference[0]
    shutil.copy(f"{path}/config.json", tmp_path)
    renamed = {name.replace("model.language_model.", "model.").replace("model.visual.", "visual."): tensor
               for name, tensor in load_file(f"{path}/model.safetensors").items()}
    assert any(name.startswith("visual.") for name in renamed)
    save_file(renamed, f"{tmp_path}/model.safetensors")
    (got,) = outputs(LLM(str(tmp_path), dtype="float32"), prompts[:1], patches)
    assert_same(got, expected[0])


def test_images_must_match_their_grids_and_runs(reference, patches, prompts):
    llm = LLM(reference[0], dtype="float32")
    prompt, _ = prompts[0]
    with pytest.raises(ValueError, match="image 0: pixel values of shape"):
        llm.generate([prompt], GREEDY, images=[[PromptImage.of_pixels(patches[0], GRIDS[1])]])
    with pytest.raises(ValueError, match="image 0: an image needs its patch grid"):
        llm.generate([prompt], GREEDY, images=[[PromptImage.of_pixels(patches[0])]])
    with pytest.raises(PromptRejected, match="run of image tokens is 15 long; the model reads 8"):
        llm.generate([prompt], GREEDY, images=[[PromptImage.of_pixels(patches[1], GRIDS[1])]])
    small = LLM(reference[0], dtype="float32", max_num_batched_tokens=8)  # the client's fault: a 400, not a 500
    with pytest.raises(PromptRejected, match="an image is 15 tokens, more than the step budget"):
        small.generate([prompt], GREEDY, images=[[PromptImage.of_pixels(patches[0], GRIDS[0])]])


TRITON_CHECK = textwrap.dedent(
    """
    import sys, torch
    import kernels
    triton_backend = kernels._backend("cuda")
    kernels._backend = lambda device_type: triton_backend
    from qwen_vl_models import greedy_with_images, image_prompt, random_patches, save_qwen2_5_vl
    from engine import LLM, SamplingParams
    from engine.images import PromptImage

    grids = [(1, 6, 10), (1, 8, 4)]
    model = save_qwen2_5_vl(sys.argv[1])
    patches = [random_patches(grid, seed) for seed, grid in enumerate(grids)]
    prompt = image_prompt(list(range(20, 44)), [3, 12], grids)
    expected, _ = greedy_with_images(model, prompt, patches, grids, 6)
    images = [PromptImage.of_pixels(pixels, grid) for pixels, grid in zip(patches, grids)]
    (out,) = LLM(sys.argv[1], dtype="float32").generate([prompt], SamplingParams(temperature=0, max_tokens=6),
                                                        images=[images])
    assert out["token_ids"] == expected, (out["token_ids"], expected)
    """
)


@pytest.mark.slow  # the engine through interpreted Triton kernels
def test_the_triton_kernels_serve_m_rope(tmp_path):
    """The GPU path on the CPU (Triton's interpreter): the prologue reads each prefill row's M-RoPE cos|sin row,
    and the fused decode kernel rotates at the shifted positions it is given."""
    pytest.importorskip("triton")
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([tests, os.path.dirname(tests)])}
    result = subprocess.run([sys.executable, "-c", TRITON_CHECK, str(tmp_path)], env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
